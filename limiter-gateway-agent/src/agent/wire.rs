//! Conversions of the owner's wire answers.

use super::*;
use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::policy::FailurePolicy;
use limiter_core::rate::Rate;
use limiter_core::{Reason, Scope};
use limiter_proto::limiter::v1 as pb;
use std::time::Duration;

pub(super) fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

pub(super) fn duration(n: Nanos) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(n / NANOS_PER_SEC).unwrap_or(i64::MAX),
        nanos: i32::try_from(n % NANOS_PER_SEC).unwrap_or(0),
    }
}

pub(super) fn duration_nanos(d: Option<&prost_types::Duration>) -> Nanos {
    d.map_or(0, |d| {
        u64::try_from(d.seconds)
            .unwrap_or(0)
            .saturating_mul(NANOS_PER_SEC)
            .saturating_add(u64::try_from(d.nanos).unwrap_or(0))
    })
}

pub(super) fn reason(r: pb::Reason) -> Option<Reason> {
    Some(match r {
        pb::Reason::Unspecified => return None,
        pb::Reason::GlobalCeiling => Reason::GlobalCeiling,
        pb::Reason::RouteLimit => Reason::RouteLimit,
        pb::Reason::TenantLimit => Reason::TenantLimit,
        pb::Reason::TenantRouteLimit => Reason::TenantRouteLimit,
        pb::Reason::KeyLimit => Reason::KeyLimit,
        pb::Reason::EmergencyCeiling => Reason::EmergencyCeiling,
        pb::Reason::LimiterUnavailable => Reason::LimiterUnavailable,
        pb::Reason::UnknownTenant => Reason::UnknownTenant,
        pb::Reason::ShareLimit => Reason::ShareLimit,
    })
}

pub(super) fn scope(s: pb::Scope) -> Option<Scope> {
    Some(match s {
        pb::Scope::Unspecified => return None,
        pb::Scope::Global => Scope::Global,
        pb::Scope::Route => Scope::Route,
        pb::Scope::Tenant => Scope::Tenant,
        pb::Scope::TenantRoute => Scope::TenantRoute,
        pb::Scope::Key => Scope::Key,
    })
}

/// The agent's outcome for an owner's decision of `slot`'s key.
pub(super) fn from_owner_for(d: &pb::ShouldAllowResponse, slot: &Slot) -> Outcome {
    let mut o = from_owner(d);
    if let Some(p) = d.permit.as_ref().filter(|_| d.allowed) {
        let (tenant, route, key) = slot.key.parts();
        o.permit = Some(Permit {
            id: p.id.clone(),
            tenant: tenant.to_owned(),
            route: route.to_owned(),
            key: key.to_owned(),
            expires_in: duration_nanos(p.expires_in.as_ref()),
            local: None,
        });
    }
    o
}

/// The agent's outcome for an owner's decision (no permit kept).
pub(super) fn from_owner(d: &pb::ShouldAllowResponse) -> Outcome {
    Outcome {
        allowed: d.allowed,
        reason: reason(d.reason()),
        scope: scope(d.scope()),
        remaining: d.remaining,
        retry_after: duration_nanos(d.retry_after.as_ref()),
        limit: d.limit.as_ref().map(|l| LimitInfo {
            name: l.name.clone(),
            quota: l.quota,
            window: duration_nanos(l.window.as_ref()),
        }),
        source: Source::Owner,
        permit: None,
    }
}

pub(super) fn failure_policy(p: &pb::FailurePolicy) -> FailurePolicy {
    let period = duration_nanos(p.emergency_period.as_ref());
    match Rate::try_new(p.emergency_amount, period) {
        Ok(rate) if p.fail_open => FailurePolicy::FailOpen { emergency_ceiling: rate },
        _ => FailurePolicy::FailClosed,
    }
}
