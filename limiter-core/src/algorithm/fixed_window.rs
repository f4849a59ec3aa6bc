//! Fixed window: at most `limit` units per aligned window `[k*W, (k+1)*W)`.

use std::num::NonZeroU64;

use super::{Algorithm, max_charged};
use crate::clock::Nanos;

/// A fixed window's parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    limit: NonZeroU64,
    window: NonZeroU64,
}

/// A fixed window's per-key state: 16 bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FixedWindowState {
    /// Index of the window `count` belongs to.
    window: u64,
    count: u64,
}

impl FixedWindow {
    /// At most `limit` units per window of `window` nanoseconds.
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

    fn index(&self, t: Nanos) -> u64 {
        t / self.window.get()
    }

    fn count(&self, state: &FixedWindowState, now: Nanos) -> u64 {
        if state.window == self.index(now) { state.count } else { 0 }
    }

    fn until_next_window(&self, now: Nanos) -> Nanos {
        self.window.get() - now % self.window.get()
    }
}

impl Algorithm for FixedWindow {
    type State = FixedWindowState;

    fn capacity(&self) -> u64 {
        self.limit.get()
    }

    fn remaining(&self, state: &Self::State, now: Nanos) -> u64 {
        self.limit.get().saturating_sub(self.count(state, now))
    }

    fn retry_after(&self, state: &Self::State, now: Nanos, cost: u64) -> Nanos {
        if self.count(state, now).saturating_add(cost) <= self.limit.get() {
            0
        } else {
            self.until_next_window(now)
        }
    }

    fn reset_after(&self, state: &Self::State, now: Nanos) -> Nanos {
        if self.count(state, now) == 0 { 0 } else { self.until_next_window(now) }
    }

    fn charge(&self, state: &mut Self::State, now: Nanos, cost: u64) {
        let index = self.index(now);
        if state.window != index {
            *state = FixedWindowState { window: index, count: 0 };
        }
        state.count = state.count.saturating_add(cost).min(max_charged(self.limit.get()));
    }

    fn refund(&self, state: &mut Self::State, now: Nanos, granted_at: Nanos, units: u64) {
        let index = self.index(now);
        if state.window == index && self.index(granted_at) == index {
            state.count = state.count.saturating_sub(units);
        }
    }

    fn is_idle(&self, state: &Self::State, now: Nanos) -> bool {
        self.count(state, now) == 0
    }

    fn plausible(&self, state: &Self::State, now: Nanos, skew: Nanos) -> bool {
        state.window <= self.index(now.saturating_add(skew))
            && state.count <= max_charged(self.limit.get())
    }

    fn grant_hold(&self, now: Nanos, hold: Nanos) -> Nanos {
        hold.min(self.until_next_window(now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
