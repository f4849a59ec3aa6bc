//! The holder's side of a lease, written once for every place that holds leased
//! units: the gateway agent (leases from an owner), a node's slices of root keys
//! (leases from their owners) and the server's batches leased from Redis. What is
//! here is the rule; the holders keep only how they call upstream and where their
//! balances live. I/O-free, and time is an argument.
//!
//! - [`Margin`] and [`Margin::spendable_until`]: a holder stops spending a grant before
//!   its owner writes it off, whatever the two clocks say;
//! - [`Demand`]: the units per second a holder spends, which sizes what it asks for
//!   ([`want`]) and what its owner grants it;
//! - [`Refusal`]: an upstream "no", remembered to answer like requests locally until
//!   it lapses.

use crate::clock::{NANOS_PER_SEC, Nanos};

/// How much of a grant's hold a holder gives up at its end: the owner writes a grant
/// off at `granted + hold` on its clock, which started after the holder sent the
/// request, so a holder that stops at `sent + hold - margin` always stops first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Margin {
    /// Thousandths of the hold.
    pub permille: u64,
    /// At least this much (clock steps between the holder and a store it does not
    /// share a clock with).
    pub at_least: Nanos,
}

impl Margin {
    /// `permille` thousandths of the hold, at least one nanosecond.
    pub const fn permille(permille: u64) -> Self {
        Self { permille, at_least: 1 }
    }

    /// The margin of a grant held for `hold`: never more than the hold itself.
    pub fn of(&self, hold: Nanos) -> Nanos {
        let part = u128::from(hold) * u128::from(self.permille) / 1_000;
        u64::try_from(part).unwrap_or(Nanos::MAX).max(self.at_least).min(hold)
    }

    /// Until when units granted for `hold`, asked for at `sent` (the holder's clock),
    /// may be spent.
    ///
    /// # Examples
    ///
    /// ```
    /// use limiter_core::holder::Margin;
    /// // 2% of a 2 s hold: spendable for 1.96 s after sending.
    /// assert_eq!(Margin::permille(20).spendable_until(1_000, 2_000_000_000), 1_960_001_000);
    /// ```
    pub fn spendable_until(&self, sent: Nanos, hold: Nanos) -> Nanos {
        sent.saturating_add(hold - self.of(hold))
    }
}

/// The demand assumed of a holder seen for the first time, in units per second.
pub const FIRST_DEMAND: u64 = 1;

/// The shortest span a demand update measures: updates closer together than this
/// keep counting into the next (a rate over a few milliseconds is noise: two requests
/// 10 ms apart are not 200 a second).
pub const DEMAND_SPAN: Nanos = NANOS_PER_SEC / 10;

/// A holder's demand, in units per second: the rate it spent at since the last
/// update (over at least [`DEMAND_SPAN`]), never falling by more than half per update
/// (a pause does not take a busy key's next grant to nothing; a drop shows within a
/// few updates).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    rate: u64,
    since: Nanos,
    spent: u64,
    started: bool,
}

impl Demand {
    /// Counts `units` spent since the last update.
    pub fn spend(&mut self, units: u64) {
        self.spent = self.spent.saturating_add(units);
    }

    /// Takes back `units` counted since the last update (they were put back unspent).
    pub fn unspend(&mut self, units: u64) {
        self.spent = self.spent.saturating_sub(units);
    }

    /// Folds what was spent since the last update into the estimate, as of `now`, and
    /// returns it. The first update starts the clock: its estimate is what was spent
    /// (at least [`FIRST_DEMAND`]).
    pub fn update(&mut self, now: Nanos) -> u64 {
        if !self.started {
            self.started = true;
            self.since = now;
            self.rate = FIRST_DEMAND.max(std::mem::take(&mut self.spent));
            return self.rate;
        }
        let elapsed = now.saturating_sub(self.since);
        if elapsed < DEMAND_SPAN {
            // Too soon to fold: what was spent, as if over the shortest span (a new
            // key's first burst grows its grant at once, within reason).
            let soon = u128::from(self.spent) * u128::from(NANOS_PER_SEC) / u128::from(DEMAND_SPAN);
            return self.rate.max(u64::try_from(soon).unwrap_or(u64::MAX));
        }
        let spent = std::mem::take(&mut self.spent);
        let rate = u128::from(spent) * u128::from(NANOS_PER_SEC) / u128::from(elapsed);
        self.rate = u64::try_from(rate).unwrap_or(u64::MAX).max(self.rate / 2);
        self.since = now;
        self.rate
    }

    /// The estimate (what the last update said, or more if more was spent since).
    pub fn rate(&self) -> u64 {
        self.rate.max(self.spent)
    }

    /// When the last update was.
    pub fn since(&self) -> Nanos {
        self.since
    }
}

/// Units to ask for: `span` nanoseconds of `demand_per_sec`, at least `cost` and 1,
/// at most `max` (unless `cost` needs more).
///
/// # Examples
///
/// ```
/// // 100 units a second for 2 s, a request of 5 waiting, at most 500.
/// assert_eq!(limiter_core::holder::want(100, 2_000_000_000, 5, 500), 200);
/// assert_eq!(limiter_core::holder::want(0, 2_000_000_000, 5, 500), 5);
/// ```
pub fn want(demand_per_sec: u64, span: Nanos, cost: u64, max: u64) -> u64 {
    let by_demand = u128::from(demand_per_sec) * u128::from(span) / u128::from(NANOS_PER_SEC);
    u64::try_from(by_demand).unwrap_or(u64::MAX).min(max).max(cost).max(1)
}

/// An upstream refusal, remembered so that like requests are answered locally until
/// it lapses: at most `cap` after it was made, and never past the wait the upstream
/// gave. A request as large as the refused one (or larger) is refused with the wait
/// left; a smaller one may fit and asks upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal<D> {
    /// When it was made (the holder's clock).
    pub at: Nanos,
    /// Until when it stands.
    pub until: Nanos,
    /// When the upstream said a retry could succeed.
    pub retry_at: Nanos,
    /// The cost that was refused.
    pub cost: u64,
    /// What the holder answers with (a decision, a reason).
    pub detail: D,
}

impl<D> Refusal<D> {
    /// A refusal at `now` of `cost`, with the upstream's `wait`, kept at most `cap`.
    pub fn new(now: Nanos, wait: Nanos, cap: Nanos, cost: u64, detail: D) -> Self {
        Self {
            at: now,
            until: now.saturating_add(wait.min(cap)),
            retry_at: now.saturating_add(wait),
            cost,
            detail,
        }
    }

    /// The wait left for a request of `cost` at `now` while the refusal stands for it
    /// (at least 1 ns), else `None`.
    pub fn wait(&self, now: Nanos, cost: u64) -> Option<Nanos> {
        (now < self.until && cost >= self.cost).then(|| self.retry_at.saturating_sub(now).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    #[test]
    fn the_margin_is_a_share_of_the_hold_with_a_floor_and_never_the_whole() {
        let m = Margin { permille: 100, at_least: MS };
        assert_eq!(m.of(1_000 * MS), 100 * MS);
        assert_eq!(m.of(5 * MS), MS, "the floor");
        assert_eq!(m.of(MS / 2), MS / 2, "never more than the hold");
        assert_eq!(m.spendable_until(10, 1_000 * MS), 10 + 900 * MS);
        assert_eq!(Margin::permille(20).of(0), 0);
    }

    #[test]
    fn demand_follows_the_rate_and_halves_at_most_per_update() {
        let mut d = Demand::default();
        d.spend(7);
        assert_eq!(d.update(0), 7, "the first update: what was spent");
        d.spend(200);
        assert_eq!(d.update(NANOS_PER_SEC), 200);
        // Nothing spent for a second: half, then a quarter.
        assert_eq!(d.update(2 * NANOS_PER_SEC), 100);
        assert_eq!(d.update(3 * NANOS_PER_SEC), 50);
        // Spending between updates shows at once in the rate read.
        d.spend(80);
        assert_eq!(d.rate(), 80);
        // An update sooner than the shortest span keeps counting, and reads what was
        // spent as if over that span.
        assert_eq!(d.update(3 * NANOS_PER_SEC + DEMAND_SPAN - 1), 800);
        d.spend(20);
        assert_eq!(d.update(4 * NANOS_PER_SEC), 100, "100 over the second");
        assert_eq!(Demand::default().update(5), FIRST_DEMAND);
    }

    #[test]
    fn a_refusal_stands_for_like_requests_until_it_lapses() {
        let r = Refusal::new(1_000, 50 * MS, 20 * MS, 3, "no");
        assert_eq!(r.wait(1_000, 3), Some(50 * MS));
        assert_eq!(r.wait(1_000 + 10 * MS, 5), Some(40 * MS));
        assert_eq!(r.wait(1_000 + 10 * MS, 2), None, "a smaller request may fit");
        assert_eq!(r.wait(1_000 + 20 * MS, 3), None, "kept at most the cap");
        let short = Refusal::new(0, 5 * MS, 20 * MS, 1, ());
        assert_eq!(short.wait(5 * MS, 1), None, "never past the upstream's wait");
    }

    #[test]
    fn want_is_demand_over_the_span_within_bounds() {
        assert_eq!(want(1_000, NANOS_PER_SEC / 2, 1, u64::MAX), 500);
        assert_eq!(want(1_000, NANOS_PER_SEC, 1, 300), 300);
        assert_eq!(want(1_000, NANOS_PER_SEC, 400, 300), 400, "the waiting request fits");
        assert_eq!(want(0, NANOS_PER_SEC, 0, 300), 1);
    }
}
