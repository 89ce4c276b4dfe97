//! SPEC §12: the binding turns mapped pages into `&[AtomicU64]` (rust/py/src/region.rs). The
//! same cast over a heap buffer, for Miri (`cargo +nightly miri test --test region_cast`):
//! alignment, bounds and every access through atomics.

use std::sync::atomic::AtomicU64;

use gateway_core::shm::{Region, REGION_WORDS};

#[test]
fn a_zeroed_buffer_cast_to_atomics_is_a_valid_region() {
    let buffer: Vec<u64> = vec![0; REGION_WORDS];
    let buffer = buffer.leak();
    // SAFETY: as the binding's (a raw pointer with write permission: `as_mut_ptr`, as mmap's
    // is; Miri rejects one from a shared borrow): `u64` and `AtomicU64` have the same size and
    // alignment, the buffer lives for the rest of the program, and after this every access is
    // atomic.
    let words: &'static [AtomicU64] = unsafe {
        std::slice::from_raw_parts(buffer.as_mut_ptr().cast::<AtomicU64>(), REGION_WORDS)
    };
    let r = Region::init(words, 2).unwrap();
    let again = Region::attach(words).unwrap();
    let p = r.join_pool(3, 0).unwrap();
    let s = r.instance_slot(p, 4, 0).unwrap();
    assert!(r.take(p, s, 0, 1));
    assert!(!again.take(p, s, 1, 1));
    assert_eq!(again.reclaim(0), 1);
    assert!(again.take(p, s, 1, 1));
}
