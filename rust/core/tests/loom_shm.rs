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
