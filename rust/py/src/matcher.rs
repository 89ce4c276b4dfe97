//! `KeywordSet` over `gateway_core::KeywordSet`.

use gateway_core as core;
use pyo3::prelude::*;

use crate::CoreErr;

/// Finds which of a fixed set of byte patterns occur in a text (Aho-Corasick).
#[pyclass(frozen, module = "gateway._core")]
pub struct KeywordSet {
    inner: core::KeywordSet,
}

#[pymethods]
impl KeywordSet {
    #[new]
    fn new(patterns: Vec<Vec<u8>>) -> Result<Self, CoreErr> {
        Ok(Self {
            inner: core::KeywordSet::new(&patterns)?,
        })
    }

    /// The indices of the patterns that occur in `haystack`, each once, ascending.
    fn present(&self, haystack: &[u8]) -> Vec<usize> {
        self.inner.present(haystack)
    }
}
