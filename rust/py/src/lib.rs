//! `gateway._core`: the Python face of `gateway-core`. Argument conversion, `#[pyclass]`
//! wrappers and error mapping — nothing else; every decision is made in the core.

use gateway_core as core;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

mod enums;
mod matcher;
mod pool;

use enums::{Balancer, InstanceState, Outcome, Policy, Priority};
use matcher::KeywordSet;
use pool::{InstanceInfo, Pool, PoolConfig, PoolStats};

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
    "No queue room for the request. args: (message, retry_after_ms)."
);
create_exception!(
    gateway._core,
    NoHealthyInstance,
    GatewayError,
    "No instance the request may use can be tried now. args: (message, retry_after_ms)."
);
create_exception!(
    gateway._core,
    UnknownTicket,
    GatewayError,
    "A ticket released twice, or not known to the pool."
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

impl From<CoreErr> for PyErr {
    fn from(CoreErr(e): CoreErr) -> PyErr {
        let msg = e.to_string();
        match e {
            core::CoreError::QueueFull { retry_after_ms } => {
                QueueFull::new_err((msg, retry_after_ms))
            }
            core::CoreError::NoHealthyInstance { retry_after_ms } => {
                NoHealthyInstance::new_err((msg, retry_after_ms))
            }
            core::CoreError::UnknownTicket(_) | core::CoreError::DuplicateTicket(_) => {
                UnknownTicket::new_err(msg)
            }
            core::CoreError::UnknownInstance(_) | core::CoreError::InvalidConfig(_) => {
                InvalidPoolConfig::new_err(msg)
            }
        }
    }
}

/// `submit` result: queued in the class asked for.
const QUEUED: i64 = -1;
/// `submit` result: a high request found the high queue full and waits as low.
const SPILLED: i64 = -2;
/// Event code: the ticket waited past its class's `max_wait_ms`.
const EXPIRED: i64 = -3;
/// Event code: no instance the ticket may use is available; try the fallback or answer 503.
const UNSERVABLE: i64 = -4;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<Priority>()?;
    m.add_class::<Policy>()?;
    m.add_class::<Balancer>()?;
    m.add_class::<InstanceState>()?;
    m.add_class::<Outcome>()?;
    m.add_class::<PoolConfig>()?;
    m.add_class::<Pool>()?;
    m.add_class::<InstanceInfo>()?;
    m.add_class::<PoolStats>()?;
    m.add_class::<KeywordSet>()?;
    m.add("GatewayError", py.get_type::<GatewayError>())?;
    m.add("QueueFull", py.get_type::<QueueFull>())?;
    m.add("NoHealthyInstance", py.get_type::<NoHealthyInstance>())?;
    m.add("UnknownTicket", py.get_type::<UnknownTicket>())?;
    m.add("InvalidPoolConfig", py.get_type::<InvalidPoolConfig>())?;
    m.add("QUEUED", QUEUED)?;
    m.add("SPILLED", SPILLED)?;
    m.add("EXPIRED", EXPIRED)?;
    m.add("UNSERVABLE", UNSERVABLE)?;
    m.add("MAX_INSTANCES", core::MAX_INSTANCES)?;
    Ok(())
}
