"""BatchStore on SQLAlchemy: SQLite (WAL) or Postgres, the same statements for both."""

from __future__ import annotations

import time

from sqlalchemy import Engine, Integer, and_, delete, func, or_, select, true, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite

from splitserve.cluster.state.batch_store import BatchStore
from splitserve.cluster.state.records import (
    FINISHED,
    STATUS_TIMESTAMP,
    UNFINISHED,
    BatchLine,
    BatchRecord,
    FileRecord,
    LineResult,
)
from splitserve.cluster.state.schema import batch_lines, batch_results, batches, files, leases

_FILE_COLUMNS = (
    files.c.id,
    files.c.purpose,
    files.c.filename,
    files.c.bytes,
    files.c.created_at,
    files.c.expires_at,
    files.c.owner,
)


def _owned(table, owner: str | None):
    """The condition that a row is owner's (None: anyone's)."""
    return true() if owner is None else table.c.owner == owner


class SqlBatchStore(BatchStore):
    def __init__(self, engine: Engine):
        self.engine = engine
        # INSERT ... ON CONFLICT DO NOTHING is dialect-specific in SQLAlchemy.
        self._insert = postgresql.insert if engine.dialect.name == "postgresql" else sqlite.insert

    # --- files ---
    def put_file(self, record: FileRecord, content: bytes) -> None:
        with self.engine.begin() as conn:
            conn.execute(files.insert().values(**_file_values(record), content=content))

    def get_file(self, file_id: str, owner: str | None = None) -> FileRecord | None:
        with self.engine.connect() as conn:
            row = conn.execute(select(*_FILE_COLUMNS).where(files.c.id == file_id, _owned(files, owner))).first()
        return FileRecord(*row) if row else None

    def file_content(self, file_id: str, owner: str | None = None) -> bytes | None:
        with self.engine.connect() as conn:
            return conn.execute(select(files.c.content).where(files.c.id == file_id, _owned(files, owner))).scalar()

    def list_files(
        self, purpose: str | None, after: str | None, limit: int, newest_first: bool, owner: str | None = None
    ) -> list[FileRecord]:
        query = select(*_FILE_COLUMNS).where(_owned(files, owner))
        if purpose:
            query = query.where(files.c.purpose == purpose)
        key = tuple_(files.c.created_at, files.c.id)
        with self.engine.connect() as conn:
            if after:
                anchor = conn.execute(select(files.c.created_at, files.c.id).where(files.c.id == after)).first()
                if anchor is not None:
                    query = query.where(key < tuple_(*anchor) if newest_first else key > tuple_(*anchor))
            order = (files.c.created_at.desc(), files.c.id.desc()) if newest_first else (files.c.created_at, files.c.id)
            rows = conn.execute(query.order_by(*order).limit(limit)).all()
        return [FileRecord(*row) for row in rows]

    def delete_file(self, file_id: str, owner: str | None = None) -> bool:
        with self.engine.begin() as conn:
            return conn.execute(delete(files).where(files.c.id == file_id, _owned(files, owner))).rowcount > 0

    # --- batches ---
    def create_batch(self, record: BatchRecord, lines: list[BatchLine]) -> None:
        with self.engine.begin() as conn:
            conn.execute(batches.insert().values(**_batch_values(record)))
            if lines:
                conn.execute(
                    batch_lines.insert(),
                    [
                        {"batch_id": record.id, "line_no": x.line_no, "custom_id": x.custom_id, "body": x.body}
                        for x in lines
                    ],
                )

    def get_batch(self, batch_id: str, owner: str | None = None) -> BatchRecord | None:
        records = self._select_batches(and_(batches.c.id == batch_id, _owned(batches, owner)))
        return records[0] if records else None

    def list_batches(self, after: str | None, limit: int, owner: str | None = None) -> list[BatchRecord]:
        condition = _owned(batches, owner)
        if after:
            with self.engine.connect() as conn:
                anchor = conn.execute(select(batches.c.created_at, batches.c.id).where(batches.c.id == after)).first()
            if anchor is not None:
                condition = and_(condition, tuple_(batches.c.created_at, batches.c.id) < tuple_(*anchor))
        return self._select_batches(condition, newest_first=True, limit=limit)

    def count_batches(self) -> dict[str, int]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(batches.c.status, func.count()).group_by(batches.c.status)).all()
        return {status: count for status, count in rows}

    def unfinished_batches(self) -> list[BatchRecord]:
        return self._select_batches(batches.c.status.in_(UNFINISHED))

    def transition(self, batch_id: str, from_statuses: tuple[str, ...], to_status: str, at: int, **fields) -> bool:
        with self.engine.begin() as conn:
            return self._transition(conn, batch_id, from_statuses, to_status, at, fields)

    def pending_lines(self, batch_id: str, limit: int, skip: frozenset[str] = frozenset()) -> list[BatchLine]:
        done = select(batch_results.c.custom_id).where(batch_results.c.batch_id == batch_id)
        query = select(batch_lines.c.line_no, batch_lines.c.custom_id, batch_lines.c.body).where(
            batch_lines.c.batch_id == batch_id, batch_lines.c.custom_id.not_in(done)
        )
        if skip:
            query = query.where(batch_lines.c.custom_id.not_in(sorted(skip)))
        with self.engine.connect() as conn:
            rows = conn.execute(query.order_by(batch_lines.c.line_no).limit(limit)).all()
        return [BatchLine(*row) for row in rows]

    def record_result(self, batch_id: str, result: LineResult) -> bool:
        return self.record_results(batch_id, [result]) == 1

    def record_results(self, batch_id: str, results: list[LineResult]) -> int:
        new = 0
        with self.engine.begin() as conn:
            for result in results:
                # RETURNING, not rowcount: drivers disagree on rowcount for ON CONFLICT DO NOTHING.
                statement = (
                    self._insert(batch_results)
                    .values(**_result_values(batch_id, result))
                    .on_conflict_do_nothing()
                    .returning(batch_results.c.line_no)
                )
                new += conn.execute(statement).first() is not None
        return new

    def results(self, batch_id: str) -> list[LineResult]:
        columns = (
            batch_results.c.custom_id,
            batch_results.c.line_no,
            batch_results.c.ok,
            batch_results.c.status_code,
            batch_results.c.request_id,
            batch_results.c.body,
            batch_results.c.completion_tokens,
        )
        query = select(*columns).where(batch_results.c.batch_id == batch_id).order_by(batch_results.c.line_no)
        with self.engine.connect() as conn:
            return [LineResult(*row) for row in conn.execute(query).all()]

    def finish_batch(self, batch_id, from_statuses, to_status, at, output, error) -> bool:
        fields = {}
        with self.engine.begin() as conn:
            for name, produced in (("output_file_id", output), ("error_file_id", error)):
                if produced is not None:
                    record, content = produced
                    conn.execute(files.insert().values(**_file_values(record), content=content))
                    fields[name] = record.id
            if not self._transition(conn, batch_id, from_statuses, to_status, at, fields):
                conn.rollback()  # someone else finished it: keep no orphan files
                return False
        return True

    def finished_batches_before(self, created_before: int) -> list[str]:
        query = select(batches.c.id).where(batches.c.status.in_(FINISHED), batches.c.created_at < created_before)
        with self.engine.connect() as conn:
            return list(conn.execute(query).scalars())

    def delete_batch(self, batch_id: str, with_files: bool) -> None:
        with self.engine.begin() as conn:
            row = conn.execute(
                select(batches.c.input_file_id, batches.c.output_file_id, batches.c.error_file_id).where(
                    batches.c.id == batch_id
                )
            ).first()
            if row is None:
                return
            conn.execute(delete(batch_results).where(batch_results.c.batch_id == batch_id))
            conn.execute(delete(batch_lines).where(batch_lines.c.batch_id == batch_id))
            conn.execute(delete(batches).where(batches.c.id == batch_id))
            if with_files:
                conn.execute(delete(files).where(files.c.id.in_([f for f in row if f])))

    # --- leases ---
    def acquire_lease(self, name: str, holder: str, ttl_s: float, now: float) -> bool:
        with self.engine.begin() as conn:
            conn.execute(self._insert(leases).values(name=name, holder="", expires_at=0.0).on_conflict_do_nothing())
            taken = conn.execute(
                update(leases)
                .where(leases.c.name == name, or_(leases.c.holder == holder, leases.c.expires_at < now))
                .values(holder=holder, expires_at=now + ttl_s)
            )
            return taken.rowcount == 1

    def release_lease(self, name: str, holder: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                update(leases).where(leases.c.name == name, leases.c.holder == holder).values(holder="", expires_at=0.0)
            )

    # --- helpers ---
    def _transition(self, conn, batch_id, from_statuses, to_status, at, fields) -> bool:
        values = {"status": to_status, **fields}
        if to_status in STATUS_TIMESTAMP:
            values[STATUS_TIMESTAMP[to_status]] = at
        moved = conn.execute(
            update(batches).where(batches.c.id == batch_id, batches.c.status.in_(from_statuses)).values(**values)
        )
        return moved.rowcount == 1

    def _select_batches(self, condition, newest_first: bool = False, limit: int | None = None) -> list[BatchRecord]:
        counts = (
            select(
                batch_results.c.batch_id,
                func.sum(func.cast(batch_results.c.ok, Integer)).label("completed"),
                func.count().label("done"),
            )
            .group_by(batch_results.c.batch_id)
            .subquery()
        )
        query = select(batches, counts.c.completed, counts.c.done).outerjoin(counts, counts.c.batch_id == batches.c.id)
        if condition is not None:
            query = query.where(condition)
        order = (
            (batches.c.created_at.desc(), batches.c.id.desc()) if newest_first else (batches.c.created_at, batches.c.id)
        )
        query = query.order_by(*order)
        if limit is not None:
            query = query.limit(limit)
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [_batch_record(row) for row in rows]


def _result_values(batch_id: str, result: LineResult) -> dict:
    return {
        "batch_id": batch_id,
        "custom_id": result.custom_id,
        "line_no": result.line_no,
        "ok": result.ok,
        "status_code": result.status_code,
        "request_id": result.request_id,
        "body": result.body,
        "completion_tokens": result.completion_tokens,
        "finished_at": time.time(),
    }


def _file_values(record: FileRecord) -> dict:
    return {
        "id": record.id,
        "purpose": record.purpose,
        "filename": record.filename,
        "bytes": record.bytes,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "owner": record.owner,
    }


def _batch_values(record: BatchRecord) -> dict:
    return {
        "id": record.id,
        "endpoint": record.endpoint,
        "input_file_id": record.input_file_id,
        "completion_window": record.completion_window,
        "status": record.status,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "total": record.total,
        "metadata": record.metadata,
        "errors": record.errors,
        "output_file_id": record.output_file_id,
        "error_file_id": record.error_file_id,
        "owner": record.owner,
    }


def _batch_record(row) -> BatchRecord:
    done, completed = row["done"] or 0, row["completed"] or 0
    return BatchRecord(
        id=row["id"],
        endpoint=row["endpoint"],
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        created_at=row["created_at"],
        expires_at=row["expires_at"],
        total=row["total"],
        metadata=row["metadata"],
        errors=row["errors"],
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        timestamps={column: row[column] for column in STATUS_TIMESTAMP.values()},
        completed=int(completed),
        failed=int(done) - int(completed),
        owner=row["owner"],
    )
