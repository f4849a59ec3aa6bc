//! A limit of any of the five algorithms, and its per-key state.
//!
//! `Limit` implements [`Algorithm`] by dispatching to the algorithm it holds. A state
//! of another algorithm (left by a policy reload that changed the limit) reads as a
//! fresh state and is replaced on the next charge.

use std::fmt;

use crate::algorithm::{
    Algorithm, Check, Concurrency, ConcurrencyState, FixedWindow, FixedWindowState, SlidingCounter,
    SlidingCounterState, SlidingLog, SlidingLogState, TokenBucket, TokenBucketState,
};
use crate::clock::Nanos;
use crate::rate::DurationText;

/// One limit: an algorithm with its parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Limit {
    /// See [`TokenBucket`].
    TokenBucket(TokenBucket),
    /// See [`FixedWindow`].
    FixedWindow(FixedWindow),
    /// See [`SlidingLog`].
    SlidingLog(SlidingLog),
    /// See [`SlidingCounter`].
    SlidingCounter(SlidingCounter),
    /// See [`Concurrency`].
    Concurrency(Concurrency),
}

/// The algorithm of a limit, as a bounded label (metrics, logs, the policy file).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AlgorithmKind {
    /// `token_bucket`
    TokenBucket,
    /// `fixed_window`
    FixedWindow,
    /// `sliding_log`
    SlidingLog,
    /// `sliding_counter`
    SlidingCounter,
    /// `concurrency`
    Concurrency,
}

impl AlgorithmKind {
    /// Every kind, in a stable order.
    pub const ALL: [Self; 5] = [
        Self::TokenBucket,
        Self::FixedWindow,
        Self::SlidingLog,
        Self::SlidingCounter,
        Self::Concurrency,
    ];

    /// The name used in policy files and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TokenBucket => "token_bucket",
            Self::FixedWindow => "fixed_window",
            Self::SlidingLog => "sliding_log",
            Self::SlidingCounter => "sliding_counter",
            Self::Concurrency => "concurrency",
        }
    }
}

/// Per-key state of a [`Limit`]: 32 bytes inline (a sliding log's entries live
/// behind a box, so the common states stay small).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LimitState {
    /// Nothing charged yet.
    #[default]
    Fresh,
    /// Token bucket state.
    TokenBucket(TokenBucketState),
    /// Fixed window state.
    FixedWindow(FixedWindowState),
    /// Sliding log state.
    SlidingLog(Box<SlidingLogState>),
    /// Sliding counter state.
    SlidingCounter(SlidingCounterState),
    /// Concurrency state (permits in use by expiry).
    Concurrency(Box<ConcurrencyState>),
}

impl Limit {
    /// The limit's algorithm.
    pub fn kind(&self) -> AlgorithmKind {
        match self {
            Self::TokenBucket(_) => AlgorithmKind::TokenBucket,
            Self::FixedWindow(_) => AlgorithmKind::FixedWindow,
            Self::SlidingLog(_) => AlgorithmKind::SlidingLog,
            Self::SlidingCounter(_) => AlgorithmKind::SlidingCounter,
            Self::Concurrency(_) => AlgorithmKind::Concurrency,
        }
    }

    /// The quota and its window in nanoseconds, as the `RateLimit-Policy` header
    /// states them: a bucket's burst over the time it takes to refill it; a calendar
    /// window's typical length (see [`Self::quota_at`] for the real one).
    pub fn quota(&self) -> (u64, Nanos) {
        match self {
            Self::TokenBucket(b) => Self::bucket_quota(b),
            Self::FixedWindow(w) => (w.limit().get(), w.window().nominal()),
            Self::SlidingLog(w) => (w.limit().get(), w.window().get()),
            Self::SlidingCounter(w) => (w.limit().get(), w.window().nominal()),
            Self::Concurrency(c) => (c.limit().get(), c.permit_ttl().get()),
        }
    }

    /// Whether this is a concurrency limit (permits held, not units spent).
    pub fn is_concurrency(&self) -> bool {
        matches!(self, Self::Concurrency(_))
    }

    /// Like [`Self::quota`], with a calendar window's real length at `now` (a day
    /// of 23 hours, a month of 28 days).
    pub fn quota_at(&self, now: Nanos) -> (u64, Nanos) {
        match self {
            Self::FixedWindow(w) => (w.limit().get(), w.window().span(now).len),
            Self::SlidingCounter(w) => (w.limit().get(), w.window().span(now).len),
            _ => self.quota(),
        }
    }

    /// Whether a counter kept for `old` stays right for this limit: the same limit, or
    /// a window algorithm over the same windows whose `limit` alone changed (its state
    /// is a count per window, which means the same under any limit). A changed limit
    /// is then no way to reset a count: a policy reload that raises or lowers a window's
    /// limit, or an Envoy descriptor's limit override that changes, keeps what was
    /// counted.
    pub fn keeps_state_of(&self, old: &Limit) -> bool {
        match (self, old) {
            (Self::FixedWindow(a), Self::FixedWindow(b)) => a.window() == b.window(),
            (Self::SlidingCounter(a), Self::SlidingCounter(b)) => a.window() == b.window(),
            // Permits in use stay in use whatever the new limit or TTL: each expires
            // when it was going to.
            (Self::Concurrency(_), Self::Concurrency(_)) => true,
            (a, b) => a == b,
        }
    }

    /// The calendar rule of a calendar window, if the limit has one.
    pub fn calendar(&self) -> Option<crate::calendar::Calendar> {
        match self {
            Self::FixedWindow(w) => w.window().calendar(),
            Self::SlidingCounter(w) => w.window().calendar(),
            _ => None,
        }
    }

    fn bucket_quota(b: &TokenBucket) -> (u64, Nanos) {
        let refill = u128::from(b.burst().get()) * u128::from(b.rate().period().get())
            / u128::from(b.rate().amount().get());
        (b.burst().get(), u64::try_from(refill).unwrap_or(u64::MAX).max(1))
    }
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::TokenBucket(b) => write!(f, "token_bucket {} burst {}", b.rate(), b.burst()),
            Self::FixedWindow(w) => {
                write!(f, "fixed_window {} per {}", w.limit(), w.window())
            }
            Self::SlidingLog(w) => {
                write!(f, "sliding_log {} per {}", w.limit(), DurationText(w.window().get()))
            }
            Self::SlidingCounter(w) => {
                write!(f, "sliding_counter {} per {}", w.limit(), w.window())
            }
            Self::Concurrency(c) => write!(
                f,
                "concurrency {} permits, ttl {}",
                c.limit(),
                DurationText(c.permit_ttl().get())
            ),
        }
    }
}

/// Applies `$body` with `$alg` bound to the inner algorithm and `$st` to its state
/// (a fresh default when the state is of another algorithm).
macro_rules! with_state {
    ($limit:expr, $state:expr, |$alg:ident, $st:ident| $body:expr) => {
        match ($limit, $state) {
            (Limit::TokenBucket($alg), LimitState::TokenBucket($st)) => $body,
            (Limit::FixedWindow($alg), LimitState::FixedWindow($st)) => $body,
            (Limit::SlidingLog($alg), LimitState::SlidingLog($st)) => $body,
            (Limit::SlidingCounter($alg), LimitState::SlidingCounter($st)) => $body,
            (Limit::Concurrency($alg), LimitState::Concurrency($st)) => $body,
            (Limit::TokenBucket($alg), _) => {
                let $st = &TokenBucketState::default();
                $body
            }
            (Limit::FixedWindow($alg), _) => {
                let $st = &FixedWindowState::default();
                $body
            }
            (Limit::SlidingLog($alg), _) => {
                let $st = &SlidingLogState::default();
                $body
            }
            (Limit::SlidingCounter($alg), _) => {
                let $st = &SlidingCounterState::default();
                $body
            }
            (Limit::Concurrency($alg), _) => {
                let $st = &ConcurrencyState::default();
                $body
            }
        }
    };
}

/// Like `with_state!` for mutation: a state of another algorithm is replaced first.
macro_rules! with_state_mut {
    ($limit:expr, $state:expr, |$alg:ident, $st:ident| $body:expr) => {{
        let state: &mut LimitState = $state;
        match $limit {
            Limit::TokenBucket($alg) => {
                if !matches!(state, LimitState::TokenBucket(_)) {
                    *state = LimitState::TokenBucket(TokenBucketState::default());
                }
                let LimitState::TokenBucket($st) = state else { unreachable!() };
                $body
            }
            Limit::FixedWindow($alg) => {
                if !matches!(state, LimitState::FixedWindow(_)) {
                    *state = LimitState::FixedWindow(FixedWindowState::default());
                }
                let LimitState::FixedWindow($st) = state else { unreachable!() };
                $body
            }
            Limit::SlidingLog($alg) => {
                if !matches!(state, LimitState::SlidingLog(_)) {
                    *state = LimitState::SlidingLog(Box::default());
                }
                let LimitState::SlidingLog($st) = state else { unreachable!() };
                $body
            }
            Limit::SlidingCounter($alg) => {
                if !matches!(state, LimitState::SlidingCounter(_)) {
                    *state = LimitState::SlidingCounter(SlidingCounterState::default());
                }
                let LimitState::SlidingCounter($st) = state else { unreachable!() };
                $body
            }
            Limit::Concurrency($alg) => {
                if !matches!(state, LimitState::Concurrency(_)) {
                    *state = LimitState::Concurrency(Box::default());
                }
                let LimitState::Concurrency($st) = state else { unreachable!() };
                $body
            }
        }
    }};
}

impl Algorithm for Limit {
    type State = LimitState;

    fn capacity(&self) -> u64 {
        match self {
            Self::TokenBucket(a) => a.capacity(),
            Self::FixedWindow(a) => a.capacity(),
            Self::SlidingLog(a) => a.capacity(),
            Self::SlidingCounter(a) => a.capacity(),
            Self::Concurrency(a) => a.capacity(),
        }
    }

    fn remaining(&self, state: &LimitState, now: Nanos) -> u64 {
        with_state!(self, state, |a, s| a.remaining(s, now))
    }

    fn retry_after(&self, state: &LimitState, now: Nanos, cost: u64) -> Nanos {
        with_state!(self, state, |a, s| a.retry_after(s, now, cost))
    }

    fn reset_after(&self, state: &LimitState, now: Nanos) -> Nanos {
        with_state!(self, state, |a, s| a.reset_after(s, now))
    }

    fn charge(&self, state: &mut LimitState, now: Nanos, cost: u64) {
        with_state_mut!(self, state, |a, s| a.charge(s, now, cost));
    }

    fn refund(&self, state: &mut LimitState, now: Nanos, granted_at: Nanos, units: u64) {
        with_state_mut!(self, state, |a, s| a.refund(s, now, granted_at, units));
    }

    fn is_idle(&self, state: &LimitState, now: Nanos) -> bool {
        with_state!(self, state, |a, s| a.is_idle(s, now))
    }

    /// A state of another algorithm is not plausible; a fresh one always is.
    fn plausible(&self, state: &LimitState, now: Nanos, skew: Nanos) -> bool {
        match (self, state) {
            (_, LimitState::Fresh) => true,
            (Self::TokenBucket(a), LimitState::TokenBucket(s)) => a.plausible(s, now, skew),
            (Self::FixedWindow(a), LimitState::FixedWindow(s)) => a.plausible(s, now, skew),
            (Self::SlidingLog(a), LimitState::SlidingLog(s)) => a.plausible(s, now, skew),
            (Self::SlidingCounter(a), LimitState::SlidingCounter(s)) => a.plausible(s, now, skew),
            (Self::Concurrency(a), LimitState::Concurrency(s)) => a.plausible(s, now, skew),
            _ => false,
        }
    }

    fn grant_hold(&self, now: Nanos, hold: Nanos) -> Nanos {
        match self {
            Self::TokenBucket(a) => a.grant_hold(now, hold),
            Self::FixedWindow(a) => a.grant_hold(now, hold),
            Self::SlidingLog(a) => a.grant_hold(now, hold),
            Self::SlidingCounter(a) => a.grant_hold(now, hold),
            Self::Concurrency(a) => a.grant_hold(now, hold),
        }
    }

    fn grant_stamp(&self, now: Nanos, hold: Nanos) -> Nanos {
        match self {
            Self::TokenBucket(a) => a.grant_stamp(now, hold),
            Self::FixedWindow(a) => a.grant_stamp(now, hold),
            Self::SlidingLog(a) => a.grant_stamp(now, hold),
            Self::SlidingCounter(a) => a.grant_stamp(now, hold),
            Self::Concurrency(a) => a.grant_stamp(now, hold),
        }
    }

    fn charge_at(&self, state: &mut LimitState, now: Nanos, stamp: Nanos, cost: u64) {
        with_state_mut!(self, state, |a, s| a.charge_at(s, now, stamp, cost));
    }

    /// One dispatch and the algorithm's own one-pass check and charge.
    fn try_acquire(&self, state: &mut LimitState, now: Nanos, cost: u64) -> Check {
        with_state_mut!(self, state, |a, s| a.try_acquire(s, now, cost))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;

    #[test]
    fn state_sizes_stay_small() {
        assert!(size_of::<TokenBucketState>() <= 64);
        assert!(size_of::<FixedWindowState>() <= 64);
        assert!(size_of::<SlidingCounterState>() <= 64);
        assert_eq!(size_of::<TokenBucketState>(), 16);
        assert_eq!(size_of::<FixedWindowState>(), 16);
        assert_eq!(size_of::<SlidingCounterState>(), 24);
        assert_eq!(size_of::<LimitState>(), 32);
    }

    #[test]
    fn a_state_of_another_algorithm_reads_as_fresh_and_is_replaced() {
        let n = |v| NonZeroU64::new(v).unwrap();
        let fw = Limit::FixedWindow(FixedWindow::new(n(5), n(100)));
        let tb = Limit::TokenBucket(TokenBucket::new("5/s".parse().unwrap(), n(5)));
        let mut s = LimitState::default();
        tb.charge(&mut s, 0, 5);
        assert_eq!(tb.remaining(&s, 0), 0);
        assert_eq!(fw.remaining(&s, 0), 5);
        fw.charge(&mut s, 0, 1);
        assert!(matches!(s, LimitState::FixedWindow(_)));
        assert_eq!(fw.remaining(&s, 0), 4);
        assert_eq!(Limit::quota(&tb), (5, 1_000_000_000));
        // Grants dispatch to the algorithm: a window ends them, a log stamps them late.
        assert_eq!(fw.grant_hold(30, 1_000), 70);
        assert_eq!(tb.grant_hold(30, 1_000), 1_000);
        let sl = Limit::SlidingLog(SlidingLog::new(n(5), n(4_000)));
        assert_eq!(sl.grant_hold(0, 1_000), 100);
        assert_eq!(sl.grant_stamp(10, 100), 110);
    }
}
