//! Fixed window: at most `limit` units per aligned window: `[k*W, (k+1)*W)` for a
//! fixed length, or a calendar window (a local day, week, month or year).

use std::num::NonZeroU64;

use super::{Algorithm, Window, max_charged};
use crate::calendar::Span;
use crate::clock::Nanos;

/// A fixed window's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    limit: NonZeroU64,
    window: Window,
}

/// A fixed window's per-key state: 16 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FixedWindowState {
    /// Number of the window `count` belongs to.
    window: u64,
    count: u64,
}

impl FixedWindow {
    /// At most `limit` units per window of `window` nanoseconds.
    pub fn new(limit: NonZeroU64, window: NonZeroU64) -> Self {
        Self { limit, window: Window::Fixed(window) }
    }

    /// At most `limit` units per window, fixed or calendar.
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

    /// The count of the window `span` is in. A state of a later window (a caller
    /// that read the clock before another caller's update of this key landed) counts
    /// as it stands: reading it as another window's would start the key afresh.
    #[inline]
    fn count(state: &FixedWindowState, span: &Span) -> u64 {
        if state.window >= span.index { state.count } else { 0 }
    }
}

impl Algorithm for FixedWindow {
    type State = FixedWindowState;

    fn capacity(&self) -> u64 {
        self.limit.get()
    }

    fn remaining(&self, state: &Self::State, now: Nanos) -> u64 {
        self.limit.get().saturating_sub(Self::count(state, &self.window.span(now)))
    }

    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos {
        let span = self.window.span(now);
        if Self::count(state, &span).saturating_add(cost) <= self.limit.get() {
            0
        } else {
            span.end() - now
        }
    }

    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos {
        let span = self.window.span(now);
        if Self::count(state, &span) == 0 { 0 } else { span.end() - now }
    }

    fn charge(&self, state: &mut Self::State, now: Nanos, cost: u64) {
        let index = self.window.span(now).index;
        if state.window < index {
            *state = FixedWindowState { window: index, count: 0 };
        }
        state.count = state.count.saturating_add(cost).min(max_charged(self.limit.get()));
    }

    fn refund(&self, state: &mut Self::State, now: Nanos, granted_at: Nanos, units: u64) {
        let span = self.window.span(now);
        if state.window == span.index
            && self.window.index_near(&span, granted_at) == Some(span.index)
        {
            state.count = state.count.saturating_sub(units);
        }
    }

    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool {
        Self::count(state, &self.window.span(now)) == 0
    }

    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool {
        state.window <= self.window.latest_index(now, skew)
            && state.count <= max_charged(self.limit.get())
    }

    fn grant_hold(&self, now: Nanos, hold: Nanos) -> Nanos {
        hold.min(self.window.span(now).end() - now)
    }

    /// One window look-up for the check and the charge.
    fn try_acquire(&self, state: &mut Self::State, now: Nanos, cost: u64) -> super::Check {
        let span = self.window.span(now);
        let count = Self::count(state, &span);
        if count.saturating_add(cost) <= self.limit.get() {
            *state = FixedWindowState { window: span.index.max(state.window), count: count + cost };
            super::Check::Admit { remaining: self.limit.get() - count - cost }
        } else {
            let cost = cost.min(self.limit.get());
            let fits = count.saturating_add(cost) <= self.limit.get();
            let retry_after = if fits { 0 } else { span.end() - now };
            super::Check::Deny { retry_after }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_reading_older_than_the_state_forgets_nothing() {
        let w = FixedWindow::new(NonZeroU64::new(5).unwrap(), NonZeroU64::new(100).unwrap());
        let mut s = FixedWindowState::default();
        w.charge(&mut s, 201, 4);
        assert_eq!(w.remaining(&s, 199), 1, "a stale reading sees the later window's count");
        assert!(matches!(
            w.try_acquire(&mut s, 199, 1),
            super::super::Check::Admit { remaining: 0 }
        ));
        w.charge(&mut s, 198, 1);
        assert_eq!(s, FixedWindowState { window: 2, count: 6 }, "counted in window 2");
        assert_eq!(w.remaining(&s, 250), 0);
        assert!(!w.is_idle(&s, 199));
        w.refund(&mut s, 199, 150, 3);
        assert_eq!(s, FixedWindowState { window: 2, count: 6 }, "a stale refund changes nothing");
    }

    #[test]
    fn windows_are_aligned_and_reset_at_their_end() {
        let w = FixedWindow::new(NonZeroU64::new(5).unwrap(), NonZeroU64::new(100).unwrap());
        let mut s = FixedWindowState::default();
        w.charge(&mut s, 150, 5);
        assert_eq!(w.remaining(&s, 199), 0);
        assert_eq!(w.retry_after(&s, 170, 1), 30);
        assert_eq!(w.remaining(&s, 200), 5);
        // A refund for a grant of an earlier window changes nothing.
        let before = s;
        w.refund(&mut s, 150, 50, 3);
        assert_eq!(s, before);
        w.refund(&mut s, 160, 150, 3);
        assert_eq!(w.remaining(&s, 160), 3);
    }
}
