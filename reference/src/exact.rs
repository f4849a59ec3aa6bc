//! Exact answers for the judge where a placement problem has one: admitted requests
//! of one cost on a token bucket, and on a fixed or calendar window.
//!
//! A token bucket of `burst` B refilled at one token every `T` ticks admits a cost
//! `c` at `t` when its theoretical arrival time (TAT) is at most `t + (B - c) T`, and
//! then moves the TAT to `max(TAT, t) + c T`. So admissions are jobs on one machine:
//! each occupies `[s, s + c T)` of the TAT's time line, starts no earlier than its
//! request may have been decided (`from`) and ends no later than its latest instant
//! plus `B T` (`to + B T`); a schedule shifted as early as it goes is realised by
//! deciding each request at `max(from, s - (B - c) T)`. With every cost equal the jobs
//! are of one length, for which Garey, Johnson, Simons and Tarjan (SIAM J. Comput.
//! 10(2), 1981) decide feasibility exactly: starting times that would leave a later
//! set of jobs no room are forbidden first, then earliest deadline first never
//! starts a job in a forbidden region. Earliest deadline first alone (the judge's
//! first choice) can start a job with room to spare just before one with none.
//!
//! A window algorithm's requests are assigned to windows their instants fall in, each
//! window holding `limit / c` of them: taking the windows in order and giving each to
//! the requests that can use it with the earliest last window places the most
//! (Glover's rule for intervals), and so counts the overshoot exactly.
//!
//! A sliding or calendar counter admits a request in window `k` when the previous
//! window's count, weighted by a part that shrinks as `k` goes on, plus `k`'s own count
//! so far leaves room for it. So within a window a request placed later only eases
//! its own check and never tightens another's: given the previous window's count, a
//! window's requests fit at some choice of instants exactly when they fit each at its
//! last instant. Only the requests that may fall in two windows are a choice: one kept
//! in the first sits best at that window's last tick (where the previous window
//! weighs least), and of those moved on, the ones with the latest last instants should
//! be. Taken window by window, each way the earlier choices can stand is a count of
//! requests moved on, with the fewest units the window before can hold for it (fewer
//! weigh less); moving more of a window's requests on only eases that window, so the
//! fewest that must be moved is found by bisection.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use crate::{Level, Spec};

/// Whether jobs of length `p`, each `(release, deadline)` (it must end by its
/// deadline), can all run on one machine, one at a time.
pub fn one_length_feasible(jobs: &[(u128, u128)], p: u128) -> bool {
    if jobs.iter().any(|&(r, d)| d < r + p) {
        return false;
    }
    if jobs.is_empty() {
        return true;
    }
    // Times moved on by a job's length, so that a forbidden region reaching back
    // before the first release has a start.
    let jobs: Vec<(u128, u128)> = jobs.iter().map(|&(r, d)| (r + p, d + p)).collect();
    let mut forbidden = Regions::default();
    // Releases from the latest; the jobs released at or after the current one, by
    // deadline.
    let mut by_release: Vec<(u128, u128)> = jobs.clone();
    by_release.sort_unstable_by_key(|&(r, d)| (Reverse(r), d));
    let mut later: Vec<u128> = Vec::with_capacity(jobs.len());
    let mut i = 0;
    while i < by_release.len() {
        let r = by_release[i].0;
        while i < by_release.len() && by_release[i].0 == r {
            let d = by_release[i].1;
            let at = later.partition_point(|&x| x < d);
            later.insert(at, d);
            i += 1;
        }
        // The latest every job released at or after `r` can begin by: each as late as
        // its deadline, the jobs after it and the forbidden regions let it start.
        let mut t = u128::MAX;
        for &d in later.iter().rev() {
            let Some(start) = t.min(d).checked_sub(p) else { return false };
            t = forbidden.start_before(start);
        }
        if t < r {
            return false;
        }
        if t < r + p {
            // A job started in (t - p, r) would still run at t, when these must
            // begin, and none of them can begin before r.
            forbidden.add(t - p, r);
        }
    }
    let mut by_start: Vec<(u128, u128)> = jobs;
    by_start.sort_unstable();
    let mut ready: BinaryHeap<Reverse<u128>> = BinaryHeap::new();
    let (mut next, mut t) = (0, by_start[0].0);
    loop {
        while next < by_start.len() && by_start[next].0 <= t {
            ready.push(Reverse(by_start[next].1));
            next += 1;
        }
        if ready.is_empty() {
            if next == by_start.len() {
                return true;
            }
            t = t.max(by_start[next].0);
            continue;
        }
        let after = forbidden.start_after(t);
        if after != t {
            t = after;
            continue;
        }
        let Reverse(d) = ready.pop().expect("a ready job");
        if t + p > d {
            return false;
        }
        t += p;
    }
}

/// Open intervals of forbidden start times, merged where they overlap.
#[derive(Default)]
struct Regions(BTreeMap<u128, u128>);

impl Regions {
    fn add(&mut self, mut a: u128, mut b: u128) {
        if a >= b {
            return;
        }
        // Merge every region that shares an instant with (a, b).
        let overlapping: Vec<(u128, u128)> =
            self.0.range(..b).filter(|&(_, &e)| e > a).map(|(&s, &e)| (s, e)).collect();
        for (s, e) in overlapping {
            self.0.remove(&s);
            a = a.min(s);
            b = b.max(e);
        }
        self.0.insert(a, b);
    }

    /// The region holding `t` strictly inside it.
    fn holding(&self, t: u128) -> Option<(u128, u128)> {
        self.0.range(..t).next_back().map(|(&a, &b)| (a, b)).filter(|&(_, b)| t < b)
    }

    /// `t`, or the start of the region it falls in (the latest allowed start not
    /// after it).
    fn start_before(&self, t: u128) -> u128 {
        self.holding(t).map_or(t, |(a, _)| a)
    }

    /// `t`, or the end of the region it falls in.
    fn start_after(&self, t: u128) -> u128 {
        self.holding(t).map_or(t, |(_, b)| b)
    }
}

/// Assigns requests, each `(first window, last window)` it may fall in, to windows
/// holding `per_window` each: the indices (into `jobs`) of those no assignment
/// places, as few as any assignment leaves.
pub fn windows_unplaced(jobs: &[(u64, u64)], per_window: u64) -> Vec<usize> {
    if per_window == 0 {
        return (0..jobs.len()).collect();
    }
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_unstable_by_key(|&i| jobs[i]);
    let mut unplaced = Vec::new();
    // Requests that may use the current window, by their last window.
    let mut open: BinaryHeap<Reverse<(u64, usize)>> = BinaryHeap::new();
    let (mut next, mut w) = (0, 0u64);
    loop {
        if open.is_empty() {
            let Some(&i) = order.get(next) else { break };
            w = w.max(jobs[i].0);
        }
        while next < order.len() && jobs[order[next]].0 <= w {
            let i = order[next];
            open.push(Reverse((jobs[i].1, i)));
            next += 1;
        }
        let mut room = per_window;
        while let Some(&Reverse((last, i))) = open.peek() {
            if last < w {
                open.pop();
                unplaced.push(i);
            } else if room > 0 {
                open.pop();
                room -= 1;
            } else {
                break;
            }
        }
        w += 1;
    }
    unplaced
}

/// The most requests that may fall in either of two windows, per window, that
/// [`counter_fits`] takes on: each way the earlier windows can stand is a state, and
/// each state a bisection of whole checks of the window.
const ACROSS_MOST: usize = 256;

/// Whether requests of one `cost`, each decided at some instant of its span
/// `(from, to)`, can all be admitted by a sliding counter or a calendar counter
/// `spec` (see above); `None` when that is not solved here: a span reaches over more
/// than two windows, or more than [`ACROSS_MOST`] reach over one window's end.
pub fn counter_fits(spec: Spec, spans: &[(u64, u64)], cost: u64) -> Option<bool> {
    // Per window (by its first tick): the last instants of the requests that fall in
    // it only, and of those that may fall in it or the next.
    let mut own: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    let mut across: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for &(from, to) in spans {
        let (start, end) = spec.window_bounds(from);
        if to < end {
            own.entry(start).or_default().push(to);
        } else if to < spec.window_bounds(end).1 {
            own.entry(start).or_default();
            own.entry(end).or_default();
            across.entry(start).or_default().push(to);
        } else {
            return None;
        }
    }
    for v in own.values_mut() {
        v.sort_unstable();
    }
    if across.values().any(|v| v.len() > ACROSS_MOST) {
        return None;
    }
    // Latest first: the ones moved on are a prefix.
    for v in across.values_mut() {
        v.sort_unstable_by(|a, b| b.cmp(a));
    }
    let none: Vec<u64> = Vec::new();
    // Entering a window: for each count of requests moved on into it from the window
    // before, the fewest the window before then holds.
    let mut states: BTreeMap<usize, u64> = BTreeMap::from([(0, 0)]);
    let mut before: Option<(u64, u64)> = None;
    for (&start, inside) in &own {
        let (_, end) = spec.window_bounds(start);
        let moved_in = match before {
            Some((prev_start, prev_end)) if prev_end == start => {
                across.get(&prev_start).unwrap_or(&none)
            }
            _ => {
                states = BTreeMap::from([(0, 0)]);
                &none
            }
        };
        let leaving = across.get(&start).unwrap_or(&none);
        let fits = |held_before: u64, came: usize, kept: usize| {
            let mut level = Level::new(spec);
            if held_before > 0 {
                level.charge(spec.window_bounds(start - 1).0, held_before * cost);
            }
            let mut at: Vec<u64> = inside.iter().chain(&moved_in[..came]).copied().collect();
            at.sort_unstable();
            at.extend(std::iter::repeat_n(end - 1, kept));
            at.iter().all(|&t| level.try_take(t, cost))
        };
        let mut next: BTreeMap<usize, u64> = BTreeMap::new();
        for (&came, &held_before) in &states {
            // The fewest of this window's requests that must move on.
            let (mut lo, mut hi) = (0, leaving.len() + 1);
            while lo < hi {
                let mid = (lo + hi) / 2;
                if fits(held_before, came, leaving.len() - mid) {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            for moved in lo..=leaving.len() {
                let held = (inside.len() + came + leaving.len() - moved) as u64;
                let e = next.entry(moved).or_insert(held);
                *e = (*e).min(held);
            }
        }
        if next.is_empty() {
            return Some(false);
        }
        states = next;
        before = Some((start, end));
    }
    Some(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::{Rng, seeds};

    /// Whether some order of the jobs, each started as early as it may be, meets
    /// every deadline: every order tried.
    fn some_order_fits(jobs: &[(u128, u128)], p: u128) -> bool {
        fn go(left: &mut Vec<(u128, u128)>, t: u128, p: u128) -> bool {
            if left.is_empty() {
                return true;
            }
            (0..left.len()).any(|i| {
                let (r, d) = left.swap_remove(i);
                let start = t.max(r);
                let ok = start + p <= d && go(left, start + p, p);
                left.push((r, d));
                let last = left.len() - 1;
                left.swap(i, last);
                ok
            })
        }
        go(&mut jobs.to_vec(), 0, p)
    }

    #[test]
    fn jobs_of_one_length_are_feasible_exactly_when_some_order_fits() {
        for seed in seeds(31) {
            println!("seed {seed}");
            let mut rng = Rng::new(seed);
            let (mut feasible, mut not) = (0, 0);
            for _ in 0..4_000 {
                let p = u128::from(rng.range(2, 7));
                let jobs: Vec<(u128, u128)> = (0..rng.range(1, 7))
                    .map(|_| {
                        let r = u128::from(rng.range(0, 30));
                        (r, r + p + u128::from(rng.range(0, 12)))
                    })
                    .collect();
                let fits = some_order_fits(&jobs, p);
                assert_eq!(one_length_feasible(&jobs, p), fits, "p {p}, jobs {jobs:?}");
                if fits { feasible += 1 } else { not += 1 }
            }
            // Both answers were put to the test.
            assert!(feasible > 500 && not > 500, "{feasible} feasible, {not} not");
        }
    }

    #[test]
    fn windows_place_the_most_requests() {
        let jobs = [(0, 2), (0, 0), (1, 1), (1, 1), (3, 3)];
        // Window 0 to the second, window 1 to one of the two that need it, window 2
        // to the first: one left over.
        assert_eq!(windows_unplaced(&jobs, 1).len(), 1);
        assert_eq!(windows_unplaced(&jobs, 2).len(), 0);
        assert_eq!(windows_unplaced(&jobs, 0).len(), 5);
        assert!(windows_unplaced(&[], 1).is_empty());
        assert!(one_length_feasible(&[], 1));
    }
}
