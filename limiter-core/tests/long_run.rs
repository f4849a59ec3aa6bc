//! One million decisions over a simulated hour per algorithm: the total admitted stays
//! within one unit of the ideal allowance, so integer time does not drift.

use std::collections::HashMap;
use std::num::NonZeroU64;

use limiter_core::algorithm::{
    Algorithm, Check, FixedWindow, SlidingCounter, SlidingLog, TokenBucket,
};
use limiter_core::clock::NANOS_PER_SEC;
use limiter_core::rate::Rate;

const DECISIONS: u64 = 1_000_000;
const HOUR: u64 = 3_600 * NANOS_PER_SEC;
/// 3.6 ms between arrivals: a million of them in the hour, far above every limit here.
const GAP: u64 = HOUR / DECISIONS;

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

fn admitted_over_the_hour<A: Algorithm>(alg: &A) -> u64 {
    let mut state = A::State::default();
    (0..DECISIONS)
        .filter(|i| matches!(alg.try_acquire(&mut state, i * GAP, 1), Check::Admit { .. }))
        .count() as u64
}

fn assert_within_one(got: u64, ideal: u64, what: &str) {
    assert!(got <= ideal, "{what}: admitted {got}, more than the ideal {ideal}");
    assert!(ideal - got <= 1, "{what}: admitted {got}, ideal {ideal}: drift");
}

#[test]
fn token_bucket_with_rates_that_are_not_whole_nanoseconds() {
    // 7/s is 142,857,142.857 ns a token; 1000/7s refills in 7 s periods. Bursts of at
    // least 2 keep the bucket from ever being full between arrivals (a full bucket
    // wastes refill by definition), so the whole refill is admissible.
    for (rate, burst) in [("7/s", 10u64), ("1000/7s", 50), ("3/s", 2)] {
        let r: Rate = rate.parse().unwrap();
        let tb = TokenBucket::new(r, nz(burst));
        let last = (DECISIONS - 1) * GAP;
        // Tokens available over [0, last]: the burst plus every refill, floored.
        let ideal = burst
            + u64::try_from(
                u128::from(last) * u128::from(r.amount().get()) / u128::from(r.period().get()),
            )
            .unwrap();
        assert_within_one(admitted_over_the_hour(&tb), ideal, rate);
    }
}

#[test]
fn fixed_window_admits_its_limit_in_every_window() {
    // 1000 windows of 3.6 s in the hour.
    let fw = FixedWindow::new(nz(100), nz(3_600_000_000));
    assert_within_one(admitted_over_the_hour(&fw), 100 * 1_000, "fixed_window");
}

#[test]
fn sliding_log_admits_its_limit_per_window_length() {
    let sl = SlidingLog::new(nz(100), nz(3_600_000_000));
    assert_within_one(admitted_over_the_hour(&sl), 100 * 1_000, "sliding_log");
}

#[test]
fn sliding_counter_matches_the_exact_formula_over_the_hour() {
    let (limit, window) = (100u64, 3_600_000_000u64);
    let sc = SlidingCounter::new(nz(limit), nz(window));
    // The ideal: the formula evaluated in exact rationals at each arrival.
    let mut counts: HashMap<u64, u64> = HashMap::new();
    let mut ideal = 0;
    for i in 0..DECISIONS {
        let now = i * GAP;
        let idx = now / window;
        let e = u128::from(now % window);
        let prev =
            u128::from(idx.checked_sub(1).and_then(|p| counts.get(&p).copied()).unwrap_or(0));
        let curr = counts.entry(idx).or_default();
        let w = u128::from(window);
        if prev * (w - e) + (u128::from(*curr) + 1) * w <= u128::from(limit) * w {
            *curr += 1;
            ideal += 1;
        }
    }
    assert!(counts.values().all(|&c| c <= limit));
    assert_within_one(admitted_over_the_hour(&sc), ideal, "sliding_counter");
    // And it is close to the limit per window: the weighting loses < 2 per window.
    assert!(ideal >= (limit - 2) * 1_000, "{ideal}");
}
