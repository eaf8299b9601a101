"""A throwaway Postgres server for tests: Debian's `postgresql` binaries (initdb, pg_ctl) in a temp dir.

initdb refuses to run as root, so as root the cluster belongs to the `postgres` user the Debian
package creates (commands run through `runuser`). The server listens on 127.0.0.1 on a free
port and on a socket in its own directory, trusts local connections, and is stopped by its PID.
Without the binaries the tests skip, naming the package -- unless SPLITSERVE_REQUIRE_POSTGRES=1
(.ci/run sets it), where that is a failure.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from splitserve.cluster.cli.free_port import free_port

REQUIRE_ENV = "SPLITSERVE_REQUIRE_POSTGRES"
START_TIMEOUT_S = 120  # a safety net only: a quiet machine starts it in about a second


def postgres_bin_dir() -> Path | None:
    """The directory holding initdb and pg_ctl (Debian keeps them out of PATH), or None."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent  # /usr/local/bin may hold links to a few of them
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    return Path(candidates[-1]).parent if candidates else None


def skip_or_fail_without_postgres() -> Path:
    bin_dir = postgres_bin_dir()
    if bin_dir is None:
        reason = "Postgres binaries (initdb, pg_ctl) not found: apt-get install postgresql"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{reason}; {REQUIRE_ENV}=1 requires them", pytrace=False)
        pytest.skip(reason)
    return bin_dir


class PostgresServer:
    """One Postgres cluster in a temp dir; `url` is its SQLAlchemy URL (psycopg driver)."""

    def __init__(self, bin_dir: Path):
        self.bin_dir = bin_dir
        self.root = Path(tempfile.mkdtemp(prefix="splitserve-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            shutil.chown(self.root, self.user)
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://splitserve@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> subprocess.CompletedProcess:
        command = [str(self.bin_dir / args[0]), *args[1:]]
        if self.user:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=True)

    def start(self) -> PostgresServer:
        self._run("initdb", "-D", str(self.data), "-U", "splitserve", "--auth=trust", "-E", "UTF8", "--no-sync")
        options = f"-h 127.0.0.1 -p {self.port} -k {self.root} -c fsync=off -c max_connections=50"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start")
        self.pid = int((self.data / "postmaster.pid").read_text().split()[0])
        return self

    def stop(self) -> None:
        """SIGINT (fast shutdown) to the postmaster by PID, then remove the directory."""
        if self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGINT)
                deadline = time.monotonic() + START_TIMEOUT_S
                while time.monotonic() < deadline:
                    os.kill(self.pid, 0)
                    time.sleep(0.05)
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.pid = None
        shutil.rmtree(self.root, ignore_errors=True)
