//! `affinity`: consistent hashing with bounded loads (SPEC §15).
//!
//! The technique is Mirrokni, Thorup and Zadimoghaddam, "Consistent Hashing with Bounded
//! Loads" (SODA 2018; arXiv 1608.01350, 2016), as HAProxy (`hash-balance-factor`) and Vimeo's
//! video edge use it: each instance owns [`VNODES`] points on a `u64` ring; a request's key
//! goes to the first instance clockwise from the key whose load is below the capacity
//! `ceil((1 + ε) · (total load + 1) / n)`, else on to the next instance on the ring. Requests
//! sharing a prompt prefix or a session so land where the backend's prefix (KV) cache already
//! holds them, while no instance carries more than `(1 + ε)` times the average.
//!
//! - **Ring.** An instance's points are the first [`VNODES`] outputs of SplitMix64 seeded with
//!   its *stable id* (a hash of its name, given by the caller), not its index: indexes are
//!   reused by reloads, names are what an operator keeps. Adding or removing an instance
//!   moves only the keys whose first choice it is (the consistent-hashing property).
//! - **Members.** Instances in the config (not removed) are on the ring. An ejected instance
//!   keeps its points (its keys come back to it once it is restored) but takes no traffic and
//!   does not count in `n`; its keys spill to the next instance meanwhile.
//! - **Load** is the count the paper balances: requests in flight from this pool plus those a
//!   vLLM backend reports waiting (see `Instance::active`), unweighted by `max_concurrency`
//!   (the paper's balls and bins; HAProxy weights by server weight instead — not taken, since
//!   the instances that share a prefix cache are the identical replicas of one model).
//! - **Skipped like any other**: an instance that is full, half-open without a permit,
//!   cooling, or already tried by this request is passed over. When no candidate is under
//!   the bound (they are all the overloaded ones), the least loaded candidate takes the
//!   request rather than letting a free slot idle (SPEC §2: queueing only at saturation).
//!
//! Alternatives not taken: rendezvous (HRW) hashing — O(n) hashes per request and no load
//! bound of its own; plain consistent hashing — a hot prefix (one problem at half the
//! traffic) would pile onto one instance; Maglev tables — equally consistent, but a rebuild
//! per reload and no bound either.

use crate::rng::SplitMix64;
use crate::types::Affinity;

/// Points per instance on the ring (ketama's 160): with 4 instances the largest arc share is
/// within about ±15 % of a quarter.
pub const VNODES: usize = 160;

/// The ring: every member's points, sorted.
#[derive(Clone, Debug, Default)]
pub struct HashRing {
    /// (point, instance index), sorted by point (then index, for a total order).
    points: Vec<(u64, u32)>,
    /// Bit set of the instances on the ring.
    members: u64,
}

impl HashRing {
    /// A ring of `(index, stable id)` members.
    pub fn new(members: impl IntoIterator<Item = (usize, u64)>) -> Self {
        let mut points = Vec::new();
        let mut mask = 0u64;
        for (index, id) in members {
            debug_assert!(index < 64, "instance index {index} beyond the 64-bit sets");
            mask |= 1 << index;
            let mut rng = SplitMix64::new(id);
            points.extend((0..VNODES).map(|_| (rng.next_u64(), index as u32)));
        }
        points.sort_unstable();
        Self {
            points,
            members: mask,
        }
    }

    pub fn members(&self) -> u64 {
        self.members
    }

    /// The distinct instances clockwise from `key`: its first choice, then where it spills,
    /// in order. Empty for an empty ring.
    pub fn successors(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|&(p, _)| p < key);
        let (before, after) = self.points.split_at(start);
        let mut points = after.iter().chain(before);
        let mut seen = 0u64;
        let all = self.members;
        std::iter::from_fn(move || {
            // Stops as soon as every member was yielded: a walk rarely reads many points.
            while seen != all {
                let &(_, i) = points.next()?;
                let bit = 1u64 << i;
                if seen & bit == 0 {
                    seen |= bit;
                    return Some(i as usize);
                }
            }
            None
        })
    }

    /// The key's first-choice instance.
    pub fn first(&self, key: u64) -> Option<usize> {
        self.successors(key).next()
    }
}

/// Mirrokni et al.: "the capacity of each bin is ⌈c·m/n⌉" with `c = 1 + ε` and `m` the balls
/// including the one being placed. `epsilon_permille` is ε in thousandths (exact integer
/// arithmetic, mirrored by the Python reference model).
pub fn capacity(total_load: u64, members: u64, epsilon_permille: u32) -> u64 {
    debug_assert!(members > 0, "capacity of an empty pool");
    let num = (1000 + u128::from(epsilon_permille)) * (u128::from(total_load) + 1);
    let den = 1000 * u128::from(members.max(1));
    num.div_ceil(den) as u64
}

/// Places a request with `key` on the ring: the first candidate clockwise whose load is below
/// `cap`, else the least loaded candidate (the first along the ring among equals). Returns the
/// instance and whether it is the key's first choice.
pub fn place(
    ring: &HashRing,
    key: u64,
    cap: u64,
    candidate: impl Fn(usize) -> bool,
    load: impl Fn(usize) -> u64,
) -> Option<(usize, Affinity)> {
    let mut first = None;
    let mut fallback: Option<(usize, u64)> = None;
    for i in ring.successors(key) {
        let first_choice = *first.get_or_insert(i);
        if !candidate(i) {
            continue;
        }
        let l = load(i);
        let label = if i == first_choice {
            Affinity::Hit
        } else {
            Affinity::Spill
        };
        // Mirrokni et al.: "a ball is placed in the first bin, in the order of the ring, that
        // has not reached its capacity".
        if l < cap {
            return Some((i, label));
        }
        if fallback.is_none_or(|(_, b)| l < b) {
            fallback = Some((i, l));
        }
    }
    let (i, _) = fallback?;
    Some((
        i,
        if Some(i) == first {
            Affinity::Hit
        } else {
            Affinity::Spill
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ring(ids: &[u64]) -> HashRing {
        HashRing::new(ids.iter().copied().enumerate())
    }

    #[test]
    fn capacity_counts_the_request_being_placed() {
        // ceil(1.25 * (0 + 1) / 4) = 1: an idle pool takes one per instance before spilling
        assert_eq!(capacity(0, 4, 250), 1);
        // ceil(1.25 * 8 / 4) = 3
        assert_eq!(capacity(7, 4, 250), 3);
        // ε = 0: the plain ceiling of the average
        assert_eq!(capacity(7, 4, 0), 2);
        assert_eq!(
            capacity(u64::from(u32::MAX) * 64, 1, 10_000),
            3_023_656_975_691
        );
    }

    #[test]
    fn successors_visit_every_member_once() {
        let r = ring(&[11, 22, 33, 44]);
        for key in [0, 1, u64::MAX, 0x8000_0000_0000_0000, 12_345] {
            let mut order: Vec<_> = r.successors(key).collect();
            assert_eq!(order.len(), 4);
            order.sort_unstable();
            assert_eq!(order, vec![0, 1, 2, 3]);
        }
        assert_eq!(HashRing::default().first(7), None);
    }

    #[test]
    fn removing_an_instance_moves_only_its_keys() {
        let before = ring(&[11, 22, 33, 44]);
        let after = HashRing::new([(0, 11), (1, 22), (3, 44)]);
        let mut rng = SplitMix64::new(5);
        for _ in 0..2_000 {
            let key = rng.next_u64();
            let (was, now) = (before.first(key).unwrap(), after.first(key).unwrap());
            if was != 2 {
                assert_eq!(was, now, "key {key} moved without its instance leaving");
            }
        }
    }

    #[test]
    fn keys_spread_over_instances() {
        let r = ring(&[1, 2, 3, 4]);
        let mut counts = [0u32; 4];
        let mut rng = SplitMix64::new(9);
        for _ in 0..40_000 {
            counts[r.first(rng.next_u64()).unwrap()] += 1;
        }
        for c in counts {
            assert!((7_000..13_000).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn place_spills_along_the_ring_past_a_full_first_choice() {
        let r = ring(&[1, 2, 3]);
        let key = 42;
        let order: Vec<_> = r.successors(key).collect();
        let loads = |i: usize| if i == order[0] { 5 } else { 0 };
        assert_eq!(
            place(&r, key, 3, |_| true, loads),
            Some((order[1], Affinity::Spill))
        );
        assert_eq!(
            place(&r, key, 6, |_| true, loads),
            Some((order[0], Affinity::Hit))
        );
        // every candidate over the bound: the least loaded takes it
        let heavy = |i: usize| if i == order[2] { 7 } else { 9 };
        assert_eq!(
            place(&r, key, 3, |i| i != order[1], heavy),
            Some((order[2], Affinity::Spill))
        );
        assert_eq!(place(&r, key, 3, |_| false, loads), None);
    }
}
