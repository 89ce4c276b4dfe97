//! One pool's scheduler: the dual queue, the class selector, the balancer and the instances'
//! slots and health — and the operations the I/O side calls. Every decision about who goes
//! next and where is made here; the caller only reports events (arrival, cancellation, an
//! attempt's end, a probe, the passing of time) and delivers what comes back.
//!
//! SPEC §17: each instance carries a latency model (`latency.rs`) that learns from the
//! attempts it completes (`first_token`, `release_with`), an optional adaptive limit
//! (`adaptive.rs`) that is then its cap, and `balancer: predicted` places by the models;
//! waiting requests are ordered by deadline within their tenant (`queue.rs`).
//!
//! Invariants (checked by the property tests):
//! - an instance never has more than `max_concurrency` attempts in flight, nor more than its
//!   adaptive limit at a grant;
//! - every accepted ticket is granted, expired, evicted or cancelled exactly once, and a
//!   granted ticket is released exactly once;
//! - after each operation no waiting request fits a free, admitting instance (work
//!   conservation), except as time passes between operations — `tick` restores it.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::adaptive::Gradient;
use crate::affinity::{self, HashRing};
use crate::balancer::Balancer;
use crate::error::CoreError;
use crate::health::{Breaker, HealthConfig};
pub use crate::instance::{Instance, InstanceExtra};
use crate::latency::{Features, LatencyModel};
use crate::peers::{Joins, Peers, Summary};
use crate::prefix::{self, PrefixIndex};
use crate::queue::{ClassQueue, Entry};
use crate::selector::{Choice, Selector, SelectorConfig};
use crate::shm::Region;
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
    /// SPEC §17 with `scheduler.shed_unattainable`: while it waited its objective was lost
    /// (no instance is predicted to meet its deadline any more): answer 503
    /// `slo_unattainable` with `Retry-After` rather than serve it late.
    Unattainable { retry_after_ms: Millis },
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
        /// What the latency model learns from this attempt (SPEC §17).
        sample: Sample,
    },
}

/// An attempt as the latency model sees it: when it was granted, when its first token came
/// (0: not yet), and the instance's state at the grant (its features).
#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    at: Millis,
    first: Millis,
    prompt: u32,
    /// Its prompt tokens the instance was not known to hold (SPEC §15 blocks matched there).
    uncached: u32,
    awaiting: u32,
    running: u32,
    context: u32,
    waiting: u32,
    cache_permille: u16,
}

impl Sample {
    fn features(&self) -> Features {
        Features {
            prompt: f64::from(self.uncached),
            awaiting: f64::from(self.awaiting),
            running: f64::from(self.running),
            context: f64::from(self.context),
            waiting: f64::from(self.waiting),
            cache: f64::from(self.cache_permille) / 1000.0,
        }
    }
}

/// A request as `submit` takes it: who sent it, where it may go, and what it is owed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Request {
    pub tenant: Tenant,
    /// Instances already tried (a bit set).
    pub excluded: u64,
    /// SPEC §15: its session key, 0 for none.
    pub affinity_key: u64,
    /// SPEC §17: arrival + its TTFT objective (the caller's clock); 0: no objective.
    pub deadline: Millis,
    /// The gateway's estimate of its prompt tokens (a feature of the latency model).
    pub prompt_tokens: u32,
}

/// What a placement decision knows of the request it places.
#[derive(Clone, Copy, Debug, Default)]
struct Want {
    /// Its objective's deadline, 0 for none.
    deadline: Millis,
    prompt: u32,
    /// How many prompt blocks it carries (SPEC §15; 0: none): with the blocks an instance
    /// holds, the share of the prompt it need not prefill.
    blocks: u32,
}

impl Want {
    /// Its prompt tokens an instance holding `matched` of its leading blocks must prefill.
    #[inline]
    fn uncached(&self, matched: u32) -> u32 {
        if self.blocks == 0 || matched == 0 {
            return self.prompt;
        }
        let held =
            u64::from(self.prompt) * u64::from(matched.min(self.blocks)) / u64::from(self.blocks);
        self.prompt - held as u32
    }
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

/// SPEC §17: what the core learns of one instance's latency, and its adaptive limit.
#[derive(Clone, Debug, Default)]
pub struct InstanceModel {
    pub latency: LatencyModel,
    /// Prompt tokens of its attempts still awaiting a first token (streams until the first
    /// token, others until they end).
    awaiting: u32,
    /// Prompt tokens of its attempts in flight.
    context: u32,
    /// With `adaptive`, the gradient controller whose limit is the instance's cap.
    adaptive: Option<Gradient>,
}

impl InstanceModel {
    /// The features of a request of `prompt` tokens (`uncached` of them not held there) sent
    /// to `inst` now.
    fn features(
        &self,
        inst: &Instance,
        extra: &InstanceExtra,
        prompt: u32,
        uncached: u32,
    ) -> Features {
        Features {
            prompt: f64::from(uncached),
            awaiting: f64::from(self.awaiting),
            running: f64::from(inst.in_flight.saturating_add(inst.peer_in_flight)) + 1.0,
            context: f64::from(self.context) + f64::from(prompt),
            waiting: f64::from(extra.backend_waiting),
            cache: f64::from(extra.cache_permille) / 1000.0,
        }
    }

    pub fn adaptive(&self) -> bool {
        self.adaptive.is_some()
    }
}

/// How an instance's model is doing, for `/admin/state` and `/metrics` (SPEC §17).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ModelView {
    /// p90 TTFT and TPOT (ms) of a typical request sent there now.
    pub ttft_ms: f64,
    pub tpot_ms: f64,
    pub ttft_mae_ms: f64,
    pub tpot_mae_ms: f64,
    /// The share of TTFT samples within their p90 band.
    pub ttft_coverage: f64,
    pub tpot_coverage: f64,
    /// Effective (decayed) sample counts.
    pub ttft_samples: f64,
    pub tpot_samples: f64,
    pub calibrated: bool,
    /// The adaptive controller's base TPOT (ms), once measured.
    pub adaptive_base_ms: Option<f64>,
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
    /// `models[i]` belongs to `instances[i]` (SPEC §17).
    models: Vec<InstanceModel>,
    /// Moving averages of the prompt and output tokens of the requests seen (a "typical
    /// request", and the output length the `predicted` balancer weighs TPOT by).
    typical_prompt: f64,
    typical_output: f64,
    /// The latest `fastest_ttft` and when it was computed (once per millisecond at most).
    fastest: (Millis, f64),
    /// SPEC §17 `scheduler.shed_unattainable`: hopeless waiters are answered, not re-keyed.
    shed_hopeless: bool,
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
    /// SPEC §12: where the pool's shared state lives (`peers.rs`): this process alone, or
    /// the workers' region. The pool meets the other workers through it only.
    peers: Peers,
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
            models: Vec::new(),
            typical_prompt: 0.0,
            typical_output: 0.0,
            fastest: (Millis::MAX, 0.0),
            shed_hopeless: false,
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
            peers: Peers::Alone,
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
        // SPEC §17: entries without an objective are ordered by arrival + max_wait_ms.
        self.queues[0].rekey_fifo(self.cfg.high_max_wait_ms, cfg.high_max_wait_ms);
        self.queues[1].rekey_fifo(self.cfg.low_max_wait_ms, cfg.low_max_wait_ms);
        if cfg.selector != self.cfg.selector {
            self.selector.reset_credit();
            self.peers.reset_credit();
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
        self.add_instance_full(max_concurrency, ring_id, false)
    }

    /// `add_instance_with_id`; with `adaptive` its cap is a gradient controller's limit, at
    /// most `max_concurrency` (SPEC §17 "Adaptive concurrency").
    pub fn add_instance_full(
        &mut self,
        max_concurrency: u32,
        ring_id: Option<u64>,
        adaptive: bool,
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
        let model = InstanceModel {
            adaptive: adaptive.then(|| Gradient::new(max_concurrency, 0)),
            ..InstanceModel::default()
        };
        let fresh = Instance {
            max_concurrency,
            limit: model
                .adaptive
                .as_ref()
                .map_or(max_concurrency, |g| g.limit(max_concurrency)),
            in_flight: 0,
            peer_in_flight: 0,
            breaker: Breaker::new(),
            removed: false,
        };
        let extra = InstanceExtra {
            ring_id: ring_id.unwrap_or(idx as u64),
            ..InstanceExtra::default()
        };
        self.peers.bind(idx, extra.ring_id)?;
        // A reused slot is another instance: what the old one held is not there.
        self.prefixes.forget(idx);
        if idx < self.instances.len() {
            self.instances[idx] = fresh;
            self.extras[idx] = extra;
            self.models[idx] = model;
        } else {
            self.instances.push(fresh);
            self.extras.push(extra);
            self.models.push(model);
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
        let limit = self
            .models
            .get(idx)
            .and_then(|m| m.adaptive.as_ref())
            .map_or(n, |g| g.limit(n));
        let inst = self.instance_mut(idx)?;
        inst.max_concurrency = n;
        inst.limit = limit;
        Ok(())
    }

    /// SPEC §17: turns instance `idx`'s adaptive limit on (starting low, see `adaptive.rs`)
    /// or off (its cap is `max_concurrency` again). Call `tick` after.
    pub fn set_adaptive(
        &mut self,
        idx: usize,
        adaptive: bool,
        now: Millis,
    ) -> Result<(), CoreError> {
        let max = self.instance_mut(idx)?.max_concurrency;
        let model = &mut self.models[idx];
        if adaptive == model.adaptive.is_some() {
            return Ok(());
        }
        model.adaptive = adaptive.then(|| Gradient::new(max, now));
        self.instances[idx].limit = model.adaptive.as_ref().map_or(max, |g| g.limit(max));
        if !adaptive {
            self.peers.clear_limit(idx); // SPEC §12: off for every worker
        }
        Ok(())
    }

    /// The instance's latency model (SPEC §17).
    pub fn model(&self, idx: usize) -> Result<&InstanceModel, CoreError> {
        self.models.get(idx).ok_or(CoreError::UnknownInstance(idx))
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
        let (tenant, excluded, affinity_key) = extra;
        let req = Request {
            tenant,
            excluded,
            affinity_key,
            ..Request::default()
        };
        self.submit_request(ticket, priority, req, blocks, now)
    }

    /// `submit` with everything a request carries: SPEC §17's deadline (arrival + TTFT
    /// objective; 0: none, then arrival + the class's `max_wait_ms`, i.e. FIFO) orders it
    /// within its tenant's queue and places it in a `predicted` pool; its prompt tokens are a
    /// feature of the latency model. A retry passes its original deadline and keeps its place.
    pub fn submit_request(
        &mut self,
        ticket: Ticket,
        priority: Priority,
        req: Request,
        blocks: &[u64],
        now: Millis,
    ) -> Result<Admit, CoreError> {
        if self.tickets.contains_key(&ticket) {
            return Err(CoreError::DuplicateTicket(ticket));
        }
        // Blocks matter to an affinity (or predicted, SPEC §17: "prefix affinity still wins")
        // pool only: elsewhere the hot path is unchanged.
        let blocks = if matches!(
            self.balancer.kind,
            BalancerKind::Affinity | BalancerKind::Predicted
        ) {
            blocks
        } else {
            &[]
        };
        if req.prompt_tokens > 0 {
            self.typical_prompt += 0.02 * (f64::from(req.prompt_tokens) - self.typical_prompt);
        }
        // SPEC §12: a worker first reads the others' state, and after, shows its own.
        self.before(now);
        let admit = self.admit(ticket, priority, req, blocks, now);
        self.after(now, false);
        admit
    }

    /// `submit` after the duplicate check.
    fn admit(
        &mut self,
        ticket: Ticket,
        priority: Priority,
        req: Request,
        blocks: &[u64],
        now: Millis,
    ) -> Result<Admit, CoreError> {
        let Request {
            tenant,
            excluded,
            affinity_key,
            deadline,
            prompt_tokens,
        } = req;
        let want = Want {
            deadline,
            prompt: prompt_tokens,
            blocks: blocks.len() as u32,
        };
        self.advance(now);
        // SPEC §6: nothing this request may use is up — answer now (fallback or 503).
        if !self.any_available(excluded) {
            self.stats.unservable += 1;
            return Err(CoreError::NoHealthyInstance {
                retry_after_ms: self.retry_after_unavailable(excluded, now),
            });
        }
        // SPEC §12: "nothing of that pool is waiting" in any worker.
        if self.waiting() == 0 && self.peers.waiting() == (0, 0) {
            if let Some((inst, placed, matched)) =
                self.pick_instance(excluded, affinity_key, blocks, want, now)
            {
                let choice = Choice::Alone(priority);
                self.commit_choice(choice, priority, false, now);
                self.grant(
                    ticket,
                    (priority, tenant),
                    inst,
                    (placed, matched),
                    want,
                    now,
                );
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
        // SPEC §17 "Ordering": the deadline, or without an objective arrival + max_wait_ms.
        // A high request spilled into low "then waits as low" (SPEC §3): in arrival order
        // there, not ahead of every batch request by its realtime deadline (which would take
        // low's share of the grants for the overflow of high's).
        let (key, objective) = if deadline > 0 && class == priority {
            (deadline, true)
        } else {
            (now.saturating_add(self.max_wait(class)), false)
        };
        self.queues[class.index()].push(
            Entry::new(ticket, tenant, now, excluded)
                .with_affinity_key(affinity_key)
                .with_deadline(key, objective)
                .with_prompt_tokens(prompt_tokens),
        );
        self.tickets
            .insert(ticket, TicketState::Waiting(class, tenant));
        if !blocks.is_empty() {
            self.pending_blocks.insert(ticket, blocks.into());
        }
        // SPEC §12, no lost wake-up: publish that we wait, *then* look at the units again
        // (see `Peers::queued`).
        let (queues, tickets) = (&mut self.queues, &self.tickets);
        self.peers.queued(tenant, || summary(queues, tickets));
        self.before(now);
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
                let (queues, tickets) = (&mut self.queues, &self.tickets);
                self.peers.publish_waiting(|| summary(queues, tickets));
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
        self.release_with(ticket, outcome, retry_after_ms, 0, now)
    }

    /// SPEC §17: the first content token of granted attempt `ticket` reached the gateway (a
    /// stream): its TTFT (now − grant) trains its instance's model. No-op for an unknown
    /// ticket or a second call.
    pub fn first_token(&mut self, ticket: Ticket, now: Millis) {
        let Some(TicketState::Granted {
            instance, sample, ..
        }) = self.tickets.get_mut(&ticket)
        else {
            return;
        };
        if sample.first != 0 {
            return;
        }
        sample.first = now.max(1);
        let (k, s) = (*instance as usize, *sample);
        let model = &mut self.models[k];
        model.awaiting = model.awaiting.saturating_sub(s.uncached);
        model
            .latency
            .observe_ttft(&s.features(), now.saturating_sub(s.at) as f64, now);
    }

    /// `release`, with the attempt's output tokens (0: unknown): on success the instance's
    /// model learns from it (see `learn`: a stream teaches TPOT, a non-streamed answer TTFT).
    pub fn release_with(
        &mut self,
        ticket: Ticket,
        outcome: Outcome,
        retry_after_ms: Millis,
        output_tokens: u32,
        now: Millis,
    ) -> Result<Vec<Event>, CoreError> {
        let Some(TicketState::Granted {
            instance,
            epoch,
            trial,
            sample,
        }) = self.tickets.get(&ticket).copied()
        else {
            return Err(CoreError::UnknownTicket(ticket));
        };
        self.tickets.remove(&ticket);
        self.learn(instance as usize, &sample, outcome, output_tokens, now);
        // The other half of `submit`'s fence: give the unit back, then read who waits.
        self.peers.give(instance as usize, trial);
        self.before(now);
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
        // SPEC §12: the failure threshold counts every worker's attempts.
        if current && before == InstanceState::Healthy && outcome != Outcome::Neutral {
            let n = self
                .peers
                .outcome(instance as usize, outcome == Outcome::Failure);
            if n > 0 {
                inst.breaker.shared_failures(&self.cfg.health, n, now);
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
        self.after(now, true);
        Ok(self.take_events())
    }

    /// What an ended attempt teaches the model of its instance (and its adaptive limit):
    /// SPEC §17 "an online model of TTFT and TPOT learned from the requests it completes".
    ///
    /// - **A stream** taught its TTFT at its first token (`first_token`); at its end it
    ///   teaches TPOT: (end − first token) / (n − 1).
    /// - **A non-streamed answer** (issue 22) shows its client the first token with the whole
    ///   answer, so for that client the time to first token *is* the total time. While the
    ///   instance has no recent streams (its TPOT model, which only streams teach, holds
    ///   fewer than `MIN_SAMPLES` effective samples) it teaches TTFT with y = total: with
    ///   non-streamed traffic the whole time is what those clients wait for, and what
    ///   `predicted`, `attainable` and shedding then go by. While streams teach TTFT directly
    ///   it teaches TTFT nothing: y = total − (n − 1) · TPOT (the first version) carried the
    ///   decode's error times n − 1 into TTFT — on the SLO bench's mixed traffic (streamed
    ///   realtime, non-streamed batch of hundreds of tokens, whose TPOT under load is not the
    ///   streams' mean) the p90 TTFT came out 2–15× above what requests took. It teaches TPOT
    ///   nothing either: its TPOT was (total − predicted TTFT) / (n − 1), circular once TTFT
    ///   learns from non-streamed answers. (A joint regression total = θ·x + n·φ·z would learn both
    ///   from one answer, but with n, the answer's length, a factor of every TPOT feature the
    ///   two are told apart only by the spread of n, which a chat workload does not promise.)
    /// - **The adaptive controller** takes a congestion sample from every success: a stream's
    ///   TPOT; a non-streamed answer's total / n — the time per token of the whole answer,
    ///   prefill share included. Under continuous batching both the prefill wait and every
    ///   decode step lengthen with the running sequences, so it rises at the knee as TPOT
    ///   does, and to first order it does not depend on the answer's length (a long answer is
    ///   mostly TPOT, a short one's prefill share is spread over few tokens but its base is
    ///   measured the same way); the request's whole latency would (a long answer would look
    ///   like congestion). With non-streamed-only traffic the controller still finds the knee.
    fn learn(&mut self, k: usize, s: &Sample, outcome: Outcome, output_tokens: u32, now: Millis) {
        let model = &mut self.models[k];
        // The instance's load now (this attempt still counted), for the TPOT sample below.
        let inst = &self.instances[k];
        let running_now = f64::from(inst.in_flight.saturating_add(inst.peer_in_flight));
        let context_now = f64::from(model.context);
        if s.first == 0 {
            model.awaiting = model.awaiting.saturating_sub(s.uncached);
        }
        model.context = model.context.saturating_sub(s.prompt);
        if outcome != Outcome::Success || output_tokens == 0 {
            return;
        }
        self.typical_output += 0.02 * (f64::from(output_tokens) - self.typical_output);
        let at_grant = s.features();
        let total = now.saturating_sub(s.at) as f64;
        let congestion = if s.first == 0 {
            // Non-streamed: TTFT only while no streams teach it (see above).
            if model.latency.tpot.effective(now) < crate::latency::MIN_SAMPLES {
                model.latency.observe_ttft(&at_grant, total, now);
            }
            total / f64::from(output_tokens)
        } else {
            if output_tokens < 2 {
                return;
            }
            // TPOT is paid over the whole decode, under the load of all of it: the sample's
            // load is the mean of the load at the grant and at the end (at the grant alone
            // under-covered on the engine mock while load rose: p90 coverage 0.69-0.85).
            let f = Features {
                running: (at_grant.running + running_now) / 2.0,
                context: (at_grant.context + context_now) / 2.0,
                ..at_grant
            };
            let per_token = now.saturating_sub(s.first) as f64 / f64::from(output_tokens - 1);
            model.latency.observe_tpot(&f, per_token, now);
            per_token
        };
        if let Some(g) = model.adaptive.as_mut() {
            g.on_sample(congestion);
        }
        self.adapt(k, now);
    }

    /// SPEC §17: judges instance `k`'s adaptive window, if complete; its cap follows (with
    /// workers one shared limit, see `Peers::adapt`).
    fn adapt(&mut self, k: usize, now: Millis) {
        let inst = &mut self.instances[k];
        let Some(g) = self.models[k].adaptive.as_mut() else {
            return;
        };
        let max = inst.max_concurrency;
        self.peers.adapt(k, g, max, now);
        inst.limit = g.limit(max);
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
        self.before(now);
        self.peers.publish_probe(idx, ok); // every worker applies it (one prober per interval)
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
        self.after(now, true);
        Ok(self.take_events())
    }

    /// Time passed: expire overdue waiters, admit instances whose ejection or cool-down ended.
    /// Call at `next_wakeup`, and after reconfiguring.
    pub fn tick(&mut self, now: Millis) -> Vec<Event> {
        self.before(now);
        for k in 0..self.instances.len() {
            self.models[k].latency.refresh(now);
            self.adapt(k, now);
        }
        self.advance(now);
        self.pump(now);
        self.after(now, true);
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
        // SPEC §17 with shedding: when a head's objective will be lost (its deadline less the
        // fastest first token last predicted), so it is answered then, not at the next grant.
        let (at, fastest) = self.fastest;
        let lost = (self.shed_hopeless && at != Millis::MAX && !fastest.is_nan())
            .then(|| {
                [Priority::High, Priority::Low]
                    .into_iter()
                    .filter_map(|c| self.queues[c.index()].earliest_objective_head())
                    .min()
                    // the first millisecond at which `deadline < now + fastest`
                    .map(|d| (d + 1).saturating_sub(fastest as Millis).max(now + 1))
            })
            .flatten();
        deadlines.chain(recoveries).chain(lost).min()
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
        self.rekey_hopeless(now);
        while self.waiting() > 0 {
            let tickets = &self.tickets;
            let low_live = |t| is_waiting(tickets, t, Priority::Low);
            // SPEC §12: the selector and the starvation guard see every worker's queue.
            let (high_waiting, oldest_low) = self.peers.heads(
                self.queues[0].live() > 0,
                self.queues[1].oldest_enqueued_at(&low_live),
            );
            let Some(choice) =
                self.selector
                    .choose(&self.cfg.selector, high_waiting, oldest_low, now)
            else {
                break;
            };
            let first = choice.class();
            if self.defers(first, now) {
                // Nothing free with workers, or the turn is another worker's.
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
            let want = Want {
                deadline: if entry.objective { entry.deadline } else { 0 },
                prompt: entry.prompt_tokens,
                blocks: if self.pending_blocks.is_empty() {
                    0
                } else {
                    self.pending_blocks
                        .get(&entry.ticket)
                        .map_or(0, |b| b.len() as u32)
                },
            };
            let (ticket, who) = (entry.ticket, (class, entry.tenant));
            self.grant(ticket, who, inst, (placed, matched), want, now);
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

    /// SPEC §17 `scheduler.shed_unattainable`: waiters whose objective becomes unattainable
    /// while they wait are answered at once (503 `slo_unattainable`, an `Unattainable` event)
    /// instead of going back to FIFO — only while the models can tell (calibrated enough to
    /// predict; otherwise they are re-keyed as without shedding). Call `tick` after.
    pub fn set_shed_unattainable(&mut self, on: bool) {
        self.shed_hopeless = on;
    }

    /// SPEC §17: heads whose objective no instance can meet any more go back to FIFO (see
    /// `queue.rs`): their deadline is before now + the fastest expected TTFT predicted for them
    /// (now alone while no model is calibrated). With `shed_unattainable` they are answered
    /// instead (while a prediction exists: shedding fails open).
    fn rekey_hopeless(&mut self, now: Millis) {
        let fastest = match self.fastest {
            (at, ms) if at == now => Some(ms),
            _ => {
                let ms = self.fastest_ttft(self.typical_prompt as u32, now);
                self.fastest = (now, ms.unwrap_or(f64::NAN));
                ms
            }
        }
        .filter(|ms| !ms.is_nan());
        if let (true, Some(ms)) = (self.shed_hopeless, fastest) {
            self.shed_hopeless_heads(now, ms);
            return;
        }
        let horizon = now.saturating_add(fastest.unwrap_or(0.0) as Millis);
        for class in [Priority::High, Priority::Low] {
            let max_wait = self.max_wait(class);
            let tickets = &self.tickets;
            self.queues[class.index()].rekey_hopeless(
                &|t| is_waiting(tickets, t, class),
                horizon,
                max_wait,
                16,
            );
        }
    }

    /// `rekey_hopeless` with shedding on: every waiter whose deadline is before now + the
    /// fastest expected TTFT is answered `Unattainable`, with a Retry-After of the class's
    /// estimated wait (at least that TTFT).
    fn shed_hopeless_heads(&mut self, now: Millis, fastest_ms: f64) {
        let horizon = now.saturating_add(fastest_ms as Millis);
        for class in [Priority::High, Priority::Low] {
            let tickets = &self.tickets;
            let shed = self.queues[class.index()]
                .take_hopeless(&|t| is_waiting(tickets, t, class), horizon);
            if shed.is_empty() {
                continue;
            }
            let retry_after_ms = self
                .retry_after_ms(class, now)
                .max(fastest_ms.ceil() as Millis);
            for t in shed {
                self.tickets.remove(&t);
                self.forget_blocks(t);
                self.events.push(Event {
                    ticket: t,
                    kind: EventKind::Unattainable { retry_after_ms },
                    affinity: Affinity::None,
                    matched_blocks: 0,
                });
            }
        }
    }

    /// The lowest expected TTFT (ms) a request of `prompt` tokens is predicted on any instance that
    /// is up, were it sent now; `None` while some instance's model has too few recent samples.
    fn fastest_ttft(&self, prompt: u32, now: Millis) -> Option<f64> {
        let mut best: Option<f64> = None;
        for (k, inst) in self.instances.iter().enumerate() {
            if inst.removed || !inst.breaker.available() {
                continue;
            }
            let m = &self.models[k];
            if !m.latency.ttft_known(now) {
                return None;
            }
            let f = m.features(inst, &self.extras[k], prompt, prompt);
            let p = m.latency.mean(&f).0; // expected, as `attainable` judges
            best = Some(best.map_or(p, |b: f64| b.min(p)));
        }
        best
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
            peers,
            prefixes,
            pending_blocks,
            models,
            typical_output,
            ..
        } = self;
        let live = |t| is_waiting(tickets, t, class);
        let view = Instances {
            instances,
            extras,
            backend_loaded: *backend_loaded,
            models,
            typical_output: *typical_output,
        };
        queues[class.index()]
            .pop_fitting(&live, |e| {
                let blocks = if pending_blocks.is_empty() {
                    &[][..]
                } else {
                    pending_blocks.get(&e.ticket).map_or(&[][..], |b| &b[..])
                };
                let want = Want {
                    deadline: if e.objective { e.deadline } else { 0 },
                    prompt: e.prompt_tokens,
                    blocks: blocks.len() as u32,
                };
                pick_taking(
                    balancer,
                    ring,
                    &view,
                    cfg,
                    peers,
                    e.excluded,
                    (e.affinity_key, blocks, prefixes),
                    want,
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
            } else if queue.has_restricted() {
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
        (placed, matched): (Affinity, u32),
        want: Want,
        now: Millis,
    ) {
        self.peers.tenant_granted(tenant);
        // SPEC §17: the instance's state as this attempt finds it, for the model to learn.
        let extra = &self.extras[inst];
        let model = &mut self.models[inst];
        let running = {
            let i = &self.instances[inst];
            i.in_flight
                .saturating_add(i.peer_in_flight)
                .saturating_add(1)
        };
        let uncached = want.uncached(matched);
        let sample = Sample {
            at: now,
            first: 0,
            prompt: want.prompt,
            uncached,
            awaiting: model.awaiting,
            running,
            context: model.context.saturating_add(want.prompt),
            waiting: extra.backend_waiting,
            cache_permille: extra.cache_permille,
        };
        model.awaiting = model.awaiting.saturating_add(uncached);
        model.context = model.context.saturating_add(want.prompt);
        if let Some(g) = model.adaptive.as_mut() {
            g.on_grant(running);
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
                sample,
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
        want: Want,
        now: Millis,
    ) -> Option<(usize, Affinity, u32)> {
        let view = Instances {
            instances: &self.instances,
            extras: &self.extras,
            backend_loaded: self.backend_loaded,
            models: &self.models,
            typical_output: self.typical_output,
        };
        pick_taking(
            &mut self.balancer,
            &mut self.ring,
            &view,
            &self.cfg,
            &self.peers,
            excluded,
            (affinity_key, blocks, &self.prefixes),
            want,
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
        let (peer_high, peer_low) = self.peers.waiting();
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

    // ---- SPEC §17: predictions --------------------------------------------------------------

    /// p90 TTFT and p90 TPOT (ms) of a request of `prompt_tokens` sent to instance `idx` now.
    pub fn predict(
        &mut self,
        idx: usize,
        prompt_tokens: u32,
        now: Millis,
    ) -> Result<(f64, f64), CoreError> {
        if idx >= self.instances.len() {
            return Err(CoreError::UnknownInstance(idx));
        }
        self.before(now);
        let m = &self.models[idx];
        let f = m.features(
            &self.instances[idx],
            &self.extras[idx],
            prompt_tokens,
            prompt_tokens,
        );
        Ok(m.latency.predict(&f))
    }

    /// SPEC §17 "Unattainable": 0 when some instance of this pool is predicted to meet
    /// `deadline` for a request of `class` and `prompt_tokens` (or some instance's model has
    /// too few recent samples to say, `LatencyModel::ttft_known`: fail open); otherwise a Retry-After (ms, > 0): when it would
    /// become attainable — the estimated queue wait ahead of it plus the time for its best
    /// instance to drain down to idle.
    pub fn attainable(
        &mut self,
        class: Priority,
        deadline: Millis,
        prompt_tokens: u32,
        now: Millis,
    ) -> Millis {
        if deadline == 0 {
            return 0;
        }
        self.before(now);
        self.advance(now);
        let budget = deadline.saturating_sub(now) as f64;
        let health = &self.cfg.health;
        // The best instance if sent now, and an idle one's best (its floor).
        let (mut best_now, mut best_idle, mut free) = (f64::INFINITY, f64::INFINITY, false);
        for (k, inst) in self.instances.iter().enumerate() {
            if inst.removed || !inst.breaker.available() {
                continue;
            }
            let m = &self.models[k];
            if !m.latency.ttft_known(now) {
                return 0;
            }
            let extra = &self.extras[k];
            let f = m.features(inst, extra, prompt_tokens, prompt_tokens);
            // The expected first token, not its p90: "unattainable" must mean the request is
            // likely to miss, not that one in ten might (the p90 of a loaded engine's TTFT is
            // several times its median: judged by it, benches/slo.py shed 60 of 60 realtime
            // requests at 1× capacity, where 58 of them met their objective unshed).
            let p = m.latency.mean(&f).0;
            let idle = Features {
                awaiting: 0.0,
                running: 1.0,
                context: f64::from(prompt_tokens),
                waiting: 0.0,
                ..f
            };
            best_idle = best_idle.min(m.latency.mean(&idle).0);
            free |= inst.has_room() && inst.breaker.admits(health, now);
            best_now = best_now.min(p);
        }
        if best_now.is_infinite() {
            return 0; // nothing up: §6's answer (fallback, 503), not this one
        }
        // SPEC §3 queue ahead of it: high waits behind high; low behind both.
        let (peer_high, peer_low) = self.peers.waiting();
        let high = self.queues[0].live() as u64 + peer_high;
        let ahead = match class {
            Priority::High => high,
            Priority::Low => high + self.queues[1].live() as u64 + peer_low,
        };
        let wait = if free && ahead == 0 {
            0.0
        } else {
            match self.drain.rate(now) {
                Some(rate) if rate > 0.0 => (ahead as f64 + 1.0) / rate * 1000.0,
                _ => return 0, // no grant seen yet: nothing to estimate by, fail open
            }
        };
        if wait + best_now <= budget {
            return 0;
        }
        (wait + (best_now - best_idle).max(0.0)).ceil().max(1.0) as Millis
    }

    /// How instance `idx`'s model is doing (SPEC §17: "its predictions and their error").
    pub fn model_view(&mut self, idx: usize, now: Millis) -> Result<ModelView, CoreError> {
        let typical = self.typical_prompt as u32;
        let (ttft_ms, tpot_ms) = self.predict(idx, typical, now)?;
        let m = &self.models[idx].latency;
        Ok(ModelView {
            ttft_ms,
            tpot_ms,
            ttft_mae_ms: m.ttft.mae_ms(),
            tpot_mae_ms: m.tpot.mae_ms(),
            ttft_coverage: m.ttft.coverage(),
            tpot_coverage: m.tpot.coverage(),
            ttft_samples: m.ttft.effective(now),
            tpot_samples: m.tpot.effective(now),
            calibrated: m.ttft_calibrated(now),
            adaptive_base_ms: self.models[idx].adaptive.as_ref().and_then(Gradient::base),
        })
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
        self.before(now);
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

/// SPEC §12: the pool as one of several workers sharing one region (`peers.rs`).
impl Pool {
    /// Makes this pool the worker `worker`'s share of pool `pool_id` (a stable hash of its
    /// name) in the workers' region, as its process's only pool of that name. Call before
    /// adding instances.
    pub fn attach(
        &mut self,
        region: Region<'static>,
        pool_id: u64,
        worker: usize,
    ) -> Result<(), CoreError> {
        self.attach_joined(region, &Joins::default(), pool_id, worker)
    }

    /// `attach`, with `joins` counting every use its process makes of the region's cells (one
    /// per process and region: a process may hold two pools of one name, a removed one still
    /// draining beside its successor, and neither may leave a cell the other uses).
    pub fn attach_joined(
        &mut self,
        region: Region<'static>,
        joins: &Joins,
        pool_id: u64,
        worker: usize,
    ) -> Result<(), CoreError> {
        if !self.instances.is_empty() {
            return Err(CoreError::InvalidConfig(
                "attach a pool to the workers' region before adding instances".into(),
            ));
        }
        self.peers = Peers::workers(region, joins.clone(), pool_id, worker)?;
        Ok(())
    }

    /// SPEC §12 "bounded and reclaimed": the pool leaves the workers' region (it closed):
    /// the cells it used, and with its process's last pool of its name the pool's slot, go
    /// back (the last worker to leave frees them for others). What it still has in flight is
    /// given back with them; afterwards it schedules alone. (A pool dropped without it is a
    /// killed worker's: its cells stay until the supervisor reclaims the worker's slot.)
    pub fn detach(&mut self) {
        self.peers.detach();
    }

    pub fn is_shared(&self) -> bool {
        self.peers.is_shared()
    }

    /// SPEC §16: (instances bound to a region cell, tenant entries cached) of this worker;
    /// (0, 0) for a single process.
    pub fn shared_tables(&self) -> (usize, usize) {
        self.peers.tables()
    }

    /// What the other workers have waiting (high, low); (0, 0) for a single process.
    pub fn peers_waiting(&self) -> (u64, u64) {
        self.peers.waiting()
    }

    /// Grants made by every worker (high, low); this pool's own for a single process.
    pub fn grants_everywhere(&self) -> (u64, u64) {
        self.peers
            .grants()
            .unwrap_or((self.stats.granted[0], self.stats.granted[1]))
    }

    /// Worker slots to wake since the last call (a bit set; always 0 for a single process).
    pub fn take_wakes(&mut self) -> u64 {
        self.peers.take_wakes()
    }

    /// SPEC §12 "one probe per instance per interval, not N": whether this worker probes
    /// instance `idx` now. Always `true` for a single process.
    pub fn claim_probe(&self, idx: usize, now: Millis, interval_ms: Millis) -> bool {
        self.peers
            .claim_probe(idx, self.instances.len(), now, interval_ms)
    }

    /// Before an operation: what the other workers changed (`Peers::before`).
    fn before(&mut self, now: Millis) {
        if self.peers.before(
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
    fn after(&mut self, now: Millis, offer: bool) {
        let (queues, tickets) = (&mut self.queues, &self.tickets);
        let (instances, health) = (&self.instances, &self.cfg.health);
        self.peers.after(
            || summary(queues, tickets),
            instances,
            || offer && any_room(instances, health, now),
        );
    }

    /// Whether `class`'s queue has room for one more (with workers: in the union of every
    /// worker's queue, `Peers::has_place`).
    fn has_room(&mut self, class: Priority) -> bool {
        let queue = &self.queues[class.index()];
        self.peers
            .has_place(class, queue.capacity, queue.has_room())
    }

    /// SPEC §12: whether this worker gives the grant of a `class` turn to another
    /// (`Peers::defers`; never for a single process).
    fn defers(&mut self, class: Priority, now: Millis) -> bool {
        let (queues, tickets) = (&mut self.queues, &self.tickets);
        let (instances, health) = (&self.instances, &self.cfg.health);
        self.peers.defers(
            class,
            || any_room(instances, health, now),
            || queues[class.index()].next_turn(&|t| is_waiting(tickets, t, class)),
            now,
        )
    }

    fn commit_choice(&mut self, choice: Choice, class: Priority, low_waiting: bool, now: Millis) {
        let cfg = &self.cfg.selector;
        self.peers.commit(
            &mut self.selector,
            |selector| selector.commit(cfg, choice, class, low_waiting, now),
            class,
            now,
        );
    }
}

/// What this worker's queue shows the other workers (SPEC §12).
fn summary(queues: &mut [ClassQueue; 2], tickets: &TicketMap) -> Summary {
    let [high, low] = queues;
    let is_high = |t| is_waiting(tickets, t, Priority::High);
    let is_low = |t| is_waiting(tickets, t, Priority::Low);
    Summary {
        counts: (high.live(), low.live()),
        oldest: (
            high.oldest_enqueued_at(&is_high),
            low.oldest_enqueued_at(&is_low),
        ),
        turns: (high.next_turn(&is_high), low.next_turn(&is_low)),
    }
}

/// Whether some instance could take an attempt now (every worker's attempts counted).
fn any_room(instances: &[Instance], health: &HealthConfig, now: Millis) -> bool {
    instances
        .iter()
        .any(|i| !i.removed && i.has_room() && i.breaker.admits(health, now))
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
    models: &'a [InstanceModel],
    typical_output: f64,
}

/// `pick`, and the unit taken (`Peers::take`): with workers (SPEC §12) from the shared lease
/// word, so an instance another worker filled since the last look is passed over and the pick
/// repeated; alone the first pick is taken.
#[allow(clippy::too_many_arguments)]
fn pick_taking(
    balancer: &mut Balancer,
    ring: &mut Option<HashRing>,
    view: &Instances<'_>,
    cfg: &PoolConfig,
    peers: &Peers,
    excluded: u64,
    affine: Affine<'_>,
    want: Want,
    now: Millis,
) -> Option<(usize, Affinity, u32)> {
    let mut full = 0u64;
    loop {
        let (k, placed, matched) = pick(
            balancer,
            ring,
            view,
            cfg,
            excluded | full,
            affine,
            want,
            now,
        )?;
        if peers.take(k, &view.instances[k], cfg.health.half_open_max_requests) {
            return Some((k, placed, matched));
        }
        full |= 1 << k;
    }
}

/// The balancer's choice among instances that admit a new attempt now, have a free slot and
/// are not excluded; with the affinity decision.
#[allow(clippy::too_many_arguments)]
fn pick(
    balancer: &mut Balancer,
    ring: &mut Option<HashRing>,
    view: &Instances<'_>,
    cfg: &PoolConfig,
    excluded: u64,
    (affinity_key, blocks, prefixes): Affine<'_>,
    want: Want,
    now: Millis,
) -> Option<(usize, Affinity, u32)> {
    let (instances, extras) = (view.instances, view.extras);
    let health = &cfg.health;
    let candidate = |k: usize| {
        let i = &instances[k];
        excluded & (1 << k) == 0 && !i.removed && i.has_room() && i.breaker.admits(health, now)
    };
    let affine = affinity_key != 0 || !blocks.is_empty();
    if affine && balancer.kind == BalancerKind::Affinity {
        return place_affine(ring, view, cfg, (affinity_key, blocks, prefixes), candidate);
    }
    if balancer.kind == BalancerKind::Predicted {
        // SPEC §17 "Placement": "prefix affinity (§15) still wins while its instance meets the
        // objective".
        if affine {
            if let Some((k, placed, matched)) =
                place_affine(ring, view, cfg, (affinity_key, blocks, prefixes), candidate)
            {
                if meets(view, k, matched, want, now) {
                    return Some((k, placed, matched));
                }
            }
        }
        // The blocks each instance holds of this prompt: its uncached share is a feature.
        let mut lens = [0u32; 64];
        if !blocks.is_empty() {
            let ring = ring.get_or_insert_with(|| ring_of(view));
            prefixes.matches(blocks, ring.members(), &mut lens);
        }
        return pick_predicted(balancer, view, candidate, want, &lens, now)
            .map(|k| (k, Affinity::None, lens[k]));
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

/// Whether instance `k`, holding `matched` of the request's blocks, is predicted to meet its
/// objective (no objective, or a model with too few recent samples: yes — fail open).
fn meets(view: &Instances<'_>, k: usize, matched: u32, want: Want, now: Millis) -> bool {
    if want.deadline == 0 {
        return true;
    }
    let m = &view.models[k];
    if !m.latency.ttft_known(now) {
        return true;
    }
    let f = m.features(
        &view.instances[k],
        &view.extras[k],
        want.prompt,
        want.uncached(matched),
    );
    now as f64 + m.latency.predict(&f).0 <= want.deadline as f64
}

/// SPEC §17 `balancer: predicted`: among candidates, the most headroom under the objective
/// (deadline − now − p90 TTFT: the lowest p90 TTFT) for a request with one, else the lowest
/// predicted latency (p90 TTFT + the typical output × mean TPOT). While some candidate's model
/// has never been calibrated, least connections; one calibrated once but not now is explored
/// one decision in `EXPLORE` (see `balancer.rs`).
fn pick_predicted(
    balancer: &mut Balancer,
    view: &Instances<'_>,
    candidate: impl Fn(usize) -> bool,
    want: Want,
    lens: &[u32; 64],
    now: Millis,
) -> Option<usize> {
    let features = |k: usize| {
        view.models[k].features(
            &view.instances[k],
            &view.extras[k],
            want.prompt,
            want.uncached(lens[k]),
        )
    };
    // A model that was calibrated once predicts, calibrated now or not (a rough prediction
    // still orders a 10x faster instance first; a wrong one is corrected by the samples its
    // exploration brings); one that never was cannot — then the pool balances by least
    // connections (the warm-up: every instance gets its first samples evenly).
    let score = |k: usize| {
        let m = &view.models[k].latency;
        let f = features(k);
        let has_ttft = m.ttft.warmed();
        if want.deadline != 0 {
            return has_ttft.then(|| m.predict(&f).0);
        }
        let has_tpot = m.tpot.warmed();
        if !has_ttft && !has_tpot {
            return None;
        }
        let (p90_ttft, _) = m.predict(&f);
        let first = if has_ttft { p90_ttft } else { 0.0 };
        let per_token = if has_tpot { m.mean(&f).1 } else { 0.0 };
        Some(first + view.typical_output * per_token)
    };
    // Not calibrated (too few recent samples, or its p90 band off): explored now and then.
    let unsure = |k: usize| {
        let m = &view.models[k].latency;
        if want.deadline != 0 {
            !m.ttft_calibrated(now)
        } else {
            !m.ttft_calibrated(now) && !m.tpot_calibrated(now)
        }
    };
    let (instances, extras) = (view.instances, view.extras);
    if view.backend_loaded {
        balancer.pick_scored(instances.len(), candidate, score, unsure, |k| {
            instances[k].load_with(&extras[k])
        })
    } else {
        balancer.pick_scored(instances.len(), candidate, score, unsure, |k| {
            instances[k].load()
        })
    }
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
    let ring = ring.get_or_insert_with(|| ring_of(view));
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

/// The affinity hash ring of the instances not removed.
fn ring_of(view: &Instances<'_>) -> HashRing {
    HashRing::new(
        view.instances
            .iter()
            .zip(view.extras)
            .enumerate()
            .filter(|(_, (i, _))| !i.removed)
            .map(|(k, (_, e))| (k, e.ring_id)),
    )
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
    fn the_uncached_share_of_a_prompt_is_what_its_instance_does_not_hold() {
        let want = Want {
            deadline: 0,
            prompt: 1000,
            blocks: 40,
        };
        assert_eq!(want.uncached(0), 1000);
        assert_eq!(want.uncached(10), 750);
        assert_eq!(want.uncached(40), 0);
        assert_eq!(want.uncached(99), 0);
        let no_blocks = Want { blocks: 0, ..want };
        assert_eq!(no_blocks.uncached(7), 1000);
    }

    /// SPEC §17 "inputs such as ... an affinity hit": in a `predicted` pool a request whose
    /// prompt an instance holds is learnt with its uncached share, and what awaits a first
    /// token there counts only that share.
    #[test]
    fn an_affinity_hit_counts_as_uncached_tokens_only() {
        let mut p = Pool::new(
            PoolConfig {
                balancer: BalancerKind::Predicted,
                ..PoolConfig::default()
            },
            1,
        )
        .unwrap();
        p.add_instance_with_id(8, Some(1)).unwrap();
        let blocks: Vec<u64> = (1..=10).collect();
        let req = Request {
            prompt_tokens: 1000,
            ..Request::default()
        };
        assert_eq!(
            p.submit_request(1, Priority::High, req, &blocks, 0),
            Ok(Admit::Granted(0))
        );
        assert_eq!(p.models[0].awaiting, 1000);
        p.release_with(1, Outcome::Success, 0, 10, 10).unwrap();
        // the same prompt again: its instance holds all ten blocks
        p.submit_request(2, Priority::High, req, &blocks, 20)
            .unwrap();
        assert_eq!(p.last_matched_blocks(), 10);
        assert_eq!(p.models[0].awaiting, 0);
        assert_eq!(p.models[0].context, 1000);
        p.release_with(2, Outcome::Success, 0, 10, 30).unwrap();
        assert_eq!((p.models[0].awaiting, p.models[0].context), (0, 0));
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
