//! SPEC §12 "Bounded and reclaimed": a table of cells in the workers' region, each the home
//! of one key (an instance id, a tenant, an API key) while some worker uses it, and free again
//! once none does — lock-free and kill -9 safe like the rest of the region.
//!
//! A cell's *key word* says everything about the cell in one atomic:
//!
//! ```text
//!   bit 63 FREEING   bit 62 PENDING   bits 56..60 owner   bits 48..56 users   bits 0..48 key
//! ```
//!
//! - empty (0): anyone may claim it;
//! - PENDING (owner, key): a worker is claiming it for `key` and checking that nobody else
//!   holds or claims the same key elsewhere (two workers binding a new instance at once must
//!   end in one cell, or the cap would count twice). Nobody uses a pending cell; anyone may
//!   take it back to empty ("steal" it — its claimer simply starts again), so a claimer killed
//!   here blocks nobody;
//! - live (users, key): the workers in `users` use it (one bit each). A worker joins by one CAS
//!   that adds its bit and leaves by one that removes it; the last to leave marks it
//! - FREEING (owner, key): resets the cell's other words, then empties it. A worker killed
//!   between is completed by the supervisor's reclaim (it knows the owner from the word).
//!
//! Uniqueness: a claimer writes PENDING, then reads every other cell (all `SeqCst`, so of two
//! claimers of one key at least one sees the other's write). It gives its own up if the key
//! is live elsewhere or pending at a lower index, steals a pending claim at a higher index,
//! and only then turns its cell live — so a key is live in at most one cell.

#[cfg(loom)]
use loom::hint::spin_loop;
#[cfg(not(loom))]
use std::hint::spin_loop;
use std::sync::atomic::Ordering::SeqCst;

use crate::shm::AtomicU64;

const KEY_MASK: u64 = (1 << 48) - 1;
const USERS_SHIFT: u32 = 48;
const OWNER_SHIFT: u32 = 56;
const PENDING: u64 = 1 << 62;
const FREEING: u64 = 1 << 63;

/// How many times a binder waits for another worker's pending claim of the same key to settle
/// (it settles within that worker's one scan) before stealing it (the claimer may be dead).
#[cfg(not(loom))]
const PATIENCE: u32 = 10_000;
#[cfg(loom)]
const PATIENCE: u32 = 1;

/// The 48-bit key a cell holds for `id` (never 0, the empty cell's).
pub const fn key_of(id: u64) -> u64 {
    let k = id.wrapping_add(1) & KEY_MASK;
    if k == 0 {
        1
    } else {
        k
    }
}

const fn user_bit(worker: usize) -> u64 {
    1 << (USERS_SHIFT + worker as u32)
}

const fn users(v: u64) -> u64 {
    (v >> USERS_SHIFT) & 0xff
}

const fn owner(v: u64) -> usize {
    ((v >> OWNER_SHIFT) & 0xf) as usize
}

/// A live cell: held, neither being claimed nor freed.
pub const fn is_live(v: u64) -> bool {
    v != 0 && v & (PENDING | FREEING) == 0
}

/// The key a cell's word holds (whatever its state).
pub const fn key(v: u64) -> u64 {
    v & KEY_MASK
}

/// The workers using a cell, as a bit set (0 unless live).
pub const fn users_of(v: u64) -> u64 {
    if is_live(v) {
        users(v)
    } else {
        0
    }
}

/// The cell among `n` where `key` lives, joined by `worker` (claimed if no cell holds it).
/// `None`: every cell is taken by other keys. Idempotent: a worker already using the cell
/// gets it again.
pub fn bind<'a>(
    cell: impl Fn(usize) -> &'a AtomicU64,
    n: usize,
    key: u64,
    worker: usize,
) -> Option<usize> {
    let me = user_bit(worker);
    let mut patience = PATIENCE;
    'again: loop {
        let mut pending = None;
        let mut empty = None;
        for k in 0..n {
            let v = cell(k).load(SeqCst);
            if v == 0 {
                empty = empty.or(Some(k));
            } else if v & KEY_MASK == key {
                if is_live(v) {
                    if v & me != 0 {
                        return Some(k);
                    }
                    match cell(k).compare_exchange(v, v | me, SeqCst, SeqCst) {
                        Ok(_) => return Some(k),
                        Err(_) => continue 'again,
                    }
                }
                if v & PENDING != 0 {
                    pending = Some((k, v));
                }
            }
        }
        if let Some((q, v)) = pending {
            // Another worker is claiming the key: it settles within its scan.
            if patience > 0 {
                patience -= 1;
                spin_loop();
            } else {
                // It takes too long (its claimer may be dead): a pending cell is nobody's yet.
                let _ = cell(q).compare_exchange(v, 0, SeqCst, SeqCst);
            }
            continue;
        }
        let c = empty?;
        let claim = PENDING | (worker as u64) << OWNER_SHIFT | key;
        if cell(c).compare_exchange(0, claim, SeqCst, SeqCst).is_err() {
            continue;
        }
        for k in (0..n).filter(|&k| k != c) {
            let v = cell(k).load(SeqCst);
            if v & KEY_MASK != key || v & FREEING != 0 || v == 0 {
                continue;
            }
            let yields =
                is_live(v) || k < c || cell(k).compare_exchange(v, 0, SeqCst, SeqCst).is_err();
            if yields {
                // The key lives (or is claimed first) elsewhere: ours goes back.
                let _ = cell(c).compare_exchange(claim, 0, SeqCst, SeqCst);
                continue 'again;
            }
        }
        if cell(c)
            .compare_exchange(claim, key | me, SeqCst, SeqCst)
            .is_ok()
        {
            return Some(c);
        }
        // Stolen by a claimer at a lower index: start again.
    }
}

/// `worker` leaves a cell; the last to leave resets the cell's other words (`reset`) and
/// empties it — unless `keep()` says the cell still means something with no user (a tenant's
/// grant count ahead of the others': it stays, free to join, until `sweep` frees it). Returns
/// whether it freed the cell.
pub fn unbind(
    cell: &AtomicU64,
    worker: usize,
    keep: impl FnOnce() -> bool,
    reset: impl FnOnce(),
) -> bool {
    let me = user_bit(worker);
    let mut v = cell.load(SeqCst);
    let mut keep = Some(keep);
    let mut kept = false;
    loop {
        if !is_live(v) || v & me == 0 {
            return false;
        }
        let last = users(v) << USERS_SHIFT == me;
        if last && !kept {
            kept = keep.take().is_some_and(|k| k());
        }
        let new = if last && !kept {
            FREEING | (worker as u64) << OWNER_SHIFT | v & KEY_MASK
        } else {
            v & !me
        };
        match cell.compare_exchange(v, new, SeqCst, SeqCst) {
            Ok(_) if new & FREEING != 0 => {
                reset();
                cell.store(0, SeqCst);
                return true;
            }
            Ok(_) => return false,
            Err(now) => v = now,
        }
    }
}

/// Frees a live cell nobody uses (one `unbind` kept), as `worker`. Returns whether it did.
pub fn sweep(cell: &AtomicU64, worker: usize, reset: impl FnOnce()) -> bool {
    let v = cell.load(SeqCst);
    if !is_live(v) || users(v) != 0 {
        return false;
    }
    let freeing = FREEING | (worker as u64) << OWNER_SHIFT | v & KEY_MASK;
    if cell.compare_exchange(v, freeing, SeqCst, SeqCst).is_err() {
        return false; // someone joined it
    }
    reset();
    cell.store(0, SeqCst);
    true
}

/// The supervisor's part for a dead (and reaped) `worker`: its pending claim goes back, a
/// free it began is completed, and it leaves every cell it used. Returns the cells freed.
pub fn reclaim<'a>(
    cell: impl Fn(usize) -> &'a AtomicU64,
    n: usize,
    worker: usize,
    mut reset: impl FnMut(usize),
) -> usize {
    let mut freed = 0;
    for k in 0..n {
        let c = cell(k);
        let v = c.load(SeqCst);
        if v == 0 {
            continue;
        }
        if v & (PENDING | FREEING) != 0 {
            if owner(v) != worker {
                continue;
            }
            if v & FREEING != 0 {
                reset(k);
                freed += 1;
            }
            // Nobody else writes a cell another worker is freeing; a pending one may have been
            // stolen already (then this does nothing).
            let _ = c.compare_exchange(v, 0, SeqCst, SeqCst);
        } else if unbind(c, worker, || false, || reset(k)) {
            freed += 1;
        }
    }
    freed
}

/// Cells in use (live, pending or being freed) among `n`.
pub fn used<'a>(cell: impl Fn(usize) -> &'a AtomicU64, n: usize) -> usize {
    (0..n).filter(|&k| cell(k).load(SeqCst) != 0).count()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn table(n: usize) -> Vec<AtomicU64> {
        (0..n).map(|_| AtomicU64::new(0)).collect()
    }

    #[test]
    fn a_key_binds_once_and_the_last_user_frees_it() {
        let t = table(4);
        let at = |k: usize| &t[k];
        let a = bind(at, 4, key_of(7), 0).unwrap();
        assert_eq!(bind(at, 4, key_of(7), 1), Some(a));
        assert_eq!(bind(at, 4, key_of(7), 1), Some(a), "idempotent");
        assert_ne!(bind(at, 4, key_of(8), 0), Some(a));
        assert_eq!(users_of(t[a].load(SeqCst)), 0b11);
        let mut resets = 0;
        assert!(!unbind(&t[a], 0, || false, || resets += 1));
        assert!(unbind(&t[a], 1, || false, || resets += 1));
        assert_eq!((resets, t[a].load(SeqCst)), (1, 0));
        assert!(!unbind(&t[a], 1, || false, || resets += 1), "not twice");
    }

    #[test]
    fn a_full_table_refuses_and_a_freed_cell_is_reused() {
        let t = table(2);
        let at = |k: usize| &t[k];
        let a = bind(at, 2, key_of(1), 0).unwrap();
        bind(at, 2, key_of(2), 0).unwrap();
        assert_eq!(bind(at, 2, key_of(3), 0), None);
        assert!(unbind(&t[a], 0, || false, || ()));
        assert_eq!(bind(at, 2, key_of(3), 1), Some(a));
        assert_eq!(used(at, 2), 2);
    }

    #[test]
    fn reclaim_completes_what_a_dead_worker_left() {
        let t = table(4);
        let at = |k: usize| &t[k];
        let shared = bind(at, 4, key_of(1), 0).unwrap();
        bind(at, 4, key_of(1), 1).unwrap();
        let alone = bind(at, 4, key_of(2), 1).unwrap();
        // Worker 1 died while claiming key 3 and while freeing key 4.
        t[2].store(PENDING | 1 << OWNER_SHIFT | key_of(3), SeqCst);
        t[3].store(FREEING | 1 << OWNER_SHIFT | key_of(4), SeqCst);
        let mut reset = Vec::new();
        let freed = reclaim(at, 4, 1, |k| reset.push(k));
        assert_eq!(freed, 2, "its own cell and the free it began");
        reset.sort_unstable();
        assert_eq!(reset, vec![alone, 3]);
        assert_eq!(users_of(t[shared].load(SeqCst)), 0b01);
        assert_eq!((t[2].load(SeqCst), t[3].load(SeqCst)), (0, 0));
    }

    #[test]
    fn a_kept_cell_is_joined_again_or_swept() {
        let t = table(2);
        let at = |k: usize| &t[k];
        let a = bind(at, 2, key_of(1), 0).unwrap();
        assert!(!unbind(&t[a], 0, || true, || ()));
        assert!(is_live(t[a].load(SeqCst)) && users_of(t[a].load(SeqCst)) == 0);
        assert_eq!(bind(at, 2, key_of(1), 1), Some(a), "joined again");
        assert!(!sweep(&t[a], 0, || ()), "not while used");
        assert!(!unbind(&t[a], 1, || true, || ()));
        assert!(sweep(&t[a], 0, || ()));
        assert_eq!(used(at, 2), 0);
    }

    #[test]
    fn a_stale_pending_claim_is_stolen() {
        let t = table(3);
        let at = |k: usize| &t[k];
        t[0].store(PENDING | 3 << OWNER_SHIFT | key_of(5), SeqCst);
        let k = bind(at, 3, key_of(5), 0).unwrap();
        assert!(is_live(t[k].load(SeqCst)));
        assert_eq!(used(at, 3), 1);
    }
}
