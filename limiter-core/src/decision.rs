//! Decisions and their stable reasons: the same words in the API, metrics and logs.

use std::fmt;

use crate::clock::Nanos;
use crate::limit::Limit;

/// A level of the hierarchy, outermost first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Scope {
    /// The service-wide ceiling.
    Global,
    /// A route, across all tenants.
    Route,
    /// A tenant, across its routes.
    Tenant,
    /// A tenant on one route.
    TenantRoute,
    /// One key (API key, user) of a tenant on one route.
    Key,
}

impl Scope {
    /// Every scope, outermost first.
    pub const ALL: [Self; 5] =
        [Self::Global, Self::Route, Self::Tenant, Self::TenantRoute, Self::Key];

    /// The stable lower-case name (labels, logs).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Global => "global",
            Self::Route => "route",
            Self::Tenant => "tenant",
            Self::TenantRoute => "tenant_route",
            Self::Key => "key",
        }
    }

    /// The reason reported when a limit of this scope rejects.
    pub fn reason(self) -> Reason {
        match self {
            Self::Global => Reason::GlobalCeiling,
            Self::Route => Reason::RouteLimit,
            Self::Tenant => Reason::TenantLimit,
            Self::TenantRoute => Reason::TenantRouteLimit,
            Self::Key => Reason::KeyLimit,
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a request was rejected. The names are a stable contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The global ceiling is exhausted.
    GlobalCeiling,
    /// The route's limit across tenants is exhausted.
    RouteLimit,
    /// The tenant's limit is exhausted.
    TenantLimit,
    /// The tenant's limit on this route is exhausted.
    TenantRouteLimit,
    /// The key's limit is exhausted.
    KeyLimit,
    /// The limiter is unreachable and the route's local emergency ceiling is exhausted.
    EmergencyCeiling,
    /// The limiter is unreachable and the route fails closed.
    LimiterUnavailable,
    /// The tenant is not in the policy and the policy rejects unknown tenants.
    UnknownTenant,
    /// The request's class has used its share of a divided level (its scope), whose
    /// rest is reserved for other classes' current use.
    ShareLimit,
}

impl Reason {
    /// Every reason, in a stable order.
    pub const ALL: [Self; 9] = [
        Self::GlobalCeiling,
        Self::RouteLimit,
        Self::TenantLimit,
        Self::TenantRouteLimit,
        Self::KeyLimit,
        Self::EmergencyCeiling,
        Self::LimiterUnavailable,
        Self::UnknownTenant,
        Self::ShareLimit,
    ];

    /// The stable upper-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::GlobalCeiling => "GLOBAL_CEILING",
            Self::RouteLimit => "ROUTE_LIMIT",
            Self::TenantLimit => "TENANT_LIMIT",
            Self::TenantRouteLimit => "TENANT_ROUTE_LIMIT",
            Self::KeyLimit => "KEY_LIMIT",
            Self::EmergencyCeiling => "EMERGENCY_CEILING",
            Self::LimiterUnavailable => "LIMITER_UNAVAILABLE",
            Self::UnknownTenant => "UNKNOWN_TENANT",
            Self::ShareLimit => "SHARE_LIMIT",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The level that binds a decision: the one with the least room left (when allowed)
/// or the outermost one that failed (when rejected).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The level.
    pub scope: Scope,
    /// Its limit.
    pub limit: Limit,
}

/// The answer to "may this request go through?".
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Admitted (and charged, unless it was a dry run).
    Allowed {
        /// Units left at the tightest level after this request (for a dry run, left
        /// now: nothing was charged).
        remaining: u64,
        /// Nanoseconds until the tightest level is back to its full allowance.
        reset_after: Nanos,
        /// The tightest level; `None` when no limit applies to the request.
        binding: Option<Binding>,
    },
    /// Refused; nothing was charged anywhere.
    Rejected {
        /// Why.
        reason: Reason,
        /// The outermost failing level.
        scope: Scope,
        /// That level's limit, when there is one.
        limit: Option<Limit>,
        /// The longest wait over the failing levels, in nanoseconds.
        retry_after: Nanos,
    },
}

impl Decision {
    /// True for [`Decision::Allowed`].
    pub fn is_allowed(&self) -> bool {
        matches!(self, Self::Allowed { .. })
    }

    /// The reason, for a rejection.
    pub fn reason(&self) -> Option<Reason> {
        match self {
            Self::Allowed { .. } => None,
            Self::Rejected { reason, .. } => Some(*reason),
        }
    }
}
