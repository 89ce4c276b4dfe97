//! SPEC §12: where a pool's shared scheduling state lives — the one interface through which
//! `pool.rs` meets the other workers (issue 20 item 7: "a narrow trait or enum for the peers
//! that the pool calls at a few sync points").
//!
//! `Peers::Alone` is a pool this process owns: every call is a no-op or answers what the pool
//! alone would (nothing waits elsewhere, every unit it picks is its own). `Peers::Workers` is
//! one worker's share of a pool in the workers' region (`shared.rs` over `shm.rs`). The pool
//! calls it unconditionally, at these points:
//!
//! - **before** an operation (`before`): read what the others changed (their in-flight
//!   counts, ejections, probes, adaptive limits, waiting requests, the selector);
//! - **after** it (`after`): show this worker's queue, the ejections it made, and offer a unit
//!   its own queue left free to the workers that wait;
//! - **a slot**: `take` a unit of the instance the balancer picked (another worker may have
//!   filled it since the last look), `give` it back at release;
//! - **a queue place**: `has_place`, counted over every worker's queue;
//! - **the class turn**: `waiting` (the others' counts and oldest low), `defers` (whether the
//!   turn is another worker's), `commit` (a grant to the shared selector);
//! - **tenant events**: `tenant_waits`, `tenant_granted` (fair share across workers);
//! - **health and limits**: `outcome` (failures counted across workers), `publish_probe`,
//!   `claim_probe`, `adapt` and `clear_limit` (the adaptive limit is one word).
//!
//! `detach` leaves the region (the pool closed) and makes the pool `Alone`.
//!
//! An enum, not a trait object: the single-process case pays one discriminant test per call,
//! as the `Option` it replaces did, and nothing is dispatched through a vtable on the hot path.

use std::sync::atomic::{fence, Ordering::SeqCst};

use crate::adaptive::{Gradient, WINDOW_MS};
use crate::error::CoreError;
use crate::health::HealthConfig;
use crate::instance::Instance;
use crate::selector::Selector;
/// This process's uses of the region's cells, which a pool attaches with (re-exported: the
/// pool reaches the shared state only through this module).
pub use crate::shared::Joins;
use crate::shared::Shared;
use crate::shm::{min_opt, Region, MAX_POOLS, MAX_SLOTS};
use crate::types::{InstanceState, Millis, Priority, Tenant};

/// What a worker's queue shows the others (SPEC §12): its waiting counts, oldest arrival and
/// next turn (tenant, head deadline) per class (high, low).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Summary {
    pub counts: (usize, usize),
    pub oldest: (Option<Millis>, Option<Millis>),
    pub turns: (Turn, Turn),
}

/// A class's next turn in a worker's queue: its tenant and its head's deadline.
pub(crate) type Turn = Option<(Tenant, Millis)>;

/// A pool's peers: none (this process owns it) or the other workers of a region.
// `Shared` inline, as in the `Option` this replaces: a pool holds one, and a boxed one would
// cost a pointer chase on every call of a worker's hot path.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Default)]
pub(crate) enum Peers {
    #[default]
    Alone,
    Workers(Shared),
}

impl Peers {
    /// Worker `worker`'s share of pool `pool_id` in `region`, its process's uses of the
    /// region's cells counted in `joins`.
    pub fn workers(
        region: Region<'static>,
        joins: Joins,
        pool_id: u64,
        worker: usize,
    ) -> Result<Self, CoreError> {
        Shared::new(region, joins, pool_id, worker)
            .map(Self::Workers)
            .ok_or_else(slots_used_up)
    }

    /// The pool closed: with workers it leaves the region (`Shared::detach`); alone after.
    pub fn detach(&mut self) {
        if let Self::Workers(s) = std::mem::take(self) {
            s.detach();
        }
    }

    pub fn is_shared(&self) -> bool {
        matches!(self, Self::Workers(_))
    }

    /// Instance `idx` of the pool is the one with stable id `id`.
    pub fn bind(&mut self, idx: usize, id: u64) -> Result<(), CoreError> {
        match self {
            Self::Alone => Ok(()),
            Self::Workers(s) => s.bind(idx, id).ok_or_else(slots_used_up),
        }
    }

    /// Before an operation: applies what the other workers changed to `instances` and the
    /// selector; transitions it causes go to `transitions`. Whether an instance changed state.
    pub fn before(
        &mut self,
        instances: &mut [Instance],
        health: &HealthConfig,
        selector: &mut Selector,
        transitions: &mut Vec<(usize, InstanceState)>,
        now: Millis,
    ) -> bool {
        match self {
            Self::Alone => false,
            Self::Workers(s) => s.sync(instances, health, selector, transitions, now),
        }
    }

    /// After an operation: this worker's queue (`summary`, computed only with workers) for the
    /// others to see, the ejections it made; with `free()` a unit its queue left goes to the
    /// workers that wait.
    pub fn after(
        &mut self,
        summary: impl FnOnce() -> Summary,
        instances: &[Instance],
        free: impl FnOnce() -> bool,
    ) {
        let Self::Workers(s) = self else {
            return;
        };
        publish(s, summary());
        let free = free();
        s.publish_ejections(instances);
        if free {
            s.offer();
        }
    }

    /// Shows this worker's queue to the others (after a cancellation).
    pub fn publish_waiting(&mut self, summary: impl FnOnce() -> Summary) {
        if let Self::Workers(s) = self {
            publish(s, summary());
        }
    }

    /// A request of `tenant` was queued here: SPEC §12, no lost wake-up — this worker shows
    /// that it waits, *then* (the caller's next `before`) looks at the units again. A worker
    /// freeing a unit gives it back, then reads who waits; with a full fence on both sides
    /// (Dekker's pattern) at least one of the two sees the other.
    pub fn queued(&mut self, tenant: Tenant, summary: impl FnOnce() -> Summary) {
        if let Self::Workers(s) = self {
            s.tenant_waits(tenant);
            publish(s, summary());
            fence(SeqCst);
        }
    }

    /// Takes a unit of instance `idx` (and, half-open, a trial permit) — with workers from the
    /// shared lease word, which another worker may have filled since the last look. Alone the
    /// pool's own count is the truth: always.
    #[inline]
    pub fn take(&self, idx: usize, inst: &Instance, trial_permits: u32) -> bool {
        match self {
            Self::Alone => true,
            Self::Workers(s) => s.take(idx, inst, trial_permits),
        }
    }

    /// Gives back the unit of an attempt on instance `idx` (and its trial permit) before the
    /// release's `before`: the other half of `queued`'s fence.
    #[inline]
    pub fn give(&mut self, idx: usize, trial: bool) {
        if let Self::Workers(s) = self {
            s.give(idx, trial);
            fence(SeqCst);
        }
    }

    /// Whether a `class` queue of `capacity` has room for one more (`local`: whether this
    /// worker's own queue has). With workers the capacity bounds the union: a place is taken
    /// in the shared count before the entry goes in.
    #[inline]
    pub fn has_place(&mut self, class: Priority, capacity: usize, local: bool) -> bool {
        match self {
            Self::Alone => local,
            Self::Workers(s) => s.take_place(class, capacity),
        }
    }

    /// What the other workers have waiting: (high, low); (0, 0) alone.
    #[inline]
    pub fn waiting(&self) -> (u64, u64) {
        match self {
            Self::Alone => (0, 0),
            Self::Workers(s) => (s.peers.high, s.peers.low),
        }
    }

    /// SPEC §12: whether high waits anywhere and the oldest low arrival anywhere, given this
    /// worker's own.
    #[inline]
    pub fn heads(&self, high: bool, oldest_low: Option<Millis>) -> (bool, Option<Millis>) {
        match self {
            Self::Alone => (high, oldest_low),
            Self::Workers(s) => (
                high || s.peers.high > 0,
                min_opt(oldest_low, s.peers.oldest_low),
            ),
        }
    }

    /// SPEC §12: whether this worker leaves a `class` turn to another — nothing is free
    /// (`any_room()` false: a deferral would be given up for nothing, and nothing is granted
    /// anyway), the class waits only elsewhere (`mine()` none), or another worker's next turn
    /// in it is fairer (see `Shared::better_turn`). The other is woken. Never alone.
    pub fn defers(
        &mut self,
        class: Priority,
        any_room: impl FnOnce() -> bool,
        mine: impl FnOnce() -> Turn,
        now: Millis,
    ) -> bool {
        let Self::Workers(s) = self else {
            return false;
        };
        if !any_room() {
            return true;
        }
        match mine() {
            None => {
                s.defer_to(class);
                true
            }
            Some(mine) => s.better_turn(class, mine, now).is_some(),
        }
    }

    /// A grant of `class`: `commit` applies it to this worker's selector; with workers the
    /// change is applied to the shared selector too (and the grant counted).
    pub fn commit(
        &self,
        selector: &mut Selector,
        commit: impl FnOnce(&mut Selector),
        class: Priority,
        now: Millis,
    ) {
        match self {
            Self::Alone => commit(selector),
            Self::Workers(s) => {
                let before = selector.clone();
                commit(selector);
                s.commit(&before, selector, class, now);
            }
        }
    }

    /// A reload changed the class weights: the shared credit starts afresh too.
    pub fn reset_credit(&self) {
        if let Self::Workers(s) = self {
            s.reset_credit();
        }
    }

    pub fn tenant_granted(&mut self, tenant: Tenant) {
        if let Self::Workers(s) = self {
            s.tenant_granted(tenant);
        }
    }

    /// SPEC §12 "the failure threshold counts every worker's attempts": an attempt's outcome
    /// on a healthy instance, counted across workers — the consecutive failures now (0 alone,
    /// where the breaker's own count is the whole count, and after a success).
    pub fn outcome(&self, idx: usize, failed: bool) -> u64 {
        match self {
            Self::Alone => 0,
            Self::Workers(s) => s.outcome(idx, failed),
        }
    }

    /// A probe's result, for every worker to apply (one prober per interval).
    pub fn publish_probe(&mut self, idx: usize, ok: bool) {
        if let Self::Workers(s) = self {
            s.publish_probe(idx, ok);
        }
    }

    /// SPEC §12 "one probe per instance per interval, not N": whether this worker probes
    /// instance `idx` (of `instances`) now. Always alone.
    pub fn claim_probe(&self, idx: usize, instances: usize, now: Millis, interval: Millis) -> bool {
        match self {
            Self::Alone => true,
            Self::Workers(s) => idx < instances && s.claim_probe(idx, now, interval),
        }
    }

    /// SPEC §17: judges instance `idx`'s adaptive window `g` if complete (ceiling `max`).
    /// With workers (SPEC §12) the limit is one shared word of the instance's region slot: a
    /// worker adopts the latest judgement, and judges only when none was made in the last
    /// window (the first worker with a full window does, by CAS), so the cap is one value
    /// and it moves once per window, whichever worker's completions filled it.
    pub fn adapt(&self, idx: usize, g: &mut Gradient, max: u32, now: Millis) {
        let Self::Workers(s) = self else {
            g.update(max, now);
            return;
        };
        let (seen, current) = s.limit(idx);
        if let Some((limit, at)) = current {
            g.adopt(limit, at, now);
            if now < at.saturating_add(WINDOW_MS) {
                return;
            }
        }
        if g.update(max, now) && !s.judge_limit(idx, seen, Some((g.raw(), now))) {
            // Another worker judged first: its limit holds.
            if let (_, Some((limit, at))) = s.limit(idx) {
                g.adopt(limit, at, now);
            }
        }
    }

    /// Instance `idx`'s adaptive limit is off: off for every worker.
    pub fn clear_limit(&self, idx: usize) {
        if let Self::Workers(s) = self {
            s.clear_limit(idx);
        }
    }

    /// SPEC §16: (instances bound to a region cell, tenant entries cached); (0, 0) alone.
    pub fn tables(&self) -> (usize, usize) {
        match self {
            Self::Alone => (0, 0),
            Self::Workers(s) => (s.bound(), s.tenants_cached()),
        }
    }

    /// Grants by every worker (high, low); `None` alone.
    pub fn grants(&self) -> Option<(u64, u64)> {
        match self {
            Self::Alone => None,
            Self::Workers(s) => Some(s.grants()),
        }
    }

    /// Worker slots to wake since the last call (a bit set; 0 alone).
    pub fn take_wakes(&mut self) -> u64 {
        match self {
            Self::Alone => 0,
            Self::Workers(s) => s.take_wakes(),
        }
    }
}

fn publish(s: &mut Shared, summary: Summary) {
    s.publish_turns(summary.turns.0, summary.turns.1);
    s.publish_waiting(summary.counts, summary.oldest);
}

fn slots_used_up() -> CoreError {
    CoreError::InvalidConfig(format!(
        "the workers' shared region is full ({MAX_POOLS} pools, {MAX_SLOTS} instance slots per pool)"
    ))
}
