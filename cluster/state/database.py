"""Opens the state store's database: SQLite in WAL mode under state_dir, or any SQLAlchemy URL.

Every write is one transaction, so a process killed at any point leaves the store as it was
before or after that transaction, never between. SQLite transactions start with BEGIN IMMEDIATE:
a writer takes the write lock up front instead of failing to upgrade a read lock when another
process (another ingress replica on the node, the controller) writes at the same time.
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url

from splitserve.cluster.state.schema import create_schema

CACHE_ENV = "SPLITSERVE_CACHE"  # the splitserve cache root (engine/builtin_models/model_cache.py)
SQLITE_FILE = "state.db"
# How long a SQLite writer waits for another process's write lock before failing.
SQLITE_BUSY_TIMEOUT_MS = 30_000


def default_state_dir() -> Path:
    """$SPLITSERVE_CACHE/state, default ~/.cache/splitserve/state (beside the model cache)."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "splitserve")) / "state"


def state_database_url(state_dir: str | os.PathLike | None = None, state_url: str | None = None) -> str:
    """The store's SQLAlchemy URL: state_url when given, else SQLite in state_dir (or its default)."""
    if state_url:
        return state_url
    directory = Path(state_dir) if state_dir else default_state_dir()
    return f"sqlite:///{directory / SQLITE_FILE}"


def open_state_engine(url: str) -> Engine:
    """An Engine on url with the schema created (idempotent; safe from several processes at once).
    A bad URL or an unreachable database raises here, at start-up, not at the first request."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed)
    else:
        engine = create_engine(parsed, pool_pre_ping=True, future=True)
    create_schema(engine)
    return engine


def _sqlite_engine(parsed) -> Engine:
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, future=True)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection, _record):
        # The driver must not open transactions on its own: "begin" below does, IMMEDIATE.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode loses nothing when a process is killed (only on power loss).
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection):
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine
