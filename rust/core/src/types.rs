//! Shared vocabulary of the core (SPEC §1). The binding exports these enums so Python never
//! copies their values.

/// Request priority class (SPEC §1: `high` = realtime, `low` = batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Priority {
    High,
    Low,
}

impl Priority {
    /// Index into per-class arrays: high = 0, low = 1.
    #[inline]
    pub const fn index(self) -> usize {
        match self {
            Priority::High => 0,
            Priority::Low => 1,
        }
    }
}

/// How the selector picks between the two classes when both wait (SPEC §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Policy {
    /// Smooth weighted round-robin, 7:3 by default, work-conserving.
    #[default]
    Weighted,
    /// High always first (the starvation guard still applies).
    Strict,
}

/// How a granted slot picks its instance (SPEC §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BalancerKind {
    #[default]
    LeastConnections,
    RoundRobin,
    Random,
    P2c,
    /// Consistent hashing with bounded loads on a request's affinity key (SPEC §15); a
    /// request without a key is placed as by `LeastConnections`.
    Affinity,
    /// SPEC §17: the most headroom under the request's objective by each instance's latency
    /// model (without an objective, the lowest predicted latency).
    Predicted,
}

/// Where an affinity-balanced grant landed relative to its key (SPEC §15, the values of
/// `X-Gateway-Affinity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Affinity {
    /// No key, or the pool does not balance by affinity.
    #[default]
    None,
    /// The key's first-choice instance on the hash ring.
    Hit,
    /// A later instance on the ring: the first choice was over its load bound, full,
    /// ejected, cooling or already tried.
    Spill,
}

impl Affinity {
    pub const fn as_str(self) -> &'static str {
        match self {
            Affinity::None => "none",
            Affinity::Hit => "hit",
            Affinity::Spill => "spill",
        }
    }
}

/// Circuit state of one instance (SPEC §6). The names are the `state` strings of /admin/state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstanceState {
    Healthy,
    Ejected,
    HalfOpen,
}

impl InstanceState {
    pub const fn as_str(self) -> &'static str {
        match self {
            InstanceState::Healthy => "healthy",
            InstanceState::Ejected => "ejected",
            InstanceState::HalfOpen => "half_open",
        }
    }
}

/// What an attempt taught us about its instance (SPEC §6, "Passive").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The instance answered well.
    Success,
    /// Connect error, reset, timeout, 5xx, 429, or a 200 carrying an error body.
    Failure,
    /// Says nothing about the instance: a client 4xx, a client that left, a drain.
    Neutral,
}

/// Milliseconds on the caller's monotonic clock. The core never reads a clock itself.
pub type Millis = u64;

/// A request's identity, allocated by the caller in arrival order. It doubles as the
/// arrival sequence number: a retry resubmitted with its original ticket keeps its place.
pub type Ticket = u64;

/// A small integer naming the tenant (API key) a request belongs to; 0 when auth is off.
pub type Tenant = u32;
