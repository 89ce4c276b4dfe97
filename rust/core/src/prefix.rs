//! `prefix`: cache-aware placement by the longest shared prefix (SPEC §15).
//!
//! SPEC §15: "the rendered prompt is cut into blocks, each block's hash chained to the
//! previous one (as vLLM hashes its KV blocks), and the gateway remembers, per instance and
//! bounded by that instance's cache size, which blocks it sent there; a new prefix goes by
//! consistent hashing of its first block, so workers and replicas agree."
//!
//! - **Blocks** ([`chain_hashes`]): the prompt's UTF-8 bytes in full blocks of `block_bytes`
//!   (a trailing partial block is ignored, as vLLM caches full blocks only); block `k`'s hash
//!   is seeded with block `k − 1`'s, so equal hashes at position `k` mean equal prompts up to
//!   the end of block `k`. The hash is a 128-bit multiply-fold over 16-byte words (wyhash's
//!   `mum`), stable across processes, machines and releases of this crate (a test pins it):
//!   workers and replicas compute the same blocks.
//! - **Index** ([`PrefixIndex`]): per instance, the blocks recently sent there, bounded by
//!   that instance's cache size `C` with two generations: blocks go into the current one;
//!   when it holds `C`, the previous one is dropped and the current one becomes the
//!   previous. An instance so *holds* at least the last `C` and at most `2C` distinct blocks
//!   it was sent (an LRU of `C`, without timestamps, that errs on remembering: a block the
//!   backend evicted costs a request that goes there what it costs anywhere — the prefill —
//!   but a run the index forgot sends the request away from the one instance that holds it;
//!   with generations of `C/2`, under `C`, a conversation silent for 1-2 s was often
//!   forgotten while its backend still held it, and went back to the ring's instance: chats
//!   of 2-8 turns (D) lost 6 of the 62 points of cached share they reach now). A pool-wide
//!   map keeps, per block, the bit set of the instances holding it, so one lookup answers for
//!   every instance.
//! - **Prefix closure.** A request's blocks are recorded tail first, so its head is never
//!   older than its tail: an instance holding block `k` of a prompt holds blocks `1..k` too
//!   (block `k`'s hash implies them). The holders of a prompt's blocks then shrink
//!   monotonically along the prompt, and [`PrefixIndex::matches`] finds every instance's
//!   longest held run by bisection over the points where that set changes: `O(d log m)`
//!   lookups for `d` distinct lengths over `m` blocks (a cold prompt: one lookup).
//! - **Placement** ([`place`]): the instance holding the longest leading run ranks first;
//!   ties in the ring's order from the first block not every instance holds (the order the
//!   prefix's first request was placed in), or, once every instance holds the run, from the
//!   first block none holds. A new prefix goes by the ring of its first block; a new problem
//!   behind a short shared head by the ring of its first block after the head (the spread
//!   rule). The bounded-load rule of `affinity.rs` then applies along that ranking.
//!
//! Alternatives not taken: a radix tree of characters (SGLang's router) — pointers cannot
//! live in a shared region and eviction sweeps the tree; scoring by the matched *share* of the
//! prompt (SGLang's 0.3 threshold) — a 600-character problem in a 4 KB prompt is 0.15 of it
//! yet saves its whole prefill; a timestamp LRU per block — a heap or a sweep per eviction,
//! where two generations cost one set swap per `C` blocks.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::affinity::HashRing;
use crate::types::Affinity;

/// Upper bound on `block_bytes` and on the blocks of one prompt (the config validates).
pub const MAX_BLOCK_BYTES: usize = 4096;
pub const MAX_BLOCKS: usize = 4096;

const P0: u64 = 0xa076_1d64_78bd_642f;
const P1: u64 = 0xe703_7ed1_a0b4_28db;
const P2: u64 = 0x8ebc_6af0_9c88_c6e3;

#[inline]
fn mum(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

#[inline]
fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

/// The hash of one block seeded with the previous block's (`block.len()` a multiple of 16).
/// Its 16-byte words are folded independently (each salted with the seed and its position),
/// so a CPU overlaps them: only the blocks are a chain.
#[inline]
pub fn block_hash(block: &[u8], seed: u64) -> u64 {
    let mut acc = seed ^ P0;
    let mut salt = seed;
    for w in block.chunks_exact(16) {
        salt = salt.wrapping_add(P1);
        acc ^= mum(
            word(&w[..8]) ^ salt.rotate_left(23) ^ P2,
            word(&w[8..]) ^ salt,
        );
    }
    // 0 is "no key" to the pool: never produced (the one colliding value moves to 1).
    mum(acc ^ P2, block.len() as u64 ^ seed ^ P1).max(1)
}

/// SPEC §15: the chained hashes of the full `block_bytes` blocks of `text`, at most
/// `max_blocks`, into `out` (cleared first). `seed` is h₀ (the model and `hash_seed`).
/// `block_bytes` must be a positive multiple of 16.
pub fn chain_hashes(
    text: &[u8],
    block_bytes: usize,
    max_blocks: usize,
    seed: u64,
    out: &mut Vec<u64>,
) {
    debug_assert!(
        block_bytes >= 16 && block_bytes.is_multiple_of(16),
        "block_bytes {block_bytes}"
    );
    out.clear();
    let mut h = seed;
    for block in text.chunks_exact(block_bytes).take(max_blocks) {
        h = block_hash(block, h);
        out.push(h);
    }
}

/// Block hashes are already uniform: the maps use them as they are.
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type Id = BuildHasherDefault<IdHasher>;

/// One instance's two generations (see the module doc).
#[derive(Clone, Debug, Default)]
struct Slot {
    /// The blocks first recorded in the current and the previous generation, in order (each
    /// once per generation: the holders map tells which generation last saw a block).
    current: Vec<u64>,
    previous: Vec<u64>,
    /// The current generation's parity (the `parity` bits of the blocks it recorded).
    parity: bool,
    /// `C`: the blocks its backend can cache (the index holds between `C` and `2C`).
    capacity: usize,
    /// Distinct blocks held (`current ∪ previous`).
    held: usize,
    /// Generations dropped since the start (for `/admin/state`).
    rotations: u64,
}

/// Who holds a block, and who was also sent a block after it (a continuation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub by: u64,
    pub continued: u64,
    /// Per instance, the parity of the generation that last recorded the block there.
    parity: u64,
}

/// Per instance, the blocks recently sent there; per block, who holds it.
#[derive(Clone, Debug, Default)]
pub struct PrefixIndex {
    holders: HashMap<u64, Held, Id>,
    slots: Vec<Slot>,
    /// `C` of an instance first seen.
    default_capacity: usize,
}

impl PrefixIndex {
    pub fn new(default_capacity: usize) -> Self {
        Self {
            default_capacity: default_capacity.max(2),
            ..Self::default()
        }
    }

    fn slot(&mut self, inst: usize) -> &mut Slot {
        if inst >= self.slots.len() {
            let capacity = self.default_capacity;
            self.slots.resize_with(inst + 1, || Slot {
                capacity,
                ..Slot::default()
            });
        }
        &mut self.slots[inst]
    }

    /// Sets every instance's `C` (a reload); an index over its new bound shrinks as it rotates.
    pub fn set_capacity(&mut self, capacity: usize) {
        self.default_capacity = capacity.max(2);
        for s in &mut self.slots {
            s.capacity = self.default_capacity;
        }
    }

    /// Sets one instance's `C` (e.g. from its backend's reported cache size).
    pub fn set_instance_capacity(&mut self, inst: usize, capacity: usize) {
        self.slot(inst).capacity = capacity.max(2);
    }

    /// Distinct blocks the index holds for `inst`.
    pub fn held(&self, inst: usize) -> usize {
        self.slots.get(inst).map_or(0, |s| s.held)
    }

    /// `(held, capacity, rotations)` of `inst`.
    pub fn stats(&self, inst: usize) -> (usize, usize, u64) {
        self.slots
            .get(inst)
            .map_or((0, self.default_capacity, 0), |s| {
                (s.held, s.capacity, s.rotations)
            })
    }

    /// Who holds `block` (a bit per instance).
    #[inline]
    pub fn holders(&self, block: u64) -> u64 {
        self.holders.get(&block).map_or(0, |h| h.by)
    }

    /// Who holds `block` followed by some block (a bit per instance): there, a prompt that
    /// continues differently branches off what the instance was sent.
    #[inline]
    pub fn continued(&self, block: u64) -> u64 {
        self.holders.get(&block).map_or(0, |h| h.continued)
    }

    /// The request's `blocks` were sent to `inst`: tail first, so that its head is never
    /// older than its tail (prefix closure, see the module doc). One map lookup per block,
    /// up to the first block this generation already holds.
    pub fn record(&mut self, inst: usize, blocks: &[u64]) {
        debug_assert!(inst < 64);
        let bit = 1u64 << inst;
        self.slot(inst);
        // Whether the block after this one became held by `inst` just now (its parent is
        // then continued there).
        let mut new_child = false;
        for &b in blocks.iter().rev() {
            let Self { holders, slots, .. } = self;
            let s = &mut slots[inst];
            let now = if s.parity { bit } else { 0 };
            let m = holders.entry(b).or_default();
            if new_child {
                m.continued |= bit;
            }
            new_child = m.by & bit == 0;
            if !new_child && m.parity & bit == now {
                // Recorded in this generation already, and so is every block before it (they
                // were recorded after it, tail first, in this generation or none newer).
                break;
            }
            m.by |= bit;
            m.parity = (m.parity & !bit) | now;
            s.held += usize::from(new_child);
            s.current.push(b);
            if s.current.len() >= s.capacity {
                Self::rotate(holders, s, bit);
            }
        }
    }

    /// Drops the previous generation (its blocks not recorded again since); the current one
    /// becomes the previous.
    fn rotate(holders: &mut HashMap<u64, Held, Id>, s: &mut Slot, bit: u64) {
        let dropped = if s.parity { 0 } else { bit };
        for &b in &s.previous {
            if let Some(m) = holders.get_mut(&b) {
                if m.by & bit != 0 && m.parity & bit == dropped {
                    m.by &= !bit;
                    m.continued &= !bit;
                    s.held -= 1;
                    if m.by == 0 {
                        holders.remove(&b);
                    }
                }
            }
        }
        // The dropped log keeps its allocation for the next generation.
        std::mem::swap(&mut s.previous, &mut s.current);
        s.current.clear();
        s.parity = !s.parity;
        s.rotations += 1;
    }

    /// Forgets everything `inst` held (its slot is reused, or its backend lost its cache).
    pub fn forget(&mut self, inst: usize) {
        if inst >= self.slots.len() {
            return;
        }
        let bit = 1u64 << inst;
        let s = &mut self.slots[inst];
        for b in s.current.drain(..).chain(s.previous.drain(..)) {
            if let Some(m) = self.holders.get_mut(&b) {
                m.by &= !bit;
                m.continued &= !bit;
                if m.by == 0 {
                    self.holders.remove(&b);
                }
            }
        }
        s.held = 0;
    }

    /// Whether `blocks` leave their longest held run (`longest` blocks, held by the instances
    /// whose `lens` equal it) where one of those instances was sent another continuation.
    pub fn branches(&self, blocks: &[u64], lens: &[u32; 64], longest: u32) -> bool {
        let Some(&last) = blocks.get((longest as usize).wrapping_sub(1)) else {
            return false;
        };
        let best = lens
            .iter()
            .enumerate()
            .filter(|&(_, &l)| l == longest)
            .fold(0u64, |m, (i, _)| m | 1 << i);
        self.continued(last) & best != 0
    }

    /// Every instance's longest leading run of `blocks` it holds, into `lens` (by index);
    /// only the instances in `members` are counted. Returns the longest.
    pub fn matches(&self, blocks: &[u64], members: u64, lens: &mut [u32; 64]) -> u32 {
        *lens = [0; 64];
        let n = blocks.len();
        if n == 0 || self.holders.is_empty() {
            return 0;
        }
        let at = |k: usize| self.holders(blocks[k]) & members;
        let first = at(0);
        if first == 0 {
            return 0;
        }
        let last = if n == 1 { first } else { at(n - 1) };
        self.bisect(&at, (0, first), (n - 1, last), lens);
        lens.iter().copied().max().unwrap_or(0)
    }

    /// The holder sets of positions `lo..=hi` shrink from `mlo` to `mhi`: every instance in
    /// a set at position `k` holds at least `k + 1` blocks.
    fn bisect(
        &self,
        at: &impl Fn(usize) -> u64,
        (lo, mlo): (usize, u64),
        (hi, mhi): (usize, u64),
        lens: &mut [u32; 64],
    ) {
        let mut credit = |mask: u64, k: usize| {
            let mut m = mask;
            while m != 0 {
                let i = m.trailing_zeros() as usize;
                lens[i] = lens[i].max(k as u32 + 1);
                m &= m - 1;
            }
        };
        if mlo == mhi || hi <= lo + 1 {
            credit(mlo, lo);
            credit(mhi, hi);
            return;
        }
        let mid = lo + (hi - lo) / 2;
        let mm = at(mid);
        self.bisect(at, (lo, mlo), (mid, mm), lens);
        self.bisect(at, (mid, mm), (hi, mhi), lens);
    }
}

/// The spread rule: a lead of the best-matching instance over the new prefix's ring choice
/// counts only if it saves at least this share of the prefill the request brings anyway
/// (its blocks nobody holds), in quarters: `lead × 4 ≥ new`.
const SPREAD_QUARTERS: u64 = 4;

/// SPEC §15: places a request by its `blocks` (see the module doc). `lens` are the
/// instances' matched runs from [`PrefixIndex::matches`], `longest` their maximum;
/// `branches` whether the request leaves the longest run where an instance holding it was
/// sent another continuation ([`PrefixIndex::branches`]). Returns the instance, `Hit` for
/// the first ranked and `Spill` for a later one, and the blocks the chosen instance holds.
#[allow(clippy::too_many_arguments)]
pub fn place(
    ring: &HashRing,
    blocks: &[u64],
    lens: &[u32; 64],
    longest: u32,
    branches: bool,
    cap: u64,
    candidate: impl Fn(usize) -> bool,
    load: impl Fn(usize) -> u64,
) -> Option<(usize, Affinity, u32)> {
    let m = blocks.len();
    debug_assert!(m > 0);
    // The ring key: the first block no instance holds (a new prefix: its first block), so
    // distinct continuations of a shared head (problems under one system prompt) spread.
    let key = blocks[(longest as usize).min(m - 1)];
    // (matched blocks, tie rank, instance), in the ring's order from `key`.
    let mut order = [(0u32, 0u8, 0u8); 64];
    let mut n = 0;
    for i in ring.successors(key) {
        order[n] = (lens[i], 0, i as u8);
        n += 1;
    }
    let order = &mut order[..n];
    let home = order.first()?.0;
    // The spread rule: without it, a short shared head (a 300-character instruction sent to
    // one instance so far) pulls every new problem to that instance, and an idle pool never
    // spreads: one instance's cache for the whole workload. Moving to the ring's choice
    // instead costs recomputing the lead, at most a quarter of the new blocks the request
    // computes anyway; the next request of the same problem then finds it there. Only at a
    // branch (the instance was sent another continuation of the run: a head that several
    // prompts share): a conversation's next turn continues its history, never branches, and
    // stays where its history is.
    let new_blocks = (m as u64).saturating_sub(u64::from(longest));
    if branches && u64::from(longest - home) * SPREAD_QUARTERS < new_blocks {
        for e in order.iter_mut() {
            e.0 = e.0.min(home);
        }
    } else if longest > 0 {
        // Ties among the instances holding the run (and among those holding less): while
        // some instance lacks it, in the ring's order from the first block not every
        // instance holds — for a problem, its first block (or the first after a head every
        // instance holds): the order its first request was placed in. So after a spill its
        // requests go back to its first holder, a spill goes to the same next instance every
        // time, and a problem does not take cache room on every instance it ever spilled to.
        // Once every instance holds the run (a system prompt), the order from the new part
        // spreads the requests over all of them.
        let common = order.iter().map(|e| e.0).min().unwrap_or(0);
        if common < longest {
            let mut rank = [0u8; 64];
            for (r, i) in ring.successors(blocks[common as usize]).enumerate() {
                rank[i] = r as u8;
            }
            for e in order.iter_mut() {
                e.1 = rank[usize::from(e.2)];
            }
        }
    }
    // Longest run first; ties by their rank, else the ring order (a stable sort).
    order.sort_by_key(|e| (std::cmp::Reverse(e.0), e.1));
    let mut fallback: Option<(usize, u64, u32)> = None;
    let label = |rank: usize| {
        if rank == 0 {
            Affinity::Hit
        } else {
            Affinity::Spill
        }
    };
    for (rank, &(_, _, i)) in order.iter().enumerate() {
        let i = usize::from(i);
        if !candidate(i) {
            continue;
        }
        let l = load(i);
        // SPEC §15: "an instance takes an affine request only while its load is at most
        // (1 + affinity.epsilon) times the pool's average, else the next best one".
        if l < cap {
            return Some((i, label(rank), lens[i]));
        }
        if fallback.is_none_or(|(_, b, _)| l < b) {
            fallback = Some((i, l, rank as u32));
        }
    }
    let (i, _, rank) = fallback?;
    Some((i, label(rank as usize), lens[i]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(text: &str) -> Vec<u64> {
        let mut out = Vec::new();
        chain_hashes(text.as_bytes(), 16, 512, 7, &mut out);
        out
    }

    const PINNED: u64 = 0x447d_075a_7f0d_13a2;

    #[test]
    fn hashes_are_chained_and_stable() {
        let a = blocks("0123456789abcdef0123456789abcdefXYZ");
        assert_eq!(a.len(), 2, "the trailing partial block is ignored");
        let b = blocks("0123456789abcdef0123456789abcdeg");
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
        // the same second block after a different first one hashes differently
        let c = blocks("x123456789abcdef0123456789abcdef");
        assert_ne!(a[1], c[1]);
        // pinned: workers, replicas and releases must agree on these values
        let mut out = Vec::new();
        chain_hashes(&[b'a'; 64], 64, 8, 0, &mut out);
        assert_eq!(out, vec![PINNED]);
    }

    /// `cargo test -p gateway-core --release --lib hash_speed -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn hash_speed() {
        fn serial(block: &[u8], seed: u64) -> u64 {
            let mut h = seed ^ P0;
            for w in block.chunks_exact(16) {
                h = mum(word(&w[..8]) ^ P1, word(&w[8..]) ^ h);
            }
            mum(h ^ P2, block.len() as u64 ^ P1).max(1)
        }
        let text: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 26) as u8 + b'a').collect();
        for round in 0..3 {
            let t = std::time::Instant::now();
            let mut x = 0u64;
            for i in 0..100_000u64 {
                let mut h = i;
                for b in text.chunks_exact(64) {
                    h = serial(b, h);
                }
                x ^= h;
            }
            let serial_ns = t.elapsed().as_nanos() / 100_000;
            let t = std::time::Instant::now();
            let mut out = Vec::with_capacity(64);
            for i in 0..100_000u64 {
                chain_hashes(&text, 64, 512, i, &mut out);
                x ^= out[63];
            }
            let lanes_ns = t.elapsed().as_nanos() / 100_000;
            println!("round {round}: serial {serial_ns} ns, lanes {lanes_ns} ns per 4 KiB ({x})");
        }
    }

    #[test]
    fn generations_bound_what_an_instance_holds() {
        let mut ix = PrefixIndex::new(10);
        for k in 0..100u64 {
            ix.record(0, &[k + 1]);
            let held = ix.held(0);
            assert!(held <= 20, "{held}");
            // the last C blocks are always held
            for j in k.saturating_sub(9)..=k {
                assert_eq!(ix.holders(j + 1), 1, "block {j} after {k}");
            }
        }
        assert!(ix.held(0) >= 10);
        ix.forget(0);
        assert_eq!(ix.held(0), 0);
        assert!(ix.holders.is_empty());
    }

    #[test]
    fn the_index_stays_prefix_closed_under_eviction() {
        // chains over a small tree of prompts, recorded on 3 instances with small bounds
        let mut rng = crate::rng::SplitMix64::new(3);
        let mut ix = PrefixIndex::new(24);
        let chain = |rng: &mut crate::rng::SplitMix64| -> Vec<u64> {
            let len = 1 + (rng.next_u64() % 12) as usize;
            let mut h = 0u64;
            (0..len)
                .map(|_| {
                    h = block_hash(&[(rng.next_u64() % 3) as u8; 16], h);
                    h
                })
                .collect()
        };
        for _ in 0..2_000 {
            let c = chain(&mut rng);
            ix.record((rng.next_u64() % 3) as usize, &c);
            let probe = chain(&mut rng);
            for w in probe.windows(2) {
                let (a, b) = (ix.holders(w[0]), ix.holders(w[1]));
                assert_eq!(a & b, b, "block held without its predecessor");
            }
            for i in 0..3 {
                assert!(ix.held(i) <= 48);
            }
        }
    }

    #[test]
    fn a_branch_is_where_an_instance_was_sent_another_continuation() {
        let mut ix = PrefixIndex::new(1000);
        ix.record(0, &[1, 2, 3]);
        let mut lens = [0; 64];
        // a conversation's next turn continues [1, 2, 3]: no branch
        let next = [1, 2, 3, 4, 5];
        let longest = ix.matches(&next, 1, &mut lens);
        assert_eq!(longest, 3);
        assert!(!ix.branches(&next, &lens, longest));
        // another problem after the shared head [1, 2]: a branch at block 2
        let other = [1, 2, 9, 10];
        let longest = ix.matches(&other, 1, &mut lens);
        assert_eq!(longest, 2);
        assert!(ix.branches(&other, &lens, longest));
        assert!(!ix.branches(&[7, 8], &[0; 64], 0));
    }

    #[test]
    fn matches_finds_every_instances_longest_run() {
        let mut ix = PrefixIndex::new(1000);
        let p: Vec<u64> = (1..=40).collect();
        ix.record(0, &p[..10]);
        ix.record(1, &p[..25]);
        ix.record(2, &p[..3]);
        ix.record(3, &[99, 98]);
        let mut lens = [0; 64];
        assert_eq!(ix.matches(&p, 0b1111, &mut lens), 25);
        assert_eq!(&lens[..4], &[10, 25, 3, 0]);
        // members only
        assert_eq!(ix.matches(&p, 0b0101, &mut lens), 10);
        assert_eq!(&lens[..4], &[10, 0, 3, 0]);
        assert_eq!(ix.matches(&[500, 501], 0b1111, &mut lens), 0);
        assert_eq!(ix.matches(&p[..1], 0b1111, &mut lens), 1);
        assert_eq!(&lens[..4], &[1, 1, 1, 0]);
    }

    #[test]
    fn place_prefers_the_longest_run_within_the_bound() {
        let ring = HashRing::new([(0, 11), (1, 22), (2, 33)]);
        let p: Vec<u64> = (1..=40).collect();
        let mut lens = [0; 64];
        lens[1] = 30;
        lens[2] = 20;
        let got = place(&ring, &p, &lens, 30, true, 5, |_| true, |_| 0);
        assert_eq!(got, Some((1, Affinity::Hit, 30)));
        // instance 1 at the bound: the next longest
        let got = place(
            &ring,
            &p,
            &lens,
            30,
            true,
            5,
            |_| true,
            |i| if i == 1 { 5 } else { 0 },
        );
        assert_eq!(got, Some((2, Affinity::Spill, 20)));
        // a cold prompt: the ring's choice for its first block
        let cold = [0; 64];
        let first = ring.first(p[0]).unwrap();
        assert_eq!(
            place(&ring, &p, &cold, 0, false, 5, |_| true, |_| 0),
            Some((first, Affinity::Hit, 0))
        );
    }

    #[test]
    fn holders_of_a_run_tie_in_the_order_of_its_first_block() {
        let ring = HashRing::new([(0, 11), (1, 22), (2, 33), (3, 44)]);
        let held: Vec<_> = ring.successors(1).collect();
        let mut lens = [0; 64];
        lens[held[1]] = 20;
        lens[held[2]] = 20;
        // whatever follows the run, its holders rank in the ring's order from its first block
        for tail in 100..140u64 {
            let tail = tail.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let p: Vec<u64> = (1..=20).chain([tail, tail ^ 1]).collect();
            let got = place(&ring, &p, &lens, 20, false, 5, |_| true, |_| 0);
            assert_eq!(got, Some((held[1], Affinity::Hit, 20)));
        }
        // held everywhere: the new part decides, so requests spread
        let all = [20; 64];
        let homes: std::collections::HashSet<_> = (100..140u64)
            .filter_map(|tail| {
                let p: Vec<u64> = (1..=20)
                    .chain([tail.wrapping_mul(0x9e37_79b9_7f4a_7c15)])
                    .collect();
                place(&ring, &p, &all, 20, false, 5, |_| true, |_| 0).map(|g| g.0)
            })
            .collect();
        assert!(homes.len() >= 3, "{homes:?}");
    }

    #[test]
    fn a_short_shared_head_does_not_pull_new_prefixes() {
        let ring = HashRing::new([(0, 11), (1, 22), (2, 33)]);
        let p: Vec<u64> = (1..=40).collect();
        let key = p[4];
        let order: Vec<_> = ring.successors(key).collect();
        let mut lens = [0; 64];
        // the head (4 blocks) is held by a non-home instance; 36 new blocks: spread
        lens[order[1]] = 4;
        assert_eq!(
            place(&ring, &p, &lens, 4, true, 5, |_| true, |_| 0),
            Some((order[0], Affinity::Hit, 0))
        );
        // not at a branch (a conversation's short first turn): the run keeps its instance
        assert_eq!(
            place(&ring, &p, &lens, 4, false, 5, |_| true, |_| 0),
            Some((order[1], Affinity::Hit, 4))
        );
        // a long held run (a conversation's history, 12 of 16 blocks) keeps its instance
        let q = &p[..16];
        let order: Vec<_> = ring.successors(q[12]).collect();
        lens = [0; 64];
        lens[order[1]] = 12;
        let got = place(&ring, q, &lens, 12, true, 5, |_| true, |_| 0);
        assert_eq!(got, Some((order[1], Affinity::Hit, 12)));
    }
}
