"""The Batch API's durable state: files, batches, lines and results — the store interface
(`BatchDb`, `Store`) and its embedded implementation, SQLite (`Database`, `SqliteStore`); the
PostgreSQL one, for several replicas, is `pgstore.py` (SPEC §14 "Across hosts").

SPEC §14: "Durable: files and batch progress live in SQLite (WAL) at `batch.store` (default
`./gateway-batches.db`); a restart, even `kill -9`, resumes every unfinished batch; no line is
lost and no `custom_id` appears twice in an output; a line in flight at a crash is sent again at
most once."

**One dedicated thread.** Every SQLite call runs on a single-worker executor that owns the one
connection; the event loop only awaits its futures, so it never blocks on disk. One thread, not
`asyncio.to_thread`'s shared pool: SQLite admits one writer at a time anyway (more threads
would only wait for its lock, or fail with `database is locked`), a single thread orders every
operation (a read issued after a commit sees it) without any lock of ours, the connection stays
on the thread that opened it (`sqlite3`'s `check_same_thread`), and work queued behind a config
reload or a file copy in the default pool cannot delay a group commit. The validator, which
runs in a worker thread of its own, inserts through the same thread (`call_sync`).

**Durability.** `journal_mode=WAL`, `synchronous=NORMAL`: a committed transaction survives a
crash of the process (`kill -9`); a power loss may roll back the last commits but never
corrupts the file. Results are committed in groups (the runner's `exchange`: every 50 ms or
100 results), each group in the same transaction that leases the next lines.

**Tables.** `files` (metadata; the bytes live in `<store>.files/<id>`, see below), `batches`
(the Batch object, its counters and usage), `lines` (`state` pending | leased | done,
`attempt` counts leases), `results` (the output or error record of each finished line, keyed
by `(batch, custom_id)`: `INSERT OR IGNORE` makes a second result for a `custom_id`
impossible). A result is applied only while its line is `leased` with the same `attempt` it
was leased with: the attempt number **fences** late results (a result of an older lease never
overwrites a newer one). On open, `leased` lines revert to `pending` (the process that leased
them is gone): they run again, at most once each, since a lease is committed before its
request is sent and a line's slot is freed only once its result is committed.

**File bytes on disk, not in SQLite.** An upload (up to `batch.max_file_bytes`, 200 MB) is
streamed to `<store>.files/.upload-*.tmp`, fsynced and renamed to its id; output and error
files are written the same way (temp file, fsync, rename, directory fsync). Blobs in SQLite
would pass 200 MB through the WAL twice (the log, then the checkpoint), hold the write lock
for the whole copy and make downloads read through the connection's thread; on disk an upload
never touches the database until its row is inserted, and a download is a `sendfile`. The
requests of a batch are copied into `lines` once validated (the work queue must be
transactional); they and the results are deleted when the batch is finalized, so the database
holds only unfinished work plus one row per file and batch.

**Finalize is idempotent**: the output and error files are written from `results` (and, for
an expired or cancelled batch, the lines never run) to temp files, fsynced and renamed, with
ids derived from the batch id; the rows for them, the batch's final status and the deletion of
its lines and results are one transaction. A crash anywhere in between re-runs it and writes
the same files under the same ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, ParamSpec, Protocol, TypeVar

import orjson

from gateway.batch.faults import classify
from gateway.batch.records import CANCELLED, EXPIRED, Usage, line_id, unfinished_record

__all__ = [
    "ACTIVE",
    "STATUSES",
    "TERMINAL",
    "BatchDb",
    "BatchRow",
    "Claimed",
    "Database",
    "FileRow",
    "LineResult",
    "SqliteStore",
    "Store",
    "fsync_dir",
    "new_id",
    "now_s",
    "output_ids",
]

P = ParamSpec("P")
T = TypeVar("T")

#: The eight statuses of OpenAI's Batch object (SPEC §14), in life order.
STATUSES: Final = (
    "validating",
    "in_progress",
    "finalizing",
    "completed",
    "failed",
    "cancelling",
    "cancelled",
    "expired",
)
TERMINAL: Final = frozenset(("completed", "failed", "cancelled", "expired"))
ACTIVE: Final = frozenset(STATUSES) - TERMINAL

#: Forward migrations: version n+1 is `_MIGRATIONS[n]` (version 1 is `_SCHEMA`). The version
#: lives in `PRAGMA user_version`; a file newer than this code is refused at open.
_MIGRATIONS: Final = (
    # 2: SPEC §14 "Quotas and expiry": a file's `expires_at`, a batch's output retention.
    "ALTER TABLE files ADD COLUMN expires_at INTEGER;"
    "ALTER TABLE batches ADD COLUMN output_ttl INTEGER;"
    "CREATE INDEX IF NOT EXISTS files_owner ON files(owner);",
)
_SCHEMA_VERSION: Final = 1 + len(_MIGRATIONS)
_SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY,
    id TEXT NOT NULL UNIQUE,
    owner TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    model TEXT,
    metadata TEXT,
    errors TEXT,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    expires_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    total_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS batches_status ON batches(status);
CREATE TABLE IF NOT EXISTS lines (
    batch_seq INTEGER NOT NULL,
    line_no INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body BLOB NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempt INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_seq, line_no)
) WITHOUT ROWID;
-- Only pending lines: a claim finds the next ones in O(k log n), not past every done line.
CREATE INDEX IF NOT EXISTS lines_pending ON lines(batch_seq, line_no) WHERE state = 'pending';
CREATE TABLE IF NOT EXISTS results (
    batch_seq INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    line_no INTEGER NOT NULL,
    attempt INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    record BLOB NOT NULL,
    PRIMARY KEY (batch_seq, custom_id)
) WITHOUT ROWID;
"""

_BATCH_COLUMNS: Final = (
    "seq, id, owner, endpoint, input_file_id, completion_window, status, model, metadata, "
    "errors, output_file_id, error_file_id, created_at, in_progress_at, expires_at, "
    "finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at, total, "
    "completed, failed, input_tokens, output_tokens, total_tokens, cached_tokens, "
    "reasoning_tokens, output_ttl"
)
_FILE_COLUMNS: Final = "seq, id, owner, purpose, filename, bytes, created_at, expires_at"


def new_id(prefix: str) -> str:
    """`file-…` / `batch_…`: the prefix and 24 random hex digits."""
    return prefix + secrets.token_hex(12)


def now_s() -> int:
    return int(time.time())


@dataclass(frozen=True, slots=True)
class FileRow:
    seq: int
    id: str
    owner: str
    purpose: str
    filename: str
    bytes: int
    created_at: int
    expires_at: int | None = None


@dataclass(frozen=True, slots=True)
class BatchRow:
    """One row of `batches`: the Batch object's fields plus its owner and counters."""

    seq: int
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    model: str | None
    metadata: str | None  # JSON text
    errors: str | None  # JSON text: a list of {code, line, message, param}
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    total: int
    completed: int
    failed: int
    input_tokens: int
    output_tokens: int
    total_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    output_ttl: int | None = None  # seconds its output and error files are kept

    @classmethod
    def new(
        cls,
        batch_id: str,
        owner: str,
        endpoint: str,
        input_file_id: str,
        created_at: int,
        expires_at: int,
        metadata: str | None = None,
        status: str = "validating",
        output_ttl: int | None = None,
    ) -> BatchRow:
        """A batch as `POST /v1/batches` creates it (its `seq` is given by the store)."""
        none, zero = None, 0  # the other *_at, then the counters
        return cls(
            0, batch_id, owner, endpoint, input_file_id, "24h", status, None, metadata, None,
            None, None, created_at, None, expires_at, none, none, none, none, none, none,
            zero, zero, zero, zero, zero, zero, zero, zero, output_ttl,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Claimed:
    """A line leased to this process: send it, then report a `LineResult` with `attempt`."""

    line_no: int
    custom_id: str
    body: bytes
    attempt: int


@dataclass(frozen=True, slots=True)
class LineResult:
    """The final answer of one leased line: its output (`ok`) or error record."""

    batch_seq: int
    line_no: int
    custom_id: str
    attempt: int
    ok: bool
    record: bytes
    usage: Usage = field(default_factory=Usage)


def output_ids(batch_id: str) -> tuple[str, str]:
    """The output and error file ids of a batch: derived, so a re-finalize reuses them."""
    suffix = batch_id.removeprefix("batch_")
    return f"file-out-{suffix}", f"file-err-{suffix}"


#: Files whose upload a crash cut short (PostgreSQL: rows still `uploading`) are removed
#: after this long.
STALE_UPLOAD_S: Final = 3600
#: A janitor pass deletes at most this many expired files (the next pass takes the rest).
JANITOR_BATCH: Final = 100


class SchemaTooNew(RuntimeError):
    """The store was migrated by a newer gateway than this one: refused, never written."""


class BatchDb(Protocol):
    """The store interface (SPEC §14): every statement the API and the runner use, synchronous,
    called on the store's own thread through `Store.call`. Two implementations: `Database`
    (SQLite, one host) and `pgstore.PgDatabase` (PostgreSQL, any number of replicas); the
    same test-suite runs against both (tests/test_batch_store.py)."""

    def close(self) -> None: ...
    def add_file(self, row: FileRow, staged: Path) -> FileRow: ...
    def get_file(self, file_id: str, owner: str | None) -> FileRow | None: ...
    def list_files(
        self, owner: str | None, purpose: str | None, after: str | None, limit: int, desc: bool
    ) -> tuple[list[FileRow], bool]: ...
    def delete_file(self, file_id: str, owner: str | None) -> bool: ...
    def used_bytes(self, owner: str) -> int: ...
    def export(self, file_id: str, dest: Path) -> Path: ...
    def read_chunk(self, file_id: str, n: int) -> bytes | None: ...
    def create_batch(self, row: BatchRow) -> BatchRow: ...
    def batch(self, seq: int) -> BatchRow: ...
    def get_batch(self, batch_id: str, owner: str | None) -> BatchRow | None: ...
    def list_batches(
        self, owner: str | None, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]: ...
    def status_counts(self) -> dict[str, int]: ...
    def unfinished(self) -> list[BatchRow]: ...
    def set_status(
        self, seq: int, status: str, when: int, only_from: Iterable[str]
    ) -> BatchRow: ...
    def cancel(self, seq: int, when: int) -> tuple[str, BatchRow]: ...
    def claim_validation(self, seq: int) -> bool: ...
    def reset_lines(self, seq: int) -> None: ...
    def insert_lines(self, seq: int, rows: Sequence[tuple[int, str, bytes]]) -> None: ...
    def begin(self, seq: int, total: int, model: str | None, when: int) -> BatchRow: ...
    def fail(self, seq: int, errors: list[dict[str, Any]], when: int) -> BatchRow: ...
    def exchange(
        self, results: Sequence[LineResult], claims: Sequence[tuple[int, int]], per_batch: int
    ) -> tuple[list[LineResult], dict[int, list[Claimed]], set[int]]: ...
    def release(self, seq: int | None = None) -> None: ...
    def heartbeat(self) -> int: ...
    def finalize(self, seq: int, final: str, when: int, ttl_s: int) -> BatchRow | None: ...
    def janitor(self, now: int) -> int: ...


class Database:
    """The SQLite store: the connection and every statement, synchronous; runs on the store's
    thread only (`SqliteStore` is its async face). Public for tests that drive the store step
    by step."""

    def __init__(self, path: str, files_dir: Path) -> None:
        self.files_dir = files_dir
        files_dir.mkdir(parents=True, exist_ok=True)
        # An upload or an output file cut short by a crash (this process holds the lock).
        for stale in files_dir.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=True)
        c = self.conn
        # Before the first table exists (a new file only): freed pages can be given back.
        c.execute("PRAGMA auto_vacuum=INCREMENTAL")
        c.execute("PRAGMA journal_mode=WAL")
        c.execute("PRAGMA synchronous=NORMAL")
        c.execute("PRAGMA busy_timeout=5000")
        version = c.execute("PRAGMA user_version").fetchone()[0]
        if version > _SCHEMA_VERSION:
            raise SchemaTooNew(
                f"The batch store's schema is version {version}, newer than this gateway's "
                f"({_SCHEMA_VERSION}): it was used by a newer release. Run that release, or "
                "point batch.store elsewhere."
            )
        if version == 0:
            c.executescript(_SCHEMA)
            version = 1
        # Forward migrations, each with its version bump in one transaction.
        while version < _SCHEMA_VERSION:
            with self.tx():
                for statement in _MIGRATIONS[version - 1].split(";"):
                    if statement.strip():
                        c.execute(statement)
                version += 1
                c.execute(f"PRAGMA user_version={version}")
        # The process that leased these lines is gone: they run again (at most once each).
        with self.tx():
            c.execute("UPDATE lines SET state='pending' WHERE state='leased'")

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        with contextlib.suppress(sqlite3.Error):
            self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.conn.close()

    # ---- files -----------------------------------------------------------------------------

    def add_file(self, row: FileRow, staged: Path) -> FileRow:
        """Moves the fsynced upload `staged` to the store and records it."""
        dest = self.files_dir / row.id
        os.replace(staged, dest)
        fsync_dir(self.files_dir)
        try:
            with self.tx() as c:
                cur = c.execute(
                    "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, "
                    "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    _file_tail(row),
                )
        except BaseException:
            dest.unlink(missing_ok=True)
            raise
        return FileRow(cur.lastrowid or 0, *_file_tail(row))

    def used_bytes(self, owner: str) -> int:
        """SPEC §14 quota: the bytes of every file `owner` keeps (outputs included)."""
        row = self.conn.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner=?", (owner,))
        n: int = row.fetchone()[0]
        return n

    def export(self, file_id: str, dest: Path) -> Path:
        """A local path to read the file's bytes from: here, the file itself."""
        return self.files_dir / file_id

    def read_chunk(self, file_id: str, n: int) -> bytes | None:
        raise NotImplementedError("SQLite files are served from disk (files_dir)")

    def janitor(self, now: int) -> int:
        """SPEC §14 expiry: deletes up to `JANITOR_BATCH` files past their `expires_at`
        (never the input of a batch still running); returns how many."""
        marks = ", ".join("?" * len(ACTIVE))
        rows = self.conn.execute(
            "SELECT seq, id FROM files WHERE expires_at IS NOT NULL AND expires_at <= ? AND id "
            f"NOT IN (SELECT input_file_id FROM batches WHERE status IN ({marks})) LIMIT ?",
            (now, *sorted(ACTIVE), JANITOR_BATCH),
        ).fetchall()
        if not rows:
            return 0
        with self.tx() as c:
            c.executemany("DELETE FROM files WHERE seq=?", [(seq,) for seq, _ in rows])
        for _, file_id in rows:
            with contextlib.suppress(FileNotFoundError):
                (self.files_dir / file_id).unlink()
        return len(rows)

    def heartbeat(self) -> int:
        """One process owns a SQLite store (its `flock`): no peer to take over from."""
        return 0

    def claim_validation(self, seq: int) -> bool:
        return True

    def get_file(self, file_id: str, owner: str | None) -> FileRow | None:
        sql = f"SELECT {_FILE_COLUMNS} FROM files WHERE id=?"
        args: tuple[Any, ...] = (file_id,)
        if owner is not None:
            sql += " AND owner=?"
            args += (owner,)
        found = self.conn.execute(sql, args).fetchone()
        return FileRow(*found) if found else None

    def list_files(
        self, owner: str | None, purpose: str | None, after: str | None, limit: int, desc: bool
    ) -> tuple[list[FileRow], bool]:
        where, args = _owned(owner)
        if purpose is not None:
            where.append("purpose=?")
            args.append(purpose)
        if after is not None:
            anchor = self.get_file(after, owner)
            if anchor is None:
                return [], False
            where.append("seq < ?" if desc else "seq > ?")
            args.append(anchor.seq)
        sql = f"SELECT {_FILE_COLUMNS} FROM files"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?"
        rows = self.conn.execute(sql, (*args, limit + 1)).fetchall()
        return [FileRow(*r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str | None) -> bool:
        found = self.get_file(file_id, owner)
        if found is None:
            return False
        with self.tx() as c:
            c.execute("DELETE FROM files WHERE seq=?", (found.seq,))
        with contextlib.suppress(FileNotFoundError):
            (self.files_dir / found.id).unlink()
        return True

    # ---- batches ---------------------------------------------------------------------------

    def create_batch(self, row: BatchRow) -> BatchRow:
        values = _batch_values(row)[1:]
        marks = ", ".join("?" * len(values))
        with self.tx() as c:
            cur = c.execute(
                f"INSERT INTO batches ({_BATCH_COLUMNS.split(', ', 1)[1]}) VALUES ({marks})",
                values,
            )
        return self.batch(cur.lastrowid or 0)

    def batch(self, seq: int) -> BatchRow:
        row = self.conn.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE seq=?", (seq,))
        return BatchRow(*row.fetchone())

    def get_batch(self, batch_id: str, owner: str | None) -> BatchRow | None:
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id=?"
        args: tuple[Any, ...] = (batch_id,)
        if owner is not None:
            sql += " AND owner=?"
            args += (owner,)
        found = self.conn.execute(sql, args).fetchone()
        return BatchRow(*found) if found else None

    def list_batches(
        self, owner: str | None, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]:
        """Newest first, as OpenAI lists them; `after` is the last id of the previous page."""
        where, args = _owned(owner)
        if after is not None:
            anchor = self.get_batch(after, owner)
            if anchor is None:
                return [], False
            where.append("seq < ?")
            args.append(anchor.seq)
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        rows = self.conn.execute(sql, (*args, limit + 1)).fetchall()
        return [BatchRow(*r) for r in rows[:limit]], len(rows) > limit

    def status_counts(self) -> dict[str, int]:
        rows = self.conn.execute("SELECT status, COUNT(*) FROM batches GROUP BY status")
        return {status: n for status, n in rows}

    def unfinished(self) -> list[BatchRow]:
        marks = ", ".join("?" * len(ACTIVE))
        rows = self.conn.execute(
            f"SELECT {_BATCH_COLUMNS} FROM batches WHERE status IN ({marks}) ORDER BY seq",
            tuple(sorted(ACTIVE)),
        )
        return [BatchRow(*r) for r in rows]

    def set_status(self, seq: int, status: str, when: int, only_from: Iterable[str]) -> BatchRow:
        """`status` (and its `<status>_at`) if the batch is in one of `only_from`."""
        froms = tuple(only_from)
        marks = ", ".join("?" * len(froms))
        with self.tx() as c:
            c.execute(
                f"UPDATE batches SET status=?, {status}_at=? WHERE seq=? AND status IN ({marks})",
                (status, when, seq, *froms),
            )
        return self.batch(seq)

    def cancel(self, seq: int, when: int) -> tuple[str, BatchRow]:
        """validating | in_progress → cancelling; returns (the status before, the batch)."""
        with self.tx() as c:
            old = c.execute("SELECT status FROM batches WHERE seq=?", (seq,)).fetchone()[0]
            if old in ("validating", "in_progress"):
                c.execute(
                    "UPDATE batches SET status='cancelling', cancelling_at=? WHERE seq=?",
                    (when, seq),
                )
        return old, self.batch(seq)

    # ---- validation ------------------------------------------------------------------------

    def reset_lines(self, seq: int) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM lines WHERE batch_seq=?", (seq,))
            c.execute("DELETE FROM results WHERE batch_seq=?", (seq,))

    def insert_lines(self, seq: int, rows: Sequence[tuple[int, str, bytes]]) -> None:
        with self.tx() as c:
            c.executemany(
                "INSERT INTO lines (batch_seq, line_no, custom_id, body) VALUES (?, ?, ?, ?)",
                [(seq, n, cid, body) for n, cid, body in rows],
            )

    def begin(self, seq: int, total: int, model: str | None, when: int) -> BatchRow:
        """validating → in_progress, with the line count and the first line's model."""
        with self.tx() as c:
            c.execute("UPDATE batches SET total=?, model=? WHERE seq=?", (total, model, seq))
            c.execute(
                "UPDATE batches SET status='in_progress', in_progress_at=? "
                "WHERE seq=? AND status='validating'",
                (when, seq),
            )
        return self.batch(seq)

    def fail(self, seq: int, errors: list[dict[str, Any]], when: int) -> BatchRow:
        """validating → failed with `errors`; nothing of it was (or will be) executed."""
        with self.tx() as c:
            c.execute("DELETE FROM lines WHERE batch_seq=?", (seq,))
            c.execute(
                "UPDATE batches SET status='failed', failed_at=?, errors=? "
                "WHERE seq=? AND status='validating'",
                (when, orjson.dumps(errors).decode(), seq),
            )
        return self.batch(seq)

    # ---- execution -------------------------------------------------------------------------

    def exchange(
        self, results: Sequence[LineResult], claims: Sequence[tuple[int, int]], per_batch: int
    ) -> tuple[list[LineResult], dict[int, list[Claimed]], set[int]]:
        """One group commit: applies `results` (fenced by attempt; at most one per custom_id)
        and their batches' counters, then leases up to n pending lines for each `(seq, n)`.
        Returns the results applied, the lines leased and the batches with no pending line
        left. (`per_batch` caps a batch's leases across replicas; one process here.)"""
        claimed: dict[int, list[Claimed]] = {}
        exhausted: set[int] = set()
        with self.tx() as c:
            applied = self._apply(c, results)
            self._count(c, applied)
            for seq, n in claims:
                claimed[seq] = self._claim(c, seq, n)
                if len(claimed[seq]) < n:
                    exhausted.add(seq)
        return applied, claimed, exhausted

    _DONE: Final = (
        "UPDATE lines SET state='done' "
        "WHERE batch_seq=? AND line_no=? AND attempt=? AND state='leased'"
    )
    _RESULT: Final = (
        "INSERT OR IGNORE INTO results (batch_seq, custom_id, line_no, attempt, ok, record) "
        "VALUES (?, ?, ?, ?, ?, ?)"
    )

    def _apply(self, c: sqlite3.Connection, results: Sequence[LineResult]) -> list[LineResult]:
        """The results whose lease is current, recorded. The usual case — every one current —
        takes two `executemany`; if any is fenced off, the group is redone row by row."""
        if not results:
            return []
        c.execute("SAVEPOINT fast")
        done = c.executemany(self._DONE, [(r.batch_seq, r.line_no, r.attempt) for r in results])
        if done.rowcount == len(results):
            rows = [
                (r.batch_seq, r.custom_id, r.line_no, r.attempt, int(r.ok), r.record)
                for r in results
            ]
            if c.executemany(self._RESULT, rows).rowcount == len(results):
                c.execute("RELEASE fast")
                return list(results)
        c.execute("ROLLBACK TO fast")
        c.execute("RELEASE fast")
        applied: list[LineResult] = []
        for r in results:
            if c.execute(self._DONE, (r.batch_seq, r.line_no, r.attempt)).rowcount != 1:
                continue  # a late result of an older lease, or a line already done
            row = (r.batch_seq, r.custom_id, r.line_no, r.attempt, int(r.ok), r.record)
            if c.execute(self._RESULT, row).rowcount == 1:
                applied.append(r)
        return applied

    @staticmethod
    def _count(c: sqlite3.Connection, applied: Sequence[LineResult]) -> None:
        sums: dict[int, list[int]] = {}
        for r in applied:
            s = sums.setdefault(r.batch_seq, [0] * 7)
            u = r.usage
            for i, v in enumerate(
                (
                    int(r.ok),
                    int(not r.ok),
                    u.input_tokens,
                    u.output_tokens,
                    u.total_tokens,
                    u.cached_tokens,
                    u.reasoning_tokens,
                )
            ):
                s[i] += v
        c.executemany(
            "UPDATE batches SET completed=completed+?, failed=failed+?, "
            "input_tokens=input_tokens+?, output_tokens=output_tokens+?, "
            "total_tokens=total_tokens+?, cached_tokens=cached_tokens+?, "
            "reasoning_tokens=reasoning_tokens+? WHERE seq=?",
            [(*s, seq) for seq, s in sums.items()],
        )

    @staticmethod
    def _claim(c: sqlite3.Connection, seq: int, n: int) -> list[Claimed]:
        # INDEXED BY: left alone the planner walks the primary key from the batch's first line,
        # past every done line — O(done) per claim, quadratic over a batch.
        rows = c.execute(
            "UPDATE lines SET state='leased', attempt=attempt+1 WHERE batch_seq=?1 AND line_no IN "
            "(SELECT line_no FROM lines INDEXED BY lines_pending "
            "WHERE batch_seq=?1 AND state='pending' ORDER BY line_no LIMIT ?2) "
            "RETURNING line_no, custom_id, body, attempt",
            (seq, n),
        ).fetchall()
        return sorted((Claimed(*r) for r in rows), key=lambda x: x.line_no)

    def release(self, seq: int | None = None) -> None:
        """The lines this process leased but will not finish (all at a graceful stop, or one
        batch's at a cancel) go back to pending."""
        with self.tx() as c:
            if seq is None:
                c.execute("UPDATE lines SET state='pending' WHERE state='leased'")
            else:
                c.execute(
                    "UPDATE lines SET state='pending' WHERE batch_seq=? AND state='leased'", (seq,)
                )

    # ---- finalize --------------------------------------------------------------------------

    def finalize(self, seq: int, final: str, when: int, ttl_s: int) -> BatchRow | None:
        """Writes the output and error files (kept `ttl_s` seconds, unless the batch named its
        own) and ends the batch in `final` (completed, cancelled or expired). Idempotent: a
        finished batch is returned as it is. None: not yet (a line is still leased)."""
        b = self.batch(seq)
        if b.status in TERMINAL:
            return b
        busy = "state != 'done'" if final == "completed" else "state = 'leased'"
        if self.conn.execute(
            f"SELECT 1 FROM lines WHERE batch_seq=? AND {busy} LIMIT 1", (seq,)
        ).fetchone():
            return None
        expires = when + (b.output_ttl or ttl_s)
        if final == "completed" and b.status != "finalizing":
            b = self.set_status(seq, "finalizing", when, ("in_progress",))
        out_id, err_id = output_ids(b.id)
        why = EXPIRED if final == "expired" else CANCELLED
        n_out, n_err = self._write_outputs(b, out_id, err_id, why)
        with self.tx() as c:
            files = []
            for fid, n, kind in ((out_id, n_out, "output"), (err_id, n_err, "error")):
                if n[0]:
                    name = f"{b.id}_{kind}.jsonl"
                    files.append((fid, b.owner, "batch_output", name, n[1], when, expires))
            c.executemany(
                "INSERT OR REPLACE INTO files (id, owner, purpose, filename, bytes, created_at, "
                "expires_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                files,
            )
            c.execute(
                f"UPDATE batches SET status=?, {final}_at=?, output_file_id=?, error_file_id=? "
                "WHERE seq=?",
                (final, when, out_id if n_out[0] else None, err_id if n_err[0] else None, seq),
            )
            c.execute("DELETE FROM lines WHERE batch_seq=?", (seq,))
            c.execute("DELETE FROM results WHERE batch_seq=?", (seq,))
        # The finished batch's pages go back to the file system (SPEC §16: nothing grows
        # without bound; the database holds unfinished work only).
        self.conn.executescript("PRAGMA incremental_vacuum;")  # steps it to the end
        return self.batch(seq)

    def _write_outputs(
        self, b: BatchRow, out_id: str, err_id: str, why: tuple[str, str]
    ) -> tuple[tuple[int, int], tuple[int, int]]:
        """(lines, bytes) written to the output and to the error file, in input order."""
        rows = self.conn.execute(
            "SELECT line_no, ok, record, custom_id FROM results WHERE batch_seq=?1 "
            "UNION ALL SELECT line_no, -1, NULL, custom_id FROM lines "
            "WHERE batch_seq=?1 AND state != 'done' ORDER BY line_no",
            (b.seq,),
        )
        with _Staged(self.files_dir / out_id) as out, _Staged(self.files_dir / err_id) as err:
            for _, ok, record, custom_id in rows:
                if ok == -1:
                    record = unfinished_record(line_id(b.id, custom_id), custom_id, why)
                (out if ok == 1 else err).write(record)
        fsync_dir(self.files_dir)
        return (out.lines, out.size), (err.lines, err.size)


class _Staged:
    """A JSONL file written to `<path>.tmp`, fsynced and renamed on a clean exit (removed if
    it got no line)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.lines = 0
        self.size = 0
        self._f = open(self.tmp, "wb")  # noqa: SIM115 - closed in __exit__

    def __enter__(self) -> _Staged:
        return self

    def write(self, record: bytes) -> None:
        self._f.write(record)
        self._f.write(b"\n")
        self.lines += 1
        self.size += len(record) + 1

    def __exit__(self, kind: object, *exc: object) -> None:
        f = self._f
        if kind is None and self.lines:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(self.tmp, self.path)
            return
        f.close()
        self.tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owned(owner: str | None) -> tuple[list[str], list[Any]]:
    return (["owner=?"], [owner]) if owner is not None else ([], [])


def _file_tail(row: FileRow) -> tuple[Any, ...]:
    return (
        row.id, row.owner, row.purpose, row.filename, row.bytes, row.created_at, row.expires_at
    )  # fmt: skip


def _batch_values(row: BatchRow) -> tuple[Any, ...]:
    return tuple(getattr(row, name) for name in _BATCH_COLUMNS.split(", "))


class Store:
    """The async face of a `BatchDb`: each call runs on the store's own thread, and a failure
    of the disk or the database comes out as the client's error (`faults.classify`: 507 or
    503, never a 500)."""

    #: Several gateways share this store (PostgreSQL): the runner polls it for batches and
    #: status changes made by its peers, and takes over the lines of a dead one.
    shared: bool = False
    #: `batch.store` as configured (a file path or a URL: never logged as it is).
    path: str
    #: Where uploads are staged before `add_file`.
    staging_dir: Path
    #: The file bytes live in this directory (SQLite), served with `sendfile`; else None and
    #: they are read through `read_chunk`.
    files_dir: Path | None = None

    def __init__(self, workers: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="batch-store")
        self._db: BatchDb | None = None

    @property
    def db(self) -> BatchDb:
        assert self._db is not None, "store not open"
        return self._db

    def _connect(self) -> BatchDb:
        raise NotImplementedError

    async def open(self) -> None:
        self._db = await self._run(self._connect)

    async def close(self) -> None:
        if self._db is not None:
            await self._run(self._db.close)
            self._db = None
        self._executor.shutdown(wait=True)

    async def _run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, partial(fn, *args, **kwargs))

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """Runs `fn` (a method of `self.db`) on the store's thread."""
        try:
            return await self._run(fn, *args, **kwargs)
        except Exception as exc:
            mapped = classify(exc)
            if mapped is None or mapped is exc:
                raise
            raise mapped from exc

    def call_sync(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """The same from another worker thread (the validator), blocking that thread only."""
        return self._executor.submit(fn, *args, **kwargs).result()


class SqliteStore(Store):
    """SQLite in WAL mode at `path`, file bytes in `<path>.files/` (one host)."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.files_dir = Path(path + ".files")
        self.staging_dir = self.files_dir

    def _connect(self) -> BatchDb:
        assert self.files_dir is not None
        return Database(self.path, self.files_dir)

    def file_path(self, file_id: str) -> Path:
        assert self.files_dir is not None
        return self.files_dir / file_id
