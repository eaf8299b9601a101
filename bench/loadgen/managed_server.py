"""ManagedServer: start a server command in its own process group, wait until it is healthy,
and stop it by its process group (SIGINT, then SIGTERM, then SIGKILL, each after a timeout)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from splitserve.bench import require_extra

psutil = require_extra("psutil")

HEALTH_PATHS = ("/health", "/v1/models")
_LOG_TAIL_CHARS = 2000
# The shell runs with SIGINT at its default action. A process started with SIGINT ignored (a
# background job of a non-interactive shell, `nohup ... &`) passes that on across exec, and a
# server that inherits it never sees stop()'s SIGINT: it then lingers until the SIGTERM
# stop_timeout_s later, skipping its graceful shutdown. Only a disposition set before exec
# reaches the shell (a shell cannot trap a signal ignored on entry), hence this small exec.
_SHELL_WITH_DEFAULT_SIGINT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv('/bin/sh', ['/bin/sh', '-c', sys.argv[1]])"
)


class ServerStartError(RuntimeError):
    """The server command exited, or did not answer a health check before the timeout."""


def find_free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _group_has_live_members(pgid: int) -> bool:
    """True while a non-zombie process is in the group (zombies of reparented children can
    linger unreaped and must not count)."""
    for process in psutil.process_iter(["status"]):
        try:
            if os.getpgid(process.pid) == pgid and process.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except ProcessLookupError:  # exited since the listing
            continue
    return False


class ManagedServer:
    def __init__(
        self,
        command_template: str,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 600.0,
        stop_timeout_s: float = 30.0,
        log_path: str | Path | None = None,
        health_paths: tuple[str, ...] = HEALTH_PATHS,
    ) -> None:
        if not (startup_timeout_s > 0 and stop_timeout_s > 0):
            raise ValueError("startup and stop timeouts must be > 0")
        self.command_template = command_template
        self.host = host
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.health_paths = health_paths
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def base_url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> str:
        # str.replace, not str.format: commands may carry literal braces (JSON flags).
        port = "" if self.port is None else str(self.port)
        return self.command_template.replace("{port}", port).replace("{host}", self.host)

    def __enter__(self) -> ManagedServer:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> str:
        """Launch the command on a free port and block until healthy; returns the base URL."""
        if self.process is not None:
            raise RuntimeError("server already started")
        self.port = find_free_port(self.host)
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SHELL_WITH_DEFAULT_SIGINT, self.command],
            stdin=subprocess.DEVNULL,
            stdout=self._log if self._log is not None else subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stop() signals the whole tree
        )
        try:
            self.wait_until_healthy()
        except BaseException:
            self.stop()
            raise
        return self.base_url

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(base_url=self.base_url, timeout=2.0) as http:
            while True:
                if self.process.poll() is not None:
                    raise ServerStartError(
                        f"server exited with code {self.process.returncode} before becoming healthy: "
                        f"{self.command}\n{self.log_tail()}"
                    )
                for path in self.health_paths:
                    try:
                        if http.get(path).status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"no healthy answer on {self.base_url}{list(self.health_paths)} within "
                        f"{self.startup_timeout_s:g}s: {self.command}\n{self.log_tail()}"
                    )
                time.sleep(0.2)

    def log_tail(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        if self._log is not None:
            self._log.flush()
        return self.log_path.read_bytes()[-_LOG_TAIL_CHARS:].decode(errors="replace")

    def stop(self) -> int | None:
        """Signal the process group (SIGINT, SIGTERM, SIGKILL, each given stop_timeout_s to take
        effect) and reap the leader; returns its exit code. Safe to call twice."""
        if self.process is None:
            return None
        pgid = self.process.pid  # start_new_session made the leader's pid the group id
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            if not self._group_alive(pgid):
                break
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            self._wait_group_exit(pgid, self.stop_timeout_s if sig != signal.SIGKILL else 10.0)
        try:
            self.process.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            pass
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.process.returncode

    def _group_alive(self, pgid: int) -> bool:
        self.process.poll()  # reap the leader so it does not linger as a zombie
        return _group_has_live_members(pgid)

    def _wait_group_exit(self, pgid: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
