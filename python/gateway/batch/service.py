"""The Batch API's life in one gateway: its store, its runner and its counts.

The store is opened lazily: at `start()` only if `batch.store` already exists (there is work to
resume: SPEC §14 "a restart, even `kill -9`, resumes every unfinished batch"), else on the
first Batch API request — a gateway whose Batch API is never used creates no file. Once open,
the path is fixed until restart (a reload that changes `batch.store` is logged and ignored).

One process owns a SQLite store: an exclusive `flock` on `<store>.lock` (released by the kernel
when the process dies, `kill -9` included) keeps a second gateway on the same host from running
the same lines; it answers the Batch API with 503 `store_unavailable` and says why in its log.
Several replicas share a PostgreSQL store instead (`batch.store: postgresql://…`,
`pgstore.py`): it is opened at start (every replica runs lines and takes over a dead one's),
and an unreachable database is logged and retried at the next Batch API call, never a 500.

Batch counts by status are kept in memory (read from the store at open, then moved by every
transition; with a shared store re-read by the runner's watch, since peers move them too) so
`/admin/state` and `/metrics` read them without touching the disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import tempfile
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from gateway.batch.faults import StoreDown
from gateway.batch.runner import Runner
from gateway.batch.store import STATUSES, BatchRow, SchemaTooNew, SqliteStore, Store

if TYPE_CHECKING:
    from gateway.batch.ports import BatchPorts

__all__ = ["BatchService", "StoreUnavailable"]

log = logging.getLogger("gateway.batch")


class StoreUnavailable(StoreDown):
    """The batch store cannot be opened (held by another process, unreachable, too new):
    503 `store_unavailable` with the reason, never a 500."""


def is_postgres(store: str) -> bool:
    return store.startswith(("postgresql://", "postgres://"))


class BatchService:
    """Files and batches of one gateway (SPEC §14)."""

    def __init__(self, ports: BatchPorts) -> None:
        self.ports = ports
        self.store: Store | None = None
        self.runner: Runner | None = None
        self.counts: dict[str, int] = dict.fromkeys(STATUSES, 0)
        self._opening = asyncio.Lock()
        self._lock_file: IO[bytes] | None = None
        self._closed = False
        ports.metrics.watch_batches(lambda: self.counts)

    @property
    def path(self) -> str:
        return self.ports.settings.config.batch.store

    async def start(self) -> None:
        """Resumes the unfinished batches of an existing store (a PostgreSQL store is always
        opened: this replica runs lines and takes over a dead peer's)."""
        if self.ports.settings.config.cluster is not None and not is_postgres(self.path):
            # SPEC §14: "`cluster:` with a SQLite store serves batches per host and says so".
            log.warning(
                "batch.store is a SQLite file: each replica serves its own batches "
                "(a postgresql:// store shares them)"
            )
        if is_postgres(self.path) or await asyncio.to_thread(os.path.exists, self.path):
            try:
                await self.open()
            except StoreUnavailable as exc:
                log.error("batch store not opened", extra={"fields": {"reason": exc.message}})

    async def open(self) -> Store:
        """The store, opened (created if need be, and its batches resumed) on first use: an
        upload is what creates it."""
        if self.store is not None:
            if self.store.path != self.path:
                log.warning("batch.store changed: the new path applies after a restart")
            return self.store
        async with self._opening:
            if self.store is None:
                if self._closed:
                    raise StoreUnavailable("The gateway is shutting down.")
                await self._open(self.path)
        assert self.store is not None
        return self.store

    async def existing(self) -> Store | None:
        """The store if there is one (opened on first use); None while none was ever created
        — a read never creates it (no file in the working directory for a mere `GET`)."""
        if (
            self.store is None
            and not is_postgres(self.path)
            and not await asyncio.to_thread(os.path.exists, self.path)
        ):
            return None
        return await self.open()

    async def _open(self, path: str) -> None:
        store: Store
        if is_postgres(path):
            from gateway.batch.pgstore import PgStore  # psycopg: only with a PostgreSQL store

            staging = await asyncio.to_thread(tempfile.mkdtemp, prefix="gateway-batch-")
            store = PgStore(path, Path(staging))
        else:
            self._lock_file = await asyncio.to_thread(_lock, path)
            store = SqliteStore(path)
        try:
            await store.open()
            counts = await store.call(store.db.status_counts)
            unfinished = await store.call(store.db.unfinished)
        except SchemaTooNew as exc:
            await store.close()
            self._unlock()
            log.error("batch store refused", extra={"fields": {"reason": str(exc)}})
            raise StoreUnavailable(str(exc)) from exc
        except Exception as exc:
            await store.close()
            self._unlock()
            # The reason without the URL or path (a URL may carry a password).
            reason = type(exc).__name__ + ": " + str(exc).replace(path, "<batch.store>")
            log.error("batch store failed to open", extra={"fields": {"reason": reason}})
            raise StoreUnavailable(
                "The batch store could not be opened; the operator's log says why.",
                retry_after_ms=5000,
            ) from exc
        self.counts = dict.fromkeys(STATUSES, 0) | counts
        self.store = store
        self.runner = Runner(self.ports, store, self.transition, self._recount)
        self.runner.start(unfinished)
        if unfinished:
            log.info("batches resumed", extra={"fields": {"batches": len(unfinished)}})

    def transition(self, old: str, new: str) -> None:
        """A batch moved from status `old` to `new` ("" for a new batch)."""
        if old == new:
            return
        # No clamping at 0: the runner and a cancel may report one batch's two moves in either
        # order; the sums come out right once both are in.
        if old:
            self.counts[old] = self.counts.get(old, 0) - 1
        self.counts[new] = self.counts.get(new, 0) + 1

    def _recount(self, counts: dict[str, int]) -> None:
        """A shared store's counts, as read by the runner's watch."""
        self.counts = dict.fromkeys(STATUSES, 0) | counts

    def submit(self, row: BatchRow) -> None:
        self.transition("", row.status)
        assert self.runner is not None
        self.runner.submit(row)

    async def drain(self, within_s: float) -> None:
        """SIGTERM: no new line starts; running lines get `within_s` seconds to finish."""
        if self.runner is not None:
            await self.runner.drain(within_s)

    async def stop(self) -> None:
        """Commits what is in hand, releases unfinished leases and closes the store."""
        self._closed = True
        async with self._opening:
            if self.runner is not None:
                await self.runner.stop()
                self.runner = None
            if self.store is not None:
                await self.store.close()
                self.store = None
            self._unlock()

    def _unlock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing the descriptor drops the flock
            self._lock_file = None

    def state(self) -> tuple[dict[str, int], list[dict[str, Any]]]:
        """(counts by status, the running batches with their progress) for /admin/state."""
        running = self.runner.running() if self.runner is not None else []
        return dict(self.counts), running


def _lock(path: str) -> IO[bytes]:
    """An exclusive, non-blocking lock on `<path>.lock`, held while the file stays open."""
    lock_path = Path(path + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    f = open(lock_path, "ab")  # noqa: SIM115 - kept open: the lock lives as long as it
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise StoreUnavailable(
            "The batch store is in use by another gateway process on this host (a SQLite "
            "store serves one process; several replicas need batch.store: postgresql://…).",
            retry_after_ms=5000,
        ) from None
    with contextlib.suppress(OSError):
        f.truncate(0)
        f.write(f"{os.getpid()}\n".encode())
        f.flush()
    return f
