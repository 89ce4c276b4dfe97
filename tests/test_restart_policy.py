"""SPEC §12's restart policy in one process, on a manual clock: the supervisor's
`RestartPolicy` told of fake starts and deaths, its replacements started by the clock.

"a dead worker is replaced at once, then with doubling back-off (up to 30 s) while
replacements keep dying within seconds of starting; the supervisor never exits because
workers were killed (an OOM-killer storm must not stop the gateway), only on SIGTERM/SIGINT
or a start-up error every worker reports alike (a bad config).
`gateway_worker_restarts_total`."

The real processes (a kill -9 replaced, the count in every worker's /metrics, a config every
worker refuses) are in test_workers.py."""

from __future__ import annotations

from gateway.clock import ManualClock
from gateway.workers import (
    BACKOFF_MAX_MS,
    HANG_MS,
    QUICK_DEATH_MS,
    START_ALLOWANCE_MS,
    RestartPolicy,
    StartError,
)

BAD_CONFIG = StartError(2, "config error: pools.p.instances[0].max_concurrency: must be >= 1")


class Supervised:
    """A policy over `n` slots whose replacements start at once when it calls them (what the
    supervisor's spawn does, without a process); `starts` logs (slot, clock ms)."""

    def __init__(self, n: int = 2, **kw: int) -> None:
        self.clock = ManualClock()
        self.starts: list[tuple[int, int]] = []
        self.policy = RestartPolicy(n, self.clock, self.spawn, **kw)
        for slot in range(n):
            self.spawn(slot)

    def spawn(self, slot: int) -> None:
        self.starts.append((slot, self.clock.now_ms()))
        self.policy.started(slot)

    def kill(self, slot: int, report: StartError | None = None) -> int | StartError:
        """The slot's worker dies (killed from outside unless `report` says it could not
        start: then it never listened)."""
        return self.policy.died(slot, listened=report is None, report=report)

    def replaced_after(self, slot: int, died_at: int) -> int:
        """Advances the clock to the slot's replacement; how long after `died_at` it started."""
        before = len(self.starts)
        due = self.clock.pending
        assert due, "no replacement scheduled"
        self.clock.advance(due[0] - self.clock.now_ms())
        assert self.starts[before:] == [(slot, self.clock.now_ms())]
        return self.clock.now_ms() - died_at


def test_replaced_at_once_then_doubling_back_off_up_to_30_s() -> None:
    s = Supervised()
    delays = []
    for _ in range(9):
        s.clock.advance(200)  # each replacement dies within a second of its start
        died_at = s.clock.now_ms()
        s.kill(1)
        delays.append(s.replaced_after(1, died_at))
    assert BACKOFF_MAX_MS == 30_000
    assert delays == [0, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000]
    assert s.policy.restarts == 9  # gateway_worker_restarts_total
    assert not s.policy.stopped


def test_a_worker_that_lived_a_while_is_replaced_at_once_again() -> None:
    s = Supervised()
    for _ in range(4):  # the back-off has grown to 4 s
        s.clock.advance(100)
        died_at = s.clock.now_ms()
        s.kill(0)
        s.replaced_after(0, died_at)
    s.clock.advance(QUICK_DEATH_MS)  # this one served long enough: not a start that fails
    died_at = s.clock.now_ms()
    assert s.kill(0) == 0
    assert s.replaced_after(0, died_at) == 0
    s.clock.advance(100)  # and its quick successor waits the first step again
    died_at = s.clock.now_ms()
    assert s.kill(0) == 1000
    assert s.replaced_after(0, died_at) == 1000


def test_an_oom_killer_storm_never_stops_the_supervisor() -> None:
    """Every worker killed again and again, within a second of its start, 200 times over:
    every slot keeps being replaced and nothing says stop."""
    s = Supervised(n=4)
    for _ in range(200):
        s.clock.advance(500)
        for slot in range(4):
            assert isinstance(s.kill(slot), int)
        s.clock.advance(BACKOFF_MAX_MS)  # every replacement is due by then
        assert len(s.starts) == 4 + s.policy.restarts
    assert not s.policy.stopped
    assert s.policy.restarts == 800
    assert s.clock.pending == []  # every slot has its worker back


def test_a_start_up_error_every_worker_reports_alike_stops_it() -> None:
    s = Supervised(n=3)
    # One slot cannot start (the config broke on disk): retried with back-off, no stop.
    for _ in range(3):
        s.clock.advance(50)
        died_at = s.clock.now_ms()
        assert isinstance(s.kill(1, BAD_CONFIG), int)
        s.replaced_after(1, died_at)
    # Killed workers meanwhile are no start-up error.
    assert isinstance(s.kill(0), int)
    s.clock.advance(0)
    # Another error is not "alike".
    assert isinstance(s.kill(2, StartError(1, "cannot listen on 127.0.0.1:8080")), int)
    s.clock.advance(BACKOFF_MAX_MS)
    # A slot whose replacement listened no longer reports the error it left before.
    s.policy.listened(1)
    assert isinstance(s.kill(0, BAD_CONFIG), int)
    assert isinstance(s.kill(2, BAD_CONFIG), int)  # slot 1's worker listens
    # Slot 1's next worker cannot start either: now every slot reports the error — slots 0
    # and 2 through replacements that are starting, not yet listening — and the supervisor
    # stops with it, whatever the phases of their back-offs.
    s.clock.advance(BACKOFF_MAX_MS)
    assert s.starts[-1][0] in (0, 2)
    verdict = s.kill(1, BAD_CONFIG)
    assert verdict == BAD_CONFIG
    s.policy.stop()
    before = len(s.starts)
    s.clock.advance(BACKOFF_MAX_MS * 2)
    assert len(s.starts) == before  # and nothing is started after the stop


def test_start_ups_slower_than_the_back_off_still_stop_on_an_error_every_slot_reports() -> None:
    """Two slots whose workers cannot start, out of phase: whenever one dies the other's
    replacement is starting. Each slot reports the error once it left it, so the supervisor
    stops after each slot's first report (before: only if both were ever dead at once)."""
    s = Supervised(n=2, backoff_ms=100, backoff_max_ms=100)
    assert isinstance(s.kill(0, BAD_CONFIG), int)  # slot 1's first worker is still starting
    s.clock.advance(0)  # slot 0's replacement starts at once
    assert s.kill(1, BAD_CONFIG) == BAD_CONFIG  # slot 0's replacement has not listened


def test_a_replacement_waiting_out_its_back_off_is_dropped_on_stop() -> None:
    s = Supervised()
    s.clock.advance(10)
    s.kill(1)
    s.replaced_after(1, s.clock.now_ms())
    s.clock.advance(10)
    assert s.kill(1) == 1000
    s.policy.stop()  # SIGTERM meanwhile
    assert s.clock.pending == []
    s.clock.advance(5000)
    assert s.starts[-1] == (1, s.clock.now_ms() - 5010)  # the replacement before the stop


def test_a_starting_worker_has_its_allowance_a_started_one_does_not() -> None:
    """Issue 20: on a loaded host a worker may take seconds to send its first heartbeat;
    killed as hung after `HANG_MS` it would be killed over and over. Before its first
    heartbeat it has the start allowance; after it, a heartbeat older than `HANG_MS` is hung."""
    assert START_ALLOWANCE_MS > HANG_MS
    s = Supervised()
    s.clock.advance(HANG_MS + 1)
    assert not s.policy.hung(0, 0)  # still starting, past HANG_MS: not hung
    s.clock.advance(START_ALLOWANCE_MS - HANG_MS - 1)
    assert not s.policy.hung(0, 0)  # exactly at the allowance
    s.clock.advance(1)
    assert s.policy.hung(0, 0)  # a start that never ends is a hang too
    # Slot 1 sends its first heartbeat now (the heartbeat word: the worker's ms + 1), after
    # a start longer than HANG_MS, then stops beating.
    beat = s.clock.now_ms() + 1
    assert not s.policy.hung(1, beat)
    s.clock.advance(HANG_MS)
    assert not s.policy.hung(1, beat)
    s.clock.advance(1)
    assert s.policy.hung(1, beat)  # stopped heartbeating after it started: hung as before
    assert not s.policy.hung(1, s.clock.now_ms() + 1)  # a fresh heartbeat: not hung


def test_a_dead_slot_is_never_hung() -> None:
    s = Supervised()
    s.kill(0)
    s.policy.stop()
    s.clock.advance(START_ALLOWANCE_MS * 2)
    assert not s.policy.hung(0, 0)
    assert s.policy.hung(1, 0)


class _Stopped:
    """A worker process that never runs (SIGSTOPped, or a start that hangs): `kill` noted."""

    def __init__(self) -> None:
        self.killed = 0

    def kill(self) -> None:
        self.killed += 1


def test_the_supervisors_hang_check_spares_a_slow_start_on_its_clock() -> None:
    """The supervisor's periodic check on a manual clock, over its real region: a worker
    that took 20 s to send its first heartbeat is not killed meanwhile; once it stopped
    beating it is killed `HANG_MS` later; one that never sends a heartbeat is killed after
    the start allowance."""
    import os
    import shutil

    from gateway.workers import HANG_CHECK_MS, Supervisor

    clock = ManualClock()
    t0 = clock.now_ms()
    sup = Supervisor(2, ["serve"], "127.0.0.1", 0, clock=clock)
    try:
        procs = [_Stopped(), _Stopped()]
        for k, proc in enumerate(procs):
            sup._slots[k].proc = proc  # type: ignore[assignment]
            sup.region.worker_start(k, 1, os.getpid())
            sup.policy.started(k)
        sup._check_hangs()  # and every HANG_CHECK_MS after, on the clock
        clock.advance(20_000)
        assert [p.killed for p in procs] == [0, 0]  # both still starting, past HANG_MS
        sup.region.heartbeat(0, clock.now_ms())  # slot 0 listens, beats once, then stops
        clock.advance(HANG_MS)
        assert [p.killed for p in procs] == [0, 0]
        clock.advance(HANG_CHECK_MS)
        assert procs[0].killed >= 1 and procs[1].killed == 0
        clock.advance(t0 + START_ALLOWANCE_MS - HANG_CHECK_MS - clock.now_ms())
        assert procs[1].killed == 0  # just within its allowance
        clock.advance(2 * HANG_CHECK_MS)
        assert procs[1].killed >= 1
    finally:
        sup._stopping = True
        sup._sock.close()
        shutil.rmtree(sup._dir, ignore_errors=True)
        for fd in (sup._shm, *sup._wake):
            os.close(fd)
