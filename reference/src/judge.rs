//! Was admitted traffic within a limit? Each admitted request may have been decided at
//! any instant of `[from, to]` (sent to answered, earlier by a lease's hold where the
//! units were charged at grant time). The traffic is within the limit exactly when
//! some choice of instants lets the reference admit every request in time order.
//!
//! The judge first places each request as early as the reference lets it, earliest
//! deadline first; if that places everything, the traffic is within. Where an exact
//! answer is known it is taken next (`crate::exact`):
//! - requests of one cost on a fixed or calendar window: the fewest left over by any
//!   choice (windows filled in order, each with the requests whose last window is
//!   nearest);
//! - requests of one cost on a token bucket (up to 20,000 on a level): whether some
//!   choice places them all. As early as possible is not always right there: a
//!   request with room to spare can take the unit that one sent just after it needs
//!   at once (the unit over that busy-machine benchmarks of an exact server showed);
//! - requests of one cost on a sliding or calendar counter whose spans reach over at
//!   most two windows (and at most 256 over any one window's end): whether some
//!   choice places them all.
//!
//! Otherwise two more ways are tried and the best of the three kept: each request at
//! its last instant, or at the last instant of the window its first one is in (a
//! sliding counter's previous window weighs least late in a window). On a token
//! bucket or a counter whose traffic does not fit, each request they leave over is
//! taken back in turn where the exact check says it still fits (up to 64 of them, on
//! levels of up to 2,000 requests: each try is a whole check). The units of the
//! requests left over are the overshoot: no tolerance, no slack. A figure above zero
//! is exact for windows and otherwise what the best choice found could not place (a
//! bound from above; never above zero when a check says the traffic fits).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::{Level, Spec, exact};

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
    verdict(spends, &over(spec, spends), report)
}

/// The requests (indices into `spends`) the best placement found leaves over.
fn over(spec: Spec, spends: &[Spend]) -> Vec<usize> {
    let mut best = earliest_first(spec, spends);
    if best.is_empty() {
        return best;
    }
    let cost = spends[0].cost;
    let one_cost = cost > 0 && spends.iter().all(|s| s.cost == cost);
    match spec {
        Spec::FixedWindow { limit, .. } | Spec::CalendarWindow { limit, .. } if one_cost => {
            let index = |t: u64| match spec {
                Spec::CalendarWindow { starts, .. } => starts.index(t),
                _ => t / spec.window(),
            };
            let jobs: Vec<(u64, u64)> =
                spends.iter().map(|s| (index(s.from), index(s.to))).collect();
            return exact::windows_unplaced(&jobs, limit / cost);
        }
        Spec::TokenBucket { .. }
            if one_cost && spends.len() <= EXACT_MOST && bucket_fits(spec, spends, &|_| true) =>
        {
            return Vec::new();
        }
        Spec::SlidingCounter { .. } | Spec::CalendarCounter { .. }
            if one_cost && counter_fits(spec, spends, &|_| true) == Some(true) =>
        {
            return Vec::new();
        }
        _ => {}
    }
    let late =
        [placed_at(spec, spends, |s| s.to), placed_at(spec, spends, |s| window_end(spec, s))];
    for v in late {
        if v.len() < best.len() {
            best = v;
        }
    }
    let fits = |keep: &dyn Fn(usize) -> bool| match spec {
        Spec::TokenBucket { .. } => bucket_fits(spec, spends, keep),
        _ => counter_fits(spec, spends, keep) == Some(true),
    };
    if matches!(
        spec,
        Spec::TokenBucket { .. } | Spec::SlidingCounter { .. } | Spec::CalendarCounter { .. }
    ) && one_cost
        && spends.len() <= EXACT_READD_MOST
        && best.len() <= EXACT_READD
    {
        // Take back every request left over that still fits with the rest.
        let mut left = vec![false; spends.len()];
        for &i in &best {
            left[i] = true;
        }
        best.sort_by_key(|&i| (spends[i].to, spends[i].from));
        best.retain(|&i| {
            left[i] = false;
            let fits = fits(&|j| !left[j]);
            left[i] = !fits;
            !fits
        });
    }
    best
}

/// Whether the requests `keep` picks, all of one cost, fit a sliding or calendar
/// counter `spec` at some choice of instants (`crate::exact`); `None` when that is not
/// solved (a span over more than two windows).
fn counter_fits(spec: Spec, spends: &[Spend], keep: &dyn Fn(usize) -> bool) -> Option<bool> {
    let spans: Vec<(u64, u64)> =
        (0..spends.len()).filter(|&i| keep(i)).map(|i| (spends[i].from, spends[i].to)).collect();
    let cost = spends.first().map_or(0, |s| s.cost);
    exact::counter_fits(spec, &spans, cost)
}

/// The last instant of the window `s`'s first instant is in, within its span.
fn window_end(spec: Spec, s: &Spend) -> u64 {
    s.to.min(spec.window_bounds(s.from).1 - 1).max(s.from)
}

/// The most requests the exact check judges on a token bucket (its time grows with
/// their square: 6,000 took 0.2 s in a test build).
const EXACT_MOST: usize = 20_000;

/// The most requests left over by the heuristics that are each tried back with the
/// exact check, and the most requests on a level where they are (each try is a
/// whole check).
const EXACT_READD: usize = 64;
const EXACT_READD_MOST: usize = 2_000;

/// Whether the requests `keep` picks, all of one cost, fit a token bucket `spec` at
/// some choice of instants (`crate::exact`).
fn bucket_fits(spec: Spec, spends: &[Spend], keep: &dyn Fn(usize) -> bool) -> bool {
    let Spec::TokenBucket { amount, period, burst } = spec else { unreachable!() };
    // Time scaled by `amount`: a unit lasts `period`.
    let (a, p) = (u128::from(amount), u128::from(period));
    let jobs: Vec<(u128, u128)> = (0..spends.len())
        .filter(|&i| keep(i))
        .map(|i| &spends[i])
        .map(|s| (u128::from(s.from) * a, u128::from(s.to) * a + u128::from(burst) * p))
        .collect();
    let cost = spends.first().map_or(0, |s| u128::from(s.cost));
    jobs.is_empty() || exact::one_length_feasible(&jobs, cost * p)
}

/// The verdict on `spends` with the requests `over` left over.
fn verdict(spends: &[Spend], over: &[usize], report: u64) -> Verdict {
    let mut v = Verdict {
        requests: spends.len() as u64,
        units: spends.iter().map(|s| s.cost).sum(),
        ..Verdict::default()
    };
    for &i in over {
        let s = &spends[i];
        v.overshoot += s.cost;
        let w = s.to / report * report;
        match v.by_window.iter_mut().find(|e| e.0 == w) {
            Some(e) => e.1 += s.cost,
            None => v.by_window.push((w, s.cost)),
        }
    }
    v.by_window.sort_unstable();
    v
}

/// Each request at the instant `at` picks for it, in time order; what does not fit is
/// over.
fn placed_at(spec: Spec, spends: &[Spend], at: impl Fn(&Spend) -> u64) -> Vec<usize> {
    let mut order: Vec<(u64, usize)> = spends.iter().enumerate().map(|(i, s)| (at(s), i)).collect();
    order.sort_by_key(|&(t, i)| (t, spends[i].from));
    let mut level = Level::new(spec);
    let mut over = Vec::new();
    for (t, i) in order {
        let s = &spends[i];
        if s.cost > spec.capacity() || !level.try_take(t, s.cost) {
            over.push(i);
        }
    }
    over
}

/// Earliest deadline first, each request as early as the reference admits it.
fn earliest_first(spec: Spec, spends: &[Spend]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..spends.len()).collect();
    order.sort_by_key(|&i| (spends[i].from, spends[i].to));
    let mut over = Vec::new();
    let mut level = Level::new(spec);
    // Pending requests by deadline.
    let mut pending: BinaryHeap<Reverse<(u64, u64, usize)>> = BinaryHeap::new();
    let mut next = 0;
    let mut t = order.first().map_or(0, |&i| spends[i].from);
    loop {
        while next < order.len() && spends[order[next]].from <= t {
            let i = order[next];
            pending.push(Reverse((spends[i].to, spends[i].from, i)));
            next += 1;
        }
        let Some(&Reverse((deadline, _, i))) = pending.peek() else {
            if next == order.len() {
                break;
            }
            t = spends[order[next]].from;
            continue;
        };
        let s = spends[i];
        if deadline < t || s.cost > spec.capacity() {
            pending.pop();
            over.push(i);
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
            over.push(i);
            continue;
        }
        // Wait for it, unless a request with an earlier deadline arrives first.
        t = match order.get(next) {
            Some(&n) if spends[n].from < at => spends[n].from,
            _ => at,
        };
    }
    over
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
        assert_eq!(earliest_first(sc, &s).len(), 1);
        assert_eq!(judge(sc, &s, 10).overshoot, 0);
        // At most 9 fit in window 1 after 9 in window 0 (0.9 + 9 at its end): a tenth
        // cannot be placed anywhere.
        s.extend((0..7).map(|_| Spend { from: 10, to: 19, cost: 1 }));
        assert_eq!(judge(sc, &s, 10).overshoot, 0);
        s.push(Spend { from: 10, to: 19, cost: 1 });
        assert_eq!(judge(sc, &s, 10).overshoot, 1);
    }

    /// What each heuristic leaves over.
    fn heuristics(spec: Spec, s: &[Spend]) -> [usize; 3] {
        [
            earliest_first(spec, s).len(),
            placed_at(spec, s, |x| x.to).len(),
            placed_at(spec, s, |x| window_end(spec, x)).len(),
        ]
    }

    /// Requests that fit, in two pairs: in the first, one with room to spare must
    /// not take the unit the other has to have (as early as possible fails, and so
    /// does the end of the first window); in the second, the two must be apart (at
    /// their last instants fails). None of the three heuristics places all four.
    #[test]
    fn traffic_that_fits_only_by_mixing_the_choices_is_judged_within() {
        let span = |from, to| Spend { from, to, cost: 1 };
        let tb = Spec::TokenBucket { amount: 1, period: 10, burst: 1 };
        let s = [span(0, 30), span(1, 2), span(1055, 1070), span(1058, 1066)];
        let each = heuristics(tb, &s);
        assert!(each.iter().all(|&o| o > 0), "{each:?}");
        assert_eq!(judge(tb, &s, 100).overshoot, 0);
        // One more request where the second pair stands leaves a unit over.
        let mut more = s.to_vec();
        more.push(span(1060, 1064));
        assert_eq!(judge(tb, &more, 100).overshoot, 1);

        let fw = Spec::FixedWindow { limit: 1, window: 10 };
        let s = [span(0, 25), span(5, 9), span(35, 50), span(50, 55)];
        let each = heuristics(fw, &s);
        assert!(each.iter().all(|&o| o > 0), "{each:?}");
        assert_eq!(judge(fw, &s, 100).overshoot, 0);
    }

    /// Whether some choice of whole ticks in each request's span lets the reference
    /// admit them all in time order: every choice tried.
    fn fits_somewhere(spec: Spec, spends: &[Spend]) -> bool {
        fn go(spec: Spec, spends: &[Spend], at: &mut Vec<(u64, u64)>) -> bool {
            let Some((s, rest)) = spends.split_first() else {
                let mut order = at.clone();
                order.sort_unstable();
                let mut level = Level::new(spec);
                return order.iter().all(|&(t, c)| level.try_take(t, c));
            };
            (s.from..=s.to).any(|t| {
                at.push((t, s.cost));
                let ok = go(spec, rest, at);
                at.pop();
                ok
            })
        }
        go(spec, spends, &mut Vec::new())
    }

    fn random_spends(rng: &mut crate::rng::Rng, cost: u64) -> Vec<Spend> {
        (0..rng.range(1, 5))
            .map(|_| {
                let from = rng.range(0, 24);
                Spend { from, to: from + rng.range(0, 4), cost }
            })
            .collect()
    }

    /// The judge against trying every placement: a token bucket's requests of one
    /// cost are within the limit exactly when some placement admits them all.
    #[test]
    fn a_token_bucket_verdict_is_zero_exactly_when_some_placement_fits() {
        for seed in crate::rng::seeds(19) {
            println!("seed {seed}");
            let mut rng = crate::rng::Rng::new(seed);
            let mut above = 0;
            for _ in 0..3_000 {
                let burst = rng.range(1, 3);
                let spec = Spec::TokenBucket { amount: 1, period: rng.range(2, 6), burst };
                let cost = rng.range(1, burst);
                let s = random_spends(&mut rng, cost);
                let v = judge(spec, &s, 100).overshoot;
                assert_eq!(v == 0, fits_somewhere(spec, &s), "{spec:?} {s:?}");
                let fewest = fewest_left_over(spec, &s);
                assert!(v >= fewest, "{spec:?} {s:?}: {v} against at least {fewest}");
                above += u64::from(v > fewest);
            }
            // When the traffic does not fit, the count is the heuristics' with every
            // request taken back that fits: a bound from above, seldom above the least.
            println!("above the fewest units left over in {above} of 3000");
            assert!(above <= 30, "{above}");
        }
    }

    /// The judge against trying every placement, on sliding and calendar counters:
    /// requests of one cost whose spans reach over at most two windows are within the
    /// limit exactly when some placement admits them all; the three heuristics alone
    /// misjudge some.
    #[test]
    fn a_sliding_counter_verdict_is_zero_exactly_when_some_placement_fits() {
        for seed in crate::rng::seeds(31) {
            println!("seed {seed}");
            let mut rng = crate::rng::Rng::new(seed);
            let (mut above, mut missed) = (0, 0);
            for round in 0..3_000 {
                let limit = rng.range(1, 3);
                // Spans of at most 5 ticks: two windows at most. Every other level a
                // calendar counter, windows of 5 to 8 ticks, the first before any
                // request.
                let spec = if round % 2 == 0 {
                    Spec::SlidingCounter { limit, window: rng.range(5, 8) }
                } else {
                    let mut starts = vec![0];
                    while starts.last() < Some(&60) {
                        starts.push(starts.last().unwrap() + rng.range(5, 8));
                    }
                    Spec::CalendarCounter { limit, starts: crate::Starts::leak(starts) }
                };
                let cost = rng.range(1, limit);
                let n = rng.range(2, 6);
                let s: Vec<Spend> = (0..n)
                    .map(|_| {
                        let from = rng.range(10, 22);
                        Spend { from, to: from + rng.range(0, 4), cost }
                    })
                    .collect();
                let v = judge(spec, &s, 100).overshoot;
                let fits = fits_somewhere(spec, &s);
                assert_eq!(v == 0, fits, "{spec:?} {s:?}");
                let fewest = if fits { 0 } else { fewest_left_over(spec, &s) };
                assert!(v >= fewest, "{spec:?} {s:?}: {v} against at least {fewest}");
                above += u64::from(v > fewest);
                missed += u64::from(fits && heuristics(spec, &s).iter().all(|&o| o > 0));
            }
            println!("above the fewest units left over in {above} of 3000");
            println!("every heuristic judged traffic that fits over in {missed} of 3000");
            assert!(above <= 30, "{above}");
            // The heuristics miss about one case in 800: asserted on the fixed seed only,
            // where it is known (3), so that a random seed cannot fail the test by luck.
            if seed == 31 {
                assert!(missed >= 1, "the exact check was never needed");
            }
        }
    }

    /// The fewest units whose requests, left out, let the rest fit somewhere.
    fn fewest_left_over(spec: Spec, s: &[Spend]) -> u64 {
        let n = s.len();
        let most = (0u32..1 << n)
            .filter(|m| {
                let sub: Vec<Spend> = (0..n).filter(|i| m >> i & 1 == 1).map(|i| s[i]).collect();
                fits_somewhere(spec, &sub)
            })
            .map(u32::count_ones)
            .max()
            .unwrap_or(0);
        (n as u64 - u64::from(most)) * s.first().map_or(0, |x| x.cost)
    }

    /// A fixed window's overshoot is the fewest units that no placement admits.
    #[test]
    fn a_fixed_window_verdict_is_the_fewest_units_left_over() {
        for seed in crate::rng::seeds(23) {
            println!("seed {seed}");
            let mut rng = crate::rng::Rng::new(seed);
            for _ in 0..3_000 {
                let limit = rng.range(1, 3);
                let spec = Spec::FixedWindow { limit, window: rng.range(2, 6) };
                let cost = rng.range(1, limit);
                let s = random_spends(&mut rng, cost);
                assert_eq!(
                    judge(spec, &s, 100).overshoot,
                    fewest_left_over(spec, &s),
                    "{spec:?} {s:?}"
                );
            }
        }
    }

    /// Traffic the reference admitted, each request then given a span around its
    /// instant: a placement that fits exists (the instants themselves), so the
    /// verdict is 0 however many requests overlap, for token buckets, windows and
    /// sliding counters.
    #[test]
    fn traffic_admitted_by_the_reference_is_judged_within_whatever_its_spans() {
        for seed in crate::rng::seeds(29) {
            println!("seed {seed}");
            let mut rng = crate::rng::Rng::new(seed);
            let mut missed = 0;
            for round in 0..200 {
                let spec = match round % 3 {
                    0 => Spec::TokenBucket {
                        amount: rng.range(1, 5),
                        period: rng.range(5, 50),
                        burst: rng.range(1, 6),
                    },
                    1 => Spec::FixedWindow { limit: rng.range(1, 6), window: rng.range(5, 50) },
                    // Windows longer than the widest span (80 ticks): two windows at most.
                    _ => {
                        Spec::SlidingCounter { limit: rng.range(1, 6), window: rng.range(81, 160) }
                    }
                };
                let mut level = Level::new(spec);
                let mut t = 0;
                let mut s = Vec::new();
                for _ in 0..600 {
                    t += rng.range(0, 4);
                    if level.try_take(t, 1) {
                        let (before, after) = (rng.range(0, 40), rng.range(0, 40));
                        s.push(Spend { from: t.saturating_sub(before), to: t + after, cost: 1 });
                    }
                }
                assert_eq!(judge(spec, &s, 100).overshoot, 0, "{spec:?}, {} requests", s.len());
                missed += usize::from(heuristics(spec, &s).iter().all(|&o| o > 0));
            }
            // The exact checks were needed: every heuristic judged some of these over.
            println!("every heuristic judged traffic that fits over in {missed} of 200");
            assert!(missed >= 5, "{missed}");
        }
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
