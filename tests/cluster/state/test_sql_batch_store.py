"""The state store on SQLite (WAL) and on a real Postgres server: every call is one transaction,
results are written once per custom_id, leases pass on expiry, and a writer killed mid-way
leaves nothing half-written."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from splitserve.cluster.state.database import default_state_dir, open_state_engine, state_database_url
from splitserve.cluster.state.records import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    FINALIZING,
    IN_PROGRESS,
    UNFINISHED,
    VALIDATING,
    BatchLine,
    BatchRecord,
    FileRecord,
    LineResult,
)
from splitserve.cluster.state.schema import batch_lines, batch_results
from splitserve.cluster.state.sql_batch_store import SqlBatchStore
from tests.helpers import state_writer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def store(state_url):
    engine = open_state_engine(state_url)
    yield SqlBatchStore(engine)
    engine.dispose()


def _batch(batch_id: str, created_at: int, total: int, status: str = VALIDATING) -> BatchRecord:
    return BatchRecord(batch_id, "/v1/completions", "file-in", "24h", status, created_at, created_at + 86400, total)


def _lines(n: int) -> list[BatchLine]:
    return [BatchLine(i, f"c{i}", {"prompt": f"p{i}", "max_tokens": 4}) for i in range(n)]


def _result(line: BatchLine, ok: bool = True) -> LineResult:
    return LineResult(line.custom_id, line.line_no, ok, 200 if ok else 400, f"r{line.line_no}", {"i": line.line_no})


def test_files_round_trip_page_and_delete(store):
    for i in range(5):
        store.put_file(FileRecord(f"file-{i}", "batch", f"in{i}.jsonl", 3, 1000 + i), b"abc")
    store.put_file(FileRecord("file-out", "batch_output", "out.jsonl", 2, 2000), b"zz")
    assert store.get_file("file-2") == FileRecord("file-2", "batch", "in2.jsonl", 3, 1002)
    assert store.file_content("file-out") == b"zz"
    first = store.list_files("batch", None, 2, newest_first=True)
    assert [f.id for f in first] == ["file-4", "file-3"]
    rest = store.list_files("batch", first[-1].id, 10, newest_first=True)
    assert [f.id for f in rest] == ["file-2", "file-1", "file-0"]
    assert [f.id for f in store.list_files(None, "file-4", 10, newest_first=False)] == ["file-out"]
    assert store.delete_file("file-2") and not store.delete_file("file-2")
    assert store.get_file("file-2") is None and store.file_content("file-2") is None


def test_create_batch_is_all_or_nothing(store):
    duplicate = _lines(3) + [BatchLine(1, "again", {})]  # line 1 twice: the insert fails part-way
    with pytest.raises(sa.exc.IntegrityError):
        store.create_batch(_batch("batch_bad", 1, 4), duplicate)
    assert store.get_batch("batch_bad") is None
    with store.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(batch_lines)).scalar() == 0


def test_results_are_stored_once_per_custom_id_and_counted(store):
    lines = _lines(5)
    store.create_batch(_batch("batch_a", 1, 5), lines)
    assert store.transition("batch_a", (VALIDATING,), IN_PROGRESS, at=7)
    assert not store.transition("batch_a", (VALIDATING,), IN_PROGRESS, at=8)  # compare-and-set
    assert store.record_result("batch_a", _result(lines[3]))
    assert not store.record_result("batch_a", _result(lines[3], ok=False))  # a rerun changes nothing
    assert store.record_result("batch_a", _result(lines[0], ok=False))
    batch = store.get_batch("batch_a")
    assert (batch.status, batch.completed, batch.failed, batch.timestamps["in_progress_at"]) == (IN_PROGRESS, 1, 1, 7)
    assert [x.custom_id for x in store.pending_lines("batch_a", 10)] == ["c1", "c2", "c4"]
    assert [x.custom_id for x in store.pending_lines("batch_a", 1, skip=frozenset({"c1"}))] == ["c2"]
    assert [(r.custom_id, r.ok) for r in store.results("batch_a")] == [("c0", False), ("c3", True)]
    assert [b.id for b in store.unfinished_batches()] == ["batch_a"]


def test_finish_batch_writes_files_and_status_together(store):
    store.create_batch(_batch("batch_f", 1, 1, FINALIZING), _lines(1))
    out = (FileRecord("file-o", "batch_output", "batch_f_output.jsonl", 2, 5), b"{}")
    assert store.finish_batch("batch_f", (FINALIZING,), COMPLETED, 9, out, None)
    batch = store.get_batch("batch_f")
    assert (batch.status, batch.output_file_id, batch.error_file_id) == (COMPLETED, "file-o", None)
    again = (FileRecord("file-o2", "batch_output", "x.jsonl", 2, 5), b"{}")
    assert not store.finish_batch("batch_f", (FINALIZING, CANCELLING), CANCELLED, 10, again, None)
    assert store.get_file("file-o2") is None  # the losing finisher left no orphan file


def test_lists_batches_newest_first_with_pagination(store):
    for i in range(4):
        store.create_batch(_batch(f"batch_{i}", 100 + i, 0), [])
    page = store.list_batches(None, 3)
    assert [b.id for b in page] == ["batch_3", "batch_2", "batch_1"]
    assert [b.id for b in store.list_batches(page[-1].id, 3)] == ["batch_0"]


def test_lease_has_one_holder_until_it_expires(store):
    assert store.acquire_lease("runner", "a", ttl_s=10, now=100)
    assert not store.acquire_lease("runner", "b", ttl_s=10, now=105)
    assert store.acquire_lease("runner", "a", ttl_s=10, now=108)  # renewal
    assert store.acquire_lease("runner", "b", ttl_s=10, now=119)  # a stopped renewing
    store.release_lease("runner", "a")  # not a's any more: no effect
    assert not store.acquire_lease("runner", "a", ttl_s=10, now=120)
    store.release_lease("runner", "b")
    assert store.acquire_lease("runner", "a", ttl_s=10, now=121)


def test_retention_deletes_finished_batches_and_their_files(store):
    store.put_file(FileRecord("file-in", "batch", "in.jsonl", 1, 1), b"x")
    store.create_batch(_batch("batch_old", 10, 1, FINALIZING), _lines(1))
    store.record_result("batch_old", _result(_lines(1)[0]))
    store.finish_batch(
        "batch_old", (FINALIZING,), COMPLETED, 11, (FileRecord("file-o", "batch_output", "o", 1, 11), b"y"), None
    )
    store.create_batch(_batch("batch_running", 10, 1, IN_PROGRESS), _lines(1))
    assert store.finished_batches_before(20) == ["batch_old"]
    store.delete_batch("batch_old", with_files=True)
    assert store.get_batch("batch_old") is None
    assert store.get_file("file-o") is None and store.get_file("file-in") is None
    assert store.get_batch("batch_running").status in UNFINISHED


def test_a_writer_killed_mid_way_leaves_whole_transactions(state_url):
    """SIGKILL a process that writes as fast as it can; every transaction it reported is there,
    and every batch has all its lines or does not exist."""
    writer = subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.state_writer", state_url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    reported = []
    try:
        for line in writer.stdout:  # kill it in the middle of its second batch's results
            reported.append(line.split())
            if sum(1 for r in reported if r[0] == "result") == state_writer.LINES // 2 + 17:
                break
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=60)
    engine = open_state_engine(state_url)  # SQLite recovers its WAL here
    store = SqlBatchStore(engine)
    with engine.connect() as conn:
        per_batch = dict(
            conn.execute(sa.select(batch_lines.c.batch_id, sa.func.count()).group_by(batch_lines.c.batch_id)).all()
        )
        results = conn.execute(sa.select(batch_results.c.batch_id, batch_results.c.custom_id)).all()
    assert set(per_batch.values()) == {state_writer.LINES}
    assert {b.id for b in store.unfinished_batches()} == set(per_batch)
    assert len(results) == len(set(results))
    assert {(r[1], r[2]) for r in reported if r[0] == "result"} <= set(results)
    assert store.record_result("batch_w1", LineResult("req-199", 199, True, 200, "r", {}))  # still writable
    engine.dispose()


def test_default_state_dir_is_under_the_cache_and_url_overrides(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE", str(tmp_path))
    assert default_state_dir() == tmp_path / "state"
    assert state_database_url() == f"sqlite:///{tmp_path / 'state' / 'state.db'}"
    assert state_database_url(tmp_path / "s") == f"sqlite:///{tmp_path / 's' / 'state.db'}"
    assert state_database_url(tmp_path / "s", "postgresql+psycopg://u@h/d") == "postgresql+psycopg://u@h/d"
    engine = open_state_engine(state_database_url())
    with engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    engine.dispose()
    assert os.path.isfile(tmp_path / "state" / "state.db")


def test_missing_postgres_skips_naming_the_package_or_fails_when_required(monkeypatch):
    from tests.helpers import postgres

    monkeypatch.setattr(postgres, "postgres_bin_dir", lambda: None)
    monkeypatch.delenv(postgres.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install postgresql"):
        postgres.skip_or_fail_without_postgres()
    monkeypatch.setenv(postgres.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="SPLITSERVE_REQUIRE_POSTGRES=1 requires them"):
        postgres.skip_or_fail_without_postgres()


def test_owners_scope_every_read_and_delete(store):
    for owner in ("team-a", "team-c"):
        store.put_file(FileRecord(f"file-{owner}", "batch", "in.jsonl", 1, 1, owner=owner), b"x")
        store.create_batch(_owned_batch(owner), [])
    assert [f.id for f in store.list_files(None, None, 10, True, owner="team-a")] == ["file-team-a"]
    assert {f.id for f in store.list_files(None, None, 10, True)} == {"file-team-a", "file-team-c"}  # None: all
    assert store.get_file("file-team-c", owner="team-a") is None and store.file_content("file-team-c", "team-a") is None
    assert store.get_file("file-team-c", owner="team-c").owner == "team-c"
    assert not store.delete_file("file-team-c", owner="team-a") and store.get_file("file-team-c") is not None
    assert store.get_batch("batch_team-c", owner="team-a") is None
    assert store.get_batch("batch_team-c", owner="team-c").owner == "team-c"
    assert [b.id for b in store.list_batches(None, 10, owner="team-c")] == ["batch_team-c"]


def _owned_batch(owner: str) -> BatchRecord:
    return BatchRecord(f"batch_{owner}", "/v1/completions", "file-x", "24h", VALIDATING, 1, 100, 1, owner=owner)


def test_a_store_from_before_owners_gets_the_column_and_keeps_its_rows(state_url):
    engine = open_state_engine(state_url)
    with engine.begin() as conn:  # the tables as the previous version created them
        for table in ("files", "batches"):
            conn.execute(sa.text(f"DROP INDEX ix_{table}_owner"))
            conn.execute(sa.text(f"ALTER TABLE {table} DROP COLUMN owner"))
        conn.execute(
            sa.text(
                "INSERT INTO files (id, purpose, filename, bytes, created_at, content) "
                "VALUES ('file-old', 'batch', 'old.jsonl', 1, 1, :content)"
            ),
            {"content": b"x"},
        )
    engine.dispose()
    engine = open_state_engine(state_url)  # the new version starts on it
    store = SqlBatchStore(engine)
    assert store.get_file("file-old", owner="").owner == ""  # the deployment without tenants
    store.put_file(FileRecord("file-new", "batch", "n.jsonl", 1, 2, owner="team-a"), b"y")
    assert store.get_file("file-new", owner="team-a") is not None
    engine.dispose()
    open_state_engine(state_url).dispose()  # and again: nothing left to add
