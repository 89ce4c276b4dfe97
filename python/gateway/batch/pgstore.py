"""The batch store on PostgreSQL: files, batches, lines and leases shared by every replica.

SPEC §14 "Across hosts": "`batch.store` may be a PostgreSQL URL (`postgresql://…`): files,
batches and line leases live there, so every replica answers every batch (a client behind a
load balancer never gets 404 for its own batch) and any replica runs its lines; a replica
killed mid-batch loses nothing: its leased lines are taken over within the lease time, each
`custom_id` still exactly once in the output."

The same interface as the SQLite store (`store.BatchDb`), with what several processes on
several hosts need:

- **Driver**: psycopg 3 with `psycopg_pool` (typed for `mypy --strict`, one API for the sync
  calls made here on the store's threads, a pool that checks its connections, the binary
  wheel bundles libpq). Every session has `statement_timeout` and
  `idle_in_transaction_session_timeout`, so a stuck statement cannot hold a row lock forever.
- **Replicas and leases**: each gateway registers a row in `replicas` and holds a session
  advisory lock on its own dedicated connection. A line is leased by an `UPDATE` that sets
  `state='leased'`, `holder` (the replica) and `attempt+1`, committed before it is sent.
  `heartbeat` (every `LEASE_S / 4`) renews the row and probes each peer: a peer whose advisory
  lock can be taken is dead (PostgreSQL frees it when the killed process's socket closes —
  `kill -9` is detected in about a second), a peer whose heartbeat is older than `LEASE_S` is
  presumed dead (a frozen process); either way its leased lines go back to `pending` and its
  validations are released, in one transaction.
- **Fencing**: a result is applied only if its line is still leased by this replica with the
  same attempt (`holder` and `attempt` are the fencing token): a replica that lost its lease
  (declared dead, then woken up) cannot write a result, and `results` is keyed by
  `(batch, custom_id)` with `ON CONFLICT DO NOTHING`, so no `custom_id` is output twice.
- **Cross-replica bound**: a claim runs under the batch row's lock (`FOR NO KEY UPDATE`, rows
  locked in `seq` order so two replicas never deadlock) and takes at most
  `in_flight_per_batch` minus the lines already leased by anyone.
- **File bytes** are 1 MiB `bytea` chunks (lz4 where the server has it): transactional,
  replicated with the database, removed with their file row. An upload is staged on local
  disk, then copied in one transaction per chunk (its row is `uploading` until the last);
  a row left `uploading` by a crash is removed by the janitor.
- **Migrations** are forward-only and versioned in `schema_migrations(version, breaking)`,
  applied at start under an advisory lock, each with its version row in one transaction; a
  database with a newer breaking version is refused with both versions named, a newer
  non-breaking one only warned about.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Final

import orjson
import psycopg
from psycopg_pool import ConnectionPool

from gateway.batch.records import CANCELLED, EXPIRED, line_id, unfinished_record
from gateway.batch.store import (
    ACTIVE,
    JANITOR_BATCH,
    STALE_UPLOAD_S,
    TERMINAL,
    BatchRow,
    Claimed,
    FileRow,
    LineResult,
    SchemaTooNew,
    Store,
    output_ids,
)

__all__ = ["LEASE_S", "MIGRATIONS", "PgDatabase", "PgStore", "is_postgres_url", "redact"]

log = logging.getLogger("gateway.batch")

#: A replica whose heartbeat is older than this is presumed dead (a frozen process; a killed
#: one is found through its advisory lock within a heartbeat).
LEASE_S: Final = 20
CHUNK_BYTES: Final = 1 << 20
_MIGRATE_LOCK: Final = 0x6777_6261_7463_6801  # "gwbatch" + 1: one migrator at a time

#: (version, breaking, SQL). Append only; a release never edits a shipped migration.
MIGRATIONS: Final[tuple[tuple[int, bool, str], ...]] = (
    (
        1,
        True,
        """
CREATE TABLE replicas (
    id text PRIMARY KEY,
    lock_key bigint NOT NULL,
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE files (
    seq bigserial PRIMARY KEY,
    id text NOT NULL UNIQUE,
    owner text NOT NULL,
    purpose text NOT NULL,
    filename text NOT NULL,
    bytes bigint NOT NULL,
    created_at bigint NOT NULL,
    expires_at bigint,
    ready boolean NOT NULL DEFAULT false
);
CREATE INDEX files_owner ON files (owner, seq);
CREATE INDEX files_expiry ON files (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE file_chunks (
    file_seq bigint NOT NULL REFERENCES files (seq) ON DELETE CASCADE,
    n integer NOT NULL,
    data bytea NOT NULL,
    PRIMARY KEY (file_seq, n)
);
ALTER TABLE file_chunks ALTER COLUMN data SET STORAGE EXTERNAL;
DO $$ BEGIN
    ALTER TABLE file_chunks ALTER COLUMN data SET COMPRESSION lz4;
EXCEPTION WHEN OTHERS THEN NULL;  -- a server built without lz4 keeps pglz
END $$;
CREATE TABLE batches (
    seq bigserial PRIMARY KEY,
    id text NOT NULL UNIQUE,
    owner text NOT NULL,
    endpoint text NOT NULL,
    input_file_id text NOT NULL,
    completion_window text NOT NULL,
    status text NOT NULL,
    model text,
    metadata text,
    errors text,
    output_file_id text,
    error_file_id text,
    created_at bigint NOT NULL,
    in_progress_at bigint,
    expires_at bigint,
    finalizing_at bigint,
    completed_at bigint,
    failed_at bigint,
    expired_at bigint,
    cancelling_at bigint,
    cancelled_at bigint,
    total bigint NOT NULL DEFAULT 0,
    completed bigint NOT NULL DEFAULT 0,
    failed bigint NOT NULL DEFAULT 0,
    input_tokens bigint NOT NULL DEFAULT 0,
    output_tokens bigint NOT NULL DEFAULT 0,
    total_tokens bigint NOT NULL DEFAULT 0,
    cached_tokens bigint NOT NULL DEFAULT 0,
    reasoning_tokens bigint NOT NULL DEFAULT 0,
    output_ttl bigint,
    validator text
);
CREATE INDEX batches_owner ON batches (owner, seq);
CREATE INDEX batches_active ON batches (seq)
    WHERE status NOT IN ('completed', 'failed', 'cancelled', 'expired');
CREATE TABLE lines (
    batch_seq bigint NOT NULL,
    line_no integer NOT NULL,
    custom_id text NOT NULL,
    body bytea NOT NULL,
    state text NOT NULL DEFAULT 'pending',
    attempt integer NOT NULL DEFAULT 0,
    holder text,
    PRIMARY KEY (batch_seq, line_no)
);
CREATE INDEX lines_pending ON lines (batch_seq, line_no) WHERE state = 'pending';
CREATE INDEX lines_leased ON lines (holder) WHERE state = 'leased';
CREATE INDEX lines_leased_batch ON lines (batch_seq) WHERE state = 'leased';
CREATE TABLE results (
    batch_seq bigint NOT NULL,
    custom_id text NOT NULL,
    line_no integer NOT NULL,
    attempt integer NOT NULL,
    ok boolean NOT NULL,
    record bytea NOT NULL,
    PRIMARY KEY (batch_seq, custom_id)
);
-- Churned tables: vacuumed after every 1,000 dead rows, not a fraction of the table.
ALTER TABLE lines SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE results SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
""",
    ),
)
SCHEMA_VERSION: Final = MIGRATIONS[-1][0]

_BATCH_COLUMNS: Final = (
    "seq, id, owner, endpoint, input_file_id, completion_window, status, model, metadata, "
    "errors, output_file_id, error_file_id, created_at, in_progress_at, expires_at, "
    "finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at, total, "
    "completed, failed, input_tokens, output_tokens, total_tokens, cached_tokens, "
    "reasoning_tokens, output_ttl"
)
_FILE_COLUMNS: Final = "seq, id, owner, purpose, filename, bytes, created_at, expires_at"
_ACTIVE: Final = tuple(sorted(ACTIVE))


def is_postgres_url(store: str) -> bool:
    """`batch.store` names a PostgreSQL database rather than a SQLite file."""
    return store.startswith(("postgresql://", "postgres://"))


def redact(url: str) -> str:
    """The URL without its password (for logs and `gateway check`)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://…"
    host = info.get("host", "")
    port = info.get("port", "")
    db = info.get("dbname", "")
    return f"postgresql://{host}{':' + str(port) if port else ''}/{db}"


def _session(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SET statement_timeout = '60s'")
    conn.execute("SET idle_in_transaction_session_timeout = '60s'")


class PgDatabase:
    """Every statement of the store on PostgreSQL, synchronous (called on `PgStore`'s
    threads); public for the store's test-suite."""

    def __init__(self, url: str, pool_size: int = 4) -> None:
        self.url = url
        self._life_lock = threading.Lock()
        self._life: psycopg.Connection[Any] | None = None
        self.replica_id = ""
        self._lock_key = 0
        self._migrate()
        self.pool: ConnectionPool[psycopg.Connection[Any]] = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            kwargs={"autocommit": True, "connect_timeout": 5},
            configure=_session,
            check=ConnectionPool.check_connection,
            open=True,
            timeout=10,
            name="gateway-batch",
        )
        self._register()

    # ---- connections, migrations, replicas -------------------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.url, autocommit=True, connect_timeout=5)
        _session(conn)
        return conn

    @contextlib.contextmanager
    def tx(self) -> Iterator[psycopg.Connection[Any]]:
        with self.pool.connection() as conn, conn.transaction():
            yield conn

    def _migrate(self) -> None:
        with self._connect() as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (_MIGRATE_LOCK,))
            try:
                conn.execute(
                    "CREATE TABLE IF NOT EXISTS schema_migrations (version integer PRIMARY KEY, "
                    "breaking boolean NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())"
                )
                rows = conn.execute("SELECT version, breaking FROM schema_migrations").fetchall()
                have = {v for v, _ in rows}
                newer = [(v, b) for v, b in rows if v > SCHEMA_VERSION]
                if any(b for _, b in newer):
                    top = max(v for v, _ in newer)
                    raise SchemaTooNew(
                        f"The batch store's schema is version {top}, newer than this gateway's "
                        f"({SCHEMA_VERSION}) and incompatible with it: it was migrated by a "
                        "newer release. Run that release, or point batch.store elsewhere."
                    )
                if newer:
                    top = max(v for v, _ in newer)
                    log.warning(
                        "batch store schema is newer than this gateway's (compatible)",
                        extra={"fields": {"store": top, "ours": SCHEMA_VERSION}},
                    )
                for version, breaking, sql in MIGRATIONS:
                    if version in have:
                        continue
                    with conn.transaction():
                        conn.execute(sql.encode())
                        conn.execute(
                            "INSERT INTO schema_migrations (version, breaking) VALUES (%s, %s)",
                            (version, breaking),
                        )
                    log.info("batch store migrated", extra={"fields": {"version": version}})
            finally:
                conn.execute("SELECT pg_advisory_unlock(%s)", (_MIGRATE_LOCK,))

    def _register(self) -> None:
        """A new identity: a dedicated connection holding the identity's advisory lock (freed
        by PostgreSQL when this process dies), then its row (so a row's lock is always held)."""
        old = self.replica_id
        if self._life is not None:
            with contextlib.suppress(psycopg.Error):
                self._life.close()
        self._life = self._connect()
        self.replica_id = "r" + secrets.token_hex(8)
        self._lock_key = secrets.randbits(62)
        self._life.execute("SELECT pg_advisory_lock(%s)", (self._lock_key,))
        with self.tx() as c:
            c.execute(
                "INSERT INTO replicas (id, lock_key) VALUES (%s, %s)",
                (self.replica_id, self._lock_key),
            )
            if old:  # the leases of our previous identity are void: their lines run again
                self._forget(c, old)

    @staticmethod
    def _forget(c: psycopg.Connection[Any], replica: str) -> int:
        cur = c.execute(
            "UPDATE lines SET state='pending', holder=NULL WHERE holder=%s AND state='leased'",
            (replica,),
        )
        c.execute("UPDATE batches SET validator=NULL WHERE validator=%s", (replica,))
        c.execute("DELETE FROM replicas WHERE id=%s", (replica,))
        return cur.rowcount

    def heartbeat(self) -> int:
        """Renews this replica's row and takes over the leases of dead peers; returns the
        number of lines returned to pending."""
        with self._life_lock:
            try:
                assert self._life is not None
                self._life.execute("SELECT 1")
                with self.tx() as c:
                    alive = c.execute(
                        "UPDATE replicas SET heartbeat_at=now() WHERE id=%s", (self.replica_id,)
                    ).rowcount
            except psycopg.OperationalError:
                alive = 0
            if not alive:
                # Declared dead (or our lock's connection dropped): our leases were, or are
                # now, void. A new identity; results of the old leases will be fenced off.
                log.warning("batch store: this replica's leases were lost; re-registering")
                self._register()
            return self._take_over()

    def _take_over(self) -> int:
        assert self._life is not None
        life = self._life
        peers = life.execute(
            "SELECT id, lock_key, heartbeat_at < now() - make_interval(secs => %s) "
            "FROM replicas WHERE id <> %s",
            (LEASE_S, self.replica_id),
        ).fetchall()
        taken = 0
        for peer, key, stale in peers:
            got = bool(_scalar(life.execute("SELECT pg_try_advisory_lock(%s)", (key,))))
            try:
                if got or stale:
                    with self.tx() as c:
                        n = self._forget(c, peer)
                    taken += n
                    log.warning(
                        "batch replica lost; its lines were taken over",
                        extra={"fields": {"replica": peer, "lines": n}},
                    )
            finally:
                if got:
                    life.execute("SELECT pg_advisory_unlock(%s)", (key,))
        return taken

    def close(self) -> None:
        with self._life_lock:
            with contextlib.suppress(psycopg.Error), self.tx() as c:
                self._forget(c, self.replica_id)
            if self._life is not None:
                with contextlib.suppress(psycopg.Error):
                    self._life.close()
                self._life = None
        self.pool.close()

    # ---- files -----------------------------------------------------------------------------

    def add_file(self, row: FileRow, staged: Path) -> FileRow:
        """Copies the staged upload in 1 MiB chunks, one transaction each (no 200 MB
        transaction); the row is visible once the last chunk is in."""
        with self.tx() as c:
            seq = _scalar(
                c.execute(
                    "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, "
                    "expires_at) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING seq",
                    (
                        row.id,
                        row.owner,
                        row.purpose,
                        row.filename,
                        0,
                        row.created_at,
                        row.expires_at,
                    ),
                )
            )
        try:
            with open(staged, "rb") as f:
                n = 0
                while data := f.read(CHUNK_BYTES):
                    with self.tx() as c:
                        c.execute(
                            "INSERT INTO file_chunks (file_seq, n, data) VALUES (%s, %s, %s)",
                            (seq, n, data),
                        )
                        c.execute(
                            "UPDATE files SET bytes = bytes + %s WHERE seq=%s", (len(data), seq)
                        )
                    n += 1
            with self.tx() as c:
                c.execute("UPDATE files SET ready=true WHERE seq=%s", (seq,))
        except BaseException:
            with contextlib.suppress(psycopg.Error), self.tx() as c:
                c.execute("DELETE FROM files WHERE seq=%s", (seq,))
            raise
        staged.unlink(missing_ok=True)
        return FileRow(seq, row.id, row.owner, row.purpose, row.filename, row.bytes,
                       row.created_at, row.expires_at)  # fmt: skip

    def get_file(self, file_id: str, owner: str | None) -> FileRow | None:
        sql = f"SELECT {_FILE_COLUMNS} FROM files WHERE id=%s AND ready"
        args: tuple[Any, ...] = (file_id,)
        if owner is not None:
            sql += " AND owner=%s"
            args += (owner,)
        with self.pool.connection() as c:
            found = c.execute(sql, args).fetchone()
        return FileRow(*found) if found else None

    def list_files(
        self, owner: str | None, purpose: str | None, after: str | None, limit: int, desc: bool
    ) -> tuple[list[FileRow], bool]:
        where: list[str] = ["ready"]
        args: list[Any] = []
        if owner is not None:
            where.append("owner=%s")
            args.append(owner)
        if purpose is not None:
            where.append("purpose=%s")
            args.append(purpose)
        if after is not None:
            anchor = self.get_file(after, owner)
            if anchor is None:
                return [], False
            where.append("seq < %s" if desc else "seq > %s")
            args.append(anchor.seq)
        sql = f"SELECT {_FILE_COLUMNS} FROM files WHERE {' AND '.join(where)}"
        sql += f" ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT %s"
        with self.pool.connection() as c:
            rows = c.execute(sql.encode(), (*args, limit + 1)).fetchall()
        return [FileRow(*r) for r in rows[:limit]], len(rows) > limit

    def delete_file(self, file_id: str, owner: str | None) -> bool:
        found = self.get_file(file_id, owner)
        if found is None:
            return False
        with self.tx() as c:
            c.execute("DELETE FROM files WHERE seq=%s", (found.seq,))
        return True

    def used_bytes(self, owner: str) -> int:
        with self.pool.connection() as c:
            n = _scalar(
                c.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE owner=%s", (owner,))
            )
        return int(n)

    def read_chunk(self, file_id: str, n: int) -> bytes | None:
        with self.pool.connection() as c:
            row = c.execute(
                "SELECT data FROM file_chunks WHERE n=%s AND file_seq = "
                "(SELECT seq FROM files WHERE id=%s)",
                (n, file_id),
            ).fetchone()
        return bytes(row[0]) if row else None

    def export(self, file_id: str, dest: Path) -> Path:
        """Copies the file's bytes to `dest` (a local temp file the validator reads)."""
        with open(dest, "wb") as f:
            n = 0
            while (data := self.read_chunk(file_id, n)) is not None:
                f.write(data)
                n += 1
        return dest

    def janitor(self, now: int) -> int:
        """Deletes expired files (never the input of a batch still running) and uploads a
        crash cut short; returns how many."""
        with self.tx() as c:
            cur = c.execute(
                "DELETE FROM files WHERE seq IN (SELECT seq FROM files WHERE "
                "((expires_at IS NOT NULL AND expires_at <= %s) OR (NOT ready AND created_at < %s))"
                " AND id NOT IN (SELECT input_file_id FROM batches WHERE status = ANY(%s)) "
                "LIMIT %s FOR UPDATE SKIP LOCKED)",
                (now, now - STALE_UPLOAD_S, list(_ACTIVE), JANITOR_BATCH),
            )
        return cur.rowcount

    # ---- batches ---------------------------------------------------------------------------

    def create_batch(self, row: BatchRow) -> BatchRow:
        names = _BATCH_COLUMNS.split(", ")[1:]
        values = tuple(getattr(row, n) for n in names)
        marks = ", ".join(["%s"] * len(values))
        with self.tx() as c:
            seq = _scalar(
                c.execute(
                    f"INSERT INTO batches ({', '.join(names)}, validator) VALUES ({marks}, %s) "
                    "RETURNING seq",
                    (*values, self.replica_id),
                )
            )
        return self.batch(seq)

    def batch(self, seq: int) -> BatchRow:
        with self.pool.connection() as c:
            row = c.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE seq=%s", (seq,))
            return BatchRow(*_one(row))

    def get_batch(self, batch_id: str, owner: str | None) -> BatchRow | None:
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id=%s"
        args: tuple[Any, ...] = (batch_id,)
        if owner is not None:
            sql += " AND owner=%s"
            args += (owner,)
        with self.pool.connection() as c:
            found = c.execute(sql.encode(), args).fetchone()
        return BatchRow(*found) if found else None

    def list_batches(
        self, owner: str | None, after: str | None, limit: int
    ) -> tuple[list[BatchRow], bool]:
        where: list[str] = []
        args: list[Any] = []
        if owner is not None:
            where.append("owner=%s")
            args.append(owner)
        if after is not None:
            anchor = self.get_batch(after, owner)
            if anchor is None:
                return [], False
            where.append("seq < %s")
            args.append(anchor.seq)
        sql = f"SELECT {_BATCH_COLUMNS} FROM batches"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT %s"
        with self.pool.connection() as c:
            rows = c.execute(sql.encode(), (*args, limit + 1)).fetchall()
        return [BatchRow(*r) for r in rows[:limit]], len(rows) > limit

    def status_counts(self) -> dict[str, int]:
        with self.pool.connection() as c:
            rows = c.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall()
        return {status: int(n) for status, n in rows}

    def unfinished(self) -> list[BatchRow]:
        with self.pool.connection() as c:
            rows = c.execute(
                f"SELECT {_BATCH_COLUMNS} FROM batches "
                "WHERE status NOT IN ('completed', 'failed', 'cancelled', 'expired') ORDER BY seq"
            ).fetchall()
        return [BatchRow(*r) for r in rows]

    def set_status(self, seq: int, status: str, when: int, only_from: Iterable[str]) -> BatchRow:
        assert status in ACTIVE | TERMINAL
        with self.tx() as c:
            c.execute(
                f"UPDATE batches SET status=%s, {status}_at=%s WHERE seq=%s AND status = ANY(%s)",
                (status, when, seq, list(only_from)),
            )
        return self.batch(seq)

    def cancel(self, seq: int, when: int) -> tuple[str, BatchRow]:
        with self.tx() as c:
            old = _scalar(
                c.execute("SELECT status FROM batches WHERE seq=%s FOR NO KEY UPDATE", (seq,))
            )
            if old in ("validating", "in_progress"):
                c.execute(
                    "UPDATE batches SET status='cancelling', cancelling_at=%s WHERE seq=%s",
                    (when, seq),
                )
        return old, self.batch(seq)

    # ---- validation ------------------------------------------------------------------------

    def claim_validation(self, seq: int) -> bool:
        """This replica validates the batch unless a live one already does."""
        with self.tx() as c:
            cur = c.execute(
                "UPDATE batches SET validator=%s WHERE seq=%s AND status='validating' "
                "AND (validator IS NULL OR validator=%s)",
                (self.replica_id, seq, self.replica_id),
            )
        return cur.rowcount == 1

    def reset_lines(self, seq: int) -> None:
        with self.tx() as c:
            c.execute("DELETE FROM lines WHERE batch_seq=%s", (seq,))
            c.execute("DELETE FROM results WHERE batch_seq=%s", (seq,))

    def insert_lines(self, seq: int, rows: Sequence[tuple[int, str, bytes]]) -> None:
        with (
            self.tx() as c,
            c.cursor().copy("COPY lines (batch_seq, line_no, custom_id, body) FROM STDIN") as copy,
        ):
            for n, cid, body in rows:
                copy.write_row((seq, n, cid, body))

    def begin(self, seq: int, total: int, model: str | None, when: int) -> BatchRow:
        with self.tx() as c:
            c.execute(
                "UPDATE batches SET total=%s, model=%s, status='in_progress', in_progress_at=%s, "
                "validator=NULL WHERE seq=%s AND status='validating'",
                (total, model, when, seq),
            )
            c.execute("UPDATE batches SET total=%s, model=%s WHERE seq=%s", (total, model, seq))
        return self.batch(seq)

    def fail(self, seq: int, errors: list[dict[str, Any]], when: int) -> BatchRow:
        with self.tx() as c:
            c.execute("DELETE FROM lines WHERE batch_seq=%s", (seq,))
            c.execute(
                "UPDATE batches SET status='failed', failed_at=%s, errors=%s, validator=NULL "
                "WHERE seq=%s AND status='validating'",
                (when, orjson.dumps(errors).decode(), seq),
            )
        return self.batch(seq)

    # ---- execution -------------------------------------------------------------------------

    def exchange(
        self, results: Sequence[LineResult], claims: Sequence[tuple[int, int]], per_batch: int
    ) -> tuple[list[LineResult], dict[int, list[Claimed]], set[int]]:
        claimed: dict[int, list[Claimed]] = {}
        exhausted: set[int] = set()
        me = self.replica_id
        with self.tx() as c:
            touched = sorted({r.batch_seq for r in results} | {seq for seq, _ in claims})
            if touched:  # one lock order for every replica: no deadlock between them
                c.execute(
                    "SELECT seq FROM batches WHERE seq = ANY(%s) ORDER BY seq FOR NO KEY UPDATE",
                    (touched,),
                )
            applied = self._apply(c, results, me)
            self._count(c, applied)
            replicas = max(1, int(_scalar(c.execute("SELECT COUNT(*) FROM replicas"))))
            # A replica's part of a batch's bound: the one committing results would otherwise
            # lease the freed slots again in the same transaction, and keep them all.
            mine = -(-per_batch // replicas)
            for seq, n in sorted(claims):
                claimed[seq], empty = self._claim(c, seq, n, per_batch, mine, me)
                if empty:
                    exhausted.add(seq)
        return applied, claimed, exhausted

    @staticmethod
    def _apply(
        c: psycopg.Connection[Any], results: Sequence[LineResult], me: str
    ) -> list[LineResult]:
        """Fenced: only lines still leased by this replica with the same attempt."""
        if not results:
            return []
        rows = c.execute(
            "WITH r AS (SELECT * FROM unnest(%s::bigint[], %s::int[], %s::int[], %s::text[], "
            "%s::bool[], %s::bytea[]) AS t(batch_seq, line_no, attempt, custom_id, ok, record)), "
            "d AS (UPDATE lines l SET state='done' FROM r WHERE l.batch_seq=r.batch_seq "
            "AND l.line_no=r.line_no AND l.attempt=r.attempt AND l.state='leased' "
            "AND l.holder=%s RETURNING l.batch_seq, l.line_no) "
            "INSERT INTO results (batch_seq, custom_id, line_no, attempt, ok, record) "
            "SELECT r.batch_seq, r.custom_id, r.line_no, r.attempt, r.ok, r.record "
            "FROM r JOIN d ON d.batch_seq=r.batch_seq AND d.line_no=r.line_no "
            "ON CONFLICT DO NOTHING RETURNING batch_seq, line_no",
            (
                [r.batch_seq for r in results],
                [r.line_no for r in results],
                [r.attempt for r in results],
                [r.custom_id for r in results],
                [r.ok for r in results],
                [r.record for r in results],
                me,
            ),
        ).fetchall()
        done = {(int(s), int(n)) for s, n in rows}
        return [r for r in results if (r.batch_seq, r.line_no) in done]

    @staticmethod
    def _count(c: psycopg.Connection[Any], applied: Sequence[LineResult]) -> None:
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
        if sums:
            with c.cursor() as cur:
                cur.executemany(
                    "UPDATE batches SET completed=completed+%s, failed=failed+%s, "
                    "input_tokens=input_tokens+%s, output_tokens=output_tokens+%s, "
                    "total_tokens=total_tokens+%s, cached_tokens=cached_tokens+%s, "
                    "reasoning_tokens=reasoning_tokens+%s WHERE seq=%s",
                    [(*sums[seq], seq) for seq in sorted(sums)],
                )

    @staticmethod
    def _claim(
        c: psycopg.Connection[Any], seq: int, n: int, per_batch: int, share: int, me: str
    ) -> tuple[list[Claimed], bool]:
        """Up to n pending lines, within the batch's cap over every replica and this
        replica's share of it; (lines, no pending line left)."""
        status = c.execute("SELECT status FROM batches WHERE seq=%s", (seq,)).fetchone()
        if status is None or status[0] != "in_progress":
            return [], False
        held, own = _one(
            c.execute(
                "SELECT COUNT(*), COUNT(*) FILTER (WHERE holder=%s) FROM lines "
                "WHERE batch_seq=%s AND state='leased'",
                (me, seq),
            )
        )
        k = min(n, per_batch - int(held), share - int(own))
        if k <= 0:
            return [], False
        rows = c.execute(
            "WITH c AS MATERIALIZED (SELECT line_no FROM lines WHERE batch_seq=%s "
            "AND state='pending' ORDER BY line_no LIMIT %s FOR UPDATE SKIP LOCKED) "
            "UPDATE lines l SET state='leased', attempt=l.attempt+1, holder=%s FROM c "
            "WHERE l.batch_seq=%s AND l.line_no=c.line_no "
            "RETURNING l.line_no, l.custom_id, l.body, l.attempt",
            (seq, k, me, seq),
        ).fetchall()
        lines = sorted(
            (Claimed(int(r[0]), r[1], bytes(r[2]), int(r[3])) for r in rows),
            key=lambda x: x.line_no,
        )
        return lines, len(lines) < k

    def release(self, seq: int | None = None) -> None:
        with self.tx() as c:
            if seq is None:
                c.execute(
                    "UPDATE lines SET state='pending', holder=NULL "
                    "WHERE holder=%s AND state='leased'",
                    (self.replica_id,),
                )
            else:
                c.execute(
                    "UPDATE lines SET state='pending', holder=NULL "
                    "WHERE batch_seq=%s AND holder=%s AND state='leased'",
                    (seq, self.replica_id),
                )

    # ---- finalize --------------------------------------------------------------------------

    def finalize(self, seq: int, final: str, when: int, ttl_s: int) -> BatchRow | None:
        """As SQLite's, in one transaction under the batch row's lock: whichever replica
        comes first writes the files; the others find the batch finished."""
        with self.tx() as c:
            found = c.execute(
                f"SELECT {_BATCH_COLUMNS} FROM batches WHERE seq=%s FOR UPDATE", (seq,)
            )
            b = BatchRow(*_one(found))
            if b.status in TERMINAL:
                return b
            busy = "state <> 'done'" if final == "completed" else "state = 'leased'"
            if c.execute(
                f"SELECT 1 FROM lines WHERE batch_seq=%s AND {busy} LIMIT 1".encode(), (seq,)
            ).fetchone():
                return None
            if final == "completed" and b.status == "in_progress":
                c.execute(
                    "UPDATE batches SET status='finalizing', finalizing_at=%s WHERE seq=%s",
                    (when, seq),
                )
            out_id, err_id = output_ids(b.id)
            why = EXPIRED if final == "expired" else CANCELLED
            expires = when + (b.output_ttl or ttl_s)
            ids: dict[bool, str | None] = {}
            for ok, fid, kind in ((True, out_id, "output"), (False, err_id, "error")):
                ids[ok] = self._write_output(c, b, ok, fid, kind, why, when, expires)
            c.execute(
                f"UPDATE batches SET status=%s, {final}_at=%s, output_file_id=%s, "
                "error_file_id=%s, validator=NULL WHERE seq=%s",
                (final, when, ids[True], ids[False], seq),
            )
            c.execute("DELETE FROM lines WHERE batch_seq=%s", (seq,))
            c.execute("DELETE FROM results WHERE batch_seq=%s", (seq,))
        return self.batch(seq)

    @staticmethod
    def _write_output(
        c: psycopg.Connection[Any],
        b: BatchRow,
        ok: bool,
        file_id: str,
        kind: str,
        why: tuple[str, str],
        when: int,
        expires: int,
    ) -> str | None:
        """The output (ok) or error file, in input order, as 1 MiB chunks; its id, or None
        if it got no line."""
        if ok:
            sql = "SELECT line_no, record, NULL FROM results WHERE batch_seq=%s AND ok"
            args: tuple[Any, ...] = (b.seq,)
        else:
            sql = (
                "SELECT line_no, record, NULL FROM results WHERE batch_seq=%s AND NOT ok "
                "UNION ALL SELECT line_no, NULL, custom_id FROM lines "
                "WHERE batch_seq=%s AND state <> 'done'"
            )
            args = (b.seq, b.seq)
        c.execute("DELETE FROM files WHERE id=%s", (file_id,))
        seq = _scalar(
            c.execute(
                "INSERT INTO files (id, owner, purpose, filename, bytes, created_at, expires_at, "
                "ready) VALUES (%s, %s, 'batch_output', %s, 0, %s, %s, true) RETURNING seq",
                (file_id, b.owner, f"{b.id}_{kind}.jsonl", when, expires),
            )
        )
        size = n = lines = 0
        buf = bytearray()
        with c.cursor(name=f"out_{kind}") as cur:
            cur.execute(f"{sql} ORDER BY line_no".encode(), args)
            for _, record, custom_id in cur:
                if record is None:
                    record = unfinished_record(line_id(b.id, custom_id), custom_id, why)
                buf += record
                buf += b"\n"
                lines += 1
                if len(buf) >= CHUNK_BYTES:
                    size += _put_chunk(c, seq, n, buf)
                    n += 1
                    buf = bytearray()
        if buf:
            size += _put_chunk(c, seq, n, buf)
        if not lines:
            c.execute("DELETE FROM files WHERE seq=%s", (seq,))
            return None
        c.execute("UPDATE files SET bytes=%s WHERE seq=%s", (size, seq))
        return file_id


def _one(cur: psycopg.Cursor[Any]) -> tuple[Any, ...]:
    row = cur.fetchone()
    assert row is not None
    return tuple(row)


def _scalar(cur: psycopg.Cursor[Any]) -> Any:
    """The first column of the one row a statement returns."""
    row = cur.fetchone()
    assert row is not None
    return row[0]


def _put_chunk(c: psycopg.Connection[Any], seq: int, n: int, data: bytearray) -> int:
    c.execute(
        "INSERT INTO file_chunks (file_seq, n, data) VALUES (%s, %s, %s)", (seq, n, bytes(data))
    )
    return len(data)


class PgStore(Store):
    """The PostgreSQL store's async face: calls run on a few threads, each with a pooled
    connection (an upload's copy does not hold up a group commit)."""

    shared = True

    def __init__(self, url: str, staging_dir: Path) -> None:
        super().__init__(workers=4)
        self.url = url
        self.path = url
        self.staging_dir = staging_dir
        self.files_dir = None

    def _connect(self) -> PgDatabase:
        self.staging_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.staging_dir.glob("*.tmp"):
            stale.unlink(missing_ok=True)
        return PgDatabase(self.url, pool_size=4)

    async def close(self) -> None:
        await super().close()
        shutil.rmtree(self.staging_dir, ignore_errors=True)
