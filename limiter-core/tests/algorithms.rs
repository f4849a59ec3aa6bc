//! Property tests: each algorithm against a simple reference model, its defining
//! bound over any interval, and exact `retry_after`.

use std::collections::HashMap;
use std::num::NonZeroU64;

use limiter_core::algorithm::{
    Algorithm, Check, FixedWindow, SlidingCounter, SlidingLog, TokenBucket,
};
use limiter_core::rate::Rate;
use proptest::prelude::*;

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

/// A schedule of (time step, cost) requests.
fn ops(max_step: u64, max_cost: u64) -> impl Strategy<Value = Vec<(u64, u64)>> {
    prop::collection::vec((0..=max_step, 1..=max_cost), 1..200)
}

/// Runs a schedule, returning `(time, cost)` of every admitted request.
fn run<A: Algorithm>(alg: &A, schedule: &[(u64, u64)]) -> (Vec<(u64, u64)>, A::State, u64) {
    let mut state = A::State::default();
    let mut now = 0;
    let mut admitted = Vec::new();
    for &(step, cost) in schedule {
        now += step;
        if let Check::Admit { .. } = alg.try_acquire(&mut state, now, cost.min(alg.capacity())) {
            admitted.push((now, cost.min(alg.capacity())));
        }
    }
    (admitted, state, now)
}

/// `retry_after` is exact: denied one nanosecond before it, admitted at it.
fn assert_retry_exact<A: Algorithm>(alg: &A, state: &A::State, now: u64, cost: u64) {
    let wait = alg.retry_after(state, now, cost);
    if wait == 0 {
        assert!(cost <= alg.remaining(state, now), "wait 0 but {cost} does not fit");
    } else {
        assert!(
            cost > alg.remaining(state, now + wait - 1),
            "cost {cost} fits at now+{} already",
            wait - 1
        );
        assert!(cost <= alg.remaining(state, now + wait), "cost {cost} does not fit at now+{wait}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn token_bucket_matches_a_level_model_and_its_bound(
        amount in 1u64..50, period_ms in 1u64..3_000, burst in 1u64..40,
        schedule in ops(400_000_000, 10), probe in 1u64..40,
    ) {
        let rate = Rate::try_new(amount, period_ms * 1_000_000).unwrap();
        let tb = TokenBucket::new(rate, nz(burst));
        // Reference: a level of tokens scaled by the period, refilled by elapsed*amount.
        let (p, a) = (u128::from(period_ms * 1_000_000), u128::from(amount));
        let cap = u128::from(burst) * p;
        let (mut level, mut last) = (cap, 0u64);
        let mut state = Default::default();
        let mut now = 0;
        let mut admitted = Vec::new();
        for &(step, cost) in &schedule {
            now += step;
            let cost = cost.min(burst);
            level = (level + u128::from(now - last) * a).min(cap);
            last = now;
            let model = level >= u128::from(cost) * p;
            if model { level -= u128::from(cost) * p; admitted.push((now, cost)); }
            let got = matches!(tb.try_acquire(&mut state, now, cost), Check::Admit { .. });
            prop_assert_eq!(got, model, "at {} cost {}", now, cost);
        }
        // Over any interval [t_i, t_j]: admitted <= burst + rate * (t_j - t_i).
        for i in 0..admitted.len() {
            let mut sum = 0u128;
            for j in i..admitted.len() {
                sum += u128::from(admitted[j].1);
                let dt = u128::from(admitted[j].0 - admitted[i].0);
                prop_assert!(sum * p <= cap + dt * a);
            }
        }
        assert_retry_exact(&tb, &state, now, probe.min(burst));
    }

    #[test]
    fn fixed_window_matches_per_window_counts(
        limit in 1u64..30, window in 1u64..1_000, schedule in ops(300, 8), probe in 1u64..30,
    ) {
        let fw = FixedWindow::new(nz(limit), nz(window));
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let mut state = Default::default();
        let mut now = 0;
        for &(step, cost) in &schedule {
            now += step;
            let cost = cost.min(limit);
            let c = counts.entry(now / window).or_default();
            let model = *c + cost <= limit;
            if model { *c += cost; }
            let got = matches!(fw.try_acquire(&mut state, now, cost), Check::Admit { .. });
            prop_assert_eq!(got, model);
        }
        prop_assert!(counts.values().all(|&c| c <= limit));
        assert_retry_exact(&fw, &state, now, probe.min(limit));
    }

    #[test]
    fn sliding_log_never_exceeds_its_limit_in_any_window(
        limit in 1u64..30, window in 1u64..1_000, schedule in ops(300, 8), probe in 1u64..30,
    ) {
        let sl = SlidingLog::new(nz(limit), nz(window));
        let (admitted, state, now) = run(&sl, &schedule);
        // Reference: the sum over (t - W, t] at every admission instant is the maximum.
        for &(t, _) in &admitted {
            let sum: u64 = admitted.iter().filter(|(u, _)| *u + window > t && *u <= t).map(|(_, c)| c).sum();
            prop_assert!(sum <= limit, "{} units in the window ending at {}", sum, t);
        }
        // And it is exact: a request it denied would have broken the bound.
        let mut state2 = Default::default();
        let mut now2 = 0;
        let mut log: Vec<(u64, u64)> = Vec::new();
        for &(step, cost) in &schedule {
            now2 += step;
            let cost = cost.min(limit);
            let live: u64 = log.iter().filter(|(u, _)| *u + window > now2).map(|(_, c)| c).sum();
            let model = live + cost <= limit;
            if model { log.push((now2, cost)); }
            prop_assert_eq!(matches!(sl.try_acquire(&mut state2, now2, cost), Check::Admit { .. }), model);
        }
        prop_assert!(state.len() as u64 <= limit);
        assert_retry_exact(&sl, &state, now, probe.min(limit));
    }

    #[test]
    fn sliding_counter_equals_its_formula(
        limit in 1u64..30, window in 1u64..1_000, schedule in ops(300, 8), probe in 1u64..30,
    ) {
        let sc = SlidingCounter::new(nz(limit), nz(window));
        let mut counts: HashMap<u64, u64> = HashMap::new();
        let mut state = Default::default();
        let mut now = 0;
        for &(step, cost) in &schedule {
            now += step;
            let cost = cost.min(limit);
            let idx = now / window;
            let e = u128::from(now % window);
            let prev = u128::from(idx.checked_sub(1).and_then(|i| counts.get(&i).copied()).unwrap_or(0));
            let curr = u128::from(counts.get(&idx).copied().unwrap_or(0));
            let w = u128::from(window);
            // prev * (W - e) / W + curr + cost <= limit, multiplied through by W.
            let model = prev * (w - e) + (curr + u128::from(cost)) * w <= u128::from(limit) * w;
            if model { *counts.entry(idx).or_default() += cost; }
            let got = matches!(sc.try_acquire(&mut state, now, cost), Check::Admit { .. });
            prop_assert_eq!(got, model, "at {} cost {}", now, cost);
        }
        assert_retry_exact(&sc, &state, now, probe.min(limit));
    }

    #[test]
    fn grant_takes_what_fits_and_refund_restores_it(
        limit in 1u64..50, window in 1u64..1_000, pre in 0u64..50, max in 1u64..80, dt in 0u64..1_000,
    ) {
        let algs = [
            limiter_core::Limit::FixedWindow(FixedWindow::new(nz(limit), nz(window))),
            limiter_core::Limit::SlidingLog(SlidingLog::new(nz(limit), nz(window))),
            limiter_core::Limit::SlidingCounter(SlidingCounter::new(nz(limit), nz(window))),
            limiter_core::Limit::TokenBucket(TokenBucket::new(Rate::try_new(limit, window).unwrap(), nz(limit))),
        ];
        for alg in algs {
            let mut s = Default::default();
            alg.charge(&mut s, 0, pre.min(limit));
            let now = dt;
            let before = alg.remaining(&s, now);
            let got = alg.grant(&mut s, now, max);
            prop_assert_eq!(got, max.min(before));
            prop_assert_eq!(alg.remaining(&s, now), before - got);
            alg.refund(&mut s, now, now, got);
            prop_assert_eq!(alg.remaining(&s, now), before, "{}", alg);
        }
    }
}
