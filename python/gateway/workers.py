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
the liveness net for a wake that raced).

Crash safety (design/workers.md §3): every unit is held in its owner's field of one atomic
word, so reclaiming a dead worker is clearing its fields. The supervisor watches each worker
through a pidfd (readable at exit, within milliseconds), reclaims its slot once the process is
gone (fenced: a dead process writes nothing more), wakes the others and spawns a replacement.
A worker whose heartbeat stops for `HANG_MS` is killed first. Workers die with the supervisor
(`PR_SET_PDEATHSIG`), and the memfd with its last descriptor.

Signals: SIGHUP to the supervisor reloads every worker; `POST /admin/reload` to any worker
reloads it and asks the supervisor (SIGUSR1) to reload the others; SIGTERM/SIGINT drain them
all, then the supervisor exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway import _core

__all__ = ["HANG_MS", "TICK_S", "Supervisor", "WorkerLink", "link", "resolve_workers"]

log = logging.getLogger("gateway.workers")

#: A worker whose heartbeat is older than this is hung: killed, then reclaimed (the
#: environment variable `GATEWAY_WORKER_HANG_MS` overrides it, e.g. for tests).
HANG_MS = int(os.environ.get("GATEWAY_WORKER_HANG_MS", "10000"))
#: Each worker's tick: heartbeat, and the net under cross-worker wake-ups.
TICK_S = 0.010
#: A worker that dies sooner than this after its start is restarted after a pause (no spin).
_CRASH_LOOP_S = 1.0
#: A slot whose worker died this many times in a row before it ever listened: the gateway
#: cannot start (bad environment, a port taken by another program); the supervisor gives up.
_FAILED_STARTS = 3
_ENV = "GATEWAY_WORKER"
_BATCH_ENV = "GATEWAY_WORKER_BATCH_SOCKET"

_link: WorkerLink | None = None


def link() -> WorkerLink | None:
    """This process's place among the workers, or None when it is the whole gateway."""
    return _link


def resolve_workers(value: str) -> int:
    """`--workers N` or `auto` (the CPUs this process may run on), 1..MAX_WORKERS."""
    if value == "auto":
        n = len(os.sched_getaffinity(0))
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


@dataclass
class WorkerLink:
    """A worker's side: its slot, the region and every slot's eventfd."""

    slot: int
    incarnation: int
    region: _core.Region
    wake_fds: tuple[int, ...]
    supervisor: int
    #: SPEC §14 with workers: worker 0 serves the Batch API on this Unix socket, the others
    #: relay to it.
    batch_socket: str = ""
    #: Called (on the loop) when another worker woke this one.
    on_wake: Callable[[], None] | None = None
    _pending: int = field(default=0, repr=False)

    @property
    def workers(self) -> int:
        return len(self.wake_fds)

    @classmethod
    def from_env(cls) -> WorkerLink | None:
        spec = os.environ.get(_ENV)
        if not spec:
            return None
        slot, incarnation, shm_fd, supervisor, fds = spec.split(":")
        wake_fds = tuple(int(fd) for fd in fds.split(","))
        return cls(
            slot=int(slot),
            incarnation=int(incarnation),
            region=_core.Region(int(shm_fd)),
            wake_fds=wake_fds,
            supervisor=int(supervisor),
            batch_socket=os.environ.get(_BATCH_ENV, ""),
        )

    @property
    def batch_home(self) -> bool:
        """Whether this worker runs the Batch API (the store and its runner)."""
        return self.slot == 0

    def wake(self, mask: int) -> None:
        """Wakes the worker slots in the bit set `mask` (never this one)."""
        mask &= ~(1 << self.slot)
        k = 0
        while mask:
            if mask & 1 and k < len(self.wake_fds):
                with contextlib.suppress(BlockingIOError, OSError):
                    os.eventfd_write(self.wake_fds[k], 1)
            mask >>= 1
            k += 1

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.add_reader(self.wake_fds[self.slot], self._woken)

    def stop(self, loop: asyncio.AbstractEventLoop) -> None:
        with contextlib.suppress(Exception):
            loop.remove_reader(self.wake_fds[self.slot])

    def _woken(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.eventfd_read(self.wake_fds[self.slot])
        if self.on_wake is not None:
            self.on_wake()

    def heartbeat(self, now_ms: int) -> None:
        self.region.heartbeat(self.slot, now_ms)

    def reloaded(self) -> None:
        """A reload through this worker's HTTP API: the others reload too."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.supervisor, signal.SIGUSR1)


def enter_worker() -> WorkerLink | None:
    """At a worker's start: attach to the region, die with the supervisor."""
    global _link
    found = WorkerLink.from_env()
    if found is None:
        return None
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != found.supervisor:
        os._exit(0)  # the supervisor died before the death signal was armed
    _link = found
    return found


@dataclass
class _Slot:
    index: int
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    started: float = 0.0
    #: Deaths in a row before this incarnation's first heartbeat.
    failed_starts: int = 0


class Supervisor:
    """Runs N workers of one `gateway serve` command line as one gateway (SPEC §12)."""

    def __init__(self, workers: int, argv: list[str], host: str, port: int) -> None:
        self.n = workers
        self.argv = argv
        self.host = host
        self.port = port
        self._slots = [_Slot(k) for k in range(workers)]
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
        #: The workers could not start (the exit status is then 1).
        self.failed = False
        self._dir = tempfile.mkdtemp(prefix="gateway-workers-")
        self.batch_socket = os.path.join(self._dir, "batch.sock")
        # SPEC §12 /metrics of the whole gateway: each worker's snapshot (gateway.metrics).
        self.metrics_dir = os.path.join(self._dir, "metrics")
        os.mkdir(self.metrics_dir)

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
        env["GATEWAY_METRICS_DIR"] = self.metrics_dir
        argv = [sys.executable, "-m", "gateway.cli", *self.argv, "--port", str(self.port)]
        proc = subprocess.Popen(argv, env=env, pass_fds=(self._shm, *self._wake))
        slot.proc = proc
        slot.started = time.monotonic()
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
        units = self.region.reclaim(slot.index)
        self.reclaimed += units
        for fd in self._wake:  # the reclaimed units may serve someone waiting elsewhere
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)
        if self._stopping:
            if all(s.proc is None for s in self._slots):
                self._done.set()
            return
        log.warning(
            "worker died",
            extra={"fields": {"worker": slot.index, "code": code, "reclaimed": units}},
        )
        if self.region.worker(slot.index)[3] == 0:  # it never got as far as its first tick
            slot.failed_starts += 1
            if slot.failed_starts >= _FAILED_STARTS:
                log.error(
                    "workers cannot start: giving up",
                    extra={"fields": {"worker": slot.index, "attempts": slot.failed_starts}},
                )
                self.failed = True
                self.stop()
                return
        else:
            slot.failed_starts = 0
        pause = _CRASH_LOOP_S if time.monotonic() - slot.started < _CRASH_LOOP_S else 0.0
        loop.call_later(pause, self._respawn, slot)

    def _respawn(self, slot: _Slot) -> None:
        if not self._stopping and slot.proc is None:
            self._spawn(slot)

    def _signal_all(self, sig: int, but: int | None = None) -> None:
        for slot in self._slots:
            if slot.proc is not None and slot.proc.pid != but:
                with contextlib.suppress(ProcessLookupError):
                    slot.proc.send_signal(sig)

    async def _watch_hangs(self) -> None:
        while not self._stopping:
            await asyncio.sleep(0.5)
            now = time.monotonic_ns() // 1_000_000
            for slot in self._slots:
                if slot.proc is None:
                    continue
                _, _, _, beat = self.region.worker(slot.index)
                started_ms = int(slot.started * 1000)
                last = beat - 1 if beat else started_ms
                if now - max(last, started_ms) > HANG_MS:
                    log.error("worker hung: killed", extra={"fields": {"worker": slot.index}})
                    with contextlib.suppress(ProcessLookupError):
                        slot.proc.kill()

    async def _ready(self, timeout_s: float = 60.0) -> bool:
        """Every worker listening (its first heartbeat is written after it listens)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s.proc is not None and self.region.worker(s.index)[3] != 0 for s in self._slots):
                return True
            if all(s.proc is None for s in self._slots):
                return False
            await asyncio.sleep(0.02)
        return False

    def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        log.info("stopping workers")
        self._signal_all(signal.SIGTERM)
        if all(s.proc is None for s in self._slots):
            self._done.set()

    async def run(self, on_listening: Callable[[Supervisor], None] | None = None) -> int:
        loop = asyncio.get_running_loop()
        for slot in self._slots:
            self._spawn(slot)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        loop.add_signal_handler(signal.SIGHUP, self._signal_all, signal.SIGHUP)
        loop.add_signal_handler(signal.SIGUSR1, self._signal_all, signal.SIGHUP)
        hangs = loop.create_task(self._watch_hangs())
        try:
            if await self._ready() and on_listening is not None and not self._stopping:
                on_listening(self)
            await self._done.wait()
        finally:
            hangs.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await hangs
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
                loop.remove_signal_handler(sig)
            self._sock.close()
            shutil.rmtree(self._dir, ignore_errors=True)
        return 1 if self.failed else 0
