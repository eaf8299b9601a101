"""The shared authority over tenant capacity: leases in the state store (SQLite or Postgres).

An ingress replica spends capacity it has leased, locally, and comes here only when its lease
runs out (a new chunk) and on its sync tick (renew, report what it spent). Granting reads every
holder's row of the window under a lock (BEGIN IMMEDIATE on SQLite, an advisory transaction
lock on Postgres), so two replicas can never lease the same capacity: the sum of leases never
exceeds the limit. A replica that dies stops renewing; once its lease expires, its unspent
capacity returns and only what it spent (as last reported) still counts.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from sqlalchemy import Engine, and_, delete, func, select, text
from sqlalchemy.dialects import postgresql, sqlite

from splitserve.cluster.state.schema import quota_leases as q

# Rows of windows that ended this long ago are deleted on renew (their counts no longer matter).
_KEEP_ENDED_S = 3600


@dataclass(frozen=True)
class WindowKey:
    tenant: str
    kind: str
    window_start: int
    window_end: int


@dataclass
class Grant:
    leased: float  # this holder's lease in the window after the call (it includes spent)
    others: float  # capacity the other holders have committed (spent, plus unexpired unspent)


class SqlQuotaAuthority:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._postgres = engine.dialect.name == "postgresql"
        self._insert = postgresql.insert if self._postgres else sqlite.insert

    def acquire(
        self, key: WindowKey, holder: str, spent: float, want: float, limit: float, now: float, ttl: float
    ) -> Grant:
        """Lease up to `want` more than `spent` (capped so all holders stay within limit);
        the caller checks whether that covers what it needs."""
        with self.engine.begin() as conn:
            if self._postgres:
                lock = zlib.crc32(f"{key.tenant}\0{key.kind}\0{key.window_start}".encode())
                conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock})
            others = self._others(conn, key, holder, now)
            leased = max(spent, min(spent + want, limit - others))
            self._upsert(conn, key, holder, leased, spent, now + ttl)
        return Grant(leased, others)

    def renew(self, holder: str, rows: dict[WindowKey, tuple[float, float]], now: float, ttl: float) -> dict:
        """Records (leased, spent) of each held window and extends its lease; returns each
        window's capacity committed by the other holders. One transaction, two statements
        (a batched upsert, one select of the other holders' rows), however many tenants."""
        if not rows:
            return {}
        others = dict.fromkeys(rows, 0.0)
        by_id = {(k.tenant, k.kind, k.window_start): k for k in rows}
        with self.engine.begin() as conn:
            conn.execute(
                self._upsert_statement(keep_larger_lease=True),
                [_row(key, holder, leased, spent, now + ttl) for key, (leased, spent) in rows.items()],
            )
            starts = sorted({k.window_start for k in rows})
            query = select(q.c.tenant, q.c.kind, q.c.window_start, q.c.leased, q.c.spent, q.c.expires_at).where(
                q.c.holder != holder, q.c.window_start.in_(starts)
            )
            for tenant, kind, start, leased, spent, expires_at in conn.execute(query):
                key = by_id.get((tenant, kind, start))
                if key is not None:
                    others[key] += spent + (max(leased - spent, 0.0) if expires_at > now else 0.0)
            conn.execute(delete(q).where(q.c.window_end < now - _KEEP_ENDED_S))
        return others

    def release(self, holder: str, rows: dict[WindowKey, tuple[float, float]], now: float) -> None:
        """A replica leaving: its unspent capacity returns now; its spending stays counted."""
        with self.engine.begin() as conn:
            for key, (_, spent) in rows.items():
                self._upsert(conn, key, holder, spent, spent, now)

    def committed(self, key: WindowKey, now: float) -> float:
        with self.engine.connect() as conn:
            return self._others(conn, key, None, now)

    def _others(self, conn, key: WindowKey, holder: str | None, now: float) -> float:
        where = and_(q.c.tenant == key.tenant, q.c.kind == key.kind, q.c.window_start == key.window_start)
        if holder is not None:
            where = and_(where, q.c.holder != holder)
        total = 0.0
        for leased, spent, expires_at in conn.execute(select(q.c.leased, q.c.spent, q.c.expires_at).where(where)):
            total += spent + (max(leased - spent, 0.0) if expires_at > now else 0.0)
        return total

    def _upsert(self, conn, key: WindowKey, holder: str, leased: float, spent: float, expires_at: float) -> None:
        conn.execute(self._upsert_statement(), [_row(key, holder, leased, spent, expires_at)])

    def _upsert_statement(self, keep_larger_lease: bool = False):
        """keep_larger_lease: a renewal never shrinks a lease in the store (its snapshot may
        predate a refill whose caller was cancelled); only release returns capacity."""
        stmt = self._insert(q)
        values = {name: stmt.excluded[name] for name in ("leased", "spent", "expires_at")}
        if keep_larger_lease:
            larger = func.greatest if self._postgres else func.max  # SQLite's max(a, b) is scalar
            values["leased"] = larger(q.c.leased, stmt.excluded.leased)
        return stmt.on_conflict_do_update(index_elements=["tenant", "kind", "window_start", "holder"], set_=values)


def _row(key: WindowKey, holder: str, leased: float, spent: float, expires_at: float) -> dict:
    return {
        "tenant": key.tenant,
        "kind": key.kind,
        "window_start": key.window_start,
        "window_end": key.window_end,
        "holder": holder,
        "leased": leased,
        "spent": spent,
        "expires_at": expires_at,
    }
