//! The four algorithms against the independent reference (`limiter-reference`): random
//! schedules of decisions, unchecked charges, grants and refunds at Unix-scale times,
//! every answer compared at every step, and `retry_after` checked on a clone of the
//! state (still refused one nanosecond before it, admitted at it).
//!
//! Two drivers share the comparison: proptest (a new random seed each run, shrinking
//! a failure to a minimal schedule, or `PROPTEST_RNG_SEED`), and a seeded loop that
//! always runs a fixed seed and a random one, printed (`REFERENCE_SEED` replays it).

use std::num::NonZeroU64;

use limiter_core::algorithm::{
    Algorithm, Check, FixedWindow, SlidingCounter, SlidingLog, TokenBucket,
};
use limiter_core::rate::Rate;
use limiter_reference::rng::{Rng, seeds};
use limiter_reference::{Level, Spec};
use proptest::prelude::*;

/// About 2027 in nanoseconds since the epoch: where the production clock runs.
const UNIX_NOW: u64 = 1_800_000_000_000_000_000;

#[derive(Debug, Clone)]
enum Op {
    /// Time passes.
    Wait(u64),
    /// A decision for a cost.
    Take(u64),
    /// Usage reported after the fact, charged unchecked.
    Charge(u64),
    /// A grant of at most `max` units for `hold` nanoseconds.
    Grant { max: u64, hold: u64 },
    /// Gives back up to `units` of the n-th earlier grant (modulo their count).
    Refund { grant: usize, units: u64 },
}

fn op(window: u64, cap: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..=window / 3).prop_map(Op::Wait),
        1 => (0..=3 * window).prop_map(Op::Wait),
        6 => (1..=cap).prop_map(Op::Take),
        1 => (1..=3 * cap).prop_map(Op::Charge),
        2 => ((1..=cap), (0..=window / 2)).prop_map(|(max, hold)| Op::Grant { max, hold }),
        2 => ((0usize..8), (1..=cap)).prop_map(|(grant, units)| Op::Refund { grant, units }),
    ]
}

/// Runs `ops` on the core algorithm and on the reference, comparing every answer.
fn compare<A: Algorithm>(
    alg: &A,
    spec: Spec,
    start: u64,
    ops: &[Op],
    probe: u64,
) -> Result<(), TestCaseError> {
    let mut state = A::State::default();
    let mut reference = Level::new(spec);
    let mut now = start;
    let mut grants: Vec<(u64, u64)> = Vec::new();
    let cap = alg.capacity();
    prop_assert_eq!(cap, spec.capacity());
    for (n, op) in ops.iter().enumerate() {
        let at = format!("step {n} ({op:?}) at start + {}", now - start);
        match *op {
            Op::Wait(d) => now += d,
            Op::Take(cost) => {
                let want = reference.try_take(now, cost);
                let got = alg.try_acquire(&mut state, now, cost);
                prop_assert_eq!(matches!(got, Check::Admit { .. }), want, "{}", at);
                match got {
                    Check::Admit { remaining } => {
                        prop_assert_eq!(remaining, reference.remaining(now), "{}", at);
                    }
                    Check::Deny { retry_after } => {
                        prop_assert_eq!(retry_after, reference.retry_after(now, cost), "{}", at);
                    }
                }
            }
            Op::Charge(units) => {
                alg.charge(&mut state, now, units);
                reference.charge(now, units);
            }
            Op::Grant { max, hold } => {
                let (units, held, stamp) = reference.grant(now, max, hold);
                let got_hold = alg.grant_hold(now, hold);
                prop_assert_eq!(got_hold, held, "{}: hold", at);
                let got_stamp = alg.grant_stamp(now, got_hold);
                prop_assert_eq!(got_stamp, stamp, "{}: stamp", at);
                let got = max.min(alg.remaining(&state, now));
                prop_assert_eq!(got, units, "{}: units", at);
                if got > 0 {
                    alg.charge_at(&mut state, now, got_stamp, got);
                }
                grants.push((stamp, units));
            }
            Op::Refund { grant, units } => {
                if !grants.is_empty() {
                    let (stamp, held) = grants[grant % grants.len()];
                    let units = units.min(held);
                    alg.refund(&mut state, now, stamp, units);
                    reference.refund(now, stamp, units);
                }
            }
        }
        prop_assert_eq!(alg.remaining(&state, now), reference.remaining(now), "{}: remaining", at);
        prop_assert_eq!(alg.reset_after(&state, now), reference.reset_after(now), "{}: reset", at);
        prop_assert_eq!(alg.is_idle(&state, now), reference.is_full(now), "{}: idle", at);
        for cost in [1, probe.min(cap), cap] {
            let wait = alg.retry_after(&state, now, cost);
            prop_assert_eq!(
                wait,
                reference.retry_after(now, cost),
                "{}: retry_after({})",
                at,
                cost
            );
            // On a clone: refused just before the wait, admitted at it.
            if wait > 0 {
                let mut early = state.clone();
                let refused = alg.try_acquire(&mut early, now + wait - 1, cost);
                prop_assert!(matches!(refused, Check::Deny { .. }), "{}: fits before", at);
                prop_assert_eq!(&early, &state, "{}: a refusal changed the state", at);
            }
            let mut then = state.clone();
            let admitted = alg.try_acquire(&mut then, now + wait, cost);
            prop_assert!(matches!(admitted, Check::Admit { .. }), "{}: refused at the wait", at);
        }
    }
    Ok(())
}

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

/// A window length: sub-microsecond to minutes, in nanoseconds.
fn window() -> impl Strategy<Value = u64> {
    prop_oneof![1u64..2_000, 1_000_000u64..3_000_000_000, Just(60_000_000_000)]
}

fn schedule(window: u64, cap: u64) -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(op(window, cap), 1..120)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(160))]

    #[test]
    fn token_bucket_matches_the_reference(
        (amount, period, burst, ops) in (1u64..1_000, prop_oneof![1u64..5_000, 1_000_000u64..3_000_000_000], 1u64..60)
            .prop_flat_map(|(a, p, b)| (Just(a), Just(p), Just(b), schedule(p.max(b * p / a), b))),
        offset in 0u64..u64::from(u32::MAX), probe in 1u64..60,
    ) {
        let rate = Rate::try_new(amount, period).unwrap();
        let tb = TokenBucket::new(rate, nz(burst));
        let spec = Spec::TokenBucket { amount: rate.amount().get(), period: rate.period().get(), burst };
        compare(&tb, spec, UNIX_NOW + offset, &ops, probe)?;
    }

    #[test]
    fn fixed_window_matches_the_reference(
        (limit, window, ops) in (1u64..40, window()).prop_flat_map(|(l, w)| (Just(l), Just(w), schedule(w, l))),
        offset in 0u64..u64::from(u32::MAX), probe in 1u64..40,
    ) {
        let fw = FixedWindow::new(nz(limit), nz(window));
        compare(&fw, Spec::FixedWindow { limit, window }, UNIX_NOW + offset, &ops, probe)?;
    }

    #[test]
    fn sliding_log_matches_the_reference(
        (limit, window, ops) in (1u64..40, window()).prop_flat_map(|(l, w)| (Just(l), Just(w), schedule(w, l))),
        offset in 0u64..u64::from(u32::MAX), probe in 1u64..40,
    ) {
        let sl = SlidingLog::new(nz(limit), nz(window));
        compare(&sl, Spec::SlidingLog { limit, window }, UNIX_NOW + offset, &ops, probe)?;
    }

    #[test]
    fn sliding_counter_matches_the_reference(
        (limit, window, ops) in (1u64..40, window()).prop_flat_map(|(l, w)| (Just(l), Just(w), schedule(w, l))),
        offset in 0u64..u64::from(u32::MAX), probe in 1u64..40,
    ) {
        let sc = SlidingCounter::new(nz(limit), nz(window));
        compare(&sc, Spec::SlidingCounter { limit, window }, UNIX_NOW + offset, &ops, probe)?;
    }
}

/// A schedule drawn from `rng`, with the same shape as the proptest strategy's.
fn drawn(rng: &mut Rng, window: u64, cap: u64) -> Vec<Op> {
    (0..rng.range(1, 120))
        .map(|_| match rng.range(0, 15) {
            0..=3 => Op::Wait(rng.range(0, window / 3)),
            4 => Op::Wait(rng.range(0, 3 * window)),
            5..=10 => Op::Take(rng.range(1, cap)),
            11 => Op::Charge(rng.range(1, 3 * cap)),
            12 | 13 => Op::Grant { max: rng.range(1, cap), hold: rng.range(0, window / 2) },
            _ => Op::Refund {
                grant: usize::try_from(rng.range(0, 7)).unwrap(),
                units: rng.range(1, cap),
            },
        })
        .collect()
}

fn drawn_window(rng: &mut Rng) -> u64 {
    match rng.range(0, 2) {
        0 => rng.range(1, 1_999),
        1 => rng.range(1_000_000, 2_999_999_999),
        _ => 60_000_000_000,
    }
}

#[test]
fn every_algorithm_matches_the_reference_on_seeded_schedules() {
    for seed in seeds(18) {
        eprintln!("reference: seed {seed} (replay: REFERENCE_SEED={seed})");
        let mut rng = Rng::new(seed);
        for case in 0..400 {
            let start = UNIX_NOW + rng.range(0, u64::from(u32::MAX));
            let limit = rng.range(1, 39);
            let probe = rng.range(1, 39);
            let window = drawn_window(&mut rng);
            let r = match case % 4 {
                0 => {
                    let amount = rng.range(1, 999);
                    let period = if rng.chance(50) {
                        rng.range(1, 4_999)
                    } else {
                        rng.range(1_000_000, 2_999_999_999)
                    };
                    let rate = Rate::try_new(amount, period).unwrap();
                    let tb = TokenBucket::new(rate, nz(limit));
                    let spec = Spec::TokenBucket {
                        amount: rate.amount().get(),
                        period: rate.period().get(),
                        burst: limit,
                    };
                    let ops = drawn(&mut rng, period.max(limit * period / amount), limit);
                    compare(&tb, spec, start, &ops, probe)
                }
                1 => {
                    let ops = drawn(&mut rng, window, limit);
                    let fw = FixedWindow::new(nz(limit), nz(window));
                    compare(&fw, Spec::FixedWindow { limit, window }, start, &ops, probe)
                }
                2 => {
                    let ops = drawn(&mut rng, window, limit);
                    let sl = SlidingLog::new(nz(limit), nz(window));
                    compare(&sl, Spec::SlidingLog { limit, window }, start, &ops, probe)
                }
                _ => {
                    let ops = drawn(&mut rng, window, limit);
                    let sc = SlidingCounter::new(nz(limit), nz(window));
                    compare(&sc, Spec::SlidingCounter { limit, window }, start, &ops, probe)
                }
            };
            if let Err(e) = r {
                panic!("seed {seed}, case {case}: {e}");
            }
        }
    }
}

/// Calendar windows against the reference, whose windows are listed by this test from
/// the timezone's calendar through jiff's zoned-date API (the first instant of each
/// local day that starts a window), not through limiter-core's window arithmetic.
mod calendar {
    use super::*;
    use jiff::civil::{Date, Weekday};
    use jiff::tz::TimeZone;
    use jiff::{Timestamp, ToSpan as _};
    use limiter_core::algorithm::Window;
    use limiter_core::calendar::{Calendar, CalendarUnit, WeekStart};
    use limiter_reference::Starts;

    const DAY: u64 = 86_400_000_000_000;

    /// Europe/Berlin (north, switches at 02:00/03:00), Australia/Sydney (south),
    /// Australia/Adelaide (south, a 30-minute offset), America/Sao_Paulo (south, its
    /// daylight saving began at local midnight until 2019: days that have no midnight).
    const ZONES: [&str; 4] =
        ["Europe/Berlin", "Australia/Sydney", "Australia/Adelaide", "America/Sao_Paulo"];

    fn date_of(t: u64, tz: &TimeZone) -> Date {
        Timestamp::from_nanosecond(i128::from(t)).unwrap().to_zoned_datetime(tz.clone()).date()
    }

    /// Whether local date `d` begins a window of `count` `unit`s.
    fn begins(d: Date, unit: CalendarUnit, count: u32, week_start: Weekday) -> bool {
        let n = i64::from(count);
        match unit {
            CalendarUnit::Day => {
                let days = i64::from(d.since(Date::constant(1970, 1, 1)).unwrap().get_days());
                days.rem_euclid(n) == 0
            }
            CalendarUnit::Week => d.weekday() == week_start,
            CalendarUnit::Month => {
                d.day() == 1 && (i64::from(d.year()) * 12 + i64::from(d.month()) - 1) % n == 0
            }
            CalendarUnit::Year => d.day() == 1 && d.month() == 1,
        }
    }

    /// The starts of every window from before `from` to after `to`, day by day.
    fn table(
        unit: CalendarUnit,
        count: u32,
        zone: &str,
        week_start: Weekday,
        from: u64,
        to: u64,
    ) -> Starts {
        let tz = TimeZone::get(zone).unwrap();
        let mut d = date_of(from, &tz);
        let last = date_of(to, &tz);
        let mut starts = Vec::new();
        while d <= last {
            if begins(d, unit, count, week_start) {
                let first = d.to_zoned_datetime(tz.clone()).unwrap().start_of_day().unwrap();
                starts.push(u64::try_from(first.timestamp().as_nanosecond()).unwrap());
            }
            d = d.tomorrow().unwrap();
        }
        Starts::leak(starts)
    }

    /// A start instant: any day from 2006 to 2030, or near a daylight-saving switch.
    fn start(rng: &mut Rng, zone: &str) -> u64 {
        let year = i16::try_from(rng.range(2006, 2030)).unwrap();
        let day = Date::new(year, 1, 1)
            .unwrap()
            .checked_add(i64::try_from(rng.range(0, 364)).unwrap().days())
            .unwrap();
        let tz = TimeZone::get(zone).unwrap();
        let mut t = day.to_zoned_datetime(tz.clone()).unwrap().timestamp();
        if rng.chance(50)
            && let Some(switch) = tz.following(t).next()
        {
            t = switch.timestamp();
        }
        let t = u64::try_from(t.as_nanosecond()).unwrap();
        // Up to five days before it, at any nanosecond.
        t - rng.range(0, 5 * DAY)
    }

    fn unit(rng: &mut Rng) -> (CalendarUnit, u32) {
        match rng.range(0, 6) {
            0 | 1 => (CalendarUnit::Day, 1),
            2 => (CalendarUnit::Day, 2),
            3 => (CalendarUnit::Week, 1),
            4 => (CalendarUnit::Month, 1),
            5 => (CalendarUnit::Month, 3),
            _ => (CalendarUnit::Year, 1),
        }
    }

    fn nominal(unit: CalendarUnit, count: u32) -> u64 {
        let days = match unit {
            CalendarUnit::Day => 1,
            CalendarUnit::Week => 7,
            CalendarUnit::Month => 31,
            CalendarUnit::Year => 366,
        };
        days * DAY * u64::from(count)
    }

    /// Random schedules over calendar windows in four timezones from 2006 to 2030,
    /// every answer (admission, remaining, `retry_after` refused just before and
    /// admitted at, `reset_after`, holds, refunds) equal to the reference's.
    #[test]
    fn calendar_windows_match_the_reference_on_seeded_schedules() {
        for seed in seeds(22) {
            eprintln!("calendar: seed {seed} (replay: REFERENCE_SEED={seed})");
            let mut rng = Rng::new(seed);
            for case in 0..240 {
                let zone = ZONES[usize::try_from(rng.range(0, 3)).unwrap()];
                let (unit, count) = unit(&mut rng);
                let day = rng.range(0, 6);
                let ws = WeekStart::ALL[usize::try_from(day).unwrap()];
                let week_start =
                    Weekday::from_monday_zero_offset(i8::try_from(day).unwrap()).unwrap();
                let limit = rng.range(1, 39);
                let probe = rng.range(1, 39);
                // Waits scaled to a tenth of a window, so a schedule crosses a few
                // boundaries and lingers around them.
                let w = nominal(unit, count) / 10;
                let ops = drawn(&mut rng, w, limit);
                let from = start(&mut rng, zone);
                let span: u64 = ops.iter().map(|o| if let Op::Wait(d) = o { *d } else { 0 }).sum();
                let margin = 8 * nominal(unit, count);
                let starts =
                    table(unit, count, zone, week_start, from - margin, from + span + margin);
                let calendar = Calendar::try_new(unit, count, zone, ws).unwrap();
                let window = Window::Calendar(calendar);
                let what = format!("{count}{} in {zone} from {ws:?}", unit.suffix());
                let r = if case % 2 == 0 {
                    let fw = FixedWindow::with_window(nz(limit), window);
                    compare(&fw, Spec::CalendarWindow { limit, starts }, from, &ops, probe)
                } else {
                    let sc = SlidingCounter::with_window(nz(limit), window);
                    compare(&sc, Spec::CalendarCounter { limit, starts }, from, &ops, probe)
                };
                if let Err(e) = r {
                    panic!("seed {seed}, case {case} ({what}, start {from}): {e}");
                }
            }
        }
    }
}
