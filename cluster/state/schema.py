"""The state store's tables, one SQLAlchemy MetaData for SQLite and Postgres.

A feature that keeps state adds its tables to `metadata` in its own module and imports that
module before `create_schema` runs (cluster/state/database.py imports the ones here).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DefaultClause,
    Engine,
    Float,
    ForeignKey,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    inspect,
    text,
)

metadata = MetaData()
# Serialises schema creation across processes that start at once (Postgres advisory lock key).
_SCHEMA_LOCK_KEY = 0x5370_6C69  # "Spli"

# Uploaded files and the files the batch runner writes (purpose batch / batch_output).
files = Table(
    "files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("purpose", String(32), nullable=False),
    Column("filename", Text, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("created_at", BigInteger, nullable=False, index=True),
    Column("expires_at", BigInteger, nullable=True),
    Column("content", LargeBinary, nullable=False),
    # The tenant whose key uploaded it (a batch's output and error files: the batch's owner); ""
    # without tenants. Another owner's file is answered as one that does not exist.
    Column("owner", String(64), nullable=False, server_default="", index=True),
)

# One batch job; status moves only by compare-and-set (SqlBatchStore.transition).
batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("created_at", BigInteger, nullable=False, index=True),
    Column("expires_at", BigInteger, nullable=False),
    Column("in_progress_at", BigInteger),
    Column("finalizing_at", BigInteger),
    Column("completed_at", BigInteger),
    Column("failed_at", BigInteger),
    Column("expired_at", BigInteger),
    Column("cancelling_at", BigInteger),
    Column("cancelled_at", BigInteger),
    Column("output_file_id", String(64)),
    Column("error_file_id", String(64)),
    Column("total", Integer, nullable=False),
    Column("metadata", JSON),
    Column("errors", JSON),
    # The tenant whose key created it; its lines run as that tenant (files.owner's rules).
    Column("owner", String(64), nullable=False, server_default="", index=True),
)

# The input lines of a batch, copied in at create (the input file may be deleted later).
batch_lines = Table(
    "batch_lines",
    metadata,
    Column("batch_id", String(64), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
    Column("line_no", Integer, primary_key=True),
    Column("custom_id", Text, nullable=False),
    Column("body", JSON, nullable=False),
)

# One result per (batch, custom_id): the primary key makes a second write of the same line a
# no-op, so a line run twice (its runner died after the request, before or after the write)
# still appears exactly once in the output or error file.
batch_results = Table(
    "batch_results",
    metadata,
    Column("batch_id", String(64), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
    Column("custom_id", Text, primary_key=True),
    Column("line_no", Integer, nullable=False),
    Column("ok", Boolean, nullable=False),
    Column("status_code", Integer, nullable=False),
    Column("request_id", String(64), nullable=False),
    Column("body", JSON, nullable=False),
    Column("completion_tokens", Integer, nullable=False, default=0),
    Column("finished_at", Float, nullable=False),
)

# Named leases: at most one holder at a time does a job (e.g. runs batches); a holder that
# dies stops renewing and another takes over once expires_at (epoch seconds) passes.
leases = Table(
    "leases",
    metadata,
    Column("name", String(64), primary_key=True),
    Column("holder", Text, nullable=False),
    Column("expires_at", Float, nullable=False),
)

# Tenant capacity leased by ingress replicas (cluster/tenants/sql_quota_authority.py): per
# tenant, limit kind (requests/tokens per minute, budget) and window, what each replica holds
# (leased) and has used of it (spent). An expired lease counts only what was spent.
quota_leases = Table(
    "quota_leases",
    metadata,
    Column("tenant", String(64), primary_key=True),
    Column("kind", String(16), primary_key=True),
    Column("window_start", BigInteger, primary_key=True),
    Column("holder", String(128), primary_key=True),
    Column("window_end", BigInteger, nullable=False, index=True),
    Column("leased", Float, nullable=False),
    Column("spent", Float, nullable=False),
    Column("expires_at", Float, nullable=False),
)

# Settled usage per tenant, model and hour (period_start: epoch seconds of the UTC hour).
tenant_usage = Table(
    "tenant_usage",
    metadata,
    Column("tenant", String(64), primary_key=True),
    Column("model", String(256), primary_key=True),
    Column("period_start", BigInteger, primary_key=True),
    Column("requests", BigInteger, nullable=False, default=0),
    Column("errors", BigInteger, nullable=False, default=0),
    Column("prompt_tokens", BigInteger, nullable=False, default=0),
    Column("cached_tokens", BigInteger, nullable=False, default=0),
    Column("completion_tokens", BigInteger, nullable=False, default=0),
)


def create_schema(engine: Engine) -> None:
    """Creates every missing table, and every missing column of a table a previous version
    created, under a lock, so processes starting together do not race."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _SCHEMA_LOCK_KEY})
        metadata.create_all(conn, checkfirst=True)
        _add_missing_columns(conn)


def _add_missing_columns(conn) -> None:
    """A store written before a column existed gets it with its server default (e.g. files and
    batches from before ownership belong to the owner "", the deployment without tenants)."""
    inspector = inspect(conn)
    for table in metadata.sorted_tables:
        present = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            server_default = column.server_default
            if not isinstance(server_default, DefaultClause) and not column.nullable:
                raise RuntimeError(f"the state store's {table.name} lacks {column.name}, which has no default")
            kind = column.type.compile(dialect=conn.dialect)
            default = f" DEFAULT '{server_default.arg}'" if isinstance(server_default, DefaultClause) else ""
            null = "" if column.nullable else " NOT NULL"
            conn.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}{default}{null}'))
            if column.index:
                conn.execute(text(f"CREATE INDEX ix_{table.name}_{column.name} ON {table.name} ({column.name})"))
