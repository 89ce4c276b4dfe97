//! `PlainEvents`: a relayed token stream's common read checked in one call (issue 25). The
//! rules are `gateway_core::sse`'s; this only counts what passed.

use std::sync::atomic::{AtomicU64, Ordering};

use gateway_core::sse;
use pyo3::prelude::*;

/// One stream's check of its reads; see `gateway_core::sse::PlainEvents::plain`.
///
/// Nothing over-aligned may live in here: a Python object's memory is 16-byte aligned, and a
/// stored `memchr::memmem::Finder` (AVX2 vectors, 32-byte alignment) segfaulted on an aligned
/// load whenever the object landed on an odd 16 bytes (the hostile suite's endless stream).
#[pyclass(module = "gateway._core", frozen)]
pub struct PlainEvents {
    inner: sse::PlainEvents,
    passed: AtomicU64,
}

#[pymethods]
impl PlainEvents {
    #[new]
    fn new(max_chunk: usize, max_event: usize, secret: &[u8]) -> Self {
        PlainEvents {
            inner: sse::PlainEvents::new(max_chunk, max_event, secret),
            passed: AtomicU64::new(0),
        }
    }

    /// Whether `read` is one whole chunk holding one plain `data:` event (counted then).
    fn plain(&self, read: &[u8]) -> bool {
        let ok = self.inner.plain(read);
        if ok {
            self.passed.fetch_add(1, Ordering::Relaxed);
        }
        ok
    }

    /// The reads `plain` accepted.
    #[getter]
    fn passed(&self) -> u64 {
        self.passed.load(Ordering::Relaxed)
    }
}
