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
use std::sync::atomic::{fence, Ordering::SeqCst};

use crate::affinity::{self, HashRing};
use crate::balancer::{Balancer, Load};
use crate::error::CoreError;
use crate::health::{Breaker, HealthConfig};
use crate::prefix::{self, PrefixIndex};
use crate::queue::{ClassQueue, Entry};
use crate::selector::{Choice, Selector, SelectorConfig};
use crate::shared::Shared;
use crate::shm::{min_opt, Region};
use crate::types::{
    Affinity, BalancerKind, InstanceState, Millis, Outcome, Priority, Tenant, Ticket,
};

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
    /// SPEC §15 `affinity.epsilon` in thousandths: an affine request goes to an instance only
    /// while its load is at most `(1 + ε)` times the pool's average.
    pub affinity_epsilon_permille: u32,
    /// SPEC §15: the prompt blocks the index remembers per instance, "bounded by that
    /// instance's cache size" (`C`; it holds between `C` and `2C`).
    pub prefix_capacity_blocks: u32,
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
            affinity_epsilon_permille: 250,
            // 0.8 × 131,072 tokens × 4 bytes per token ÷ 64-byte blocks
            prefix_capacity_blocks: 6553,
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
    /// For a grant in an `affinity` pool: whether it went to its key's first choice.
    pub affinity: Affinity,
    /// For a grant placed by prompt blocks: how many leading blocks its instance holds.
    pub matched_blocks: u32,
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
    /// SPEC §12: attempts other workers have on it (0 when one process owns the pool).
    pub peer_in_flight: u32,
    pub breaker: Breaker,
    /// Removed by a reload: takes nothing new, drains what it has.
    pub removed: bool,
}

/// What an instance is beyond its slots and health (SPEC §15): its place on the affinity
/// ring and what its backend reports of itself. Kept beside `Instance`, not in it, so that
/// the balancer's scan reads one 64-byte line per instance, as before these existed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InstanceExtra {
    /// Where its points lie on the affinity hash ring: a stable identity (a hash of its
    /// name), so that a reload reusing the index of another instance moves that one's keys.
    pub ring_id: u64,
    /// Requests the backend itself reports waiting (vLLM `num_requests_waiting`).
    pub backend_waiting: u32,
    /// The backend's KV-cache usage in thousandths (vLLM `gpu_cache_usage_perc`).
    pub cache_permille: u16,
}

impl Instance {
    /// The load of an instance whose backend reports nothing: its own attempts only.
    fn load(&self) -> Load {
        Load {
            active: self.in_flight.saturating_add(self.peer_in_flight),
            capacity: self.max_concurrency,
            cache_permille: 0,
        }
    }

    /// SPEC §15 "Backend load": this pool's attempts plus the backend's own queue.
    fn load_with(&self, extra: &InstanceExtra) -> Load {
        Load {
            active: self
                .in_flight
                .saturating_add(self.peer_in_flight)
                .saturating_add(extra.backend_waiting),
            capacity: self.max_concurrency,
            cache_permille: extra.cache_permille,
        }
    }

    /// Requests on the instance, for the affinity bound.
    fn active(&self, extra: &InstanceExtra) -> u64 {
        u64::from(self.in_flight)
            + u64::from(self.peer_in_flight)
            + u64::from(extra.backend_waiting)
    }

    /// Whether another attempt fits under its cap (every worker's attempts counted).
    fn has_room(&self) -> bool {
        self.in_flight.saturating_add(self.peer_in_flight) < self.max_concurrency
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
    /// Grants to their key's first-choice instance, and to a later one (SPEC §15).
    pub affinity_hits: u64,
    pub affinity_spills: u64,
}

pub struct Pool {
    cfg: PoolConfig,
    queues: [ClassQueue; 2],
    selector: Selector,
    balancer: Balancer,
    instances: Vec<Instance>,
    /// `extras[i]` belongs to `instances[i]`.
    extras: Vec<InstanceExtra>,
    /// Some backend reported load: the balancers read `extras` (else they skip them).
    backend_loaded: bool,
    /// The affinity hash ring, built on first use; `None` after the instances change.
    ring: Option<HashRing>,
    /// Where the latest grant landed relative to its affinity key.
    last_affinity: Affinity,
    /// The leading prompt blocks the latest grant's instance held (SPEC §15).
    last_matched: u32,
    /// SPEC §15: which prompt blocks each instance was sent (empty unless placed by blocks).
    prefixes: PrefixIndex,
    /// The blocks of waiting requests placed by them, recorded when they are granted.
    pending_blocks: HashMap<Ticket, Box<[u64]>, BuildHasherDefault<TicketHasher>>,
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
    /// SPEC §12: the workers' shared state of this pool (`None`: this process owns it).
    shared: Option<Shared>,
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
            extras: Vec::new(),
            backend_loaded: false,
            ring: None,
            last_affinity: Affinity::None,
            last_matched: 0,
            prefixes: PrefixIndex::new(cfg.prefix_capacity_blocks as usize),
            pending_blocks: HashMap::default(),
            tickets: TicketMap::default(),
            events: Vec::new(),
            transitions: Vec::new(),
            scan_at: 0,
            up_mask: None,
            drain: DrainMeter::default(),
            stats: PoolStats::default(),
            shared: None,
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
            if let Some(shared) = &self.shared {
                shared.reset_credit();
            }
        }
        self.balancer.kind = cfg.balancer;
        if cfg.prefix_capacity_blocks != self.cfg.prefix_capacity_blocks {
            self.prefixes
                .set_capacity(cfg.prefix_capacity_blocks as usize);
        }
        self.cfg = cfg;
        self.invalidate();
        Ok(())
    }

    pub fn config(&self) -> &PoolConfig {
        &self.cfg
    }

    /// Adds an instance; returns its index. The slot of a removed instance that has drained
    /// is reused (nothing can refer to it any more), so reloads never exhaust the pool. Its
    /// ring id is its index; see `add_instance_with_id`.
    pub fn add_instance(&mut self, max_concurrency: u32) -> Result<usize, CoreError> {
        self.add_instance_with_id(max_concurrency, None)
    }

    /// Adds an instance whose points on the affinity ring derive from `ring_id` (a stable
    /// identity such as a hash of its name; `None`: its index).
    pub fn add_instance_with_id(
        &mut self,
        max_concurrency: u32,
        ring_id: Option<u64>,
    ) -> Result<usize, CoreError> {
        if max_concurrency == 0 {
            return Err(CoreError::InvalidConfig(
                "max_concurrency must be at least 1".into(),
            ));
        }
        let reused = self
            .instances
            .iter()
            .position(|i| i.removed && i.in_flight == 0);
        if reused.is_none() && self.instances.len() >= MAX_INSTANCES {
            return Err(CoreError::InvalidConfig(format!(
                "a pool holds at most {MAX_INSTANCES} instances"
            )));
        }
        let idx = reused.unwrap_or(self.instances.len());
        let fresh = Instance {
            max_concurrency,
            in_flight: 0,
            peer_in_flight: 0,
            breaker: Breaker::new(),
            removed: false,
        };
        let extra = InstanceExtra {
            ring_id: ring_id.unwrap_or(idx as u64),
            ..InstanceExtra::default()
        };
        if let Some(shared) = self.shared.as_mut() {
            shared.bind(idx, extra.ring_id).ok_or_else(slots_used_up)?;
        }
        // A reused slot is another instance: what the old one held is not there.
        self.prefixes.forget(idx);
        if idx < self.instances.len() {
            self.instances[idx] = fresh;
            self.extras[idx] = extra;
        } else {
            self.instances.push(fresh);
            self.extras.push(extra);
        }
        self.invalidate();
        self.ring = None;
        self.note_backend_load();
        Ok(idx)
    }

    /// SPEC §15 "Backend load": what the instance's backend reports of itself (vLLM's
    /// `num_requests_waiting` and `gpu_cache_usage_perc` in thousandths). Counted by the
    /// balancers from the next decision; nothing is granted or taken back by it.
    pub fn set_backend_load(
        &mut self,
        idx: usize,
        waiting: u32,
        cache_permille: u16,
    ) -> Result<(), CoreError> {
        self.instance_mut(idx)?;
        self.extras[idx] = InstanceExtra {
            backend_waiting: waiting,
            cache_permille: cache_permille.min(1000),
            ..self.extras[idx]
        };
        self.note_backend_load();
        Ok(())
    }

    /// Keeps the balancers' shortcut exact: without backend load, `extras` are not read.
    fn note_backend_load(&mut self) {
        self.backend_loaded = self
            .extras
            .iter()
            .any(|e| e.backend_waiting != 0 || e.cache_permille != 0);
    }

    /// The instance's ring id and backend load (see `InstanceExtra`).
    pub fn extra(&self, idx: usize) -> Result<InstanceExtra, CoreError> {
        self.extras
            .get(idx)
            .copied()
            .ok_or(CoreError::UnknownInstance(idx))
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
    /// It leaves the affinity ring: its keys move to their next instance, no other key moves.
    pub fn remove_instance(&mut self, idx: usize) -> Result<(), CoreError> {
        self.instance_mut(idx)?.removed = true;
        self.prefixes.forget(idx);
        self.invalidate();
        self.ring = None;
        Ok(())
    }

    fn instance_mut(&mut self, idx: usize) -> Result<&mut Instance, CoreError> {
        self.instances
            .get_mut(idx)
            .ok_or(CoreError::UnknownInstance(idx))
    }

    // ---- the operations ------------------------------------------------------------------

    /// A request arrives (or comes back for a retry with its original ticket and the
    /// instances it already tried in `excluded`). `affinity_key` (0: none) places it in an
    /// `affinity` pool (SPEC §15); `last_affinity` then tells where an immediate grant landed.
    ///
    /// SPEC §2.4: "if the pool has a healthy instance with a free slot *and nothing of that
    /// pool is waiting*, dispatch at once; otherwise enqueue in the pool's dual queue".
    pub fn submit(
        &mut self,
        ticket: Ticket,
        priority: Priority,
        tenant: Tenant,
        excluded: u64,
        affinity_key: u64,
        now: Millis,
    ) -> Result<Admit, CoreError> {
        self.submit_prefixed(ticket, priority, (tenant, excluded, affinity_key), &[], now)
    }

    /// `submit` with the request's prompt blocks (`prefix::chain_hashes`; SPEC §15): in an
    /// `affinity` pool a request without a session key (`affinity_key` 0) goes where the
    /// longest run of its blocks is held (`prefix::place`), and the blocks are recorded for
    /// the instance it is granted (with a key too: a session's instance holds its prompt).
    /// `extra` is (tenant, excluded, affinity key).
    pub fn submit_prefixed(
        &mut self,
        ticket: Ticket,
        priority: Priority,
        extra: (Tenant, u64, u64),
        blocks: &[u64],
        now: Millis,
    ) -> Result<Admit, CoreError> {
        if self.tickets.contains_key(&ticket) {
            return Err(CoreError::DuplicateTicket(ticket));
        }
        // Blocks matter to an affinity pool only: elsewhere the hot path is unchanged.
        let blocks = if self.balancer.kind == BalancerKind::Affinity {
            blocks
        } else {
            &[]
        };
        // SPEC §12: a worker first reads the others' state, and after, shows its own.
        self.sync(now);
        let admit = self.admit(ticket, priority, extra, blocks, now);
        self.publish(now, false);
        admit
    }

    /// `submit` after the duplicate check; `extra` is (tenant, excluded, affinity key).
    fn admit(
        &mut self,
        ticket: Ticket,
        priority: Priority,
        extra: (Tenant, u64, u64),
        blocks: &[u64],
        now: Millis,
    ) -> Result<Admit, CoreError> {
        let (tenant, excluded, affinity_key) = extra;
        self.advance(now);
        // SPEC §6: nothing this request may use is up — answer now (fallback or 503).
        if !self.any_available(excluded) {
            self.stats.unservable += 1;
            return Err(CoreError::NoHealthyInstance {
                retry_after_ms: self.retry_after_unavailable(excluded, now),
            });
        }
        // SPEC §12: "nothing of that pool is waiting" in any worker.
        if self.waiting() == 0 && self.peers_waiting() == (0, 0) {
            if let Some((inst, placed, matched)) =
                self.pick_instance(excluded, affinity_key, blocks, now)
            {
                let choice = Choice::Alone(priority);
                self.commit_choice(choice, priority, false, now);
                self.grant(ticket, (priority, tenant), inst, placed, now);
                self.last_matched = matched;
                if !blocks.is_empty() {
                    // SPEC §15: "remembers, per instance ..., which blocks it sent there".
                    self.prefixes.record(inst, blocks);
                }
                return Ok(Admit::Granted(inst));
            }
        }
        // SPEC §3 "Overflow": a high request finding the high queue full spills into low.
        let class = if self.has_room(priority) {
            priority
        } else if priority == Priority::High
            && self.cfg.overflow_high_to_low
            && self.has_room(Priority::Low)
        {
            Priority::Low
        } else {
            self.stats.rejected_full += 1;
            return Err(CoreError::QueueFull {
                retry_after_ms: self.retry_after_ms(priority, now),
            });
        };
        self.queues[class.index()]
            .push(Entry::new(ticket, tenant, now, excluded).with_affinity_key(affinity_key));
        self.tickets
            .insert(ticket, TicketState::Waiting(class, tenant));
        if !blocks.is_empty() {
            self.pending_blocks.insert(ticket, blocks.into());
        }
        if let Some(shared) = self.shared.as_mut() {
            shared.tenant_waits(tenant);
            // SPEC §12, no lost wake-up: publish that we wait, *then* look at the units again.
            // A worker freeing a unit gives it back, then reads who waits; with a full fence
            // on both sides (Dekker's pattern) at least one of the two sees the other.
            self.publish_waiting();
            fence(SeqCst);
            self.sync(now);
        }
        // Usually nothing fits (the queue was non-empty because nothing did), but a free slot
        // that only retries excluded, or capacity that came back with time, must not idle.
        self.pump(now);
        if let Some(pos) = self.events.iter().position(|e| e.ticket == ticket) {
            let event = self.events.remove(pos);
            if let EventKind::Granted(inst) = event.kind {
                self.last_affinity = event.affinity;
                self.last_matched = event.matched_blocks;
                return Ok(Admit::Granted(inst));
            }
        }
        Ok(Admit::Queued(class))
    }

    /// A waiting ticket left without a grant: its blocks go (nothing to look up when no
    /// waiting request carries any, the case of every pool but `affinity`).
    fn forget_blocks(&mut self, ticket: Ticket) {
        if !self.pending_blocks.is_empty() {
            self.pending_blocks.remove(&ticket);
        }
    }

    /// Where the latest grant landed relative to its affinity key: after a `submit` that
    /// granted at once, that request's (queued grants carry theirs in their `Event`).
    pub fn last_affinity(&self) -> Affinity {
        self.last_affinity
    }

    /// How many leading prompt blocks the latest grant's instance held (as `last_affinity`).
    pub fn last_matched_blocks(&self) -> u32 {
        self.last_matched
    }

    /// SPEC §15: an instance's own bound `C` (its backend reported its cache size); the next
    /// reload's `prefix_capacity_blocks` replaces it.
    pub fn set_prefix_capacity(&mut self, idx: usize, blocks: u32) -> Result<(), CoreError> {
        self.instance_mut(idx)?;
        self.prefixes.set_instance_capacity(idx, blocks as usize);
        Ok(())
    }

    /// SPEC §15: the prompt blocks the index holds for an instance, its bound `C`, and how
    /// many generations it dropped (for `/admin/state`).
    pub fn prefix_index(&self, idx: usize) -> (usize, usize, u64) {
        self.prefixes.stats(idx)
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
                self.forget_blocks(ticket);
                self.queues[class.index()].forget(tenant);
                self.stats.cancelled += 1;
                if self.shared.is_some() {
                    self.publish_waiting();
                }
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
        if let Some(shared) = self.shared.as_mut() {
            shared.give(instance as usize, trial);
            fence(SeqCst); // the other half of `submit`'s fence: then read who waits
        }
        self.sync(now);
        // Time-driven transitions first, so the outcome meets the state it really lands in.
        self.advance(now);
        let inst = &mut self.instances[instance as usize];
        debug_assert!(
            inst.in_flight > 0,
            "release of an instance with nothing in flight"
        );
        inst.in_flight -= 1;
        let before = inst.breaker.state();
        let current = epoch == inst.breaker.epoch();
        inst.breaker
            .on_outcome(&self.cfg.health, outcome, epoch, trial, now);
        if let Some(shared) = &self.shared {
            // SPEC §12: the failure threshold counts every worker's attempts.
            if current && before == InstanceState::Healthy && outcome != Outcome::Neutral {
                let n = shared.outcome(instance as usize, outcome == Outcome::Failure);
                if n > 0 {
                    inst.breaker.shared_failures(&self.cfg.health, n, now);
                }
            }
        }
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
        self.publish(now, true);
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
        self.sync(now);
        if let Some(shared) = self.shared.as_mut() {
            shared.publish_probe(idx, ok); // every worker applies it (one prober per interval)
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
        self.publish(now, true);
        Ok(self.take_events())
    }

    /// Time passed: expire overdue waiters, admit instances whose ejection or cool-down ended.
    /// Call at `next_wakeup`, and after reconfiguring.
    pub fn tick(&mut self, now: Millis) -> Vec<Event> {
        self.sync(now);
        self.advance(now);
        self.pump(now);
        self.publish(now, true);
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
                self.forget_blocks(t);
                self.stats.expired += 1;
                self.events.push(Event {
                    ticket: t,
                    kind: EventKind::Expired,
                    affinity: Affinity::None,
                    matched_blocks: 0,
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
            let mut high_waiting = self.queues[0].live() > 0;
            let mut oldest_low = self.queues[1].oldest_enqueued_at(&low_live);
            if let Some(shared) = &self.shared {
                // SPEC §12: the selector and the starvation guard see every worker's queue.
                high_waiting |= shared.peers.high > 0;
                oldest_low = min_opt(oldest_low, shared.peers.oldest_low);
            }
            let Some(choice) =
                self.selector
                    .choose(&self.cfg.selector, high_waiting, oldest_low, now)
            else {
                break;
            };
            let first = choice.class();
            if self.shared.is_some() && (!self.any_room(now) || self.defers(first, now)) {
                // Nothing free (a deferral then would be given up for nothing), or the turn
                // is another worker's.
                break;
            }
            let Some((entry, (inst, placed, matched), class)) = self
                .pop_fitting(first, now)
                .or_else(|| self.pop_fitting(other(first), now))
            else {
                break;
            };
            self.commit_choice(choice, class, oldest_low.is_some(), now);
            if choice == Choice::Forced && class == Priority::Low {
                self.stats.forced_low += 1;
            }
            self.tickets.remove(&entry.ticket);
            self.grant(entry.ticket, (class, entry.tenant), inst, placed, now);
            if !self.pending_blocks.is_empty() {
                if let Some(blocks) = self.pending_blocks.remove(&entry.ticket) {
                    self.prefixes.record(inst, &blocks);
                }
            }
            self.events.push(Event {
                ticket: entry.ticket,
                kind: EventKind::Granted(inst),
                affinity: placed,
                matched_blocks: matched,
            });
        }
    }

    fn pop_fitting(
        &mut self,
        class: Priority,
        now: Millis,
    ) -> Option<(Entry, (usize, Affinity, u32), Priority)> {
        if self.queues[class.index()].live() == 0 {
            return None;
        }
        let Pool {
            queues,
            tickets,
            balancer,
            instances,
            extras,
            backend_loaded,
            ring,
            cfg,
            shared,
            prefixes,
            pending_blocks,
            ..
        } = self;
        let live = |t| is_waiting(tickets, t, class);
        let view = Instances {
            instances,
            extras,
            backend_loaded: *backend_loaded,
        };
        let shared = shared.as_ref();
        queues[class.index()]
            .pop_fitting(&live, |e| {
                let blocks = if pending_blocks.is_empty() {
                    &[][..]
                } else {
                    pending_blocks.get(&e.ticket).map_or(&[][..], |b| &b[..])
                };
                pick_taking(
                    balancer,
                    ring,
                    &view,
                    cfg,
                    shared,
                    e.excluded,
                    (e.affinity_key, blocks, prefixes),
                    now,
                )
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
                self.forget_blocks(t);
                self.stats.unservable += 1;
                self.events.push(Event {
                    ticket: t,
                    kind: EventKind::Unservable {
                        retry_after_ms: wait,
                    },
                    affinity: Affinity::None,
                    matched_blocks: 0,
                });
            }
        }
    }

    fn grant(
        &mut self,
        ticket: Ticket,
        (class, tenant): (Priority, Tenant),
        inst: usize,
        placed: Affinity,
        now: Millis,
    ) {
        if let Some(shared) = self.shared.as_mut() {
            shared.tenant_granted(tenant);
        }
        match placed {
            Affinity::None => {}
            Affinity::Hit => self.stats.affinity_hits += 1,
            Affinity::Spill => self.stats.affinity_spills += 1,
        }
        self.last_affinity = placed;
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

    fn pick_instance(
        &mut self,
        excluded: u64,
        affinity_key: u64,
        blocks: &[u64],
        now: Millis,
    ) -> Option<(usize, Affinity, u32)> {
        let view = Instances {
            instances: &self.instances,
            extras: &self.extras,
            backend_loaded: self.backend_loaded,
        };
        pick_taking(
            &mut self.balancer,
            &mut self.ring,
            &view,
            &self.cfg,
            self.shared.as_ref(),
            excluded,
            (affinity_key, blocks, &self.prefixes),
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
        let (peer_high, peer_low) = self.peers_waiting();
        let high = self.queues[0].live() as u64 + peer_high;
        let ahead = match class {
            Priority::High => high,
            Priority::Low => high + self.queues[1].live() as u64 + peer_low,
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
        self.sync(now);
        self.advance(now);
        let health = &self.cfg.health;
        self.instances
            .iter()
            .filter(|i| !i.removed && i.breaker.admits(health, now))
            .map(|i| {
                let free = i
                    .max_concurrency
                    .saturating_sub(i.in_flight.saturating_add(i.peer_in_flight));
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

/// SPEC §12: the pool as one of several workers sharing one region.
impl Pool {
    /// Makes this pool the worker `worker`'s share of pool `pool_id` (a stable hash of its
    /// name) in the workers' region. Call before adding instances.
    pub fn attach(
        &mut self,
        region: Region<'static>,
        pool_id: u64,
        worker: usize,
    ) -> Result<(), CoreError> {
        if !self.instances.is_empty() {
            return Err(CoreError::InvalidConfig(
                "attach a pool to the workers' region before adding instances".into(),
            ));
        }
        self.shared = Some(Shared::new(region, pool_id, worker).ok_or_else(slots_used_up)?);
        Ok(())
    }

    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }

    /// SPEC §16: (instances bound to a region cell, tenant entries cached) of this worker;
    /// (0, 0) for a single process.
    pub fn shared_tables(&self) -> (usize, usize) {
        self.shared
            .as_ref()
            .map_or((0, 0), |s| (s.bound(), s.tenants_cached()))
    }

    /// What the other workers have waiting (high, low); (0, 0) for a single process.
    pub fn peers_waiting(&self) -> (u64, u64) {
        self.shared
            .as_ref()
            .map_or((0, 0), |s| (s.peers.high, s.peers.low))
    }

    /// Grants made by every worker (high, low); this pool's own for a single process.
    pub fn grants_everywhere(&self) -> (u64, u64) {
        self.shared
            .as_ref()
            .map_or((self.stats.granted[0], self.stats.granted[1]), |s| {
                s.grants()
            })
    }

    /// Worker slots to wake since the last call (a bit set; always 0 for a single process).
    pub fn take_wakes(&mut self) -> u64 {
        self.shared.as_mut().map_or(0, Shared::take_wakes)
    }

    /// SPEC §12 "one probe per instance per interval, not N": whether this worker probes
    /// instance `idx` now. Always `true` for a single process.
    pub fn claim_probe(&self, idx: usize, now: Millis, interval_ms: Millis) -> bool {
        self.shared
            .as_ref()
            .is_none_or(|s| idx < self.instances.len() && s.claim_probe(idx, now, interval_ms))
    }

    fn sync(&mut self, now: Millis) {
        let Some(shared) = self.shared.as_mut() else {
            return;
        };
        if shared.sync(
            &mut self.instances,
            &self.cfg.health,
            &mut self.selector,
            &mut self.transitions,
            now,
        ) {
            self.invalidate();
        }
    }

    /// After an operation: this worker's queue for the others to see, the ejections it made;
    /// with `offer`, a free unit its queue left goes to the workers that wait.
    fn publish(&mut self, now: Millis, offer: bool) {
        if self.shared.is_none() {
            return;
        }
        self.publish_waiting();
        let free = offer && self.any_room(now);
        let Some(shared) = self.shared.as_mut() else {
            return;
        };
        shared.publish_ejections(&self.instances);
        if free {
            shared.offer();
        }
    }

    /// Whether `class`'s queue has room for one more. SPEC §12: with workers the capacity
    /// bounds the union — a place is taken in the shared count before the entry goes in.
    fn has_room(&mut self, class: Priority) -> bool {
        let queue = &self.queues[class.index()];
        match self.shared.as_mut() {
            None => queue.has_room(),
            Some(shared) => shared.take_place(class, queue.capacity),
        }
    }

    /// Whether some instance could take an attempt now (every worker's attempts counted).
    fn any_room(&self, now: Millis) -> bool {
        let health = &self.cfg.health;
        self.instances
            .iter()
            .any(|i| !i.removed && i.has_room() && i.breaker.admits(health, now))
    }

    fn publish_waiting(&mut self) {
        let tickets = &self.tickets;
        let [high, low] = &mut self.queues;
        let counts = (high.live(), low.live());
        let is_high = |t| is_waiting(tickets, t, Priority::High);
        let is_low = |t| is_waiting(tickets, t, Priority::Low);
        let oldest = (
            high.oldest_enqueued_at(&is_high),
            low.oldest_enqueued_at(&is_low),
        );
        let turns = (high.next_turn(&is_high), low.next_turn(&is_low));
        if let Some(shared) = self.shared.as_mut() {
            shared.publish_turns(turns.0, turns.1);
            shared.publish_waiting(counts, oldest);
        }
    }

    /// SPEC §12: whether this worker gives the grant of a `class` turn to another: the class
    /// waits only there, or another worker's next turn in it is fairer (its tenant had fewer
    /// grants across workers, or as many and it came first). The other is woken.
    fn defers(&mut self, class: Priority, now: Millis) -> bool {
        let tickets = &self.tickets;
        let mine = self.queues[class.index()].next_turn(&|t| is_waiting(tickets, t, class));
        let Some(shared) = self.shared.as_mut() else {
            return false;
        };
        match mine {
            None => {
                // The turn is a class only other workers have waiting: theirs to take.
                shared.defer_to(class);
                true
            }
            Some(mine) => shared.better_turn(class, mine, now).is_some(),
        }
    }

    fn commit_choice(&mut self, choice: Choice, class: Priority, low_waiting: bool, now: Millis) {
        let before = self.shared.as_ref().map(|_| self.selector.clone());
        self.selector
            .commit(&self.cfg.selector, choice, class, low_waiting, now);
        if let (Some(shared), Some(before)) = (&self.shared, before) {
            shared.commit(&before, &self.selector, class, now);
        }
    }
}

fn slots_used_up() -> CoreError {
    CoreError::InvalidConfig(format!(
        "the workers' shared region is full ({} pools, {} instance slots per pool)",
        crate::shm::MAX_POOLS,
        crate::shm::MAX_SLOTS
    ))
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

/// The instances with what their backends report, as the balancers read them.
struct Instances<'a> {
    instances: &'a [Instance],
    extras: &'a [InstanceExtra],
    backend_loaded: bool,
}

/// `pick`, and in a shared pool (SPEC §12) the unit taken from the shared lease word: an
/// instance another worker filled since the last look is passed over and the pick repeated.
#[allow(clippy::too_many_arguments)]
fn pick_taking(
    balancer: &mut Balancer,
    ring: &mut Option<HashRing>,
    view: &Instances<'_>,
    cfg: &PoolConfig,
    shared: Option<&Shared>,
    excluded: u64,
    affine: Affine<'_>,
    now: Millis,
) -> Option<(usize, Affinity, u32)> {
    let Some(shared) = shared else {
        return pick(balancer, ring, view, cfg, excluded, affine, now);
    };
    let mut full = 0u64;
    loop {
        let (k, placed, matched) = pick(balancer, ring, view, cfg, excluded | full, affine, now)?;
        if shared.take(k, &view.instances[k], cfg.health.half_open_max_requests) {
            return Some((k, placed, matched));
        }
        full |= 1 << k;
    }
}

/// The balancer's choice among instances that admit a new attempt now, have a free slot and
/// are not excluded; with the affinity decision.
fn pick(
    balancer: &mut Balancer,
    ring: &mut Option<HashRing>,
    view: &Instances<'_>,
    cfg: &PoolConfig,
    excluded: u64,
    (affinity_key, blocks, prefixes): Affine<'_>,
    now: Millis,
) -> Option<(usize, Affinity, u32)> {
    let (instances, extras) = (view.instances, view.extras);
    let health = &cfg.health;
    let candidate = |k: usize| {
        let i = &instances[k];
        excluded & (1 << k) == 0 && !i.removed && i.has_room() && i.breaker.admits(health, now)
    };
    if (affinity_key != 0 || !blocks.is_empty()) && balancer.kind == BalancerKind::Affinity {
        return place_affine(ring, view, cfg, (affinity_key, blocks, prefixes), candidate);
    }
    let n = instances.len();
    let chosen = if view.backend_loaded {
        balancer.pick(n, candidate, |k| instances[k].load_with(&extras[k]))
    } else {
        // The common case: no backend reports load; the scan reads `instances` alone.
        balancer.pick(n, candidate, |k| instances[k].load())
    };
    chosen.map(|i| (i, Affinity::None, 0))
}

/// SPEC §15: the key's instance on the hash ring while its load is at most `(1 + ε)` times
/// the pool's average, else the next one on the ring (see `affinity.rs`). The average is over
/// the instances that are up (not removed, not ejected), the request being placed included.
fn place_affine(
    ring: &mut Option<HashRing>,
    view: &Instances<'_>,
    cfg: &PoolConfig,
    (key, blocks, prefixes): Affine<'_>,
    candidate: impl Fn(usize) -> bool,
) -> Option<(usize, Affinity, u32)> {
    let (instances, extras) = (view.instances, view.extras);
    let ring = ring.get_or_insert_with(|| {
        HashRing::new(
            instances
                .iter()
                .zip(extras)
                .enumerate()
                .filter(|(_, (i, _))| !i.removed)
                .map(|(k, (_, e))| (k, e.ring_id)),
        )
    });
    let (total, up) = instances
        .iter()
        .zip(extras)
        .filter(|(i, _)| !i.removed && i.breaker.available())
        .fold((0u64, 0u64), |(t, n), (i, e)| (t + i.active(e), n + 1));
    if up == 0 {
        return None;
    }
    let cap = affinity::capacity(total, up, cfg.affinity_epsilon_permille);
    let load = |k: usize| instances[k].active(&extras[k]);
    if key != 0 {
        // SPEC §15: "A session (`X-Session-Id` header, or the body's `user`) keeps one
        // instance" — and a prompt shorter than one block goes by its whole hash.
        let mut lens = [0u32; 64];
        if !blocks.is_empty() {
            prefixes.matches(blocks, ring.members(), &mut lens);
        }
        return affinity::place(ring, key, cap, candidate, load).map(|(i, a)| (i, a, lens[i]));
    }
    let mut lens = [0u32; 64];
    let longest = prefixes.matches(blocks, ring.members(), &mut lens);
    let branches = prefixes.branches(blocks, &lens, longest);
    prefix::place(ring, blocks, &lens, longest, branches, cap, candidate, load)
}

/// What places a request in an `affinity` pool: its session key (0: none), its prompt
/// blocks, and the index of the blocks each instance holds.
type Affine<'a> = (u64, &'a [u64], &'a PrefixIndex);

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
        assert_eq!(
            p.submit(1, Priority::High, 0, 0, 0, 0),
            Ok(Admit::Granted(0))
        );
        p.release(1, Outcome::Failure, 0, 0).unwrap();
        assert_eq!(p.take_transitions(), vec![(0, InstanceState::Ejected)]);
        assert!(!p.has_transitions());
        // time passes: the next decision sees it half-open, a success restores it
        assert_eq!(
            p.submit(2, Priority::High, 0, 0, 0, 100),
            Ok(Admit::Granted(0))
        );
        p.release(2, Outcome::Success, 0, 101).unwrap();
        assert_eq!(
            p.take_transitions(),
            vec![(0, InstanceState::HalfOpen), (0, InstanceState::Healthy)]
        );
    }

    fn affinity_pool(instances: &[u32]) -> Pool {
        let mut p = Pool::new(
            PoolConfig {
                balancer: BalancerKind::Affinity,
                ..PoolConfig::default()
            },
            1,
        )
        .unwrap();
        for (k, &m) in instances.iter().enumerate() {
            p.add_instance_with_id(m, Some(1000 + k as u64)).unwrap();
        }
        p
    }

    #[test]
    fn affinity_keeps_a_key_on_its_instance_while_loads_allow() {
        let mut p = affinity_pool(&[8, 8, 8, 8]);
        let key = 0xDEAD_BEEF;
        let Ok(Admit::Granted(home)) = p.submit(1, Priority::High, 0, 0, key, 0) else {
            panic!("an idle pool grants at once");
        };
        assert_eq!(p.last_affinity(), Affinity::Hit);
        p.release(1, Outcome::Success, 0, 0).unwrap();
        for t in 2..20 {
            assert_eq!(
                p.submit(t, Priority::High, 0, 0, key, 0),
                Ok(Admit::Granted(home))
            );
            assert_eq!(p.last_affinity(), Affinity::Hit);
            p.release(t, Outcome::Success, 0, 0).unwrap();
        }
        // no key: placed by least connections, no affinity decision
        p.submit(50, Priority::High, 0, 0, 0, 0).unwrap();
        assert_eq!(p.last_affinity(), Affinity::None);
        assert_eq!(p.stats().affinity_hits, 19);
    }

    #[test]
    fn affinity_spills_past_the_load_bound_and_counts_backend_waiting() {
        let mut p = affinity_pool(&[8, 8, 8, 8]);
        let key = 77;
        let mut homes = Vec::new();
        // Mirrokni et al. with ε = 0.25 on 4 instances: capacity ceil(1.25 (L + 1) / 4)
        for t in 1..=8 {
            let Ok(Admit::Granted(i)) = p.submit(t, Priority::High, 0, 0, key, 0) else {
                panic!("room for all");
            };
            homes.push((i, p.last_affinity()));
        }
        let home = homes[0].0;
        assert_eq!(homes[0].1, Affinity::Hit);
        // the home takes the key while it is under capacity: 1 (L=0), then at L=1 cap 1 → spill
        assert_eq!(homes[1].1, Affinity::Spill);
        let on_home = homes.iter().filter(|(i, _)| *i == home).count();
        assert!(on_home <= 3, "{homes:?}");
        for (i, inst) in p.instances().iter().enumerate() {
            let total: u32 = p.instances().iter().map(|i| i.in_flight).sum();
            let cap = affinity::capacity(u64::from(total) - 1, 4, 250);
            assert!(u64::from(inst.in_flight) <= cap, "instance {i}");
        }
        // a backend's own queue is load: the key's home reports 10 waiting, the key spills
        for t in 1..=8 {
            p.release(t, Outcome::Success, 0, 0).unwrap();
        }
        p.set_backend_load(home, 10, 500).unwrap();
        assert_ne!(
            p.submit(100, Priority::High, 0, 0, key, 0),
            Ok(Admit::Granted(home))
        );
        assert_eq!(p.last_affinity(), Affinity::Spill);
    }

    #[test]
    fn a_queued_grant_carries_its_affinity_decision() {
        let mut p = affinity_pool(&[1, 1]);
        let key = 5;
        let Ok(Admit::Granted(home)) = p.submit(1, Priority::High, 0, 0, key, 0) else {
            panic!()
        };
        assert!(matches!(
            p.submit(2, Priority::High, 0, 0, 0, 0),
            Ok(Admit::Granted(_))
        ));
        assert_eq!(
            p.submit(3, Priority::High, 0, 0, key, 0),
            Ok(Admit::Queued(Priority::High))
        );
        let events = p.release(1, Outcome::Success, 0, 1).unwrap();
        assert_eq!(
            events,
            vec![Event {
                ticket: 3,
                kind: EventKind::Granted(home),
                affinity: Affinity::Hit,
                matched_blocks: 0,
            }]
        );
    }

    #[test]
    fn backend_waiting_counts_in_least_connections() {
        let mut p = pool(&[4, 4], HealthConfig::default());
        p.set_backend_load(0, 3, 0).unwrap();
        for t in 1..=3 {
            assert_eq!(
                p.submit(t, Priority::High, 0, 0, 0, 0),
                Ok(Admit::Granted(1))
            );
        }
        // equal loads (3/4 each): the emptier KV cache wins
        p.set_backend_load(1, 0, 900).unwrap();
        p.set_backend_load(0, 3, 100).unwrap();
        assert_eq!(
            p.submit(4, Priority::High, 0, 0, 0, 0),
            Ok(Admit::Granted(0))
        );
        assert!(p.set_backend_load(9, 0, 0).is_err());
    }

    #[test]
    fn a_drained_removed_slot_is_reused() {
        let mut p = pool(&[1, 1], HealthConfig::default());
        assert_eq!(
            p.submit(1, Priority::High, 0, 0, 0, 0),
            Ok(Admit::Granted(0))
        );
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
