//! `gateway._core`: the Python face of `gateway-core`. Argument conversion, `#[pyclass]`
//! wrappers and error mapping — nothing else; every decision is made in the core.

use gateway_core as core;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

mod access;
mod enums;
mod matcher;
mod otlp;
mod pool;
mod region;
mod sse;

use access::LineBuffer;
use enums::{Affinity, Balancer, EventKind, InstanceState, Outcome, Policy, Priority};
use matcher::KeywordSet;
use pool::{Event, InstanceInfo, Pool, PoolConfig, PoolStats};
use region::Region;
use sse::PlainEvents;

create_exception!(
    gateway._core,
    GatewayError,
    PyException,
    "Base of every error the gateway raises."
);
create_exception!(
    gateway._core,
    QueueFull,
    GatewayError,
    "No queue room for the request; `retry_after_ms` says when to try again."
);
create_exception!(
    gateway._core,
    NoHealthyInstance,
    GatewayError,
    "No instance the request may use can be tried now; `retry_after_ms` says when one may."
);
create_exception!(
    gateway._core,
    UnknownTicket,
    GatewayError,
    "A ticket released twice, or not known to the pool."
);
create_exception!(
    gateway._core,
    DuplicateTicket,
    GatewayError,
    "A ticket submitted while the pool still holds it."
);
create_exception!(
    gateway._core,
    InvalidPoolConfig,
    GatewayError,
    "A scheduler value the core cannot work with."
);

/// The core's error, wrapped so it can convert into a Python exception (orphan rule).
pub struct CoreErr(core::CoreError);

impl From<core::CoreError> for CoreErr {
    fn from(e: core::CoreError) -> Self {
        Self(e)
    }
}

/// An exception carrying `retry_after_ms` as a typed attribute (never in `args`).
fn with_retry_after(err: PyErr, retry_after_ms: u64) -> PyErr {
    Python::attach(|py| {
        // Setting an attribute on a fresh exception instance cannot fail in practice; if it
        // did, the error itself still propagates (callers default to 1 s).
        let _ = err.value(py).setattr("retry_after_ms", retry_after_ms);
    });
    err
}

impl From<CoreErr> for PyErr {
    fn from(CoreErr(e): CoreErr) -> PyErr {
        let msg = e.to_string();
        match e {
            core::CoreError::QueueFull { retry_after_ms } => {
                with_retry_after(QueueFull::new_err(msg), retry_after_ms)
            }
            core::CoreError::NoHealthyInstance { retry_after_ms } => {
                with_retry_after(NoHealthyInstance::new_err(msg), retry_after_ms)
            }
            core::CoreError::UnknownTicket(_) => UnknownTicket::new_err(msg),
            core::CoreError::DuplicateTicket(_) => DuplicateTicket::new_err(msg),
            core::CoreError::UnknownInstance(_) | core::CoreError::InvalidConfig(_) => {
                InvalidPoolConfig::new_err(msg)
            }
        }
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Priority>()?;
    m.add_class::<Policy>()?;
    m.add_class::<Balancer>()?;
    m.add_class::<Affinity>()?;
    m.add_class::<InstanceState>()?;
    m.add_class::<Outcome>()?;
    m.add_class::<EventKind>()?;
    m.add_class::<Event>()?;
    m.add_class::<PoolConfig>()?;
    m.add_class::<Pool>()?;
    m.add_class::<InstanceInfo>()?;
    m.add_class::<pool::Prefix>()?;
    m.add_class::<PoolStats>()?;
    m.add_class::<KeywordSet>()?;
    m.add_class::<Region>()?;
    m.add_class::<LineBuffer>()?;
    m.add_class::<PlainEvents>()?;
    m.add_function(wrap_pyfunction!(otlp::otlp_spans, m)?)?;
    m.add("REGION_BYTES", core::shm::REGION_BYTES)?;
    m.add("MAX_WORKERS", core::shm::MAX_WORKERS)?;
    m.add("MAX_KEYS", core::shm::MAX_KEYS)?;
    m.add("GatewayError", py.get_type::<GatewayError>())?;
    m.add("QueueFull", py.get_type::<QueueFull>())?;
    m.add("NoHealthyInstance", py.get_type::<NoHealthyInstance>())?;
    m.add("UnknownTicket", py.get_type::<UnknownTicket>())?;
    m.add("DuplicateTicket", py.get_type::<DuplicateTicket>())?;
    m.add("InvalidPoolConfig", py.get_type::<InvalidPoolConfig>())?;
    m.add("MAX_INSTANCES", core::MAX_INSTANCES)?;
    Ok(())
}
