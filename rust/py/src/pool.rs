//! `Pool`, `PoolConfig` and read-only views over `gateway_core::Pool`.

use gateway_core as core;
use pyo3::prelude::*;

use crate::enums::{Affinity, Balancer, EventKind, InstanceState, Outcome, Policy, Priority};
use crate::CoreErr;

/// One pool's scheduler settings (SPEC §8 `scheduler`, `balancer`, `health`).
#[pyclass(frozen, get_all, module = "gateway._core")]
#[derive(Clone)]
pub struct PoolConfig {
    policy: Policy,
    high_capacity: usize,
    low_capacity: usize,
    high_weight: u32,
    low_weight: u32,
    high_max_wait_ms: u64,
    low_max_wait_ms: u64,
    max_consecutive_high: u32,
    max_low_wait_ms: u64,
    overflow_high_to_low: bool,
    balancer: Balancer,
    /// SPEC §15 `affinity.epsilon`, in whole thousandths.
    affinity_epsilon: f64,
    /// SPEC §15: the prompt blocks remembered per instance (its cache size in blocks).
    prefix_capacity_blocks: u32,
    failure_threshold: u32,
    ejection_ms: u64,
    max_ejection_ms: u64,
    half_open_max_requests: u32,
    success_threshold: u32,
    probing: bool,
}

#[pymethods]
impl PoolConfig {
    /// Every setting omitted takes the core's default (`gateway_core::PoolConfig::default()`,
    /// the one place defaults are written; `PoolConfig()` shows them to Python).
    #[new]
    #[pyo3(signature = (
        *,
        policy = None,
        high_capacity = None,
        low_capacity = None,
        high_weight = None,
        low_weight = None,
        high_max_wait_ms = None,
        low_max_wait_ms = None,
        max_consecutive_high = None,
        max_low_wait_ms = None,
        overflow_high_to_low = None,
        balancer = None,
        affinity_epsilon = None,
        prefix_capacity_blocks = None,
        failure_threshold = None,
        ejection_ms = None,
        max_ejection_ms = None,
        half_open_max_requests = None,
        success_threshold = None,
        probing = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        policy: Option<Policy>,
        high_capacity: Option<usize>,
        low_capacity: Option<usize>,
        high_weight: Option<u32>,
        low_weight: Option<u32>,
        high_max_wait_ms: Option<u64>,
        low_max_wait_ms: Option<u64>,
        max_consecutive_high: Option<u32>,
        max_low_wait_ms: Option<u64>,
        overflow_high_to_low: Option<bool>,
        balancer: Option<Balancer>,
        affinity_epsilon: Option<f64>,
        prefix_capacity_blocks: Option<u32>,
        failure_threshold: Option<u32>,
        ejection_ms: Option<u64>,
        max_ejection_ms: Option<u64>,
        half_open_max_requests: Option<u32>,
        success_threshold: Option<u32>,
        probing: Option<bool>,
    ) -> Result<Self, CoreErr> {
        let d = core::PoolConfig::default();
        let cfg = Self {
            policy: policy.unwrap_or(d.selector.policy.into()),
            high_capacity: high_capacity.unwrap_or(d.high_capacity),
            low_capacity: low_capacity.unwrap_or(d.low_capacity),
            high_weight: high_weight.unwrap_or(d.selector.high_weight),
            low_weight: low_weight.unwrap_or(d.selector.low_weight),
            high_max_wait_ms: high_max_wait_ms.unwrap_or(d.high_max_wait_ms),
            low_max_wait_ms: low_max_wait_ms.unwrap_or(d.low_max_wait_ms),
            max_consecutive_high: max_consecutive_high.unwrap_or(d.selector.max_consecutive_high),
            max_low_wait_ms: max_low_wait_ms.unwrap_or(d.selector.max_low_wait_ms),
            overflow_high_to_low: overflow_high_to_low.unwrap_or(d.overflow_high_to_low),
            balancer: balancer.unwrap_or(d.balancer.into()),
            affinity_epsilon: match affinity_epsilon {
                None => f64::from(d.affinity_epsilon_permille) / 1000.0,
                Some(e) if e.is_finite() && (0.0..=1000.0).contains(&e) => {
                    (e * 1000.0).round() / 1000.0
                }
                Some(_) => {
                    return Err(core::CoreError::InvalidConfig(
                        "affinity epsilon must be within [0, 1000]".into(),
                    )
                    .into())
                }
            },
            prefix_capacity_blocks: prefix_capacity_blocks.unwrap_or(d.prefix_capacity_blocks),
            failure_threshold: failure_threshold.unwrap_or(d.health.failure_threshold),
            ejection_ms: ejection_ms.unwrap_or(d.health.ejection_ms),
            max_ejection_ms: max_ejection_ms.unwrap_or(d.health.max_ejection_ms),
            half_open_max_requests: half_open_max_requests
                .unwrap_or(d.health.half_open_max_requests),
            success_threshold: success_threshold.unwrap_or(d.health.success_threshold),
            probing: probing.unwrap_or(d.health.probing),
        };
        cfg.to_core().validate()?;
        Ok(cfg)
    }
}

impl PoolConfig {
    fn to_core(&self) -> core::PoolConfig {
        core::PoolConfig {
            selector: core::SelectorConfig {
                policy: self.policy.into(),
                high_weight: self.high_weight,
                low_weight: self.low_weight,
                max_consecutive_high: self.max_consecutive_high,
                max_low_wait_ms: self.max_low_wait_ms,
            },
            high_capacity: self.high_capacity,
            low_capacity: self.low_capacity,
            high_max_wait_ms: self.high_max_wait_ms,
            low_max_wait_ms: self.low_max_wait_ms,
            overflow_high_to_low: self.overflow_high_to_low,
            balancer: self.balancer.into(),
            affinity_epsilon_permille: (self.affinity_epsilon * 1000.0).round() as u32,
            prefix_capacity_blocks: self.prefix_capacity_blocks,
            health: core::HealthConfig {
                failure_threshold: self.failure_threshold,
                ejection_ms: self.ejection_ms,
                max_ejection_ms: self.max_ejection_ms,
                half_open_max_requests: self.half_open_max_requests,
                success_threshold: self.success_threshold,
                probing: self.probing,
            },
        }
    }
}

/// One instance as the scheduler sees it, at the time it was read.
#[pyclass(frozen, get_all, module = "gateway._core")]
pub struct InstanceInfo {
    state: InstanceState,
    in_flight: u32,
    /// SPEC §12: attempts other workers have on it (0 for a single process).
    peer_in_flight: u32,
    max_concurrency: u32,
    consecutive_failures: u32,
    /// Monotonic ms the ejection ends, while ejected.
    ejected_until_ms: Option<u64>,
    /// Monotonic ms until which a Retry-After cools the instance (0: never cooled).
    cool_until_ms: u64,
    /// Earliest monotonic ms the instance may be tried again.
    next_try_ms: u64,
    ejections: u64,
    half_open_trials: u32,
    removed: bool,
    /// Requests the backend reports waiting (vLLM), as last set by `set_backend_load`.
    backend_waiting: u32,
    /// The backend's KV-cache usage in thousandths, as last set.
    cache_permille: u16,
    /// SPEC §15: prompt blocks the affinity index holds for it, and its bound.
    prefix_blocks: usize,
    prefix_capacity: usize,
    /// SPEC §17: the current effective cap (`max_concurrency`, or the adaptive limit).
    concurrency_limit: u32,
    /// Whether the cap is adaptive.
    adaptive: bool,
    /// p90 TTFT and TPOT (ms) predicted for a typical request sent there now.
    predicted_ttft_ms: f64,
    predicted_tpot_ms: f64,
    /// The models' mean absolute errors (ms), scored before each sample was learnt.
    ttft_mae_ms: f64,
    tpot_mae_ms: f64,
    /// The share of samples within the p90 band.
    ttft_coverage: f64,
    tpot_coverage: f64,
    /// Effective (decayed) TTFT samples, and TPOT's.
    samples: f64,
    tpot_samples: f64,
    /// Whether the TTFT model may be trusted (what `PREDICTED` and `attainable` use).
    calibrated: bool,
}

/// Cumulative counters of one pool.
#[pyclass(frozen, get_all, module = "gateway._core")]
pub struct PoolStats {
    granted_high: u64,
    granted_low: u64,
    forced_low: u64,
    expired: u64,
    cancelled: u64,
    rejected_full: u64,
    unservable: u64,
    affinity_hits: u64,
    affinity_spills: u64,
}

/// What the core decided about one waiting ticket.
#[pyclass(frozen, get_all, module = "gateway._core")]
pub struct Event {
    ticket: u64,
    kind: EventKind,
    /// The granted instance (`GRANTED` only).
    instance: Option<usize>,
    /// When the request may be tried again (`UNSERVABLE` only; 0 otherwise).
    retry_after_ms: u64,
    /// Where a grant landed relative to its affinity key (`NONE` otherwise).
    affinity: Affinity,
    /// Leading prompt blocks the granted instance held (SPEC §15; 0 otherwise).
    matched_blocks: u32,
}

#[pymethods]
impl Event {
    fn __repr__(&self) -> String {
        format!(
            "Event(ticket={}, kind={:?}, instance={:?}, retry_after_ms={}, affinity={:?})",
            self.ticket, self.kind, self.instance, self.retry_after_ms, self.affinity
        )
    }
}

type Events = Vec<Event>;

fn encode(events: Vec<core::Event>) -> Events {
    events
        .into_iter()
        .map(|e| {
            let (kind, instance, retry_after_ms) = match e.kind {
                core::EventKind::Granted(i) => (EventKind::GRANTED, Some(i), 0),
                core::EventKind::Expired => (EventKind::EXPIRED, None, 0),
                core::EventKind::Unservable { retry_after_ms } => {
                    (EventKind::UNSERVABLE, None, retry_after_ms)
                }
                core::EventKind::Unattainable { retry_after_ms } => {
                    (EventKind::UNATTAINABLE, None, retry_after_ms)
                }
            };
            Event {
                ticket: e.ticket,
                kind,
                instance,
                retry_after_ms,
                affinity: e.affinity.into(),
                matched_blocks: e.matched_blocks,
            }
        })
        .collect()
}

/// SPEC §15: a prompt's chained block hashes, computed once per request.
#[pyclass(frozen, module = "gateway._core")]
pub struct Prefix {
    blocks: Vec<u64>,
}

#[pymethods]
impl Prefix {
    /// The hashes of `text`'s full `block_bytes`-byte UTF-8 blocks (a positive multiple of
    /// 16, at most 4096), at most `max_blocks`, chained from `seed`.
    #[new]
    fn new(text: &str, block_bytes: usize, max_blocks: usize, seed: u64) -> Result<Self, CoreErr> {
        if block_bytes == 0
            || !block_bytes.is_multiple_of(16)
            || block_bytes > core::prefix::MAX_BLOCK_BYTES
        {
            return Err(core::CoreError::InvalidConfig(
                "block_bytes must be a multiple of 16 within [16, 4096]".into(),
            )
            .into());
        }
        let max_blocks = max_blocks.min(core::prefix::MAX_BLOCKS);
        let mut blocks = Vec::with_capacity((text.len() / block_bytes).min(max_blocks));
        core::prefix::chain_hashes(text.as_bytes(), block_bytes, max_blocks, seed, &mut blocks);
        Ok(Self { blocks })
    }

    fn __len__(&self) -> usize {
        self.blocks.len()
    }

    /// The block hashes, in order.
    fn hashes(&self) -> Vec<u64> {
        self.blocks.clone()
    }
}

/// One pool's scheduler. All times are monotonic milliseconds supplied by the caller.
#[pyclass(module = "gateway._core")]
pub struct Pool {
    inner: core::Pool,
}

#[pymethods]
impl Pool {
    #[new]
    #[pyo3(signature = (config, seed = 0))]
    fn new(config: &PoolConfig, seed: u64) -> Result<Self, CoreErr> {
        Ok(Self {
            inner: core::Pool::new(config.to_core(), seed)?,
        })
    }

    /// Applies new settings; waiting and in-flight requests stay. Call `tick` after.
    fn configure(&mut self, config: &PoolConfig) -> Result<(), CoreErr> {
        Ok(self.inner.configure(config.to_core())?)
    }

    /// Adds an instance; returns its index. `ring_id` places it on the affinity hash ring: a
    /// stable identity such as a hash of its name (default: its index). With `adaptive`
    /// (SPEC §17) its cap is a gradient controller's limit, `max_concurrency` the ceiling.
    #[pyo3(signature = (max_concurrency, ring_id = None, adaptive = false))]
    fn add_instance(
        &mut self,
        max_concurrency: u32,
        ring_id: Option<u64>,
        adaptive: bool,
    ) -> Result<usize, CoreErr> {
        Ok(self
            .inner
            .add_instance_full(max_concurrency, ring_id, adaptive)?)
    }

    /// SPEC §17 `scheduler.shed_unattainable`: waiters whose objective is lost while they wait
    /// are answered (`EventKind.UNATTAINABLE`) instead of re-keyed to FIFO. Call `tick` after.
    fn set_shed_unattainable(&mut self, on: bool) {
        self.inner.set_shed_unattainable(on);
    }

    /// SPEC §17: turns an instance's adaptive limit on (it starts low) or off.
    fn set_adaptive(&mut self, index: usize, adaptive: bool) -> Result<(), CoreErr> {
        Ok(self.inner.set_adaptive(index, adaptive, 0)?)
    }

    /// SPEC §15 "Backend load": what a vLLM backend reports of itself — requests waiting
    /// and KV-cache usage in [0, 1] (rounded to thousandths; out of range is clamped, NaN is 0).
    fn set_backend_load(
        &mut self,
        index: usize,
        waiting: u32,
        gpu_cache_usage: f64,
    ) -> Result<(), CoreErr> {
        let usage = if gpu_cache_usage.is_nan() {
            0.0
        } else {
            gpu_cache_usage.clamp(0.0, 1.0)
        };
        let permille = (usage * 1000.0 + 0.5).floor() as u16;
        Ok(self.inner.set_backend_load(index, waiting, permille)?)
    }

    /// SPEC §15: the prompt blocks the affinity index remembers for one instance (its own
    /// cache size, as its backend reports it); a `configure` resets every instance's.
    fn set_prefix_capacity(&mut self, index: usize, blocks: u32) -> Result<(), CoreErr> {
        Ok(self.inner.set_prefix_capacity(index, blocks)?)
    }

    fn set_max_concurrency(&mut self, index: usize, max_concurrency: u32) -> Result<(), CoreErr> {
        Ok(self.inner.set_max_concurrency(index, max_concurrency)?)
    }

    fn remove_instance(&mut self, index: usize) -> Result<(), CoreErr> {
        Ok(self.inner.remove_instance(index)?)
    }

    /// Admits a request: returns the instance index when dispatched at once, `None` when it
    /// waits (`waiting_class` tells in which class). Raises `QueueFull` or
    /// `NoHealthyInstance`. After a queued result, deliver `take_events()`. `affinity_key`
    /// (0: none) places the request in an `AFFINITY` pool; `last_affinity()` then tells how.
    /// `prefix` (SPEC §15): the prompt's blocks; without a session key it places the request
    /// by the longest run of them an instance holds, and `last_matched_blocks()` tells how many.
    /// SPEC §17: `deadline_ms` is arrival + the TTFT objective on the same clock (0: none —
    /// FIFO); it orders the request within its tenant's queue, and a retry passing it again
    /// keeps its place. `prompt_tokens` is the gateway's estimate of its prompt's size.
    #[pyo3(signature = (
        ticket, priority, now_ms, tenant = 0, excluded = 0, affinity_key = 0, prefix = None,
        deadline_ms = 0, prompt_tokens = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        ticket: u64,
        priority: Priority,
        now_ms: u64,
        tenant: u32,
        excluded: u64,
        affinity_key: u64,
        prefix: Option<PyRef<'_, Prefix>>,
        deadline_ms: u64,
        prompt_tokens: u32,
    ) -> Result<Option<usize>, CoreErr> {
        let p = core::Priority::from(priority);
        let req = core::Request {
            tenant,
            excluded,
            affinity_key,
            deadline: deadline_ms,
            prompt_tokens,
        };
        let blocks = prefix.as_ref().map_or(&[][..], |b| &b.blocks[..]);
        let admit = self.inner.submit_request(ticket, p, req, blocks, now_ms)?;
        Ok(match admit {
            core::Admit::Granted(i) => Some(i),
            core::Admit::Queued(_) => None,
        })
    }

    /// Where the latest grant landed relative to its affinity key — after a `submit` that
    /// returned an instance, that request's decision.
    fn last_affinity(&self) -> Affinity {
        self.inner.last_affinity().into()
    }

    /// How many leading prompt blocks the latest immediate grant's instance held.
    fn last_matched_blocks(&self) -> u32 {
        self.inner.last_matched_blocks()
    }

    /// The class a waiting ticket waits in (a high request that found the high queue full
    /// waits as low); `None` when it is not waiting.
    fn waiting_class(&self, ticket: u64) -> Option<Priority> {
        self.inner.waiting_class(ticket).map(Priority::from)
    }

    fn take_events(&mut self) -> Events {
        encode(self.inner.take_events())
    }

    /// Removes a waiting request; `False` when it is not waiting (granted: release it).
    fn cancel(&mut self, ticket: u64) -> bool {
        self.inner.cancel(ticket)
    }

    /// An attempt ended. On success with `output_tokens` (0: unknown) it teaches the instance's
    /// latency model (SPEC §17): a stream (`first_token` was called) its TPOT, a non-streamed
    /// answer its TTFT (its client's first token came with the whole answer).
    #[pyo3(signature = (ticket, outcome, now_ms, retry_after_ms = 0, output_tokens = 0))]
    fn release(
        &mut self,
        ticket: u64,
        outcome: Outcome,
        now_ms: u64,
        retry_after_ms: u64,
        output_tokens: u32,
    ) -> Result<Events, CoreErr> {
        Ok(encode(self.inner.release_with(
            ticket,
            outcome.into(),
            retry_after_ms,
            output_tokens,
            now_ms,
        )?))
    }

    /// SPEC §17: the first content token of granted attempt `ticket` reached the gateway; its
    /// TTFT trains the instance's model. No-op for an unknown ticket or a second call.
    fn first_token(&mut self, ticket: u64, now_ms: u64) {
        self.inner.first_token(ticket, now_ms);
    }

    /// SPEC §17: (p90 TTFT ms, p90 TPOT ms) of a request of `prompt_tokens` sent to instance
    /// `index` now.
    fn predict(
        &mut self,
        index: usize,
        prompt_tokens: u32,
        now_ms: u64,
    ) -> Result<(f64, f64), CoreErr> {
        Ok(self.inner.predict(index, prompt_tokens, now_ms)?)
    }

    /// SPEC §17 "Unattainable": 0 when some instance of this pool is predicted to meet
    /// `deadline_ms` (or the model is not calibrated: fail open); else a Retry-After in ms.
    fn attainable(
        &mut self,
        priority: Priority,
        deadline_ms: u64,
        prompt_tokens: u32,
        now_ms: u64,
    ) -> u64 {
        self.inner
            .attainable(priority.into(), deadline_ms, prompt_tokens, now_ms)
    }

    fn record_probe(&mut self, index: usize, ok: bool, now_ms: u64) -> Result<Events, CoreErr> {
        Ok(encode(self.inner.record_probe(index, ok, now_ms)?))
    }

    fn tick(&mut self, now_ms: u64) -> Events {
        encode(self.inner.tick(now_ms))
    }

    fn next_wakeup(&self, now_ms: u64) -> Option<u64> {
        self.inner.next_wakeup(now_ms)
    }

    fn retry_after_ms(&mut self, priority: Priority, now_ms: u64) -> u64 {
        self.inner.retry_after_ms(priority.into(), now_ms)
    }

    fn queued(&self, priority: Priority) -> usize {
        self.inner.queued(priority.into())
    }

    #[getter]
    fn waiting(&self) -> usize {
        self.inner.waiting()
    }

    /// Slots a new request could take now (admitting instances only).
    fn free_slots(&mut self, now_ms: u64) -> u32 {
        self.inner.free_slots(now_ms)
    }

    #[getter]
    fn in_flight(&self) -> u32 {
        self.inner.in_flight()
    }

    #[getter]
    fn outstanding(&self) -> usize {
        self.inner.tickets_outstanding()
    }

    #[getter]
    fn instance_count(&self) -> usize {
        self.inner.instances().len()
    }

    #[getter]
    fn consecutive_high(&self) -> u32 {
        self.inner.consecutive_high()
    }

    fn drain_rate(&mut self, now_ms: u64) -> f64 {
        self.inner.drain_rate(now_ms)
    }

    fn instance(&mut self, index: usize, now_ms: u64) -> Result<InstanceInfo, CoreErr> {
        let state = self.inner.instance_state(index, now_ms)?;
        let i = &self.inner.instances()[index];
        let extra = self.inner.extra(index)?;
        let (held, capacity, _) = self.inner.prefix_index(index);
        let (limit, adaptive) = (i.limit, self.inner.model(index)?.adaptive());
        let model = self.inner.model_view(index, now_ms)?;
        let i = &self.inner.instances()[index];
        Ok(InstanceInfo {
            state: state.into(),
            in_flight: i.in_flight,
            peer_in_flight: i.peer_in_flight,
            max_concurrency: i.max_concurrency,
            consecutive_failures: i.consecutive_failures(),
            ejected_until_ms: i.ejected_until(),
            cool_until_ms: i.cool_until(),
            next_try_ms: i.next_try_at(now_ms),
            ejections: i.ejections(),
            half_open_trials: i.trials(),
            removed: i.removed,
            backend_waiting: extra.backend_waiting,
            cache_permille: extra.cache_permille,
            prefix_blocks: held,
            prefix_capacity: capacity,
            concurrency_limit: limit,
            adaptive,
            predicted_ttft_ms: model.ttft_ms,
            predicted_tpot_ms: model.tpot_ms,
            ttft_mae_ms: model.ttft_mae_ms,
            tpot_mae_ms: model.tpot_mae_ms,
            ttft_coverage: model.ttft_coverage,
            tpot_coverage: model.tpot_coverage,
            samples: model.ttft_samples,
            tpot_samples: model.tpot_samples,
            calibrated: model.calibrated,
        })
    }

    /// Instance state changes since the last call: (index, new state), oldest first.
    fn take_transitions(&mut self) -> Vec<(usize, InstanceState)> {
        self.inner
            .take_transitions()
            .into_iter()
            .map(|(i, s)| (i, s.into()))
            .collect()
    }

    #[getter]
    fn has_transitions(&self) -> bool {
        self.inner.has_transitions()
    }

    /// SPEC §12: makes this pool worker `worker`'s share of pool `pool_id` (a stable hash of
    /// its name) in the workers' region. Before any instance is added.
    fn attach(
        &mut self,
        region: &crate::region::Region,
        pool_id: u64,
        worker: usize,
    ) -> Result<(), CoreErr> {
        Ok(self
            .inner
            .attach_joined(region.inner, &region.joins, pool_id, worker)?)
    }

    /// SPEC §12 "bounded and reclaimed": the pool closed — it leaves the workers' region (its
    /// instance cells and tenant entries, and with this process's last pool of its name the
    /// pool's slot, which the last worker frees for another pool). Idempotent; afterwards
    /// the pool schedules alone. A pool garbage-collected without it keeps its cells until
    /// the worker's slot is reclaimed (as a killed worker's).
    fn detach(&mut self) {
        self.inner.detach();
    }

    #[getter]
    fn shared(&self) -> bool {
        self.inner.is_shared()
    }

    /// What the other workers have waiting: (high, low); (0, 0) for a single process.
    fn peers_waiting(&self) -> (u64, u64) {
        self.inner.peers_waiting()
    }

    /// Grants by every worker: (high, low).
    fn grants_everywhere(&self) -> (u64, u64) {
        self.inner.grants_everywhere()
    }

    /// Worker slots to wake (a bit set) since the last call; 0 for a single process.
    fn take_wakes(&mut self) -> u64 {
        self.inner.take_wakes()
    }

    /// Whether this worker probes instance `index` now (one probe per interval across
    /// workers); always true for a single process.
    fn claim_probe(&self, index: usize, now_ms: u64, interval_ms: u64) -> bool {
        self.inner.claim_probe(index, now_ms, interval_ms)
    }

    fn stats(&self) -> PoolStats {
        let s = self.inner.stats();
        PoolStats {
            granted_high: s.granted[0],
            granted_low: s.granted[1],
            forced_low: s.forced_low,
            expired: s.expired,
            cancelled: s.cancelled,
            rejected_full: s.rejected_full,
            unservable: s.unservable,
            affinity_hits: s.affinity_hits,
            affinity_spills: s.affinity_spills,
        }
    }
}
