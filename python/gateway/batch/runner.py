"""The executor: validates new batches, then feeds their lines through `Executor.call`.

SPEC §14: "Each line goes through the same routing, scheduling, retries and health as a live
request, as **low** priority (a key's default priority does not raise it), fed into the low
queue gradually so realtime traffic keeps its share and the queue never overflows because of
a batch."

- **Gradual feed.** A batch has at most `batch.in_flight_per_batch` lines leased at once —
  queued in the core, in flight upstream, backing off, or answered but not yet committed —
  and all batches together at most half the low queue (`scheduler.low.capacity`), so a
  50,000-line batch never fills it. A line's slot is freed only by the commit of its result:
  that is what bounds the lines a `kill -9` can make run twice (SPEC: "a line in flight at a
  crash is sent again at most once").
- **Fairness.** SPEC §14: "all batches of one key are one tenant of the low class (sixty
  batches from one key get one key's share, not sixty)". Every batch of an owner runs under
  the owner's one batch tenant index (`owners.batch_index`): the core's per-tenant
  round-robin shares the low queue between owners, and with live low-priority traffic. The
  global bound is split between owners first (each gets an equal part of it), then between
  an owner's batches, oldest first. A line answered `queue_timeout` (it waited its class's
  `max_wait_ms`) is re-queued, never failed, while its batch's window is open.
- **One pump, group commits.** A single task (`_pump`) hands finished lines to the store and
  leases the next ones in one transaction (`Store.exchange`) every `FLUSH_S` (50 ms), at
  `FLUSH_MAX` (100) results, or as soon as a batch has half its slots free.
- **Retries.** `Executor.call` already retries an attempt on other instances and the fallback
  pool; on top of that a line that ends 408, 429 or 5xx is retried `MAX_LINE_RETRIES` times
  with exponential backoff and jitter, then written to the error file with the upstream's
  status. A 429 from the owner's own RPM/TPM limit is not a failure: the owner's lines wait
  for the `Retry-After` the limiter named (one probing request at a time while it holds), as
  do lines refused because the gateway itself is full (`queue_full`, `overloaded`).
- **Cancel** (`cancelling` → `cancelled`), SPEC §14 "Cancel is prompt": every line of the
  batch not yet sent upstream — queued in the core, backing off, waiting for a rate limit — is
  withdrawn at once (its task cancelled; `Executor.call` hands back the exchange, so the runner
  sees whether an attempt started); lines already sent finish and keep their results, no retry
  is made; then its leases are released and the batch finalized with the results it has; the
  lines never answered go to the error file as `batch_cancelled`. **Expiry** (`expires_at`,
  24 h) withdraws every line, sent or not, and ends the batch with `batch_expired`.
- **Several replicas** (a shared store, PostgreSQL): a watch task renews this replica's
  heartbeat, takes over the leases of a dead peer (`BatchDb.heartbeat`) and every
  `WATCH_S` reads the unfinished batches: new ones (created through a peer) are validated by
  one replica (`claim_validation`) and run by all, a cancel made through a peer halts the
  lines here, a batch finished by a peer is dropped. A batch is finalized by whoever finds
  none of its lines leased; the others see it finished.
- **Store failures** (a full or read-only disk, a lost database) never leave a batch stuck:
  validation, group commits and finalization retry with exponential backoff (up to
  `RETRY_MAX_S`), with one log line when a failure starts and one when it ends, not a
  traceback per try; a validation that still fails after `VALIDATE_TRIES` ends the batch
  `failed` with the reason in its `errors`. A janitor deletes expired files every
  `JANITOR_S` (SPEC §14 "Quotas and expiry").
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from gateway.auth import KeyRing, Tenant
from gateway.batch import owners
from gateway.batch.faults import classify
from gateway.batch.records import answer_record, line_id
from gateway.batch.store import BatchRow, Claimed, LineResult, Store, new_id, now_s
from gateway.batch.validate import Checked, LineError, Rules, check_file
from gateway.errors import (
    DEFAULT_RETRY_AFTER_MS,
    Draining,
    Overloaded,
    QueueFull,
    QueueTimeout,
    RateLimited,
)
from gateway.messages import ENDPOINTS, Endpoint
from gateway.outcome import Answered, Outcome, Refused

if TYPE_CHECKING:
    from gateway.batch.ports import BatchPorts
    from gateway.exchange import Exchange

__all__ = ["Runner"]

log = logging.getLogger("gateway.batch")

FLUSH_S: Final = 0.05
FLUSH_MAX: Final = 100
TICK_S: Final = 1.0
MAX_LINE_RETRIES: Final = 3
BACKOFF_BASE_S: Final = 0.5
BACKOFF_MAX_S: Final = 30.0
# A line refused because the gateway itself is full waits this long (with jitter).
BUSY_WAIT_S: Final = 1.0
MAX_RUNNING_SHOWN: Final = 20
#: A shared store is read this often (peers' batches, cancels; heartbeat every other time).
WATCH_S: Final = 0.5
JANITOR_S: Final = 60.0
RETRY_BASE_S: Final = 1.0
RETRY_MAX_S: Final = 60.0
VALIDATE_TRIES: Final = 5

OnStatus = Callable[[str, str], None]
OnCounts = Callable[[dict[str, int]], None]


class Verdict(enum.Enum):
    DONE = "done"  # a final answer: success, or a failure that no retry would change
    RETRY = "retry"  # 408, 429 upstream, 5xx: retried with backoff, a bounded number of times
    LATER = "later"  # the owner's rate limit or a full gateway: wait, not a failure
    STOP = "stop"  # the gateway is draining: leave the line for the next start


def verdict(outcome: Outcome) -> tuple[Verdict, float]:
    """What to do with an outcome of `Executor.call`, and how long to wait first (read from
    the typed outcome: the refusal's domain error and the wait it names, never its text)."""
    status = outcome.status
    if isinstance(outcome, Answered):
        if 200 <= status < 300:
            return Verdict.DONE, 0.0
        return (Verdict.RETRY if status in (408, 429) or status >= 500 else Verdict.DONE), 0.0
    err = outcome.error
    if isinstance(err, RateLimited):  # the owner's RPM/TPM limit, or the upstreams' quota
        return Verdict.LATER, (outcome.retry_after_ms or DEFAULT_RETRY_AFTER_MS) / 1000
    if isinstance(err, (QueueFull, Overloaded)):
        return Verdict.LATER, BUSY_WAIT_S
    if isinstance(err, QueueTimeout):
        # SPEC §14: "a batch line never fails with `queue_timeout` while its window is
        # open": it is queued again (the window's end is the runner's expiry).
        return Verdict.LATER, 0.0
    if isinstance(err, Draining):
        return Verdict.STOP, 0.0
    if status in (408, 429) or status >= 500:
        return Verdict.RETRY, 0.0
    return Verdict.DONE, 0.0


def backoff_s(retry: int) -> float:
    """Exponential backoff with jitter before retry number `retry` (1-based)."""
    step: float = BACKOFF_BASE_S * 2.0 ** (retry - 1)
    return min(BACKOFF_MAX_S, step) * random.uniform(0.5, 1.0)


@dataclass(eq=False)
class _Throttle:
    """An owner held back by its own rate limit until `until` (loop time)."""

    until: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(eq=False)
class _Run:
    """A batch this process is working on."""

    row: BatchRow
    status: str
    endpoint: Endpoint | None
    expires_at: float
    total: int = 0
    completed: int = 0
    failed: int = 0
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    # Each running line's exchanges (one per try): an attempt started = sent upstream.
    seen: dict[int, list[Exchange]] = field(default_factory=dict)
    awaiting: int = 0  # results buffered, not committed yet (their slots are still taken)
    exhausted: bool = False  # no pending line left to lease
    validating: bool = False
    cancelling: bool = False
    expired: bool = False
    finalizing: bool = False
    not_before: float = 0.0  # finalize is retried from then (loop time)
    failures: int = 0  # finalizations failed in a row
    halt: asyncio.Event = field(default_factory=asyncio.Event)
    tenant: Tenant | None = None
    ring: KeyRing | None = None

    @property
    def seq(self) -> int:
        return self.row.seq

    @property
    def id(self) -> str:
        return self.row.id

    def doc(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "endpoint": self.row.endpoint,
            "owner": self.row.owner,
            "total": self.total,
            "completed": self.completed,
            "failed": self.failed,
            "in_flight": len(self.tasks),
            "created_at": self.row.created_at,
            "expires_at": self.row.expires_at,
        }


def _run_of(row: BatchRow) -> _Run:
    return _Run(
        row,
        row.status,
        ENDPOINTS.get(row.endpoint),
        float(row.expires_at or 0) or float("inf"),
        row.total,
        row.completed,
        row.failed,
    )


class Runner:
    """Every unfinished batch of one store, run by this process."""

    def __init__(
        self,
        ports: BatchPorts,
        store: Store,
        on_status: OnStatus,
        on_counts: OnCounts | None = None,
    ) -> None:
        self.ports = ports
        self.store = store
        self.on_status = on_status
        self.on_counts = on_counts
        self._watch_task: asyncio.Task[None] | None = None
        self._failing: set[str] = set()  # what is failing now (logged once, then on recovery)
        self._runs: dict[int, _Run] = {}
        self._buffer: list[LineResult] = []
        self._first_at: float | None = None
        self._wake = asyncio.Event()
        self._throttles: dict[str, _Throttle] = {}
        self._aux: set[asyncio.Task[None]] = set()  # validations and finalizations
        self._abort = threading.Event()
        self._stopping = False
        self._rotate = 0
        self._pump_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------------------------

    def start(self, unfinished: list[BatchRow]) -> None:
        """Resumes what a previous process left (SPEC §14: "a restart, even `kill -9`,
        resumes every unfinished batch"), then runs."""
        for row in unfinished:
            if row.status == "validating":
                self.submit(row)
                continue
            self._adopt(row)
        loop = asyncio.get_running_loop()
        self._pump_task = loop.create_task(self._pump(), name="batch-pump")
        self._watch_task = loop.create_task(self._watch(), name="batch-watch")
        self._wake.set()

    def _adopt(self, row: BatchRow) -> None:
        """Runs (or finishes) a batch validated already, here or by a peer."""
        run = _run_of(row)
        run.cancelling = row.status == "cancelling"
        run.exhausted = row.status == "finalizing"
        if run.cancelling:
            run.halt.set()
        self._runs[row.seq] = run

    def submit(self, row: BatchRow) -> None:
        """A new batch (status `validating`): check its file, then run it."""
        run = _run_of(row)
        run.validating = True
        self._runs[row.seq] = run
        self._spawn(self._validate(run), f"batch-validate-{row.id}")

    def cancel(self, seq: int) -> None:
        """The batch went `cancelling` (already in the store): its lines are withdrawn now
        (SPEC §14 "lines not yet sent are withdrawn at once")."""
        run = self._runs.get(seq)
        if run is None or run.cancelling:
            return
        run.status = "cancelling"
        run.cancelling = True
        run.halt.set()
        for line_no, task in run.tasks.items():
            if not any(ex.attempts for ex in run.seen.get(line_no, ())):
                task.cancel()  # not sent yet: withdrawn (in flight: it finishes)
        self._wake.set()

    async def drain(self, within_s: float) -> None:
        """Shutdown, step one: nothing new starts; lines already running get `within_s`
        seconds to finish (their results are kept)."""
        self._stopping = True
        self._abort.set()
        for run in self._runs.values():
            run.halt.set()
        tasks = [t for run in self._runs.values() for t in run.tasks.values()]
        if tasks and within_s > 0:
            await asyncio.wait(tasks, timeout=within_s)

    async def stop(self) -> None:
        """Shutdown, step two: abandons what still runs (those lines run again after the next
        start), commits every result in hand and releases the leases."""
        await self.drain(0)
        tasks = [t for run in self._runs.values() for t in run.tasks.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for background in (self._pump_task, self._watch_task):
            if background is not None:
                background.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await background
        await asyncio.gather(*self._aux, return_exceptions=True)
        results, self._buffer = self._buffer, []
        try:
            await self.store.call(self.store.db.exchange, results, [], 0)
            await self.store.call(self.store.db.release)
        except Exception as exc:
            log.error(
                "batch store: final commit failed (the lines will run again)",
                extra={"fields": {"reason": _reason(exc)}},
            )

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(self._guard(coro, name), name=name)
        self._aux.add(task)
        task.add_done_callback(self._aux.discard)

    @staticmethod
    async def _guard(coro: Coroutine[Any, Any, None], name: str) -> None:
        """A validation or finalization that fails is logged; the batch keeps its status and
        is taken up again at the next start (or, for finalize, the next tick)."""
        try:
            await coro
        except Exception:
            log.exception("batch task failed", extra={"fields": {"task": name}})

    # ---- what /admin/state shows -----------------------------------------------------------

    def running(self) -> list[dict[str, Any]]:
        """The batches being worked on (oldest first, at most `MAX_RUNNING_SHOWN`)."""
        runs = sorted(self._runs.values(), key=lambda r: r.seq)[:MAX_RUNNING_SHOWN]
        return [run.doc() for run in runs]

    def lines_in_flight(self) -> int:
        return sum(len(run.tasks) for run in self._runs.values())

    # ---- validation ------------------------------------------------------------------------

    async def _validate(self, run: _Run) -> None:
        """Validates with bounded retries: a store failure is retried with backoff, then ends
        the batch `failed` with the reason (SPEC §14: never stuck in `validating`)."""
        tries = 0
        reason = ""
        while True:
            try:
                await self._validate_once(run)
                self._recovered(f"validate {run.id}")
                return
            except Exception as exc:
                tries += 1
                if classify(exc) is None:
                    raise
                self._failed(f"validate {run.id}", exc)
                reason = _reason(exc)
                if tries >= VALIDATE_TRIES:
                    break
                if not await self._nap(run, _retry_wait(tries)):
                    return
        errors = [
            {
                "code": "store_error",
                "line": None,
                "message": "The batch store could not record the input's lines: " + reason,
                "param": None,
            }
        ]
        while True:  # ending it failed needs the store too: retried until it takes
            try:
                new = await self.store.call(self.store.db.fail, run.seq, errors, now_s())
                break
            except Exception as exc2:
                if classify(exc2) is None:
                    raise
                tries += 1
                if not await self._nap(run, _retry_wait(tries)):
                    return
        self._validated(run, new)

    async def _validate_once(self, run: _Run) -> None:
        row = run.row
        db = self.store.db
        if not await self.store.call(db.claim_validation, row.seq):
            self._runs.pop(row.seq, None)  # a live peer validates it
            return
        base = owners.base_tenant(self.ports.keys(), row.owner)
        cfg = self.ports.settings.config
        assert run.endpoint is not None  # the API admits only served endpoints
        rules = Rules(
            url=row.endpoint,
            endpoint=run.endpoint,
            models=owners.allowed_models(self.ports.settings.router, base),
            max_lines=cfg.batch.max_lines,
            max_body_bytes=cfg.max_body_bytes,
        )
        await self.store.call(db.reset_lines, row.seq)

        def sink(chunk: list[tuple[int, str, bytes]]) -> None:
            self.store.call_sync(db.insert_lines, row.seq, chunk)

        temp = self.store.staging_dir / f".input-{new_id('')}.tmp"
        try:
            path = await self.store.call(db.export, row.input_file_id, temp)
            try:
                checked = await asyncio.to_thread(check_file, path, rules, sink, self._abort)
            except FileNotFoundError:
                message = "The input file could not be read (was it deleted?)."
                checked = Checked(errors=[LineError("file_not_found", message).doc(None)])
        finally:
            await asyncio.to_thread(temp.unlink, True)
        if checked.aborted:
            return  # stopping: validated again at the next start (or by a peer)
        if checked.errors:
            new = await self.store.call(db.fail, row.seq, checked.errors, now_s())
        else:
            new = await self.store.call(db.begin, row.seq, checked.total, checked.model, now_s())
        self._validated(run, new)

    def _validated(self, run: _Run, new: BatchRow) -> None:
        """`new` is the batch just after `begin`/`fail`: its status says whether that moved it
        (validating → in_progress | failed) or a cancel came first (it stays `cancelling`,
        the count of which the cancel already moved); finalized as cancelled then."""
        run.validating = False
        if new.status in ("in_progress", "failed"):
            self.on_status("validating", new.status)
        if new.status == "failed":
            self._runs.pop(run.seq, None)
            return
        run.row = new
        run.total = new.total
        if not run.cancelling:
            run.status = new.status
        self._wake.set()

    # ---- the pump --------------------------------------------------------------------------

    async def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            timeout = TICK_S
            if self._first_at is not None:
                timeout = max(0.0, min(timeout, self._first_at + FLUSH_S - loop.time()))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self._cycle()
                self._recovered("commit")
                failures = 0
            except Exception as exc:
                if classify(exc) is None:
                    log.exception("batch group commit failed")
                else:
                    self._failed("commit", exc)
                failures += 1
                await asyncio.sleep(_retry_wait(failures))

    async def _cycle(self) -> None:
        """One group commit: results in, next lines out; then expiry and finalization."""
        self._expire()
        results, self._buffer = self._buffer, []
        self._first_at = None
        claims = self._claims()
        per_batch, _ = self._limits()
        if results or claims:
            try:
                applied, claimed, exhausted = await self.store.call(
                    self.store.db.exchange, results, claims, per_batch
                )
            except BaseException:
                self._buffer[:0] = results
                self._first_at = asyncio.get_running_loop().time()
                raise
            self._applied(results, applied)
            self._start_lines(claimed, exhausted)
        self._finish_ready()

    def _limits(self) -> tuple[int, int]:
        """(lines one batch may hold, lines all batches may hold)."""
        cfg = self.ports.settings.config
        half_low = max(1, cfg.scheduler.low.capacity // 2)
        per_batch = min(cfg.batch.in_flight_per_batch, half_low)
        return per_batch, max(per_batch, half_low)

    def _claims(self) -> list[tuple[int, int]]:
        """(batch, lines to lease) for this group commit: the global budget split equally
        between owners (rotating who goes first), each owner's part between its batches,
        oldest first (SPEC §14: a key's batches are one tenant, not one each)."""
        if self._stopping:
            return []
        per_batch, budget = self._limits()
        by_owner: dict[str, list[_Run]] = {}
        for run in sorted(self._runs.values(), key=lambda r: r.seq):
            budget -= len(run.tasks) + run.awaiting
            by_owner.setdefault(run.row.owner, []).append(run)
        owners_ = list(by_owner)
        if not owners_:
            return []
        self._rotate = (self._rotate + 1) % len(owners_)
        owners_ = owners_[self._rotate :] + owners_[: self._rotate]
        share = max(per_batch, -(-max(0, budget + self._held()) // len(owners_)))
        out = []
        for owner in owners_:
            runs = by_owner[owner]
            room = share - sum(len(r.tasks) + r.awaiting for r in runs)
            for run in runs:
                if run.status != "in_progress" or run.exhausted or run.halt.is_set():
                    continue
                # The results of this group commit free their slots in the same transaction.
                n = min(per_batch - len(run.tasks), budget, room)
                if n > 0:
                    out.append((run.seq, n))
                    budget -= n
                    room -= n
        return out

    def _held(self) -> int:
        return sum(len(r.tasks) + r.awaiting for r in self._runs.values())

    def _applied(self, results: list[LineResult], applied: list[LineResult]) -> None:
        for r in results:
            run = self._runs.get(r.batch_seq)
            if run is not None:
                run.awaiting -= 1
        metrics = self.ports.metrics
        for r in applied:
            run = self._runs.get(r.batch_seq)
            if run is not None:
                if r.ok:
                    run.completed += 1
                else:
                    run.failed += 1
            metrics.batch_line_done(r.ok)

    def _start_lines(self, claimed: dict[int, list[Claimed]], exhausted: set[int]) -> None:
        loop = asyncio.get_running_loop()
        for seq, lines in claimed.items():
            run = self._runs.get(seq)
            if run is None:
                continue
            if seq in exhausted:
                run.exhausted = True
            if run.halt.is_set():
                continue  # cancelled meanwhile: released by its finalize (error file)
            for line in lines:
                task = loop.create_task(self._line(run, line))
                run.tasks[line.line_no] = task
                task.add_done_callback(self._line_ended(run, line.line_no))

    def _finish_ready(self) -> None:
        if self._stopping:
            return
        now = asyncio.get_running_loop().time()
        for run in list(self._runs.values()):
            if run.finalizing or run.validating or run.tasks or run.awaiting:
                continue
            if now < run.not_before:
                continue
            if run.exhausted or run.halt.is_set():
                final = "expired" if run.expired else "cancelled" if run.cancelling else "completed"
                run.finalizing = True
                self._spawn(self._finalize(run, final), f"batch-finalize-{run.id}")

    async def _finalize(self, run: _Run, final: str) -> None:
        old = run.status
        if final == "completed" and old == "in_progress":
            self.on_status(old, "finalizing")
            run.status = old = "finalizing"
        loop = asyncio.get_running_loop()
        ttl = self.ports.settings.config.batch.output_ttl
        db = self.store.db
        try:
            if final != "completed":  # this replica's leases of a halted batch end here
                await self.store.call(db.release, run.seq)
            row = await self.store.call(db.finalize, run.seq, final, now_s(), ttl)
        except Exception as exc:
            # SPEC §14: never stuck in finalizing or cancelling — retried with backoff (the
            # results are kept; it completes once the store takes writes again).
            if classify(exc) is None:
                log.exception("batch finalize failed", extra={"fields": {"batch": run.id}})
            else:
                self._failed(f"finalize {run.id}", exc)
            run.failures += 1
            run.not_before = loop.time() + _retry_wait(run.failures)
            run.finalizing = False
            return
        self._recovered(f"finalize {run.id}")
        run.failures = 0
        if row is None:  # a line is still leased (by a peer), or pending again: not yet
            run.finalizing = False
            run.exhausted = False
            run.not_before = loop.time() + TICK_S
            return
        self.on_status(old, row.status)
        self._runs.pop(run.seq, None)
        log.info(
            "batch finished",
            extra={
                "fields": {
                    "batch": run.id,
                    "status": row.status,
                    "completed": row.completed,
                    "failed": row.failed,
                    "total": row.total,
                }
            },
        )

    # ---- a shared store: peers, takeovers, the janitor ------------------------------------

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        janitor_at = loop.time() + 1.0
        beat = 0
        while True:
            try:
                if self.store.shared:
                    beat += 1
                    taken = 0
                    if beat % 2 == 1:
                        taken = await self.store.call(self.store.db.heartbeat)
                    if taken:
                        for run in self._runs.values():
                            run.exhausted = False  # a dead peer's lines are pending again
                    await self._refresh()
                if loop.time() >= janitor_at:
                    janitor_at = loop.time() + JANITOR_S
                    n = await self.store.call(self.store.db.janitor, now_s())
                    if n:
                        log.info("expired batch files deleted", extra={"fields": {"files": n}})
                self._recovered("watch")
            except Exception as exc:
                if classify(exc) is None:
                    log.exception("batch watch failed")
                else:
                    self._failed("watch", exc)
            await asyncio.sleep(WATCH_S if self.store.shared else JANITOR_S / 4)

    async def _refresh(self) -> None:
        """Peers' changes: new batches, cancels, batches finished elsewhere."""
        db = self.store.db
        # Only runs known before the read can be missing from it because they finished (one
        # created meanwhile through this replica is not in the rows yet).
        before = set(self._runs)
        rows = await self.store.call(db.unfinished)
        if self.on_counts is not None:
            self.on_counts(await self.store.call(db.status_counts))
        seen = set()
        for row in rows:
            seen.add(row.seq)
            run = self._runs.get(row.seq)
            if run is None:
                if self._stopping:
                    continue
                if row.status == "validating":
                    run = _run_of(row)
                    run.validating = True
                    self._runs[row.seq] = run
                    self._spawn(self._validate(run), f"batch-validate-{row.id}")
                else:
                    self._adopt(row)
                continue
            if row.status == "cancelling" and not run.cancelling:
                self.cancel(row.seq)
            elif (
                row.status == "in_progress"
                and run.status != "in_progress"
                and not (run.validating or run.cancelling or run.finalizing)
            ):
                run.row, run.status, run.total = row, row.status, row.total
            if run.status == "in_progress" and not run.tasks:
                run.exhausted = False  # lines a peer gave back are leased again
        for seq, run in list(self._runs.items()):
            if seq in before and seq not in seen and not (run.validating or run.finalizing):
                run.halt.set()  # finished by a peer
                for task in run.tasks.values():
                    task.cancel()
                if not run.tasks:
                    self._runs.pop(seq, None)
        self._wake.set()

    def _failed(self, what: str, exc: BaseException) -> None:
        """One log line when `what` starts failing (not one per retry)."""
        if what not in self._failing:
            self._failing.add(what)
            log.error(
                "batch store failing; retrying with backoff",
                extra={"fields": {"task": what, "reason": _reason(exc)}},
            )

    def _recovered(self, what: str) -> None:
        if what in self._failing:
            self._failing.discard(what)
            log.info("batch store recovered", extra={"fields": {"task": what}})

    def _expire(self) -> None:
        """SPEC §14 / OpenAI: a batch still running at `expires_at` ends `expired`."""
        now = time.time()
        for run in self._runs.values():
            if run.status == "in_progress" and not run.expired and now >= run.expires_at:
                run.expired = True
                run.halt.set()
                for task in run.tasks.values():
                    task.cancel()

    # ---- one line --------------------------------------------------------------------------

    async def _line(self, run: _Run, line: Claimed) -> None:
        result: LineResult | None = None
        try:
            result = await self._execute(run, line)
        except asyncio.CancelledError:
            pass  # expired, or the gateway stopping: the line stays unfinished
        except Exception:
            log.exception("batch line failed", extra={"fields": {"batch": run.id}})
            body = b'{"error":{"message":"Internal gateway error.","code":"internal_error"}}'
            result = _result(run, line, line_id(run.id, line.custom_id), 500, "", body)
        finally:
            run.tasks.pop(line.line_no, None)
            run.seen.pop(line.line_no, None)
        if result is not None:
            self._buffer.append(result)
            run.awaiting += 1
            if self._first_at is None:
                self._first_at = asyncio.get_running_loop().time()
        self._nudge(run)

    def _line_ended(self, run: _Run, line_no: int) -> Callable[[asyncio.Task[None]], None]:
        """A line's task ended, however: its entry leaves `run.tasks`. `_line`'s `finally`
        does so for a task that ran; a task cancelled before its first step (a cancel or an
        expiry right after its lines were started) never enters `_line`, and its entry kept
        the batch from finalizing: stuck `cancelling` for good."""

        def ended(task: asyncio.Task[None]) -> None:
            if run.tasks.get(line_no) is task:
                del run.tasks[line_no]
                run.seen.pop(line_no, None)
                self._wake.set()

        return ended

    def _nudge(self, run: _Run) -> None:
        """Wakes the pump now, rather than at the next 50 ms tick, when waiting would leave
        slots idle or a batch unfinished."""
        per_batch, _ = self._limits()
        if (
            len(self._buffer) >= FLUSH_MAX
            or (not run.exhausted and len(run.tasks) <= per_batch // 2)
            or not run.tasks
        ):
            self._wake.set()

    async def _execute(self, run: _Run, line: Claimed) -> LineResult | None:
        """Sends one line until it has a final answer; None if abandoned (cancel, stop)."""
        assert run.endpoint is not None
        out_id = line_id(run.id, line.custom_id)
        seen = run.seen.setdefault(line.line_no, [])
        retries = tries = 0
        while not (run.halt.is_set() or self._stopping):
            tenant = self._tenant(run)
            if tenant is None:  # the owner's key is gone from the config: wait for it
                await self._nap(run, TICK_S)
                continue
            tries += 1
            request_id = f"{out_id}-{line.attempt}-{tries}"
            outcome = await self._call(run, tenant, line.body, request_id, seen)
            if outcome is None:
                return None
            what, wait = verdict(outcome)
            if what is Verdict.STOP:
                # The gateway is draining: this process stops feeding lines in a moment.
                await self._nap(run, TICK_S)
                continue
            if what is Verdict.DONE or (what is Verdict.RETRY and retries >= MAX_LINE_RETRIES):
                return _result(run, line, out_id, outcome.status, request_id, outcome.body)
            if what is Verdict.RETRY:
                retries += 1
                self.ports.metrics.batch_line_retry()
                wait = backoff_s(retries)
            elif isinstance(outcome, Refused) and isinstance(outcome.error, RateLimited):
                self._hold(run.row.owner, wait)
                continue
            await self._nap(run, wait * random.uniform(1.0, 1.2))
        return None

    async def _call(
        self, run: _Run, tenant: Tenant, body: bytes, request_id: str, seen: list[Exchange]
    ) -> Outcome | None:
        """`Executor.call` at low priority; while the owner is held back by its rate limit,
        one line at a time waits for the hold to end and probes."""
        assert run.endpoint is not None
        loop = asyncio.get_running_loop()
        throttle = self._throttles.get(run.row.owner)
        if throttle is not None and throttle.until > loop.time():
            async with throttle.lock:
                wait = throttle.until - loop.time()
                if wait > 0:
                    if not await self._nap(run, wait):
                        return None
                    return await self.ports.executor.call(
                        run.endpoint,
                        body,
                        tenant,
                        request_id=request_id,
                        seen=seen,
                        slo_ttft_ms=_window_left_ms(run),
                    )
        return await self.ports.executor.call(
            run.endpoint,
            body,
            tenant,
            request_id=request_id,
            seen=seen,
            slo_ttft_ms=_window_left_ms(run),
        )

    def _hold(self, owner: str, seconds: float) -> None:
        throttle = self._throttles.setdefault(owner, _Throttle())
        throttle.until = max(throttle.until, asyncio.get_running_loop().time() + seconds)

    async def _nap(self, run: _Run, seconds: float) -> bool:
        """Sleeps; False if the batch was halted (cancel, expiry, stop) meanwhile."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await run.halt.wait()
        return not (run.halt.is_set() or self._stopping)

    def _tenant(self, run: _Run) -> Tenant | None:
        """The owner's tenant under the owner's batch fair-queue index (re-read after a
        reload: the owner's limits and aliases are the current ones)."""
        keys = self.ports.keys()
        if run.ring is not keys:
            base = owners.base_tenant(keys, run.row.owner)
            run.tenant = None if base is None else owners.batch_tenant(base, run.row.owner)
            run.ring = keys
        return run.tenant


def _window_left_ms(run: _Run) -> int | None:
    """SPEC §14/§17: "each line carries a deadline from the batch's `completion_window`" —
    its objective is the time left until the window ends (None: the batch has no end)."""
    if run.expires_at == float("inf"):
        return None
    return max(1, int((run.expires_at - time.time()) * 1000))


def _result(
    run: _Run, line: Claimed, out_id: str, status: int, request_id: str, body: bytes
) -> LineResult:
    ok, usage, record = answer_record(out_id, line.custom_id, status, request_id, body)
    return LineResult(run.seq, line.line_no, line.custom_id, line.attempt, ok, record, usage)


def _retry_wait(failures: int) -> float:
    """Backoff before retry number `failures` of a failing store operation."""
    step: float = RETRY_BASE_S * 2.0 ** (failures - 1)
    return min(RETRY_MAX_S, step) * random.uniform(0.8, 1.0)


def _reason(exc: BaseException) -> str:
    """What a log line or a batch's `errors` says about a store failure (the client's message
    for a known one: no path, no URL)."""
    mapped = classify(exc)
    return mapped.message if mapped is not None else type(exc).__name__
