//! The agent's clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use limiter_core::clock::{Clock, MonotonicClock, Nanos, tightest_between};
use parking_lot::Mutex;

/// How far the time-stamp counter may run off the OS's monotonic clock before the
/// agent stops trusting it: 0.1%, a fifth of the default lease deadline margin
/// ([`crate::AgentConfig::deadline_margin`]), so a lease cannot outlive its hold by
/// the counter's error.
pub const COUNTER_TOLERANCE_PPM: u64 = 1_000;

/// Reads of the OS clock on either side of one of the counter's, the tightest kept.
const PAIR_READS: usize = 8;

/// The span over which the counter's rate is judged: a check compares the two
/// clocks since the last check at least this far back (the start, at first), so a
/// rate that changes after a long run (a host's counter rescaled, say) is caught
/// within about this span, not diluted by the run.
const CHECK_SPAN: Nanos = 1_000_000_000;

/// The agent's default clock: the CPU's invariant time-stamp counter where there is
/// one (a few nanoseconds a read, about half the OS clock's here), else the OS's
/// monotonic clock. The agent only measures durations on it (its deadlines count
/// from its own send times), so it need not agree with the owner's.
///
/// The counter's rate is `quanta`'s calibration, a measurement of about a
/// millisecond at the process's start: a thread descheduled in it sets the rate off
/// for the process's life. So [`FastClock::check`] (the agent's renewer calls it
/// every round) compares the counter with the OS clock over the last second or so
/// (since the start, at first); once it is off by more than
/// [`COUNTER_TOLERANCE_PPM`] of that span, the clock reads the OS clock instead
/// and says so in a warning. A counter that ran slow jumps forward to the OS clock
/// (a lease's deadline comes sooner, never later); one that ran fast goes on from
/// where it had got to (never back), at the OS clock's rate.
#[derive(Debug)]
pub struct FastClock {
    clock: quanta::Clock,
    /// A test's counter, in nanoseconds (read through a mock clock, whose scale is
    /// one).
    #[cfg(test)]
    source: Option<Source>,
    /// The counter's reading at the start (its raw units).
    origin: u64,
    /// The OS clock, and its reading at the counter's origin.
    os: MonotonicClock,
    os_origin: Nanos,
    /// Where the rate is judged from: the OS clock's reading, the counter's (both
    /// since the origin) and how far the first may be from the moment of the second
    /// (half the tightest pair of OS reads around it). The origin at first.
    anchor: Mutex<(Nanos, Nanos, Nanos)>,
    /// 0 while the counter is trusted; then what is added to the OS clock's reading
    /// since the origin, which is read instead (at least 1: never a zero reading).
    os_offset: AtomicU64,
}

impl Default for FastClock {
    fn default() -> Self {
        Self::bare(quanta::Clock::new()).started()
    }
}

impl Clock for FastClock {
    #[inline]
    fn now(&self) -> Nanos {
        match self.os_offset.load(Ordering::Relaxed) {
            // Never zero: 0 means "no deadline" for a balance.
            0 => self.counter() + 1,
            off => self.os_since() + off,
        }
    }
}

impl FastClock {
    /// The clock on `clock`'s counter, not started.
    fn bare(clock: quanta::Clock) -> Self {
        Self {
            clock,
            #[cfg(test)]
            source: None,
            origin: 0,
            os: MonotonicClock::new(),
            os_origin: 0,
            anchor: Mutex::new((0, 0, 0)),
            os_offset: AtomicU64::new(0),
        }
    }

    /// Its origin: the counter's reading now and the OS clock's around it.
    fn started(mut self) -> Self {
        let (os_origin, origin_slack, origin) = tightest(|| self.raw(), &self.os);
        (self.os_origin, self.origin) = (os_origin, origin);
        *self.anchor.get_mut() = (0, 0, origin_slack);
        self
    }

    /// The counter's raw reading.
    #[inline]
    fn raw(&self) -> u64 {
        #[cfg(test)]
        if let Some(f) = &self.source {
            return (f.0)();
        }
        self.clock.raw()
    }

    /// Nanoseconds since the origin by the counter: the raw counter scaled by one
    /// multiply and shift (no `Duration`, whose making divides by a billion).
    #[inline]
    fn counter(&self) -> Nanos {
        self.counter_at(self.raw())
    }

    #[inline]
    fn counter_at(&self, raw: u64) -> Nanos {
        self.clock.delta_as_nanos(self.origin, raw)
    }

    /// Nanoseconds since the origin by the OS clock.
    fn os_since(&self) -> Nanos {
        self.os.now().saturating_sub(self.os_origin)
    }

    /// The OS clock's time since the origin, never zero: what rates measured over
    /// unbounded spans (the emergency ceilings) read, whatever the counter does.
    pub fn os_now(&self) -> Nanos {
        self.os_since() + 1
    }

    /// Whether the clock reads the OS clock (the counter was found off).
    pub fn on_os_clock(&self) -> bool {
        self.os_offset.load(Ordering::Relaxed) != 0
    }

    /// Compares the counter with the OS clock since the anchor; when it is off by
    /// more than [`COUNTER_TOLERANCE_PPM`] of the time (beyond what the reads
    /// themselves may be off), reads the OS clock from now on and returns the
    /// counter's error in parts per million. `None` while the counter is trusted (the
    /// anchor moved here once it is [`CHECK_SPAN`] back), and once the OS clock is
    /// read.
    pub fn check(&self) -> Option<i64> {
        if self.on_os_clock() {
            return None;
        }
        let (os_mid, slack, raw) = tightest(|| self.raw(), &self.os);
        let (os_now, counter_now) = (os_mid.saturating_sub(self.os_origin), self.counter_at(raw));
        let mut anchor = self.anchor.lock();
        let (os_from, counter_from, anchor_slack) = *anchor;
        let elapsed = os_now.saturating_sub(os_from);
        let counter = counter_now.saturating_sub(counter_from);
        let allowed =
            u64::try_from(u128::from(elapsed) * u128::from(COUNTER_TOLERANCE_PPM) / 1_000_000)
                .unwrap_or(u64::MAX)
                .saturating_add(slack + anchor_slack);
        if counter.abs_diff(elapsed) <= allowed {
            if elapsed >= CHECK_SPAN {
                *anchor = (os_now, counter_now, slack);
            }
            return None;
        }
        drop(anchor);
        // At the OS clock's reading, or from where the counter has got to if that is
        // later, so that no reading goes back.
        let now = self.counter_at(self.raw()) + 1;
        let offset = now.saturating_sub(self.os_since());
        self.os_offset.store(offset.max(1), Ordering::Relaxed);
        #[allow(clippy::cast_possible_wrap, clippy::cast_possible_truncation)]
        let ppm = ((i128::from(counter) - i128::from(elapsed)) * 1_000_000
            / i128::from(elapsed.max(1))) as i64;
        metrics::gauge!(crate::CLOCK_ON_OS).set(1.0);
        tracing::warn!(
            ppm,
            "the time-stamp counter ran {ppm} ppm off the OS clock over the last {} ms (more \
             than {COUNTER_TOLERANCE_PPM}): the agent reads the OS clock from now on",
            elapsed / 1_000_000
        );
        Some(ppm)
    }
}

/// A test's counter.
#[cfg(test)]
struct Source(Box<dyn Fn() -> u64 + Send + Sync>);

#[cfg(test)]
impl std::fmt::Debug for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Source")
    }
}

/// The OS clock's reading nearest a read of the counter (`raw`): the tightest of a
/// few pairs of OS reads around one ([`limiter_core::clock::tightest_between`]), as
/// (its midpoint, how far that may be from the counter's read, the counter's raw
/// reading).
fn tightest(raw: impl Fn() -> u64, os: &MonotonicClock) -> (Nanos, Nanos, u64) {
    // A tuple's parts are evaluated in order: OS, counter, OS.
    let reads = (0..PAIR_READS).map(|_| (os.now(), raw(), os.now()));
    tightest_between(reads).map_or((0, 0, 0), |(mid, half, r)| (mid, half + 1, r))
}

/// The clock an agent reads: its own (called directly, inlined on the hit path), or
/// one it was given (tests drive time by hand).
pub(super) enum AgentClock {
    Fast(FastClock),
    Given(Arc<dyn Clock>),
}

impl AgentClock {
    #[inline]
    pub(super) fn now(&self) -> Nanos {
        match self {
            Self::Fast(c) => c.now(),
            Self::Given(c) => c.now(),
        }
    }

    /// The time for rates kept over unbounded spans (the emergency ceilings): the
    /// OS's monotonic clock, never the counter, whose rate is a start-up measurement
    /// (off by a part in a million at best, by the tolerance of
    /// [`FastClock::check`] before it is caught, and a ceiling holding a route at
    /// its rate for minutes would admit that much more).
    pub(super) fn rates_now(&self) -> Nanos {
        match self {
            Self::Fast(c) => c.os_now(),
            Self::Given(c) => c.now(),
        }
    }

    /// The renewer's round: checks the counter against the OS clock.
    pub(super) fn check(&self) {
        if let Self::Fast(c) = self {
            c.check();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicI64;

    use super::*;

    fn sleep_ms(ms: u64) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }

    /// A counter that reads the OS clock off its rate by `ppm` from `from` (its own
    /// time, at its rate till then): one whose rate was measured that far wrong, or
    /// changed.
    struct Skew {
        os: MonotonicClock,
        base: Nanos,
        from: AtomicU64,
        ppm: AtomicI64,
    }

    impl Skew {
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        fn read(&self) -> u64 {
            let e = self.os.now() - self.base;
            let (from, ppm) = (self.from.load(Ordering::Relaxed), self.ppm.load(Ordering::Relaxed));
            if e <= from {
                return e + 1;
            }
            let off = i128::from(e - from) * (1_000_000 + i128::from(ppm)) / 1_000_000;
            from + off as u64 + 1
        }

        /// From now on, off by `ppm` (from a counter at the OS clock's rate).
        fn change(&self, ppm: i64) {
            self.from.store(self.os.now() - self.base, Ordering::Relaxed);
            self.ppm.store(ppm, Ordering::Relaxed);
        }
    }

    /// A clock on a counter `ppm` off the OS clock's rate, and the counter.
    fn skewed(ppm: i64) -> (FastClock, Arc<Skew>) {
        let os = MonotonicClock::new();
        let base = os.now();
        let skew = Arc::new(Skew { os, base, from: AtomicU64::new(0), ppm: AtomicI64::new(ppm) });
        let mut c = FastClock::bare(quanta::Clock::mock().0);
        let read = skew.clone();
        c.source = Some(Source(Box::new(move || read.read())));
        (c.started(), skew)
    }

    /// The counter is scaled to nanoseconds: a sleep of 50 ms reads as at least that
    /// (and not wildly more: a second would mean the scale is off by twenty).
    #[test]
    fn reads_nanoseconds() {
        let c = FastClock::default();
        let a = c.now();
        sleep_ms(50);
        let b = c.now();
        assert!(a >= 1);
        assert!(b - a >= 50_000_000, "{} ns", b - a);
        assert!(b - a < 1_000_000_000, "{} ns", b - a);
    }

    /// A counter within the tolerance is kept.
    #[test]
    fn a_counter_within_the_tolerance_is_kept() {
        for ppm in [200, -200] {
            let (c, _) = skewed(ppm);
            sleep_ms(100);
            assert_eq!(c.check(), None, "{ppm} ppm");
            assert!(!c.on_os_clock());
        }
    }

    /// A counter running 0.3% fast (or slow) is caught within 100 ms, and the clock
    /// reads the OS clock from then: never back, never behind it, and at its rate.
    #[test]
    fn a_counter_off_its_rate_is_caught_and_the_os_clock_read_from_there() {
        for skew in [3_000, -3_000] {
            let (c, _) = skewed(skew);
            sleep_ms(100);
            let before = c.now();
            let ppm = c.check().expect("caught");
            assert!((skew - 500..=skew + 500).contains(&ppm), "{ppm} ppm for {skew}");
            assert!(c.on_os_clock());
            let os = c.os_now();
            let after = c.now();
            assert!(after >= before, "{after} < {before}");
            // A slow counter's lag is not kept: no deadline on it comes late.
            assert!(after >= os, "{after} behind the OS clock's {os}");
            assert_eq!(c.check(), None, "once");
            // The counter goes on off its rate (0.3% of 100 ms is 300 µs); the clock
            // reads the OS clock, whose spans hold the clock's read inside them and
            // are held by those read outside.
            let os_a = c.os_now();
            let a = c.now();
            sleep_ms(100);
            let b = c.now();
            let os_b = c.os_now();
            assert!(b - a <= os_b - os_a, "{} against {}", b - a, os_b - os_a);
            let a = c.now();
            let os_a = c.os_now();
            sleep_ms(100);
            let os_b = c.os_now();
            let b = c.now();
            assert!(b - a >= os_b - os_a, "{} against {}", b - a, os_b - os_a);
        }
    }

    /// A counter whose rate changes after it ran true for a while is judged over
    /// the last second or so, not since the start: 0.3% off for 0.2 s after 1.2 s
    /// true is caught (since the start, it is 0.04% off).
    #[test]
    fn a_change_of_rate_after_a_long_run_is_caught_within_its_span() {
        for change in [-3_000, 3_000] {
            let (c, skew) = skewed(0);
            while c.os_since() < 1_200_000_000 {
                sleep_ms(150);
                assert_eq!(c.check(), None, "true so far");
            }
            skew.change(change);
            sleep_ms(200);
            let ppm = c.check().expect("caught");
            assert!(ppm.signum() == change.signum(), "{ppm} ppm for {change}");
            assert!(c.on_os_clock());
        }
    }

    /// The emergency ceilings' time is the OS clock even while the counter is
    /// trusted: a counter 0.09% fast (inside the tolerance) does not make a ceiling's
    /// second shorter.
    #[test]
    fn rates_read_the_os_clock_not_the_counter() {
        let (c, _) = skewed(900);
        let (os, fast) = (MonotonicClock::new(), AgentClock::Fast(c));
        let os_a = os.now();
        let a = fast.rates_now();
        sleep_ms(300);
        let b = fast.rates_now();
        let os_b = os.now();
        // The OS clock's span holds the other's, both on one clock, so no more (the
        // counter's would be 270 µs more, less the few reads' time).
        let (run, os_run) = (b - a, os_b - os_a);
        assert!(run <= os_run, "{run} against the OS clock's {os_run}");
    }
}
