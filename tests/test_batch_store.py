"""The batch store's contract (SPEC §14), one test-suite run against both implementations:
SQLite (the embedded default) and PostgreSQL (a real server, `postgres_fixture`). Fencing,
one result per `custom_id`, idempotent finalize, ownership, quotas' byte counts, expiry, the
schema's versions; and, PostgreSQL only, what several replicas need: a claim bounded over
replicas, a dead replica's leases taken over, a replica that lost its lease fenced off."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final

import pytest

from gateway.batch.records import Usage
from gateway.batch.store import BatchDb, BatchRow, Database, FileRow, LineResult, SchemaTooNew
from postgres_fixture import PostgresServer, pg_server

CHAT: Final = "/v1/chat/completions"
__all__ = ["pg_server"]  # the session's PostgreSQL, used as a fixture here

Opener = Callable[[], BatchDb]


@pytest.fixture(params=["sqlite", "postgresql"])
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """`opener()`: a connection to one store of the test (call it twice: two replicas of
    PostgreSQL, or the same SQLite file reopened)."""
    made: list[BatchDb] = []
    if request.param == "sqlite":

        def make() -> BatchDb:
            db = Database(str(tmp_path / "b.db"), tmp_path / "files")
            made.append(db)
            return db

    else:
        from gateway.batch.pgstore import PgDatabase

        url = request.getfixturevalue("pg_server").new_database()

        def make() -> BatchDb:
            db = PgDatabase(url, pool_size=2)
            made.append(db)
            return db

    yield make
    for db in made:
        db.close()


def _batch(db: BatchDb, owner: str = "o", lines: int = 3) -> int:
    row = db.create_batch(BatchRow.new("batch_x" + owner, owner, CHAT, "file-x", 0, 10**10))
    db.begin(row.seq, lines, "m", 1)
    db.insert_lines(row.seq, [(i, f"c{i}", b"{}") for i in range(1, lines + 1)])
    return row.seq


def _result(seq: int, no: int, attempt: int, ok: bool = True) -> LineResult:
    return LineResult(seq, no, f"c{no}", attempt, ok, b'{"x":%d}' % no, Usage(1, 2, 3))


def _content(db: BatchDb, file_id: str, tmp_path: Path) -> bytes:
    return db.export(file_id, tmp_path / "export").read_bytes()


def test_late_results_are_fenced_and_one_per_custom_id(opener: Opener, tmp_path: Path) -> None:
    db = opener()
    seq = _batch(db)
    _, claimed, _ = db.exchange([], [(seq, 2)], 64)
    assert [(c.line_no, c.attempt) for c in claimed[seq]] == [(1, 1), (2, 1)]
    db.release()  # as after a crash: the leases go back to pending
    _, claimed, exhausted = db.exchange([], [(seq, 3)], 64)
    assert [(c.line_no, c.attempt) for c in claimed[seq]] == [(1, 2), (2, 2), (3, 1)]
    assert seq not in exhausted
    # a late answer of the first lease is fenced off; the current one is applied
    applied, _, _ = db.exchange([_result(seq, 1, 1), _result(seq, 2, 2)], [], 64)
    assert [(r.line_no, r.attempt) for r in applied] == [(2, 2)]
    applied, _, _ = db.exchange(
        [_result(seq, 1, 2), _result(seq, 2, 2), _result(seq, 3, 1, ok=False)], [], 64
    )
    assert sorted(r.line_no for r in applied) == [1, 3]  # line 2 is done: no second result
    _, claimed, exhausted = db.exchange([], [(seq, 5)], 64)
    assert claimed[seq] == [] and seq in exhausted
    b = db.batch(seq)
    assert (b.completed, b.failed, b.total_tokens) == (2, 1, 9)
    final = db.finalize(seq, "completed", 5, 3600)
    assert final is not None and final.status == "completed"
    assert final.output_file_id and final.error_file_id
    out = _content(db, final.output_file_id, tmp_path)
    assert out.splitlines() == [b'{"x":1}', b'{"x":2}']
    assert _content(db, final.error_file_id, tmp_path) == b'{"x":3}\n'
    again = db.finalize(seq, "completed", 6, 3600)  # idempotent
    assert again is not None and again.completed_at == 5
    got = db.get_file(final.output_file_id, "o")
    assert got is not None and got.expires_at == 5 + 3600 and got.purpose == "batch_output"
    assert db.get_file(final.output_file_id, "someone else") is None


def test_finalize_waits_for_leased_lines_and_cancel_writes_the_rest(
    opener: Opener, tmp_path: Path
) -> None:
    db = opener()
    seq = _batch(db, lines=4)
    _, _claimed, _ = db.exchange([], [(seq, 2)], 64)
    assert db.finalize(seq, "completed", 5, 3600) is None  # lines left: not yet
    old, row = db.cancel(seq, 5)
    assert (old, row.status) == ("in_progress", "cancelling")
    assert db.finalize(seq, "cancelled", 5, 3600) is None  # two still leased
    db.exchange([_result(seq, 1, 1)], [], 64)
    db.release(seq)
    final = db.finalize(seq, "cancelled", 6, 3600)
    assert final is not None and final.status == "cancelled" and final.completed == 1
    assert final.error_file_id is not None
    errors = _content(db, final.error_file_id, tmp_path).splitlines()
    assert len(errors) == 3 and all(b"batch_cancelled" in e for e in errors)


def test_files_ownership_quota_bytes_and_expiry(opener: Opener, tmp_path: Path) -> None:
    db = opener()
    rows = []
    for i, (owner, expires) in enumerate([("a", 100), ("a", None), ("b", 100)]):
        staged = tmp_path / f"up{i}.tmp"
        staged.write_bytes(b"x" * (10 + i))
        rows.append(
            db.add_file(FileRow(0, f"file-{i}", owner, "batch", "f", 10 + i, 1, expires), staged)
        )
    assert db.used_bytes("a") == 21 and db.used_bytes("b") == 12 and db.used_bytes("c") == 0
    files, more = db.list_files("a", None, None, 10, True)
    assert [f.id for f in files] == ["file-1", "file-0"] and not more
    assert db.get_file("file-2", "a") is None and db.get_file("file-2", None) is not None
    assert _content(db, "file-1", tmp_path) == b"x" * 11
    # the input of a running batch is kept past its expiry
    row = db.create_batch(BatchRow.new("batch_k", "b", CHAT, "file-2", 0, 10**10))
    assert db.janitor(99) == 0
    assert db.janitor(100) == 1  # file-0 only
    assert db.get_file("file-0", None) is None and db.get_file("file-2", None) is not None
    db.fail(row.seq, [{"code": "x", "line": None, "message": "m", "param": None}], 101)
    assert db.janitor(101) == 1 and db.used_bytes("b") == 0
    assert db.delete_file("file-1", "a") and db.used_bytes("a") == 0


def test_a_newer_schema_is_refused(opener: Opener, request: pytest.FixtureRequest) -> None:
    db = opener()
    if isinstance(db, Database):
        db.conn.execute("PRAGMA user_version=99")
    else:
        with db.tx() as c:
            c.execute("INSERT INTO schema_migrations (version, breaking) VALUES (99, true)")
    db.close()
    with pytest.raises(SchemaTooNew, match="version 99, newer than this gateway's"):
        opener()


def test_sqlite_version_1_is_migrated_forward(tmp_path: Path) -> None:
    """A store written by the previous release (schema 1) opens, and keeps its batches."""
    from gateway.batch import store

    conn = sqlite3.connect(tmp_path / "b.db")
    conn.executescript(store._SCHEMA)
    conn.execute(
        "INSERT INTO batches (id, owner, endpoint, input_file_id, completion_window, status, "
        "created_at) VALUES ('batch_old', 'o', ?, 'file-x', '24h', 'in_progress', 1)",
        (CHAT,),
    )
    conn.execute("PRAGMA user_version=1")
    conn.commit()
    conn.close()
    db = Database(str(tmp_path / "b.db"), tmp_path / "files")
    old = db.get_batch("batch_old", "o")
    assert old is not None and old.output_ttl is None
    assert db.conn.execute("PRAGMA user_version").fetchone()[0] == store._SCHEMA_VERSION
    db.close()


# ---- PostgreSQL: several replicas ---------------------------------------------------------------


@pytest.fixture
def pg(pg_server: PostgresServer) -> Iterator[Callable[[], Any]]:
    from gateway.batch.pgstore import PgDatabase

    url = pg_server.new_database()
    made: list[PgDatabase] = []

    def make() -> PgDatabase:
        db = PgDatabase(url, pool_size=2)
        made.append(db)
        return db

    yield make
    for db in made:
        with contextlib.suppress(Exception):
            db.close()


def test_the_claim_is_bounded_over_replicas(pg: Callable[[], Any]) -> None:
    a, b = pg(), pg()
    seq = _batch(a, lines=10)
    _, got_a, _ = a.exchange([], [(seq, 4)], 6)
    _, got_b, _ = b.exchange([], [(seq, 4)], 6)
    # each replica leases its share (6 / 2 replicas), the batch 6 at most over all of them
    assert len(got_a[seq]) == 3 and len(got_b[seq]) == 3
    _, got_c, _ = pg().exchange([], [(seq, 4)], 6)
    assert got_c[seq] == []
    assert not {c.line_no for c in got_a[seq]} & {c.line_no for c in got_b[seq]}


def test_a_dead_replicas_leases_are_taken_over_and_its_results_fenced(
    pg: Callable[[], Any],
) -> None:
    a, b = pg(), pg()
    seq = _batch(a, lines=3)
    _, got, _ = a.exchange([], [(seq, 3)], 64)
    assert len(got[seq]) == 3
    assert b.heartbeat() == 0  # a is alive: its advisory lock is held
    # a's process dies: PostgreSQL frees its lock when the connection closes
    assert a._life is not None
    a._life.close()
    assert b.heartbeat() == 3
    _, again, _ = b.exchange([], [(seq, 3)], 64)
    assert [(c.line_no, c.attempt) for c in again[seq]] == [(1, 2), (2, 2), (3, 2)]
    # a wakes up with its old answers: fenced off (its lease is gone)
    applied, _, _ = a.exchange([_result(seq, 1, 1)], [], 64)
    assert applied == []
    applied, _, _ = b.exchange([_result(seq, n, 2) for n in (1, 2, 3)], [], 64)
    assert len(applied) == 3
    # a's next heartbeat finds itself declared dead and comes back under a new identity
    old = a.replica_id
    a.heartbeat()
    assert a.replica_id != old
    final = b.finalize(seq, "completed", 9, 3600)
    assert final is not None and final.completed == 3
    assert a.finalize(seq, "completed", 10, 3600) == final  # the second finder sees it done


def test_validation_is_claimed_by_one_replica(pg: Callable[[], Any]) -> None:
    a, b = pg(), pg()
    row = a.create_batch(BatchRow.new("batch_v", "o", CHAT, "file-x", 0, 10**10))
    assert a.claim_validation(row.seq) and not b.claim_validation(row.seq)
    assert a._life is not None
    a._life.close()
    b.heartbeat()  # a is gone: its validation is released
    assert b.claim_validation(row.seq)


def test_the_store_setting_is_a_path_or_a_postgresql_url() -> None:
    """SPEC §14: a PostgreSQL URL is a store, never a file name; another URL is refused."""
    from gateway.config import parse_config
    from gateway.errors import ConfigError

    def store(value: str) -> str:
        doc = (
            "pools: {p: {instances: [{name: a, url: 'http://127.0.0.1:9/v1', model: x, "
            "max_concurrency: 4}]}}\n"
            f"models: {{m: {{pool: p}}}}\nbatch: {{store: '{value}'}}\n"
        )
        return parse_config(doc, env={}).batch.store

    assert store("postgresql://gw:pw@db.internal:5432/gateway").startswith("postgresql://")
    assert store("./b.db") == "./b.db"
    with pytest.raises(ConfigError, match="postgresql:// URL"):
        store("mysql://db/gateway")
    with pytest.raises(ConfigError, match="must name a host"):
        store("postgresql:///gateway")
