"""The committed benchmark write-ups stay usable: each states its command and the commit it
measured, names modules that exist, and links only to files that are in git (not to the raw
output that .gitignore keeps out)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = REPO_ROOT / "bench"
WRITE_UPS = sorted((BENCH_DIR / "results").glob("*.md"))
LINKING_DOCS = [BENCH_DIR / "README.md", *sorted((BENCH_DIR / "results").rglob("*.md"))]
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_COMMIT = re.compile(r"\b(?:Commit:|commit|HEAD) [0-9a-f]{7,40}\b")
_MODULE_RUN = re.compile(r"python -m ([\w.]+)")
_SCRIPT = re.compile(r"\bbench/results/[\w./-]+\.sh\b")


def _ignored(path: Path) -> bool:
    if shutil.which("git") is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout: cannot ask .gitignore")
    return subprocess.run(["git", "-C", str(REPO_ROOT), "check-ignore", "-q", str(path)]).returncode == 0


def test_there_are_write_ups():
    assert len(WRITE_UPS) >= 7


@pytest.mark.parametrize("path", WRITE_UPS, ids=lambda path: path.name)
def test_write_up_states_its_command_and_commit(path):
    text = path.read_text(encoding="utf-8")
    assert "```" in text or "Command" in text, f"{path.name}: no command"
    assert _COMMIT.search(text), f"{path.name}: no 'Commit: <sha>' (or 'commit <sha>' / 'HEAD <sha>')"


@pytest.mark.parametrize("path", WRITE_UPS, ids=lambda path: path.name)
def test_write_up_commands_name_modules_and_scripts_that_exist(path):
    text = path.read_text(encoding="utf-8")
    for module in _MODULE_RUN.findall(text):
        if module.startswith("vllm."):
            continue  # runs in vLLM's own venv
        assert importlib.util.find_spec(module) is not None, f"{path.name}: `python -m {module}` does not exist"
    for script in _SCRIPT.findall(text):
        assert (REPO_ROOT / script).is_file(), f"{path.name}: {script} does not exist"


@pytest.mark.parametrize("path", LINKING_DOCS, ids=lambda path: str(path.relative_to(BENCH_DIR)))
def test_links_resolve_to_files_kept_in_git(path):
    for target in _LINK.findall(path.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "#", "mailto:")):
            continue
        resolved = (path.parent / target.split("#", 1)[0]).resolve()
        assert resolved.exists(), f"{path.relative_to(REPO_ROOT)} links to missing {target}"
        assert not _ignored(resolved), f"{path.relative_to(REPO_ROOT)} links to {target}, which is not in git"


def test_raw_output_is_ignored_at_any_depth():
    results = BENCH_DIR / "results"
    raw_output = (
        "x.server.log",
        "a/b/x.server.log",
        "results.json",
        "a/rep0-x/results.json",
        "a/rep0-x/latency_cdf.png",  # per-run plots: the write-up keeps its own summary plot
        "a/rep0-x/slo_attainment.png",
        "a/b/none.spec_metrics.json",
    )
    for raw in raw_output:
        assert _ignored(results / raw), raw
    for kept in ("a/rep0-x/results.md", "a/rep0-x.cpu.md", "a/run.sh", "x.md", "x.png"):
        assert not _ignored(results / kept), kept


def test_readme_indexes_every_bench_module():
    modules_section = (BENCH_DIR / "README.md").read_text(encoding="utf-8").split("## Modules", 1)[1]
    modules_section = modules_section.split("\n## ", 1)[0]
    modules = [path.name for path in sorted(BENCH_DIR.glob("*.py")) if path.name != "__init__.py"]
    missing = [name for name in modules if f"`{name}`" not in modules_section]
    assert missing == [], f"bench/README.md's Modules table does not name {missing}"
