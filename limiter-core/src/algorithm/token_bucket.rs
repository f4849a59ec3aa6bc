//! Token bucket: refills `rate` per period up to `burst`; a cost `c` needs `c` tokens.
//!
//! Kept as a theoretical arrival time (GCRA) on a scaled time line where one
//! nanosecond is `amount` units and one token is `period` units, so refill is exact
//! for any rate (`3/s` does not round to 333,333,333 ns a token) and never drifts.

use std::num::NonZeroU64;

use super::{Algorithm, Check, Divisor, div_ceil_u128, max_charged, sat_u64};
use crate::clock::Nanos;
use crate::rate::Rate;

/// A token bucket's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenBucket {
    rate: Rate,
    burst: NonZeroU64,
    /// Scaled units to tokens (by `period`), over a full bucket.
    per_token: Divisor,
    /// Scaled units to nanoseconds (by `amount`), over the deepest debt.
    per_nano: Divisor,
}

/// A token bucket's per-key state: 16 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenBucketState {
    /// Scaled time at which the bucket is full again; at or before now means full.
    /// A `u128` kept as two words so the state needs only 8-byte alignment (a
    /// smaller slot in the state table).
    tat: [u64; 2],
}

impl TokenBucketState {
    fn tat(&self) -> u128 {
        (u128::from(self.tat[0]) << 64) | u128::from(self.tat[1])
    }

    #[allow(clippy::cast_possible_truncation)] // splitting into words is the intent
    fn set_tat(&mut self, tat: u128) {
        self.tat = [(tat >> 64) as u64, tat as u64];
    }
}

impl TokenBucket {
    /// A bucket refilling at `rate` and holding at most `burst` tokens.
    pub fn new(rate: Rate, burst: NonZeroU64) -> Self {
        let (amount, period) = (rate.amount().get(), rate.period().get());
        let full = u128::from(burst.get()) * u128::from(period);
        let deepest = u128::from(max_charged(burst.get())) * u128::from(period);
        Self {
            rate,
            burst,
            per_token: Divisor::new(period, full),
            per_nano: Divisor::new(amount, deepest),
        }
    }

    /// The refill rate.
    pub fn rate(&self) -> Rate {
        self.rate
    }

    /// The bucket's size.
    pub fn burst(&self) -> NonZeroU64 {
        self.burst
    }

    #[inline]
    fn amount(&self) -> u128 {
        self.rate.amount().get().into()
    }
    #[inline]
    fn period(&self) -> u128 {
        self.rate.period().get().into()
    }
    #[inline]
    fn scaled(&self, now: Nanos) -> u128 {
        u128::from(now) * self.amount()
    }
    #[inline]
    fn capacity_scaled(&self) -> u128 {
        u128::from(self.burst.get()) * self.period()
    }
    /// The deepest a bucket can be spent, debt included (scaled).
    fn max_used(&self) -> u128 {
        u128::from(max_charged(self.burst.get())) * self.period()
    }
    /// Scaled time the bucket's current contents are "spent" ahead of now.
    #[inline]
    fn used(&self, state: &TokenBucketState, now: Nanos) -> u128 {
        state.tat().saturating_sub(self.scaled(now))
    }
}

impl TokenBucket {
    /// The state this bucket takes over from `old`'s: the same tokens left, to the
    /// fraction (never more than this bucket holds), refilling at this bucket's rate
    /// from `now`. A bucket whose rate or size changes (a class's share of a level)
    /// neither loses nor gains what it had.
    pub fn carry(
        &self,
        old: &TokenBucket,
        state: &TokenBucketState,
        now: Nanos,
    ) -> TokenBucketState {
        // In each bucket's scaled units one token is its period.
        let (p_old, p_new) = (old.period().max(1), self.period());
        let (cap_old, cap_new) = (old.capacity_scaled(), self.capacity_scaled());
        let used_old = old.used(state, now);
        let used = match used_old.checked_sub(cap_old) {
            // In debt: the same debt, rounded up.
            Some(debt) => cap_new + (debt * p_new).div_ceil(p_old),
            // The same tokens left (rounded down), at most a full bucket.
            None => cap_new.saturating_sub((cap_old - used_old) * p_new / p_old),
        };
        let mut out = TokenBucketState::default();
        out.set_tat(self.scaled(now) + used.min(self.max_used()));
        out
    }
}

impl Algorithm for TokenBucket {
    type State = TokenBucketState;

    fn capacity(&self) -> u64 {
        self.burst.get()
    }

    #[inline]
    fn remaining(&self, state: &Self::State, now: Nanos) -> u64 {
        sat_u64(self.per_token.div(self.capacity_scaled().saturating_sub(self.used(state, now))))
    }

    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos {
        let need = self.used(state, now) + u128::from(cost) * self.period();
        match need.checked_sub(self.capacity_scaled()) {
            None | Some(0) => 0,
            // The earliest t with (t - now) * amount >= excess.
            Some(excess) => sat_u64(div_ceil_u128(excess, self.amount())),
        }
    }

    #[inline]
    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos {
        sat_u64(self.per_nano.div_ceil(self.used(state, now)))
    }

    #[inline]
    fn charge(&self, state: &mut Self::State, now: Nanos, cost: u64) {
        let base = state.tat().max(self.scaled(now));
        let deepest = self.scaled(now) + self.max_used();
        state.set_tat(base.saturating_add(u128::from(cost) * self.period()).min(deepest.max(base)));
    }

    fn refund(&self, state: &mut Self::State, now: Nanos, _granted_at: Nanos, units: u64) {
        // Tokens are fungible: give them back, but never beyond a full bucket.
        let back = u128::from(units) * self.period();
        let tat = state.tat();
        state.set_tat(tat.saturating_sub(back).max(self.scaled(now).min(tat)));
    }

    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool {
        state.tat() <= self.scaled(now)
    }

    /// One pass over the state (the default checks, then charges): `cost` fits when
    /// the bucket spent ahead of now, plus the cost, is within its capacity; what is
    /// left is then exactly the default's (`cost x period` is a whole number of
    /// tokens, so it comes off the floor exactly).
    #[inline]
    fn check(&self, state: &Self::State, now: Nanos, cost: u64) -> Check {
        if cost == 0 {
            return Check::Admit { remaining: self.remaining(state, now) };
        }
        let need = self.used(state, now).saturating_add(u128::from(cost) * self.period());
        match self.capacity_scaled().checked_sub(need) {
            Some(room) => Check::Admit { remaining: sat_u64(self.per_token.div(room)) },
            None => {
                Check::Deny { retry_after: self.retry_after(state, now, cost.min(self.capacity())) }
            }
        }
    }

    #[inline]
    fn try_acquire(&self, state: &mut Self::State, now: Nanos, cost: u64) -> Check {
        if cost == 0 {
            return Check::Admit { remaining: self.remaining(state, now) };
        }
        let now_s = self.scaled(now);
        let tat = state.tat();
        let used = tat.saturating_sub(now_s);
        let need = used.saturating_add(u128::from(cost) * self.period());
        match self.capacity_scaled().checked_sub(need) {
            Some(room) => {
                // Within capacity, so within the debt cap of `charge`.
                state.set_tat(tat.max(now_s) + u128::from(cost) * self.period());
                Check::Admit { remaining: sat_u64(self.per_token.div(room)) }
            }
            None => {
                Check::Deny { retry_after: self.retry_after(state, now, cost.min(self.capacity())) }
            }
        }
    }

    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool {
        state.tat() <= self.scaled(now.saturating_add(skew)) + self.max_used()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Check;

    fn tb(rate: &str, burst: u64) -> TokenBucket {
        TokenBucket::new(rate.parse().unwrap(), NonZeroU64::new(burst).unwrap())
    }

    #[test]
    fn starts_full_refills_exactly_and_caps_at_burst() {
        let b = tb("3/s", 3);
        let mut s = TokenBucketState::default();
        assert_eq!(b.remaining(&s, 0), 3);
        assert_eq!(b.try_acquire(&mut s, 0, 3), Check::Admit { remaining: 0 });
        // One token every 333,333,333.33 ns: due at 333,333,334 ns, not before.
        assert_eq!(b.retry_after(&s, 0, 1), 333_333_334);
        assert_eq!(b.remaining(&s, 333_333_333), 0);
        assert_eq!(b.remaining(&s, 333_333_334), 1);
        assert_eq!(b.remaining(&s, 10_000_000_000), 3);
        assert!(b.is_idle(&s, 1_000_000_000));
        assert_eq!(b.reset_after(&s, 0), 1_000_000_000);
    }

    #[test]
    fn refund_restores_exactly_and_never_overfills() {
        let b = tb("10/s", 10);
        let mut s = TokenBucketState::default();
        b.charge(&mut s, 0, 7);
        let before = s;
        b.charge(&mut s, 0, 2);
        b.refund(&mut s, 0, 0, 2);
        assert_eq!(s, before);
        b.refund(&mut s, 0, 0, 100);
        assert_eq!(b.remaining(&s, 0), 10);
    }

    #[test]
    fn a_charge_past_the_limit_is_a_debt_to_wait_out() {
        let b = tb("1/s", 5);
        let mut s = TokenBucketState::default();
        b.charge(&mut s, 0, 8);
        assert_eq!(b.remaining(&s, 0), 0);
        assert_eq!(b.retry_after(&s, 0, 1), 4_000_000_000);
    }
}

#[cfg(test)]
mod carry_tests {
    use super::*;

    #[test]
    fn carried_tokens_are_kept_to_the_fraction_and_never_grow() {
        let bucket = |amount: u64, period: u64, burst: u64| {
            TokenBucket::new(
                Rate::try_new(amount, period).unwrap(),
                NonZeroU64::new(burst).unwrap(),
            )
        };
        let a = bucket(50_000, 1_000_000_000_000, 50);
        let b = bucket(51_000, 1_000_000_000_000, 51);
        let c = bucket(7, 1_000_000_000, 7);
        let now = 1_796_240_257_221_819_613;
        let mut s = TokenBucketState::default();
        a.charge(&mut s, now, 10);
        // Back and forth at one instant: exactly the same tokens, however often.
        for i in 0..40 {
            let (from, to) = if i % 2 == 0 { (&a, &b) } else { (&b, &a) };
            s = to.carry(from, &s, now);
            assert_eq!(to.remaining(&s, now), 40, "step {i}");
        }
        // To a smaller bucket: at most its size, and no more on the way back.
        s = c.carry(&a, &s, now);
        assert_eq!(c.remaining(&s, now), 7);
        s = a.carry(&c, &s, now);
        assert_eq!(a.remaining(&s, now), 7);
        // A debt stays a debt.
        let mut d = TokenBucketState::default();
        a.charge(&mut d, now, 60);
        let e = b.carry(&a, &d, now);
        assert_eq!(b.remaining(&e, now), 0);
        assert!(b.retry_after(&e, now, 1) > 0);
    }
}
