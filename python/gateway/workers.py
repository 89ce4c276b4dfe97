"""SPEC §12: `gateway serve --workers N` — a supervisor and N worker processes that are one
gateway.

The supervisor creates the shared region (a sealed memfd, `_core.Region`: per pool the union
of the queues, per instance a lease word with one field per worker, health and probe words)
and one eventfd per worker slot, binds the port (`SO_REUSEPORT`; its own socket never listens,
it only keeps the port while workers come and go), and spawns the workers, passing them the
descriptors. Each worker runs the ordinary `Server`, its pools attached to the region: every
grant takes a unit from the shared lease word, and a unit a worker's own queue should not take
(the turn is a class only another worker has waiting, or a freed unit nobody here wants) is
announced by writing the waiting workers' eventfds. A worker ticks every 10 ms (heartbeat, and
the liveness net for a wake that raced). In `ps` a worker reads `… serve --worker 1/4 …`
(slot 1 of 4, as `/admin/state` numbers them) and in `top` `gw worker 1/4`.

Crash safety (design/workers.md §3): every unit is held in its owner's field of one atomic
word, so reclaiming a dead worker is clearing its fields. The supervisor watches each worker
through a pidfd (readable at exit, within milliseconds), reclaims its slot once the process is
gone (fenced: a dead process writes nothing more), wakes the others and spawns a replacement.
A worker whose heartbeat stops for `HANG_MS` is killed first; one that has not sent its first
heartbeat yet (it is still starting: imports, config, listening) has `START_ALLOWANCE_MS`
from its start instead, so a slow start on a loaded host is not taken for a hang. Workers die
with the supervisor (`PR_SET_PDEATHSIG`), and the memfd with its last descriptor.

Restart policy (SPEC §12): a dead worker is replaced at once, then with doubling back-off (up
to 30 s) while its replacements keep dying within seconds of starting; the supervisor never
exits because workers were killed (an OOM-killer storm must not stop the gateway), only on
SIGTERM/SIGINT or when every slot's worker reports the same start-up error (a bad config: the
worker writes it to the supervisor's directory before it exits). Replacements are counted in
`gateway_worker_restarts_total`: the supervisor serves no HTTP, so it keeps the count in a file
beside the metrics snapshots, which every worker's `/metrics` reads. The policy (when a slot
is started again, when a worker is hung, when the supervisor stops) is `RestartPolicy`, apart
from the processes and over a `Clock` the supervisor is handed, so it is tested with a manual
clock and fake deaths in one process.

Signals: SIGHUP to the supervisor reloads every worker; `POST /admin/reload` to any worker
reloads it and asks the supervisor (SIGUSR1) to reload the others; SIGTERM/SIGINT drain them
all (each worker drains as one gateway would, SPEC §7: a second signal, relayed, skips the
delay), then the supervisor exits. Workers run in their own process group, so a terminal's
Ctrl-C reaches them once, through the supervisor.

Platforms (SPEC §18): memfd, pidfd, eventfd and SO_REUSEPORT are Linux's; `unavailable()` says
what is missing, and nothing here calls them unless `--workers N > 1` was asked for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypedDict

from gateway import _core
from gateway.clock import LOOP_CLOCK, Clock, Timer
from gateway.topology import (
    _BATCH_ENV,
    _DIR_ENV,
    _ENV,
    _METRICS_ENV,
    WORKER_RESTARTS_FILE,
    WorkerLink,
    _report_path,
)

__all__ = [
    "HANG_MS",
    "START_ALLOWANCE_MS",
    "TICK_S",
    "RestartPolicy",
    "StartError",
    "Supervisor",
    "WorkerLink",
    "enter_worker",
    "resolve_workers",
    "unavailable",
]

log = logging.getLogger("gateway.workers")

#: A worker whose heartbeat is older than this is hung: killed, then reclaimed.
HANG_MS = 10_000
#: A worker that has not sent its first heartbeat (it is starting: imports, the config, its
#: pools, listening) is hung only this long after its start: a slow start on a loaded host is
#: not a hang (killing it would only start another slow start).
START_ALLOWANCE_MS = 60_000
#: How often the supervisor looks for hung workers.
HANG_CHECK_MS = 500
#: Each worker's tick: heartbeat, and the net under cross-worker wake-ups.
TICK_S = 0.010
#: SPEC §12 restart policy: a worker that dies sooner than this after its start died "within
#: seconds of starting"; its slot's next replacement waits (doubling from `BACKOFF_MS`, at most
#: `BACKOFF_MAX_MS`).
QUICK_DEATH_MS = 10_000
BACKOFF_MS = 1_000
BACKOFF_MAX_MS = 30_000


class Tuning(TypedDict, total=False):
    """The supervisor's timing, where the environment overrides it (tests run the policy in
    seconds): `GATEWAY_WORKER_HANG_MS`, `GATEWAY_WORKER_BACKOFF_MS`,
    `GATEWAY_WORKER_BACKOFF_MAX_MS`."""

    hang_ms: int
    backoff_ms: int
    backoff_max_ms: int


def tuning(env: Mapping[str, str]) -> Tuning:
    """The `Supervisor` keyword arguments `env` overrides, read by the composition root (the
    CLI) once — never at import."""
    out = Tuning()
    if env.get("GATEWAY_WORKER_HANG_MS"):
        out["hang_ms"] = int(env["GATEWAY_WORKER_HANG_MS"])
    if env.get("GATEWAY_WORKER_BACKOFF_MS"):
        out["backoff_ms"] = int(env["GATEWAY_WORKER_BACKOFF_MS"])
    if env.get("GATEWAY_WORKER_BACKOFF_MAX_MS"):
        out["backoff_max_ms"] = int(env["GATEWAY_WORKER_BACKOFF_MAX_MS"])
    return out


#: Where the supervisor's directory goes when it can: a memory file system. The workers rewrite
#: their files there several times a second (the cluster member's publication and every
#: worker's report: SPEC §12 × §13; the metrics snapshots): on tmpfs a 1 KB write in place
#: costs ~4 us, on a journaled disk (ext4: each write dirties the inode's mtime in the journal)
#: ~25 us with a tail of 0.1-8 ms that stalls the writer's event loop (measured here with other
#: work on the host). Elsewhere: the default temporary directory.
_MEMORY_DIRS = ("/dev/shm",)


def _memory_dir() -> str | None:
    for path in _MEMORY_DIRS:
        if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK):
            return path
    return None


def resolve_workers(value: str) -> int:
    """`--workers N` or `auto` (the CPUs this process may run on), 1..MAX_WORKERS."""
    if value == "auto":
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every CPU
        n = len(affinity(0)) if affinity is not None else os.cpu_count() or 1
    else:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--workers: {value!r} is not a number or 'auto'"
            ) from None
    if n < 1:
        raise argparse.ArgumentTypeError("--workers must be at least 1")
    return min(n, _core.MAX_WORKERS)


def unavailable() -> str | None:
    """SPEC §18: why `--workers N > 1` cannot run on this platform (None: it can). The shared
    region is a sealed memfd, each worker is watched through a pidfd and woken through an
    eventfd, and the workers share the port with SO_REUSEPORT: each is checked for and tried
    once (a Linux before 5.3 has the names but answers ENOSYS)."""
    missing = [
        name
        for name, there in (
            ("memfd_create", hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")),
            ("file seals", hasattr(fcntl, "F_ADD_SEALS")),
            ("pidfd_open", hasattr(os, "pidfd_open")),
            ("eventfd", hasattr(os, "eventfd")),
            ("SO_REUSEPORT", hasattr(socket, "SO_REUSEPORT")),
        )
        if not there
    ]
    if not missing:
        try:
            os.close(os.pidfd_open(os.getpid()))
        except OSError:
            missing.append("pidfd_open")
        try:
            fd = os.memfd_create("gateway-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            try:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
            finally:
                os.close(fd)
        except OSError:
            missing.append("memfd_create with seals")
    if not missing:
        return None
    return (
        f"this platform has no {', '.join(missing)} (Linux 5.3 or later has them all): "
        "serve with one process per port (--workers 1)"
    )


def enter_worker() -> WorkerLink | None:
    """At a worker's start: attach to the region, die with the supervisor. Returns this
    process's place among the workers (None: it is the whole gateway), for the composition
    root to hand down (`Topology.workers`)."""
    found = WorkerLink.from_env()
    if found is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        # What `top` and `ps -o comm` show (15 bytes at most); `ps` shows `--worker k/N`.
        name = f"gw worker {found.slot}/{found.workers}".encode()[:15]
        libc.prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    if os.getppid() != found.supervisor:
        os._exit(0)  # the supervisor died before the death signal was armed
    return found


@dataclass(frozen=True)
class StartError:
    """What a worker that could not start reported (SPEC §12: "a start-up error every worker
    reports alike")."""

    status: int
    reason: str


@dataclass
class _Life:
    """What the policy knows of one slot's latest worker."""

    started_ms: int = 0
    running: bool = False
    #: Deaths in a row, each within `QUICK_DEATH_MS` of its start (the back-off's exponent).
    quick_deaths: int = 0
    #: The start-up error its latest worker reported (None: it started, or died otherwise).
    start_error: StartError | None = None
    #: A replacement waiting out its back-off.
    respawn: Timer | None = None


class RestartPolicy:
    """SPEC §12's restart policy over `slots` worker slots, apart from the processes: told of
    each start (`started`) and death (`died`), it decides when the slot's replacement starts —
    at once, then with doubling back-off while replacements keep dying within seconds of
    starting — and has `respawn(slot)` called then, on `clock`; it says when a worker is hung
    (`hung`) and when the supervisor stops (only when every slot's worker reports the same
    start-up error). `restarts` counts the replacements (`gateway_worker_restarts_total`)."""

    def __init__(
        self,
        slots: int,
        clock: Clock,
        respawn: Callable[[int], None],
        *,
        backoff_ms: int = BACKOFF_MS,
        backoff_max_ms: int = BACKOFF_MAX_MS,
        hang_ms: int = HANG_MS,
        start_allowance_ms: int = START_ALLOWANCE_MS,
        quick_death_ms: int = QUICK_DEATH_MS,
    ) -> None:
        self.clock = clock
        self._respawn = respawn
        self.backoff_ms = backoff_ms
        self.backoff_max_ms = backoff_max_ms
        self.hang_ms = hang_ms
        self.start_allowance_ms = start_allowance_ms
        self.quick_death_ms = quick_death_ms
        self._lives = [_Life() for _ in range(slots)]
        #: Replacements started (SPEC §12 `gateway_worker_restarts_total`).
        self.restarts = 0
        self.stopped = False

    def started(self, slot: int) -> None:
        """The slot's worker (first or a replacement) was just started."""
        life = self._lives[slot]
        life.started_ms = self.clock.now_ms()
        life.running = True

    def died(self, slot: int, *, listened: bool, report: StartError | None) -> int | StartError:
        """The slot's worker is gone (`listened`: it had sent a heartbeat; `report`: the
        start-up error it left). Returns the ms until its replacement starts (scheduled), or
        the start-up error every slot now reports alike: then nothing is scheduled and the
        supervisor stops with it."""
        life = self._lives[slot]
        life.running = False
        life.start_error = None if listened else report
        lived = self.clock.now_ms() - life.started_ms
        # SPEC §12: "a dead worker is replaced at once, then with doubling back-off (up to
        # 30 s) while replacements keep dying within seconds of starting".
        life.quick_deaths = life.quick_deaths + 1 if lived < self.quick_death_ms else 1
        pause_ms = 0
        if life.quick_deaths > 1:
            pause_ms = min(self.backoff_max_ms, self.backoff_ms << min(life.quick_deaths - 2, 30))
        # SPEC §12: "the supervisor never exits because workers were killed ... only on
        # SIGTERM/SIGINT or a start-up error every worker reports alike (a bad config)". A
        # slot reports the error its latest worker left until a worker of it listens
        # (`listened`): a replacement still starting counts as its last report. (Counting
        # only slots that are all dead at once made the stop a matter of chance: with start-ups
        # slower than the back-off, some slot's replacement was always starting.)
        first = self._lives[0].start_error
        if first is not None and all(x.start_error == first for x in self._lives):
            return first
        if not self.stopped:
            life.respawn = self.clock.call_later(pause_ms, lambda: self._due(slot))
        return pause_ms

    def listened(self, slot: int) -> None:
        """The slot's running worker sent its first heartbeat (it listens): the error an
        earlier worker of the slot left is no longer the slot's report."""
        self._lives[slot].start_error = None

    def lived_ms(self, slot: int) -> int:
        """How long the slot's latest worker has been (or was) running."""
        return self.clock.now_ms() - self._lives[slot].started_ms

    def _due(self, slot: int) -> None:
        life = self._lives[slot]
        life.respawn = None
        if self.stopped or life.running:
            return
        self.restarts += 1
        self._respawn(slot)

    def hung(self, slot: int, beat: int) -> bool:
        """Whether the slot's running worker is hung, given its heartbeat word (0: none yet,
        else the worker's monotonic ms + 1): its last heartbeat is older than `hang_ms`; or,
        before its first one, its start is older than `start_allowance_ms`."""
        life = self._lives[slot]
        if not life.running:
            return False
        now = self.clock.now_ms()
        if beat == 0:  # still starting
            return now - life.started_ms > self.start_allowance_ms
        return now - max(beat - 1, life.started_ms) > self.hang_ms

    def stop(self) -> None:
        """No replacement starts any more (the ones waiting out a back-off are dropped)."""
        self.stopped = True
        for life in self._lives:
            if life.respawn is not None:
                life.respawn.cancel()
                life.respawn = None


@dataclass
class _Slot:
    index: int
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    pidfd: int = -1


class Supervisor:
    """Runs N workers of one `gateway serve` command line as one gateway (SPEC §12). `argv` is
    the workers' command line after `gateway`, with `serve` and without `--port`."""

    def __init__(
        self,
        workers: int,
        argv: list[str],
        host: str,
        port: int,
        *,
        backoff_ms: int = BACKOFF_MS,
        backoff_max_ms: int = BACKOFF_MAX_MS,
        hang_ms: int = HANG_MS,
        clock: Clock = LOOP_CLOCK,
    ) -> None:
        self.n = workers
        self.argv = argv
        self.host = host
        self.port = port
        self._slots = [_Slot(k) for k in range(workers)]
        # SPEC §12 restart policy, on the clock the supervisor's start hands down.
        self.clock = clock
        self.policy = RestartPolicy(
            workers,
            clock,
            self._respawn,
            backoff_ms=backoff_ms,
            backoff_max_ms=backoff_max_ms,
            hang_ms=hang_ms,
        )
        self._hang_check: Timer | None = None
        self._stopping = False
        self._shm = os.memfd_create("gateway-workers", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self._shm, _core.REGION_BYTES)
        # Sealed: nobody can shrink it under the others (a SIGBUS) or grow it.
        fcntl.fcntl(
            self._shm,
            fcntl.F_ADD_SEALS,
            fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL,
        )
        self.region = _core.Region(self._shm, workers)
        self._wake = tuple(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC) for _ in range(workers))
        self._sock = self._reserve_port()
        self.port = self._sock.getsockname()[1]
        self._done = asyncio.Event()
        self.reclaimed = 0
        #: Why the workers could not start (then the supervisor's exit status is its status).
        self.failure: StartError | None = None
        self._dir = tempfile.mkdtemp(prefix="gateway-workers-", dir=_memory_dir())
        self.batch_socket = os.path.join(self._dir, "batch.sock")
        # SPEC §12 /metrics of the whole gateway: each worker's snapshot (gateway.metrics).
        self.metrics_dir = os.path.join(self._dir, "metrics")
        os.mkdir(self.metrics_dir)
        self._count_restarts()  # 0 from the start, so a rate works from the first scrape

    def _reserve_port(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((self.host, self.port))
        return sock

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _spawn(self, slot: _Slot) -> None:
        slot.incarnation += 1
        fds = ",".join(str(fd) for fd in self._wake)
        env = dict(os.environ)
        env[_ENV] = f"{slot.index}:{slot.incarnation}:{self._shm}:{os.getpid()}:{fds}"
        env[_BATCH_ENV] = self.batch_socket
        env[_DIR_ENV] = self._dir
        env[_METRICS_ENV] = self.metrics_dir
        # `ps` says what each process is: `serve --worker 1/4` (slot 1 of 4), not the
        # operator's `--workers 4` (without setproctitle: the title is the command line).
        at = self.argv.index("serve") + 1
        argv = [sys.executable, "-m", "gateway.cli", *self.argv[:at]]
        argv += ["--worker", f"{slot.index}/{self.n}", *self.argv[at:], "--port", str(self.port)]
        # Its own process group: a terminal's Ctrl-C (SIGINT to the foreground group) reaches
        # the workers once, relayed by the supervisor, not twice (SPEC §7: a second signal
        # skips the drain delay).
        proc = subprocess.Popen(argv, env=env, pass_fds=(self._shm, *self._wake), process_group=0)
        slot.proc = proc
        self.policy.started(slot.index)
        slot.pidfd = os.pidfd_open(proc.pid)
        self.region.worker_start(slot.index, slot.incarnation, proc.pid)
        loop = asyncio.get_running_loop()
        loop.add_reader(slot.pidfd, self._exited, slot)
        log.info(
            "worker started",
            extra={
                "fields": {"worker": slot.index, "pid": proc.pid, "incarnation": slot.incarnation}
            },
        )

    def _exited(self, slot: _Slot) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(slot.pidfd)
        os.close(slot.pidfd)
        slot.pidfd = -1
        proc = slot.proc
        assert proc is not None
        code = proc.wait()  # reaped: fenced, it writes nothing more
        slot.proc = None
        listened = self.region.worker(slot.index)[3] != 0  # its first tick comes after listen
        units = self.region.reclaim(slot.index)
        self.reclaimed += units
        for fd in self._wake:  # the reclaimed units may serve someone waiting elsewhere
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)
        report = self._take_report(slot)
        if self._stopping:
            if all(s.proc is None for s in self._slots):
                self._done.set()
            return
        lived_ms = self.policy.lived_ms(slot.index)
        # SPEC §12: replaced at once, then with doubling back-off; never stopped because
        # workers were killed, only by a start-up error every worker reports alike.
        for other in self._slots:  # who listens now, not at the last hang check
            if other.proc is not None and self.region.worker(other.index)[3] != 0:
                self.policy.listened(other.index)
        verdict = self.policy.died(slot.index, listened=listened, report=report)
        alike = isinstance(verdict, StartError)
        fields: dict[str, object] = {
            "worker": slot.index,
            "code": code,
            "lived_s": round(lived_ms / 1000, 3),
            "reclaimed": units,
            "restart_in_ms": None if alike else verdict,
        }
        if report is not None:
            fields["reason"] = report.reason
        log.warning("worker died", extra={"fields": fields})
        if isinstance(verdict, StartError):
            log.error(
                "every worker reports the same start-up error: stopping",
                extra={"fields": {"status": verdict.status}},
            )
            self.failure = verdict
            self.stop()

    def _take_report(self, slot: _Slot) -> StartError | None:
        """The start-up error the slot's worker left before exiting (read once)."""
        path = _report_path(self._dir, slot.index)
        try:
            with open(path) as f:
                doc = json.load(f)
            os.unlink(path)
            return StartError(int(doc["status"]), str(doc["reason"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @property
    def restarts(self) -> int:
        """Replacements started (SPEC §12 `gateway_worker_restarts_total`)."""
        return self.policy.restarts

    def _respawn(self, index: int) -> None:
        """The policy's call: the slot's replacement is due (already counted)."""
        slot = self._slots[index]
        if not self._stopping and slot.proc is None:
            self._count_restarts()
            self._spawn(slot)

    def _count_restarts(self) -> None:
        """Every worker's /metrics reads this count (the supervisor serves no HTTP)."""
        path = os.path.join(self.metrics_dir, WORKER_RESTARTS_FILE)
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as f:
                f.write(str(self.restarts))
            os.replace(path + ".tmp", path)

    def _signal_all(self, sig: int, but: int | None = None) -> None:
        for slot in self._slots:
            if slot.proc is not None and slot.proc.pid != but:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(sig)

    def _check_hangs(self) -> None:
        """Every `HANG_CHECK_MS`: a worker the policy finds hung (its heartbeat stopped, or
        its start took longer than the start allowance) is killed, then reclaimed and
        replaced like any dead one."""
        self._hang_check = None
        if self._stopping:
            return
        try:
            for slot in self._slots:
                if slot.proc is None:
                    continue
                beat = self.region.worker(slot.index)[3]
                if beat != 0:
                    self.policy.listened(slot.index)
                if self.policy.hung(slot.index, beat):
                    starting = beat == 0
                    log.error(
                        "worker hung: killed",
                        extra={"fields": {"worker": slot.index, "starting": starting}},
                    )
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.kill()
        finally:  # a check that failed must not end the watch
            self._hang_check = self.clock.call_later(HANG_CHECK_MS, self._check_hangs)

    async def _ready(self) -> bool:
        """Every worker listening (its first heartbeat is written after it listens); False
        if the supervisor stops first."""
        while not self._stopping:
            if all(s.proc is not None and self.region.worker(s.index)[3] != 0 for s in self._slots):
                return True
            await asyncio.sleep(0.02)
        return False

    def stop(self) -> None:
        """Drains every worker (SIGTERM), then `run` returns."""
        if self._stopping:
            return
        self._stopping = True
        log.info("stopping workers")
        self.policy.stop()
        if self._hang_check is not None:
            self._hang_check.cancel()
            self._hang_check = None
        self._signal_all(signal.SIGTERM)
        if all(s.proc is None for s in self._slots):
            self._done.set()

    def _signalled(self) -> None:
        """SIGTERM/SIGINT: the first drains every worker; each later one is relayed (SPEC §7:
        the second skips the workers' drain delay, a third ends their drain)."""
        if self._stopping:
            self._signal_all(signal.SIGTERM)
        else:
            self.stop()

    async def run(self, on_listening: Callable[[Supervisor], None] | None = None) -> int:
        """Runs the workers until SIGTERM/SIGINT (0) or until every worker reports the same
        start-up error (its status)."""
        loop = asyncio.get_running_loop()
        for slot in self._slots:
            self._spawn(slot)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._signalled)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        loop.add_signal_handler(signal.SIGUSR1, self._signal_all, signal.SIGHUP)
        self._hang_check = self.clock.call_later(HANG_CHECK_MS, self._check_hangs)
        try:
            if await self._ready() and on_listening is not None and not self._stopping:
                on_listening(self)
            await self._done.wait()
        finally:
            if self._hang_check is not None:
                self._hang_check.cancel()
                self._hang_check = None
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
                loop.remove_signal_handler(sig)
            self._sock.close()
            shutil.rmtree(self._dir, ignore_errors=True)
        if self.failure is not None:
            print(f"workers cannot start: {self.failure.reason}", file=sys.stderr, flush=True)
            return self.failure.status or 1
        return 0
