//! The four algorithms of `DESIGN.md`, written from their definitions for clarity and
//! not for speed, sharing no code with `limiter-core`: the yardstick that the core's
//! property tests, the Lua scripts' randomised test and the load tests' accuracy
//! figures are measured against.
//!
//! - token bucket: a level of tokens held as an exact rational (tokens x period),
//!   refilled by `amount` per `period` up to `burst`;
//! - fixed window: a count per aligned window;
//! - sliding log: a list of `(instant, units)` entries;
//! - sliding counter: the formula `prev x (W - e) / W + curr`, multiplied through by W;
//! - calendar windows (a fixed window or a sliding counter over windows of unequal
//!   lengths): the windows are given as the list of their starts, made by the caller
//!   from a timezone's calendar; a sliding counter's previous window counts for the
//!   part of it that the rolling window `(t - L, t]` (L the current window's length)
//!   still covers, its units taken as spread evenly over its own length.
//!
//! Time is in ticks (nanoseconds for the core, microseconds for the scripts); every
//! wait is found by searching for the earliest tick at which the definition says yes,
//! never by a closed form, so the closed forms under test are checked, not copied.
//!
//! [`judge`] decides whether traffic that a system admitted could have been admitted
//! by the reference at all, given when each request may have been decided.

pub mod exact;
pub mod judge;
pub mod rng;

use std::collections::BTreeMap;

/// How many allowances beyond its limit a level may owe (`DESIGN.md`: a reported
/// cost above its estimate is charged as a debt, capped).
pub const MAX_DEBT_ALLOWANCES: u64 = 10;

/// An algorithm and its parameters, times in ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spec {
    /// `amount` tokens every `period` ticks, at most `burst` held.
    TokenBucket {
        /// Tokens per period.
        amount: u64,
        /// Period in ticks.
        period: u64,
        /// Bucket size.
        burst: u64,
    },
    /// At most `limit` units per aligned window of `window` ticks.
    FixedWindow {
        /// Units per window.
        limit: u64,
        /// Window length in ticks.
        window: u64,
    },
    /// At most `limit` units in any interval `(t - window, t]`.
    SlidingLog {
        /// Units per window.
        limit: u64,
        /// Window length in ticks.
        window: u64,
    },
    /// The current window's count plus the previous one's, weighted by its overlap.
    SlidingCounter {
        /// Units per window.
        limit: u64,
        /// Window length in ticks.
        window: u64,
    },
    /// At most `limit` units per window, the windows of a calendar.
    CalendarWindow {
        /// Units per window.
        limit: u64,
        /// The windows.
        starts: Starts,
    },
    /// The current calendar window's count plus the previous one's, weighted by the
    /// part of it the rolling window still covers.
    CalendarCounter {
        /// Units per window.
        limit: u64,
        /// The windows.
        starts: Starts,
    },
}

/// Consecutive window starts in ticks, ascending: window `i` is
/// `[starts[i], starts[i + 1])`. The caller lists enough windows to cover every
/// instant a test uses, and one either side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Starts(pub &'static [u64]);

impl Starts {
    /// Leaks `starts` for the life of the test process (a test's tables are small).
    pub fn leak(starts: Vec<u64>) -> Self {
        assert!(starts.windows(2).all(|w| w[0] < w[1]), "window starts must ascend");
        Self(Vec::leak(starts))
    }

    /// The window holding `t`.
    pub fn index(&self, t: u64) -> u64 {
        let i = self.0.partition_point(|&s| s <= t);
        assert!(i >= 1 && i < self.0.len(), "instant {t} outside the calendar table");
        (i - 1) as u64
    }

    /// Window `i`'s first tick.
    pub fn start(&self, i: u64) -> u64 {
        self.0[usize::try_from(i).expect("index")]
    }

    /// Window `i`'s length.
    pub fn len(&self, i: u64) -> u64 {
        self.start(i + 1) - self.start(i)
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.0.len() < 2
    }
}

impl Spec {
    /// The largest cost one request can be admitted with.
    pub fn capacity(&self) -> u64 {
        match *self {
            Spec::TokenBucket { burst, .. } => burst,
            Spec::FixedWindow { limit, .. }
            | Spec::SlidingLog { limit, .. }
            | Spec::SlidingCounter { limit, .. }
            | Spec::CalendarWindow { limit, .. }
            | Spec::CalendarCounter { limit, .. } => limit,
        }
    }

    /// The most units a level may hold charged, debt included.
    fn most_charged(&self) -> u64 {
        self.capacity().saturating_mul(MAX_DEBT_ALLOWANCES + 1)
    }

    /// The window length (the period for a token bucket; a calendar's first
    /// window's).
    pub fn window(&self) -> u64 {
        match *self {
            Spec::TokenBucket { period, .. } => period,
            Spec::FixedWindow { window, .. }
            | Spec::SlidingLog { window, .. }
            | Spec::SlidingCounter { window, .. } => window,
            Spec::CalendarWindow { starts, .. } | Spec::CalendarCounter { starts, .. } => {
                starts.len(0)
            }
        }
    }

    /// The first tick of the window holding `t`, and the window's end.
    pub fn window_bounds(&self, t: u64) -> (u64, u64) {
        match *self {
            Spec::CalendarWindow { starts, .. } | Spec::CalendarCounter { starts, .. } => {
                let i = starts.index(t);
                (starts.start(i), starts.start(i + 1))
            }
            _ => {
                let w = self.window();
                (t / w * w, (t / w + 1) * w)
            }
        }
    }

    /// How long units granted at `now` may be spent when `hold` is asked for: a
    /// window algorithm's grant ends with its window; a sliding log's hold is at most
    /// a fortieth of its window.
    pub fn grant_hold(&self, now: u64, hold: u64) -> u64 {
        match *self {
            Spec::TokenBucket { .. } => hold,
            Spec::FixedWindow { window, .. } | Spec::SlidingCounter { window, .. } => {
                hold.min(window - now % window)
            }
            Spec::CalendarWindow { .. } | Spec::CalendarCounter { .. } => {
                hold.min(self.window_bounds(now).1 - now)
            }
            Spec::SlidingLog { window, .. } => hold.min(window / 40),
        }
    }

    /// When a unit spent from a lease of `hold` (`DESIGN.md`) by a request decided
    /// between `sent` and `answered` may have been charged: a token bucket's units were
    /// paid at the grant, up to a hold before the spend; fixed-window and counter
    /// grants end with their window, so the grant fell in the spend's window; a sliding
    /// log's grant is logged at the end of its hold, at most a fortieth of the window
    /// after the spend. The latest grant is `answered`, not `sent`: a grant may land
    /// between the caller's clock reading and the spend.
    pub fn leased_span(&self, sent: u64, answered: u64, hold: u64) -> (u64, u64) {
        match self {
            Spec::TokenBucket { .. } => (sent.saturating_sub(hold), answered),
            Spec::FixedWindow { .. }
            | Spec::SlidingCounter { .. }
            | Spec::CalendarWindow { .. }
            | Spec::CalendarCounter { .. } => {
                (sent.saturating_sub(hold).max(self.window_bounds(sent).0), answered)
            }
            Spec::SlidingLog { .. } => (sent, answered + self.grant_hold(answered, hold)),
        }
    }

    /// The instant a grant made at `now` for `hold` is charged at: the end of its hold
    /// for a sliding log (so it counts in every window a spend of it can fall in),
    /// `now` otherwise.
    pub fn grant_stamp(&self, now: u64, hold: u64) -> u64 {
        match self {
            Spec::SlidingLog { .. } => now + hold,
            _ => now,
        }
    }
}

/// One level's state under the reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Level {
    spec: Spec,
    /// Token bucket: tokens x period at `at` (negative: a debt).
    tokens: i128,
    at: u64,
    /// Window algorithms: units charged per window index.
    counts: BTreeMap<u64, u64>,
    /// Sliding log: `(instant, units)`, in no particular order.
    log: Vec<(u64, u64)>,
}

impl Level {
    /// A level never used: a full allowance.
    pub fn new(spec: Spec) -> Self {
        let tokens = match spec {
            Spec::TokenBucket { period, burst, .. } => i128::from(burst) * i128::from(period),
            _ => 0,
        };
        Self { spec, tokens, at: 0, counts: BTreeMap::new(), log: Vec::new() }
    }

    /// Token bucket: tokens x period at `t`.
    fn level_at(&self, t: u64) -> i128 {
        let Spec::TokenBucket { amount, period, burst } = self.spec else { unreachable!() };
        let full = i128::from(burst) * i128::from(period);
        if t <= self.at {
            return self.tokens;
        }
        let refill = i128::from(t - self.at) * i128::from(amount);
        (self.tokens + refill).min(full.max(self.tokens))
    }

    fn count(&self, index: u64) -> u64 {
        self.counts.get(&index).copied().unwrap_or(0)
    }

    /// The window holding `t`, for the window algorithms.
    fn index(&self, t: u64) -> u64 {
        match self.spec {
            Spec::FixedWindow { window, .. } | Spec::SlidingCounter { window, .. } => t / window,
            Spec::CalendarWindow { starts, .. } | Spec::CalendarCounter { starts, .. } => {
                starts.index(t)
            }
            _ => unreachable!("not a window algorithm"),
        }
    }

    /// Calendar counter: `limit x P - prev x o - curr x P` at `t`, where `P` is the
    /// previous window's length and `o` how much of it `(t - L, t]` covers.
    fn calendar_room(&self, t: u64) -> (i128, i128) {
        let Spec::CalendarCounter { limit, starts } = self.spec else { unreachable!() };
        let i = starts.index(t);
        let (prev_start, start) = (starts.start(i - 1), starts.start(i));
        let rolling_from = t.saturating_sub(starts.len(i));
        let covered = start.saturating_sub(prev_start.max(rolling_from));
        let p = i128::from(start - prev_start);
        let room = i128::from(limit) * p
            - i128::from(self.count(i - 1)) * i128::from(covered)
            - i128::from(self.count(i)) * p;
        (room, p)
    }

    /// Units in the sliding log that still count at `t`.
    fn live(&self, t: u64) -> u64 {
        let Spec::SlidingLog { window, .. } = self.spec else { unreachable!() };
        self.log.iter().filter(|&&(at, _)| at + window > t).map(|&(_, u)| u).sum()
    }

    /// Sliding counter: `limit x W - prev x (W - e) - curr x W` at `t`.
    fn room(&self, t: u64) -> i128 {
        let Spec::SlidingCounter { limit, window } = self.spec else { unreachable!() };
        let (index, e) = (t / window, t % window);
        let prev = index.checked_sub(1).map_or(0, |i| self.count(i));
        let w = i128::from(window);
        i128::from(limit) * w
            - i128::from(prev) * (w - i128::from(e))
            - i128::from(self.count(index)) * w
    }

    /// Units that could be admitted at `t`.
    pub fn remaining(&self, t: u64) -> u64 {
        let left: i128 = match self.spec {
            Spec::TokenBucket { period, .. } => self.level_at(t).div_euclid(i128::from(period)),
            Spec::FixedWindow { limit, window } => {
                i128::from(limit) - i128::from(self.count(t / window))
            }
            Spec::SlidingLog { limit, .. } => i128::from(limit) - i128::from(self.live(t)),
            Spec::SlidingCounter { window, .. } => self.room(t).div_euclid(i128::from(window)),
            Spec::CalendarWindow { limit, .. } => {
                i128::from(limit) - i128::from(self.count(self.index(t)))
            }
            Spec::CalendarCounter { .. } => {
                let (room, p) = self.calendar_room(t);
                room.div_euclid(p)
            }
        };
        u64::try_from(left.max(0)).unwrap_or(u64::MAX)
    }

    /// Whether `cost` fits at `t`.
    pub fn fits(&self, t: u64, cost: u64) -> bool {
        match self.spec {
            Spec::TokenBucket { period, .. } => {
                self.level_at(t) >= i128::from(cost) * i128::from(period)
            }
            Spec::SlidingCounter { window, .. } => {
                self.room(t) >= i128::from(cost) * i128::from(window)
            }
            Spec::CalendarCounter { .. } => {
                let (room, p) = self.calendar_room(t);
                room >= i128::from(cost) * p
            }
            _ => cost <= self.remaining(t),
        }
    }

    /// True when the level at `t` is as a fresh one.
    pub fn is_full(&self, t: u64) -> bool {
        match self.spec {
            Spec::TokenBucket { period, burst, .. } => {
                self.level_at(t) >= i128::from(burst) * i128::from(period)
            }
            Spec::FixedWindow { window, .. } => self.count(t / window) == 0,
            Spec::SlidingLog { .. } => self.live(t) == 0,
            Spec::SlidingCounter { window, .. } => {
                let i = t / window;
                self.count(i) == 0 && i.checked_sub(1).is_none_or(|p| self.count(p) == 0)
            }
            Spec::CalendarWindow { .. } => self.count(self.index(t)) == 0,
            Spec::CalendarCounter { starts, .. } => {
                // Full once the previous window no longer weighs anything.
                let i = starts.index(t);
                let covers_prev = t.saturating_sub(starts.len(i)) < starts.start(i);
                self.count(i) == 0 && (self.count(i - 1) == 0 || !covers_prev)
            }
        }
    }

    /// Ticks from `now` until `cost` fits with no other traffic (0: it fits now).
    pub fn retry_after(&self, now: u64, cost: u64) -> u64 {
        earliest(now, |t| self.fits(t, cost))
    }

    /// Ticks from `now` until the level is full again.
    pub fn reset_after(&self, now: u64) -> u64 {
        earliest(now, |t| self.is_full(t))
    }

    /// Charges `cost` at `now` without checking (a debt past the limit, capped).
    pub fn charge(&mut self, now: u64, cost: u64) {
        self.charge_at(now, now, cost);
    }

    /// Charges `cost` as of `stamp` (a sliding log's grant is logged at the end of its
    /// hold; every other algorithm charges at `now`).
    pub fn charge_at(&mut self, now: u64, stamp: u64, cost: u64) {
        let most = self.spec.most_charged();
        match self.spec {
            Spec::TokenBucket { period, .. } => {
                let level = self.level_at(now);
                let floor = i128::from(self.spec.capacity()) * i128::from(period)
                    - i128::from(most) * i128::from(period);
                self.tokens = (level - i128::from(cost) * i128::from(period)).max(floor.min(level));
                self.at = now;
            }
            Spec::FixedWindow { .. }
            | Spec::SlidingCounter { .. }
            | Spec::CalendarWindow { .. }
            | Spec::CalendarCounter { .. } => {
                let index = self.index(now);
                let c = self.counts.entry(index).or_default();
                *c = c.saturating_add(cost).min(most);
                // Only the current and previous windows ever count again.
                self.counts.retain(|&i, _| i >= index.saturating_sub(1));
            }
            Spec::SlidingLog { limit, window } => {
                self.log.retain(|&(at, _)| at + window > now);
                if cost == 0 {
                    return;
                }
                let live: u64 = self.log.iter().map(|&(_, u)| u).sum();
                let cost = cost.min(most.saturating_sub(live));
                let newest = self.log.iter().map(|&(at, _)| at).max();
                if cost == 0 {
                    // At the debt cap the newest entry only counts for longer.
                    if let Some(e) = self.log.iter_mut().find(|e| Some(e.0) == newest) {
                        e.0 = e.0.max(stamp);
                    }
                    return;
                }
                if let Some(e) = self.log.iter_mut().find(|e| e.0 == stamp) {
                    // Charges at one instant are one entry.
                    e.1 += cost;
                } else if self.log.len() as u64 >= limit {
                    // The log holds at most `limit` entries: past that (a debt), units
                    // join the newest entry, which then counts until the later instant.
                    let e = self.log.iter_mut().find(|e| Some(e.0) == newest).expect("entries");
                    *e = (e.0.max(stamp), e.1 + cost);
                } else {
                    self.log.push((stamp, cost));
                }
            }
        }
    }

    /// Admits and charges `cost` if it fits at `now`.
    pub fn try_take(&mut self, now: u64, cost: u64) -> bool {
        let ok = self.fits(now, cost);
        if ok {
            self.charge(now, cost);
        }
        ok
    }

    /// Grants up to `max` units at `now` for `hold`: `(units, hold, stamp)`.
    pub fn grant(&mut self, now: u64, max: u64, hold: u64) -> (u64, u64, u64) {
        let hold = self.spec.grant_hold(now, hold);
        let stamp = self.spec.grant_stamp(now, hold);
        let units = max.min(self.remaining(now));
        if units > 0 {
            self.charge_at(now, stamp, units);
        }
        (units, hold, stamp)
    }

    /// Gives back `units` charged at `stamp`, as far as they still count at `now`.
    pub fn refund(&mut self, now: u64, stamp: u64, units: u64) {
        match self.spec {
            Spec::TokenBucket { period, burst, .. } => {
                let level = self.level_at(now);
                let full = i128::from(burst) * i128::from(period);
                self.tokens = (level + i128::from(units) * i128::from(period)).min(full.max(level));
                self.at = now;
            }
            Spec::FixedWindow { .. } | Spec::CalendarWindow { .. } => {
                let now_index = self.index(now);
                if self.index(stamp) == now_index
                    && let Some(c) = self.counts.get_mut(&now_index)
                {
                    *c -= units.min(*c);
                }
            }
            Spec::SlidingCounter { .. } | Spec::CalendarCounter { .. } => {
                let (granted, current) = (self.index(stamp), self.index(now));
                if (granted == current || granted + 1 == current)
                    && let Some(c) = self.counts.get_mut(&granted)
                {
                    *c -= units.min(*c);
                }
            }
            Spec::SlidingLog { window, .. } => {
                self.log.retain(|&(at, _)| at + window > now);
                if let Some(i) = self.log.iter().position(|e| e.0 == stamp) {
                    let back = units.min(self.log[i].1);
                    self.log[i].1 -= back;
                    if self.log[i].1 == 0 {
                        self.log.remove(i);
                    }
                }
            }
        }
    }
}

/// The least `d >= 0` with `ok(now + d)`, for a predicate that, once true, stays true
/// as time passes with no traffic (every algorithm's allowance only grows then).
fn earliest(now: u64, ok: impl Fn(u64) -> bool) -> u64 {
    if ok(now) {
        return 0;
    }
    let mut hi = 1u64;
    while !ok(now.saturating_add(hi)) {
        if hi > u64::MAX / 4 {
            return u64::MAX - now;
        }
        hi *= 2;
    }
    let mut lo = hi / 2; // not ok at now + lo (lo = 0 checked above)
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if ok(now + mid) { hi = mid } else { lo = mid }
    }
    hi
}

/// A chain of levels decided all or nothing, outermost first.
#[derive(Debug, Clone, Default)]
pub struct Chains {
    levels: BTreeMap<String, Level>,
}

impl Chains {
    /// No level used yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits `cost` at `now` when every level of `chain` (`(key, spec)` pairs) has
    /// room, charging all of them; otherwise charges none.
    pub fn decide(&mut self, chain: &[(String, Spec)], now: u64, cost: u64) -> bool {
        for (key, spec) in chain {
            self.levels.entry(key.clone()).or_insert_with(|| Level::new(*spec));
        }
        let ok = chain.iter().all(|(key, _)| self.levels[key].fits(now, cost));
        if ok {
            for (key, _) in chain {
                self.levels.get_mut(key).expect("inserted").charge(now, cost);
            }
        }
        ok
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_bucket_refills_a_third_of_a_token_at_a_time() {
        let mut l = Level::new(Spec::TokenBucket { amount: 3, period: 1_000, burst: 3 });
        assert!(l.try_take(0, 3));
        assert_eq!(l.retry_after(0, 1), 334);
        assert_eq!(l.remaining(333), 0);
        assert_eq!(l.remaining(334), 1);
        assert_eq!(l.reset_after(0), 1_000);
        l.charge(0, 100);
        // Ten bursts of debt at most.
        assert_eq!(l.retry_after(0, 1), 10_000 + 334);
    }

    #[test]
    fn windows_count_per_aligned_window_and_logs_per_interval() {
        let mut fw = Level::new(Spec::FixedWindow { limit: 2, window: 10 });
        assert!(fw.try_take(9, 2) && !fw.try_take(9, 1) && fw.try_take(10, 2));
        assert_eq!(fw.retry_after(12, 1), 8);
        let mut sl = Level::new(Spec::SlidingLog { limit: 2, window: 10 });
        assert!(sl.try_take(9, 2) && !sl.try_take(10, 1) && !sl.try_take(18, 1));
        assert!(sl.try_take(19, 2));
        let mut sc = Level::new(Spec::SlidingCounter { limit: 10, window: 10 });
        sc.charge(5, 10);
        // At 15: 10 x (10 - 5) / 10 = 5 still count.
        assert_eq!(sc.remaining(15), 5);
        assert_eq!(sc.retry_after(15, 6), 1);
    }

    #[test]
    fn a_chain_charges_all_levels_or_none() {
        let mut c = Chains::new();
        let fw = Spec::FixedWindow { limit: 5, window: 100 };
        let small = Spec::FixedWindow { limit: 2, window: 100 };
        let chain = [("t".to_owned(), fw), ("t/k".to_owned(), small)];
        assert!(c.decide(&chain, 0, 2));
        assert!(!c.decide(&chain, 0, 1));
        assert!(c.decide(&chain[..1], 0, 3));
        assert!(!c.decide(&chain[..1], 0, 1));
    }
}
