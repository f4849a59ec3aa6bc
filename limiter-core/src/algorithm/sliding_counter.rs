//! Sliding counter: the current aligned window's count plus the previous window's
//! count weighted by the part of it still inside the rolling window.
//!
//! With `e` the time elapsed in the current window of length `L`, and the previous
//! window of length `P`, the rolling window `(now - L, now]` still covers
//! `o = min(P, L - e)` of the previous one, whose count is taken as spread evenly
//! over its real length. A cost `c` is admitted when
//! `prev * o / P + curr + c <= limit`, evaluated exactly (multiplied through by `P`,
//! in `i128`). For a fixed window `L = P = W` and `o = W - e`: the usual
//! `prev * (W - e) / W`. A calendar month after a longer one starts with the longer
//! one's weight below 1 (28 of January's 31 days still count on the 1st of February).

use std::num::NonZeroU64;

use super::{Algorithm, Window, max_charged, sat_u64};
use crate::calendar::Span;
use crate::clock::Nanos;

/// A sliding counter's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingCounter {
    limit: NonZeroU64,
    window: Window,
}

/// A sliding counter's per-key state: 24 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SlidingCounterState {
    /// Number of the window `curr` belongs to.
    window: u64,
    curr: u64,
    prev: u64,
}

/// The counts as seen from `now`.
#[derive(Debug, Clone, Copy)]
struct View {
    span: Span,
    elapsed: u64,
    prev: u64,
    curr: u64,
    /// The window `curr` belongs to: `span.index`, or the state's own when it is
    /// later (`stale`).
    index: u64,
    /// `now` is older than the state's window: a caller that read the clock before
    /// another caller's update of this key landed.
    stale: bool,
}

impl View {
    /// How much of the previous window the rolling window still covers (all of it
    /// for a stale view: the most it can weigh).
    fn overlap(&self) -> u64 {
        if self.stale {
            return self.span.prev_len;
        }
        self.span.prev_len.min(self.span.len - self.elapsed)
    }
}

impl SlidingCounter {
    /// At most `limit` units in a rolling `window` nanoseconds (estimated).
    pub fn new(limit: NonZeroU64, window: NonZeroU64) -> Self {
        Self { limit, window: Window::Fixed(window) }
    }

    /// At most `limit` units in a rolling window, fixed or calendar.
    pub fn with_window(limit: NonZeroU64, window: Window) -> Self {
        Self { limit, window }
    }

    /// Units per window.
    pub fn limit(&self) -> NonZeroU64 {
        self.limit
    }

    /// The window.
    pub fn window(&self) -> Window {
        self.window
    }

    fn view(&self, state: &SlidingCounterState, now: Nanos) -> View {
        let span = self.window.span(now);
        let elapsed = now - span.start;
        if state.window > span.index {
            // The state is of a later window than `now`: its counts as they stand,
            // nothing forgotten (reading them as another window's would start the
            // key afresh), and updates stay in the state's window.
            let (prev, curr, index) = (state.prev, state.curr, state.window);
            return View { span, elapsed, prev, curr, index, stale: true };
        }
        let (prev, curr) = if state.window == span.index {
            (state.prev, state.curr)
        } else if state.window.checked_add(1) == Some(span.index) {
            (state.curr, 0)
        } else {
            (0, 0)
        };
        View { span, elapsed, prev, curr, index: span.index, stale: false }
    }

    /// `limit*P - prev*o - curr*P`: the room left, scaled by `P` (negative: none).
    fn room(&self, v: &View) -> i128 {
        let p = i128::from(v.span.prev_len);
        i128::from(self.limit.get()) * p
            - i128::from(v.prev) * i128::from(v.overlap())
            - i128::from(v.curr) * p
    }

    /// The least elapsed time `e'` in a window of length `len` after one of length
    /// `prev_len` holding `prev` units, with `prev * min(prev_len, len - e') <=
    /// budget * prev_len`.
    fn earliest_elapsed(prev: u64, prev_len: u64, len: u64, budget: u64) -> u64 {
        if prev == 0 {
            return 0;
        }
        let slack = u128::from(budget) * u128::from(prev_len) / u128::from(prev);
        if slack >= u128::from(prev_len) {
            return 0;
        }
        sat_u64(u128::from(len).saturating_sub(slack))
    }
}

impl Algorithm for SlidingCounter {
    type State = SlidingCounterState;

    fn capacity(&self) -> u64 {
        self.limit.get()
    }

    fn remaining(&self, state: &Self::State, now: Nanos) -> u64 {
        let v = self.view(state, now);
        let room = self.room(&v);
        if room <= 0 { 0 } else { sat_u64(room.unsigned_abs() / u128::from(v.span.prev_len)) }
    }

    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos {
        let v = self.view(state, now);
        let limit = self.limit.get();
        if self.room(&v) >= i128::from(cost) * i128::from(v.span.prev_len) {
            return 0;
        }
        let (start, len) = (v.span.start, v.span.len);
        // Later in the current window, as the previous window's weight fades.
        if let Some(budget) = limit.checked_sub(v.curr.saturating_add(cost)) {
            let e = Self::earliest_elapsed(v.prev, v.span.prev_len, len, budget).max(v.elapsed);
            if e < len {
                return start + e - now;
            }
        }
        // In the next window, where the current count becomes the previous one.
        let next = v.span.next_len;
        let e = Self::earliest_elapsed(v.curr, len, next, limit - cost);
        if e < next {
            return start + len + e - now;
        }
        start + len + next - now
    }

    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos {
        let v = self.view(state, now);
        let end = v.span.end();
        if v.curr > 0 {
            end + v.span.next_len - now
        } else if v.prev > 0 {
            end - now
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
        if v.stale {
            // Which window the grant's units are in cannot be told from a stale
            // clock: kept (a refund may only lower a count it is sure of).
            return;
        }
        let (mut prev, mut curr) = (v.prev, v.curr);
        match self.window.index_near(&v.span, granted_at) {
            Some(i) if i == v.span.index => curr = curr.saturating_sub(units),
            Some(_) => prev = prev.saturating_sub(units),
            None => return,
        }
        *state = SlidingCounterState { window: v.span.index, curr, prev };
    }

    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool {
        let v = self.view(state, now);
        v.prev == 0 && v.curr == 0
    }

    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool {
        let most = max_charged(self.limit.get());
        state.window <= self.window.latest_index(now, skew)
            && state.curr <= most
            && state.prev <= most
    }

    fn grant_hold(&self, now: Nanos, hold: Nanos) -> Nanos {
        hold.min(self.window.span(now).end() - now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_reading_older_than_the_state_forgets_nothing() {
        // Two callers read the clock either side of a window's start and the later
        // one's update lands first: the earlier reading must not start the key afresh.
        let c = SlidingCounter::new(NonZeroU64::new(10).unwrap(), NonZeroU64::new(100).unwrap());
        let mut s = SlidingCounterState::default();
        c.charge(&mut s, 150, 10);
        c.charge(&mut s, 201, 0);
        assert_eq!(c.remaining(&s, 201), 0);
        assert_eq!(c.remaining(&s, 199), 0, "a stale reading sees the counts as they stand");
        c.charge(&mut s, 199, 1);
        assert_eq!(s, SlidingCounterState { window: 2, curr: 1, prev: 10 }, "counted in window 2");
        assert_eq!(c.remaining(&s, 202), 0);
        assert!(!c.is_idle(&s, 199));
        // A refund read from a stale clock changes nothing.
        c.refund(&mut s, 199, 199, 1);
        assert_eq!(s, SlidingCounterState { window: 2, curr: 1, prev: 10 });
        let retry_after = c.retry_after(&s, 199, 1);
        assert_eq!(c.try_acquire(&mut s, 199, 1), super::super::Check::Deny { retry_after });
    }

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
