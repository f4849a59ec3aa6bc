//! The five algorithms (four rates and a concurrency limit). Each is a small immutable description (`TokenBucket`, ...)
//! plus a per-key state; every query takes the state by reference and `now` as an
//! argument, so a check never mutates, and only `charge` and `refund` do.
//!
//! One property holds for all five and the hierarchy relies on it: a cost `c` (with
//! `c <= capacity`) is admissible now exactly when `c <= remaining(now)`.

mod concurrency;
mod fixed_window;
mod sliding_counter;
mod sliding_log;
mod token_bucket;
mod window;

pub use concurrency::{Concurrency, ConcurrencyState};
pub use fixed_window::{FixedWindow, FixedWindowState};
pub use sliding_counter::{SlidingCounter, SlidingCounterState};
pub use sliding_log::{SlidingLog, SlidingLogState};
pub use token_bucket::{TokenBucket, TokenBucketState};
pub use window::Window;

use crate::clock::Nanos;

/// How many allowances beyond its limit a level can owe: a charge (a cost reported
/// above its estimate) never takes a state further into debt than this, so a wait is
/// at most this many windows (or refills of a bucket), whatever a caller reports.
pub const MAX_DEBT_ALLOWANCES: u64 = 10;

/// The most units a level with `capacity` can hold charged at once, debt included.
pub(crate) fn max_charged(capacity: u64) -> u64 {
    capacity.saturating_mul(MAX_DEBT_ALLOWANCES + 1)
}

/// An admission verdict for one limit, before anything is charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// The cost fits: `remaining` units would be left after charging it.
    Admit {
        /// Units left after the cost is charged.
        remaining: u64,
    },
    /// The cost does not fit yet; it would at `now + retry_after` with no other traffic.
    Deny {
        /// Exact wait in nanoseconds.
        retry_after: Nanos,
    },
}

/// The operations every algorithm provides over its per-key state.
pub trait Algorithm {
    /// Per-key state; `Default` is a key never seen (full allowance).
    type State: Default + Clone + PartialEq + std::fmt::Debug;

    /// The largest cost one request can ever be admitted with (burst or limit).
    fn capacity(&self) -> u64;

    /// Units that could be admitted now.
    fn remaining(&self, state: &Self::State, now: Nanos) -> u64;

    /// Nanoseconds until `cost` would be admitted, assuming no other traffic; zero when
    /// it fits now. `cost` must not exceed [`Self::capacity`].
    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos;

    /// Nanoseconds until the state is back to a full allowance.
    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos;

    /// Charges `cost` without checking: a charge can take the state past its limit
    /// (a debt that later requests wait out), which is how reported usage above an
    /// estimate is recorded rather than lost.
    fn charge(&self, state: &mut Self::State, now: Nanos, cost: u64);

    /// Gives back `units` charged at `granted_at`, restoring the level exactly as far
    /// as they still count (units of a window that has passed are gone).
    fn refund(&self, state: &mut Self::State, now: Nanos, granted_at: Nanos, units: u64);

    /// True when the state is indistinguishable from a fresh one: dropping it loses
    /// nothing.
    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool;

    /// Whether some sequence of this algorithm's operations could have produced
    /// `state` by `now + skew` (`skew`: how far another node's clock may run ahead):
    /// no more debt than [`MAX_DEBT_ALLOWANCES`] allowances beyond the limit, no
    /// window or entry in the future. A state from elsewhere (a handoff) that fails
    /// this is refused rather than trusted.
    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool;

    /// Whether `cost` fits now, and what would be left.
    fn check(&self, state: &Self::State, now: Nanos, cost: u64) -> Check {
        let remaining = self.remaining(state, now);
        if cost <= remaining {
            Check::Admit { remaining: remaining - cost }
        } else {
            Check::Deny { retry_after: self.retry_after(state, now, cost.min(self.capacity())) }
        }
    }

    /// Admits and charges `cost` if it fits; otherwise changes nothing.
    fn try_acquire(&self, state: &mut Self::State, now: Nanos, cost: u64) -> Check {
        let verdict = self.check(state, now, cost);
        if let Check::Admit { .. } = verdict {
            self.charge(state, now, cost);
        }
        verdict
    }

    /// Grants up to `max` units at once (what leases are made of) and returns how many.
    fn grant(&self, state: &mut Self::State, now: Nanos, max: u64) -> u64 {
        let n = max.min(self.remaining(state, now));
        if n > 0 {
            self.charge(state, now, n);
        }
        n
    }

    /// How long units granted at `now` may be spent, at most `hold`: a window
    /// algorithm's grant ends with its window (units of one window must not be spent
    /// in the next).
    fn grant_hold(&self, _now: Nanos, hold: Nanos) -> Nanos {
        hold
    }

    /// The instant a grant made at `now` and spendable for `hold` is charged at; what
    /// a refund of it names. At `now`, except for the sliding log (see there).
    fn grant_stamp(&self, now: Nanos, _hold: Nanos) -> Nanos {
        now
    }

    /// Charges `cost` as of `stamp` (from [`Self::grant_stamp`]).
    fn charge_at(&self, state: &mut Self::State, now: Nanos, _stamp: Nanos, cost: u64) {
        self.charge(state, now, cost);
    }
}

/// `a / b` for `b > 0`, on the cheap 64-bit divider when both fit (the common case:
/// a 128-bit division is a library call several times slower).
pub(crate) fn div_u128(a: u128, b: u128) -> u128 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => u128::from(a / b),
        _ => a / b,
    }
}

/// Ceiling of `a / b` for `b > 0`, like [`div_u128`].
pub(crate) fn div_ceil_u128(a: u128, b: u128) -> u128 {
    match (u64::try_from(a), u64::try_from(b)) {
        (Ok(a), Ok(b)) => u128::from(a.div_ceil(b)),
        _ => a.div_ceil(b),
    }
}

/// Division by a divisor fixed when a limit is built, for dividends up to a bound
/// known then: a multiply and a shift instead of a divide instruction (several times
/// slower), exact over that range; larger dividends take the plain division.
///
/// With `m = floor(2^k / d) + 1`, `m * d = 2^k + e` for some `0 < e <= d`, so
/// `n * m / 2^k = n / d + n * e / (d * 2^k)`; the floor is `floor(n / d)` whenever
/// `n * e < 2^k`, which `n * d < 2^k` guarantees. `k` is the least with
/// `max * d < 2^k`, so `m <= 2 * max + 1` fits 64 bits for every `max < 2^63`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Divisor {
    d: u64,
    max: u64,
    m: u64,
    k: u32,
}

impl Divisor {
    /// Divides by `d` (> 0) dividends up to `max`, exactly.
    pub(crate) fn new(d: u64, max: u128) -> Self {
        let d = d.max(1);
        match u64::try_from(max) {
            Ok(max) if max < 1 << 63 => {
                let product = u128::from(max) * u128::from(d);
                let k = 128 - product.leading_zeros();
                let m = u64::try_from((1u128 << k) / u128::from(d) + 1).unwrap_or(0);
                Self { d, max, m, k }
            }
            _ => Self { d, max: 0, m: 0, k: 0 },
        }
    }

    /// `floor(n / d)`.
    #[inline]
    pub(crate) fn div(&self, n: u128) -> u128 {
        match u64::try_from(n) {
            Ok(n) if n <= self.max && self.m > 0 => (u128::from(n) * u128::from(self.m)) >> self.k,
            _ => div_u128(n, u128::from(self.d)),
        }
    }

    /// `ceil(n / d)`.
    #[inline]
    pub(crate) fn div_ceil(&self, n: u128) -> u128 {
        match n.checked_add(u128::from(self.d) - 1) {
            Some(up) => self.div(up),
            None => div_ceil_u128(n, u128::from(self.d)),
        }
    }
}

/// Narrows to `u64`, saturating (every caller's true value fits; this only guards
/// against arithmetic on states in debt far beyond any real use).
pub(crate) fn sat_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_divisor_divides_exactly_over_its_range_and_beyond() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let divisors = [1, 2, 3, 7, 10, 1_000, 999_999_937, 1_000_000_000, u64::MAX / 3, u64::MAX];
        for d in divisors {
            for max in [0u128, 1, 1_000, 1 << 40, (1 << 63) - 1, 1 << 63, u128::MAX] {
                let div = Divisor::new(d, max);
                let top = max.min(u128::from(u64::MAX));
                let check = |n: u128| {
                    assert_eq!(div.div(n), n / u128::from(d), "{n} / {d} (max {max})");
                    assert_eq!(div.div_ceil(n), n.div_ceil(u128::from(d)), "ceil {n} / {d}");
                };
                for n in [0, 1, top, top.saturating_sub(1), top / 2, u128::from(d), u128::MAX] {
                    check(n);
                }
                for _ in 0..2_000 {
                    check(u128::from(next()) % (top + 1));
                }
            }
        }
    }
}
