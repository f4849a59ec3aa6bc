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

/// Reads of the wall clock between two of the monotonic clock made to anchor a
/// [`MonotonicClock`]; the read closest in time to its monotonic reads is kept.
const ANCHOR_READS: usize = 16;

impl MonotonicClock {
    /// A clock anchored to the wall clock at the moment of creation.
    ///
    /// The wall clock is read between two reads of the monotonic clock, several
    /// times, and the read with the least time around it anchors the time line: a
    /// thread descheduled between the two clocks' reads (milliseconds on a busy
    /// machine) would otherwise set its whole time line off by as long as it
    /// waited, and processes that compare times (nodes aligning windows, a load
    /// test judging several gateways' records together) would disagree by that.
    #[allow(clippy::disallowed_methods)] // the one sanctioned reader of system time
    pub fn new() -> Self {
        let base = Instant::now();
        let since = |t: Instant| u64::try_from(t.duration_since(base).as_nanos()).unwrap_or(0);
        let reads = (0..ANCHOR_READS).map(|_| {
            let before = since(Instant::now());
            let unix = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
            (before, unix, since(Instant::now()))
        });
        let (mid, origin_unix) = tightest(reads);
        Self { origin: base + Duration::from_nanos(mid), origin_unix }
    }

    /// The instant at which this clock reads `at` (the nearest it can tell: `None`
    /// when that is before the clock's anchor and the platform cannot go back so far).
    pub fn instant_of(&self, at: Nanos) -> Option<Instant> {
        if at >= self.origin_unix {
            self.origin.checked_add(Duration::from_nanos(at - self.origin_unix))
        } else {
            self.origin.checked_sub(Duration::from_nanos(self.origin_unix - at))
        }
    }
}

/// Of wall-clock reads each between two monotonic reads (`(before, wall, after)`,
/// the monotonic ones in nanoseconds from any base), the one with the least time
/// between its monotonic reads: the monotonic instant half way between them and the
/// wall clock's reading.
fn tightest(reads: impl Iterator<Item = (Nanos, Nanos, Nanos)>) -> (Nanos, Nanos) {
    tightest_between(reads).map_or((0, 0), |(mid, _, wall)| (mid, wall))
}

/// Of readings of another clock each taken between two reads of a reference
/// (`(before, reading, after)`, the reference's in nanoseconds from any base), the
/// one with the least time between its reference reads, as (the reference's instant
/// half way between them, half the time between them, the reading). A thread
/// descheduled between two reads only widens that pair, so comparing clocks by
/// their tightest pair keeps a wait out of the comparison.
pub fn tightest_between<T>(
    reads: impl Iterator<Item = (Nanos, T, Nanos)>,
) -> Option<(Nanos, Nanos, T)> {
    reads.min_by_key(|(before, _, after)| after.saturating_sub(*before)).map(
        |(before, reading, after)| {
            let half = after.saturating_sub(before) / 2;
            (before + half, half, reading)
        },
    )
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
    fn the_anchor_is_the_wall_clock_read_closest_to_its_monotonic_reads() {
        // The second read waited 5 ms between the clocks (descheduled): not taken.
        let reads = [
            (0, 1_000_000, 900),
            (1_000, 1_001_000 + 5_000_000, 5_001_000),
            (6_000, 1_006_000, 6_100),
        ];
        assert_eq!(tightest(reads.into_iter()), (6_050, 1_006_000));
        assert_eq!(tightest(std::iter::empty()), (0, 0));
        // A clock's instants and readings agree.
        let c = MonotonicClock::new();
        let at = c.now() + 1_000_000;
        let t = c.instant_of(at).unwrap();
        let back = c.instant_of(at - 2_000_000).unwrap();
        assert_eq!(t.duration_since(back), Duration::from_millis(2));
        assert_eq!(
            c.origin_unix
                .saturating_add(u64::try_from(t.duration_since(c.origin).as_nanos()).unwrap()),
            at
        );
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
