//! What the agent answers: a decision's outcome, where it came from, and the agent's counts.

use limiter_core::clock::Nanos;
use limiter_core::{Reason, Scope};

/// Where a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// From the local leased balance.
    Local,
    /// By the owner, directly (exact mode, or too little left to lease).
    Owner,
    /// From a lease the owner granted for this request (its units came out of the
    /// grant; the rest is the new local balance).
    Granted,
    /// By the route's failure policy (owner unreachable).
    Fallback,
}

/// A limit as the agent reports it (for headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitInfo {
    /// Its name.
    pub name: String,
    /// Units per window.
    pub quota: u64,
    /// The window.
    pub window: Nanos,
}

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the request goes through.
    pub allowed: bool,
    /// Why not (or, in shadow mode, why it would not have).
    pub reason: Option<Reason>,
    /// The level that decided, when known.
    pub scope: Option<Scope>,
    /// Units left (locally, for a local decision).
    pub remaining: u64,
    /// When rejected: how long until the same request could be admitted.
    pub retry_after: Nanos,
    /// The binding limit, when the owner said.
    pub limit: Option<LimitInfo>,
    /// Where it was decided.
    pub source: Source,
    /// The permits an admission holds on the chain's concurrency levels: release them
    /// ([`super::Agent::release`]) when the request ends. `None` for a chain without
    /// a concurrency level.
    pub permit: Option<Permit>,
}

/// Permits of concurrency levels held by one admitted request, until released or
/// expired (unless renewed). A permit of the agent's local pool (the default) also
/// goes back when its last clone is dropped; an owner's permit (a route decided per
/// request, or `AgentConfig::local_permits` off) is held until released or expired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permit {
    /// The owner's id of it.
    pub id: String,
    /// The tenant, route and key it was issued for.
    pub tenant: String,
    /// Route.
    pub route: String,
    /// Key (empty: none).
    pub key: String,
    /// Until it is reclaimed unless renewed, from when it was issued.
    pub expires_in: Nanos,
    /// A permit of the agent's local pool (its id and names are then empty):
    /// released here, with no call.
    pub(crate) local: Option<std::sync::Arc<super::LocalPermit>>,
}

impl Outcome {
    pub(super) fn local(remaining: u64) -> Self {
        Self {
            allowed: true,
            reason: None,
            scope: None,
            remaining,
            retry_after: 0,
            limit: None,
            source: Source::Local,
            permit: None,
        }
    }

    pub(super) fn rejected(reason: Reason, retry_after: Nanos, source: Source) -> Self {
        Self {
            allowed: false,
            reason: Some(reason),
            scope: None,
            remaining: 0,
            retry_after,
            limit: None,
            source,
            permit: None,
        }
    }
}

/// One request as the agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentRequest<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Route.
    pub route: &'a str,
    /// Key, if any.
    pub key: Option<&'a str>,
    /// Units; at least 1.
    pub cost: u64,
}

/// Counters of what the agent did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentStats {
    /// Decisions made from the local balance.
    pub local: u64,
    /// Decisions that needed the owner (slow path).
    pub slow: u64,
    /// Decisions made by the failure policy.
    pub fallback: u64,
    /// Calls to the owner (slow path and renewals).
    pub owner_calls: u64,
    /// Items those calls carried (one per key renewed, returned or asked for).
    pub owner_items: u64,
    /// Calls that failed or timed out.
    pub failed_calls: u64,
    /// Requests refused here, with no call: from a refusal the owner gave for the
    /// key a moment before (until the wait it gave, at most a
    /// [`REFUSAL_CAP_SHARE`]th of the lease TTL and `AgentConfig::refusal_cap`), or
    /// because the key's share of a limit near its end is spent (until the key's
    /// next renewal asks again). Counted apart from the owner's refusals.
    pub refused_locally: u64,
}

/// The longest a refusal from the owner answers a key's requests locally, as a share
/// of the lease's TTL (an eighth; also at most `AgentConfig::refusal_cap`), and
/// never past the wait the owner gave.
pub const REFUSAL_CAP_SHARE: u64 = 8;
