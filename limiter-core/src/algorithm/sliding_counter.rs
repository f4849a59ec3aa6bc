//! Sliding counter: the current aligned window's count plus the previous window's
//! count weighted by the part of it still inside the rolling window.
//!
//! With `e` the time elapsed in the current window, a cost `c` is admitted when
//! `prev * (W - e) / W + curr + c <= limit`, evaluated exactly (multiplied through
//! by `W`, in `u128`).

use std::num::NonZeroU64;

use super::{Algorithm, max_charged, sat_u64};
use crate::clock::Nanos;

/// A sliding counter's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingCounter {
    limit: NonZeroU64,
    window: NonZeroU64,
}

/// A sliding counter's per-key state: 24 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlidingCounterState {
    /// Index of the window `curr` belongs to.
    window: u64,
    curr: u64,
    prev: u64,
}

/// The counts as seen from `now`.
#[derive(Debug, Clone, Copy)]
struct View {
    index: u64,
    elapsed: u64,
    prev: u64,
    curr: u64,
}

impl SlidingCounter {
    /// At most `limit` units in a rolling `window` nanoseconds (estimated).
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

    fn w(&self) -> u64 {
        self.window.get()
    }

    fn view(&self, state: &SlidingCounterState, now: Nanos) -> View {
        let index = now / self.w();
        let elapsed = now % self.w();
        let (prev, curr) = if state.window == index {
            (state.prev, state.curr)
        } else if state.window.checked_add(1) == Some(index) {
            (state.curr, 0)
        } else {
            (0, 0)
        };
        View { index, elapsed, prev, curr }
    }

    /// `limit*W - prev*(W-e) - curr*W`: the scaled room left (negative: none).
    fn room(&self, v: View) -> i128 {
        let w = i128::from(self.w());
        i128::from(self.limit.get()) * w
            - i128::from(v.prev) * (w - i128::from(v.elapsed))
            - i128::from(v.curr) * w
    }

    /// The least `e'` in `[0, W]` with `prev * (W - e') <= budget * W`.
    fn earliest_elapsed(&self, prev: u64, budget: u64) -> u64 {
        if prev == 0 {
            return 0;
        }
        let w = u128::from(self.w());
        let slack = u128::from(budget) * w / u128::from(prev);
        sat_u64(w.saturating_sub(slack))
    }
}

impl Algorithm for SlidingCounter {
    type State = SlidingCounterState;

    fn capacity(&self) -> u64 {
        self.limit.get()
    }

    fn remaining(&self, state: &Self::State, now: Nanos) -> u64 {
        let room = self.room(self.view(state, now));
        if room <= 0 { 0 } else { sat_u64(room.unsigned_abs() / u128::from(self.w())) }
    }

    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos {
        let v = self.view(state, now);
        let limit = self.limit.get();
        if self.room(v) >= i128::from(cost) * i128::from(self.w()) {
            return 0;
        }
        let window_start = v.index * self.w();
        // Later in the current window, as the previous window's weight fades.
        if let Some(budget) = limit.checked_sub(v.curr.saturating_add(cost)) {
            let e = self.earliest_elapsed(v.prev, budget).max(v.elapsed);
            if e < self.w() {
                return window_start + e - now;
            }
        }
        // In the next window, where the current count becomes the previous one.
        let e = self.earliest_elapsed(v.curr, limit - cost);
        if e < self.w() {
            return window_start + self.w() + e - now;
        }
        window_start + 2 * self.w() - now
    }

    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos {
        let v = self.view(state, now);
        let window_start = v.index * self.w();
        if v.curr > 0 {
            window_start + 2 * self.w() - now
        } else if v.prev > 0 {
            window_start + self.w() - now
        } else {
            0
        }
    }

    fn charge(&self, state: &mut Self::State, now: Nanos, cost: u64) {
        let v = self.view(state, now);
        *state = SlidingCounterState {
            window: v.index,
            curr: v.curr.saturating_add(cost).min(max_charged(self.limit.get())),
            prev: v.prev,
        };
    }

    fn refund(&self, state: &mut Self::State, now: Nanos, granted_at: Nanos, units: u64) {
        let v = self.view(state, now);
        let granted = granted_at / self.w();
        let (mut prev, mut curr) = (v.prev, v.curr);
        if granted == v.index {
            curr = curr.saturating_sub(units);
        } else if granted.checked_add(1) == Some(v.index) {
            prev = prev.saturating_sub(units);
        } else {
            return;
        }
        *state = SlidingCounterState { window: v.index, curr, prev };
    }

    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool {
        let v = self.view(state, now);
        v.prev == 0 && v.curr == 0
    }

    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool {
        let most = max_charged(self.limit.get());
        state.window <= now.saturating_add(skew) / self.w()
            && state.curr <= most
            && state.prev <= most
    }

    fn grant_hold(&self, now: Nanos, hold: Nanos) -> Nanos {
        hold.min(self.w() - now % self.w())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_the_previous_window_by_its_overlap() {
        let c = SlidingCounter::new(NonZeroU64::new(10).unwrap(), NonZeroU64::new(100).unwrap());
        let mut s = SlidingCounterState::default();
        c.charge(&mut s, 50, 10);
        // At 125: prev 10 weighted by 75/100 = 7.5, so 2 units fit.
        assert_eq!(c.remaining(&s, 125), 2);
        // At 150: 10 * 50/100 = 5, so 5 fit.
        assert_eq!(c.remaining(&s, 150), 5);
        // Cost 5 at 125: needs 10*(100-e) <= 5*100, e >= 50 -> at 150.
        assert_eq!(c.retry_after(&s, 125, 5), 25);
        assert_eq!(c.remaining(&s, 200), 10);
        assert_eq!(c.reset_after(&s, 60), 140);
    }
}
