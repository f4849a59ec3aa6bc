//! The agent's clock.

use limiter_core::clock::{Clock, Nanos};

/// The agent's default clock: the CPU's invariant time-stamp counter where there is
/// one (a few nanoseconds a read, against a system call's twenty), else the OS's
/// monotonic clock. The agent only measures durations on it (its deadlines count
/// from its own send times), so it need not agree with the owner's.
#[derive(Debug, Clone)]
pub struct FastClock {
    clock: quanta::Clock,
    origin: quanta::Instant,
}

impl Default for FastClock {
    fn default() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.now();
        Self { clock, origin }
    }
}

impl Clock for FastClock {
    fn now(&self) -> Nanos {
        // Never zero: 0 means "no deadline" for a balance.
        u64::try_from(self.clock.now().duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
            + 1
    }
}
