//! Sliding log: at most `limit` units in any interval `(now - W, now]`, exactly.
//!
//! The state is a log of `(time, units)` entries, one per charge instant (charges at
//! the same nanosecond merge). Every admitted entry carries at least one unit and the
//! log only holds units inside the window, so it has at most `limit` entries; charges
//! past the limit (reported debts) merge into the newest entry and move it later,
//! which only ever makes the limit stricter.
//!
//! A leased grant may be spent at any time until `now + hold`, so it is logged at that
//! latest instant (in the future): it then counts against every window that any of
//! its spends can fall in, and the limit stays exact for leased traffic too, at the
//! cost of holding the slot for `hold` longer (holds are capped at `W / 40`).

use std::collections::VecDeque;
use std::num::NonZeroU64;

use super::{Algorithm, max_charged};
use crate::clock::Nanos;

/// A sliding log's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingLog {
    limit: NonZeroU64,
    window: NonZeroU64,
}

/// A sliding log's per-key state: 40 bytes inline plus 16 bytes per entry, at most
/// `limit` entries.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlidingLogState {
    entries: VecDeque<(Nanos, u64)>,
    /// Sum of the units of every entry in `entries`, expired ones included.
    total: u64,
}

impl SlidingLogState {
    /// Entries currently held (for memory accounting).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

impl SlidingLog {
    /// At most `limit` units in any `window` nanoseconds.
    pub fn new(limit: NonZeroU64, window: NonZeroU64) -> Self {
        Self { limit, window }
    }

    /// Units per window.
    pub fn limit(&self) -> NonZeroU64 {
        self.limit
    }

    /// Window length in nanoseconds.
    pub fn window(&self) -> NonZeroU64 {
        self.window
    }

    /// An entry at `t` no longer counts at `now` once `t + W <= now`.
    fn expired(&self, t: Nanos, now: Nanos) -> bool {
        t.saturating_add(self.window.get()) <= now
    }

    /// Index of the first live entry and the units of the live entries.
    fn live(&self, state: &SlidingLogState, now: Nanos) -> (usize, u64) {
        let mut dead = 0;
        let mut dead_units = 0;
        for &(t, units) in &state.entries {
            if !self.expired(t, now) {
                break;
            }
            dead += 1;
            dead_units += units;
        }
        (dead, state.total - dead_units)
    }

    fn evict(&self, state: &mut SlidingLogState, now: Nanos) {
        while let Some(&(t, units)) = state.entries.front() {
            if !self.expired(t, now) {
                break;
            }
            state.entries.pop_front();
            state.total -= units;
        }
    }
}

impl Algorithm for SlidingLog {
    type State = SlidingLogState;

    fn capacity(&self) -> u64 {
        self.limit.get()
    }

    fn remaining(&self, state: &Self::State, now: Nanos) -> u64 {
        self.limit.get().saturating_sub(self.live(state, now).1)
    }

    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos {
        let (first, live) = self.live(state, now);
        let Some(excess) = (live.saturating_add(cost)).checked_sub(self.limit.get()) else {
            return 0;
        };
        if excess == 0 {
            return 0;
        }
        // Wait until the oldest entries holding `excess` units have left the window.
        let mut freed = 0;
        for &(t, units) in state.entries.iter().skip(first) {
            freed += units;
            if freed >= excess {
                return t.saturating_add(self.window.get()).saturating_sub(now);
            }
        }
        // Unreachable with cost <= limit; answer conservatively anyway.
        self.window.get()
    }

    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos {
        match state.entries.back() {
            Some(&(t, _)) if !self.expired(t, now) => t.saturating_add(self.window.get()) - now,
            _ => 0,
        }
    }

    fn charge(&self, state: &mut Self::State, now: Nanos, cost: u64) {
        self.charge_at(state, now, now, cost);
    }

    /// A grant holds its slot for `hold` beyond the window, so holds are kept to a
    /// fortieth of the window: leased traffic then uses at least 97.5% of the limit.
    fn grant_hold(&self, _now: Nanos, hold: Nanos) -> Nanos {
        hold.min(self.window.get() / 40)
    }

    fn grant_stamp(&self, now: Nanos, hold: Nanos) -> Nanos {
        now.saturating_add(hold)
    }

    fn charge_at(&self, state: &mut Self::State, now: Nanos, stamp: Nanos, cost: u64) {
        self.evict(state, now);
        if cost == 0 {
            return;
        }
        // Debt is capped in units, never in time: at the cap, the newest entry only
        // counts for longer.
        let cost = cost.min(max_charged(self.limit.get()).saturating_sub(state.total));
        if cost == 0 {
            if let Some(last) = state.entries.back_mut() {
                last.0 = last.0.max(stamp);
            }
            return;
        }
        state.total = state.total.saturating_add(cost);
        let cap = usize::try_from(self.limit.get()).unwrap_or(usize::MAX);
        let full = state.entries.len() >= cap;
        // Entries stay sorted by time; a stamp in the future (a lease) may sit between.
        let at = state.entries.iter().rposition(|&(t, _)| t <= stamp).map_or(0, |i| i + 1);
        match state.entries.get_mut(at.wrapping_sub(1)) {
            Some(e) if e.0 == stamp => e.1 = e.1.saturating_add(cost),
            _ if full => {
                // Merging into the latest entry only lengthens how long units count.
                let last = state.entries.back_mut().expect("a full log has entries");
                *last = (stamp.max(last.0), last.1.saturating_add(cost));
            }
            _ => state.entries.insert(at, (stamp, cost)),
        }
    }

    fn refund(&self, state: &mut Self::State, now: Nanos, granted_at: Nanos, units: u64) {
        self.evict(state, now);
        if let Some(i) = state.entries.iter().rposition(|&(t, _)| t == granted_at) {
            let back = units.min(state.entries[i].1);
            state.entries[i].1 -= back;
            state.total -= back;
            if state.entries[i].1 == 0 {
                state.entries.remove(i);
            }
        }
    }

    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool {
        self.live(state, now).1 == 0
    }

    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool {
        // Lease grants are stamped up to a fortieth of the window ahead.
        let latest = now.saturating_add(skew).saturating_add(self.window.get() / 40);
        let cap = usize::try_from(self.limit.get()).unwrap_or(usize::MAX);
        let mut sum = 0u64;
        let mut last = 0;
        for &(t, units) in &state.entries {
            if units == 0 || t < last || t > latest {
                return false;
            }
            last = t;
            sum = sum.saturating_add(units);
        }
        state.entries.len() <= cap && sum == state.total && sum <= max_charged(self.limit.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(limit: u64, window: u64) -> SlidingLog {
        SlidingLog::new(NonZeroU64::new(limit).unwrap(), NonZeroU64::new(window).unwrap())
    }

    #[test]
    fn counts_every_unit_in_the_open_closed_interval() {
        let l = log(3, 100);
        let mut s = SlidingLogState::default();
        l.charge(&mut s, 10, 1);
        l.charge(&mut s, 20, 2);
        assert_eq!(l.remaining(&s, 109), 0);
        // The entry at 10 leaves at 110; two units must wait for the one at 20.
        assert_eq!(l.retry_after(&s, 50, 1), 60);
        assert_eq!(l.retry_after(&s, 50, 2), 70);
        assert_eq!(l.remaining(&s, 110), 1);
        assert_eq!(l.remaining(&s, 120), 3);
        assert_eq!(l.reset_after(&s, 50), 70);
    }

    #[test]
    fn memory_is_bounded_by_the_limit_even_with_debt() {
        let l = log(4, 1_000);
        let mut s = SlidingLogState::default();
        for t in 0..100 {
            l.charge(&mut s, t, 1);
        }
        assert!(s.len() <= 4);
        assert_eq!(l.remaining(&s, 100), 0);
        // Debt is never forgotten early: the merged units count until their last time.
        assert_eq!(l.remaining(&s, 1_098), 0);
    }

    #[test]
    fn refund_removes_the_granted_units() {
        let l = log(10, 100);
        let mut s = SlidingLogState::default();
        l.charge(&mut s, 5, 3);
        l.charge(&mut s, 6, 4);
        l.refund(&mut s, 7, 6, 4);
        assert_eq!(l.remaining(&s, 7), 7);
        assert_eq!(s.len(), 1);
    }
}
