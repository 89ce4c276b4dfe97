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
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};

use crate::cells;
use crate::types::Millis;

/// "GWSHMv01".
pub const MAGIC: u64 = 0x4757_5348_4d76_3031;
/// 3: a pool's id word is a `cells.rs` key word (pools are reclaimed), not `id + 1`.
pub const LAYOUT_VERSION: u64 = 3;
/// Words per cache-line pair (128 bytes): hot words of different owners never share one.
pub const LINE: usize = 16;
pub const MAX_WORKERS: usize = 8;
/// Pools at once (a pool's place is reclaimed once no worker uses it, SPEC §12).
pub const MAX_POOLS: usize = 32;
/// Instance cells per pool: a pool's live instances plus those a reload removed that still
/// have requests in flight somewhere (a cell is reclaimed once no worker uses it).
pub const MAX_SLOTS: usize = 128;
/// Tenants per pool whose grants are counted for fair share across workers (idle tenants'
/// entries are reclaimed); past that many at once, the rest share one overflow count.
pub const MAX_TENANTS: usize = 64;
/// API keys whose `rpm`/`tpm` buckets live in the region (SPEC §12: a key gets its limit once
/// per gateway); entries of keys no worker has configured any more are reclaimed.
pub const MAX_KEYS: usize = 512;

// SPEC §12 "the region's layout is checked at attach by a hash derived from the layout
// itself": the layout is these `#[repr(C)]` structs (never instantiated: every word index
// below is an `offset_of!` into them), and `layout!` hashes each one's name, size and every
// field's name, offset and size, so any change to where a word is changes `ABI_HASH`.

const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

const fn mix(mut h: u64, v: u64) -> u64 {
    let mut i = 0;
    while i < 8 {
        h ^= (v >> (8 * i)) & 0xff;
        h = h.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    h
}

const fn mix_str(mut h: u64, s: &str) -> u64 {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        h ^= b[i] as u64;
        h = h.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    mix(h, b.len() as u64)
}

macro_rules! layout {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident : $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[repr(C)]
        #[allow(dead_code)]
        struct $name {
            $($(#[$fm])* $field: $ty),*
        }
        impl $name {
            const WORDS: usize = std::mem::size_of::<$name>() / 8;
            const HASH: u64 = {
                let h = mix_str(FNV_BASIS, stringify!($name));
                let h = mix(h, std::mem::size_of::<$name>() as u64);
                $(
                    let h = mix_str(h, stringify!($field));
                    let h = mix(h, std::mem::offset_of!($name, $field) as u64);
                    let h = mix(h, std::mem::size_of::<$ty>() as u64);
                )*
                h
            };
        }
    };
}

/// Word index of `field` in `T`.
macro_rules! word {
    ($t:ty, $field:ident) => {
        std::mem::offset_of!($t, $field) / 8
    };
}

layout!(
    /// The header's line.
    Header {
        magic: u64,
        version: u64,
        abi: u64,
        len: u64,
        workers: u64,
        _pad: [u64; LINE - 5],
    }
);

layout!(
    /// A worker slot's line (the supervisor writes state and pid; the worker the rest).
    WorkerLine {
        /// incarnation << 8 | state
        state: u64,
        pid: u64,
        heartbeat: u64,
        /// SPEC §16 request bytes this worker holds (`limits.max_buffered_bytes`, per host).
        buffered: u64,
        _pad: [u64; LINE - 4],
    }
);

layout!(
    /// A pool's first line.
    PoolHead {
        id: u64,
        /// credit_high as i32 bits << 32 | consecutive_high
        selector: u64,
        /// the last low grant, ms + 1
        last_low: u64,
        /// grants across workers (high, low)
        granted: u64,
        granted_low: u64,
        /// the highest tenant grant count reached (fair share)
        virtual_time: u64,
        /// queue places taken, one field per worker (lease layout)
        places_high: u64,
        places_low: u64,
        _pad: [u64; LINE - 8],
    }
);

layout!(
    /// A worker's summary line within a pool.
    Summary {
        /// high << 32 | low
        counts: u64,
        /// ms + 1, 0 = none
        oldest_high: u64,
        oldest_low: u64,
        /// whose turn is next in this worker, per class: tenant entry + 1 (0 none) and its
        /// head's arrival + 1
        turn_high: u64,
        turn_high_at: u64,
        turn_low: u64,
        turn_low_at: u64,
        /// how many times this worker looked at the pool (after each operation)
        looks: u64,
        _pad: [u64; LINE - 8],
    }
);

layout!(
    /// An instance cell's line.
    Slot {
        /// the cell's key word (`cells.rs`): the instance id's key and its users
        id: u64,
        lease: u64,
        /// generation << 48 | ejected_until (ms, 48 bits)
        health: u64,
        /// sequence << 1 | ok
        probe: u64,
        /// when the latest probe was claimed, ms + 1
        probe_claim: u64,
        /// half-open trial permits, one field per worker (lease layout)
        trials: u64,
        /// consecutive failed attempts, by any worker
        failures: u64,
        /// SPEC §17 adaptive limit: (limit × 16) << 40 | judged at (ms + 1); 0 = none
        limit: u64,
        _pad: [u64; LINE - 8],
    }
);

layout!(
    /// A tenant table entry: its key word (`cells.rs`) and its grants.
    TenantEntry {
        key: u64,
        grants: u64,
    }
);

layout!(
    /// One pool's block.
    PoolBlock {
        head: PoolHead,
        summaries: [Summary; MAX_WORKERS],
        slots: [Slot; MAX_SLOTS],
        tenants: [TenantEntry; MAX_TENANTS],
    }
);

layout!(
    /// An API key's entry: its key word (`cells.rs`) and its two buckets, each the GCRA
    /// "theoretical arrival time" in microseconds; then, with `cluster:` (SPEC §13), the
    /// host's allowance leased from the central bucket, per dimension (requests, tokens): what
    /// the workers spend (a signed count: usage above an estimate may leave a debt), what they
    /// spent and were refused since the member last looked, and the central level the member
    /// last saw (and when, on the system-wide monotonic clock, in µs).
    KeyEntry {
        key: u64,
        rpm: u64,
        tpm: u64,
        _pad: u64,
        allowance: [u64; 2],
        used: [u64; 2],
        refused: [u64; 2],
        central: [u64; 2],
        central_at: [u64; 2],
        _tail: [u64; 2],
    }
);

layout!(
    /// The whole region.
    Layout {
        header: Header,
        workers: [WorkerLine; MAX_WORKERS],
        pools: [PoolBlock; MAX_POOLS],
        keys: [KeyEntry; MAX_KEYS],
    }
);

const H_MAGIC: usize = word!(Header, magic);
const H_VERSION: usize = word!(Header, version);
const H_ABI: usize = word!(Header, abi);
const H_LEN: usize = word!(Header, len);
const H_WORKERS: usize = word!(Header, workers);

const W_STATE: usize = word!(WorkerLine, state);
const W_PID: usize = word!(WorkerLine, pid);
const W_HEARTBEAT: usize = word!(WorkerLine, heartbeat);
const W_BUFFERED: usize = word!(WorkerLine, buffered);

const P_ID: usize = word!(PoolHead, id);
const P_SELECTOR: usize = word!(PoolHead, selector);
const P_LAST_LOW: usize = word!(PoolHead, last_low);
const P_GRANTED: usize = word!(PoolHead, granted);
const P_GRANTED_LOW: usize = word!(PoolHead, granted_low);
const P_VIRTUAL_TIME: usize = word!(PoolHead, virtual_time);
const P_PLACES_HIGH: usize = word!(PoolHead, places_high);
const P_PLACES_LOW: usize = word!(PoolHead, places_low);

const S_COUNTS: usize = word!(Summary, counts);
const S_OLDEST_HIGH: usize = word!(Summary, oldest_high);
const S_OLDEST_LOW: usize = word!(Summary, oldest_low);
const S_TURN_HIGH: usize = word!(Summary, turn_high);
const S_TURN_HIGH_AT: usize = word!(Summary, turn_high_at);
const S_TURN_LOW: usize = word!(Summary, turn_low);
const S_TURN_LOW_AT: usize = word!(Summary, turn_low_at);
const S_LOOKS: usize = word!(Summary, looks);

const I_ID: usize = word!(Slot, id);
const I_LEASE: usize = word!(Slot, lease);
const I_HEALTH: usize = word!(Slot, health);
const I_PROBE: usize = word!(Slot, probe);
const I_PROBE_CLAIM: usize = word!(Slot, probe_claim);
const I_TRIALS: usize = word!(Slot, trials);
const I_FAILURES: usize = word!(Slot, failures);
const I_LIMIT: usize = word!(Slot, limit);

const T_KEY: usize = word!(TenantEntry, key);
const T_GRANTS: usize = word!(TenantEntry, grants);

const K_KEY: usize = word!(KeyEntry, key);
const K_RPM: usize = word!(KeyEntry, rpm);
const K_TPM: usize = word!(KeyEntry, tpm);
const K_ALLOWANCE: usize = word!(KeyEntry, allowance);
const K_USED: usize = word!(KeyEntry, used);
const K_REFUSED: usize = word!(KeyEntry, refused);
const K_CENTRAL: usize = word!(KeyEntry, central);
const K_CENTRAL_AT: usize = word!(KeyEntry, central_at);

const WORKERS_AT: usize = word!(Layout, workers);
const POOLS_AT: usize = word!(Layout, pools);
const KEYS_AT: usize = word!(Layout, keys);
const SUMMARIES_AT: usize = word!(PoolBlock, summaries);
const SLOTS_AT: usize = word!(PoolBlock, slots);
const TENANTS_AT: usize = word!(PoolBlock, tenants);

/// The region's length in words.
pub const REGION_WORDS: usize = Layout::WORDS;
/// The region's length in bytes.
pub const REGION_BYTES: usize = REGION_WORDS * 8;

const UNTIL_MASK: u64 = (1 << 48) - 1;

/// The tenant entry every tenant past the table's size shares (never freed).
pub const TENANT_OVERFLOW: usize = MAX_TENANTS - 1;

pub const WORKER_FREE: u64 = 0;
pub const WORKER_LIVE: u64 = 1;
pub const WORKER_RECLAIMING: u64 = 2;

/// FNV-1a over the layout itself (every struct's fields, offsets and sizes, the version and
/// the sizes the layout is built from): two builds agree on it only if they agree on where
/// every word is. A worker built from other sources refuses to attach.
pub const ABI_HASH: u64 = {
    let parts = [
        LAYOUT_VERSION,
        Header::HASH,
        WorkerLine::HASH,
        PoolHead::HASH,
        Summary::HASH,
        Slot::HASH,
        TenantEntry::HASH,
        PoolBlock::HASH,
        KeyEntry::HASH,
        Layout::HASH,
    ];
    let mut h = FNV_BASIS;
    let mut i = 0;
    while i < parts.len() {
        h = mix(h, parts[i]);
        i += 1;
    }
    h
};

// The lines stay lines: a hot word of one owner never shares a line pair with another's.
const _: () = assert!(Header::WORDS == LINE && WorkerLine::WORDS == LINE);
const _: () = assert!(PoolHead::WORDS == LINE && Summary::WORDS == LINE && Slot::WORDS == LINE);
const _: () = assert!(PoolBlock::WORDS.is_multiple_of(LINE) && KEYS_AT.is_multiple_of(LINE));

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
        &self.words[WORKERS_AT + w * WorkerLine::WORDS + k]
    }

    fn pool_base(&self, p: usize) -> usize {
        POOLS_AT + p * PoolBlock::WORDS
    }

    fn pool_word(&self, p: usize, k: usize) -> &'a AtomicU64 {
        &self.words[self.pool_base(p) + k]
    }

    fn summary_word(&self, p: usize, w: usize, k: usize) -> &'a AtomicU64 {
        &self.words[self.pool_base(p) + SUMMARIES_AT + w * Summary::WORDS + k]
    }

    fn slot_word(&self, p: usize, s: usize, k: usize) -> &'a AtomicU64 {
        &self.words[self.pool_base(p) + SLOTS_AT + s * Slot::WORDS + k]
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

    /// Whether pool slot `p` is held by a pool.
    pub fn pool_in_use(&self, p: usize) -> bool {
        p < MAX_POOLS && self.pool_word(p, P_ID).load(Acquire) != 0
    }

    /// The pool slot of pool `id` (a stable hash of its name), joined by worker `w` (claimed
    /// if no slot holds it; a cell of `cells.rs`, like an instance's). `None`: every slot is
    /// used by other pools.
    pub fn join_pool(&self, id: u64, w: usize) -> Option<usize> {
        cells::bind(|p| self.pool_word(p, P_ID), MAX_POOLS, cells::key_of(id), w)
    }

    /// The pool slot pool `id` holds, if some worker uses it (a look, no join).
    pub fn find_pool(&self, id: u64) -> Option<usize> {
        let key = cells::key_of(id);
        (0..MAX_POOLS).find(|&p| {
            let v = self.pool_word(p, P_ID).load(Acquire);
            cells::is_live(v) && cells::key(v) == key
        })
    }

    /// SPEC §12 "bounded and reclaimed" for pools: worker `w` no longer has any pool of this
    /// name (its last one closed): it gives back every unit and trial permit it holds there,
    /// leaves every instance cell and tenant entry it uses, clears its queue summary and
    /// places, and leaves the pool's slot; the last worker to leave resets the whole block and
    /// frees the slot for another pool. Returns whether it freed it.
    pub fn leave_pool(&self, p: usize, w: usize) -> bool {
        if !self.pool_in_use(p) {
            return false;
        }
        self.forget_worker(p, w);
        cells::unbind(self.pool_word(p, P_ID), w, || false, || self.reset_pool(p))
    }

    /// Everything worker `w` holds in pool `p` goes back: units, trial permits, instance cells
    /// and tenant entries (the last user of each frees it), its queue summary and places.
    /// Returns the units given back.
    fn forget_worker(&self, p: usize, w: usize) -> u64 {
        let mut units = 0;
        for s in 0..MAX_SLOTS {
            if self.slot_word(p, s, I_ID).load(Acquire) == 0 {
                continue; // cells are freed and reused in any order
            }
            units += clear(self.lease(p, s), w, self.bits);
            clear(self.slot_word(p, s, I_TRIALS), w, self.bits);
        }
        // Then the cells it used: a free it began is completed, the last user's leaving
        // frees (what it held is already cleared above).
        cells::reclaim(
            |s| self.slot_word(p, s, I_ID),
            MAX_SLOTS,
            w,
            |s| self.reset_slot(p, s),
        );
        cells::reclaim(
            |k| self.tenant_word(p, k, false),
            TENANT_OVERFLOW,
            w,
            |k| self.tenant_word(p, k, true).store(0, Release),
        );
        self.publish_waiting(p, w, 0, 0, None, None);
        self.publish_turns(p, w, None, None);
        clear(self.places(p, true), w, self.bits);
        clear(self.places(p, false), w, self.bits);
        units
    }

    /// A freed pool's block, all but its key word (which `cells::unbind` empties after),
    /// back to zeros: the next pool to take the slot finds it as a fresh region's.
    fn reset_pool(&self, p: usize) {
        let base = self.pool_base(p);
        for k in 0..PoolBlock::WORDS {
            if k != P_ID {
                self.words[base + k].store(0, Release);
            }
        }
    }

    /// The cell of instance `id` in pool slot `p`, joined by worker `w` (claimed if no cell
    /// holds it; ids 0 and 1 are distinct). `None`: every cell is used by other instances.
    pub fn instance_slot(&self, p: usize, id: u64, w: usize) -> Option<usize> {
        cells::bind(
            |s| self.slot_word(p, s, I_ID),
            MAX_SLOTS,
            cells::key_of(id),
            w,
        )
    }

    /// SPEC §12 "region cells of removed instances ... are reclaimed": worker `w` no longer
    /// uses instance cell `s` (no pool of its process does); what it still held there goes
    /// back (nothing, unless a pool closed with attempts in flight), and the last worker to
    /// leave resets the cell and frees it. Returns whether it was freed.
    pub fn leave_instance(&self, p: usize, s: usize, w: usize) -> bool {
        if !cells::is_live(self.slot_word(p, s, I_ID).load(Acquire)) {
            return false;
        }
        clear(self.lease(p, s), w, self.bits);
        clear(self.slot_word(p, s, I_TRIALS), w, self.bits);
        cells::unbind(
            self.slot_word(p, s, I_ID),
            w,
            || false,
            || self.reset_slot(p, s),
        )
    }

    fn reset_slot(&self, p: usize, s: usize) {
        for k in [
            I_LEASE,
            I_HEALTH,
            I_PROBE,
            I_PROBE_CLAIM,
            I_TRIALS,
            I_FAILURES,
            I_LIMIT,
        ] {
            self.slot_word(p, s, k).store(0, Release);
        }
    }

    /// Instance cells in use in pool slot `p`.
    pub fn instance_cells_used(&self, p: usize) -> usize {
        cells::used(|s| self.slot_word(p, s, I_ID), MAX_SLOTS)
    }

    /// The workers using instance cell `s` (a bit set).
    pub fn instance_users(&self, p: usize, s: usize) -> u64 {
        cells::users_of(self.slot_word(p, s, I_ID).load(Acquire))
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
        let at = if grants { T_GRANTS } else { T_KEY };
        &self.words[self.pool_base(p) + TENANTS_AT + k * TenantEntry::WORDS + at]
    }

    /// The tenant table's entry of `tenant` in pool `p`, joined by worker `w` (claimed if
    /// new; with the table full, entries nobody uses are swept first); `None` when every entry
    /// but the overflow one is in use (then the caller counts the tenant in `TENANT_OVERFLOW`,
    /// shared by every tenant past the table's size).
    pub fn tenant_slot(&self, p: usize, tenant: u32, w: usize) -> Option<usize> {
        let key = cells::key_of(u64::from(tenant));
        let entry = |k| self.tenant_word(p, k, false);
        cells::bind(entry, TENANT_OVERFLOW, key, w).or_else(|| {
            for k in 0..TENANT_OVERFLOW {
                cells::sweep(entry(k), w, || {
                    self.tenant_word(p, k, true).store(0, Release)
                });
            }
            cells::bind(entry, TENANT_OVERFLOW, key, w)
        })
    }

    /// SPEC §12 "idle tenants ... are reclaimed": worker `w` has nothing of entry `k`'s tenant
    /// waiting any more. The last worker to leave frees the entry if its tenant is not ahead
    /// (a tenant that comes back joins at the pool's virtual time, as an idle one does, so it
    /// loses nothing); one ahead — it was served last — keeps its count, free to join, until
    /// others catch up or the table needs the room.
    pub fn leave_tenant(&self, p: usize, k: usize, w: usize) -> bool {
        if k >= TENANT_OVERFLOW {
            return false;
        }
        let grants = self.tenant_word(p, k, true);
        let ahead = || grants.load(Acquire) >= self.pool_word(p, P_VIRTUAL_TIME).load(Acquire);
        cells::unbind(self.tenant_word(p, k, false), w, ahead, || {
            grants.store(0, Release)
        })
    }

    /// Tenant entries in use in pool slot `p` (the overflow entry not counted).
    pub fn tenant_cells_used(&self, p: usize) -> usize {
        cells::used(|k| self.tenant_word(p, k, false), TENANT_OVERFLOW)
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
            units += self.forget_worker(p, w);
        }
        // The pools it used: the last user's leaving frees (and resets) a pool's slot.
        cells::reclaim(
            |p| self.pool_word(p, P_ID),
            MAX_POOLS,
            w,
            |p| self.reset_pool(p),
        );
        cells::reclaim(
            |k| self.key_word(k, K_KEY),
            MAX_KEYS,
            w,
            |k| self.reset_key(k),
        );
        // SPEC §16 "a dead worker's share is returned": the bytes it held.
        self.worker_word(w, W_BUFFERED).store(0, Release);
        state.store((cur >> 8) << 8 | WORKER_FREE, Release);
        units
    }

    // ---- whole-gateway limits outside the scheduler (SPEC §12) ---------------------------

    /// SPEC §16 `limits.max_buffered_bytes` per host: worker `w` holds `n` more request bytes
    /// if every worker's together stay within `max`. Optimistic and exact: add to its own
    /// word, read the sum, give back if over (two racing takers may both give back; never do
    /// both stay over). A dead worker's word is cleared at reclaim.
    pub fn take_bytes(&self, w: usize, n: u64, max: u64) -> bool {
        let mine = self.worker_word(w, W_BUFFERED);
        mine.fetch_add(n, SeqCst);
        if self.buffered() > max {
            mine.fetch_sub(n, SeqCst);
            return false;
        }
        true
    }

    /// Worker `w` gives back `n` request bytes (never below what it holds).
    pub fn give_bytes(&self, w: usize, n: u64) {
        let mine = self.worker_word(w, W_BUFFERED);
        let mut cur = mine.load(Acquire);
        while let Err(now) = mine.compare_exchange_weak(cur, cur.saturating_sub(n), AcqRel, Acquire)
        {
            cur = now;
        }
    }

    /// Request bytes held by every worker of the host.
    pub fn buffered(&self) -> u64 {
        (0..self.workers)
            .map(|w| self.worker_word(w, W_BUFFERED).load(SeqCst))
            .fold(0u64, u64::saturating_add)
    }

    /// Request bytes held by worker `w`.
    pub fn buffered_by(&self, w: usize) -> u64 {
        self.worker_word(w, W_BUFFERED).load(Acquire)
    }

    fn key_word(&self, k: usize, at: usize) -> &'a AtomicU64 {
        &self.words[KEYS_AT + k * KeyEntry::WORDS + at]
    }

    fn reset_key(&self, k: usize) {
        self.key_word(k, K_RPM).store(0, Release);
        self.key_word(k, K_TPM).store(0, Release);
        for at in [K_ALLOWANCE, K_USED, K_REFUSED, K_CENTRAL, K_CENTRAL_AT] {
            self.key_word(k, at).store(0, Release);
            self.key_word(k, at + 1).store(0, Release);
        }
    }

    /// The entry of API key `id` (a stable hash of its name), joined by worker `w` (claimed
    /// if new). `None`: every entry is used by other keys.
    pub fn key_slot(&self, id: u64, w: usize) -> Option<usize> {
        cells::bind(|k| self.key_word(k, K_KEY), MAX_KEYS, cells::key_of(id), w)
    }

    /// Worker `w` no longer has key entry `k` configured; the last to leave frees it.
    pub fn leave_key(&self, k: usize, w: usize) -> bool {
        cells::unbind(self.key_word(k, K_KEY), w, || false, || self.reset_key(k))
    }

    /// API key entries in use.
    pub fn key_cells_used(&self) -> usize {
        cells::used(|k| self.key_word(k, K_KEY), MAX_KEYS)
    }

    fn bucket(&self, k: usize, tokens: bool) -> &'a AtomicU64 {
        self.key_word(k, if tokens { K_TPM } else { K_RPM })
    }

    /// SPEC §12 per-key `rpm`/`tpm` once per gateway: takes `cost` from key entry `k`'s
    /// request (`tokens` false) or token bucket of `per_minute`, which holds one minute's
    /// worth at most (a burst of it, then the rate, as each process's own bucket did). GCRA
    /// on one word (the bucket's "theoretical arrival time" in µs): `Ok(())` if taken, else
    /// `Err(µs until it would be)` (`u64::MAX`: never, `cost` is above a minute's worth).
    pub fn take_bucket(
        &self,
        k: usize,
        tokens: bool,
        cost: u64,
        per_minute: u64,
        now_us: u64,
    ) -> Result<(), u64> {
        let per_minute = per_minute.max(1);
        if cost > per_minute {
            return Err(u64::MAX);
        }
        let word = self.bucket(k, tokens);
        let need = gcra_span(cost, per_minute);
        let mut tat = word.load(Acquire);
        loop {
            let start = tat.max(now_us);
            let after = start.saturating_add(need);
            if after > now_us.saturating_add(MINUTE_US) {
                return Err(after - now_us - MINUTE_US);
            }
            match word.compare_exchange_weak(tat, after, AcqRel, Acquire) {
                Ok(_) => return Ok(()),
                Err(v) => tat = v,
            }
        }
    }

    /// Gives `cost` back to a bucket (an estimate that was too high), never past full.
    pub fn refund_bucket(&self, k: usize, tokens: bool, cost: u64, per_minute: u64, now_us: u64) {
        let word = self.bucket(k, tokens);
        let back = gcra_span(cost, per_minute.max(1));
        let mut tat = word.load(Acquire);
        loop {
            let new = tat.saturating_sub(back).max(now_us.min(tat));
            match word.compare_exchange_weak(tat, new, AcqRel, Acquire) {
                Ok(_) => return,
                Err(v) => tat = v,
            }
        }
    }

    /// Charges `cost` more to a bucket whatever its level (usage above the estimate): later
    /// requests wait for it.
    pub fn charge_bucket(&self, k: usize, tokens: bool, cost: u64, per_minute: u64, now_us: u64) {
        let word = self.bucket(k, tokens);
        let more = gcra_span(cost, per_minute.max(1));
        let mut tat = word.load(Acquire);
        loop {
            let new = tat.max(now_us).saturating_add(more);
            match word.compare_exchange_weak(tat, new, AcqRel, Acquire) {
                Ok(_) => return,
                Err(v) => tat = v,
            }
        }
    }

    /// What a bucket holds now (whole units, at most `per_minute`).
    pub fn bucket_level(&self, k: usize, tokens: bool, per_minute: u64, now_us: u64) -> u64 {
        let per_minute = per_minute.max(1);
        let tat = self.bucket(k, tokens).load(Acquire);
        let used = tat.saturating_sub(now_us);
        let used_units =
            (u128::from(used) * u128::from(per_minute)).div_ceil(u128::from(MINUTE_US));
        per_minute.saturating_sub(used_units.min(u128::from(u64::MAX)) as u64)
    }
}

// ---- SPEC §13 × §12: a key's host allowance, leased from the cluster's central bucket -------
//
// One member per host tops the allowance up from Redis (and takes surplus back out); every
// worker spends it by CAS on its one word, never below zero. Units are the caller's (the
// gateway counts thousandths of a request or token).
impl Region<'_> {
    fn lease_word(&self, k: usize, at: usize, tokens: bool) -> &AtomicU64 {
        self.key_word(k, at + usize::from(tokens))
    }

    /// Spends `cost` of key entry `k`'s host allowance if it holds that much (and counts it
    /// spent); else spends nothing and counts it refused (the member's next chunk follows).
    pub fn allowance_take(&self, k: usize, tokens: bool, cost: u64) -> bool {
        let word = self.lease_word(k, K_ALLOWANCE, tokens);
        let cost_i = i64::try_from(cost).unwrap_or(i64::MAX);
        let mut cur = word.load(Acquire);
        loop {
            let held = cur as i64;
            if held < cost_i {
                self.lease_word(k, K_REFUSED, tokens)
                    .fetch_add(cost, Relaxed);
                return false;
            }
            match word.compare_exchange_weak(cur, (held - cost_i) as u64, AcqRel, Acquire) {
                Ok(_) => break,
                Err(v) => cur = v,
            }
        }
        self.lease_word(k, K_USED, tokens).fetch_add(cost, Relaxed);
        true
    }

    /// Adds `delta` (a chunk granted, or a settled estimate: may be negative, and may leave a
    /// debt) to the allowance; `spent` is added to the spending count alike.
    pub fn allowance_add(&self, k: usize, tokens: bool, delta: i64, spent: i64) {
        self.lease_word(k, K_ALLOWANCE, tokens)
            .fetch_add(delta as u64, AcqRel);
        if spent != 0 {
            self.lease_word(k, K_USED, tokens)
                .fetch_add(spent as u64, Relaxed);
        }
    }

    /// Takes up to `amount` out of the allowance (surplus given back), never below zero:
    /// what it took.
    pub fn allowance_take_upto(&self, k: usize, tokens: bool, amount: u64) -> u64 {
        let word = self.lease_word(k, K_ALLOWANCE, tokens);
        let mut cur = word.load(Acquire);
        loop {
            let held = (cur as i64).max(0) as u64;
            let take = held.min(amount);
            if take == 0 {
                return 0;
            }
            match word.compare_exchange_weak(cur, cur.wrapping_sub(take), AcqRel, Acquire) {
                Ok(_) => return take,
                Err(v) => cur = v,
            }
        }
    }

    /// Raises the allowance by `add`, but not past `cap` (never lowers it): the static share
    /// refilled while Redis is unreachable.
    pub fn allowance_refill(&self, k: usize, tokens: bool, add: u64, cap: u64) {
        let word = self.lease_word(k, K_ALLOWANCE, tokens);
        let add = i64::try_from(add).unwrap_or(i64::MAX);
        let cap = i64::try_from(cap).unwrap_or(i64::MAX);
        let mut cur = word.load(Acquire);
        loop {
            let held = cur as i64;
            let new = held.max(held.saturating_add(add).min(cap));
            if new == held {
                return;
            }
            match word.compare_exchange_weak(cur, new as u64, AcqRel, Acquire) {
                Ok(_) => return,
                Err(v) => cur = v,
            }
        }
    }

    /// The allowance held now (negative: a debt).
    pub fn allowance(&self, k: usize, tokens: bool) -> i64 {
        self.lease_word(k, K_ALLOWANCE, tokens).load(Acquire) as i64
    }

    /// What was spent (net of settled estimates) and refused since the last call; both
    /// counts start again from zero.
    pub fn allowance_drain(&self, k: usize, tokens: bool) -> (i64, u64) {
        let used = self.lease_word(k, K_USED, tokens).swap(0, AcqRel) as i64;
        let refused = self.lease_word(k, K_REFUSED, tokens).swap(0, AcqRel);
        (used, refused)
    }

    /// What was refused since the last drain (nothing is reset).
    pub fn allowance_refused(&self, k: usize, tokens: bool) -> u64 {
        self.lease_word(k, K_REFUSED, tokens).load(Relaxed)
    }

    /// Whether any key entry counted a refusal since its last drain (the member's look at
    /// every tick: one pass over the table instead of a call per key).
    pub fn any_allowance_refused(&self) -> bool {
        (0..MAX_KEYS).any(|k| {
            self.key_word(k, K_REFUSED).load(Relaxed) != 0
                || self.key_word(k, K_REFUSED + 1).load(Relaxed) != 0
        })
    }

    /// The central bucket's level as the member last saw it, and when (µs).
    pub fn set_central(&self, k: usize, tokens: bool, level: u64, at_us: u64) {
        self.lease_word(k, K_CENTRAL_AT, tokens)
            .store(at_us, Release);
        self.lease_word(k, K_CENTRAL, tokens).store(level, Release);
    }

    pub fn central(&self, k: usize, tokens: bool) -> (u64, u64) {
        (
            self.lease_word(k, K_CENTRAL, tokens).load(Acquire),
            self.lease_word(k, K_CENTRAL_AT, tokens).load(Acquire),
        )
    }
}

const MINUTE_US: u64 = 60_000_000;

/// µs of a minute that `cost` of `per_minute` stands for.
fn gcra_span(cost: u64, per_minute: u64) -> u64 {
    let span = u128::from(cost) * u128::from(MINUTE_US) / u128::from(per_minute);
    span.min(u128::from(u64::MAX)) as u64
}

/// The earlier of two optional times.
pub fn min_opt(a: Option<Millis>, b: Option<Millis>) -> Option<Millis> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.min(y)),
        (x, None) => x,
        (None, y) => y,
    }
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
        let p = r.join_pool(77, 0).unwrap();
        assert_eq!(r.join_pool(77, 1), Some(p));
        assert_eq!(r.find_pool(77), Some(p));
        assert_ne!(r.join_pool(78, 0), Some(p));
        assert_ne!(
            r.instance_slot(p, 0, 0),
            r.instance_slot(p, 1, 0),
            "ids 0 and 1 are two"
        );
        let a = r.instance_slot(p, 5, 0).unwrap();
        let b = r.instance_slot(p, 6, 1).unwrap();
        assert_ne!(a, b);
        assert_eq!(r.instance_slot(p, 5, 1), Some(a));
    }

    #[test]
    fn reclaim_frees_exactly_the_dead_workers_units() {
        let (_, r) = region(3);
        let p = r.join_pool(1, 0).unwrap();
        let s = r.instance_slot(p, 9, 0).unwrap();
        assert_eq!(r.instance_slot(p, 9, 1), Some(s));
        assert!(r.take(p, s, 0, 4) && r.take(p, s, 1, 4) && r.take(p, s, 1, 4));
        r.publish_waiting(p, 1, 2, 3, Some(10), Some(5));
        assert_eq!(r.peers_waiting(p, 0).low, 3);
        assert_eq!(r.reclaim(1), 2);
        assert_eq!(r.held(p, s), 1);
        assert_eq!(r.held_by(p, s, 0), 1);
        assert_eq!(r.peers_waiting(p, 0), PeerWaiting::default());
        assert_eq!(r.instance_users(p, s), 0b01, "it left the cell");
    }

    #[test]
    fn the_layout_is_what_the_hash_covers() {
        // Every word index comes from the structs the hash is computed over.
        assert_eq!(REGION_BYTES, std::mem::size_of::<Layout>());
        assert_eq!(I_LEASE, 1);
        assert_eq!(
            SLOTS_AT,
            LINE * (1 + MAX_WORKERS),
            "head and summaries first"
        );
        assert_eq!(KEYS_AT, POOLS_AT + MAX_POOLS * PoolBlock::WORDS);
        assert_ne!(Slot::HASH, Summary::HASH, "names and offsets are hashed");
    }

    #[test]
    fn an_instance_cell_is_freed_and_reset_when_its_last_worker_leaves() {
        let (_, r) = region(2);
        let p = r.join_pool(1, 0).unwrap();
        let s = r.instance_slot(p, 9, 0).unwrap();
        assert_eq!(r.instance_slot(p, 9, 1), Some(s));
        r.publish_ejection(p, s, 500);
        r.count_failure(p, s);
        assert!(r.take(p, s, 1, 4) && r.give(p, s, 1));
        assert!(!r.leave_instance(p, s, 0));
        assert!(r.leave_instance(p, s, 1));
        assert_eq!(r.instance_cells_used(p), 0);
        let again = r.instance_slot(p, 10, 0).unwrap();
        assert_eq!(again, s, "the freed cell is reused");
        assert_eq!(
            r.ejection(p, again),
            (0, 0),
            "and holds nothing of the old one"
        );
    }

    #[test]
    fn a_hosts_key_allowance_is_spent_never_below_zero_and_outlives_its_member() {
        let (_, r) = region(2);
        let k = r.key_slot(77, 0).unwrap();
        assert_eq!(r.key_slot(77, 1), Some(k));
        assert!(
            !r.allowance_take(k, false, 1000),
            "nothing held before the first chunk"
        );
        r.allowance_add(k, false, 2500, 0);
        assert!(r.allowance_take(k, false, 1000));
        assert!(r.allowance_take(k, false, 1000));
        assert!(
            !r.allowance_take(k, false, 1000),
            "500 left: never below zero"
        );
        assert_eq!(r.allowance(k, false), 500);
        assert_eq!(r.allowance_refused(k, false), 2000);
        assert!(r.any_allowance_refused());
        assert_eq!(r.allowance_drain(k, false), (2000, 2000));
        assert_eq!(r.allowance_drain(k, false), (0, 0));
        assert!(!r.any_allowance_refused());
        // Usage above an estimate leaves a debt; surplus is taken back only as far as held.
        r.allowance_add(k, true, -300, 300);
        assert_eq!(r.allowance(k, true), -300);
        assert_eq!(r.allowance_take_upto(k, true, 100), 0);
        r.allowance_refill(k, true, 1000, 400);
        assert_eq!(r.allowance(k, true), 400, "refilled up to the cap");
        r.allowance_refill(k, true, 1000, 100);
        assert_eq!(r.allowance(k, true), 400, "a refill never lowers");
        assert_eq!(r.allowance_take_upto(k, true, 1000), 400);
        r.set_central(k, false, 7000, 123);
        assert_eq!(r.central(k, false), (7000, 123));
        // The member role moving is another worker reading the same words; the entry is reset
        // only when its last worker leaves.
        assert!(!r.leave_key(k, 0));
        assert_eq!(r.allowance(k, false), 500);
        assert!(r.leave_key(k, 1));
        let again = r.key_slot(78, 0).unwrap();
        assert_eq!(again, k);
        assert_eq!(r.allowance(again, false), 0);
        assert_eq!(r.central(again, false), (0, 0));
    }

    #[test]
    fn buffered_bytes_hold_per_host_and_a_dead_workers_come_back() {
        let (_, r) = region(2);
        assert!(r.take_bytes(0, 600, 1000));
        assert!(!r.take_bytes(1, 500, 1000), "the bound is the host's");
        assert!(r.take_bytes(1, 400, 1000));
        assert_eq!(r.buffered(), 1000);
        assert_eq!(r.reclaim(0), 0);
        assert_eq!((r.buffered(), r.buffered_by(1)), (400, 400));
        r.give_bytes(1, 10_000);
        assert_eq!(r.buffered(), 0);
    }

    #[test]
    fn a_key_bucket_allows_a_minute_then_the_rate() {
        let (_, r) = region(2);
        let k = r.key_slot(77, 0).unwrap();
        assert_eq!(r.key_slot(77, 1), Some(k));
        let now = 1_000_000_000;
        for _ in 0..10 {
            assert_eq!(r.take_bucket(k, false, 1, 10, now), Ok(()));
        }
        assert_eq!(r.take_bucket(k, false, 1, 10, now), Err(6_000_000));
        assert_eq!(r.bucket_level(k, false, 10, now), 0);
        assert_eq!(r.take_bucket(k, false, 1, 10, now + 6_000_000), Ok(()));
        assert_eq!(r.take_bucket(k, true, 11, 10, now), Err(u64::MAX));
        assert_eq!(r.take_bucket(k, true, 8, 10, now), Ok(()));
        r.refund_bucket(k, true, 5, 10, now);
        assert_eq!(r.bucket_level(k, true, 10, now), 7);
        r.charge_bucket(k, true, 20, 10, now);
        assert_eq!(r.bucket_level(k, true, 10, now), 0);
        assert!(!r.leave_key(k, 0));
        assert!(r.leave_key(k, 1));
        assert_eq!(r.key_cells_used(), 0);
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
