"""Run `splitserve serve` as a real subprocess on 127.0.0.1 and stop it by its process group.

It starts where users start it: in a folder outside the repository (the log's folder), so a
module that only imports from the repository root fails here as it would for them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from splitserve.cluster.cli.free_port import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServeProcess:
    def __init__(
        self,
        model: str | None,
        log_path: Path,
        *extra: str,
        startup_timeout_s: float = 240.0,
        python: str | Path = sys.executable,
        env: dict[str, str] | None = None,
        console_script: Path | None = None,
    ):
        """`python -m splitserve.cluster.cli serve MODEL *extra` with cwd = log_path's folder
        (model None: the models are --model flags in extra); `python`/`env` run another
        installation (tests/helpers/wheel.py), `console_script` its `splitserve` instead."""
        cwd = log_path.parent
        if cwd.resolve().is_relative_to(REPO_ROOT):
            raise ValueError(f"start splitserve serve outside the repository, not in {cwd}")
        self.http_port = free_port()
        self.grpc_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.http_port}"
        self.log_path = log_path
        launcher = [str(console_script)] if console_script else [str(python), "-m", "splitserve.cluster.cli"]
        cmd = [
            *launcher,
            "serve",
            *([model] if model is not None else []),
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--num-cpus",
            "6",
            *extra,
        ]
        if not any("grammar.prestart-workers" in flag for flag in extra):
            # Each compile worker starts on its first constrained request: most servers here
            # never get one, and two idle workers per ingress cost ~1.5 CPU-s per server start.
            cmd.append("--no-grammar.prestart-workers")
        if "--state-dir" not in extra and "--state-url" not in extra:
            # Its own state store (batch jobs): never the user's cache, never another test's.
            cmd += ["--state-dir", str(cwd / "state")]
        env = dict(
            env or os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1"
        )
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            cwd=str(cwd),
        )
        self._wait_ready(startup_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"splitserve serve exited early:\n{self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                    if resp.status == 200 and "ready" in self.log_path.read_text():
                        return
            except Exception:
                pass
            # Past readiness a test waits up to one interval more: a tenth of a second, not half.
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"splitserve serve not ready in {timeout_s:.0f} s:\n{self.log_path.read_text()[-4000:]}")

    def stop(self, timeout_s: float = 60.0) -> int:
        """Ctrl-C, as a user would; escalate only if it does not exit in time."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL to the whole process group: no handler runs, nothing is released or written."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.log.close()
        return self.proc.returncode


def shutdown_serve(timeout_s: float = 60.0) -> None:
    """serve.shutdown() on the session's Ray cluster, then wait until Serve's own actors (its
    controller, proxies) are gone: the next `splitserve serve --address` on that cluster must
    not find a proxy of this one that is still being killed (it then fails to start with "the
    actor died ... killed by ray.kill")."""
    from ray import serve

    from splitserve.cluster.control.worker_pool import named_actors

    serve.shutdown()
    deadline = time.monotonic() + timeout_s
    while left := named_actors("serve"):
        if time.monotonic() > deadline:
            raise AssertionError(f"Ray Serve's actors outlived serve.shutdown() by {timeout_s:.0f} s: {left}")
        time.sleep(0.2)
