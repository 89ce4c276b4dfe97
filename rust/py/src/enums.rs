//! The core's enums, exported so Python never copies their values.

use gateway_core as core;
use pyo3::prelude::*;

macro_rules! mirror_enum {
    ($(#[$doc:meta])* $py:ident => $core:ident { $($variant:ident = $cv:ident),+ $(,)? }) => {
        $(#[$doc])*
        #[pyclass(eq, eq_int, frozen, hash, from_py_object, module = "gateway._core")]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[allow(clippy::upper_case_acronyms, non_camel_case_types)]
        pub enum $py {
            $($variant),+
        }

        impl From<$py> for core::$core {
            fn from(v: $py) -> Self {
                match v {
                    $($py::$variant => core::$core::$cv),+
                }
            }
        }

        impl From<core::$core> for $py {
            fn from(v: core::$core) -> Self {
                match v {
                    $(core::$core::$cv => $py::$variant),+
                }
            }
        }
    };
}

mirror_enum!(
    /// Request class: HIGH (realtime) or LOW (batch).
    Priority => Priority { HIGH = High, LOW = Low }
);
mirror_enum!(
    /// Class selection when both wait: WEIGHTED (smooth WRR) or STRICT.
    Policy => Policy { WEIGHTED = Weighted, STRICT = Strict }
);
mirror_enum!(
    /// Instance selection policy.
    Balancer => BalancerKind {
        LEAST_CONNECTIONS = LeastConnections,
        ROUND_ROBIN = RoundRobin,
        RANDOM = Random,
        P2C = P2c,
        AFFINITY = Affinity,
        PREDICTED = Predicted,
    }
);
mirror_enum!(
    /// Where an affinity-balanced grant landed: NONE (no key, or not an affinity pool), HIT
    /// (its key's first choice on the ring) or SPILL (a later instance on the ring).
    Affinity => Affinity { NONE = None, HIT = Hit, SPILL = Spill }
);
mirror_enum!(
    /// Circuit state of an instance.
    InstanceState => InstanceState { HEALTHY = Healthy, EJECTED = Ejected, HALF_OPEN = HalfOpen }
);
mirror_enum!(
    /// What an attempt says about its instance.
    Outcome => Outcome { SUCCESS = Success, FAILURE = Failure, NEUTRAL = Neutral }
);

/// What happened to a waiting ticket (see `Event`).
#[pyclass(eq, eq_int, frozen, hash, from_py_object, module = "gateway._core")]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms)]
pub enum EventKind {
    /// A slot was granted: send the request to `Event.instance` now.
    GRANTED,
    /// It waited longer than its class's `max_wait_ms` (SPEC §3 "Deadlines").
    EXPIRED,
    /// No instance it may use is available: the fallback pool, or 503 after
    /// `Event.retry_after_ms`.
    UNSERVABLE,
    /// SPEC §17 `scheduler.shed_unattainable`: its objective was lost while it waited: 503
    /// `slo_unattainable` after `Event.retry_after_ms`.
    UNATTAINABLE,
}

#[pymethods]
impl Priority {
    /// The spec's name: "high" or "low".
    #[getter]
    fn label(&self) -> &'static str {
        match self {
            Priority::HIGH => "high",
            Priority::LOW => "low",
        }
    }
}

#[pymethods]
impl Affinity {
    /// The `X-Gateway-Affinity` value: "none", "hit" or "spill".
    #[getter]
    fn label(&self) -> &'static str {
        core::Affinity::from(*self).as_str()
    }
}

#[pymethods]
impl InstanceState {
    /// The /admin/state name: "healthy", "ejected" or "half_open".
    #[getter]
    fn label(&self) -> &'static str {
        core::InstanceState::from(*self).as_str()
    }
}
