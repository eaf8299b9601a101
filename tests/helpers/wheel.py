"""Install this checkout the way a user does: build a wheel (not editable), then either
`pip install --no-deps --target DIR` it and run it with an interpreter that has the project's
dependencies but not its editable install, so every `splitserve.*` import can only come from
DIR (on PYTHONPATH) (install_wheel); or install it, dependencies and all but no extras, into a
fresh venv, so a module missing from `[project] dependencies` is missing there too
(install_in_fresh_venv). A session builds the wheel once and the fresh venv at most once, the
venv in the background from the first test of the serial group on (WheelBuilds).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from tests.helpers.installed_closure import dependency_closure, link_into, wheel_requirements

REPO_ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
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


# A build in the background yields the CPU to the tests running meanwhile: it takes what they leave.
BACKGROUND = ("nice", "-n", "19")
# So on a busy machine it may take far longer than in the foreground: its timeout is only a
# safety net against a hung pip, not a bound on how long the build takes.
BACKGROUND_SAFETY_NET_S = 3600.0


def _run(cmd: list[str], cwd: Path, timeout_s: float = 300, background: bool = False) -> None:
    if background:
        cmd, timeout_s = [*BACKGROUND, *cmd], max(timeout_s, BACKGROUND_SAFETY_NET_S)
    res = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    if res.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")


def build_wheel(root: Path, background: bool = False) -> Path:
    """The wheel of this checkout, built under `root` (a folder outside the repository);
    `background`: at the lowest CPU priority."""
    src, dist = root / "src", root / "dist"
    # A copy, so the build's build/ and *.egg-info never land in the checkout.
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
    # No build isolation: the build requirements (setuptools, grpcio-tools) are installed.
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)],
        root,
        background=background,
    )
    (wheel,) = dist.glob("splitserve-*.whl")
    return wheel


def install_wheel(root: Path, wheel: Path) -> InstalledWheel:
    """Install `wheel` (build_wheel's) and isolate it under `root` (a folder outside the repository)."""
    site_dir, venv = root / "site", root / "venv"
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


def install_in_fresh_venv(root: Path, wheel: Path, background: bool = False) -> FreshVenv:
    """`python -m venv`, the wheel's dependency closure (no extras) linked in from this
    environment (tests/helpers/installed_closure.py: what pip would fetch and unpack again), then
    `pip install --no-index` of the wheel, which fails unless every dependency is there;
    `background`: at the lowest CPU priority."""
    venv = FreshVenv(root / "venv")
    _run([sys.executable, "-m", "venv", str(venv.root)], root, background=background)
    purelib = subprocess.check_output(
        [str(venv.python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
    ).strip()
    link_into(dependency_closure(wheel_requirements(wheel)), Path(purelib), venv.python)
    pip = [str(venv.python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-index"]
    _run([*pip, str(wheel)], root, timeout_s=900, background=background)
    return venv


class WheelBuilds:
    """This session's wheel of the checkout and the fresh venv with it, each built at most once
    on a thread of its own (the venv's after the wheel's). start_fresh_venv starts both early,
    at the lowest CPU priority: the venv's ~10 s of links and pip run on what the serial tests before
    its users leave idle. Asked for before a start, a build runs at normal priority.
    `mktemp` is tmp_path_factory.mktemp; a failed build raises in every caller."""

    def __init__(self, mktemp: Callable[[str], Path]):
        self._mktemp = mktemp
        self._lock = threading.Lock()
        self._wheel: Future[Path] | None = None
        self._venv: Future[FreshVenv] | None = None

    def wheel(self) -> Path:
        return self._wheel_build(background=False).result()

    def start_fresh_venv(self) -> None:
        self._fresh_venv_build(background=True)

    def fresh_venv(self) -> FreshVenv:
        return self._fresh_venv_build(background=False).result()

    def _wheel_build(self, background: bool) -> Future[Path]:
        with self._lock:
            if self._wheel is None:
                root = self._mktemp("wheel-build")
                self._wheel = _in_background(lambda: build_wheel(root, background))
            return self._wheel

    def _fresh_venv_build(self, background: bool) -> Future[FreshVenv]:
        wheel = self._wheel_build(background)
        with self._lock:
            if self._venv is None:
                root = self._mktemp("fresh-install")
                self._venv = _in_background(lambda: install_in_fresh_venv(root, wheel.result(), background))
            return self._venv


def _in_background(build: Callable[[], T]) -> Future[T]:
    """build() on a daemon thread (an interrupted session does not wait for its pip)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(build())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="wheel-build", daemon=True).start()
    return future
