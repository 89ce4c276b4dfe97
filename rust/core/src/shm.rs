//! SPEC §12: the scheduling state several worker processes share — a region of plain 64-bit
//! atomics that every worker maps (a sealed memfd the supervisor creates; mapping it is the
//! binding's business: this module sees only `&[AtomicU64]` and does no I/O).
//!
//! Rules of the region: no pointers, no locks, no `Drop`,
//! all-zero is a valid state, integers only (no `bool` or enum bit patterns are ever read back
//! as such), a header with magic, layout version and an ABI hash checked at attach. Every
//! update is one CAS (or one `fetch_*`) on one word, so a worker killed at any instruction
//! leaves every word in a state some complete operation produced, and blocks nobody.
//!
//! **Ownership in the word** (iceoryx2's `RobustUniqueIndexSet` is the model: each cell holds
//! its owner): an instance's *lease word* is split into one field per worker slot (64/F bits
//! each, F = the slot count rounded up to a power of two). A worker takes a unit by a CAS that
//! adds 1 to its own field only while the sum of all fields is below the instance's cap, and
//! gives it back by a CAS that subtracts 1. Nothing is counted outside an owner's field, so
//! when a worker dies the supervisor reclaims exactly what it held by clearing its fields —
//! nothing leaks and nothing is freed twice. Least-connections reads one word per instance.
//!
//! What else lives here, per pool: each worker's *summary* of its own waiting requests (counts
//! and oldest arrival per class, so the class selector and the starvation guard see the union),
//! the class selector's state (one packed word; smooth-WRR credits sum to zero so one credit
//! is enough), and per instance a *health word* (an ejection seen by any worker, with a
//! generation), a *probe word* (the latest active probe result, with a sequence) and a *probe
//! claim* (one probe per instance per interval across workers).
//!
//! The waiting requests themselves stay in their own worker's queue (an aiohttp handler
//! awaits each); the summaries make the decision of *which class* and *whether this worker's
//! head is the one to serve* global, and a worker that frees a unit its own queue should not
//! take wakes the peers that wait (the binding's eventfd), as in design §2's wake tokens.

#[cfg(loom)]
pub use loom::sync::atomic::AtomicU64;
#[cfg(not(loom))]
pub use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release};

use crate::types::Millis;

/// "GWSHMv01".
pub const MAGIC: u64 = 0x4757_5348_4d76_3031;
pub const LAYOUT_VERSION: u64 = 1;
/// Words per cache-line pair (128 bytes): hot words of different owners never share one.
pub const LINE: usize = 16;
pub const MAX_WORKERS: usize = 8;
pub const MAX_POOLS: usize = 32;
/// Instance slots per pool: a pool's live instances plus those a reload replaced.
pub const MAX_SLOTS: usize = 128;
/// Tenants per pool whose grants are counted for fair share across workers; more share one
/// overflow count.
pub const MAX_TENANTS: usize = 64;

// Header words.
const H_MAGIC: usize = 0;
const H_VERSION: usize = 1;
const H_ABI: usize = 2;
const H_LEN: usize = 3;
const H_WORKERS: usize = 4;

// A worker slot's line.
const W_STATE: usize = 0; // incarnation << 8 | state
const W_PID: usize = 1;
const W_HEARTBEAT: usize = 2;

// A pool's first line.
const P_ID: usize = 0;
const P_SELECTOR: usize = 1; // credit_high as i32 bits << 32 | consecutive_high
const P_LAST_LOW: usize = 2; // the last low grant, ms + 1
const P_GRANTED: usize = 3; // grants across workers (high)
const P_GRANTED_LOW: usize = 4;
const P_VIRTUAL_TIME: usize = 5; // the highest tenant grant count reached (fair share)
const P_PLACES_HIGH: usize = 6; // queue places taken, one field per worker (lease layout)
const P_PLACES_LOW: usize = 7;

// A worker's summary line within a pool.
const S_COUNTS: usize = 0; // high << 32 | low
const S_OLDEST_HIGH: usize = 1; // ms + 1, 0 = none
const S_OLDEST_LOW: usize = 2;
// Whose turn is next in this worker, per class: tenant + 1 (0 none) and its head's arrival + 1.
const S_TURN_HIGH: usize = 3;
const S_TURN_HIGH_AT: usize = 4;
const S_TURN_LOW: usize = 5;
const S_TURN_LOW_AT: usize = 6;
const S_LOOKS: usize = 7; // how many times this worker looked at the pool (after each operation)

// An instance slot's line.
const I_ID: usize = 0;
const I_LEASE: usize = 1;
const I_HEALTH: usize = 2; // generation << 48 | ejected_until (ms, 48 bits)
const I_PROBE: usize = 3; // sequence << 1 | ok
const I_PROBE_CLAIM: usize = 4; // when the latest probe was claimed, ms + 1
const I_TRIALS: usize = 5; // half-open trial permits, one field per worker (lease layout)
const I_FAILURES: usize = 6; // consecutive failed attempts, by any worker
const I_LIMIT: usize = 7; // SPEC §17 adaptive limit: (limit × 16) << 40 | judged at (ms + 1); 0 = none

// The tenant table: per entry two words (tenant + 1, grants), eight entries a line.
const TENANT_LINES: usize = MAX_TENANTS * 2 / LINE;
const POOL_LINES: usize = 1 + MAX_WORKERS + MAX_SLOTS + TENANT_LINES;
const POOLS_AT: usize = LINE * (1 + MAX_WORKERS);
/// The region's length in words.
pub const REGION_WORDS: usize = POOLS_AT + MAX_POOLS * POOL_LINES * LINE;
/// The region's length in bytes.
pub const REGION_BYTES: usize = REGION_WORDS * 8;

const UNTIL_MASK: u64 = (1 << 48) - 1;

pub const WORKER_FREE: u64 = 0;
pub const WORKER_LIVE: u64 = 1;
pub const WORKER_RECLAIMING: u64 = 2;

/// FNV-1a over the layout's constants: two builds agree on it only if they agree on where
/// every word is. A worker built from other sources refuses to attach.
pub const ABI_HASH: u64 = {
    let parts: [u64; 19] = [
        MAX_TENANTS as u64,
        S_TURN_LOW_AT as u64,
        S_LOOKS as u64,
        P_PLACES_LOW as u64,
        LAYOUT_VERSION,
        LINE as u64,
        MAX_WORKERS as u64,
        MAX_POOLS as u64,
        MAX_SLOTS as u64,
        P_SELECTOR as u64,
        P_LAST_LOW as u64,
        S_OLDEST_LOW as u64,
        I_LEASE as u64,
        I_HEALTH as u64,
        I_PROBE as u64,
        I_TRIALS as u64,
        I_FAILURES as u64,
        REGION_WORDS as u64,
        W_HEARTBEAT as u64,
    ];
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut i = 0;
    while i < parts.len() {
        h ^= parts[i];
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
        i += 1;
    }
    h
};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttachError {
    TooSmall(usize),
    BadMagic,
    Version(u64),
    Abi,
    Workers(u64),
}

impl std::fmt::Display for AttachError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::TooSmall(n) => write!(f, "shared region too small: {n} words"),
            Self::BadMagic => write!(f, "not a gateway shared region (bad magic)"),
            Self::Version(v) => write!(f, "shared region layout version {v} is not ours"),
            Self::Abi => write!(
                f,
                "shared region layout differs from this build's (ABI hash)"
            ),
            Self::Workers(n) => write!(f, "shared region declares {n} worker slots"),
        }
    }
}

/// Bits of one worker's field in a lease word, for `workers` slots.
pub const fn field_bits(workers: usize) -> u32 {
    let f = if workers <= 1 {
        1
    } else {
        workers.next_power_of_two()
    };
    64 / f as u32
}

/// One worker's field of a packed word.
#[inline]
pub fn field(v: u64, w: usize, bits: u32) -> u64 {
    if bits == 64 {
        v
    } else {
        (v >> (w as u32 * bits)) & ((1 << bits) - 1)
    }
}

/// The sum of every field of a packed word.
#[inline]
pub fn sum(v: u64, bits: u32) -> u64 {
    if bits == 64 {
        return v;
    }
    let mut total = 0;
    let mut rest = v;
    let mask = (1u64 << bits) - 1;
    while rest != 0 {
        total += rest & mask;
        rest >>= bits;
    }
    total
}

/// Adds one to worker `w`'s field if the sum of all fields stays at most `cap` and the field
/// does not overflow. One CAS: a worker killed before it lands held nothing, after it holds
/// one unit in its own field.
pub fn take(word: &AtomicU64, w: usize, bits: u32, cap: u64) -> bool {
    let one = 1u64 << (w as u32 * bits % 64);
    let full = if bits == 64 {
        u64::MAX
    } else {
        (1 << bits) - 1
    };
    let mut cur = word.load(Acquire);
    loop {
        if sum(cur, bits) >= cap || field(cur, w, bits) >= full {
            return false;
        }
        match word.compare_exchange_weak(cur, cur + one, AcqRel, Acquire) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

/// Takes one from worker `w`'s field; `false` (and nothing changes) if it held none.
pub fn give(word: &AtomicU64, w: usize, bits: u32) -> bool {
    let one = 1u64 << (w as u32 * bits % 64);
    let mut cur = word.load(Acquire);
    loop {
        if field(cur, w, bits) == 0 {
            return false;
        }
        match word.compare_exchange_weak(cur, cur - one, AcqRel, Acquire) {
            Ok(_) => return true,
            Err(now) => cur = now,
        }
    }
}

/// Clears worker `w`'s field (a dead worker's holdings); returns what it held.
pub fn clear(word: &AtomicU64, w: usize, bits: u32) -> u64 {
    let mut cur = word.load(Acquire);
    loop {
        let held = field(cur, w, bits);
        if held == 0 {
            return 0;
        }
        let new = if bits == 64 {
            0
        } else {
            cur & !(((1u64 << bits) - 1) << (w as u32 * bits))
        };
        match word.compare_exchange_weak(cur, new, AcqRel, Acquire) {
            Ok(_) => return held,
            Err(now) => cur = now,
        }
    }
}

/// The class selector's state shared by the workers of one pool (see `selector.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SharedSelector {
    pub credit_high: i64,
    pub consecutive_high: u32,
    pub last_low_grant: Millis,
}

/// What the other workers have waiting in one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerWaiting {
    pub high: u64,
    pub low: u64,
    pub oldest_high: Option<Millis>,
    pub oldest_low: Option<Millis>,
    /// Worker slots with something waiting, as bit sets (whom to wake): any class, high, low.
    pub workers: u64,
    pub high_workers: u64,
    pub low_workers: u64,
}

fn enc_time(t: Option<Millis>) -> u64 {
    t.map_or(0, |t| t.saturating_add(1))
}

fn dec_time(v: u64) -> Option<Millis> {
    v.checked_sub(1)
}

/// A view of the whole region.
#[derive(Clone, Copy)]
pub struct Region<'a> {
    words: &'a [AtomicU64],
    workers: usize,
    bits: u32,
}

impl std::fmt::Debug for Region<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("workers", &self.workers)
            .finish()
    }
}

impl<'a> Region<'a> {
    /// Writes the header of a fresh, zero-filled region for `workers` slots (the supervisor).
    pub fn init(words: &'a [AtomicU64], workers: usize) -> Result<Self, AttachError> {
        if words.len() < REGION_WORDS {
            return Err(AttachError::TooSmall(words.len()));
        }
        if workers == 0 || workers > MAX_WORKERS {
            return Err(AttachError::Workers(workers as u64));
        }
        words[H_VERSION].store(LAYOUT_VERSION, Relaxed);
        words[H_ABI].store(ABI_HASH, Relaxed);
        words[H_LEN].store(REGION_WORDS as u64, Relaxed);
        words[H_WORKERS].store(workers as u64, Relaxed);
        // The magic last: a reader that sees it sees the rest.
        words[H_MAGIC].store(MAGIC, Release);
        Self::attach(words)
    }

    /// Checks the header and returns a view (every worker, at start).
    pub fn attach(words: &'a [AtomicU64]) -> Result<Self, AttachError> {
        if words.len() < REGION_WORDS {
            return Err(AttachError::TooSmall(words.len()));
        }
        if words[H_MAGIC].load(Acquire) != MAGIC {
            return Err(AttachError::BadMagic);
        }
        let version = words[H_VERSION].load(Relaxed);
        if version != LAYOUT_VERSION {
            return Err(AttachError::Version(version));
        }
        if words[H_ABI].load(Relaxed) != ABI_HASH
            || words[H_LEN].load(Relaxed) != REGION_WORDS as u64
        {
            return Err(AttachError::Abi);
        }
        let workers = words[H_WORKERS].load(Relaxed);
        if workers == 0 || workers > MAX_WORKERS as u64 {
            return Err(AttachError::Workers(workers));
        }
        let workers = workers as usize;
        Ok(Self {
            words,
            workers,
            bits: field_bits(workers),
        })
    }

    pub fn workers(&self) -> usize {
        self.workers
    }

    pub fn field_bits(&self) -> u32 {
        self.bits
    }

    fn worker_word(&self, w: usize, k: usize) -> &'a AtomicU64 {
        &self.words[LINE * (1 + w) + k]
    }

    fn pool_base(&self, p: usize) -> usize {
        POOLS_AT + p * POOL_LINES * LINE
    }

    fn pool_word(&self, p: usize, k: usize) -> &'a AtomicU64 {
        &self.words[self.pool_base(p) + k]
    }

    fn summary_word(&self, p: usize, w: usize, k: usize) -> &'a AtomicU64 {
        &self.words[self.pool_base(p) + LINE * (1 + w) + k]
    }

    fn slot_word(&self, p: usize, s: usize, k: usize) -> &'a AtomicU64 {
        &self.words[self.pool_base(p) + LINE * (1 + MAX_WORKERS + s) + k]
    }

    // ---- worker slots (the supervisor writes state and pid; the worker its heartbeat) -------

    /// Marks slot `w` live for incarnation `incarnation` with process `pid`.
    pub fn worker_start(&self, w: usize, incarnation: u64, pid: u64) {
        self.worker_word(w, W_PID).store(pid, Relaxed);
        self.worker_word(w, W_HEARTBEAT).store(0, Relaxed);
        self.worker_word(w, W_STATE)
            .store(incarnation << 8 | WORKER_LIVE, Release);
    }

    /// (state, incarnation, pid, heartbeat ms + 1 or 0).
    pub fn worker(&self, w: usize) -> (u64, u64, u64, u64) {
        let s = self.worker_word(w, W_STATE).load(Acquire);
        (
            s & 0xff,
            s >> 8,
            self.worker_word(w, W_PID).load(Relaxed),
            self.worker_word(w, W_HEARTBEAT).load(Relaxed),
        )
    }

    pub fn heartbeat(&self, w: usize, now: Millis) {
        self.worker_word(w, W_HEARTBEAT)
            .store(now.saturating_add(1), Relaxed);
    }

    // ---- pools and instance slots -------------------------------------------------------

    /// The pool slot of pool `id` (a stable hash of its name, nonzero), claimed if new.
    pub fn pool_slot(&self, id: u64) -> Option<usize> {
        claim(|p| self.pool_word(p, P_ID), MAX_POOLS, id.saturating_add(1))
    }

    /// The slot of instance `id` in pool slot `p`, claimed if new (ids 0 and 1 are distinct:
    /// a cell holds the id + 1, 0 being empty).
    pub fn instance_slot(&self, p: usize, id: u64) -> Option<usize> {
        claim(
            |s| self.slot_word(p, s, I_ID),
            MAX_SLOTS,
            id.saturating_add(1),
        )
    }

    pub fn lease(&self, p: usize, s: usize) -> &'a AtomicU64 {
        self.slot_word(p, s, I_LEASE)
    }

    /// Units of instance slot `s` held by all workers / by worker `w`.
    pub fn held(&self, p: usize, s: usize) -> u64 {
        sum(self.lease(p, s).load(Acquire), self.bits)
    }

    /// (units held by all workers, by worker `w`) from one read of the lease word.
    pub fn held_split(&self, p: usize, s: usize, w: usize) -> (u64, u64) {
        let v = self.lease(p, s).load(Acquire);
        (sum(v, self.bits), field(v, w, self.bits))
    }

    pub fn held_by(&self, p: usize, s: usize, w: usize) -> u64 {
        field(self.lease(p, s).load(Acquire), w, self.bits)
    }

    pub fn take(&self, p: usize, s: usize, w: usize, cap: u64) -> bool {
        take(self.lease(p, s), w, self.bits, cap)
    }

    pub fn give(&self, p: usize, s: usize, w: usize) -> bool {
        give(self.lease(p, s), w, self.bits)
    }

    /// SPEC §6 half-open trial permits, global: taken like units, against the permit count.
    pub fn take_trial(&self, p: usize, s: usize, w: usize, permits: u64) -> bool {
        take(self.slot_word(p, s, I_TRIALS), w, self.bits, permits)
    }

    pub fn give_trial(&self, p: usize, s: usize, w: usize) -> bool {
        give(self.slot_word(p, s, I_TRIALS), w, self.bits)
    }

    pub fn trials(&self, p: usize, s: usize) -> u64 {
        sum(self.slot_word(p, s, I_TRIALS).load(Acquire), self.bits)
    }

    /// An ejection seen by one worker holds for all: publishes `until` unless a later one is
    /// already there. Returns the (generation, until) now in the word.
    pub fn publish_ejection(&self, p: usize, s: usize, until: Millis) -> (u64, Millis) {
        let word = self.slot_word(p, s, I_HEALTH);
        let until = until.min(UNTIL_MASK);
        let mut cur = word.load(Acquire);
        loop {
            if cur & UNTIL_MASK >= until {
                return (cur >> 48, cur & UNTIL_MASK);
            }
            let new = (((cur >> 48) + 1) & 0xffff) << 48 | until;
            match word.compare_exchange_weak(cur, new, AcqRel, Acquire) {
                Ok(_) => return (new >> 48, until),
                Err(now) => cur = now,
            }
        }
    }

    /// A failed attempt on instance slot `s`, by any worker: the consecutive count now.
    pub fn count_failure(&self, p: usize, s: usize) -> u64 {
        self.slot_word(p, s, I_FAILURES).fetch_add(1, AcqRel) + 1
    }

    /// A successful attempt (or a new ejection): the consecutive count starts again.
    pub fn reset_failures(&self, p: usize, s: usize) {
        self.slot_word(p, s, I_FAILURES).store(0, Release);
    }

    /// (generation, until) of the latest ejection any worker published.
    pub fn ejection(&self, p: usize, s: usize) -> (u64, Millis) {
        let v = self.slot_word(p, s, I_HEALTH).load(Acquire);
        (v >> 48, v & UNTIL_MASK)
    }

    /// SPEC §6 probes, one per instance per interval across workers: `true` if this worker
    /// won the right to probe now (nobody claimed one within `interval_ms`).
    pub fn claim_probe(&self, p: usize, s: usize, now: Millis, interval_ms: Millis) -> bool {
        let word = self.slot_word(p, s, I_PROBE_CLAIM);
        let cur = word.load(Acquire);
        if let Some(last) = dec_time(cur) {
            if now < last.saturating_add(interval_ms) {
                return false;
            }
        }
        word.compare_exchange(cur, now.saturating_add(1), AcqRel, Acquire)
            .is_ok()
    }

    /// SPEC §17: instance slot `s`'s adaptive limit as the workers share it, with the word it
    /// was read from (for `judge_limit`) and when it was last judged: `None` when unset.
    pub fn limit(&self, p: usize, s: usize) -> (u64, Option<(f64, Millis)>) {
        let v = self.slot_word(p, s, I_LIMIT).load(Acquire);
        let at = dec_time(v & ((1 << 40) - 1));
        (v, at.map(|at| ((v >> 40) as f64 / 16.0, at)))
    }

    /// Sets the shared adaptive limit if the word is still `seen` (one judgement per window
    /// across workers: the first to judge wins, the others adopt it). `None` clears it.
    pub fn judge_limit(&self, p: usize, s: usize, seen: u64, limit: Option<(f64, Millis)>) -> bool {
        let v = limit.map_or(0, |(l, at)| {
            let fixed = ((l * 16.0) as u64).min((1 << 24) - 1);
            fixed << 40 | (at.saturating_add(1) & ((1 << 40) - 1))
        });
        self.slot_word(p, s, I_LIMIT)
            .compare_exchange(seen, v, AcqRel, Acquire)
            .is_ok()
    }

    /// Publishes a probe's result for every worker to apply.
    pub fn publish_probe(&self, p: usize, s: usize, ok: bool) {
        let word = self.slot_word(p, s, I_PROBE);
        let mut cur = word.load(Acquire);
        loop {
            let new = ((cur >> 1).wrapping_add(1)) << 1 | u64::from(ok);
            match word.compare_exchange_weak(cur, new, AcqRel, Acquire) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
        }
    }

    /// (sequence, ok) of the latest probe result.
    pub fn probe(&self, p: usize, s: usize) -> (u64, bool) {
        let v = self.slot_word(p, s, I_PROBE).load(Acquire);
        (v >> 1, v & 1 == 1)
    }

    // ---- the queue's union ----------------------------------------------------------------

    /// Worker `w`'s own waiting requests in pool `p`.
    pub fn publish_waiting(
        &self,
        p: usize,
        w: usize,
        high: u64,
        low: u64,
        oldest_high: Option<Millis>,
        oldest_low: Option<Millis>,
    ) {
        // Times first, counts last: a reader that sees a count sees its head's time.
        self.summary_word(p, w, S_OLDEST_HIGH)
            .store(enc_time(oldest_high), Relaxed);
        self.summary_word(p, w, S_OLDEST_LOW)
            .store(enc_time(oldest_low), Relaxed);
        self.summary_word(p, w, S_COUNTS).store(
            high.min(u32::MAX.into()) << 32 | low.min(u32::MAX.into()),
            Release,
        );
    }

    /// What every worker but `me` has waiting in pool `p` (all of them with `me` out of range).
    pub fn peers_waiting(&self, p: usize, me: usize) -> PeerWaiting {
        let mut out = PeerWaiting::default();
        for w in (0..self.workers).filter(|&w| w != me) {
            let counts = self.summary_word(p, w, S_COUNTS).load(Acquire);
            let (high, low) = (counts >> 32, counts & 0xffff_ffff);
            if high + low == 0 {
                continue;
            }
            out.workers |= 1 << w;
            if high > 0 {
                out.high_workers |= 1 << w;
            }
            if low > 0 {
                out.low_workers |= 1 << w;
            }
            out.high += high;
            out.low += low;
            if high > 0 {
                let t = dec_time(self.summary_word(p, w, S_OLDEST_HIGH).load(Relaxed));
                out.oldest_high = min_opt(out.oldest_high, t);
            }
            if low > 0 {
                let t = dec_time(self.summary_word(p, w, S_OLDEST_LOW).load(Relaxed));
                out.oldest_low = min_opt(out.oldest_low, t);
            }
        }
        out
    }

    fn tenant_word(&self, p: usize, k: usize, grants: bool) -> &'a AtomicU64 {
        let base = self.pool_base(p) + LINE * (1 + MAX_WORKERS + MAX_SLOTS);
        &self.words[base + 2 * k + usize::from(grants)]
    }

    /// The tenant table's entry of `tenant` in pool `p` (claimed if new; the last entry is
    /// shared by every tenant past the table's size).
    pub fn tenant_slot(&self, p: usize, tenant: u32) -> usize {
        let id = u64::from(tenant) + 1;
        claim(|k| self.tenant_word(p, k, false), MAX_TENANTS - 1, id).unwrap_or(MAX_TENANTS - 1)
    }

    /// Grants to the tenant of table entry `k`, by every worker (SPEC §12 fair share).
    pub fn tenant_grants(&self, p: usize, k: usize) -> u64 {
        self.tenant_word(p, k, true).load(Acquire)
    }

    /// A grant to table entry `k`'s tenant; the pool's virtual time follows the highest count.
    pub fn count_tenant_grant(&self, p: usize, k: usize) {
        let n = self.tenant_word(p, k, true).fetch_add(1, AcqRel) + 1;
        self.pool_word(p, P_VIRTUAL_TIME).fetch_max(n, AcqRel);
    }

    /// A request of entry `k`'s tenant starts waiting: a tenant that was idle starts at the
    /// pool's virtual time (start-time fair queuing), so it neither banks credit while idle
    /// nor pays for service long past.
    pub fn tenant_waits(&self, p: usize, k: usize) {
        let vt = self.pool_word(p, P_VIRTUAL_TIME).load(Acquire);
        self.tenant_word(p, k, true)
            .fetch_max(vt.saturating_sub(1), AcqRel);
    }

    /// Worker `w`'s next turn per class: (tenant table entry, its head's arrival).
    pub fn publish_turns(
        &self,
        p: usize,
        w: usize,
        high: Option<(usize, Millis)>,
        low: Option<(usize, Millis)>,
    ) {
        let enc = |t: Option<(usize, Millis)>| t.map_or((0, 0), |(k, at)| (k as u64 + 1, at + 1));
        let (h, h_at) = enc(high);
        let (l, l_at) = enc(low);
        self.summary_word(p, w, S_TURN_HIGH_AT).store(h_at, Relaxed);
        self.summary_word(p, w, S_TURN_LOW_AT).store(l_at, Relaxed);
        self.summary_word(p, w, S_TURN_HIGH).store(h, Release);
        self.summary_word(p, w, S_TURN_LOW).store(l, Release);
    }

    /// Worker `w` looked at pool `p` (after an operation: it saw what was free then).
    pub fn looked(&self, p: usize, w: usize) {
        self.summary_word(p, w, S_LOOKS).fetch_add(1, Release);
    }

    fn places(&self, p: usize, high: bool) -> &'a AtomicU64 {
        self.pool_word(p, if high { P_PLACES_HIGH } else { P_PLACES_LOW })
    }

    /// SPEC §3 capacity over every worker's queue: a place for worker `w`, if fewer than
    /// `capacity` are taken.
    pub fn take_place(&self, p: usize, w: usize, high: bool, capacity: u64) -> bool {
        take(self.places(p, high), w, self.bits, capacity)
    }

    /// Queue places taken by every worker.
    pub fn places_taken(&self, p: usize, high: bool) -> u64 {
        sum(self.places(p, high).load(Acquire), self.bits)
    }

    /// Gives back worker `w`'s places beyond the `live` entries it still has queued.
    pub fn settle_places(&self, p: usize, w: usize, high: bool, live: u64) {
        let word = self.places(p, high);
        while field(word.load(Acquire), w, self.bits) > live {
            if !give(word, w, self.bits) {
                break;
            }
        }
    }

    /// Worker `w`'s waiting requests in pool `p`: (high, low).
    pub fn waiting_of(&self, p: usize, w: usize) -> (u64, u64) {
        let counts = self.summary_word(p, w, S_COUNTS).load(Acquire);
        (counts >> 32, counts & 0xffff_ffff)
    }

    /// How many times worker `w` looked at pool `p`.
    pub fn looks(&self, p: usize, w: usize) -> u64 {
        self.summary_word(p, w, S_LOOKS).load(Acquire)
    }

    /// Worker `w`'s next turn in `class` (`high`: true), if it has one.
    pub fn turn(&self, p: usize, w: usize, high: bool) -> Option<(usize, Millis)> {
        let (k, at) = if high {
            (S_TURN_HIGH, S_TURN_HIGH_AT)
        } else {
            (S_TURN_LOW, S_TURN_LOW_AT)
        };
        let slot = self.summary_word(p, w, k).load(Acquire).checked_sub(1)?;
        let at = dec_time(self.summary_word(p, w, at).load(Relaxed))?;
        Some((slot as usize, at))
    }

    pub fn selector(&self, p: usize) -> SharedSelector {
        let v = self.pool_word(p, P_SELECTOR).load(Acquire);
        SharedSelector {
            credit_high: i64::from((v >> 32) as u32 as i32),
            consecutive_high: v as u32,
            last_low_grant: dec_time(self.pool_word(p, P_LAST_LOW).load(Acquire)).unwrap_or(0),
        }
    }

    /// Applies one grant to the shared selector: `credit_delta` to the high credit (the low
    /// credit is its negation), and the consecutive-high count set by `consecutive` from the
    /// current one. A low grant also records its time.
    pub fn commit_selector(
        &self,
        p: usize,
        credit_delta: i64,
        consecutive: impl Fn(u32) -> u32,
        low_granted_at: Option<Millis>,
    ) {
        let word = self.pool_word(p, P_SELECTOR);
        let mut cur = word.load(Acquire);
        loop {
            let credit = i64::from((cur >> 32) as u32 as i32) + credit_delta;
            let credit = credit.clamp(i64::from(i32::MIN), i64::from(i32::MAX)) as i32;
            let new = u64::from(credit as u32) << 32 | u64::from(consecutive(cur as u32));
            match word.compare_exchange_weak(cur, new, AcqRel, Acquire) {
                Ok(_) => break,
                Err(now) => cur = now,
            }
        }
        if let Some(t) = low_granted_at {
            self.pool_word(p, P_LAST_LOW)
                .fetch_max(t.saturating_add(1), AcqRel);
        }
    }

    /// Resets the selector's credit (a reload changed the weights).
    pub fn reset_selector_credit(&self, p: usize) {
        let word = self.pool_word(p, P_SELECTOR);
        let mut cur = word.load(Acquire);
        while let Err(now) = word.compare_exchange_weak(cur, cur & 0xffff_ffff, AcqRel, Acquire) {
            cur = now;
        }
    }

    /// Grants by every worker, per class (high, low).
    pub fn count_grant(&self, p: usize, high: bool) {
        let k = if high { P_GRANTED } else { P_GRANTED_LOW };
        self.pool_word(p, k).fetch_add(1, Relaxed);
    }

    pub fn grants(&self, p: usize) -> (u64, u64) {
        (
            self.pool_word(p, P_GRANTED).load(Relaxed),
            self.pool_word(p, P_GRANTED_LOW).load(Relaxed),
        )
    }

    // ---- reclaim --------------------------------------------------------------------------

    /// Clears everything worker `w` held (it is dead and fenced: the supervisor waited for its
    /// exit): units, trial permits and its queue summaries. Returns the units reclaimed.
    pub fn reclaim(&self, w: usize) -> u64 {
        let state = self.worker_word(w, W_STATE);
        let cur = state.load(Acquire);
        state.store((cur >> 8) << 8 | WORKER_RECLAIMING, Release);
        let mut units = 0;
        for p in 0..MAX_POOLS {
            if self.pool_word(p, P_ID).load(Acquire) == 0 {
                continue;
            }
            for s in 0..MAX_SLOTS {
                if self.slot_word(p, s, I_ID).load(Acquire) == 0 {
                    break; // slots are claimed in order
                }
                units += clear(self.lease(p, s), w, self.bits);
                clear(self.slot_word(p, s, I_TRIALS), w, self.bits);
            }
            self.publish_waiting(p, w, 0, 0, None, None);
            self.publish_turns(p, w, None, None);
            clear(self.places(p, true), w, self.bits);
            clear(self.places(p, false), w, self.bits);
        }
        state.store((cur >> 8) << 8 | WORKER_FREE, Release);
        units
    }
}

/// The earlier of two optional times.
pub fn min_opt(a: Option<Millis>, b: Option<Millis>) -> Option<Millis> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
}

/// Finds the cell holding `id` among `n`, claiming the first empty one (by CAS) if none does.
/// Cells are claimed in order and never freed, so a scan stops at the first empty cell.
fn claim<'a>(cell: impl Fn(usize) -> &'a AtomicU64, n: usize, id: u64) -> Option<usize> {
    for k in 0..n {
        let c = cell(k);
        match c.load(Acquire) {
            v if v == id => return Some(k),
            0 => match c.compare_exchange(0, id, AcqRel, Acquire) {
                Ok(_) => return Some(k),
                Err(v) if v == id => return Some(k),
                Err(_) => continue,
            },
            _ => continue,
        }
    }
    None
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn region(workers: usize) -> (&'static [AtomicU64], Region<'static>) {
        let words: Vec<AtomicU64> = (0..REGION_WORDS).map(|_| AtomicU64::new(0)).collect();
        let words: &'static [AtomicU64] = Box::leak(words.into_boxed_slice());
        (words, Region::init(words, workers).unwrap())
    }

    #[test]
    fn attach_checks_the_header() {
        let (words, _) = region(4);
        assert_eq!(Region::attach(words).unwrap().workers(), 4);
        words[H_ABI].store(1, Relaxed);
        assert_eq!(Region::attach(words).unwrap_err(), AttachError::Abi);
        words[H_MAGIC].store(0, Relaxed);
        assert_eq!(Region::attach(words).unwrap_err(), AttachError::BadMagic);
        let short: Vec<AtomicU64> = (0..8).map(|_| AtomicU64::new(0)).collect();
        assert!(matches!(
            Region::attach(&short),
            Err(AttachError::TooSmall(8))
        ));
    }

    #[test]
    fn fields_pack_and_sum() {
        assert_eq!(field_bits(1), 64);
        assert_eq!(field_bits(2), 32);
        assert_eq!(field_bits(3), 16);
        assert_eq!(field_bits(8), 8);
        let w = AtomicU64::new(0);
        for worker in 0..8 {
            assert!(take(&w, worker, 8, 100));
        }
        assert_eq!(sum(w.load(Relaxed), 8), 8);
        assert!(!take(&w, 0, 8, 8), "the cap holds across workers");
        assert_eq!(clear(&w, 3, 8), 1);
        assert!(take(&w, 0, 8, 8));
        assert_eq!(field(w.load(Relaxed), 0, 8), 2);
        assert!(give(&w, 0, 8) && give(&w, 0, 8) && !give(&w, 0, 8));
    }

    #[test]
    fn a_field_never_overflows_into_its_neighbour() {
        let w = AtomicU64::new(0);
        for _ in 0..255 {
            assert!(take(&w, 0, 8, 10_000));
        }
        assert!(!take(&w, 0, 8, 10_000));
        assert_eq!(field(w.load(Relaxed), 1, 8), 0);
    }

    #[test]
    fn slots_are_claimed_once_per_id() {
        let (_, r) = region(2);
        let p = r.pool_slot(77).unwrap();
        assert_eq!(r.pool_slot(77), Some(p));
        assert_ne!(r.pool_slot(78), Some(p));
        assert_ne!(
            r.instance_slot(p, 0),
            r.instance_slot(p, 1),
            "ids 0 and 1 are two"
        );
        let a = r.instance_slot(p, 5).unwrap();
        let b = r.instance_slot(p, 6).unwrap();
        assert_ne!(a, b);
        assert_eq!(r.instance_slot(p, 5), Some(a));
    }

    #[test]
    fn reclaim_frees_exactly_the_dead_workers_units() {
        let (_, r) = region(3);
        let p = r.pool_slot(1).unwrap();
        let s = r.instance_slot(p, 9).unwrap();
        assert!(r.take(p, s, 0, 4) && r.take(p, s, 1, 4) && r.take(p, s, 1, 4));
        r.publish_waiting(p, 1, 2, 3, Some(10), Some(5));
        assert_eq!(r.peers_waiting(p, 0).low, 3);
        assert_eq!(r.reclaim(1), 2);
        assert_eq!(r.held(p, s), 1);
        assert_eq!(r.held_by(p, s, 0), 1);
        assert_eq!(r.peers_waiting(p, 0), PeerWaiting::default());
    }

    #[test]
    fn the_latest_ejection_and_probe_win() {
        let (_, r) = region(2);
        let (p, s) = (0, 0);
        assert_eq!(r.publish_ejection(p, s, 500), (1, 500));
        assert_eq!(r.publish_ejection(p, s, 300), (1, 500));
        assert_eq!(r.publish_ejection(p, s, 900), (2, 900));
        assert!(r.claim_probe(p, s, 1000, 100));
        assert!(!r.claim_probe(p, s, 1050, 100));
        assert!(r.claim_probe(p, s, 1100, 100));
        r.publish_probe(p, s, false);
        r.publish_probe(p, s, true);
        assert_eq!(r.probe(p, s), (2, true));
    }

    #[test]
    fn the_selector_word_round_trips() {
        let (_, r) = region(2);
        r.commit_selector(0, -7, |c| c + 1, None);
        r.commit_selector(0, 3, |c| c + 1, Some(42));
        assert_eq!(
            r.selector(0),
            SharedSelector {
                credit_high: -4,
                consecutive_high: 2,
                last_low_grant: 42
            }
        );
        r.reset_selector_credit(0);
        assert_eq!(r.selector(0).credit_high, 0);
        assert_eq!(r.selector(0).consecutive_high, 2);
    }
}
