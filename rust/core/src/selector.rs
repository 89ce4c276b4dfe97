//! Which class goes next when a slot frees (SPEC §3 "Selection" and "Starvation protection").
//!
//! `weighted` is smooth weighted round-robin as in nginx's upstream module: every turn each
//! competing class gains its weight, the richest wins and pays the total. For 7:3 it yields
//! `H L H H H L H H L H` — the shares are exact over every 10 grants and the low grants are
//! spread out, not bunched. It is work-conserving: the selector runs only when both classes
//! wait; a class alone is served without touching the counters (an empty class cedes its turns
//! and builds no credit). `strict` always serves high.
//!
//! The starvation guard sits above both and never inverts priority: it forces one low grant
//! when a bound is hit and restarts both bounds, so a sustained backlog sees one forced low per
//! bound, not a run of them.
//!
//! Not taken: deficit round-robin (needs request sizes we do not know) and aging priorities
//! (which can invert priority under a long backlog).

use crate::shm::SharedSelector;
use crate::types::{Millis, Policy, Priority};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelectorConfig {
    pub policy: Policy,
    pub high_weight: u32,
    pub low_weight: u32,
    pub max_consecutive_high: u32,
    pub max_low_wait_ms: Millis,
}

impl Default for SelectorConfig {
    fn default() -> Self {
        Self {
            policy: Policy::Weighted,
            high_weight: 7,
            low_weight: 3,
            max_consecutive_high: 20,
            max_low_wait_ms: 5_000,
        }
    }
}

/// Why a class was chosen; the pool applies it with `commit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    /// Only this class waits.
    Alone(Priority),
    /// Both wait; the policy chose.
    Policy(Priority),
    /// Both wait; the starvation guard forced a low grant.
    Forced,
}

impl Choice {
    pub fn class(self) -> Priority {
        match self {
            Choice::Alone(p) | Choice::Policy(p) => p,
            Choice::Forced => Priority::Low,
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Selector {
    /// Smooth-WRR running credits (high, low).
    credit: [i64; 2],
    consecutive_high: u32,
    last_low_grant: Millis,
}

impl Selector {
    pub fn new() -> Self {
        Self::default()
    }

    /// Picks the class for the next grant. `oldest_low` is the arrival time of the oldest
    /// waiting low request. Pure: nothing changes until `commit`.
    pub fn choose(
        &self,
        cfg: &SelectorConfig,
        high_waiting: bool,
        oldest_low: Option<Millis>,
        now: Millis,
    ) -> Option<Choice> {
        match (high_waiting, oldest_low) {
            (false, None) => None,
            (true, None) => Some(Choice::Alone(Priority::High)),
            (false, Some(_)) => Some(Choice::Alone(Priority::Low)),
            (true, Some(oldest)) => {
                // SPEC §3: "(a) at most max_consecutive_high high grants in a row"
                let too_many_high = self.consecutive_high >= cfg.max_consecutive_high;
                // SPEC §3: "(b) at most max_low_wait_ms since the last low grant (or since the
                // oldest low arrived, if later)"
                let since = self.last_low_grant.max(oldest);
                let waited_too_long = now.saturating_sub(since) >= cfg.max_low_wait_ms;
                if too_many_high || waited_too_long {
                    return Some(Choice::Forced);
                }
                Some(Choice::Policy(match cfg.policy {
                    Policy::Strict => Priority::High,
                    Policy::Weighted => self.swrr_pick(cfg),
                }))
            }
        }
    }

    fn swrr_pick(&self, cfg: &SelectorConfig) -> Priority {
        let h = self.credit[0] + i64::from(cfg.high_weight);
        let l = self.credit[1] + i64::from(cfg.low_weight);
        // ties go to high
        if h >= l {
            Priority::High
        } else {
            Priority::Low
        }
    }

    /// Applies a grant of `granted` (normally `choice.class()`; the other class when the
    /// chosen one had no entry that fits a free instance). `low_waiting` is whether low
    /// requests were waiting when the grant was made.
    pub fn commit(
        &mut self,
        cfg: &SelectorConfig,
        choice: Choice,
        granted: Priority,
        low_waiting: bool,
        now: Millis,
    ) {
        if let (Choice::Policy(_), Policy::Weighted) = (choice, cfg.policy) {
            self.credit[0] += i64::from(cfg.high_weight);
            self.credit[1] += i64::from(cfg.low_weight);
            self.credit[granted.index()] -= i64::from(cfg.high_weight + cfg.low_weight);
        }
        match granted {
            Priority::High => {
                // Counts only high grants that passed over a waiting low.
                self.consecutive_high = if low_waiting {
                    self.consecutive_high + 1
                } else {
                    0
                };
            }
            Priority::Low => {
                // SPEC §3: "the next grant goes to low and both counts restart".
                self.consecutive_high = 0;
                self.last_low_grant = now;
            }
        }
    }

    /// Drops the policy's running credit (on reconfiguration, where old credits would skew the
    /// new weights).
    pub fn reset_credit(&mut self) {
        self.credit = [0, 0];
    }

    pub fn consecutive_high(&self) -> u32 {
        self.consecutive_high
    }

    /// The state as the workers' region stores it (SPEC §12): smooth-WRR credits always sum
    /// to zero (each commit adds both weights and takes their sum from one class), so the
    /// high credit is the whole of it.
    pub fn shared(&self) -> SharedSelector {
        SharedSelector {
            credit_high: self.credit[0],
            consecutive_high: self.consecutive_high,
            last_low_grant: self.last_low_grant,
        }
    }

    /// Adopts the state the workers share (before a decision in a shared pool).
    pub fn set_shared(&mut self, s: SharedSelector) {
        self.credit = [s.credit_high, -s.credit_high];
        self.consecutive_high = s.consecutive_high;
        self.last_low_grant = s.last_low_grant;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(cfg: &SelectorConfig, s: &mut Selector, n: usize, now: Millis) -> String {
        (0..n)
            .map(|_| {
                let c = s.choose(cfg, true, Some(now), now).unwrap();
                s.commit(cfg, c, c.class(), true, now);
                match c.class() {
                    Priority::High => 'H',
                    Priority::Low => 'L',
                }
            })
            .collect()
    }

    #[test]
    fn seven_to_three_is_smooth_and_exact() {
        let cfg = SelectorConfig::default();
        let mut s = Selector::new();
        assert_eq!(run(&cfg, &mut s, 10, 0), "HLHHHLHHLH");
        assert_eq!(run(&cfg, &mut s, 10, 0), "HLHHHLHHLH");
    }

    #[test]
    fn strict_forces_one_low_per_twenty_highs() {
        let cfg = SelectorConfig {
            policy: Policy::Strict,
            ..SelectorConfig::default()
        };
        let mut s = Selector::new();
        let seq = run(&cfg, &mut s, 42, 0);
        assert_eq!(seq, format!("{}L{}L", "H".repeat(20), "H".repeat(20)));
    }

    #[test]
    fn wait_bound_forces_one_low_then_restarts() {
        let cfg = SelectorConfig {
            policy: Policy::Strict,
            ..SelectorConfig::default()
        };
        let mut s = Selector::new();
        let oldest = Some(1_000);
        assert_eq!(
            s.choose(&cfg, true, oldest, 5_999),
            Some(Choice::Policy(Priority::High))
        );
        let c = s.choose(&cfg, true, oldest, 6_000).unwrap();
        assert_eq!(c, Choice::Forced);
        s.commit(&cfg, c, Priority::Low, true, 6_000);
        // the bound restarts from the forced grant, not from the old arrival
        assert_eq!(
            s.choose(&cfg, true, oldest, 6_001),
            Some(Choice::Policy(Priority::High))
        );
        assert_eq!(s.choose(&cfg, true, oldest, 11_000), Some(Choice::Forced));
    }

    #[test]
    fn a_lone_class_builds_no_credit() {
        let cfg = SelectorConfig::default();
        let mut s = Selector::new();
        for _ in 0..50 {
            let c = s.choose(&cfg, true, None, 0).unwrap();
            assert_eq!(c, Choice::Alone(Priority::High));
            s.commit(&cfg, c, Priority::High, false, 0);
        }
        assert_eq!(run(&cfg, &mut s, 10, 0), "HLHHHLHHLH");
    }
}
