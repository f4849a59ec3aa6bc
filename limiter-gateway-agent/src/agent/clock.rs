//! The agent's clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use limiter_core::clock::{Clock, MonotonicClock, Nanos};

/// How far the time-stamp counter may run off the OS's monotonic clock before the
/// agent stops trusting it: 0.1%, a fifth of the default lease deadline margin
/// ([`crate::AgentConfig::deadline_margin`]), so a lease cannot outlive its hold by
/// the counter's error.
pub const COUNTER_TOLERANCE_PPM: u64 = 1_000;

/// Reads of the OS clock on either side of one of the counter's, the tightest kept.
const PAIR_READS: usize = 8;

/// The agent's default clock: the CPU's invariant time-stamp counter where there is
/// one (a few nanoseconds a read, against the OS clock's twenty), else the OS's
/// monotonic clock. The agent only measures durations on it (its deadlines count
/// from its own send times), so it need not agree with the owner's.
///
/// The counter's rate is `quanta`'s calibration, a measurement of about a
/// millisecond at the process's start: a thread descheduled in it sets the rate off
/// for the process's life. So [`FastClock::check`] (the agent's renewer calls it
/// every round) compares the counter with the OS clock since the start; once it is
/// off by more than [`COUNTER_TOLERANCE_PPM`], the clock reads the OS clock instead
/// and says so in a warning. A counter that ran slow jumps forward to the OS clock
/// (a lease's deadline comes sooner, never later); one that ran fast goes on from
/// where it had got to (never back), at the OS clock's rate.
#[derive(Debug)]
pub struct FastClock {
    clock: quanta::Clock,
    /// The counter's reading at the start (its raw units).
    origin: u64,
    /// The OS clock, and its reading at the counter's origin.
    os: MonotonicClock,
    os_origin: Nanos,
    /// How far that reading may be from the counter's origin (half the tightest
    /// pair of reads around it).
    origin_slack: Nanos,
    /// 0 while the counter is trusted; then what is added to the OS clock's reading
    /// since the origin, which is read instead (at least 1: never a zero reading).
    os_offset: AtomicU64,
}

impl Default for FastClock {
    fn default() -> Self {
        Self::on(quanta::Clock::new())
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
    /// The clock on `clock`'s counter (tests give a mock one).
    fn on(clock: quanta::Clock) -> Self {
        let os = MonotonicClock::new();
        let (os_origin, origin_slack, origin) = tightest(|| clock.raw(), &os);
        Self { clock, origin, os, os_origin, origin_slack, os_offset: AtomicU64::new(0) }
    }

    /// Nanoseconds since the origin by the counter: the raw counter scaled by one
    /// multiply and shift (no `Duration`, whose making divides by a billion).
    #[inline]
    fn counter(&self) -> Nanos {
        self.counter_at(self.clock.raw())
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

    /// Compares the counter with the OS clock since the origin; when it is off by
    /// more than [`COUNTER_TOLERANCE_PPM`] of the time (beyond what the reads
    /// themselves may be off), reads the OS clock from now on and returns the
    /// counter's error in parts per million. `None` while the counter is trusted, and
    /// once the OS clock is read.
    pub fn check(&self) -> Option<i64> {
        if self.on_os_clock() {
            return None;
        }
        let (os_mid, slack, raw) = tightest(|| self.clock.raw(), &self.os);
        let elapsed = os_mid.saturating_sub(self.os_origin);
        let counter = self.counter_at(raw);
        let allowed =
            u64::try_from(u128::from(elapsed) * u128::from(COUNTER_TOLERANCE_PPM) / 1_000_000)
                .unwrap_or(u64::MAX)
                .saturating_add(slack + self.origin_slack);
        if counter.abs_diff(elapsed) <= allowed {
            return None;
        }
        // At the OS clock's reading, or from where the counter has got to if that is
        // later, so that no reading goes back.
        let now = self.counter_at(self.clock.raw()) + 1;
        let offset = now.saturating_sub(self.os_since());
        self.os_offset.store(offset.max(1), Ordering::Relaxed);
        #[allow(clippy::cast_possible_wrap, clippy::cast_possible_truncation)]
        let ppm = ((i128::from(counter) - i128::from(elapsed)) * 1_000_000
            / i128::from(elapsed.max(1))) as i64;
        metrics::gauge!(crate::CLOCK_ON_OS).set(1.0);
        tracing::warn!(
            ppm,
            "the time-stamp counter runs {ppm} ppm off the OS clock since the agent started \
             (more than {COUNTER_TOLERANCE_PPM}): the agent reads the OS clock from now on"
        );
        Some(ppm)
    }
}

/// The OS clock's reading nearest a read of the counter (`raw`): the tightest of a
/// few pairs of OS reads around one, as (its midpoint, half its width, the counter's
/// raw reading). A thread descheduled between two reads only widens that pair.
fn tightest(raw: impl Fn() -> u64, os: &MonotonicClock) -> (Nanos, Nanos, u64) {
    (0..PAIR_READS)
        .map(|_| {
            let before = os.now();
            let r = raw();
            let after = os.now();
            (before, after.saturating_sub(before), r)
        })
        .min_by_key(|&(_, width, _)| width)
        .map_or((0, 0, 0), |(before, width, r)| (before + width / 2, width / 2 + 1, r))
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
    use super::*;

    fn sleep_ms(ms: u64) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }

    /// A clock on a mock counter, and the mock.
    fn mocked() -> (FastClock, Arc<quanta::Mock>) {
        let (clock, mock) = quanta::Clock::mock();
        mock.increment(1_000_000_u64);
        (FastClock::on(clock), mock)
    }

    /// Moves the mock counter to the OS clock's time since the origin, off its rate
    /// by `ppm`: a counter whose rate was measured that far wrong.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    fn run_off(c: &FastClock, mock: &quanta::Mock, ppm: i64) {
        let os = i128::from(c.os_since());
        let at = c.origin + (os * (1_000_000 + i128::from(ppm)) / 1_000_000) as u64;
        mock.increment(at.saturating_sub(mock.value()));
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
            let (c, mock) = mocked();
            sleep_ms(100);
            run_off(&c, &mock, ppm);
            assert_eq!(c.check(), None, "{ppm} ppm");
            assert!(!c.on_os_clock());
        }
    }

    /// A counter running 0.3% fast (or slow) is caught within 100 ms, and the clock
    /// reads the OS clock from then: never back, never behind it, and at its rate.
    #[test]
    fn a_counter_off_its_rate_is_caught_and_the_os_clock_read_from_there() {
        for skew in [3_000, -3_000] {
            let (c, mock) = mocked();
            sleep_ms(100);
            run_off(&c, &mock, skew);
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
            // The counter goes on off its rate; the clock no longer follows it.
            let (a, os_a) = (c.now(), c.os_now());
            sleep_ms(100);
            run_off(&c, &mock, skew);
            let (b, os_b) = (c.now(), c.os_now());
            // The counter's 300 µs in 100 ms would show; the reads one after the
            // other are apart by far less.
            let (run, os_run) = (b - a, os_b - os_a);
            assert!(run.abs_diff(os_run) < 150_000, "{run} against {os_run}");
        }
    }

    /// The emergency ceilings' time is the OS clock even while the counter is
    /// trusted: a counter 0.09% fast (inside the tolerance) does not make a ceiling's
    /// second shorter.
    #[test]
    fn rates_read_the_os_clock_not_the_counter() {
        let (c, mock) = mocked();
        sleep_ms(300);
        run_off(&c, &mock, 900);
        let os = MonotonicClock::new();
        let fast = AgentClock::Fast(c);
        let os_a = os.now();
        let a = fast.rates_now();
        sleep_ms(300);
        if let AgentClock::Fast(c) = &fast {
            run_off(c, &mock, 900);
        }
        let b = fast.rates_now();
        let os_b = os.now();
        // The OS clock's span holds the other's, both on one clock, so no more (the
        // counter's would be 270 µs more, less the few reads' time).
        let (run, os_run) = (b - a, os_b - os_a);
        assert!(run <= os_run, "{run} against the OS clock's {os_run}");
    }
}
