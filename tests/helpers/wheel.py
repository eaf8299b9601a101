"""Install this checkout the way a user does: build a wheel (not editable), `pip install
--no-deps --target DIR` it, and run it with an interpreter that has the project's
dependencies but not its editable install, so every `splitserve.*` import can only come
from DIR (on PYTHONPATH).
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


def install_wheel(root: Path) -> InstalledWheel:
    """Build, install and isolate under `root` (a folder outside the repository)."""
    src, dist, site_dir, venv = root / "src", root / "dist", root / "site", root / "venv"
    # A copy, so the build's build/ and *.egg-info never land in the checkout.
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    # No build isolation: the build requirements (setuptools, grpcio-tools) are installed.
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        root,
    )
    (wheel,) = dist.glob("splitserve-*.whl")
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
