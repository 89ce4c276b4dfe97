//! One backend instance as the scheduler sees it (its slots, cap and health) and what it is
//! beyond them. Its own module, below `pool.rs` and `shared.rs` both, so that `shared.rs` (a
//! pool's door to the workers' region) reads and updates instances without importing
//! `pool.rs`, which imports it: issue 20's `pool.rs` <-> `shared.rs` cycle is gone.

use crate::balancer::Load;
use crate::health::{Breaker, HealthConfig};
use crate::types::{InstanceState, Millis};

/// One backend instance as the scheduler sees it: its slots and its health.
#[derive(Clone, Debug)]
pub struct Instance {
    pub max_concurrency: u32,
    /// The effective cap: `max_concurrency`, or below it the adaptive limit (SPEC §17).
    pub limit: u32,
    pub in_flight: u32,
    /// SPEC §12: attempts other workers have on it (0 when one process owns the pool).
    pub peer_in_flight: u32,
    /// Its health (SPEC §6): read through the methods below; only the core moves it.
    pub(crate) breaker: Breaker,
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
    /// Its health state (SPEC §6).
    pub fn state(&self) -> InstanceState {
        self.breaker.state()
    }

    /// Until when it is ejected, if it is.
    pub fn ejected_until(&self) -> Option<Millis> {
        self.breaker.ejected_until()
    }

    /// Consecutive failed attempts, while healthy.
    pub fn consecutive_failures(&self) -> u32 {
        self.breaker.consecutive_failures()
    }

    /// Until when a Retry-After cools it (0: never cooled).
    pub fn cool_until(&self) -> Millis {
        self.breaker.cool_until()
    }

    /// The earliest time it may be tried again.
    pub fn next_try_at(&self, now: Millis) -> Millis {
        self.breaker.next_try_at(now)
    }

    /// How many times it was ejected.
    pub fn ejections(&self) -> u64 {
        self.breaker.ejections()
    }

    /// Half-open trial attempts in flight.
    pub fn trials(&self) -> u32 {
        self.breaker.trials()
    }

    /// SPEC §12 "an ejection seen by one worker holds for all": adopts another worker's.
    pub fn adopt_ejection(&mut self, until: Millis) {
        self.breaker.adopt_ejection(until);
    }

    /// SPEC §6 a probe's result (this worker's or another's).
    pub fn on_probe(&mut self, health: &HealthConfig, ok: bool, now: Millis) {
        self.breaker.on_probe(health, ok, now);
    }

    /// The load of an instance whose backend reports nothing: its own attempts only.
    pub(crate) fn load(&self) -> Load {
        Load {
            active: self.in_flight.saturating_add(self.peer_in_flight),
            capacity: self.limit,
            cache_permille: 0,
        }
    }

    /// SPEC §15 "Backend load": this pool's attempts plus the backend's own queue.
    pub(crate) fn load_with(&self, extra: &InstanceExtra) -> Load {
        Load {
            active: self
                .in_flight
                .saturating_add(self.peer_in_flight)
                .saturating_add(extra.backend_waiting),
            capacity: self.limit,
            cache_permille: extra.cache_permille,
        }
    }

    /// Requests on the instance, for the affinity bound.
    pub(crate) fn active(&self, extra: &InstanceExtra) -> u64 {
        u64::from(self.in_flight)
            + u64::from(self.peer_in_flight)
            + u64::from(extra.backend_waiting)
    }

    /// Whether another attempt fits under its cap (every worker's attempts counted).
    pub(crate) fn has_room(&self) -> bool {
        self.in_flight.saturating_add(self.peer_in_flight) < self.limit
    }
}
