//! Which instance a granted slot goes to (SPEC §5).
//!
//! Measure and policy are kept apart, as in tower: [`Load`] says how busy an instance is,
//! the [`Balancer`] policies only compare loads.
//!
//! **Load** (SPEC §5, §15 "Backend load"): `(in_flight + waiting) / max_concurrency`, where
//! `in_flight` counts this pool's attempts on the instance and `waiting` the requests a vLLM
//! backend reports queued (`vllm:num_requests_waiting`, read each probe interval; 0 for other
//! providers). Equal ratios are told apart by the backend's KV-cache usage
//! (`vllm:gpu_cache_usage_perc`, lower first): a fuller cache preempts sooner. A backend's
//! own queue so counts against it in `least_connections`, `p2c` and `affinity`;
//! `round_robin` and `random` ignore load by definition.
//!
//! - `least_connections` (default): the lowest `in_flight / max_concurrency`; the scan starts
//!   at a rotating cursor and keeps the first of equals, so equal instances share evenly.
//!   Chosen because LLM requests vary 10× in cost (a 2 s syntax check against a 30 s proof),
//!   and in-flight count tracks that cost where round-robin cannot (the seed article, §4).
//! - `round_robin`: the next candidate after the cursor.
//! - `random`: a uniform candidate.
//! - `p2c`: power of two choices (Mitzenmacher 2001; Envoy's and Finagle's least-request
//!   default): two distinct uniform candidates, the less loaded wins, the first on a tie.
//!   Kept for comparison in benchmarks; with a handful of instances a full scan is as cheap.
//! - `affinity`: consistent hashing with bounded loads on the request's key (see
//!   `affinity.rs`, placed by the pool); a request without a key goes as `least_connections`.
//! - `predicted` (SPEC §17): the lowest predicted latency (`pick_scored`, scores from each
//!   instance's latency model, see `latency.rs` and the pool). While some candidate's model
//!   has never been calibrated, `least_connections` (the warm-up). A candidate whose model is
//!   not calibrated now (too few recent samples, or its p90 band off) still scores, and is explored
//!   one decision in `EXPLORE` by least connections among such candidates: an instance that
//!   got no traffic for minutes loses its calibration (its samples decay) and wins samples
//!   back this way, so a stale model cannot starve it for good.

use std::cmp::Ordering;

use crate::rng::SplitMix64;
use crate::types::BalancerKind;

/// `predicted` explores its uncalibrated candidates one decision in this many (llm-d explores
/// 1 %: with requests seconds long an instance would need minutes to calibrate again).
pub const EXPLORE: usize = 16;

/// How busy an instance is: `active / capacity` (compared exactly by cross-multiplying), then
/// the backend's KV-cache usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Load {
    /// Requests on the instance: in flight from this pool plus waiting at the backend
    /// (saturating; a `u32`, so the cross-multiplication below stays in a `u64`).
    pub active: u32,
    /// Its `max_concurrency`.
    pub capacity: u32,
    /// The backend's KV-cache usage in thousandths (0 when unknown).
    pub cache_permille: u16,
}

impl Ord for Load {
    fn cmp(&self, other: &Self) -> Ordering {
        let a = u64::from(self.active) * u64::from(other.capacity.max(1));
        let b = u64::from(other.active) * u64::from(self.capacity.max(1));
        a.cmp(&b)
            .then_with(|| self.cache_permille.cmp(&other.cache_permille))
    }
}

impl PartialOrd for Load {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

#[derive(Clone, Debug)]
pub struct Balancer {
    pub kind: BalancerKind,
    cursor: usize,
    rng: SplitMix64,
}

impl Balancer {
    pub fn new(kind: BalancerKind, seed: u64) -> Self {
        Self {
            kind,
            cursor: 0,
            rng: SplitMix64::new(seed),
        }
    }

    /// Picks among the `n` instances those `candidate` accepts (eligible, free slot, not
    /// excluded); `None` when there is none.
    pub fn pick(
        &mut self,
        n: usize,
        candidate: impl Fn(usize) -> bool,
        load: impl Fn(usize) -> Load,
    ) -> Option<usize> {
        if n == 0 {
            return None;
        }
        let rotated = |cursor: usize| (0..n).map(move |k| (cursor + k) % n);
        let chosen = match self.kind {
            // `Affinity` comes here only for requests without a key; `Predicted` only while no
            // model is calibrated.
            BalancerKind::LeastConnections | BalancerKind::Affinity | BalancerKind::Predicted => {
                let mut best: Option<(usize, Load)> = None;
                for i in rotated(self.cursor).filter(|&i| candidate(i)) {
                    let l = load(i);
                    if best.is_none_or(|(_, b)| l < b) {
                        best = Some((i, l));
                    }
                }
                best.map(|(i, _)| i)
            }
            BalancerKind::RoundRobin => rotated(self.cursor).find(|&i| candidate(i)),
            BalancerKind::Random => {
                let count = (0..n).filter(|&i| candidate(i)).count();
                if count == 0 {
                    None
                } else {
                    let r = self.rng.below(count);
                    (0..n).filter(|&i| candidate(i)).nth(r)
                }
            }
            BalancerKind::P2c => {
                let count = (0..n).filter(|&i| candidate(i)).count();
                match count {
                    0 => None,
                    1 => (0..n).find(|&i| candidate(i)),
                    _ => {
                        let a = self.rng.below(count);
                        let mut b = self.rng.below(count - 1);
                        if b >= a {
                            b += 1;
                        }
                        let nth = |k| (0..n).filter(|&i| candidate(i)).nth(k).expect("k < count");
                        let (ia, ib) = (nth(a), nth(b));
                        Some(if load(ib) < load(ia) { ib } else { ia })
                    }
                }
            }
        };
        if let Some(i) = chosen {
            self.cursor = (i + 1) % n;
        }
        chosen
    }
}

impl Balancer {
    /// SPEC §17: the candidate with the lowest `score` (ties: the first after the cursor). If
    /// some candidate has no score (its model was never calibrated), least connections among all;
    /// else, one time in `EXPLORE` while some candidate is `unsure`, least connections among
    /// those.
    pub fn pick_scored(
        &mut self,
        n: usize,
        candidate: impl Fn(usize) -> bool,
        score: impl Fn(usize) -> Option<f64>,
        unsure: impl Fn(usize) -> bool,
        load: impl Fn(usize) -> Load,
    ) -> Option<usize> {
        if n == 0 {
            return None;
        }
        let mut best: Option<(usize, f64)> = None;
        let mut least: Option<(usize, Load)> = None;
        let mut unknown = false;
        let mut doubtful = 0u64;
        // Drawn first, so `unsure` (an `exp` per candidate) is asked only when exploring.
        let explore = self.rng.below(EXPLORE) == 0;
        for k in 0..n {
            let i = (self.cursor + k) % n;
            if !candidate(i) {
                continue;
            }
            let l = load(i);
            if least.is_none_or(|(_, b)| l < b) {
                least = Some((i, l));
            }
            if unknown {
                continue;
            }
            match score(i) {
                Some(s) => {
                    if best.is_none_or(|(_, b)| s < b) {
                        best = Some((i, s));
                    }
                    if explore && unsure(i) {
                        doubtful |= 1 << i;
                    }
                }
                None => unknown = true,
            }
        }
        let chosen = if unknown {
            least.map(|(i, _)| i)
        } else if doubtful != 0 {
            let mut least: Option<(usize, Load)> = None;
            for k in 0..n {
                let i = (self.cursor + k) % n;
                if doubtful & (1 << i) != 0 {
                    let l = load(i);
                    if least.is_none_or(|(_, b)| l < b) {
                        least = Some((i, l));
                    }
                }
            }
            least.map(|(i, _)| i)
        } else {
            best.map(|(i, _)| i)
        };
        if let Some(i) = chosen {
            self.cursor = (i + 1) % n;
        }
        chosen
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(v: &[(u32, u32)]) -> impl Fn(usize) -> Load + '_ {
        move |i| Load {
            active: v[i].0,
            capacity: v[i].1,
            cache_permille: 0,
        }
    }

    #[test]
    fn least_connections_compares_ratios() {
        let mut b = Balancer::new(BalancerKind::LeastConnections, 1);
        // 3/16 < 1/4
        let v = [(1, 4), (3, 16)];
        assert_eq!(b.pick(2, |_| true, loads(&v)), Some(1));
    }

    #[test]
    fn cache_usage_breaks_ties_of_equal_ratios() {
        let mut b = Balancer::new(BalancerKind::LeastConnections, 1);
        let v = [
            Load {
                active: 2,
                capacity: 4,
                cache_permille: 900,
            },
            Load {
                active: 1,
                capacity: 2,
                cache_permille: 300,
            },
            Load {
                active: 3,
                capacity: 4,
                cache_permille: 0,
            },
        ];
        for _ in 0..3 {
            assert_eq!(b.pick(3, |_| true, |i| v[i]), Some(1));
        }
    }

    #[test]
    fn least_connections_ties_rotate() {
        let mut b = Balancer::new(BalancerKind::LeastConnections, 1);
        let v = [(0, 4), (0, 4), (0, 4)];
        let picks: Vec<_> = (0..6)
            .map(|_| b.pick(3, |_| true, loads(&v)).unwrap())
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn candidates_are_respected_by_every_policy() {
        for kind in [
            BalancerKind::LeastConnections,
            BalancerKind::RoundRobin,
            BalancerKind::Random,
            BalancerKind::P2c,
            BalancerKind::Affinity,
            BalancerKind::Predicted,
        ] {
            let mut b = Balancer::new(kind, 7);
            let v = [(0, 1), (5, 9), (0, 1), (1, 2)];
            for _ in 0..50 {
                let i = b.pick(4, |i| i % 2 == 1, loads(&v)).unwrap();
                assert!(i % 2 == 1, "{kind:?} picked {i}");
            }
            assert_eq!(b.pick(4, |_| false, loads(&v)), None);
        }
    }

    #[test]
    fn scored_picks_the_lowest_unless_a_candidate_is_unknown() {
        let mut b = Balancer::new(BalancerKind::Predicted, 7);
        let v = [(3, 4), (2, 4), (1, 4)];
        let known = |i: usize| [Some(50.0), Some(5.0), Some(9.0)][i];
        let sure = |_| false;
        for _ in 0..5 {
            assert_eq!(b.pick_scored(3, |_| true, known, sure, loads(&v)), Some(1));
        }
        // instance 2 has no sample yet: least connections over all, until it has
        let partly = |i: usize| [Some(50.0), Some(5.0), None][i];
        assert_eq!(b.pick_scored(3, |_| true, partly, sure, loads(&v)), Some(2));
        // ... but only among candidates
        assert_eq!(
            b.pick_scored(3, |i| i != 2, partly, sure, loads(&v)),
            Some(1)
        );
    }

    #[test]
    fn an_unsure_candidate_is_explored_now_and_then() {
        let mut b = Balancer::new(BalancerKind::Predicted, 7);
        let v = [(0, 4), (0, 4)];
        let score = |i: usize| [Some(50.0), Some(5.0)][i];
        let picks: Vec<_> = (0..1600)
            .map(|_| {
                b.pick_scored(2, |_| true, score, |i| i == 0, loads(&v))
                    .unwrap()
            })
            .collect();
        let explored = picks.iter().filter(|&&i| i == 0).count();
        assert!((50..=150).contains(&explored), "{explored}");
    }
}
