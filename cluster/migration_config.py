"""MigrationConfig: how streams outlive their decode replica (cluster/ingress/stream_migration.py).
ServeConfig nests it as `migration`, so its CLI flag (--migration.max-attempts), the YAML file
and the Helm schema derive from it."""

from __future__ import annotations

from pydantic import Field

from splitserve.cluster.pool_config import StrictConfig


class MigrationConfig(StrictConfig):
    max_attempts: int = Field(3, ge=0)
    """Times one stream may move to another decode replica after its own failed mid-stream (0: never; the stream then ends with an error, as a request with `migration: false` does)."""
    migrate_after_s: float | None = Field(None, ge=0)
    """A draining decode replica (scale-down, rollout, SIGTERM) hands the streams it still runs after this many seconds to other replicas, each continued exactly (0: at once; unset: the drain waits for them, up to its timeout). Requests that sent no token yet are retried elsewhere."""
