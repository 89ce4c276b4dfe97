//! The gateway's scheduling core: per pool, a bounded dual queue (high/low, fair across
//! tenants), the class selector (smooth weighted round-robin or strict, with a starvation
//! guard), the instance balancer over in-flight counters (with consistent hashing with bounded
//! loads for prefix affinity), and each instance's health state; beside them, the check of a
//! relayed token stream's common read (`sse`).
//!
//! Pure Rust: no Python, no I/O, no clock and no global randomness. Time comes in as an
//! argument in milliseconds; randomness from a seeded generator. The rules implemented are
//! those of SPEC §3, §5, §6, §15 and §17; each is quoted beside the line that implements it.
#![forbid(unsafe_code)]

pub mod adaptive;
pub mod affinity;
pub mod balancer;
pub mod cells;
pub mod error;
pub mod health;
pub mod instance;
pub mod json;
pub mod latency;
pub mod matcher;
mod peers;
pub mod pool;
pub mod prefix;
pub mod queue;
pub mod rng;
pub mod selector;
pub mod shared;
pub mod shm;
pub mod sse;
pub mod types;

pub use affinity::HashRing;
pub use balancer::{Balancer, Load};
pub use error::CoreError;
pub use health::{Breaker, HealthConfig};
pub use matcher::KeywordSet;
pub use pool::{
    Admit, Event, EventKind, Instance, InstanceExtra, InstanceModel, ModelView, Pool, PoolConfig,
    PoolStats, Request, MAX_INSTANCES,
};
pub use selector::{Choice, Selector, SelectorConfig};
pub use types::{
    Affinity, BalancerKind, InstanceState, Millis, Outcome, Policy, Priority, Tenant, Ticket,
};
