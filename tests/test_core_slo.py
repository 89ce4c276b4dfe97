"""SPEC §17 through the binding (`gateway._core`): deadline order, the latency model's views,
`predicted`, `attainable` and adaptive limits, as the Python side calls them. The behaviour
itself is tested in the core (rust/core/tests/slo.rs); these check what crosses the boundary."""

from __future__ import annotations

import pytest

from gateway._core import Balancer, Outcome, Pool, PoolConfig, Priority

HIGH = Priority.HIGH


def test_a_queue_serves_the_earliest_deadline_first() -> None:
    pool = Pool(PoolConfig(), 1)
    pool.add_instance(1)
    assert pool.submit(1, HIGH, 0) == 0  # holds the slot
    # arrival order 2, 3, 4, 5; deadlines 900, 300, none (FIFO: 0 + 30 000), 600
    for ticket, deadline in [(2, 900), (3, 300), (4, 0), (5, 600)]:
        assert pool.submit(ticket, HIGH, 0, deadline_ms=deadline, prompt_tokens=10) is None
    order, running = [], 1
    while pool.waiting:
        (event,) = pool.release(running, Outcome.SUCCESS, 1)
        running = event.ticket
        order.append(running)
    assert order == [3, 5, 2, 4]
    pool.release(running, Outcome.SUCCESS, 1)
    assert (pool.in_flight, pool.waiting, pool.outstanding) == (0, 0, 0)


def warm(pool: Pool, ttft_ms: list[int], rounds: int = 120) -> int:
    """Sequential requests (one at a time), each instance answering with its own TTFT and a
    TPOT of 10 ms over 21 tokens; returns the clock after."""
    now = 1
    for ticket in range(rounds):
        index = pool.submit(ticket, HIGH, now, prompt_tokens=300)
        assert index is not None
        now += ttft_ms[index]
        pool.first_token(ticket, now)
        pool.first_token(ticket, now + 5)  # a second call changes nothing
        now += 200
        pool.release(ticket, Outcome.SUCCESS, now, output_tokens=21)
    return now


def test_predicted_learns_and_prefers_the_faster_instance() -> None:
    pool = Pool(PoolConfig(balancer=Balancer.PREDICTED), 1)
    assert pool.add_instance(8) == 0
    assert pool.add_instance(8) == 1
    fresh = pool.instance(0, 0)
    assert not fresh.calibrated and fresh.samples == 0
    now = warm(pool, [400, 40])
    slow, fast = pool.instance(0, now), pool.instance(1, now)
    # both were calibrated in the warm-up (least connections until then); since, nearly every
    # request went to the fast one, and the slow one's samples aged: it is explored now and
    # then, still predicted from what it learnt
    assert fast.calibrated and fast.samples >= 20
    assert 0 < slow.samples < fast.samples
    assert fast.predicted_ttft_ms == pytest.approx(40, rel=0.25)
    assert slow.predicted_ttft_ms == pytest.approx(400, rel=0.25)
    assert fast.predicted_tpot_ms == pytest.approx(10, rel=0.25)
    assert 0.8 <= fast.ttft_coverage <= 0.97
    assert fast.ttft_mae_ms >= 0 and fast.tpot_mae_ms >= 0
    ttft, tpot = pool.predict(1, 300, now)
    assert ttft == pytest.approx(fast.predicted_ttft_ms, rel=0.1) and tpot > 0
    # sequential requests now go to the 10x faster instance
    placed = []
    for ticket in range(1000, 1010):
        placed.append(pool.submit(ticket, HIGH, now, prompt_tokens=300))
        now += 40
        pool.first_token(ticket, now)
        now += 200
        pool.release(ticket, Outcome.SUCCESS, now, output_tokens=21)
    # all but an exploration now and then (one placement in 16 while the slow one's model has
    # lapsed, balancer.rs EXPLORE)
    assert placed.count(1) >= 8, placed


def test_non_streamed_answers_alone_calibrate_predicted_and_attainable() -> None:
    """Issue 22: a non-streamed answer (no `first_token`) teaches TTFT its whole time — what
    its client waits for its first token — so with no stream at all the models calibrate,
    `predicted` sends sequential requests to the 10x faster instance and a tiny objective is
    unattainable with a Retry-After."""
    pool = Pool(PoolConfig(balancer=Balancer.PREDICTED), 1)
    pool.add_instance(8)
    pool.add_instance(8)
    now, placed = 1, []
    for ticket in range(200):
        index = pool.submit(ticket, HIGH, now, prompt_tokens=300)
        assert index is not None
        placed.append(index)
        now += [2000, 200][index]  # the whole answer, 21 tokens
        pool.release(ticket, Outcome.SUCCESS, now, output_tokens=21)
    slow, fast = pool.instance(0, now), pool.instance(1, now)
    assert fast.calibrated and fast.samples >= 20
    assert fast.predicted_ttft_ms == pytest.approx(200, rel=0.25)
    assert slow.predicted_ttft_ms == pytest.approx(2000, rel=0.25)
    assert fast.tpot_samples == 0  # a non-streamed answer shows no time per token
    # after the warm-up, all but an exploration now and then go to the fast one
    assert placed[100:].count(1) >= 90, placed[100:]
    assert pool.attainable(HIGH, now + 5_000, 300, now) == 0
    assert pool.attainable(HIGH, now + 20, 300, now) > 0
    assert (pool.in_flight, pool.waiting, pool.outstanding) == (0, 0, 0)


def test_attainable_fails_open_then_answers_a_retry_after() -> None:
    pool = Pool(PoolConfig(balancer=Balancer.PREDICTED), 1)
    pool.add_instance(4)
    # not calibrated: fail open
    assert pool.attainable(HIGH, 10, 300, 9) == 0
    now = warm(pool, [100])
    assert pool.attainable(HIGH, 0, 300, now) == 0  # no objective
    assert pool.attainable(HIGH, now + 2_000, 300, now) == 0
    retry_after = pool.attainable(HIGH, now + 5, 300, now)
    assert retry_after > 0


def test_an_adaptive_instance_starts_low_under_its_ceiling() -> None:
    pool = Pool(PoolConfig(), 1)
    pool.add_instance(64, None, True)
    info = pool.instance(0, 0)
    assert info.adaptive and info.max_concurrency == 64
    assert 1 <= info.concurrency_limit < 64
    granted = [pool.submit(t, HIGH, 0) for t in range(10)]
    assert granted.count(0) == info.concurrency_limit  # the rest wait in the gateway's queue
    pool.set_adaptive(0, False)
    assert pool.instance(0, 0).concurrency_limit == 64
    events = pool.tick(1)  # the freed capacity goes to the waiting requests
    assert len(events) == 10 - info.concurrency_limit
    for t in range(10):
        pool.release(t, Outcome.SUCCESS, 2)
    assert (pool.in_flight, pool.waiting, pool.outstanding) == (0, 0, 0)
