//! Conversions between the wire types of `limiter.v1` and limiter-core's types, and
//! the metadata names nodes use on the wire.

use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::policy::Request;
use limiter_core::{AlgorithmKind, Limit, Reason, Scope};
use limiter_proto::limiter::v1 as pb;

/// Metadata naming a forwarded call's hop (`1`: forwarded once; `2`: redirected once
/// after that). A node never forwards a call that carries it.
pub const FORWARDED: &str = "x-limiter-forwarded";

/// Metadata of a `FAILED_PRECONDITION` answer: the address of the tenant's owner.
pub const OWNER: &str = "x-limiter-owner";

/// A wire duration from nanoseconds.
pub(crate) fn duration(nanos: Nanos) -> prost_types::Duration {
    prost_types::Duration {
        seconds: i64::try_from(nanos / NANOS_PER_SEC).unwrap_or(i64::MAX),
        // Below 10^9: fits.
        nanos: i32::try_from(nanos % NANOS_PER_SEC).unwrap_or(0),
    }
}

/// Nanoseconds of a wire duration (negative: 0).
pub(crate) fn nanos_of(d: &prost_types::Duration) -> Nanos {
    let secs = u64::try_from(d.seconds).unwrap_or(0);
    let sub = u64::try_from(d.nanos).unwrap_or(0);
    secs.saturating_mul(NANOS_PER_SEC).saturating_add(sub)
}

/// The core request of a wire request (an empty key is no key).
pub(crate) fn request(r: &pb::ShouldAllowRequest) -> Request<'_> {
    Request {
        tenant: &r.tenant,
        route: &r.route,
        key: (!r.key.is_empty()).then_some(r.key.as_str()),
        cost: r.cost,
        dry_run: r.dry_run,
    }
}

/// The wire reason.
pub(crate) fn reason(r: Reason) -> pb::Reason {
    match r {
        Reason::GlobalCeiling => pb::Reason::GlobalCeiling,
        Reason::RouteLimit => pb::Reason::RouteLimit,
        Reason::TenantLimit => pb::Reason::TenantLimit,
        Reason::TenantRouteLimit => pb::Reason::TenantRouteLimit,
        Reason::KeyLimit => pb::Reason::KeyLimit,
        Reason::EmergencyCeiling => pb::Reason::EmergencyCeiling,
        Reason::LimiterUnavailable => pb::Reason::LimiterUnavailable,
        Reason::UnknownTenant => pb::Reason::UnknownTenant,
        Reason::ShareLimit => pb::Reason::ShareLimit,
    }
}

/// The wire scope.
pub(crate) fn scope(s: Scope) -> pb::Scope {
    match s {
        Scope::Global => pb::Scope::Global,
        Scope::Route => pb::Scope::Route,
        Scope::Tenant => pb::Scope::Tenant,
        Scope::TenantRoute => pb::Scope::TenantRoute,
        Scope::Key => pb::Scope::Key,
    }
}

/// The scope a wire value names (`None`: unset or unknown).
pub(crate) fn scope_from(v: i32) -> Option<Scope> {
    match pb::Scope::try_from(v).ok()? {
        pb::Scope::Global => Some(Scope::Global),
        pb::Scope::Route => Some(Scope::Route),
        pb::Scope::Tenant => Some(Scope::Tenant),
        pb::Scope::TenantRoute => Some(Scope::TenantRoute),
        pb::Scope::Key => Some(Scope::Key),
        pb::Scope::Unspecified => None,
    }
}

/// The wire algorithm.
pub(crate) fn algorithm(k: AlgorithmKind) -> pb::Algorithm {
    match k {
        AlgorithmKind::TokenBucket => pb::Algorithm::TokenBucket,
        AlgorithmKind::FixedWindow => pb::Algorithm::FixedWindow,
        AlgorithmKind::SlidingLog => pb::Algorithm::SlidingLog,
        AlgorithmKind::SlidingCounter => pb::Algorithm::SlidingCounter,
        AlgorithmKind::Concurrency => pb::Algorithm::Concurrency,
    }
}

/// The wire limit; a calendar window's length is that of the window holding `now`.
pub(crate) fn limit(l: &Limit, name: Option<&str>, now: Nanos) -> pb::Limit {
    let (quota, window) = l.quota_at(now);
    pb::Limit {
        name: name.unwrap_or_default().to_owned(),
        algorithm: algorithm(l.kind()).into(),
        quota,
        window: Some(duration(window)),
    }
}

/// An instant as RFC 3339 in UTC, to the millisecond.
pub(crate) fn rfc3339(nanos: Nanos) -> String {
    let ms = i128::from(nanos / 1_000_000) * 1_000_000;
    jiff::Timestamp::from_nanosecond(ms).map(|t| t.to_string()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instants_are_rfc3339_to_the_millisecond() {
        assert_eq!(rfc3339(1_800_000_000_123_456_789), "2027-01-15T08:00:00.123Z");
    }

    #[test]
    fn durations_split_into_seconds_and_nanos() {
        let d = duration(2_500_000_001);
        assert_eq!((d.seconds, d.nanos), (2, 500_000_001));
    }
}
