//! The core's one error type; the binding maps it to the `GatewayError` exception tree.

use std::fmt;

use crate::types::{Millis, Ticket};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoreError {
    /// SPEC §3 "Overflow": no room in the class queue (nor in low, when high spills).
    QueueFull {
        retry_after_ms: Millis,
    },
    /// SPEC §6: no instance of the pool may be tried now.
    NoHealthyInstance {
        retry_after_ms: Millis,
    },
    /// A ticket that is not waiting/granted (double release, unknown id) or already queued.
    UnknownTicket(Ticket),
    DuplicateTicket(Ticket),
    /// An instance index outside the pool.
    UnknownInstance(usize),
    /// A configuration value the core cannot work with.
    InvalidConfig(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::QueueFull { retry_after_ms } => {
                write!(f, "queue full; retry after {retry_after_ms} ms")
            }
            CoreError::NoHealthyInstance { retry_after_ms } => {
                write!(f, "no healthy instance; retry after {retry_after_ms} ms")
            }
            CoreError::UnknownTicket(t) => write!(f, "ticket {t} is not waiting or granted"),
            CoreError::DuplicateTicket(t) => write!(f, "ticket {t} is already waiting or granted"),
            CoreError::UnknownInstance(i) => write!(f, "no instance with index {i}"),
            CoreError::InvalidConfig(msg) => write!(f, "invalid configuration: {msg}"),
        }
    }
}

impl std::error::Error for CoreError {}
