//! SPEC §12: pools of several workers sharing one region behave as one pool.
#![cfg(not(loom))]

use std::sync::atomic::AtomicU64;

use gateway_core::shared::Joins;
use gateway_core::shm::{Region, MAX_POOLS, MAX_SLOTS, REGION_WORDS};
use gateway_core::{
    Admit, EventKind, HealthConfig, InstanceState, Outcome, Pool, PoolConfig, Priority,
};

fn region(workers: usize) -> Region<'static> {
    let words: Vec<AtomicU64> = (0..REGION_WORDS).map(|_| AtomicU64::new(0)).collect();
    Region::init(Box::leak(words.into_boxed_slice()), workers).unwrap()
}

fn worker(r: Region<'static>, w: usize, caps: &[u32], cfg: PoolConfig) -> Pool {
    let mut p = Pool::new(cfg, 1).unwrap();
    p.attach(r, 42, w).unwrap();
    for (k, &c) in caps.iter().enumerate() {
        p.add_instance_with_id(c, Some(100 + k as u64)).unwrap();
    }
    p
}

/// Two workers of one pool of two instances with four units each, with these health rules.
fn two_workers(health: HealthConfig) -> (Region<'static>, Pool, Pool) {
    let r = region(2);
    let cfg = PoolConfig {
        health,
        ..PoolConfig::default()
    };
    let a = worker(r, 0, &[4, 4], cfg.clone());
    let b = worker(r, 1, &[4, 4], cfg);
    (r, a, b)
}

#[test]
fn the_cap_holds_across_workers_and_least_connections_sees_them_all() {
    let r = region(2);
    let mut a = worker(r, 0, &[2, 2], PoolConfig::default());
    let mut b = worker(r, 1, &[2, 2], PoolConfig::default());
    assert_eq!(
        a.submit(1, Priority::High, 0, 0, 0, 0),
        Ok(Admit::Granted(0))
    );
    // b sees a's attempt on 0: least-connections sends it to 1
    assert_eq!(
        b.submit(1, Priority::High, 0, 0, 0, 0),
        Ok(Admit::Granted(1))
    );
    assert!(matches!(
        a.submit(2, Priority::High, 0, 0, 0, 0),
        Ok(Admit::Granted(_))
    ));
    assert!(matches!(
        b.submit(2, Priority::High, 0, 0, 0, 0),
        Ok(Admit::Granted(_))
    ));
    assert_eq!((r.held(0, 0), r.held(0, 1)), (2, 2));
    // four units, four attempts: nothing more anywhere
    assert_eq!(
        a.submit(3, Priority::High, 0, 0, 0, 0),
        Ok(Admit::Queued(Priority::High))
    );
    assert_eq!(b.free_slots(0), 0);
    // a unit freed in b while a waits and b does not: b offers it, a takes it on its wake
    assert!(b.release(1, Outcome::Success, 0, 1).unwrap().is_empty());
    assert_eq!(b.take_wakes(), 1 << 0);
    let events = a.tick(2);
    assert_eq!(events.len(), 1);
    assert!(matches!(events[0].kind, EventKind::Granted(_)));
    assert_eq!(r.held(0, 0) + r.held(0, 1), 4);
}

#[test]
fn a_high_request_in_one_worker_overtakes_lows_waiting_in_another() {
    let r = region(2);
    let cfg = PoolConfig::default();
    let mut a = worker(r, 0, &[1], cfg.clone());
    let mut b = worker(r, 1, &[1], cfg);
    assert_eq!(
        a.submit(1, Priority::Low, 0, 0, 0, 0),
        Ok(Admit::Granted(0))
    );
    for t in 2..6 {
        assert_eq!(
            a.submit(t, Priority::Low, 0, 0, 0, 1),
            Ok(Admit::Queued(Priority::Low))
        );
    }
    assert_eq!(
        b.submit(1, Priority::High, 0, 0, 0, 2),
        Ok(Admit::Queued(Priority::High))
    );
    // a frees its unit: the turn is high, which only b has, so a wakes b and keeps its lows
    assert!(a.release(1, Outcome::Success, 0, 3).unwrap().is_empty());
    assert_eq!(a.take_wakes(), 1 << 1);
    let events = b.tick(3);
    assert_eq!(events[0].kind, EventKind::Granted(0));
    assert_eq!(events[0].ticket, 1);
    assert_eq!(r.peers_waiting(0, 0).high, 0);
    assert_eq!(r.peers_waiting(0, 1).low, 4, "a's lows still wait");
}

#[test]
fn an_ejection_by_one_worker_holds_for_all_and_probes_are_shared() {
    let (_, mut a, mut b) = two_workers(HealthConfig {
        failure_threshold: 1,
        ejection_ms: 1000,
        probing: true,
        ..HealthConfig::default()
    });
    assert_eq!(
        a.submit(1, Priority::High, 0, 0, 0, 0),
        Ok(Admit::Granted(0))
    );
    a.release(1, Outcome::Failure, 0, 10).unwrap();
    assert_eq!(a.instance_state(0, 10), Ok(InstanceState::Ejected));
    // b never sent it anything, yet does not use it
    assert_eq!(
        b.submit(1, Priority::High, 0, 0, 0, 20),
        Ok(Admit::Granted(1))
    );
    assert_eq!(b.instance_state(0, 20), Ok(InstanceState::Ejected));
    // one prober: a claims the probe, b may not in the same interval
    assert!(a.claim_probe(0, 1100, 500));
    assert!(!b.claim_probe(0, 1200, 500));
    a.record_probe(0, true, 1100).unwrap();
    // b applies a's passing probe: half-open after the ejection time
    b.tick(1100);
    assert_eq!(b.instance_state(0, 1100), Ok(InstanceState::HalfOpen));
}

#[test]
fn reclaiming_a_dead_worker_frees_its_units_for_the_others() {
    let r = region(3);
    let mut a = worker(r, 0, &[2], PoolConfig::default());
    let mut dead = worker(r, 2, &[2], PoolConfig::default());
    assert_eq!(
        dead.submit(1, Priority::Low, 0, 0, 0, 0),
        Ok(Admit::Granted(0))
    );
    assert_eq!(
        dead.submit(2, Priority::Low, 0, 0, 0, 0),
        Ok(Admit::Granted(0))
    );
    assert_eq!(
        dead.submit(3, Priority::Low, 0, 0, 0, 0),
        Ok(Admit::Queued(Priority::Low))
    );
    assert_eq!(
        a.submit(1, Priority::High, 0, 0, 0, 1),
        Ok(Admit::Queued(Priority::High))
    );
    assert_eq!(r.reclaim(2), 2);
    let events = a.tick(2);
    assert_eq!(
        events.len(),
        1,
        "both units are free again: a's one waiter takes one"
    );
    assert_eq!(a.peers_waiting(), (0, 0));
    assert_eq!(r.held(0, 0), 1);
}

mod random_runs {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    #[derive(Clone, Debug)]
    enum Op {
        Submit(usize, bool),
        Release(usize),
        Cancel(usize),
        Tick(usize),
        /// The worker is killed: its region fields are reclaimed and a fresh one replaces it.
        Kill(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..3usize, any::<bool>()).prop_map(|(w, h)| Op::Submit(w, h)),
            3 => any::<usize>().prop_map(Op::Release),
            1 => any::<usize>().prop_map(Op::Cancel),
            1 => (0..3usize).prop_map(Op::Tick),
            1 => (0..3usize).prop_map(Op::Kill),
        ]
    }

    const CAPS: [u32; 3] = [1, 2, 3];

    /// Queues small enough that random runs fill them (SPEC §3 capacity over the union).
    fn small_queues() -> PoolConfig {
        PoolConfig {
            high_capacity: 3,
            low_capacity: 4,
            ..PoolConfig::default()
        }
    }

    struct World {
        r: Region<'static>,
        pools: Vec<Pool>,
        /// ticket -> (worker, granted)
        tickets: HashMap<u64, (usize, bool)>,
        next: u64,
        now: u64,
    }

    impl World {
        fn new() -> Self {
            let r = region(3);
            let pools = (0..3)
                .map(|w| worker(r, w, &CAPS, small_queues()))
                .collect();
            Self {
                r,
                pools,
                tickets: HashMap::new(),
                next: 1,
                now: 0,
            }
        }

        fn apply(&mut self, w: usize, events: Vec<gateway_core::Event>) {
            let mut queue = vec![(w, events)];
            let mut rounds = 0;
            while let Some((w, events)) = queue.pop() {
                for e in events {
                    match e.kind {
                        EventKind::Granted(_) => self.tickets.insert(e.ticket, (w, true)),
                        _ => self.tickets.remove(&e.ticket),
                    };
                }
                // Wakes are delivered at once (the eventfd), as the workers' loops do; they
                // must die out (no two workers waking each other for ever).
                let wakes = self.pools[w].take_wakes();
                for k in (0..3).filter(|k| wakes & (1 << k) != 0) {
                    rounds += 1;
                    assert!(rounds < 20, "wake storm: {:?}", self.tickets);
                    queue.push((k, self.pools[k].tick(self.now)));
                }
            }
        }

        fn nth(&self, n: usize, granted: bool) -> Option<u64> {
            let mut ts: Vec<u64> = self
                .tickets
                .iter()
                .filter(|(_, v)| v.1 == granted)
                .map(|(t, _)| *t)
                .collect();
            ts.sort_unstable();
            (!ts.is_empty()).then(|| ts[n % ts.len()])
        }

        fn run(&mut self, op: Op) {
            self.now += 1;
            match op {
                Op::Submit(w, high) => {
                    let t = self.next;
                    self.next += 1;
                    let p = if high { Priority::High } else { Priority::Low };
                    let tenant = (t % 3) as u32;
                    match self.pools[w].submit(t, p, tenant, 0, 0, self.now) {
                        Ok(Admit::Granted(_)) => drop(self.tickets.insert(t, (w, true))),
                        Ok(Admit::Queued(_)) => drop(self.tickets.insert(t, (w, false))),
                        Err(_) => {}
                    }
                    let events = self.pools[w].take_events();
                    self.apply(w, events);
                }
                Op::Release(n) => {
                    if let Some(t) = self.nth(n, true) {
                        let (w, _) = self.tickets.remove(&t).unwrap();
                        let events = self.pools[w]
                            .release(t, Outcome::Success, 0, self.now)
                            .unwrap();
                        self.apply(w, events);
                    }
                }
                Op::Cancel(n) => {
                    if let Some(t) = self.nth(n, false) {
                        let (w, _) = self.tickets.remove(&t).unwrap();
                        assert!(self.pools[w].cancel(t));
                    }
                }
                Op::Tick(w) => {
                    let events = self.pools[w].tick(self.now);
                    self.apply(w, events);
                }
                Op::Kill(w) => {
                    self.r.reclaim(w);
                    self.tickets.retain(|_, v| v.0 != w);
                    self.pools[w] = worker(self.r, w, &CAPS, small_queues());
                    for k in 0..3 {
                        let events = self.pools[k].tick(self.now);
                        self.apply(k, events);
                    }
                }
            }
            self.check();
        }

        fn check(&self) {
            for (k, &cap) in CAPS.iter().enumerate() {
                let held = self.r.held(0, k);
                let local: u32 = self.pools.iter().map(|p| p.instances()[k].in_flight).sum();
                assert_eq!(
                    held,
                    u64::from(local),
                    "the region counts exactly the live attempts"
                );
                assert!(held <= u64::from(cap), "instance {k} over its cap");
            }
            for (high, class) in [(true, Priority::High), (false, Priority::Low)] {
                let queued: usize = self.pools.iter().map(|p| p.queued(class)).sum();
                assert_eq!(
                    self.r.places_taken(0, high),
                    queued as u64,
                    "queue places exact"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]
        #[test]
        fn units_are_exact_and_every_waiter_is_served(ops in prop::collection::vec(op(), 1..120)) {
            let mut world = World::new();
            for op in ops {
                world.run(op);
            }
            // Quiesce: finish everything in flight; every waiting request must be granted (the
            // workers' 10 ms tick is the net under a deferral nobody took up).
            for _ in 0..10_000 {
                if let Some(t) = world.nth(0, true) {
                    let (w, _) = world.tickets.remove(&t).unwrap();
                    world.now += 1;
                    let events = world.pools[w].release(t, Outcome::Success, 0, world.now).unwrap();
                    world.apply(w, events);
                } else if world.tickets.is_empty() {
                    break;
                } else {
                    world.now += 10;
                    for w in 0..3 {
                        let events = world.pools[w].tick(world.now);
                        world.apply(w, events);
                    }
                }
                world.check();
            }
            prop_assert!(world.tickets.is_empty(), "waiters left with every unit free: {:?}", world.tickets);
            for k in 0..CAPS.len() {
                prop_assert_eq!(world.r.held(0, k), 0);
            }
        }
    }
}

#[test]
fn tenants_share_fairly_across_workers() {
    // Tenant 1 floods worker 0; tenant 2 arrives later at worker 1. One unit: grants alternate
    // between the tenants (as one pool's round-robin would), not tenant 1's whole backlog first.
    let r = region(2);
    let mut a = worker(r, 0, &[1], PoolConfig::default());
    let mut b = worker(r, 1, &[1], PoolConfig::default());
    assert_eq!(
        a.submit(1, Priority::Low, 1, 0, 0, 0),
        Ok(Admit::Granted(0))
    );
    for t in 2..=20 {
        a.submit(t, Priority::Low, 1, 0, 0, 1).unwrap();
    }
    for t in 101..=105 {
        b.submit(t, Priority::Low, 2, 0, 0, 5).unwrap();
    }
    let mut running = (0usize, 1u64);
    let mut order = Vec::new();
    for now in 10..40 {
        let (w, t) = running;
        let pools = [&mut a, &mut b];
        let mut moved: Vec<(usize, gateway_core::Event)> = Vec::new();
        let events = pools[w].release(t, Outcome::Success, 0, now).unwrap();
        moved.extend(events.into_iter().map(|e| (w, e)));
        let wakes = pools[w].take_wakes();
        for k in (0..2).filter(|k| wakes & (1 << k) != 0) {
            let events = pools[k].tick(now);
            moved.extend(events.into_iter().map(|e| (k, e)));
        }
        let Some(&(k, e)) = moved
            .iter()
            .find(|(_, e)| matches!(e.kind, EventKind::Granted(_)))
        else {
            break;
        };
        order.push(if e.ticket > 100 { 2 } else { 1 });
        running = (k, e.ticket);
    }
    // Tenant 2's five requests are served within the first ten grants, alternating.
    assert_eq!(&order[..10], &[2, 1, 2, 1, 2, 1, 2, 1, 2, 1], "{order:?}");
    assert_eq!(order.len(), 24);
}

#[test]
fn the_failure_threshold_counts_every_workers_attempts() {
    let (_, mut a, mut b) = two_workers(HealthConfig {
        failure_threshold: 2,
        probing: false,
        ..HealthConfig::default()
    });
    assert_eq!(
        a.submit(1, Priority::High, 0, 0, 0, 0),
        Ok(Admit::Granted(0))
    );
    assert_eq!(
        b.submit(1, Priority::High, 0, 1 << 1, 0, 0),
        Ok(Admit::Granted(0))
    );
    a.release(1, Outcome::Failure, 0, 1).unwrap();
    assert_eq!(a.instance_state(0, 1), Ok(InstanceState::Healthy));
    // one failure each, two in a row for the instance: b's ejects it, and a adopts it
    b.release(1, Outcome::Failure, 0, 2).unwrap();
    assert_eq!(b.instance_state(0, 2), Ok(InstanceState::Ejected));
    a.tick(3);
    assert_eq!(a.instance_state(0, 3), Ok(InstanceState::Ejected));
}

#[test]
fn closed_loop_clients_on_two_workers_are_served_alike() {
    // One unit; four clients per worker, each sending its next request to the same worker as
    // soon as its answer arrives (keep-alive connections). The unit must go round both
    // workers' queues in arrival order, not stay with the worker that frees it.
    let r = region(2);
    let mut pools: Vec<Pool> = (0..2)
        .map(|w| worker(r, w, &[1], PoolConfig::default()))
        .collect();
    let (mut ticket, mut now) = (0u64, 0u64);
    let mut owner = std::collections::HashMap::new();
    let mut running = None;
    let granted = |events: Vec<gateway_core::Event>, running: &mut Option<u64>| {
        for e in events {
            if let EventKind::Granted(_) = e.kind {
                *running = Some(e.ticket);
            }
        }
    };
    for _ in 0..4 {
        for (w, pool) in pools.iter_mut().enumerate() {
            ticket += 1;
            owner.insert(ticket, w);
            if let Ok(Admit::Granted(_)) = pool.submit(ticket, Priority::High, 0, 0, 0, 0) {
                running = Some(ticket);
            }
        }
    }
    let mut served = [0u32; 2];
    for _ in 0..400 {
        now += 3;
        let t = running.take().expect("the unit is always in use");
        let w = owner[&t];
        served[w] += 1;
        let events = pools[w].release(t, Outcome::Success, 0, now).unwrap();
        granted(events, &mut running);
        let wakes = pools[w].take_wakes();
        for k in (0..2).filter(|k| wakes & (1 << k) != 0) {
            let events = pools[k].tick(now);
            granted(events, &mut running);
        }
        ticket += 1;
        owner.insert(ticket, w);
        pools[w]
            .submit(ticket, Priority::High, 0, 0, 0, now)
            .unwrap();
        let events = pools[w].take_events();
        granted(events, &mut running);
    }
    assert!(served[0].abs_diff(served[1]) <= 8, "{served:?}");
}

/// SPEC §12 "Bounded and reclaimed": two workers apply 500 reloads that each rename the pool's
/// one instance (the old one drains, the new one joins) with requests running across them;
/// the region's instance cells, each worker's instances and bindings stay bounded, and every
/// reload keeps working (was: refused after 128 names).
#[test]
fn five_hundred_renames_leave_the_region_bounded() {
    let r = region(2);
    let mut pools = [
        worker(r, 0, &[2], PoolConfig::default()),
        worker(r, 1, &[2], PoolConfig::default()),
    ];
    let mut idx = [0usize, 0usize];
    let mut now = 0;
    let mut ticket = 1;
    for name in 1..=500u64 {
        // A request runs on the old instance in worker 0 while the reload lands.
        now += 1;
        let t = ticket;
        ticket += 1;
        assert_eq!(
            pools[0].submit(t, Priority::High, 0, 0, 0, now),
            Ok(Admit::Granted(idx[0]))
        );
        for (w, pool) in pools.iter_mut().enumerate() {
            pool.remove_instance(idx[w]).unwrap();
            idx[w] = pool
                .add_instance_with_id(2, Some(10_000 + name))
                .unwrap_or_else(|e| panic!("reload {name} refused: {e}"));
        }
        // Both workers use the new instance's one cell: the cap holds across them.
        now += 1;
        let (a, b) = (ticket, ticket + 1);
        ticket += 2;
        assert!(matches!(
            pools[0].submit(a, Priority::High, 0, 0, 0, now),
            Ok(Admit::Granted(_))
        ));
        assert!(matches!(
            pools[1].submit(b, Priority::High, 0, 0, 0, now),
            Ok(Admit::Granted(_))
        ));
        let p = r.find_pool(42).unwrap();
        assert!(r.instance_cells_used(p) <= 2, "old and new, no more");
        pools[0].release(t, Outcome::Success, 0, now).unwrap();
        pools[0].release(a, Outcome::Success, 0, now).unwrap();
        pools[1].release(b, Outcome::Success, 0, now).unwrap();
        for pool in &mut pools {
            pool.tick(now);
        }
        assert_eq!(
            r.instance_cells_used(p),
            1,
            "the drained instance's cell is free"
        );
        for pool in &pools {
            assert!(pool.instances().len() <= 2);
            assert_eq!(pool.shared_tables().0, 1);
        }
    }
}

/// SPEC §12 "idle tenants ... are reclaimed": 1,000 tenants (every batch of a thousand, or a
/// thousand keys) pass through two workers; the tenant table and each worker's cache stay
/// bounded and no tenant is pushed into the shared overflow count while entries are idle.
#[test]
fn a_thousand_tenants_leave_the_tables_bounded() {
    let r = region(2);
    let mut pools = [
        worker(r, 0, &[1], PoolConfig::default()),
        worker(r, 1, &[1], PoolConfig::default()),
    ];
    let p = r.find_pool(42).unwrap();
    let mut now = 0;
    for tenant in 0..1000u32 {
        let w = tenant as usize % 2;
        let t = u64::from(tenant) * 2 + 1;
        now += 1;
        // One runs, one of the same tenant waits behind it: the tenant is bound meanwhile.
        assert!(matches!(
            pools[w].submit(t, Priority::Low, tenant, 0, 0, now),
            Ok(Admit::Granted(_))
        ));
        assert_eq!(
            pools[w].submit(t + 1, Priority::Low, tenant, 0, 0, now),
            Ok(Admit::Queued(Priority::Low))
        );
        assert!(r.tenant_cells_used(p) < gateway_core::shm::MAX_TENANTS);
        let events = pools[w].release(t, Outcome::Success, 0, now).unwrap();
        assert!(matches!(events[0].kind, EventKind::Granted(_)));
        pools[w].release(t + 1, Outcome::Success, 0, now).unwrap();
        for pool in &mut pools {
            pool.tick(now);
            // What waits (two at most here), or a handful kept while nothing does.
            assert!(pool.shared_tables().1 <= 5, "the cache follows what waits");
        }
    }
    assert!(r.tenant_cells_used(p) < gateway_core::shm::MAX_TENANTS);
    assert_eq!(
        r.tenant_grants(p, gateway_core::shm::TENANT_OVERFLOW),
        0,
        "no tenant had to share the overflow count"
    );
}

/// SPEC §17 with workers: "an adaptive limit is the instance's cap that §12 shares" — one
/// worker's completions judge it, the other's cap follows, and the cap holds across both.
#[test]
fn an_adaptive_limit_is_one_cap_across_workers() {
    let r = region(2);
    let mut a = Pool::new(PoolConfig::default(), 1).unwrap();
    a.attach(r, 42, 0).unwrap();
    a.add_instance_full(32, Some(100), true).unwrap();
    let mut b = Pool::new(PoolConfig::default(), 1).unwrap();
    b.attach(r, 42, 1).unwrap();
    b.add_instance_full(32, Some(100), true).unwrap();
    let start = a.instances()[0].limit;
    assert_eq!(start, b.instances()[0].limit);
    // worker a runs windows of requests whose TPOT stays flat: the limit grows
    let mut t = 0;
    for w in 1..=4u64 {
        let now = w * 1_000;
        let mut granted = Vec::new();
        for _ in 0..a.instances()[0].limit {
            t += 1;
            if let Ok(Admit::Granted(_)) = a.submit(t, Priority::High, 0, 0, 0, now) {
                granted.push(t);
            }
        }
        for _ in 0..20 {
            // 16+ samples per window: each request streams 11 tokens at 10 ms
            for &g in &granted {
                a.first_token(g, now);
            }
            for &g in &granted {
                a.release_with(g, Outcome::Success, 0, 11, now + 100)
                    .unwrap();
            }
            granted.clear();
            for _ in 0..a.instances()[0].limit {
                t += 1;
                if let Ok(Admit::Granted(_)) = a.submit(t, Priority::High, 0, 0, 0, now) {
                    granted.push(t);
                }
            }
        }
        for &g in &granted {
            a.release(g, Outcome::Success, 0, now + 100).unwrap();
        }
    }
    let grown = a.instances()[0].limit;
    assert!(grown > start, "{start} -> {grown}");
    // b never saw a completion, yet its cap is the same limit once it looks
    b.tick(5_000);
    assert_eq!(b.instances()[0].limit, grown);
    // and the cap holds across both: b fills what a leaves of it
    let mut n = 0;
    while let Ok(Admit::Granted(_)) = b.submit(1_000_000 + n, Priority::High, 0, 0, 0, 5_000) {
        n += 1;
    }
    assert_eq!(n as u32, grown);
    assert_eq!(
        a.submit(2_000_000, Priority::High, 0, 0, 0, 5_000),
        Ok(Admit::Queued(Priority::High))
    );
    // switched off in one worker: the shared limit is cleared, every worker's cap is max again
    a.set_adaptive(0, false, 5_000).unwrap();
    b.set_adaptive(0, false, 5_000).unwrap();
    assert_eq!(r.limit(0, 0).1, None);
}

/// SPEC §17 with workers: "deadlines are compared across workers" — a request with an earlier
/// deadline waiting in one worker is granted before an earlier arrival with a later deadline
/// waiting in another.
#[test]
fn the_earliest_deadline_wins_across_workers() {
    use gateway_core::Request;
    let r = region(2);
    let mut a = worker(r, 0, &[1], PoolConfig::default());
    let mut b = worker(r, 1, &[1], PoolConfig::default());
    let req = |deadline| Request {
        deadline,
        ..Request::default()
    };
    assert_eq!(
        a.submit_request(1, Priority::High, req(0), &[], 0),
        Ok(Admit::Granted(0))
    );
    // a's waiter arrived first with a 5 s objective, b's later with a 1 s one
    assert_eq!(
        a.submit_request(2, Priority::High, req(5_010), &[], 10),
        Ok(Admit::Queued(Priority::High))
    );
    assert_eq!(
        b.submit_request(1, Priority::High, req(1_020), &[], 20),
        Ok(Admit::Queued(Priority::High))
    );
    // a frees the unit: b's head is due first, so a wakes b and keeps its own waiting
    assert!(a.release(1, Outcome::Success, 0, 30).unwrap().is_empty());
    assert_eq!(a.take_wakes(), 1 << 1);
    let events = b.tick(30);
    assert_eq!(
        (events[0].ticket, events[0].kind),
        (1, EventKind::Granted(0))
    );
    assert_eq!(a.waiting(), 1);
}

/// SPEC §12 "bounded and reclaimed" for pools: a reload loop that renames the pool 100 times
/// (the region holds 32 pools at once; their places used to last the supervisor's life) —
/// each old pool detaches in both workers once drained and its slot, cells and tenant entries
/// go back; the last worker's leaving resets the block for the next pool.
#[test]
fn a_hundred_pool_renames_leave_the_region_bounded() {
    let r = region(2);
    let joins = [Joins::default(), Joins::default()]; // one per worker process
    let mut old: Vec<Pool> = Vec::new();
    for name in 1000..1100u64 {
        let mut pools: Vec<Pool> = (0..2)
            .map(|w| {
                let mut p = Pool::new(PoolConfig::default(), 1).unwrap();
                p.attach_joined(r, &joins[w], name, w).unwrap();
                p.add_instance_with_id(2, Some(7)).unwrap();
                p
            })
            .collect();
        for (w, p) in pools.iter_mut().enumerate() {
            assert_eq!(
                p.submit(1, Priority::High, w as u32 + 1, 0, 0, name),
                Ok(Admit::Granted(0))
            );
        }
        // the previous name's pools close, this one's run
        for mut p in old.drain(..) {
            p.detach();
        }
        let live: Vec<usize> = (0..MAX_POOLS).filter(|&p| r.pool_in_use(p)).collect();
        assert_eq!(live.len(), 1, "only the current name holds a slot");
        let p = r.find_pool(name).unwrap();
        assert_eq!((r.instance_cells_used(p), r.tenant_cells_used(p)), (1, 2));
        for p in &mut pools {
            p.release(1, Outcome::Success, 0, name).unwrap();
        }
        old = pools;
    }
    for mut p in old {
        p.detach();
    }
    assert!((0..MAX_POOLS).all(|p| !r.pool_in_use(p)));
}

/// A worker holds two pools of one name while a removed one drains beside its re-added
/// successor: the first to detach leaves nothing the other uses (its attempt still counts
/// against the cap across workers); the slot goes with the last.
#[test]
fn a_detached_pool_leaves_nothing_its_successor_uses() {
    let r = region(2);
    let joins = Joins::default();
    let attach = |w: usize, joins: &Joins| {
        let mut p = Pool::new(PoolConfig::default(), 1).unwrap();
        p.attach_joined(r, joins, 42, w).unwrap();
        p.add_instance_with_id(1, Some(7)).unwrap();
        p
    };
    let (mut old, mut new, mut peer) = (
        attach(0, &joins),
        attach(0, &joins),
        worker(r, 1, &[], PoolConfig::default()),
    );
    peer.add_instance_with_id(1, Some(7)).unwrap();
    old.remove_instance(0).unwrap();
    assert_eq!(
        new.submit(1, Priority::High, 0, 0, 0, 1),
        Ok(Admit::Granted(0))
    );
    old.tick(2);
    old.detach();
    let p = r.find_pool(42).unwrap();
    assert_eq!(r.instance_cells_used(p), 1);
    let held: u64 = (0..MAX_SLOTS).map(|s| r.held(p, s)).sum();
    assert_eq!(held, 1, "worker 0's unit still counts");
    assert_eq!(
        peer.submit(2, Priority::High, 0, 0, 0, 3),
        Ok(Admit::Queued(Priority::High)),
        "the cap holds across workers"
    );
    let events = new.release(1, Outcome::Success, 0, 4).unwrap();
    assert!(events.is_empty());
    assert_eq!(peer.tick(5).len(), 1, "the freed unit goes to the peer");
    new.detach();
    assert!(r.pool_in_use(p), "worker 1 still uses it");
    peer.release(2, Outcome::Success, 0, 6).unwrap();
    peer.detach();
    assert!(!r.pool_in_use(p));
}
