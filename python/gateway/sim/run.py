"""Running the demo: backends, gateway and clients in this process, on one event loop.

`run_demo` starts the simulated backends and a `Server` over them, sends the scenario's
workload open loop (arrivals do not wait for answers), runs the scripted crash, submits the
re-judging batch through the Batch API, samples `GET /admin/state`'s document every 200 ms and
collects the gateway's typed events (`gateway.events`); it returns all of it as a
`DemoResult`, which `analysis` and `summary` read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import unquote

import aiohttp
import orjson

from gateway import __version__
from gateway.app import Gateway
from gateway.config import parse_config
from gateway.events import Events, GatewayEvent, ProbeFinished, RequestFinished
from gateway.server import Server
from gateway.sim.mock import MockBehavior, MockServer
from gateway.sim.report import fmt_ms, percentile
from gateway.sim.scenario import (
    BATCH_TTFT_MS,
    CHAT,
    COMPLEXITY_BY,
    CRASHED,
    DRAIN_LIMIT_S,
    HEAVY,
    HEAVY_BEHAVIOR,
    HEAVY_SLOTS,
    LIGHT,
    LIGHT_BEHAVIOR,
    LIGHT_KNEE,
    LIGHT_SLOTS,
    REALTIME_SHARE,
    REALTIME_TTFT_MS,
    REJUDGE_CANCEL_WAIT_S,
    REJUDGE_POLL_S,
    SAMPLE_EVERY_S,
    Job,
    Options,
    Script,
    config_yaml,
    plan_rejudge,
    plan_workload,
)

__all__ = [
    "DemoResult",
    "Event",
    "InstanceView",
    "LogCapture",
    "PoolView",
    "Rejudge",
    "Sample",
    "Snapshot",
    "run_demo",
    "snapshot_of",
]

# ---- what is observed ------------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """One request as its client saw it. Times are seconds from the start."""

    job: Job
    sent: float
    done: float | None = None
    status: int = 0
    ok: bool = False
    error: str | None = None  # error code, `stream_error`, `connection` or `cancelled`
    request_id: str | None = None
    pool: str | None = None
    instance: str | None = None
    waited_as: str | None = None
    decided: str | None = None  # X-Gateway-Complexity: "complex; rule"
    queue_ms: float | None = None
    affinity: str | None = None  # X-Gateway-Affinity: hit, spill or none

    @property
    def e2e_ms(self) -> float | None:
        return None if self.done is None else (self.done - self.sent) * 1000

    @property
    def service_ms(self) -> float | None:
        e2e = self.e2e_ms
        return None if e2e is None or self.queue_ms is None else max(e2e - self.queue_ms, 0.0)


@dataclass(slots=True)
class Rejudge:
    """The overnight re-judging, one Batch API batch, as its client saw it (times are
    seconds from the start)."""

    lines: int
    batch_id: str | None = None
    status: str = "not submitted"
    submitted: float | None = None
    finished: float | None = None
    progress: list[tuple[float, int, int]] = field(default_factory=list)  # t, done, failed
    output_lines: int = 0
    error_lines: int = 0
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.status in ("completed", "failed", "cancelled", "expired") or bool(self.error)


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One instance in one sample of the gateway's state."""

    name: str
    pool: str
    state: str
    in_flight: int
    max_concurrency: int
    consecutive_failures: int
    ejections: int
    # SPEC §17: the cap in force — an adaptive instance's current limit, else max_concurrency.
    concurrency_limit: int = 0
    adaptive: bool = False


@dataclass(frozen=True, slots=True)
class PoolView:
    """One pool in one sample of the gateway's state (counters are cumulative)."""

    queued_high: int
    queued_low: int
    granted_high: int
    granted_low: int
    forced_low: int


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The gateway's state (`GET /admin/state`) at time `t`."""

    t: float
    pools: dict[str, PoolView]
    instances: tuple[InstanceView, ...]


def snapshot_of(t: float, state: dict[str, Any]) -> Snapshot:
    """Reads the /admin/state document; counters beyond SPEC §7's shape default to 0."""
    pools: dict[str, PoolView] = {}
    instances: list[InstanceView] = []
    for name, p in state.get("pools", {}).items():
        queued = p.get("queued", {})
        granted = p.get("granted", {})
        pools[name] = PoolView(
            queued_high=int(queued.get("high", 0)),
            queued_low=int(queued.get("low", 0)),
            granted_high=int(granted.get("high", 0)),
            granted_low=int(granted.get("low", 0)),
            forced_low=int(p.get("forced_low_grants", 0)),
        )
        for inst in p.get("instances", []):
            if inst.get("removed"):
                continue
            cap = int(inst.get("max_concurrency", 1))
            instances.append(
                InstanceView(
                    name=str(inst["name"]),
                    pool=name,
                    state=str(inst["state"]),
                    in_flight=int(inst.get("in_flight", 0)),
                    max_concurrency=cap,
                    consecutive_failures=int(inst.get("consecutive_failures", 0)),
                    ejections=int(inst.get("ejections", 0)),
                    concurrency_limit=int(inst.get("concurrency_limit", cap)),
                    adaptive=bool(inst.get("adaptive", False)),
                )
            )
    return Snapshot(t, pools, tuple(instances))


@dataclass(frozen=True, slots=True)
class Event:
    """Something that happened, at `t` seconds from the start."""

    t: float
    what: str


class LogCapture(logging.Handler):
    """What the run observed of the gateway, for the report: each answered request and every
    probe result and instance change from the gateway's typed event stream
    (`gateway.events`), and any warning it logged (shown, not parsed, instead of printed
    over the progress line). Times are seconds since `wall_start` (a `time.time()`)."""

    def __init__(self, wall_start: float) -> None:
        super().__init__(logging.WARNING)
        self.wall_start = wall_start
        self.answered: dict[str, RequestFinished] = {}  # by request id
        self.probe_failures: list[tuple[float, str]] = []  # (t, instance)
        self.probe_changes: list[tuple[float, str, str]] = []  # (t, instance, new state)
        self.warnings: list[str] = []

    def t(self, event: GatewayEvent) -> float:
        """When `event` happened, in seconds since the start."""
        return event.at - self.wall_start

    def on_event(self, event: GatewayEvent) -> None:
        if isinstance(event, RequestFinished):
            self.answered[event.id] = event
        elif isinstance(event, ProbeFinished):
            if not event.ok:
                self.probe_failures.append((self.t(event), event.instance))
        else:
            self.probe_changes.append((self.t(event), event.instance, event.state))

    def emit(self, record: logging.LogRecord) -> None:
        t = record.created - self.wall_start
        self.warnings.append(f"{t:6.1f}s {record.name}: {record.getMessage()}")


@contextlib.contextmanager
def _captured_logs(capture: LogCapture, events: Events) -> Iterator[None]:
    """Subscribes `capture` to the gateway's events and routes the `gateway` and `aiohttp`
    loggers' warnings to it for the run (the access log stays quiet), then restores."""
    saved: list[tuple[logging.Logger, int, bool, list[logging.Handler]]] = []
    for name in ("gateway", "aiohttp"):
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate, logger.handlers[:]))
        logger.handlers = [capture]
        logger.propagate = False
        logger.setLevel(logging.WARNING)
    unsubscribe = events.subscribe(capture.on_event)
    try:
        yield
    finally:
        unsubscribe()
        for logger, level, propagate, handlers in saved:
            logger.handlers = handlers
            logger.propagate = propagate
            logger.setLevel(level)


@dataclass(slots=True)
class DemoResult:
    """Everything one run observed; the summary and the report are functions of it."""

    options: Options
    script: Script
    config_text: str
    capture: LogCapture
    rejudge: Rejudge
    samples: list[Sample] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    stopped_early: bool = False
    end: float = 0.0  # seconds from the start when the last answer came
    wall_s: float = 0.0
    summary: str = ""
    report_path: Path | None = None
    # Pool light's backends at the end: instance name → (prefix-cache hits, misses), in
    # prompt tokens (the engine model caches KV blocks).
    prefix_cache: dict[str, tuple[int, int]] = field(default_factory=dict)


# ---- running it ------------------------------------------------------------------------------


async def run_demo(
    options: Options, *, out: TextIO | None = None, stop: asyncio.Event | None = None
) -> DemoResult:
    """Runs the scenario: starts the backends and the gateway, sends the workload, runs the
    script, stops everything; returns what was observed. `stop` set early ends the workload
    (Ctrl-C)."""
    out = out if out is not None else sys.stdout
    stop = stop if stop is not None else asyncio.Event()
    wall0 = time.monotonic()
    jobs, script = plan_workload(options)
    mocks = [
        MockServer(_behavior(model, LIGHT_BEHAVIOR, options.seed * 100 + i))
        for i, (_, model) in enumerate(LIGHT)
    ] + [
        MockServer(_behavior(model, HEAVY_BEHAVIOR, options.seed * 100 + 10 + i))
        for i, (_, model) in enumerate(HEAVY)
    ]
    crashed = mocks[len(LIGHT) + [n for n, _ in HEAVY].index(CRASHED)]
    server: Server | None = None
    # The Batch API's store lives as long as the run (SPEC §14; nothing left behind).
    store_dir = tempfile.TemporaryDirectory(prefix="gateway-demo-")
    try:
        for m in mocks:
            await m.start()
        text = config_yaml(
            options,
            [m.url for m in mocks[: len(LIGHT)]],
            [m.url for m in mocks[len(LIGHT) :]],
            batch_store=str(Path(store_dir.name) / "batches.db"),
        )
        config = parse_config(text, env={}, source="demo config")
        server = Server(config, host="127.0.0.1", port=0)
        await server.start()
        rejudge_file = plan_rejudge(options)
        rejudge = Rejudge(lines=rejudge_file.count(b"\n"))
        _print_intro(out, options, script, jobs, server.port, rejudge.lines)
        result = DemoResult(options, script, text, LogCapture(time.time()), rejudge)
        await _drive(result, server.gateway, server.url, jobs, crashed, out, stop, rejudge_file)
        result.prefix_cache = {
            name: _prefix_cache(m) for (name, _), m in zip(LIGHT, mocks, strict=False)
        }
    finally:
        if server is not None:
            await server.shutdown()
        for m in mocks:
            await m.stop()
        store_dir.cleanup()
    result.wall_s = time.monotonic() - wall0
    return result


def _prefix_cache(mock: MockServer) -> tuple[int, int]:
    """(hits, misses) of the mock's prefix cache: prompt tokens for the engine model,
    requests for the plain mock."""
    engine = mock.engine
    if engine is not None:
        return engine.prefix_hits, engine.prefix_queries - engine.prefix_hits
    return mock.stats.prefix_hits, mock.stats.prefix_misses


def _behavior(model: str, shape: dict[str, Any], seed: int) -> MockBehavior:
    # log_size 0: the demo reads what the gateway says, not the mock's request log.
    return MockBehavior(model=model, seed=seed, log_size=0, **shape)


async def _drive(
    result: DemoResult,
    gateway: Gateway,
    base: str,
    jobs: Sequence[Job],
    crashed: MockServer,
    out: TextIO,
    stop: asyncio.Event,
    rejudge_file: bytes,
) -> None:
    """Sends the workload, runs the script and samples the state until every answer is in
    (and the re-judging batch, submitted through the Batch API at the start, is finished)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    capture = result.capture

    def now() -> float:
        return loop.time() - t0

    pending: set[asyncio.Task[None]] = set()
    finished = asyncio.Event()
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
    timeout = aiohttp.ClientTimeout(total=120)
    progress = _Progress(out, result, enabled=result.options.progress)
    with _captured_logs(capture, gateway.events):
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            sampler = asyncio.create_task(
                _sample(gateway, result, now, progress, finished), name="demo-sampler"
            )
            script = asyncio.create_task(
                _run_script(result, crashed, now, stop), name="demo-script"
            )
            rejudge = result.rejudge
            batch = asyncio.create_task(
                _rejudge(session, base, rejudge, rejudge_file, now), name="demo-rejudge"
            )
            try:
                for job in jobs:
                    delay = job.at - now()
                    if delay > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), delay)
                    if stop.is_set():
                        break
                    sample = Sample(job, now())
                    result.samples.append(sample)
                    task = asyncio.create_task(_send(session, base, sample, now))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                else:
                    # The workload is sent; wait (boundedly) for the answers still owed.
                    result.events.append(Event(now(), "workload sent; waiting for answers"))
                    deadline = now() + DRAIN_LIMIT_S
                    while (pending or not rejudge.done) and not stop.is_set() and now() < deadline:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(stop.wait(), 0.1)
                    if pending:
                        result.events.append(
                            Event(now(), f"stopped waiting: {len(pending)} answers still owed")
                        )
                result.stopped_early = stop.is_set()
            finally:
                for task in list(pending):
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                if not script.done():
                    script.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await script
                await _end_rejudge(session, base, rejudge, batch)
                result.end = now()
                finished.set()
                await sampler
                progress.clear()
            if crashed.refusing:
                await crashed.set_down(False)


async def _run_script(
    result: DemoResult, crashed: MockServer, now: Callable[[], float], stop: asyncio.Event
) -> None:
    """The scripted failure: crash one heavy instance, bring it back."""
    script = result.script
    for at, down in ((script.crash_at, True), (script.recover_at, False)):
        delay = at - now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return
        if down:
            dropped = crashed.stats.in_flight
            await crashed.set_down(True)
            result.events.append(
                Event(
                    now(),
                    f"{CRASHED} crashed: listener closed, {dropped} request(s) in flight dropped",
                )
            )
        else:
            await crashed.set_down(False)
            result.events.append(Event(now(), f"{CRASHED} restarted: accepting connections"))


async def _send(
    session: aiohttp.ClientSession,
    base: str,
    sample: Sample,
    now: Callable[[], float],
) -> None:
    """One request, timed; the result goes into `sample`."""
    job = sample.job
    headers = {"Content-Type": "application/json", "X-Priority": job.priority}
    body: dict[str, Any] = {
        "model": job.alias,
        "messages": [{"role": "user", "content": job.prompt}],
        "max_tokens": job.max_tokens,
    }
    if job.stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    try:
        async with session.post(
            base + "/v1/chat/completions", data=orjson.dumps(body), headers=headers
        ) as resp:
            h = resp.headers
            sample.status = resp.status
            sample.request_id = h.get("X-Request-Id")
            sample.pool = h.get("X-Gateway-Pool")
            sample.instance = h.get("X-Gateway-Instance")
            sample.waited_as = h.get("X-Gateway-Priority")
            sample.affinity = h.get("X-Gateway-Affinity")
            decided = h.get("X-Gateway-Complexity")
            # A rule naming a Chinese keyword arrives percent-encoded (headers are latin-1).
            sample.decided = None if decided is None else unquote(decided)
            queue_ms = h.get("X-Gateway-Queue-Ms")
            if queue_ms is not None:
                with contextlib.suppress(ValueError):
                    sample.queue_ms = float(queue_ms)
            raw = await resp.read()
            sample.done = now()
            if resp.status != 200:
                sample.error = _error_code(raw) or f"http_{resp.status}"
            elif job.stream and b'data: {"error"' in raw:
                # SPEC §6: a started stream that fails ends with an error event.
                sample.error = "stream_error"
            elif job.stream and not raw.rstrip().endswith(b"data: [DONE]"):
                sample.error = "stream_cut"
            else:
                sample.ok = True
    except asyncio.CancelledError:
        sample.error = "cancelled"
        raise
    except (aiohttp.ClientError, OSError) as exc:
        sample.done = now()
        sample.error = f"connection ({type(exc).__name__})"


def _error_code(raw: bytes) -> str | None:
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


class _ApiError(Exception):
    """A Batch API call the demo makes answered with an error."""


async def _api(session: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> dict[str, Any]:
    async with session.request(method, url, **kw) as resp:
        raw = await resp.read()
        if resp.status != 200:
            raise _ApiError(f"{method} {url.split('/v1', 1)[-1]}: HTTP {resp.status}")
    doc: dict[str, Any] = orjson.loads(raw)
    return doc


async def _rejudge(
    session: aiohttp.ClientSession,
    base: str,
    rejudge: Rejudge,
    data: bytes,
    now: Callable[[], float],
) -> None:
    """Submits the re-judging file as a batch (SPEC §14), then follows it to its end with
    `GET /v1/batches/{id}` as an OpenAI Batch API client does."""
    try:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", data, filename="rejudge.jsonl", content_type="application/jsonl")
        f = await _api(session, "POST", base + "/v1/files", data=form)
        spec = {
            "input_file_id": f["id"],
            "endpoint": CHAT,
            "completion_window": "24h",
            "metadata": {"job": "overnight re-judging"},
        }
        b = await _api(session, "POST", base + "/v1/batches", json=spec)
        rejudge.batch_id, rejudge.submitted = b["id"], now()
        while True:
            _progress(rejudge, b, now())
            if rejudge.done:
                break
            await asyncio.sleep(REJUDGE_POLL_S)
            b = await _api(session, "GET", f"{base}/v1/batches/{rejudge.batch_id}")
        rejudge.output_lines = await _count_lines(session, base, b.get("output_file_id"))
        rejudge.error_lines = await _count_lines(session, base, b.get("error_file_id"))
    except (aiohttp.ClientError, OSError, _ApiError, orjson.JSONDecodeError, KeyError) as exc:
        rejudge.error = str(exc) or type(exc).__name__


def _progress(rejudge: Rejudge, batch: dict[str, Any], t: float) -> None:
    rejudge.status = str(batch.get("status"))
    counts = batch.get("request_counts") or {}
    rejudge.progress.append((t, int(counts.get("completed", 0)), int(counts.get("failed", 0))))
    if rejudge.done and rejudge.finished is None:
        rejudge.finished = t


async def _count_lines(session: aiohttp.ClientSession, base: str, file_id: Any) -> int:
    if not isinstance(file_id, str):
        return 0
    async with session.get(f"{base}/v1/files/{file_id}/content") as resp:
        return (await resp.read()).count(b"\n") if resp.status == 200 else 0


async def _end_rejudge(
    session: aiohttp.ClientSession,
    base: str,
    rejudge: Rejudge,
    task: asyncio.Task[None],
) -> None:
    """A run stopped before the batch finished cancels it (SPEC §14: `cancelling` →
    `cancelled`, partial results kept) and gives it a moment to get there."""
    if not rejudge.done and rejudge.batch_id is not None:
        with contextlib.suppress(aiohttp.ClientError, OSError, _ApiError):
            await _api(session, "POST", f"{base}/v1/batches/{rejudge.batch_id}/cancel")
        await asyncio.wait([task], timeout=REJUDGE_CANCEL_WAIT_S)
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _sample(
    gateway: Gateway,
    result: DemoResult,
    now: Callable[[], float],
    progress: _Progress,
    finished: asyncio.Event,
) -> None:
    """Samples the gateway's state every 200 ms (and once more at the end)."""
    while True:
        assert gateway.admin is not None  # mounted by `Server`
        result.snapshots.append(snapshot_of(now(), gateway.admin.state()))
        progress.update(result.snapshots[-1], now())
        if finished.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(finished.wait(), SAMPLE_EVERY_S)


class _Progress:
    """One live status line: rewritten in place on a terminal, every 5 s otherwise."""

    def __init__(self, out: TextIO, result: DemoResult, enabled: bool) -> None:
        self.out = out
        self.result = result
        self.enabled = enabled
        self.tty = enabled and out.isatty()
        self.last = 0.0  # the first line once there is something to say
        self.width = 0

    def update(self, snap: Snapshot, t: float) -> None:
        if not self.enabled:
            return
        every = 0.5 if self.tty else 5.0
        if t - self.last < every:
            return
        self.last = t
        if self.tty:
            # A line wider than the terminal would wrap, and `\r` would then rewrite only
            # its last row: drop the least important parts until it fits.
            cols = shutil.get_terminal_size((120, 24)).columns - 1
            line = self.line(snap, t, cols)[:cols]
            self.out.write("\r" + line.ljust(self.width))
            self.width = len(line)
        else:
            self.out.write(self.line(snap, t) + "\n")
        self.out.flush()

    def line(self, snap: Snapshot, t: float, width: int = 1_000) -> str:
        """`t  done/sent failed | wait p50/p99 per class | queued per pool | instances`."""
        samples = self.result.samples
        done = [s for s in samples if s.done is not None]
        failed = sum(1 for s in done if not s.ok)
        head = f"{t:5.1f}s done {len(done)}/{len(samples)} failed {failed}"
        waits = "wait p50/p99"
        for cls, short in (("high", "rt"), ("low", "batch")):
            w = [s.queue_ms for s in done if s.job.priority == cls and s.queue_ms is not None]
            waits += f" {short} {_compact(percentile(w, 50))}/{_compact(percentile(w, 99))}"
        queues = "queued rt+batch " + " ".join(
            f"{name} {p.queued_high}+{p.queued_low}" for name, p in snap.pools.items()
        )
        instances = " ".join(
            f"{i.name} {i.in_flight}/{i.concurrency_limit or i.max_concurrency}"
            + ("" if i.state == "healthy" else f" {i.state.upper()}")
            for i in snap.instances
        )
        unwell = " ".join(
            f"{i.name} {i.state.upper()}" for i in snap.instances if i.state != "healthy"
        )
        states = unwell or "all instances healthy"
        r = self.result.rejudge
        rejudge = ""
        if r.progress:
            _, done_n, failed_n = r.progress[-1]
            rejudge = f"rejudge {done_n + failed_n}/{r.lines} {r.status}"
        # From the richest to the leanest; a narrow terminal gets the first that fits.
        variants = (
            (head, waits, queues, instances, rejudge),
            (head, waits, instances, rejudge),
            (head, waits, instances),
            (head, waits, states),
            (head, states),
        )
        lines = [" | ".join(x for x in v if x) for v in variants]
        return next((line for line in lines if len(line) <= width), lines[-1])

    def clear(self) -> None:
        if self.tty and self.width:
            self.out.write("\r" + " " * self.width + "\r")
            self.out.flush()
            self.width = 0


def _compact(ms: float) -> str:
    return fmt_ms(ms).replace(" ", "")


def _print_intro(
    out: TextIO,
    options: Options,
    script: Script,
    jobs: Sequence[Job],
    port: int,
    rejudge_lines: int,
) -> None:
    backlog = sum(1 for j in jobs if j.origin == "backlog")
    policy = "weighted 7:3" if options.policy == "weighted" else "strict"
    light = ", ".join(n for n, _ in LIGHT)
    heavy = ", ".join(n for n, _ in HEAVY)
    a, b = script.surge
    lines = [
        f"gateway {__version__} demo — backends, gateway and clients all in this process",
        f"  gateway   http://127.0.0.1:{port}  (GET /admin/state or open /dashboard meanwhile)",
        f"  pools     light: {light} (continuous-batching engines with a knee at "
        f"{LIGHT_KNEE} running; adaptive limit, at most {LIGHT_SLOTS})",
        f"            heavy: {heavy} ({HEAVY_SLOTS} slots each, ~600 ms heavy-tailed),"
        " fallback light",
        f"  policy    {policy} · balancer {options.balancer} · seed {options.seed}",
        f"  objective realtime {REALTIME_TTFT_MS / 1000:g} s, batch {BATCH_TTFT_MS / 1000:g} s to "
        "the first token (SPEC §17: earliest deadline first within a class)",
        f"  workload  {len(jobs)} requests in {options.duration:g} s: {backlog} batch queued at "
        f"once, a live stream at {options.rate:g}/s",
        f"            ({REALTIME_SHARE:.0%} realtime), an exam-deadline surge at {a:.3g}–{b:.3g} s",
        f"  failure   {CRASHED} crashes at {script.crash_at:.3g} s, restarts at "
        f"{script.recover_at:.3g} s",
        f"  routing   complexity {COMPLEXITY_BY}",
    ]
    if rejudge_lines:
        lines.append(
            f"  batch API the overnight re-judging: {rejudge_lines} lines in one batch "
            "(POST /v1/files, /v1/batches), run at low priority beside the backlog"
        )
    if options.progress:
        lines.append(
            "  progress  wait = queue wait p50/p99 per class · queued = realtime+batch per pool"
            " · in flight/slots per instance"
        )
    print("\n".join(lines), file=out, flush=True)
