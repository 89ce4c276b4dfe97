//! SPEC §17 on the Rust API: deadline order, the `predicted` balancer, `attainable`, adaptive
//! limits — property tests of the invariants, and simulated backends for the behaviour.
//!
//! - inside a class and tenant, grants go in (deadline, arrival) order, entries without an
//!   objective keyed by arrival + `max_wait_ms`; a retry keeps its place;
//! - with deadlines, `predicted` and adaptive caps mixed in, every ticket still ends exactly
//!   once, no instance is granted past its effective cap, and a quiet pool shows 0 in flight
//!   and 0 queued;
//! - after warm-up, `predicted` sends sequential requests to a 10× faster instance;
//! - an objective no instance can meet gets a Retry-After; one that can gets 0;
//! - an adaptive instance over a backend that slows past 4 running holds near 4, not 40.

use std::collections::{BTreeMap, BTreeSet};

use gateway_core::rng::SplitMix64;
use gateway_core::{
    Admit, BalancerKind, Event, EventKind, Millis, Outcome, Pool, PoolConfig, Priority, Request,
    Ticket,
};
use proptest::prelude::*;

fn cfg(balancer: BalancerKind) -> PoolConfig {
    PoolConfig {
        balancer,
        ..PoolConfig::default()
    }
}

fn req(deadline: Millis, prompt: u32) -> Request {
    Request {
        deadline,
        prompt_tokens: prompt,
        ..Request::default()
    }
}

fn granted(events: &[Event]) -> Vec<Ticket> {
    events
        .iter()
        .filter(|e| matches!(e.kind, EventKind::Granted(_)))
        .map(|e| e.ticket)
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// SPEC §17 "Ordering": one slot, one tenant; waiting requests are granted earliest
    /// deadline first, those without an objective at arrival + max_wait_ms, ties by arrival.
    #[test]
    fn grants_follow_deadlines(
        deadlines in prop::collection::vec(prop_oneof![Just(0u64), 1_000u64..60_000], 1..40),
        high in any::<bool>(),
    ) {
        let mut p = Pool::new(cfg(BalancerKind::LeastConnections), 1).unwrap();
        p.add_instance(1).unwrap();
        let class = if high { Priority::High } else { Priority::Low };
        let max_wait = if high { p.config().high_max_wait_ms } else { p.config().low_max_wait_ms };
        // ticket 0 holds the slot
        assert_eq!(p.submit_request(0, class, req(0, 0), &[], 0), Ok(Admit::Granted(0)));
        let mut keys = Vec::new();
        for (i, &d) in deadlines.iter().enumerate() {
            let t = i as Ticket + 1;
            let now = t; // one ms apart
            let d = if d == 0 { 0 } else { d + now };
            assert_eq!(p.submit_request(t, class, req(d, 0), &[], now), Ok(Admit::Queued(class)));
            keys.push((if d == 0 { now + max_wait } else { d }, t));
        }
        keys.sort_unstable();
        let want: Vec<Ticket> = keys.iter().map(|&(_, t)| t).collect();
        let mut got = Vec::new();
        let mut running = 0;
        let now = 100; // before every deadline: nothing is hopeless
        while got.len() < want.len() {
            let events = p.release(running, Outcome::Success, 0, now).unwrap();
            let g = granted(&events);
            prop_assert_eq!(g.len(), 1);
            running = g[0];
            got.push(running);
        }
        prop_assert_eq!(got, want);
    }
}

/// A caller of a pool with deadlines, `predicted`, adaptive instances and token counts.
#[derive(Clone, Debug)]
enum Op {
    Submit {
        high: bool,
        tenant: u32,
        slo: Option<Millis>,
        prompt: u32,
    },
    FirstToken {
        k: usize,
    },
    Release {
        k: usize,
        ok: bool,
        tokens: u32,
    },
    Retry {
        k: usize,
    },
    Cancel {
        k: usize,
    },
    Tick,
}

fn op() -> impl Strategy<Value = (Op, Millis)> {
    let op = prop_oneof![
        5 => (any::<bool>(), 0u32..3, prop::option::of(1u64..3_000), 0u32..4_000)
            .prop_map(|(high, tenant, slo, prompt)| Op::Submit { high, tenant, slo, prompt }),
        3 => (0usize..16).prop_map(|k| Op::FirstToken { k }),
        5 => (0usize..16, prop::bool::weighted(0.85), 0u32..500)
            .prop_map(|(k, ok, tokens)| Op::Release { k, ok, tokens }),
        1 => (0usize..16).prop_map(|k| Op::Retry { k }),
        1 => (0usize..16).prop_map(|k| Op::Cancel { k }),
        2 => Just(Op::Tick),
    ];
    (op, prop_oneof![Just(0u64), 1u64..50, 50u64..2_000])
}

/// The caller's own books of one pool.
struct Books {
    pool: Pool,
    now: Millis,
    waiting: BTreeSet<Ticket>,
    running: BTreeMap<Ticket, usize>,
    failed: Vec<Ticket>,
    asked: BTreeMap<Ticket, (Priority, Request)>,
}

impl Books {
    fn start(&mut self, t: Ticket, i: usize) {
        let inst = &self.pool.instances()[i];
        // SPEC §5, §17: never past the cap in force at the grant, never past the ceiling
        assert!(inst.in_flight <= inst.limit, "instance {i} over its limit");
        assert!(
            inst.in_flight <= inst.max_concurrency,
            "over max_concurrency"
        );
        assert!(self.running.insert(t, i).is_none(), "granted twice");
    }

    fn take(&mut self, events: Vec<Event>) {
        for e in events {
            assert!(
                self.waiting.remove(&e.ticket),
                "event for a ticket not waiting"
            );
            if let EventKind::Granted(i) = e.kind {
                self.start(e.ticket, i);
            }
        }
    }

    fn submit(&mut self, t: Ticket) {
        let (class, r) = self.asked[&t];
        match self.pool.submit_request(t, class, r, &[], self.now) {
            Ok(Admit::Granted(i)) => self.start(t, i),
            Ok(Admit::Queued(_)) => {
                self.waiting.insert(t);
            }
            Err(_) => {}
        }
        let events = self.pool.take_events();
        self.take(events);
    }

    fn nth_running(&self, k: usize) -> Option<Ticket> {
        (!self.running.is_empty())
            .then(|| *self.running.keys().nth(k % self.running.len()).unwrap())
    }

    fn apply(&mut self, op: Op, next: &mut Ticket) {
        match op {
            Op::Submit {
                high,
                tenant,
                slo,
                prompt,
            } => {
                *next += 1;
                let class = if high { Priority::High } else { Priority::Low };
                let deadline = slo.map_or(0, |s| self.now + s);
                let r = Request {
                    tenant,
                    deadline,
                    prompt_tokens: prompt,
                    ..Request::default()
                };
                self.asked.insert(*next, (class, r));
                self.submit(*next);
            }
            Op::FirstToken { k } => {
                if let Some(t) = self.nth_running(k) {
                    self.pool.first_token(t, self.now);
                    self.pool.first_token(t, self.now + 1); // a second call is a no-op
                }
            }
            Op::Release { k, ok, tokens } => {
                if let Some(t) = self.nth_running(k) {
                    self.running.remove(&t);
                    let outcome = if ok {
                        Outcome::Success
                    } else {
                        Outcome::Failure
                    };
                    let events = self
                        .pool
                        .release_with(t, outcome, 0, tokens, self.now)
                        .unwrap();
                    if !ok {
                        self.failed.push(t);
                    }
                    self.take(events);
                }
            }
            Op::Retry { k } if !self.failed.is_empty() => {
                let t = self.failed.remove(k % self.failed.len());
                self.submit(t);
            }
            Op::Cancel { k } if !self.waiting.is_empty() => {
                let t = *self.waiting.iter().nth(k % self.waiting.len()).unwrap();
                assert!(self.pool.cancel(t));
                self.waiting.remove(&t);
            }
            Op::Tick => {
                let events = self.pool.tick(self.now);
                self.take(events);
            }
            _ => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every ticket ends exactly once; no grant past an instance's effective cap; a quiet
    /// pool shows 0 in flight and 0 queued.
    #[test]
    fn books_balance_with_objectives(
        ops in prop::collection::vec(op(), 1..300),
        caps in prop::collection::vec((1u32..6, any::<bool>()), 1..4),
        predicted in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let kind = if predicted { BalancerKind::Predicted } else { BalancerKind::LeastConnections };
        let config = PoolConfig { high_max_wait_ms: 5_000, low_max_wait_ms: 20_000, ..cfg(kind) };
        let mut pool = Pool::new(config, seed).unwrap();
        for &(c, adaptive) in &caps {
            pool.add_instance_full(c, None, adaptive).unwrap();
        }
        let mut b = Books {
            pool,
            now: 0,
            waiting: BTreeSet::new(),
            running: BTreeMap::new(),
            failed: Vec::new(),
            asked: BTreeMap::new(),
        };
        let mut next: Ticket = 0;
        for (op, dt) in ops {
            b.now += dt;
            b.apply(op, &mut next);
            prop_assert_eq!(b.pool.waiting(), b.waiting.len());
            prop_assert_eq!(b.pool.tickets_outstanding(), b.waiting.len() + b.running.len());
            for (i, inst) in b.pool.instances().iter().enumerate() {
                let mine = b.running.values().filter(|&&k| k == i).count();
                prop_assert_eq!(inst.in_flight as usize, mine);
                prop_assert!(inst.limit >= 1 && inst.limit <= inst.max_concurrency);
            }
            // every prediction is a finite, positive number
            for i in 0..b.pool.instances().len() {
                let (ttft, tpot) = b.pool.predict(i, 100, b.now).unwrap();
                prop_assert!(ttft.is_finite() && ttft > 0.0 && tpot.is_finite() && tpot > 0.0);
            }
        }
        // quiet: everything ends
        for t in std::mem::take(&mut b.waiting) {
            prop_assert!(b.pool.cancel(t));
        }
        for t in std::mem::take(&mut b.running).into_keys() {
            let events = b.pool.release_with(t, Outcome::Neutral, 0, 0, b.now).unwrap();
            prop_assert!(events.is_empty());
        }
        let p = &b.pool;
        prop_assert_eq!((p.in_flight(), p.waiting(), p.tickets_outstanding()), (0, 0, 0));
    }
}

/// A simulated backend: TTFT and TPOT of instance `i` with `running` requests on it.
struct Backend {
    speed: Vec<f64>,
}

impl Backend {
    fn ttft(&self, i: usize, prompt: u32, running: u32) -> f64 {
        self.speed[i] * (20.0 + 0.02 * f64::from(prompt) + 5.0 * f64::from(running))
    }
    fn tpot(&self, i: usize, running: u32) -> f64 {
        self.speed[i] * 10.0 * (f64::from(running) / 4.0).max(1.0)
    }
}

/// Sequential requests (one at a time) through a `predicted` pool: (grants per instance after
/// warm-up).
fn sequential(speed: Vec<f64>, n: usize) -> Vec<u32> {
    sequential_in(&mut predicted_pool(speed.len()), speed, n, (true, 1)).0
}

fn predicted_pool(instances: usize) -> Pool {
    let mut p = Pool::new(cfg(BalancerKind::Predicted), 7).unwrap();
    for _ in 0..instances {
        p.add_instance(8).unwrap();
    }
    p
}

/// `sequential` on `p`, streamed (a first token, then 49 more) or not (one answer of 50
/// tokens after the same total time): (grants per instance in the second half, the clock).
fn sequential_in(
    p: &mut Pool,
    speed: Vec<f64>,
    n: usize,
    (streamed, start): (bool, Millis),
) -> (Vec<u32>, Millis) {
    let backend = Backend { speed };
    let mut counts = vec![0; backend.speed.len()];
    let mut now: Millis = start;
    let mut rng = SplitMix64::new(5);
    for t in 0..n as Ticket {
        let prompt = 200 + rng.below(800) as u32;
        let Ok(Admit::Granted(i)) = p.submit_request(t, Priority::High, req(0, prompt), &[], now)
        else {
            panic!("an idle pool grants at once")
        };
        if t as usize >= n / 2 {
            counts[i] += 1;
        }
        now += backend.ttft(i, prompt, 1) as Millis;
        if streamed {
            p.first_token(t, now);
        }
        now += (backend.tpot(i, 1) * 49.0) as Millis;
        p.release_with(t, Outcome::Success, 0, 50, now).unwrap();
    }
    (counts, now)
}

#[test]
fn predicted_sends_sequential_requests_to_the_faster_instance() {
    // instance 1 is 10x faster
    let counts = sequential(vec![10.0, 1.0], 400);
    let share = f64::from(counts[1]) / f64::from(counts[0] + counts[1]);
    // all of them (the slow one keeps its calibration for minutes without traffic)
    assert!(share > 0.95, "{counts:?}");
}

/// Issue 22: a non-streamed answer teaches TTFT (its client sees the first token with the
/// whole answer): with non-streamed traffic only, the models calibrate, `predicted` prefers
/// the 10x faster instance, and an objective below the fastest total time is unattainable.
#[test]
fn non_streamed_traffic_alone_calibrates_and_places() {
    let mut p = predicted_pool(2);
    let (counts, now) = sequential_in(&mut p, vec![10.0, 1.0], 400, (false, 1));
    let share = f64::from(counts[1]) / f64::from(counts[0] + counts[1]);
    assert!(share > 0.95, "{counts:?}");
    let fast = p.model(1).unwrap();
    assert!(fast.latency.ttft_calibrated(now));
    // no stream ever warmed TPOT: nothing was learnt of it, the whole time is TTFT
    assert_eq!(fast.latency.tpot.samples(), 0);
    let (ttft, _) = p.predict(1, 500, now).unwrap();
    // 20 + 0.02 · 500 + 5 ms, then 49 · 10 ms
    assert!((450.0..700.0).contains(&ttft), "{ttft}");
    assert_eq!(p.attainable(Priority::High, now + 5_000, 500, now), 0);
    assert!(p.attainable(Priority::High, now + 100, 500, now) > 0);
}

/// Mixed traffic: streams teach TTFT directly, and the non-streamed answers between them
/// teach it nothing — even when their decode is slower than the streams' (long batch answers
/// under load), which y = total − (n − 1) · TPOT carried into TTFT n − 1 times (the SLO
/// bench's p90 TTFT came out 2–15× too high). Nor do they teach TPOT.
#[test]
fn non_streamed_answers_beside_streams_leave_ttft_to_the_streams() {
    let mut p = predicted_pool(1);
    let backend = Backend { speed: vec![1.0] };
    let (_, mut now) = sequential_in(&mut p, vec![1.0], 100, (true, 1));
    let before = p.predict(0, 500, now).unwrap().0;
    for _ in 0..10 {
        let tpot_samples = p.model(0).unwrap().latency.tpot.samples();
        for t in 0..5 {
            let Ok(Admit::Granted(i)) = p.submit_request(t, Priority::Low, req(0, 500), &[], now)
            else {
                panic!("an idle pool grants at once")
            };
            now += backend.ttft(i, 500, 1) as Millis;
            // 300 tokens at three times the streams' time per token
            now += (backend.tpot(i, 1) * 3.0 * 299.0) as Millis;
            p.release_with(t, Outcome::Success, 0, 300, now).unwrap();
        }
        assert_eq!(
            p.model(0).unwrap().latency.tpot.samples(),
            tpot_samples,
            "non-streamed: no TPOT sample"
        );
        now = sequential_in(&mut p, vec![1.0], 10, (true, now)).1;
    }
    let after = p.predict(0, 500, now).unwrap().0;
    // ~35 ms idle TTFT either way, not seconds
    assert!(after < 1.5 * before && after < 100.0, "{before} -> {after}");
}

#[test]
fn an_unattainable_objective_gets_a_retry_after() {
    let backend = Backend {
        speed: vec![1.0, 1.0],
    };
    let mut p = Pool::new(cfg(BalancerKind::Predicted), 7).unwrap();
    p.add_instance(2).unwrap();
    p.add_instance(2).unwrap();
    // warm the models up with one request at a time on each
    let mut now: Millis = 1;
    for t in 0..100 {
        let Ok(Admit::Granted(i)) = p.submit_request(t, Priority::High, req(0, 500), &[], now)
        else {
            panic!()
        };
        now += backend.ttft(i, 500, 1) as Millis;
        p.first_token(t, now);
        now += 100;
        p.release_with(t, Outcome::Success, 0, 10, now).unwrap();
    }
    assert!(p.model(0).unwrap().latency.ttft_calibrated(now));
    // ~40 ms idle: a 1 s objective is attainable, a 10 ms one never is
    assert_eq!(p.attainable(Priority::High, now + 1_000, 500, now), 0);
    let r = p.attainable(Priority::High, now + 10, 500, now);
    assert!(r > 0, "{r}");
    // fill every slot and queue 20: a 100 ms objective now waits behind the queue
    for t in 1000..1004 {
        p.submit_request(t, Priority::High, req(0, 500), &[], now)
            .unwrap();
    }
    for t in 1004..1024 {
        assert_eq!(
            p.submit_request(t, Priority::High, req(0, 500), &[], now),
            Ok(Admit::Queued(Priority::High))
        );
    }
    let r = p.attainable(Priority::High, now + 100, 500, now);
    assert!(r > 100, "{r}");
    // an uncalibrated pool fails open
    let mut fresh = Pool::new(cfg(BalancerKind::Predicted), 7).unwrap();
    fresh.add_instance(1).unwrap();
    assert_eq!(fresh.attainable(Priority::High, 11, 500, 10), 0);
}

/// 40 closed-loop clients on one adaptive instance (ceiling 64) whose backend slows past 4
/// running: the limit settles near the knee, and every request is served.
#[test]
fn adaptive_limit_holds_a_knee_backend_near_its_knee() {
    let backend = Backend { speed: vec![1.0] };
    let mut p = Pool::new(cfg(BalancerKind::LeastConnections), 7).unwrap();
    p.add_instance_full(64, None, true).unwrap();
    // event-driven: (end time, ticket); a client resubmits at once when its request ends
    let mut now: Millis = 0;
    let mut ends: BTreeMap<(Millis, Ticket), ()> = BTreeMap::new();
    let mut next: Ticket = 0;
    let mut served = 0u64;
    let mut limits = Vec::new();
    let start = |p: &Pool, ends: &mut BTreeMap<(Millis, Ticket), ()>, t: Ticket, now: Millis| {
        let running = p.instances()[0].in_flight;
        let tpot = backend.tpot(0, running);
        ends.insert((now + 20 + (tpot * 19.0) as Millis, t), ());
    };
    for _ in 0..40 {
        match p.submit_request(next, Priority::High, req(0, 100), &[], now) {
            Ok(Admit::Granted(_)) => start(&p, &mut ends, next, now),
            Ok(Admit::Queued(_)) => {}
            Err(e) => panic!("{e}"),
        }
        next += 1;
    }
    while now < 120_000 {
        let Some((&(end, t), _)) = ends.iter().next() else {
            break;
        };
        ends.remove(&(end, t));
        now = end;
        let mut events = p.release_with(t, Outcome::Success, 0, 20, now).unwrap();
        served += 1;
        // the client sends its next request
        match p.submit_request(next, Priority::High, req(0, 100), &[], now) {
            Ok(Admit::Granted(_)) => start(&p, &mut ends, next, now),
            Ok(Admit::Queued(_)) => events.extend(p.take_events()),
            Err(e) => panic!("{e}"),
        }
        next += 1;
        events.extend(p.tick(now));
        for e in events {
            if let EventKind::Granted(_) = e.kind {
                start(&p, &mut ends, e.ticket, now);
            }
        }
        limits.push(p.instances()[0].limit);
    }
    assert!(served > 1_000);
    let tail = &limits[limits.len() / 2..];
    let mean = tail.iter().map(|&l| f64::from(l)).sum::<f64>() / tail.len() as f64;
    assert!((3.0..=10.0).contains(&mean), "mean limit {mean}");
    assert!(tail.iter().all(|&l| l <= 16), "{:?}", &tail[..20]);
}

/// SPEC §3 "Overflow": a high request spilled into low "then waits as low" — in arrival order
/// among the batch requests, not ahead of all of them by its realtime deadline.
#[test]
fn a_spilled_high_request_waits_in_arrival_order_as_low() {
    let mut p = Pool::new(
        PoolConfig {
            high_capacity: 1,
            ..cfg(BalancerKind::LeastConnections)
        },
        1,
    )
    .unwrap();
    p.add_instance(1).unwrap();
    assert_eq!(
        p.submit_request(1, Priority::Low, req(0, 0), &[], 0),
        Ok(Admit::Granted(0))
    );
    p.submit_request(2, Priority::Low, req(0, 0), &[], 1)
        .unwrap();
    p.submit_request(3, Priority::High, req(500, 0), &[], 2)
        .unwrap(); // fills high
                   // high is full: 4 spills into low, behind 2
    assert_eq!(
        p.submit_request(4, Priority::High, req(100, 0), &[], 3),
        Ok(Admit::Queued(Priority::Low))
    );
    p.submit_request(5, Priority::Low, req(0, 0), &[], 4)
        .unwrap();
    let strict = PoolConfig {
        high_capacity: 1,
        selector: gateway_core::SelectorConfig {
            policy: gateway_core::Policy::Strict,
            ..gateway_core::SelectorConfig::default()
        },
        ..cfg(BalancerKind::LeastConnections)
    };
    p.configure(strict).unwrap();
    let mut order = Vec::new();
    let mut running = 1;
    for _ in 0..4 {
        let events = p.release(running, Outcome::Success, 0, 10).unwrap();
        running = granted(&events)[0];
        order.push(running);
    }
    assert_eq!(order, vec![3, 2, 4, 5]);
}

/// SPEC §17 `scheduler.shed_unattainable`: a waiter whose objective becomes unattainable while
/// it waits is answered `Unattainable` (503 `slo_unattainable` with a Retry-After) instead of
/// being served late; one whose objective is still attainable keeps waiting. Without shedding
/// the hopeless one goes back to FIFO and no event comes.
#[test]
fn a_waiter_whose_objective_is_lost_is_shed_only_when_asked() {
    for shed in [true, false] {
        let mut p = predicted_pool(1);
        // ~35 ms idle TTFT, calibrated; the instance holds 8 at once: fill it
        let (_, mut now) = sequential_in(&mut p, vec![1.0], 100, (true, 1));
        p.set_shed_unattainable(shed);
        for t in 1000..1008 {
            let admit = p.submit_request(t, Priority::High, req(0, 500), &[], now);
            assert!(matches!(admit, Ok(Admit::Granted(_))), "{admit:?}");
        }
        let (hopeful, doomed) = (2000, 2001);
        for (t, within) in [(hopeful, 10_000), (doomed, 60)] {
            let admit = p.submit_request(t, Priority::High, req(now + within, 500), &[], now);
            assert_eq!(admit, Ok(Admit::Queued(Priority::High)));
        }
        assert!(p.take_events().is_empty(), "both attainable when they came");
        now += 40; // the doomed one's 60 ms can no longer hold a ~35 ms first token
        let events = p.tick(now);
        let shed_now: Vec<_> = events
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::Unattainable { retry_after_ms } => Some((e.ticket, retry_after_ms)),
                _ => None,
            })
            .collect();
        if shed {
            assert_eq!(shed_now.len(), 1, "{events:?}");
            assert_eq!(shed_now[0].0, doomed);
            assert!(
                shed_now[0].1 >= 30,
                "a Retry-After of at least a first token"
            );
        } else {
            assert!(shed_now.is_empty(), "{events:?}");
        }
        assert_eq!(p.waiting(), if shed { 1 } else { 2 });
        // every ticket still ends exactly once
        for t in 1000..1008 {
            p.release_with(t, Outcome::Success, 0, 10, now).unwrap();
        }
        assert_eq!(p.waiting(), 0);
        assert_eq!(p.tickets_outstanding(), if shed { 1 } else { 2 });
    }
}
