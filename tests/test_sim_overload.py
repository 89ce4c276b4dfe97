"""`gateway.sim.overload`: issue 22's overload scenario replayed on the core in virtual time."""

from __future__ import annotations

import pytest

from gateway.sim import overload


def test_replay_is_exact_and_ends_quiet() -> None:
    """Seed for seed the same decisions (what lets two commits be compared), and after the
    flood every admitted request was served: nothing in flight, nothing queued."""
    a, b = overload.run(1, duration_s=10), overload.run(1, duration_s=10)
    assert a == b
    assert a.quiet
    assert overload.run(2, duration_s=10).high_waits != a.high_waits


def test_realtime_keeps_its_share_under_a_batch_flood() -> None:
    """At 0.5x capacity realtime waits tens of milliseconds while batch (2x) waits seconds and
    overflows its 1000 places; no realtime request is turned away."""
    r = overload.run(3, duration_s=20)
    assert len(r.high_waits) > 500
    assert r.high_rejected == 0 and r.low_rejected > 0
    assert overload.percentile(r.high_waits, 0.5) < 100
    assert overload.percentile(r.high_waits, 0.99) < 500
    assert overload.percentile(r.low_waits, 0.5) > 5000


def test_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert overload.main(["--seeds", "1-2", "--duration", "5"]) == 0
    out = capsys.readouterr().out
    assert out.count("seed ") == 2
    assert "realtime p99 over 2 seeds" in out
