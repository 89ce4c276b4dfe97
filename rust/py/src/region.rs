//! SPEC §12: the workers' shared region, mapped from a memfd the supervisor created. The
//! mapping is the only `unsafe` of the gateway: it turns the shared pages into the
//! `&'static [AtomicU64]` the core works on. It is never unmapped (a worker keeps it for its
//! whole life; the kernel frees it with the last process), which is what makes `'static` true.

use gateway_core::shm::{self, AtomicU64};
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;

#[pyclass(frozen, module = "gateway._core")]
pub struct Region {
    pub inner: shm::Region<'static>,
}

fn map(fd: i32) -> PyResult<&'static [AtomicU64]> {
    // SAFETY: a fresh shared mapping of `REGION_BYTES` of the file; `mmap` returns page-aligned
    // memory (so aligned for `AtomicU64`), zero-filled where the file was never written, and
    // every access to it goes through atomics (no `&mut`, no non-atomic reads), which is what
    // memory shared with other processes requires. It is never unmapped, so `'static` holds.
    unsafe {
        let ptr = libc::mmap(
            std::ptr::null_mut(),
            shm::REGION_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        );
        if ptr == libc::MAP_FAILED {
            return Err(PyOSError::new_err(
                std::io::Error::last_os_error().to_string(),
            ));
        }
        Ok(std::slice::from_raw_parts(
            ptr as *const AtomicU64,
            shm::REGION_WORDS,
        ))
    }
}

#[pymethods]
impl Region {
    /// Maps the region in file `fd` (at least `REGION_BYTES` long). With `workers`, writes a
    /// fresh header for that many worker slots (the supervisor, once); without, checks the
    /// header (magic, layout version, ABI hash) and refuses a region of another build.
    #[new]
    #[pyo3(signature = (fd, workers = None))]
    fn new(fd: i32, workers: Option<usize>) -> PyResult<Self> {
        // Every atomic the region holds must be lock-free (no per-process fallback lock).
        const _: () = assert!(cfg!(target_has_atomic = "64"));
        let words = map(fd)?;
        let inner = match workers {
            Some(n) => shm::Region::init(words, n),
            None => shm::Region::attach(words),
        }
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self { inner })
    }

    #[getter]
    fn workers(&self) -> usize {
        self.inner.workers()
    }

    /// Marks worker slot `worker` live (the supervisor, after spawning it).
    fn worker_start(&self, worker: usize, incarnation: u64, pid: u64) -> PyResult<()> {
        self.check(worker)?;
        self.inner.worker_start(worker, incarnation, pid);
        Ok(())
    }

    /// (state, incarnation, pid, heartbeat): state 0 free, 1 live, 2 reclaiming; the heartbeat
    /// is the worker's latest monotonic ms + 1 (0: none yet).
    fn worker(&self, worker: usize) -> PyResult<(u64, u64, u64, u64)> {
        self.check(worker)?;
        Ok(self.inner.worker(worker))
    }

    fn heartbeat(&self, worker: usize, now_ms: u64) -> PyResult<()> {
        self.check(worker)?;
        self.inner.heartbeat(worker, now_ms);
        Ok(())
    }

    /// Clears everything a dead (and reaped) worker held; returns the units reclaimed.
    fn reclaim(&self, worker: usize) -> PyResult<u64> {
        self.check(worker)?;
        Ok(self.inner.reclaim(worker))
    }
}

impl Region {
    fn check(&self, worker: usize) -> PyResult<()> {
        if worker >= self.inner.workers() {
            return Err(PyValueError::new_err(format!(
                "worker slot {worker} out of range (0..{})",
                self.inner.workers()
            )));
        }
        Ok(())
    }
}
