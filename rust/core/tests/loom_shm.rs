//! SPEC §12 under loom: every interleaving of workers taking and giving units of one instance,
//! one of them killed after each of its steps and reclaimed by the supervisor.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p gateway-core --test loom_shm --release`.
#![cfg(loom)]

use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::Ordering::Acquire;
use loom::sync::Arc;
use loom::thread;

use gateway_core::shm::{clear, field, field_bits, give, sum, take};

const CAP: u64 = 2;

/// Every interleaving with up to three preemptions (loom's recommended bound: bugs need few).
fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

/// A live worker: takes a unit if one is free, checks the cap, gives it back.
fn live(word: Arc<AtomicU64>, w: usize, bits: u32) {
    if take(&word, w, bits, CAP) {
        assert!(sum(word.load(Acquire), bits) <= CAP, "over the cap");
        assert!(give(&word, w, bits));
    }
}

#[test]
fn the_cap_holds_and_a_killed_worker_leaks_nothing_after_reclaim() {
    // The killed worker runs take; give; take and dies after step `k` (0..=3).
    for k in 0..=3 {
        model(move || {
            let bits = field_bits(3);
            let word = Arc::new(AtomicU64::new(0));
            let victim = {
                let word = word.clone();
                thread::spawn(move || {
                    let mut held = 0u64;
                    let steps: [fn(&AtomicU64, u32) -> bool; 3] = [
                        |w, b| take(w, 0, b, CAP),
                        |w, b| give(w, 0, b),
                        |w, b| take(w, 0, b, CAP),
                    ];
                    for (i, step) in steps.iter().enumerate().take(k) {
                        let done = step(&word, bits);
                        if done {
                            held = if i == 1 { held - 1 } else { held + 1 };
                        }
                        assert!(sum(word.load(Acquire), bits) <= CAP, "over the cap");
                    }
                    held
                })
            };
            let others: Vec<_> = (1..2)
                .map(|w| {
                    let word = word.clone();
                    thread::spawn(move || live(word, w, bits))
                })
                .collect();
            // The supervisor fences (waits for the exit), then reclaims exactly what it held.
            let held = victim.join().unwrap();
            assert_eq!(field(word.load(Acquire), 0, bits), held);
            assert_eq!(clear(&word, 0, bits), held);
            for t in others {
                t.join().unwrap();
            }
            assert_eq!(word.load(Acquire), 0, "everything given back or reclaimed");
        });
    }
}

#[test]
fn a_unit_given_back_is_taken_by_exactly_one_waiter() {
    model(|| {
        let bits = field_bits(2);
        let word = Arc::new(AtomicU64::new(0));
        assert!(take(&word, 0, bits, 1));
        let racers: Vec<_> = (0..2)
            .map(|w| {
                let word = word.clone();
                thread::spawn(move || take(&word, w, bits, 1))
            })
            .collect();
        assert!(give(&word, 0, bits));
        let won: usize = racers
            .into_iter()
            .map(|t| usize::from(t.join().unwrap()))
            .sum();
        assert!(won <= 1);
        assert_eq!(sum(word.load(Acquire), bits), won as u64);
    });
}

/// No lost wake-up (SPEC §12): a worker frees a unit (give, fence, read who waits) while
/// another arrives to a full instance (publish that it waits, fence, read the units). Either
/// the arrival sees the free unit and takes it, or the releaser sees the waiter and wakes it.
#[test]
fn a_freed_unit_and_a_new_waiter_always_meet() {
    use loom::sync::atomic::{fence, Ordering::SeqCst};
    model(|| {
        let bits = field_bits(2);
        let lease = Arc::new(AtomicU64::new(0));
        let waiting = Arc::new(AtomicU64::new(0));
        assert!(take(&lease, 0, bits, 1));
        let releaser = {
            let (lease, waiting) = (lease.clone(), waiting.clone());
            thread::spawn(move || {
                assert!(give(&lease, 0, bits));
                fence(SeqCst);
                waiting.load(SeqCst) != 0 // wakes the waiter
            })
        };
        let arrival = {
            let (lease, waiting) = (lease.clone(), waiting.clone());
            thread::spawn(move || {
                waiting.store(1, SeqCst);
                fence(SeqCst);
                take(&lease, 1, bits, 1) // self-dispatch
            })
        };
        let woke = releaser.join().unwrap();
        let took = arrival.join().unwrap();
        assert!(
            woke || took,
            "the free unit and the waiter missed each other"
        );
    });
}

// ---- SPEC §12 "Bounded and reclaimed": the cells' claim, join, leave and reclaim (cells.rs) --

mod cells_model {
    use super::*;
    use gateway_core::cells::{bind, is_live, key_of, reclaim, unbind, users_of};
    use loom::sync::atomic::Ordering::Release;

    const N: usize = 3;

    fn table() -> Arc<Vec<AtomicU64>> {
        Arc::new((0..N).map(|_| AtomicU64::new(0)).collect())
    }

    /// Cells holding `key` live.
    fn live_cells(t: &[AtomicU64], key: u64) -> usize {
        t.iter()
            .filter(|c| {
                let v = c.load(Acquire);
                is_live(v) && v & ((1 << 48) - 1) == key
            })
            .count()
    }

    #[test]
    fn two_workers_binding_a_new_key_at_once_end_in_one_cell() {
        model(|| {
            let t = table();
            let key = key_of(7);
            let racers: Vec<_> = (0..2)
                .map(|w| {
                    let t = t.clone();
                    thread::spawn(move || bind(|k| &t[k], N, key, w))
                })
                .collect();
            let got: Vec<_> = racers.into_iter().map(|r| r.join().unwrap()).collect();
            assert!(got[0].is_some() && got[0] == got[1], "one cell: {got:?}");
            assert_eq!(live_cells(&t, key), 1);
            assert_eq!(users_of(t[got[0].unwrap()].load(Acquire)), 0b11);
        });
    }

    #[test]
    fn a_cell_is_never_freed_under_a_worker_that_joins_it() {
        model(|| {
            let t = table();
            let data = Arc::new(AtomicU64::new(5)); // the cell's other words
            let key = key_of(7);
            let k = bind(|k| &t[k], N, key, 0).unwrap();
            let leaver = {
                let (t, data) = (t.clone(), data.clone());
                thread::spawn(move || {
                    unbind(&t[k], 0, || false, || data.store(0, Release));
                })
            };
            let joiner = {
                let (t, data) = (t.clone(), data.clone());
                thread::spawn(move || {
                    let got = bind(|k| &t[k], N, key, 1);
                    (got, data.load(Acquire))
                })
            };
            leaver.join().unwrap();
            let (got, seen) = joiner.join().unwrap();
            let v = t[got.unwrap()].load(Acquire);
            assert!(
                is_live(v) && users_of(v) == 0b10,
                "the joiner holds a live cell"
            );
            assert_eq!(live_cells(&t, key), 1);
            if got == Some(k) && seen == 5 {
                // It joined the old cell before the leave (`data` is cell k's): the leaver was
                // not the last user, so nothing of the cell was reset under it.
                assert_eq!(data.load(Acquire), 5);
            }
        });
    }

    #[test]
    fn a_claim_left_by_a_killed_worker_blocks_nobody() {
        model(|| {
            let t = table();
            let key = key_of(7);
            // Worker 1 was killed while claiming: its pending claim is in cell 0.
            t[0].store(1 << 62 | 1 << 56 | key, Release);
            let binder = {
                let t = t.clone();
                thread::spawn(move || bind(|k| &t[k], N, key, 0))
            };
            // The supervisor reclaims worker 1 meanwhile.
            reclaim(|k| &t[k], N, 1, |_| ());
            let got = binder.join().unwrap().unwrap();
            assert_eq!(users_of(t[got].load(Acquire)), 0b01);
            assert_eq!(live_cells(&t, key), 1);
        });
    }

    #[test]
    fn a_dead_workers_cells_are_left_and_freed_once() {
        model(|| {
            let t = table();
            let resets = Arc::new(AtomicU64::new(0));
            let key = key_of(7);
            let k = bind(|k| &t[k], N, key, 0).unwrap();
            assert_eq!(bind(|k| &t[k], N, key, 1), Some(k));
            // Worker 1 (alive) leaves while the supervisor reclaims dead worker 0.
            let leaver = {
                let (t, resets) = (t.clone(), resets.clone());
                thread::spawn(move || {
                    unbind(
                        &t[k],
                        1,
                        || false,
                        || {
                            resets.fetch_add(1, Release);
                        },
                    );
                })
            };
            reclaim(
                |k| &t[k],
                N,
                0,
                |_| {
                    resets.fetch_add(1, Release);
                },
            );
            leaver.join().unwrap();
            assert_eq!(resets.load(Acquire), 1, "freed exactly once");
            assert_eq!(t[k].load(Acquire), 0);
        });
    }
}
