//! Per-instance health: a circuit breaker in the manner of Envoy's outlier detection
//! (consecutive-failure detection, ejection time growing with repeated ejections) with an
//! explicit half-open state as in resilience4j, plus a Retry-After cool-down.
//!
//! Alternatives not taken: success-rate or latency-based detection (needs volume the smaller
//! pools never reach) and a probe-only health model (SPEC §6 says a passing probe must not
//! restore an instance that real requests fail on).
//!
//! Only *enforced* ejections exist here: every detection ejects (there is no max-ejection-percent
//! as in Envoy), because a pool whose instances all fail is better answered by its fallback.

use crate::types::{InstanceState, Millis, Outcome};

/// SPEC §8 `health:` — the thresholds shared by a pool's instances.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    pub failure_threshold: u32,
    pub ejection_ms: Millis,
    pub max_ejection_ms: Millis,
    pub half_open_max_requests: u32,
    pub success_threshold: u32,
    /// Whether active probes run; when they do, half-open also needs a probe that passed
    /// after the ejection (SPEC §6 "Half-open").
    pub probing: bool,
}

impl Default for HealthConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            ejection_ms: 10_000,
            max_ejection_ms: 300_000,
            half_open_max_requests: 1,
            success_threshold: 2,
            probing: true,
        }
    }
}

/// The health of one instance.
#[derive(Clone, Debug)]
pub struct Breaker {
    state: InstanceState,
    consecutive_failures: u32,
    consecutive_successes: u32,
    /// Ejection level: the next ejection lasts `ejection_ms * 2^(level)` (capped).
    level: u32,
    ejected_until: Millis,
    restored_at: Millis,
    /// Trial requests in flight while half-open.
    trials: u32,
    /// Whether the latest probe since the last ejection passed.
    probe_ok: bool,
    cool_until: Millis,
    /// Bumped on every ejection: outcomes of attempts granted before it are stale.
    epoch: u32,
    ejections: u64,
}

impl Default for Breaker {
    fn default() -> Self {
        Self::new()
    }
}

impl Breaker {
    pub const fn new() -> Self {
        Self {
            state: InstanceState::Healthy,
            consecutive_failures: 0,
            consecutive_successes: 0,
            level: 0,
            ejected_until: 0,
            restored_at: 0,
            trials: 0,
            probe_ok: false,
            cool_until: 0,
            epoch: 0,
            ejections: 0,
        }
    }

    /// Applies the time-driven transition ejected → half-open.
    /// SPEC §6: "an ejected instance turns half-open once its ejection time has passed *and*
    /// (where probing is on) its latest probe passed".
    pub fn advance(&mut self, cfg: &HealthConfig, now: Millis) {
        if self.state == InstanceState::Ejected
            && now >= self.ejected_until
            && (!cfg.probing || self.probe_ok)
        {
            self.state = InstanceState::HalfOpen;
            self.consecutive_successes = 0;
            self.trials = 0;
        }
    }

    /// Whether a new attempt may start here now (free slots are the balancer's business).
    /// Call `advance` first.
    pub fn admits(&self, cfg: &HealthConfig, now: Millis) -> bool {
        if now < self.cool_until {
            return false;
        }
        match self.state {
            InstanceState::Healthy => true,
            // SPEC §6: half-open "admits at most half_open_max_requests real trial requests".
            InstanceState::HalfOpen => self.trials < cfg.half_open_max_requests,
            InstanceState::Ejected => false,
        }
    }

    /// Whether the instance is up — the test behind "no healthy instance" (SPEC §6: every
    /// instance *ejected*). A half-open instance whose trial permits are taken is busy, not
    /// down; so is one cooling off for an upstream's Retry-After: requests wait for it (within
    /// their `max_wait_ms`) rather than fail.
    pub fn available(&self) -> bool {
        self.state != InstanceState::Ejected
    }

    /// Earliest time this instance may be tried again (for `Retry-After`).
    pub fn next_try_at(&self, now: Millis) -> Millis {
        let mut t = now.max(self.cool_until);
        if self.state == InstanceState::Ejected {
            t = t.max(self.ejected_until);
        }
        t
    }

    /// Records that an attempt starts; returns whether it is a half-open trial.
    pub fn on_grant(&mut self) -> bool {
        if self.state == InstanceState::HalfOpen {
            self.trials += 1;
            true
        } else {
            false
        }
    }

    /// Records an attempt's outcome. `epoch` and `trial` are what `on_grant` saw; an outcome
    /// from before the latest ejection only returns its trial permit (it no longer speaks for
    /// the instance).
    pub fn on_outcome(
        &mut self,
        cfg: &HealthConfig,
        outcome: Outcome,
        epoch: u32,
        trial: bool,
        now: Millis,
    ) {
        if epoch != self.epoch {
            return;
        }
        if trial {
            debug_assert!(self.trials > 0, "a trial returned that was never granted");
            self.trials = self.trials.saturating_sub(1);
        }
        match (self.state, outcome) {
            (_, Outcome::Neutral) | (InstanceState::Ejected, _) => {}
            (InstanceState::Healthy, Outcome::Success) => self.consecutive_failures = 0,
            (InstanceState::Healthy, Outcome::Failure) => self.count_failure(cfg, now),
            (InstanceState::HalfOpen, Outcome::Success) => {
                self.consecutive_successes += 1;
                // SPEC §6: "success_threshold consecutive successes restore it".
                if self.consecutive_successes >= cfg.success_threshold {
                    self.state = InstanceState::Healthy;
                    self.consecutive_failures = 0;
                    self.restored_at = now;
                }
            }
            // SPEC §6: "one failure (a request or a probe) ejects it again with the doubled time".
            (InstanceState::HalfOpen, Outcome::Failure) => self.eject(cfg, now),
        }
    }

    /// Records an active probe's result. SPEC §6: "a failed probe counts as a failure"; a
    /// passing one only opens the way to half-open.
    pub fn on_probe(&mut self, cfg: &HealthConfig, ok: bool, now: Millis) {
        if ok {
            self.probe_ok = true;
            return;
        }
        self.probe_ok = false;
        match self.state {
            InstanceState::Healthy => self.count_failure(cfg, now),
            InstanceState::HalfOpen => self.eject(cfg, now),
            InstanceState::Ejected => {}
        }
    }

    /// SPEC §6: "An upstream 429 or 503 carrying Retry-After also cools the instance for that
    /// long" — in addition to (not instead of) the failure it counts as.
    pub fn cool(&mut self, until: Millis) {
        self.cool_until = self.cool_until.max(until);
    }

    /// SPEC §12: another worker ejected this instance until `until`; it holds here too (a
    /// later end already here wins). Trials in flight stop speaking for it, as on an ejection.
    pub fn adopt_ejection(&mut self, until: Millis) {
        if self.state == InstanceState::Ejected && self.ejected_until >= until {
            return;
        }
        self.enter_ejection(until);
    }

    /// SPEC §12: the consecutive failures every worker saw; the threshold applies to them.
    pub fn shared_failures(&mut self, cfg: &HealthConfig, n: u64, now: Millis) {
        if self.state != InstanceState::Healthy {
            return;
        }
        self.consecutive_failures = self
            .consecutive_failures
            .max(n.min(u64::from(u32::MAX)) as u32);
        if self.consecutive_failures >= cfg.failure_threshold {
            self.eject(cfg, now);
        }
    }

    fn count_failure(&mut self, cfg: &HealthConfig, now: Millis) {
        self.consecutive_failures += 1;
        // SPEC §6: "After failure_threshold consecutive failures the instance is ejected".
        if self.consecutive_failures >= cfg.failure_threshold {
            self.eject(cfg, now);
        }
    }

    fn eject(&mut self, cfg: &HealthConfig, now: Millis) {
        if self.state == InstanceState::Healthy {
            // A healthy spell forgives one doubling per `ejection_ms` it lasted (Envoy's
            // multiplier decay), so an instance that flaps keeps growing its ejection while
            // one that failed once an hour ago starts again from `ejection_ms`.
            let healthy_for = now.saturating_sub(self.restored_at);
            let forgiven = healthy_for / cfg.ejection_ms.max(1);
            self.level = self
                .level
                .saturating_sub(forgiven.min(u32::MAX as u64) as u32);
        }
        // SPEC §6: ejected for ejection_ms, "doubling on each repeated ejection up to
        // max_ejection_ms".
        let span = cfg
            .ejection_ms
            .saturating_mul(1u64 << self.level.min(32))
            .min(cfg.max_ejection_ms.max(cfg.ejection_ms));
        self.level = self.level.saturating_add(1);
        self.enter_ejection(now.saturating_add(span));
    }

    fn enter_ejection(&mut self, until: Millis) {
        self.state = InstanceState::Ejected;
        self.ejected_until = until;
        self.consecutive_failures = 0;
        self.consecutive_successes = 0;
        self.trials = 0;
        // Fresh evidence is needed: a probe that passed before the ejection does not count.
        self.probe_ok = false;
        self.epoch = self.epoch.wrapping_add(1);
        self.ejections += 1;
    }

    pub fn state(&self) -> InstanceState {
        self.state
    }
    pub fn epoch(&self) -> u32 {
        self.epoch
    }
    pub fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures
    }
    /// `Some(until)` while ejected.
    pub fn ejected_until(&self) -> Option<Millis> {
        (self.state == InstanceState::Ejected).then_some(self.ejected_until)
    }
    pub fn cool_until(&self) -> Millis {
        self.cool_until
    }
    pub fn ejections(&self) -> u64 {
        self.ejections
    }
    pub fn trials(&self) -> u32 {
        self.trials
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> HealthConfig {
        HealthConfig {
            probing: false,
            ..HealthConfig::default()
        }
    }

    #[test]
    fn three_failures_eject_and_time_half_opens() {
        let c = cfg();
        let mut b = Breaker::new();
        for _ in 0..2 {
            b.on_outcome(&c, Outcome::Failure, b.epoch(), false, 0);
        }
        assert_eq!(b.state(), InstanceState::Healthy);
        b.on_outcome(&c, Outcome::Failure, b.epoch(), false, 100);
        assert_eq!(b.state(), InstanceState::Ejected);
        assert_eq!(b.ejected_until(), Some(10_100));
        b.advance(&c, 10_099);
        assert_eq!(b.state(), InstanceState::Ejected);
        b.advance(&c, 10_100);
        assert_eq!(b.state(), InstanceState::HalfOpen);
    }

    #[test]
    fn success_resets_the_failure_run() {
        let c = cfg();
        let mut b = Breaker::new();
        b.on_outcome(&c, Outcome::Failure, 0, false, 0);
        b.on_outcome(&c, Outcome::Failure, 0, false, 0);
        b.on_outcome(&c, Outcome::Success, 0, false, 0);
        b.on_outcome(&c, Outcome::Failure, 0, false, 0);
        assert_eq!(b.state(), InstanceState::Healthy);
        assert_eq!(b.consecutive_failures(), 1);
    }

    #[test]
    fn half_open_failure_doubles_up_to_the_cap() {
        let c = HealthConfig {
            failure_threshold: 1,
            max_ejection_ms: 35_000,
            ..cfg()
        };
        let mut b = Breaker::new();
        let mut now = 0;
        let mut spans = vec![];
        for _ in 0..4 {
            let trial = b.on_grant();
            b.on_outcome(&c, Outcome::Failure, b.epoch(), trial, now);
            let until = b.ejected_until().unwrap();
            spans.push(until - now);
            now = until;
            b.advance(&c, now);
            assert_eq!(b.state(), InstanceState::HalfOpen);
        }
        assert_eq!(spans, vec![10_000, 20_000, 35_000, 35_000]);
    }

    #[test]
    fn probe_gates_half_open_and_never_restores() {
        let c = HealthConfig {
            failure_threshold: 1,
            ..HealthConfig::default()
        };
        let mut b = Breaker::new();
        b.on_probe(&c, true, 0);
        b.on_outcome(&c, Outcome::Failure, 0, false, 0);
        b.advance(&c, 20_000);
        // the pass before the ejection does not count
        assert_eq!(b.state(), InstanceState::Ejected);
        b.on_probe(&c, true, 20_000);
        b.advance(&c, 20_000);
        assert_eq!(b.state(), InstanceState::HalfOpen);
        // trials: one at a time, two successes restore
        assert!(b.admits(&c, 20_000));
        let trial = b.on_grant();
        assert!(trial && !b.admits(&c, 20_000));
        b.on_outcome(&c, Outcome::Success, b.epoch(), trial, 20_001);
        assert_eq!(b.state(), InstanceState::HalfOpen);
        let trial = b.on_grant();
        b.on_outcome(&c, Outcome::Success, b.epoch(), trial, 20_002);
        assert_eq!(b.state(), InstanceState::Healthy);
    }

    #[test]
    fn stale_outcomes_do_not_speak_for_the_instance() {
        let c = HealthConfig {
            failure_threshold: 1,
            ..cfg()
        };
        let mut b = Breaker::new();
        let old = b.epoch();
        b.on_outcome(&c, Outcome::Failure, old, false, 0);
        b.advance(&c, 10_000);
        assert_eq!(b.state(), InstanceState::HalfOpen);
        // a success from an attempt granted before the ejection does not count as a trial
        b.on_outcome(&c, Outcome::Success, old, false, 10_000);
        b.on_outcome(&c, Outcome::Success, old, false, 10_000);
        assert_eq!(b.state(), InstanceState::HalfOpen);
    }

    #[test]
    fn cooling_blocks_without_ejecting() {
        let c = cfg();
        let mut b = Breaker::new();
        b.cool(5_000);
        assert!(!b.admits(&c, 4_999));
        assert!(b.available()); // busy, not down
        assert_eq!(b.state(), InstanceState::Healthy);
        assert_eq!(b.next_try_at(1_000), 5_000);
        assert!(b.admits(&c, 5_000));
    }
}
