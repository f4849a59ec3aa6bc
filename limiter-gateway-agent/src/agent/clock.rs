//! The agent's clock.

use std::sync::Arc;

use limiter_core::clock::{Clock, Nanos};

/// The agent's default clock: the CPU's invariant time-stamp counter where there is
/// one (a few nanoseconds a read, against a system call's twenty), else the OS's
/// monotonic clock. The agent only measures durations on it (its deadlines count
/// from its own send times), so it need not agree with the owner's.
#[derive(Debug, Clone)]
pub struct FastClock {
    clock: quanta::Clock,
    /// The counter's reading at the start (its raw units).
    origin: u64,
}

impl Default for FastClock {
    fn default() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.raw();
        Self { clock, origin }
    }
}

impl Clock for FastClock {
    #[inline]
    fn now(&self) -> Nanos {
        // The raw counter scaled by one multiply and shift (no `Duration`, whose
        // making divides by a billion). Never zero: 0 means "no deadline" for a balance.
        self.clock.delta_as_nanos(self.origin, self.clock.raw()) + 1
    }
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The counter is scaled to nanoseconds: a sleep of 50 ms reads as at least that
    /// (and not wildly more: a second would mean the scale is off by twenty).
    #[test]
    fn reads_nanoseconds() {
        let c = FastClock::default();
        let a = c.now();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let b = c.now();
        assert!(a >= 1);
        assert!(b - a >= 50_000_000, "{} ns", b - a);
        assert!(b - a < 1_000_000_000, "{} ns", b - a);
    }
}
