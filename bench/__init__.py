"""splitserve benchmarks: an OpenAI-compatible load generator (`splitserve bench`) and router
microbenchmarks. Importing this package imports nothing heavy.

The benchmarks' own dependencies (matplotlib, tqdm, psutil) come with the `bench` extra, not with
the server: modules import them through require_extra, which names the extra when one is missing.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

INSTALL_HINT = "pip install 'splitserve[bench]'"
# The committed write-ups (bench/results/), where the benchmarks in the folders below write by default.
RESULTS_DIR = Path(__file__).resolve().parent / "results"


class MissingBenchDependency(ImportError):
    """A benchmark dependency is not installed (the `bench` extra is missing)."""


def require_extra(module_name: str) -> ModuleType:
    """Import a dependency of the `bench` extra; when it is absent, say how to install it."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = module_name.partition(".")[0]
        if exc.name is None or exc.name.partition(".")[0] != top:
            raise  # something the dependency itself imports is missing: not ours to explain
        raise MissingBenchDependency(
            f"the splitserve benchmarks need {top}, which is not installed: {INSTALL_HINT}", name=top
        ) from exc


def source_commit() -> str:
    """'Commit: <sha>' of the checkout the benchmark runs from, for the header of a committed
    result; '(with uncommitted changes)' when tracked files differ from it."""
    import subprocess

    def git(*args: str) -> str:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout

    try:
        commit = git("rev-parse", "--short", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.CalledProcessError):
        return "Commit: unknown (not run from a git checkout)"
    return f"Commit: {commit}" + (" (with uncommitted changes)" if dirty else "")


def cpu_model() -> str:
    """The CPU's marketing name, for the machine line of a committed result: psutil has no call
    for it, so Linux's cpuinfo is read (elsewhere, what the platform module knows)."""
    import platform

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
