"""Settled tenant usage in the state store: counters per tenant, model and UTC hour, added to
by each ingress replica's sync (INSERT ... ON CONFLICT DO UPDATE col = col + new)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from sqlalchemy import Engine, func, select
from sqlalchemy.dialects import postgresql, sqlite

from splitserve.cluster.state.schema import tenant_usage as u


@dataclass
class UsageCounts:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: UsageCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


COUNTERS = [f.name for f in fields(UsageCounts)]


class SqlUsageStore:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    def add(self, usage: dict[tuple[str, str, int], UsageCounts]) -> None:
        """Adds each (tenant, model, hour start) -> counts, all in one transaction."""
        if not usage:
            return
        stmt = self._insert(u)
        stmt = stmt.on_conflict_do_update(
            index_elements=["tenant", "model", "period_start"],
            set_={name: u.c[name] + stmt.excluded[name] for name in COUNTERS},
        )
        rows = [
            {"tenant": tenant, "model": model, "period_start": period_start, **counts.as_dict()}
            for (tenant, model, period_start), counts in usage.items()
        ]
        with self.engine.begin() as conn:
            conn.execute(stmt, rows)

    def query(self, tenant: str | None, start: int | None, end: int | None) -> list[dict]:
        """Sums per tenant and model over the hours in [start, end) (all when unset)."""
        query = select(u.c.tenant, u.c.model, *(func.sum(u.c[name]).label(name) for name in COUNTERS))
        if tenant:
            query = query.where(u.c.tenant == tenant)
        if start is not None:
            query = query.where(u.c.period_start >= start - start % 3600)
        if end is not None:
            query = query.where(u.c.period_start < end)
        query = query.group_by(u.c.tenant, u.c.model).order_by(u.c.tenant, u.c.model)
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        return [{"tenant": r.tenant, "model": r.model, **{n: int(getattr(r, n)) for n in COUNTERS}} for r in rows]
