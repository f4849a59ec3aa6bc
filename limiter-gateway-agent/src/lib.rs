//! limiter-gateway-agent: rate limiting embedded in a Rust proxy.
//!
//! The agent holds leased batches of units from the token owner and decides locally,
//! with atomics only, while its balance lasts ([`Agent::decide_local`]); when it runs
//! out it asks the owner within a small budget ([`Agent::decide`]); a background task
//! renews leases before they run dry, one call per owner carrying every due key.
//! When the owner cannot be reached (timeouts open a circuit breaker), each route
//! follows its failure policy: `fail_open` admits up to a local emergency ceiling
//! (`EMERGENCY_CEILING` past it), `fail_closed` answers `LIMITER_UNAVAILABLE`. The
//! fallback ends by itself when the owner answers again.
//!
//! [`layer::RateLimitLayer`] puts an agent in front of any `tower` HTTP service.

pub mod agent;
pub mod config;
pub mod error;
pub mod layer;
pub mod pool;
pub mod slot;

pub use agent::{
    Agent, AgentRequest, AgentStats, COUNTER_TOLERANCE_PPM, FastClock, HandlePermit, LimitInfo,
    LocalPermit, Outcome, Permit, PermitHandle, Source,
};
pub use config::AgentConfig;
pub use error::AgentError;

/// Gauge: 1 while the owner is unreachable and routes follow their failure policy.
pub const FALLBACK: &str = "limiter_agent_fallback";

/// Gauge: 1 once the agent's time-stamp counter was found off the OS clock by more
/// than [`COUNTER_TOLERANCE_PPM`] and the agent reads the OS clock instead.
pub const CLOCK_ON_OS: &str = "limiter_agent_clock_on_os";
