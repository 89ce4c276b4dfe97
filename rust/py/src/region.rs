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
    /// This process's uses of the region's cells, shared by every pool attached through this
    /// mapping (SPEC §12 "bounded and reclaimed": a worker may hold two pools of one name, a
    /// removed one draining beside its successor; see `gateway_core::shared::Joins`).
    pub joins: gateway_core::shared::Joins,
}

/// SPEC §12 "a region file of the wrong size or without its seals is refused": mapping a file
/// shorter than the region would SIGBUS the process at the first access past its end, and one
/// that can still shrink could be cut under the workers. The supervisor (`init`) seals a
/// memfd that lacks the seals; a worker refuses one that lacks them.
fn check_fd(fd: i32, init: bool) -> PyResult<()> {
    // SAFETY: `fstat` writes into the zeroed `stat` we own; `fcntl` takes plain integers.
    let (size, seals) = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut st) != 0 {
            return Err(PyOSError::new_err(format!(
                "shared region fd {fd}: {}",
                std::io::Error::last_os_error()
            )));
        }
        (st.st_size, libc::fcntl(fd, libc::F_GET_SEALS))
    };
    if size != shm::REGION_BYTES as libc::off_t {
        return Err(PyValueError::new_err(format!(
            "shared region file is {size} bytes, this build's region is {} bytes: \
             refused (a region of another gateway version, or not a region at all)",
            shm::REGION_BYTES
        )));
    }
    let need = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
    if seals >= 0 && seals & need == need {
        return Ok(());
    }
    // SAFETY: as above.
    if init && seals >= 0 && unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, need) } == 0 {
        return Ok(());
    }
    Err(PyValueError::new_err(
        "shared region file is not sealed against shrinking and growing (F_SEAL_SHRINK, \
         F_SEAL_GROW): refused, it could be cut under the workers (a memfd created with \
         MFD_ALLOW_SEALING and sealed by the supervisor is expected)",
    ))
}

fn map(fd: i32) -> PyResult<&'static [AtomicU64]> {
    // SAFETY: a fresh shared mapping of `REGION_BYTES` of a file `check_fd` found exactly that
    // long and sealed against shrinking (so no access can fault); `mmap` returns page-aligned
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
    /// Maps the region in file `fd`, which must be exactly `REGION_BYTES` long and sealed
    /// against shrinking and growing (the supervisor's `init` adds the seals if it can). With
    /// `workers`, writes a fresh header for that many worker slots (the supervisor, once);
    /// without, checks the header (magic, layout version, ABI hash) and refuses a region of
    /// another build.
    #[new]
    #[pyo3(signature = (fd, workers = None))]
    fn new(fd: i32, workers: Option<usize>) -> PyResult<Self> {
        // Every atomic the region holds must be lock-free (no per-process fallback lock).
        const _: () = assert!(cfg!(target_has_atomic = "64"));
        check_fd(fd, workers.is_some())?;
        let words = map(fd)?;
        let inner = match workers {
            Some(n) => shm::Region::init(words, n),
            None => shm::Region::attach(words),
        }
        .map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(Self {
            inner,
            joins: gateway_core::shared::Joins::default(),
        })
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

    // ---- SPEC §12 whole-gateway limits across workers ----------------------------------

    /// SPEC §16 `limits.max_buffered_bytes` per host: worker `worker` holds `n` more bytes if
    /// every worker's together stay within `max` (else nothing changes).
    fn take_bytes(&self, worker: usize, n: u64, max: u64) -> PyResult<bool> {
        self.check(worker)?;
        Ok(self.inner.take_bytes(worker, n, max))
    }

    fn give_bytes(&self, worker: usize, n: u64) -> PyResult<()> {
        self.check(worker)?;
        self.inner.give_bytes(worker, n);
        Ok(())
    }

    /// Request bytes held by every worker of the host.
    #[getter]
    fn buffered(&self) -> u64 {
        self.inner.buffered()
    }

    fn buffered_by(&self, worker: usize) -> PyResult<u64> {
        self.check(worker)?;
        Ok(self.inner.buffered_by(worker))
    }

    /// The entry of API key `key_id` (a stable hash of its name) for `worker`, or `None` when
    /// the key table is full.
    fn key_slot(&self, key_id: u64, worker: usize) -> PyResult<Option<usize>> {
        self.check(worker)?;
        Ok(self.inner.key_slot(key_id, worker))
    }

    fn leave_key(&self, slot: usize, worker: usize) -> PyResult<bool> {
        self.check(worker)?;
        Self::check_key(slot)?;
        Ok(self.inner.leave_key(slot, worker))
    }

    /// Takes `cost` from key entry `slot`'s request (`tokens` false) or token bucket of
    /// `per_minute`: 0 if taken, else µs until it would be (2**64-1: never).
    fn take_bucket(
        &self,
        slot: usize,
        tokens: bool,
        cost: u64,
        per_minute: u64,
        now_us: u64,
    ) -> PyResult<u64> {
        Self::check_key(slot)?;
        Ok(self
            .inner
            .take_bucket(slot, tokens, cost, per_minute, now_us)
            .map_or_else(|wait| wait.max(1), |()| 0))
    }

    fn refund_bucket(
        &self,
        slot: usize,
        tokens: bool,
        cost: u64,
        per_minute: u64,
        now_us: u64,
    ) -> PyResult<()> {
        Self::check_key(slot)?;
        self.inner
            .refund_bucket(slot, tokens, cost, per_minute, now_us);
        Ok(())
    }

    fn charge_bucket(
        &self,
        slot: usize,
        tokens: bool,
        cost: u64,
        per_minute: u64,
        now_us: u64,
    ) -> PyResult<()> {
        Self::check_key(slot)?;
        self.inner
            .charge_bucket(slot, tokens, cost, per_minute, now_us);
        Ok(())
    }

    fn bucket_level(
        &self,
        slot: usize,
        tokens: bool,
        per_minute: u64,
        now_us: u64,
    ) -> PyResult<u64> {
        Self::check_key(slot)?;
        Ok(self.inner.bucket_level(slot, tokens, per_minute, now_us))
    }

    /// SPEC §13 × §12: spends `cost` of key entry `slot`'s host allowance (requests, or
    /// `tokens`) if held, else counts it refused: whether it was spent.
    fn allowance_take(&self, slot: usize, tokens: bool, cost: u64) -> PyResult<bool> {
        Self::check_key(slot)?;
        Ok(self.inner.allowance_take(slot, tokens, cost))
    }

    /// Adds `delta` (may be negative) to the allowance and `spent` to the spending count.
    fn allowance_add(&self, slot: usize, tokens: bool, delta: i64, spent: i64) -> PyResult<()> {
        Self::check_key(slot)?;
        self.inner.allowance_add(slot, tokens, delta, spent);
        Ok(())
    }

    /// Takes up to `amount` out of the allowance (never below zero): what it took.
    fn allowance_take_upto(&self, slot: usize, tokens: bool, amount: u64) -> PyResult<u64> {
        Self::check_key(slot)?;
        Ok(self.inner.allowance_take_upto(slot, tokens, amount))
    }

    /// Raises the allowance by `add`, not past `cap` (never lowers it).
    fn allowance_refill(&self, slot: usize, tokens: bool, add: u64, cap: u64) -> PyResult<()> {
        Self::check_key(slot)?;
        self.inner.allowance_refill(slot, tokens, add, cap);
        Ok(())
    }

    fn allowance(&self, slot: usize, tokens: bool) -> PyResult<i64> {
        Self::check_key(slot)?;
        Ok(self.inner.allowance(slot, tokens))
    }

    /// (spent, refused) since the last drain; both start again from zero.
    fn allowance_drain(&self, slot: usize, tokens: bool) -> PyResult<(i64, u64)> {
        Self::check_key(slot)?;
        Ok(self.inner.allowance_drain(slot, tokens))
    }

    fn allowance_refused(&self, slot: usize, tokens: bool) -> PyResult<u64> {
        Self::check_key(slot)?;
        Ok(self.inner.allowance_refused(slot, tokens))
    }

    /// Whether any key entry counted a refusal since its last drain.
    fn any_allowance_refused(&self) -> bool {
        self.inner.any_allowance_refused()
    }

    fn set_central(&self, slot: usize, tokens: bool, level: u64, at_us: u64) -> PyResult<()> {
        Self::check_key(slot)?;
        self.inner.set_central(slot, tokens, level, at_us);
        Ok(())
    }

    /// The central level the member last saw, and when (µs, monotonic).
    fn central(&self, slot: usize, tokens: bool) -> PyResult<(u64, u64)> {
        Self::check_key(slot)?;
        Ok(self.inner.central(slot, tokens))
    }

    /// SPEC §16 what the region's tables hold: (instance cells in use, per pool in use — so
    /// its length is the pools in use; tenant entries in use, likewise; API key entries in
    /// use).
    fn tables(&self) -> (Vec<usize>, Vec<usize>, usize) {
        let pools: Vec<usize> = (0..shm::MAX_POOLS)
            .filter(|&p| self.inner.pool_in_use(p))
            .collect();
        (
            pools
                .iter()
                .map(|&p| self.inner.instance_cells_used(p))
                .collect(),
            pools
                .iter()
                .map(|&p| self.inner.tenant_cells_used(p))
                .collect(),
            self.inner.key_cells_used(),
        )
    }
}

impl Region {
    fn check_key(slot: usize) -> PyResult<()> {
        if slot >= shm::MAX_KEYS {
            return Err(PyValueError::new_err(format!(
                "key entry {slot} out of range (0..{})",
                shm::MAX_KEYS
            )));
        }
        Ok(())
    }

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
