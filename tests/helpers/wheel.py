"""Install this checkout the way a user does: build a wheel (not editable), then either
`pip install --no-deps --target DIR` it and run it with an interpreter that has the project's
dependencies but not its editable install, so every `splitserve.*` import can only come from
DIR (on PYTHONPATH) (install_wheel); or install it, dependencies and all but no extras, into a
fresh venv, so a module missing from `[project] dependencies` is missing there too
(install_in_fresh_venv).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
# Never part of a wheel: copying them would only slow the build down.
_NOT_SOURCE = (".venv", ".git", "__pycache__", "build", "dist", "*.egg-info", ".pytest_cache", "results", "*_pb2*")


@dataclass(frozen=True)
class InstalledWheel:
    wheel: Path
    site_dir: Path  # pip install --target
    python: Path  # sees the dependencies (torch, ray, ...) but no splitserve of its own

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        return {**env, "PYTHONPATH": str(self.site_dir), **extra}


def _run(cmd: list[str], cwd: Path, timeout_s: float = 300) -> None:
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def build_wheel(root: Path) -> Path:
    """The wheel of this checkout, built under `root` (a folder outside the repository)."""
    src, dist = root / "src", root / "dist"
    # A copy, so the build's build/ and *.egg-info never land in the checkout.
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    # No build isolation: the build requirements (setuptools, grpcio-tools) are installed.
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        root,
    )
    (wheel,) = dist.glob("splitserve-*.whl")
    return wheel


def install_wheel(root: Path) -> InstalledWheel:
    """Build, install and isolate under `root` (a folder outside the repository)."""
    site_dir, venv = root / "site", root / "venv"
    wheel = build_wheel(root)
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site_dir), str(wheel)], root)
    # A venv whose one .pth line adds this venv's site-packages as a plain path: .pth files
    # there (the editable install's finder among them) are not run, so no splitserve.
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], root)
    python = venv / "bin" / "python"
    purelib = subprocess.check_output(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    Path(purelib, "splitserve-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return InstalledWheel(wheel, site_dir, python)


@dataclass(frozen=True)
class FreshVenv:
    """A venv with only what `pip install splitserve` (no extras) puts there."""

    root: Path

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def env(self) -> dict[str, str]:
        """The environment of a shell with this venv activated, nothing of the checkout's."""
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
        return {**env, "VIRTUAL_ENV": str(self.root), "PATH": f"{self.bin}{os.pathsep}{env.get('PATH', '')}"}


def install_in_fresh_venv(root: Path, wheel: Path) -> FreshVenv:
    """`python -m venv`, then torch first, pinned exactly as pyproject.toml says to (a looser
    spec would pull a CUDA build), then the wheel with its dependencies and no extras."""
    venv = FreshVenv(root / "venv")
    _run([sys.executable, "-m", "venv", str(venv.root)], root)
    # pip byte-compiles what it installs (~10 s here): without it, the server's processes (the
    # CLI, Ray's agents, each replica) all compile torch and ray at once as they start, ~90 s more.
    pip = [str(venv.python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    _run([*pip, "torch==2.13.0"], root, timeout_s=900)
    _run([*pip, str(wheel)], root, timeout_s=900)
    return venv
