//! Concurrency: at most `limit` permits in use at once. A permit is charged when a
//! request is admitted and stays in use until it is released (a refund naming when
//! it was charged) or until it expires, `permit_ttl` after it was charged or last
//! renewed, whichever comes first. Expiry needs nobody: a holder that crashed, or a
//! release that was lost, costs its permits for at most `permit_ttl`.
//!
//! The state is the permits in use grouped by when they expire, on a grid of a
//! sixteenth of the TTL (at least a millisecond): a permit charged at `t` expires at
//! `t + permit_ttl` rounded up to the grid, so it lives at most one grid step longer
//! than its TTL and never shorter, and the state holds at most 18 groups whatever
//! the number of permits. Which permit is which (so that a release is paid once) is
//! the holder's book, not the state's: the state counts, the book names.

use std::collections::VecDeque;
use std::num::NonZeroU64;

use super::{Algorithm, max_charged};
use crate::clock::Nanos;

/// Expiry groups per TTL.
const GRID_STEPS: u64 = 16;
/// The finest expiry grid.
const MIN_GRID: Nanos = 1_000_000;
/// Groups a plausible state may hold: every live group falls within one TTL and a
/// grid step of `now`, plus the groups a reading slightly ahead has not pruned.
const MAX_GROUPS: usize = (GRID_STEPS as usize + 2) * 2;

/// A concurrency limit's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Concurrency {
    limit: NonZeroU64,
    ttl: NonZeroU64,
    grid: Nanos,
}

/// Permits in use, by expiry (boxed in [`crate::LimitState`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ConcurrencyState {
    /// `(expires_at, permits)`, by strictly increasing expiry (on the grid of the
    /// TTL they were charged under: a reload that changes the TTL keeps them).
    groups: VecDeque<(Nanos, u64)>,
}

impl ConcurrencyState {
    /// Expiry groups held (for memory accounting).
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// True when no group is held.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}

impl Concurrency {
    /// At most `limit` permits at once, each reclaimed `ttl` nanoseconds after it was
    /// charged unless released or renewed first.
    pub fn new(limit: NonZeroU64, ttl: NonZeroU64) -> Self {
        let grid = (ttl.get() / GRID_STEPS).max(MIN_GRID);
        Self { limit, ttl, grid }
    }

    /// Permits in use at once.
    pub fn limit(&self) -> NonZeroU64 {
        self.limit
    }

    /// How long a permit lives unless released or renewed.
    pub fn permit_ttl(&self) -> NonZeroU64 {
        self.ttl
    }

    /// When a permit charged (or renewed) at `at` expires: `at + ttl` rounded up to
    /// the grid.
    pub fn expires_at(&self, at: Nanos) -> Nanos {
        let end = at.saturating_add(self.ttl.get());
        end.div_ceil(self.grid).saturating_mul(self.grid)
    }

    /// Permits in use at `now`.
    pub fn in_use(&self, state: &ConcurrencyState, now: Nanos) -> u64 {
        state.groups.iter().filter(|(e, _)| *e > now).fold(0u64, |s, (_, n)| s.saturating_add(*n))
    }

    fn prune(state: &mut ConcurrencyState, now: Nanos) {
        while state.groups.front().is_some_and(|(e, _)| *e <= now) {
            state.groups.pop_front();
        }
    }
}

impl Algorithm for Concurrency {
    type State = ConcurrencyState;

    fn capacity(&self) -> u64 {
        self.limit.get()
    }

    fn remaining(&self, state: &Self::State, now: Nanos) -> u64 {
        self.limit.get().saturating_sub(self.in_use(state, now))
    }

    /// Until enough permits expire, assuming none is released first (a release
    /// frees them sooner; a caller told to wait may retry earlier).
    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos {
        let mut in_use = self.in_use(state, now);
        if in_use.saturating_add(cost) <= self.limit.get() {
            return 0;
        }
        for &(expires, n) in state.groups.iter().filter(|(e, _)| *e > now) {
            in_use = in_use.saturating_sub(n);
            if in_use.saturating_add(cost) <= self.limit.get() {
                return expires - now;
            }
        }
        0
    }

    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos {
        state.groups.back().map_or(0, |(e, _)| e.saturating_sub(now))
    }

    /// Takes `cost` permits at `now`, expiring a TTL later; never more in use than
    /// [`super::MAX_DEBT_ALLOWANCES`] limits beyond the limit.
    fn charge(&self, state: &mut Self::State, now: Nanos, cost: u64) {
        if cost == 0 {
            return;
        }
        Self::prune(state, now);
        let room = max_charged(self.limit.get()).saturating_sub(self.in_use(state, now));
        let cost = cost.min(room);
        if cost == 0 {
            return;
        }
        let expires = self.expires_at(now);
        match state.groups.binary_search_by_key(&expires, |(e, _)| *e) {
            Ok(i) => state.groups[i].1 += cost,
            Err(i) => state.groups.insert(i, (expires, cost)),
        }
    }

    /// Releases `units` permits charged at `granted_at`: taken from their expiry
    /// group while it is live (an expired permit is already back; releasing it again
    /// changes nothing).
    fn refund(&self, state: &mut Self::State, now: Nanos, granted_at: Nanos, units: u64) {
        let expires = self.expires_at(granted_at);
        if expires <= now {
            return;
        }
        if let Ok(i) = state.groups.binary_search_by_key(&expires, |(e, _)| *e) {
            let group = &mut state.groups[i].1;
            *group = group.saturating_sub(units);
            if *group == 0 {
                state.groups.remove(i);
            }
        }
        Self::prune(state, now);
    }

    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool {
        state.groups.iter().all(|(e, _)| *e <= now)
    }

    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool {
        let latest = self.expires_at(now.saturating_add(skew));
        let ordered = state.groups.iter().zip(state.groups.iter().skip(1)).all(|(a, b)| a.0 < b.0);
        let total = state.groups.iter().fold(0u64, |s, (_, n)| s.saturating_add(*n));
        ordered
            && state.groups.len() <= MAX_GROUPS
            && state.groups.iter().all(|&(e, n)| n > 0 && e <= latest)
            && total <= max_charged(self.limit.get())
    }

    /// Permits are not spent: a grant of them is held until released or expired, so
    /// its hold is the permit TTL, never longer.
    fn grant_hold(&self, _now: Nanos, hold: Nanos) -> Nanos {
        hold.min(self.ttl.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::Check;

    fn n(v: u64) -> NonZeroU64 {
        NonZeroU64::new(v).unwrap()
    }

    const S: Nanos = 1_000_000_000;

    #[test]
    fn permits_are_held_until_released_or_expired() {
        let c = Concurrency::new(n(3), n(16 * S));
        let mut s = ConcurrencyState::default();
        assert!(matches!(c.try_acquire(&mut s, 0, 2), Check::Admit { remaining: 1 }));
        assert!(matches!(c.try_acquire(&mut s, 5 * S, 1), Check::Admit { remaining: 0 }));
        // Full: the first permits expire at 16 s.
        assert_eq!(c.check(&s, 6 * S, 1), Check::Deny { retry_after: 10 * S });
        assert_eq!(c.reset_after(&s, 6 * S), 15 * S);
        // A release of the second: one back at once.
        c.refund(&mut s, 7 * S, 5 * S, 1);
        assert_eq!(c.remaining(&s, 7 * S), 1);
        // Released twice: the group is gone, nothing else changes.
        c.refund(&mut s, 7 * S, 5 * S, 1);
        assert_eq!(c.remaining(&s, 7 * S), 1);
        // Expiry reclaims the rest, with no call.
        assert_eq!(c.remaining(&s, 16 * S), 3);
        assert!(c.is_idle(&s, 16 * S));
        // Releasing an expired permit is harmless.
        c.refund(&mut s, 17 * S, 0, 2);
        assert_eq!(c.remaining(&s, 17 * S), 3);
    }

    #[test]
    fn expiry_rounds_up_to_the_grid_and_never_shortens_a_ttl() {
        let c = Concurrency::new(n(10), n(1_600_000_000));
        for at in [0, 1, 99_999_999, 100_000_000, 123_456_789, u64::MAX / 2] {
            let e = c.expires_at(at);
            assert!(e >= at + 1_600_000_000);
            assert!(e < at + 1_600_000_000 + 100_000_000);
            assert_eq!(e % 100_000_000, 0);
        }
        // A tiny TTL uses the millisecond grid.
        let tiny = Concurrency::new(n(1), n(2_000_000));
        assert_eq!(tiny.expires_at(1), 3_000_000);
    }

    #[test]
    fn a_renewal_moves_a_permit_to_a_later_expiry() {
        let c = Concurrency::new(n(1), n(16 * S));
        let mut s = ConcurrencyState::default();
        c.charge(&mut s, 0, 1);
        // Renew at 10 s: charge anew, then release the old one.
        c.charge(&mut s, 10 * S, 1);
        c.refund(&mut s, 10 * S, 0, 1);
        assert_eq!(c.remaining(&s, 20 * S), 0, "held past its first expiry");
        assert_eq!(c.remaining(&s, 26 * S), 1);
    }

    #[test]
    fn a_stale_clock_reading_loses_no_permit() {
        let c = Concurrency::new(n(2), n(16 * S));
        let mut s = ConcurrencyState::default();
        c.charge(&mut s, 10 * S, 1);
        // A charge read before it lands after it.
        c.charge(&mut s, 9 * S, 1);
        assert_eq!(c.remaining(&s, 10 * S), 0);
        assert!(c.plausible(&s, 10 * S, 0));
        assert_eq!(c.remaining(&s, 25 * S), 1, "the earlier one expires first");
        assert_eq!(c.remaining(&s, 26 * S), 2);
    }

    #[test]
    fn debt_is_bounded_and_implausible_states_are_refused() {
        let c = Concurrency::new(n(2), n(16 * S));
        let mut s = ConcurrencyState::default();
        c.charge(&mut s, 0, u64::MAX);
        assert_eq!(c.in_use(&s, 0), max_charged(2));
        assert!(c.plausible(&s, 0, 0));
        let future = ConcurrencyState { groups: VecDeque::from([(1_000 * S, 1)]) };
        assert!(!c.plausible(&future, 0, S));
        let unordered = ConcurrencyState { groups: VecDeque::from([(16 * S, 1), (S, 1)]) };
        assert!(!c.plausible(&unordered, 0, 0));
        let empty_group = ConcurrencyState { groups: VecDeque::from([(S, 0)]) };
        assert!(!c.plausible(&empty_group, 0, 0));
    }

    #[test]
    fn groups_stay_bounded_whatever_the_traffic() {
        let c = Concurrency::new(n(1_000), n(16 * S));
        let mut s = ConcurrencyState::default();
        for i in 0..100_000u64 {
            let now = i * 7_000_000;
            let _ = c.try_acquire(&mut s, now, 1);
            if i % 3 == 0 {
                c.refund(&mut s, now, now.saturating_sub(5 * S), 1);
            }
            assert!(s.len() <= GRID_STEPS as usize + 2, "{} groups at {now}", s.len());
        }
    }
}
