"""The executor: validates new batches, then feeds their lines through `Gateway.call`.

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
- **Fairness.** Each batch runs under its own tenant index (`owners.batch_index`): the core's
  per-tenant round-robin shares the low queue between batches, and with the owner's live
  low-priority traffic. Claims rotate across batches when the global bound binds.
- **One pump, group commits.** A single task (`_pump`) hands finished lines to the store and
  leases the next ones in one transaction (`Store.exchange`) every `FLUSH_S` (50 ms), at
  `FLUSH_MAX` (100) results, or as soon as a batch has half its slots free.
- **Retries.** `Gateway.call` already retries an attempt on other instances and the fallback
  pool; on top of that a line that ends 408, 429 or 5xx is retried `MAX_LINE_RETRIES` times
  with exponential backoff and jitter, then written to the error file with the upstream's
  status. A 429 from the owner's own RPM/TPM limit is not a failure: the owner's lines wait
  for the `Retry-After` the limiter named (one probing request at a time while it holds), as
  do lines refused because the gateway itself is full (`queue_full`, `overloaded`).
- **Cancel** (`cancelling` → `cancelled`): no new line starts and no retry is made; lines
  already queued or in flight finish and keep their results. **Expiry** (`expires_at`, 24 h):
  lines still running are abandoned and every unfinished line goes to the error file as
  `batch_expired`. Both keep partial results (`Store.finalize`).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec

from gateway.auth import KeyRing, Tenant
from gateway.batch import owners
from gateway.batch.records import answer_record, line_id
from gateway.batch.store import BatchRow, Claimed, LineResult, Store, now_s
from gateway.batch.validate import Checked, LineError, Rules, check_file
from gateway.messages import ENDPOINTS, Endpoint

if TYPE_CHECKING:
    from gateway.app import Gateway

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

OnStatus = Callable[[str, str], None]


class Verdict(enum.Enum):
    DONE = "done"  # a final answer: success, or a failure that no retry would change
    RETRY = "retry"  # 408, 429 upstream, 5xx: retried with backoff, a bounded number of times
    LATER = "later"  # the owner's rate limit or a full gateway: wait, not a failure
    STOP = "stop"  # the gateway is draining: leave the line for the next start


class _Code(msgspec.Struct):
    code: str | int | None = None
    message: str | None = None


class _Body(msgspec.Struct):
    error: _Code | None = None


_error_body = msgspec.json.Decoder(_Body)
_RESET = re.compile(r"retry after (?:(\d+)ms|(?:(\d+)m)?(\d+)s)")


def _error(body: bytes) -> _Code:
    try:
        err = _error_body.decode(body).error
    except (msgspec.DecodeError, msgspec.ValidationError):
        return _Code()
    return err if err is not None else _Code()


def retry_after_s(message: str | None) -> float:
    """The wait the gateway's own 429 names ("retry after 850ms", "1s", "6m0s"), else 1 s."""
    m = _RESET.search(message or "")
    if m is None:
        return 1.0
    if m.group(1) is not None:
        return int(m.group(1)) / 1000
    return int(m.group(2) or 0) * 60 + int(m.group(3))


def verdict(status: int, body: bytes) -> tuple[Verdict, float]:
    """What to do with an answer of `Gateway.call`, and how long to wait first."""
    if 200 <= status < 300:
        return Verdict.DONE, 0.0
    if status in (429, 503):
        err = _error(body)
        if status == 429 and err.code == "rate_limited":
            return Verdict.LATER, retry_after_s(err.message)
        if err.code in ("queue_full", "overloaded"):
            return Verdict.LATER, BUSY_WAIT_S
        if err.code == "draining":
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
    awaiting: int = 0  # results buffered, not committed yet (their slots are still taken)
    exhausted: bool = False  # no pending line left to lease
    validating: bool = False
    cancelling: bool = False
    expired: bool = False
    finalizing: bool = False
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

    def __init__(self, gateway: Gateway, store: Store, on_status: OnStatus) -> None:
        self.gw = gateway
        self.store = store
        self.on_status = on_status
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
            run = _run_of(row)
            run.cancelling = row.status == "cancelling"
            run.exhausted = row.status == "finalizing"
            if run.cancelling:
                run.halt.set()
            self._runs[row.seq] = run
        loop = asyncio.get_running_loop()
        self._pump_task = loop.create_task(self._pump(), name="batch-pump")
        self._wake.set()

    def submit(self, row: BatchRow) -> None:
        """A new batch (status `validating`): check its file, then run it."""
        run = _run_of(row)
        run.validating = True
        self._runs[row.seq] = run
        self._spawn(self._validate(run), f"batch-validate-{row.id}")

    def cancel(self, seq: int) -> None:
        """The batch went `cancelling` (already in the store)."""
        run = self._runs.get(seq)
        if run is None or run.cancelling:
            return
        run.status = "cancelling"
        run.cancelling = True
        run.halt.set()
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
        if self._pump_task is not None:
            self._pump_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump_task
        await asyncio.gather(*self._aux, return_exceptions=True)
        results, self._buffer = self._buffer, []
        try:
            await self.store.call(self.store.db.exchange, results, [])
            await self.store.call(self.store.db.release)
        except Exception:
            log.exception("batch store: final commit failed (the lines will run again)")

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
        row = run.row
        db = self.store.db
        base = owners.base_tenant(self.gw.keys, row.owner)
        cfg = self.gw.runtime.config
        assert run.endpoint is not None  # the API admits only served endpoints
        rules = Rules(
            url=row.endpoint,
            endpoint=run.endpoint,
            models=owners.allowed_models(self.gw.runtime.router, base),
            max_lines=cfg.batch.max_lines,
            max_body_bytes=cfg.max_body_bytes,
        )
        await self.store.call(db.reset_lines, row.seq)

        def sink(chunk: list[tuple[int, str, bytes]]) -> None:
            self.store.call_sync(db.insert_lines, row.seq, chunk)

        path = self.store.file_path(row.input_file_id)
        try:
            checked = await asyncio.to_thread(check_file, path, rules, sink, self._abort)
        except OSError:
            message = "The input file could not be read (was it deleted?)."
            checked = Checked(errors=[LineError("file_not_found", message).doc(None)])
        if checked.aborted:
            return  # stopping: validated again at the next start
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
            except Exception:
                log.exception("batch group commit failed; retrying in 1 s")
                await asyncio.sleep(1.0)

    async def _cycle(self) -> None:
        """One group commit: results in, next lines out; then expiry and finalization."""
        self._expire()
        results, self._buffer = self._buffer, []
        self._first_at = None
        claims = self._claims()
        if results or claims:
            try:
                applied, claimed = await self.store.call(self.store.db.exchange, results, claims)
            except BaseException:
                self._buffer[:0] = results
                self._first_at = asyncio.get_running_loop().time()
                raise
            self._applied(results, applied)
            self._start_lines(claimed, dict(claims))
        self._finish_ready()

    def _limits(self) -> tuple[int, int]:
        """(lines one batch may hold, lines all batches may hold)."""
        cfg = self.gw.runtime.config
        half_low = max(1, cfg.scheduler.low.capacity // 2)
        per_batch = min(cfg.batch.in_flight_per_batch, half_low)
        return per_batch, max(per_batch, half_low)

    def _claims(self) -> list[tuple[int, int]]:
        if self._stopping:
            return []
        per_batch, budget = self._limits()
        runs = list(self._runs.values())
        budget -= sum(len(r.tasks) + r.awaiting for r in runs)
        if runs:
            self._rotate = (self._rotate + 1) % len(runs)
            runs = runs[self._rotate :] + runs[: self._rotate]
        out = []
        for run in runs:
            if run.status != "in_progress" or run.exhausted or run.halt.is_set():
                continue
            # The results of this group commit free their slots in the same transaction.
            n = min(per_batch - len(run.tasks), budget)
            if n > 0:
                out.append((run.seq, n))
                budget -= n
        return out

    def _applied(self, results: list[LineResult], applied: list[LineResult]) -> None:
        for r in results:
            run = self._runs.get(r.batch_seq)
            if run is not None:
                run.awaiting -= 1
        metrics = self.gw.metrics
        for r in applied:
            run = self._runs.get(r.batch_seq)
            if run is not None:
                if r.ok:
                    run.completed += 1
                else:
                    run.failed += 1
            metrics.batch_line_done(r.ok)

    def _start_lines(self, claimed: dict[int, list[Claimed]], asked: dict[int, int]) -> None:
        loop = asyncio.get_running_loop()
        for seq, lines in claimed.items():
            run = self._runs.get(seq)
            if run is None:
                continue
            if len(lines) < asked.get(seq, 0):
                run.exhausted = True
            if run.halt.is_set():
                continue  # cancelled meanwhile: these stay unfinished
            for line in lines:
                task = loop.create_task(self._line(run, line))
                run.tasks[line.line_no] = task

    def _finish_ready(self) -> None:
        if self._stopping:
            return
        for run in list(self._runs.values()):
            if run.finalizing or run.validating or run.tasks or run.awaiting:
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
        try:
            row = await self.store.call(self.store.db.finalize, run.seq, final, now_s())
        except Exception:
            log.exception("batch finalize failed; retrying", extra={"fields": {"batch": run.id}})
            await asyncio.sleep(TICK_S)
            run.finalizing = False
            self._wake.set()
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
        if result is not None:
            self._buffer.append(result)
            run.awaiting += 1
            if self._first_at is None:
                self._first_at = asyncio.get_running_loop().time()
        self._nudge(run)

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
        retries = tries = 0
        while not (run.halt.is_set() or self._stopping):
            tenant = self._tenant(run)
            if tenant is None:  # the owner's key is gone from the config: wait for it
                await self._nap(run, TICK_S)
                continue
            tries += 1
            request_id = f"{out_id}-{line.attempt}-{tries}"
            answer = await self._call(run, tenant, line.body, request_id)
            if answer is None:
                return None
            status, body = answer
            what, wait = verdict(status, body)
            if what is Verdict.STOP:
                # The gateway is draining: this process stops feeding lines in a moment.
                await self._nap(run, TICK_S)
                continue
            if what is Verdict.DONE or (what is Verdict.RETRY and retries >= MAX_LINE_RETRIES):
                return _result(run, line, out_id, status, request_id, body)
            if what is Verdict.RETRY:
                retries += 1
                self.gw.metrics.batch_line_retry()
                wait = backoff_s(retries)
            elif status == 429:
                self._hold(run.row.owner, wait)
                continue
            await self._nap(run, wait * random.uniform(1.0, 1.2))
        return None

    async def _call(
        self, run: _Run, tenant: Tenant, body: bytes, request_id: str
    ) -> tuple[int, bytes] | None:
        """`Gateway.call` at low priority; while the owner is held back by its rate limit,
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
                    return await self.gw.call(run.endpoint, body, tenant, request_id=request_id)
        return await self.gw.call(run.endpoint, body, tenant, request_id=request_id)

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
        """The owner's tenant under the batch's own fair-queue index (re-read after a reload:
        the owner's limits and aliases are the current ones)."""
        keys = self.gw.keys
        if run.ring is not keys:
            base = owners.base_tenant(keys, run.row.owner)
            run.tenant = None if base is None else owners.batch_tenant(base, run.seq)
            run.ring = keys
        return run.tenant


def _result(
    run: _Run, line: Claimed, out_id: str, status: int, request_id: str, body: bytes
) -> LineResult:
    ok, usage, record = answer_record(out_id, line.custom_id, status, request_id, body)
    return LineResult(run.seq, line.line_no, line.custom_id, line.attempt, ok, record, usage)
