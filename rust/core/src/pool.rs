//! One pool's scheduler: the dual queue, the class selector, the balancer and the instances'
//! slots and health — and the operations the I/O side calls. Every decision about who goes
//! next and where is made here; the caller only reports events (arrival, cancellation, an
//! attempt's end, a probe, the passing of time) and delivers what comes back.
//!
//! Invariants (checked by the property tests):
//! - an instance never has more than `max_concurrency` attempts in flight;
//! - every accepted ticket is granted, expired, evicted or cancelled exactly once, and a
//!   granted ticket is released exactly once;
//! - after each operation no waiting request fits a free, admitting instance (work
//!   conservation), except as time passes between operations — `tick` restores it.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::balancer::{Balancer, Load};
use crate::error::CoreError;
use crate::health::{Breaker, HealthConfig};
use crate::queue::{ClassQueue, Entry};
use crate::selector::{Choice, Selector, SelectorConfig};
use crate::types::{BalancerKind, InstanceState, Millis, Outcome, Priority, Tenant, Ticket};

/// Most instances one pool may hold: exclusions of already-tried instances are a `u64` set.
pub const MAX_INSTANCES: usize = 64;

/// SPEC §8 `scheduler:`, `balancer:` and `health:` as one pool sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    pub selector: SelectorConfig,
    pub high_capacity: usize,
    pub low_capacity: usize,
    pub high_max_wait_ms: Millis,
    pub low_max_wait_ms: Millis,
    pub overflow_high_to_low: bool,
    pub balancer: BalancerKind,
    pub health: HealthConfig,
}

impl Default for PoolConfig {
    fn default() -> Self {
        Self {
            selector: SelectorConfig::default(),
            high_capacity: 200,
            low_capacity: 1000,
            high_max_wait_ms: 30_000,
            low_max_wait_ms: 600_000,
            overflow_high_to_low: true,
            balancer: BalancerKind::LeastConnections,
            health: HealthConfig::default(),
        }
    }
}

impl PoolConfig {
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |m: &str| Err(CoreError::InvalidConfig(m.to_owned()));
        if self.selector.high_weight == 0 && self.selector.low_weight == 0 {
            return bad("scheduler weights: high and low cannot both be 0");
        }
        if self.selector.max_consecutive_high == 0 {
            return bad("scheduler.max_consecutive_high must be at least 1");
        }
        if self.selector.max_low_wait_ms == 0 {
            // 0 would force every grant to low while lows wait: priority inverted.
            return bad("scheduler.max_low_wait_ms must be at least 1");
        }
        if self.health.failure_threshold == 0 {
            return bad("health.failure_threshold must be at least 1");
        }
        if self.health.success_threshold == 0 {
            return bad("health.success_threshold must be at least 1");
        }
        if self.health.half_open_max_requests == 0 {
            return bad("health.half_open_max_requests must be at least 1");
        }
        if self.health.ejection_ms == 0 {
            return bad("health.ejection_ms must be at least 1");
        }
        Ok(())
    }
}

/// What became of a ticket, delivered by the operations that move the queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventKind {
    /// Send it to this instance now.
    Granted(usize),
    /// It waited longer than its class's `max_wait_ms` (SPEC §3 "Deadlines").
    Expired,
    /// No instance it may use is available any more: try the fallback pool, or answer 503
    /// with `Retry-After` (SPEC §6: "the time until the earliest instance may be tried").
    Unservable { retry_after_ms: Millis },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub ticket: Ticket,
    pub kind: EventKind,
}

/// Where `submit` put a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admit {
    /// Dispatched at once to this instance.
    Granted(usize),
    /// Waiting in this class (high may have spilled to low).
    Queued(Priority),
}

#[derive(Clone, Copy, Debug)]
enum TicketState {
    Waiting(Priority, Tenant),
    Granted {
        instance: u32,
        epoch: u32,
        trial: bool,
    },
}

/// Tickets are unique increasing integers: a multiplicative hash spreads them cheaply.
#[derive(Default)]
struct TicketHasher(u64);

impl Hasher for TicketHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

type TicketMap = HashMap<Ticket, TicketState, BuildHasherDefault<TicketHasher>>;

/// One backend instance as the scheduler sees it: its slots and its health.
#[derive(Clone, Debug)]
pub struct Instance {
    pub max_concurrency: u32,
    pub in_flight: u32,
    pub breaker: Breaker,
    /// Removed by a reload: takes nothing new, drains what it has.
    pub removed: bool,
}

impl Instance {
    fn load(&self) -> Load {
        Load {
            in_flight: self.in_flight,
            capacity: self.max_concurrency,
        }
    }
}

/// Grants per second over a sliding window of one-second buckets, for `Retry-After`.
#[derive(Clone, Debug, Default)]
struct DrainMeter {
    buckets: [u32; Self::WINDOW],
    /// The second the newest bucket counts.
    head_sec: u64,
    first_grant_ms: Option<Millis>,
}

impl DrainMeter {
    const WINDOW: usize = 10;

    fn roll(&mut self, now: Millis) {
        let sec = now / 1000;
        if sec > self.head_sec {
            let gap = (sec - self.head_sec).min(Self::WINDOW as u64) as usize;
            self.buckets.rotate_right(gap);
            self.buckets[..gap].fill(0);
            self.head_sec = sec;
        }
    }

    fn record(&mut self, now: Millis) {
        self.roll(now);
        self.buckets[0] += 1;
        self.first_grant_ms.get_or_insert(now);
    }

    /// Grants per second, or `None` before the first grant.
    fn rate(&mut self, now: Millis) -> Option<f64> {
        let first = self.first_grant_ms?;
        self.roll(now);
        let window_ms = (Self::WINDOW as u64 - 1) * 1000 + now % 1000;
        let span_ms = now.saturating_sub(first).clamp(1000, window_ms.max(1000));
        let total: u32 = self.buckets.iter().sum();
        Some(f64::from(total) * 1000.0 / span_ms as f64)
    }
}

/// Counters for metrics and the admin view; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub granted: [u64; 2],
    pub forced_low: u64,
    pub expired: u64,
    pub cancelled: u64,
    pub rejected_full: u64,
    pub unservable: u64,
}

pub struct Pool {
    cfg: PoolConfig,
    queues: [ClassQueue; 2],
    selector: Selector,
    balancer: Balancer,
    instances: Vec<Instance>,
    tickets: TicketMap,
    events: Vec<Event>,
    /// Instance state changes since the caller last asked, for lifecycle logs.
    transitions: Vec<(usize, InstanceState)>,
    /// `advance` has nothing to do before this time (the earliest ejection end).
    scan_at: Millis,
    /// Cached `available_mask`; `None` after any state change.
    up_mask: Option<u64>,
    drain: DrainMeter,
    stats: PoolStats,
}

impl Pool {
    pub fn new(cfg: PoolConfig, seed: u64) -> Result<Self, CoreError> {
        cfg.validate()?;
        Ok(Self {
            queues: [
                ClassQueue::new(cfg.high_capacity),
                ClassQueue::new(cfg.low_capacity),
            ],
            selector: Selector::new(),
            balancer: Balancer::new(cfg.balancer, seed),
            instances: Vec::new(),
            tickets: TicketMap::default(),
            events: Vec::new(),
            transitions: Vec::new(),
            scan_at: 0,
            up_mask: None,
            drain: DrainMeter::default(),
            stats: PoolStats::default(),
            cfg,
        })
    }

    // ---- configuration -------------------------------------------------------------------

    /// Applies a reloaded configuration. Waiting and in-flight requests stay; a smaller
    /// capacity only refuses new arrivals until the queue is below it. Call `tick` after.
    pub fn configure(&mut self, cfg: PoolConfig) -> Result<(), CoreError> {
        cfg.validate()?;
        self.queues[0].capacity = cfg.high_capacity;
        self.queues[1].capacity = cfg.low_capacity;
        if cfg.selector != self.cfg.selector {
            self.selector.reset_credit();
        }
        self.balancer.kind = cfg.balancer;
        self.cfg = cfg;
        self.invalidate();
        Ok(())
    }

    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// Adds an instance; returns its index. The slot of a removed instance that has drained
    /// is reused (nothing can refer to it any more), so reloads never exhaust the pool.
    pub fn add_instance(&mut self, max_concurrency: u32) -> Result<usize, CoreError> {
        if max_concurrency == 0 {
            return Err(CoreError::InvalidConfig(
                "max_concurrency must be at least 1".into(),
            ));
        }
        let fresh = Instance {
            max_concurrency,
            in_flight: 0,
            breaker: Breaker::new(),
            removed: false,
        };
        if let Some(idx) = self
            .instances
            .iter()
            .position(|i| i.removed && i.in_flight == 0)
        {
            self.instances[idx] = fresh;
            self.invalidate();
            return Ok(idx);
        }
        if self.instances.len() >= MAX_INSTANCES {
            return Err(CoreError::InvalidConfig(format!(
                "a pool holds at most {MAX_INSTANCES} instances"
            )));
        }
        self.instances.push(fresh);
        self.invalidate();
        Ok(self.instances.len() - 1)
    }

    /// Changes an instance's capacity. Lowering it below the in-flight count refuses new
    /// attempts until enough finish; nothing running is cut. Call `tick` after.
    pub fn set_max_concurrency(&mut self, idx: usize, n: u32) -> Result<(), CoreError> {
        if n == 0 {
            return Err(CoreError::InvalidConfig(
                "max_concurrency must be at least 1".into(),
            ));
        }
        self.instance_mut(idx)?.max_concurrency = n;
        Ok(())
    }

    /// Stops giving an instance new attempts; those in flight finish and release as usual.
    pub fn remove_instance(&mut self, idx: usize) -> Result<(), CoreError> {
        self.instance_mut(idx)?.removed = true;
        self.invalidate();
        Ok(())
    }

    fn instance_mut(&mut self, idx: usize) -> Result<&mut Instance, CoreError> {
        self.instances
            .get_mut(idx)
            .ok_or(CoreError::UnknownInstance(idx))
    }

    // ---- the operations ------------------------------------------------------------------

    /// A request arrives (or comes back for a retry with its original ticket and the
    /// instances it already tried in `excluded`).
    ///
    /// SPEC §2.4: "if the pool has a healthy instance with a free slot *and nothing of that
    /// pool is waiting*, dispatch at once; otherwise enqueue in the pool's dual queue".
    pub fn submit(
        &mut self,
        ticket: Ticket,
        priority: Priority,
        tenant: Tenant,
        excluded: u64,
        now: Millis,
    ) -> Result<Admit, CoreError> {
        if self.tickets.contains_key(&ticket) {
            return Err(CoreError::DuplicateTicket(ticket));
        }
        self.advance(now);
        // SPEC §6: nothing this request may use is up — answer now (fallback or 503).
        if !self.any_available(excluded) {
            self.stats.unservable += 1;
            return Err(CoreError::NoHealthyInstance {
                retry_after_ms: self.retry_after_unavailable(excluded, now),
            });
        }
        if self.waiting() == 0 {
            if let Some(inst) = self.pick_instance(excluded, now) {
                let choice = Choice::Alone(priority);
                self.selector
                    .commit(&self.cfg.selector, choice, priority, false, now);
                self.grant(ticket, priority, inst, now);
                return Ok(Admit::Granted(inst));
            }
        }
        // SPEC §3 "Overflow": a high request finding the high queue full spills into low.
        let class = if self.queues[priority.index()].has_room() {
            priority
        } else if priority == Priority::High
            && self.cfg.overflow_high_to_low
            && self.queues[Priority::Low.index()].has_room()
        {
            Priority::Low
        } else {
            self.stats.rejected_full += 1;
            return Err(CoreError::QueueFull {
                retry_after_ms: self.retry_after_ms(priority, now),
            });
        };
        self.queues[class.index()].push(Entry::new(ticket, tenant, now, excluded));
        self.tickets
            .insert(ticket, TicketState::Waiting(class, tenant));
        // Usually nothing fits (the queue was non-empty because nothing did), but a free slot
        // that only retries excluded, or capacity that came back with time, must not idle.
        self.pump(now);
        if let Some(pos) = self.events.iter().position(|e| e.ticket == ticket) {
            if let EventKind::Granted(inst) = self.events.remove(pos).kind {
                return Ok(Admit::Granted(inst));
            }
        }
        Ok(Admit::Queued(class))
    }

    /// Grants made by `submit` to *other* waiting tickets; deliver them.
    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    /// A waiting request leaves (client gone, deadline kept by the caller, drain). Returns
    /// `false` when it is not waiting — already granted (release it instead) or unknown.
    pub fn cancel(&mut self, ticket: Ticket) -> bool {
        match self.tickets.get(&ticket) {
            Some(TicketState::Waiting(class, tenant)) => {
                let (class, tenant) = (*class, *tenant);
                self.tickets.remove(&ticket);
                self.queues[class.index()].forget(tenant);
                self.stats.cancelled += 1;
                true
            }
            _ => false,
        }
    }

    /// An attempt ended: its slot frees, its outcome feeds the instance's health, and the
    /// freed slot goes to whoever waits. `retry_after_ms` > 0 cools the instance that long
    /// (an upstream 429/503 with `Retry-After`).
    pub fn release(
        &mut self,
        ticket: Ticket,
        outcome: Outcome,
        retry_after_ms: Millis,
        now: Millis,
    ) -> Result<Vec<Event>, CoreError> {
        let Some(TicketState::Granted {
            instance,
            epoch,
            trial,
        }) = self.tickets.get(&ticket).copied()
        else {
            return Err(CoreError::UnknownTicket(ticket));
        };
        self.tickets.remove(&ticket);
        // Time-driven transitions first, so the outcome meets the state it really lands in.
        self.advance(now);
        let inst = &mut self.instances[instance as usize];
        debug_assert!(
            inst.in_flight > 0,
            "release of an instance with nothing in flight"
        );
        inst.in_flight -= 1;
        let before = inst.breaker.state();
        inst.breaker
            .on_outcome(&self.cfg.health, outcome, epoch, trial, now);
        if retry_after_ms > 0 {
            // SPEC §16: "an upstream `Retry-After` is clamped to `health.max_ejection_ms`": an
            // upstream cannot take itself out for longer than the gateway would eject it.
            let pause = retry_after_ms.min(self.cfg.health.max_ejection_ms);
            inst.breaker.cool(now.saturating_add(pause));
        }
        let after = inst.breaker.state();
        if after != before {
            self.transitions.push((instance as usize, after));
            self.invalidate();
        }
        self.pump(now);
        Ok(self.take_events())
    }

    /// An active probe of instance `idx` finished.
    pub fn record_probe(
        &mut self,
        idx: usize,
        ok: bool,
        now: Millis,
    ) -> Result<Vec<Event>, CoreError> {
        let cfg = self.cfg.health.clone();
        if idx >= self.instances.len() {
            return Err(CoreError::UnknownInstance(idx));
        }
        // An ejection that ended meets this probe as half-open: a failure ejects it again.
        self.advance(now);
        let breaker = &mut self.instance_mut(idx)?.breaker;
        let before = breaker.state();
        breaker.on_probe(&cfg, ok, now);
        if breaker.state() != before {
            let after = breaker.state();
            self.transitions.push((idx, after));
            self.invalidate();
        }
        self.pump(now);
        Ok(self.take_events())
    }

    /// Time passed: expire overdue waiters, admit instances whose ejection or cool-down ended.
    /// Call at `next_wakeup`, and after reconfiguring.
    pub fn tick(&mut self, now: Millis) -> Vec<Event> {
        self.advance(now);
        self.pump(now);
        self.take_events()
    }

    /// When `tick` next has work: the earliest queue deadline, or the earliest time an
    /// unavailable instance may take traffic again while requests wait. `None` when idle.
    pub fn next_wakeup(&self, now: Millis) -> Option<Millis> {
        if self.waiting() == 0 {
            return None;
        }
        let deadlines = [Priority::High, Priority::Low]
            .into_iter()
            .filter_map(|c| self.queues[c.index()].next_deadline(self.max_wait(c)));
        let recoveries = self
            .instances
            .iter()
            .filter(|i| !i.removed)
            .map(|i| i.breaker.next_try_at(now))
            .filter(|&t| t > now);
        deadlines.chain(recoveries).min()
    }

    fn max_wait(&self, class: Priority) -> Millis {
        match class {
            Priority::High => self.cfg.high_max_wait_ms,
            Priority::Low => self.cfg.low_max_wait_ms,
        }
    }

    /// SPEC §3 "Deadlines": a request waiting longer than its class's `max_wait_ms` is
    /// answered and removed — before any grant, so an overdue request is never granted.
    fn expire(&mut self, now: Millis) {
        for class in [Priority::High, Priority::Low] {
            let max_wait = self.max_wait(class);
            let tickets = &self.tickets;
            let expired = self.queues[class.index()]
                .expire(now, max_wait, &|t| is_waiting(tickets, t, class));
            for t in expired {
                self.tickets.remove(&t);
                self.stats.expired += 1;
                self.events.push(Event {
                    ticket: t,
                    kind: EventKind::Expired,
                });
            }
        }
    }

    // ---- the scheduling ------------------------------------------------------------------

    /// Grants free slots to waiting requests until none fits; evicts waiters nothing can
    /// serve. Results go to `self.events`.
    fn pump(&mut self, now: Millis) {
        if self.waiting() == 0 {
            return;
        }
        self.advance(now);
        self.expire(now);
        self.evict_unservable(now);
        while self.waiting() > 0 {
            let tickets = &self.tickets;
            let low_live = |t| is_waiting(tickets, t, Priority::Low);
            let high_waiting = self.queues[0].live() > 0;
            let oldest_low = self.queues[1].oldest_enqueued_at(&low_live);
            let Some(choice) =
                self.selector
                    .choose(&self.cfg.selector, high_waiting, oldest_low, now)
            else {
                break;
            };
            let first = choice.class();
            let Some((entry, inst, class)) = self
                .pop_fitting(first, now)
                .or_else(|| self.pop_fitting(other(first), now))
            else {
                break;
            };
            self.selector
                .commit(&self.cfg.selector, choice, class, oldest_low.is_some(), now);
            if choice == Choice::Forced && class == Priority::Low {
                self.stats.forced_low += 1;
            }
            self.tickets.remove(&entry.ticket);
            self.grant(entry.ticket, class, inst, now);
            self.events.push(Event {
                ticket: entry.ticket,
                kind: EventKind::Granted(inst),
            });
        }
    }

    fn pop_fitting(&mut self, class: Priority, now: Millis) -> Option<(Entry, usize, Priority)> {
        if self.queues[class.index()].live() == 0 {
            return None;
        }
        let Pool {
            queues,
            tickets,
            balancer,
            instances,
            cfg,
            ..
        } = self;
        let live = |t| is_waiting(tickets, t, class);
        queues[class.index()]
            .pop_fitting(&live, |excluded| {
                pick(balancer, instances, &cfg.health, excluded, now)
            })
            .map(|(e, i)| (e, i, class))
    }

    /// SPEC §6: a request that no instance it may use can serve is answered now (its pool's
    /// fallback, or 503 with Retry-After) rather than held until its deadline.
    fn evict_unservable(&mut self, now: Millis) {
        // Computed lazily, once per sweep: only an eviction needs it.
        let mut retry_after_ms: Option<Millis> = None;
        for class in [Priority::High, Priority::Low] {
            if self.queues[class.index()].live() == 0 {
                continue;
            }
            let up = self.available_mask();
            let queue = &mut self.queues[class.index()];
            let tickets = &self.tickets;
            let live = |t| is_waiting(tickets, t, class);
            let gone = if up == 0 {
                queue.drain_all(&live)
            } else if queue.has_irregular() {
                queue.remove_where(&live, |e| up & !e.excluded == 0)
            } else {
                // Every entry is unrestricted and something is up: nothing to evict.
                continue;
            };
            if gone.is_empty() {
                continue;
            }
            let wait = *retry_after_ms.get_or_insert_with(|| self.retry_after_unavailable(0, now));
            for t in gone {
                self.tickets.remove(&t);
                self.stats.unservable += 1;
                self.events.push(Event {
                    ticket: t,
                    kind: EventKind::Unservable {
                        retry_after_ms: wait,
                    },
                });
            }
        }
    }

    fn grant(&mut self, ticket: Ticket, class: Priority, inst: usize, now: Millis) {
        let instance = &mut self.instances[inst];
        instance.in_flight += 1;
        // SPEC §5: "An instance never exceeds its max_concurrency."
        debug_assert!(
            instance.in_flight <= instance.max_concurrency,
            "instance {inst} over its max_concurrency"
        );
        let trial = instance.breaker.on_grant();
        let epoch = instance.breaker.epoch();
        self.tickets.insert(
            ticket,
            TicketState::Granted {
                instance: inst as u32,
                epoch,
                trial,
            },
        );
        self.stats.granted[class.index()] += 1;
        self.drain.record(now);
    }

    fn pick_instance(&mut self, excluded: u64, now: Millis) -> Option<usize> {
        pick(
            &mut self.balancer,
            &self.instances,
            &self.cfg.health,
            excluded,
            now,
        )
    }

    /// Applies time-driven transitions (ejected → half-open). Skipped until the earliest
    /// ejection can end: most operations on a busy pool then cost no walk over instances.
    fn advance(&mut self, now: Millis) {
        if now < self.scan_at {
            return;
        }
        let cfg = &self.cfg.health;
        let mut next = Millis::MAX;
        for (idx, inst) in self.instances.iter_mut().enumerate() {
            let before = inst.breaker.state();
            inst.breaker.advance(cfg, now);
            let after = inst.breaker.state();
            if after != before {
                self.transitions.push((idx, after));
                self.up_mask = None;
            }
            if let Some(until) = inst.breaker.ejected_until() {
                next = next.min(until);
            }
        }
        self.scan_at = next;
    }

    /// Something about the instances changed: cached views must be rebuilt.
    fn invalidate(&mut self) {
        self.scan_at = 0;
        self.up_mask = None;
    }

    /// Instance state changes (index, new state) since the last call, oldest first.
    pub fn take_transitions(&mut self) -> Vec<(usize, InstanceState)> {
        std::mem::take(&mut self.transitions)
    }

    pub fn has_transitions(&self) -> bool {
        !self.transitions.is_empty()
    }

    /// Bit set of instances that are up (not removed, not ejected), cached until a state
    /// changes.
    fn available_mask(&mut self) -> u64 {
        if let Some(mask) = self.up_mask {
            return mask;
        }
        let mask = self
            .instances
            .iter()
            .enumerate()
            .filter(|(_, i)| !i.removed && i.breaker.available())
            .fold(0, |m, (k, _)| m | (1 << k));
        self.up_mask = Some(mask);
        mask
    }

    fn any_available(&mut self, excluded: u64) -> bool {
        self.available_mask() & !excluded != 0
    }

    /// Milliseconds until the earliest instance this request may use can be tried.
    fn retry_after_unavailable(&self, excluded: u64, now: Millis) -> Millis {
        self.instances
            .iter()
            .enumerate()
            .filter(|(k, i)| !i.removed && excluded & (1 << k) == 0)
            .map(|(_, i)| i.breaker.next_try_at(now) - now)
            .min()
            .unwrap_or(0)
    }

    /// How long a request of `class` should wait before trying again: the queue ahead of it
    /// divided by the observed drain rate, at least 1 s, at most the class's `max_wait_ms`.
    pub fn retry_after_ms(&mut self, class: Priority, now: Millis) -> Millis {
        let ahead = match class {
            Priority::High => self.queues[0].live(),
            Priority::Low => self.queues[0].live() + self.queues[1].live(),
        } as f64;
        let cap = match class {
            Priority::High => self.cfg.high_max_wait_ms,
            Priority::Low => self.cfg.low_max_wait_ms,
        }
        .max(1000);
        match self.drain.rate(now) {
            Some(rate) if rate > 0.0 => {
                (((ahead + 1.0) / rate * 1000.0) as Millis).clamp(1000, cap)
            }
            _ => 1000,
        }
    }

    // ---- views ---------------------------------------------------------------------------

    pub fn waiting(&self) -> usize {
        self.queues[0].live() + self.queues[1].live()
    }

    pub fn queued(&self, class: Priority) -> usize {
        self.queues[class.index()].live()
    }

    /// Slots a new request could take right now: free slots of instances that admit traffic
    /// (a half-open instance counts only its remaining trial permits).
    pub fn free_slots(&mut self, now: Millis) -> u32 {
        self.advance(now);
        let health = &self.cfg.health;
        self.instances
            .iter()
            .filter(|i| !i.removed && i.breaker.admits(health, now))
            .map(|i| {
                let free = i.max_concurrency.saturating_sub(i.in_flight);
                if i.breaker.state() == InstanceState::HalfOpen {
                    free.min(health.half_open_max_requests - i.breaker.trials())
                } else {
                    free
                }
            })
            .sum()
    }

    pub fn in_flight(&self) -> u32 {
        self.instances.iter().map(|i| i.in_flight).sum()
    }

    pub fn instances(&self) -> &[Instance] {
        &self.instances
    }

    /// The instance's state after applying the passage of time.
    pub fn instance_state(&mut self, idx: usize, now: Millis) -> Result<InstanceState, CoreError> {
        if idx >= self.instances.len() {
            return Err(CoreError::UnknownInstance(idx));
        }
        self.advance(now);
        Ok(self.instances[idx].breaker.state())
    }

    pub fn stats(&self) -> PoolStats {
        self.stats
    }

    pub fn consecutive_high(&self) -> u32 {
        self.selector.consecutive_high()
    }

    pub fn drain_rate(&mut self, now: Millis) -> f64 {
        self.drain.rate(now).unwrap_or(0.0)
    }

    /// Tickets in flight or waiting (for leak checks).
    pub fn tickets_outstanding(&self) -> usize {
        self.tickets.len()
    }
}

impl Pool {
    /// The class a waiting ticket waits in (a high request may wait as low after a spill);
    /// `None` when it is not waiting.
    pub fn waiting_class(&self, ticket: Ticket) -> Option<Priority> {
        match self.tickets.get(&ticket) {
            Some(TicketState::Waiting(class, _)) => Some(*class),
            _ => None,
        }
    }
}

fn is_waiting(tickets: &TicketMap, t: Ticket, class: Priority) -> bool {
    matches!(tickets.get(&t), Some(TicketState::Waiting(c, _)) if *c == class)
}

fn other(p: Priority) -> Priority {
    match p {
        Priority::High => Priority::Low,
        Priority::Low => Priority::High,
    }
}

/// The balancer's choice among instances that admit a new attempt now, have a free slot and
/// are not excluded.
fn pick(
    balancer: &mut Balancer,
    instances: &[Instance],
    health: &HealthConfig,
    excluded: u64,
    now: Millis,
) -> Option<usize> {
    balancer.pick(
        instances.len(),
        |k| {
            let i = &instances[k];
            excluded & (1 << k) == 0
                && !i.removed
                && i.in_flight < i.max_concurrency
                && i.breaker.admits(health, now)
        },
        |k| instances[k].load(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(instances: &[u32], health: HealthConfig) -> Pool {
        let mut p = Pool::new(
            PoolConfig {
                health,
                ..PoolConfig::default()
            },
            1,
        )
        .unwrap();
        for &m in instances {
            p.add_instance(m).unwrap();
        }
        p
    }

    #[test]
    fn transitions_are_reported_once_in_order() {
        let health = HealthConfig {
            failure_threshold: 1,
            ejection_ms: 100,
            success_threshold: 1,
            probing: false,
            ..HealthConfig::default()
        };
        let mut p = pool(&[1], health);
        assert_eq!(p.submit(1, Priority::High, 0, 0, 0), Ok(Admit::Granted(0)));
        p.release(1, Outcome::Failure, 0, 0).unwrap();
        assert_eq!(p.take_transitions(), vec![(0, InstanceState::Ejected)]);
        assert!(!p.has_transitions());
        // time passes: the next decision sees it half-open, a success restores it
        assert_eq!(
            p.submit(2, Priority::High, 0, 0, 100),
            Ok(Admit::Granted(0))
        );
        p.release(2, Outcome::Success, 0, 101).unwrap();
        assert_eq!(
            p.take_transitions(),
            vec![(0, InstanceState::HalfOpen), (0, InstanceState::Healthy)]
        );
    }

    #[test]
    fn a_drained_removed_slot_is_reused() {
        let mut p = pool(&[1, 1], HealthConfig::default());
        assert_eq!(p.submit(1, Priority::High, 0, 0, 0), Ok(Admit::Granted(0)));
        p.remove_instance(0).unwrap();
        p.remove_instance(1).unwrap();
        // instance 1 is drained, instance 0 still has an attempt in flight
        assert_eq!(p.add_instance(4).unwrap(), 1);
        assert_eq!(p.add_instance(4).unwrap(), 2);
        p.release(1, Outcome::Success, 0, 1).unwrap();
        assert_eq!(p.add_instance(4).unwrap(), 0);
        assert_eq!(p.instances().len(), 3);
    }
}
