//! Was admitted traffic within a limit? Each admitted request may have been decided at
//! any instant of `[from, to]` (sent to answered, earlier by a lease's hold where the
//! units were charged at grant time). The traffic is within the limit exactly when
//! some choice of instants lets the reference admit every request in time order.
//!
//! The judge tries three ways of choosing and keeps the one that places the most:
//! earliest deadline first with each request as early as the reference lets it (the
//! best choice for a token bucket, a fixed window and a log, where units come back
//! only with time), and each request as late as it may have been, either at its last
//! instant or at the last instant of the window its first one is in (a sliding
//! counter's previous window weighs least late in a window). The units of the
//! requests the best choice cannot place are the overshoot: no tolerance, no slack.
//! A choice that places everything proves the traffic within the limit; a figure
//! above zero is what the best of the three could not place.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::{Level, Spec};

/// One admitted request: decided at some instant in `from..=to`, `cost` units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spend {
    /// The earliest instant it may have been decided at.
    pub from: u64,
    /// The latest.
    pub to: u64,
    /// Units.
    pub cost: u64,
}

/// What the judge found for one level.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verdict {
    /// Requests judged.
    pub requests: u64,
    /// Units judged.
    pub units: u64,
    /// Units of requests no placement could admit.
    pub overshoot: u64,
    /// Overshoot per report window: `(window start, units)`, in time order (a request
    /// is reported in the window of its latest instant).
    pub by_window: Vec<(u64, u64)>,
}

/// Judges `spends` on one level with `spec`, fresh at the start, reporting overshoot
/// per aligned window of `report` ticks.
pub fn judge(spec: Spec, spends: &[Spend], report: u64) -> Verdict {
    let mut best = earliest_first(spec, spends, report);
    if best.overshoot == 0 {
        return best;
    }
    let window_end = |s: &Spend| s.to.min(spec.window_bounds(s.from).1 - 1).max(s.from);
    for v in
        [placed_at(spec, spends, report, |s| s.to), placed_at(spec, spends, report, window_end)]
    {
        if v.overshoot < best.overshoot {
            best = v;
        }
    }
    best
}

/// Each request at the instant `at` picks for it, in time order; what does not fit is
/// over.
fn placed_at(spec: Spec, spends: &[Spend], report: u64, at: impl Fn(&Spend) -> u64) -> Verdict {
    let mut order: Vec<(u64, Spend)> = spends.iter().map(|s| (at(s), *s)).collect();
    order.sort_by_key(|&(t, s)| (t, s.from));
    let mut v = Verdict {
        requests: order.len() as u64,
        units: order.iter().map(|(_, s)| s.cost).sum(),
        ..Verdict::default()
    };
    let mut level = Level::new(spec);
    for (t, s) in order {
        if s.cost > spec.capacity() || !level.try_take(t, s.cost) {
            count_over(&mut v, &s, report);
        }
    }
    v.by_window.sort_unstable();
    v
}

fn count_over(v: &mut Verdict, s: &Spend, report: u64) {
    v.overshoot += s.cost;
    let w = s.to / report * report;
    match v.by_window.iter_mut().find(|e| e.0 == w) {
        Some(e) => e.1 += s.cost,
        None => v.by_window.push((w, s.cost)),
    }
}

/// Earliest deadline first, each request as early as the reference admits it.
fn earliest_first(spec: Spec, spends: &[Spend], report: u64) -> Verdict {
    let mut order: Vec<Spend> = spends.to_vec();
    order.sort_by_key(|s| (s.from, s.to));
    let mut v = Verdict {
        requests: order.len() as u64,
        units: order.iter().map(|s| s.cost).sum(),
        ..Verdict::default()
    };
    let over = |v: &mut Verdict, s: &Spend| count_over(v, s, report);
    let mut level = Level::new(spec);
    // Pending requests by deadline.
    let mut pending: BinaryHeap<Reverse<(u64, u64, usize)>> = BinaryHeap::new();
    let mut next = 0;
    let mut t = order.first().map_or(0, |s| s.from);
    loop {
        while next < order.len() && order[next].from <= t {
            pending.push(Reverse((order[next].to, order[next].from, next)));
            next += 1;
        }
        let Some(&Reverse((deadline, _, i))) = pending.peek() else {
            if next == order.len() {
                break;
            }
            t = order[next].from;
            continue;
        };
        let s = order[i];
        if deadline < t || s.cost > spec.capacity() {
            pending.pop();
            over(&mut v, &s);
            continue;
        }
        if level.fits(t, s.cost) {
            level.charge(t, s.cost);
            pending.pop();
            continue;
        }
        let at = t.saturating_add(level.retry_after(t, s.cost));
        if at > deadline {
            // It cannot fit before its deadline: nothing pending frees units.
            pending.pop();
            over(&mut v, &s);
            continue;
        }
        // Wait for it, unless a request with an earlier deadline arrives first.
        t = match order.get(next) {
            Some(n) if n.from < at => n.from,
            _ => at,
        };
    }
    v.by_window.sort_unstable();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(t: u64, cost: u64) -> Spend {
        Spend { from: t, to: t, cost }
    }

    #[test]
    fn exact_traffic_reads_zero_and_one_more_unit_reads_one() {
        let fw = Spec::FixedWindow { limit: 3, window: 10 };
        let ok = [at(0, 1), at(1, 2), at(10, 3)];
        assert_eq!(judge(fw, &ok, 10).overshoot, 0);
        let over = [at(0, 1), at(1, 2), at(9, 1), at(10, 3)];
        let v = judge(fw, &over, 10);
        assert_eq!((v.overshoot, v.by_window.clone()), (1, vec![(0, 1)]));
    }

    #[test]
    fn a_request_answered_across_a_boundary_may_have_been_admitted_in_either_window() {
        let fw = Spec::FixedWindow { limit: 2, window: 10 };
        // Two admitted in window 0; a third sent at 8 and answered at 11 fits in 1.
        let s = [at(1, 1), at(2, 1), Spend { from: 8, to: 11, cost: 1 }, at(12, 1)];
        assert_eq!(judge(fw, &s, 10).overshoot, 0);
        // With a third request in window 1 it fits nowhere.
        let s = [at(1, 1), at(2, 1), Spend { from: 8, to: 11, cost: 1 }, at(12, 1), at(13, 1)];
        assert_eq!(judge(fw, &s, 10).overshoot, 1);
    }

    #[test]
    fn a_sliding_counter_spend_may_be_placed_late_in_its_window() {
        let sc = Spec::SlidingCounter { limit: 10, window: 10 };
        // Nine in window 0. A lease spent by 19 may have been granted at 10, where it
        // fits (9 x 10/10 + 1), but then a request decided at 11 does not (8.1 + 2):
        // as early as possible is the wrong choice, late in the window the right one.
        let mut s: Vec<Spend> = (0..9).map(|_| at(0, 1)).collect();
        s.push(Spend { from: 10, to: 19, cost: 1 });
        s.push(at(11, 1));
        assert_eq!(earliest_first(sc, &s, 10).overshoot, 1);
        assert_eq!(judge(sc, &s, 10).overshoot, 0);
        // At most 9 fit in window 1 after 9 in window 0 (0.9 + 9 at its end): a tenth
        // cannot be placed anywhere.
        s.extend((0..7).map(|_| Spend { from: 10, to: 19, cost: 1 }));
        assert_eq!(judge(sc, &s, 10).overshoot, 0);
        s.push(Spend { from: 10, to: 19, cost: 1 });
        assert_eq!(judge(sc, &s, 10).overshoot, 1);
    }

    #[test]
    fn a_token_bucket_allows_its_burst_plus_its_refill_and_no_more() {
        let tb = Spec::TokenBucket { amount: 1, period: 10, burst: 5 };
        // 5 at once, then one every 10 ticks: exactly the bound.
        let mut s: Vec<Spend> = (0..5).map(|_| at(0, 1)).collect();
        s.extend((1..=20).map(|i| at(i * 10, 1)));
        assert_eq!(judge(tb, &s, 100).overshoot, 0);
        s.push(at(205, 1));
        assert_eq!(judge(tb, &s, 100).overshoot, 1);
    }
}
