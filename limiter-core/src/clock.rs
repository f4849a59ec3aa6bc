//! Time sources. The algorithms never read a clock: they take `now` in integer
//! nanoseconds. This module is the one place allowed to read the system clocks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Nanoseconds on a clock's time line. All limit arithmetic is done in these.
pub type Nanos = u64;

/// Nanoseconds in one second.
pub const NANOS_PER_SEC: Nanos = 1_000_000_000;

/// A monotonic source of time in nanoseconds.
///
/// Windows of `fixed_window` and `sliding_counter` are aligned to multiples of the
/// window length on this time line, so a clock that starts at the Unix epoch aligns
/// them to wall-clock minutes and hours.
pub trait Clock: Send + Sync {
    /// The current time. Never goes backwards.
    fn now(&self) -> Nanos;
}

/// The production clock: anchored once to the Unix epoch, then advanced by the
/// monotonic clock, so it never jumps when the wall clock is stepped.
#[derive(Debug, Clone)]
pub struct MonotonicClock {
    origin: Instant,
    origin_unix: Nanos,
}

impl MonotonicClock {
    /// A clock anchored to the wall clock at the moment of creation.
    #[allow(clippy::disallowed_methods)] // the one sanctioned reader of system time
    pub fn new() -> Self {
        let origin_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        Self { origin: Instant::now(), origin_unix }
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    #[allow(clippy::disallowed_methods)] // the one sanctioned reader of the monotonic clock
    fn now(&self) -> Nanos {
        let elapsed = u64::try_from(self.origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.origin_unix.saturating_add(elapsed)
    }
}

/// A clock that only moves when told to; cheap to clone, clones share the time.
///
/// # Examples
///
/// ```
/// use limiter_core::clock::{Clock, ManualClock};
/// use std::time::Duration;
/// let clock = ManualClock::new(0);
/// clock.advance(Duration::from_millis(5));
/// assert_eq!(clock.now(), 5_000_000);
/// ```
#[derive(Debug, Clone, Default)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock reading `start` nanoseconds.
    pub fn new(start: Nanos) -> Self {
        Self { now: Arc::new(AtomicU64::new(start)) }
    }

    /// Moves the clock forward by `by`.
    #[inline]
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        // Relaxed: the clock value is the only shared datum; readers need no other ordering.
        self.now.fetch_add(by, Ordering::Relaxed);
    }

    /// Sets the clock to `to`; ignored if that would move it backwards.
    pub fn set(&self, to: Nanos) {
        self.now.fetch_max(to, Ordering::Relaxed);
    }
}

impl Clock for ManualClock {
    #[inline]
    fn now(&self) -> Nanos {
        self.now.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_never_goes_back_and_starts_near_the_epoch_time() {
        let c = MonotonicClock::new();
        let a = c.now();
        let b = c.now();
        assert!(b >= a);
        // 2020-01-01 in nanoseconds: the anchor is the wall clock, not zero.
        assert!(a > 1_577_836_800 * NANOS_PER_SEC);
    }

    #[test]
    fn manual_clock_clones_share_time_and_never_go_back() {
        let c = ManualClock::new(10);
        let d = c.clone();
        c.advance(Duration::from_nanos(5));
        assert_eq!(d.now(), 15);
        d.set(3);
        assert_eq!(c.now(), 15);
    }
}
