//! What a caller does when the limiter (an owner, or a store) cannot be reached: a
//! circuit breaker that notices trouble from consecutive failures rather than one slow
//! call, and each route's failure policy (emergency ceiling or rejection).
//!
//! Shared by the gateway agent (its owner) and the server (its Redis store).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::algorithm::{Algorithm, Check, TokenBucket, TokenBucketState};
use crate::clock::Nanos;
use crate::decision::{Decision, Reason, Scope};
use crate::limit::Limit;
use crate::policy::FailurePolicy;

/// A circuit breaker: closed until `threshold` consecutive failures, then open; while
/// open, one probe call may go out every `probe_every`, and its success closes it.
///
/// # Examples
///
/// ```
/// use limiter_core::failure::Breaker;
/// let b = Breaker::new(2, 1_000);
/// assert!(b.allow(0));
/// assert!(!b.failure(0));
/// assert!(b.failure(0)); // just opened
/// assert!(!b.allow(10)); // open
/// assert!(b.allow(1_000)); // one probe
/// assert!(!b.allow(1_000));
/// assert!(b.success()); // closed again
/// ```
#[derive(Debug)]
pub struct Breaker {
    failures: AtomicU64,
    open_until: AtomicU64,
    threshold: u64,
    probe_every: Nanos,
}

impl Breaker {
    /// A closed breaker that opens after `threshold` consecutive failures (at least 1).
    pub fn new(threshold: u64, probe_every: Nanos) -> Self {
        Self {
            failures: AtomicU64::new(0),
            open_until: AtomicU64::new(0),
            threshold: threshold.max(1),
            probe_every,
        }
    }

    /// Whether it is open (calls fail fast, the failure policy applies).
    pub fn is_open(&self) -> bool {
        self.failures.load(Ordering::Acquire) >= self.threshold
    }

    /// Whether a call may go out now: closed, or open and due for its one probe.
    pub fn allow(&self, now: Nanos) -> bool {
        if !self.is_open() {
            return true;
        }
        let until = self.open_until.load(Ordering::Acquire);
        now >= until
            && self
                .open_until
                .compare_exchange(
                    until,
                    now + self.probe_every,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
    }

    /// Records a success; true when this closed an open breaker.
    pub fn success(&self) -> bool {
        self.failures.swap(0, Ordering::AcqRel) >= self.threshold
    }

    /// Records a failure at `now`; true when this one opened the breaker.
    pub fn failure(&self, now: Nanos) -> bool {
        let n = self.failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= self.threshold {
            self.open_until.store(now + self.probe_every, Ordering::Release);
        }
        n == self.threshold
    }
}

/// Emergency ceilings of fail-open routes: a local token bucket per route holding one
/// period's amount, so a node in fallback admits at most the ceiling's rate.
#[derive(Debug, Default)]
pub struct EmergencyCeilings {
    routes: Mutex<HashMap<Box<str>, (TokenBucket, TokenBucketState)>>,
}

impl EmergencyCeilings {
    /// Decides a request of `cost` on `route` by the route's failure policy: within the
    /// emergency ceiling (fail open) or `LIMITER_UNAVAILABLE` (fail closed).
    pub fn decide(&self, route: &str, policy: FailurePolicy, cost: u64, now: Nanos) -> Decision {
        let FailurePolicy::FailOpen { emergency_ceiling } = policy else {
            return Decision::Rejected {
                reason: Reason::LimiterUnavailable,
                scope: Scope::Route,
                limit: None,
                retry_after: 0,
            };
        };
        let mut routes = self.routes.lock();
        let fresh = || TokenBucket::new(emergency_ceiling, emergency_ceiling.amount());
        let (bucket, state) =
            routes.entry(route.into()).or_insert_with(|| (fresh(), TokenBucketState::default()));
        if bucket.rate() != emergency_ceiling {
            *bucket = fresh();
        }
        let limit = Some(Limit::TokenBucket(*bucket));
        if cost > bucket.capacity() {
            return Decision::Rejected {
                reason: Reason::EmergencyCeiling,
                scope: Scope::Route,
                limit,
                retry_after: 0,
            };
        }
        match bucket.try_acquire(state, now, cost) {
            Check::Admit { remaining } => Decision::Allowed {
                remaining,
                reset_after: bucket.reset_after(state, now),
                binding: None,
            },
            Check::Deny { retry_after } => Decision::Rejected {
                reason: Reason::EmergencyCeiling,
                scope: Scope::Route,
                limit,
                retry_after,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fail_open_admits_up_to_the_ceiling_and_fail_closed_nothing() {
        let c = EmergencyCeilings::default();
        let open = FailurePolicy::FailOpen { emergency_ceiling: "3/s".parse().unwrap() };
        let admitted = (0..10).filter(|_| c.decide("/r", open, 1, 0).is_allowed()).count();
        assert_eq!(admitted, 3);
        let d = c.decide("/r", open, 1, 0);
        assert_eq!(d.reason(), Some(Reason::EmergencyCeiling));
        assert!(c.decide("/r", open, 1, 400_000_000).is_allowed());
        assert_eq!(c.decide("/r", open, 4, 0).reason(), Some(Reason::EmergencyCeiling));
        let d = c.decide("/other", FailurePolicy::FailClosed, 1, 0);
        assert_eq!(d.reason(), Some(Reason::LimiterUnavailable));
    }

    #[test]
    fn the_breaker_opens_after_consecutive_failures_only() {
        let b = Breaker::new(3, 100);
        b.failure(0);
        b.failure(0);
        b.success();
        b.failure(0);
        b.failure(0);
        assert!(!b.is_open());
        assert!(b.failure(0));
        assert!(b.is_open());
        assert!(!b.allow(50));
        assert!(b.allow(100));
        assert!(!b.failure(100)); // the probe failed: still open, not newly opened
        assert!(!b.allow(150));
        assert!(b.allow(200));
        assert!(b.success());
        assert!(b.allow(201));
    }
}
