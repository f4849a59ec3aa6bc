//! Decision cost of each algorithm, with baselines measured in the same group and run:
//! `governor` (GCRA) and a `Mutex<HashMap>` token bucket. The clock is driven by hand
//! on both sides (`ManualClock` / governor's `FakeRelativeClock`), one microsecond per
//! decision, with limits roomy enough that every decision is an admission.
//!
//! Run: `cargo bench -p limiter-core --bench algorithms`

#![allow(missing_docs)]

use std::collections::HashMap;
use std::hint::black_box;
use std::num::{NonZeroU32, NonZeroU64};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::clock::FakeRelativeClock;
use governor::{Quota, RateLimiter};
use limiter_core::algorithm::{
    Algorithm, Check, FixedWindow, SlidingCounter, SlidingLog, TokenBucket, TokenBucketState,
};
use limiter_core::clock::{Clock, ManualClock};
use limiter_core::key::LimitKeyRef;
use limiter_core::policy::{NameBounds, Request, from_yaml};
use limiter_core::table::StateTable;
use limiter_core::{Limit, Limiter, Scope};
use parking_lot::Mutex;

const KEYS: usize = 10_000;
const STEP: Duration = Duration::from_micros(1);

fn nz(v: u64) -> NonZeroU64 {
    NonZeroU64::new(v).unwrap()
}

fn quota() -> Quota {
    Quota::per_second(NonZeroU32::new(1_000_000).unwrap())
        .allow_burst(NonZeroU32::new(1_000).unwrap())
}

fn bucket() -> TokenBucket {
    TokenBucket::new("1000000/s".parse().unwrap(), nz(1_000))
}

fn governor_direct(c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    let clock = FakeRelativeClock::default();
    let lim = RateLimiter::direct_with_clock(quota(), clock.clone());
    c.bench_function("governor_direct", |b| {
        b.iter(|| {
            clock.advance(STEP);
            black_box(lim.check().is_ok())
        });
    });
}

/// A check's answer as one word (what is left, or the wait), so that what the
/// benchmark keeps is a register like governor's `bool`: a two-word enum kept through
/// `black_box` goes through memory and stalls the loop on its reload.
fn answer(c: Check) -> u64 {
    match c {
        Check::Admit { remaining } => remaining,
        Check::Deny { retry_after } => retry_after,
    }
}

/// One algorithm on one key: the plain state, and the same behind a mutex (the
/// shape of governor's direct limiter: shared, thread-safe), against governor.
fn single<A: Algorithm>(c: &mut Criterion, name: &str, alg: &A)
where
    A::State: Send,
{
    let mut g = c.benchmark_group(name);
    let clock = ManualClock::new(0);
    let mut state = A::State::default();
    g.bench_function("ours_state", |b| {
        b.iter(|| {
            clock.advance(STEP);
            black_box(answer(alg.try_acquire(&mut state, clock.now(), 1)))
        });
    });
    let shared = Mutex::new(A::State::default());
    g.bench_function("ours_shared", |b| {
        b.iter(|| {
            clock.advance(STEP);
            let now = clock.now();
            black_box(answer(alg.try_acquire(&mut shared.lock(), now, 1)))
        });
    });
    governor_direct(&mut g);
    g.finish();
}

fn algorithms(c: &mut Criterion) {
    let second = nz(1_000_000_000);
    single(c, "token_bucket", &bucket());
    single(c, "fixed_window", &FixedWindow::new(nz(1_000_000), second));
    single(c, "sliding_counter", &SlidingCounter::new(nz(1_000_000), second));
    // A log holds one entry per admitted instant; 1,000 per window keeps it full.
    single(c, "sliding_log", &SlidingLog::new(nz(100_000), nz(1_000_000)));
}

/// One algorithm's decisions, one microsecond apart from 2027-01-15T08:00Z.
fn decisions<A: Algorithm>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    alg: &A,
) {
    let clock = ManualClock::new(1_800_000_000_000_000_000);
    let mut state = A::State::default();
    g.bench_function(name, |b| {
        b.iter(|| {
            clock.advance(STEP);
            black_box(answer(alg.try_acquire(&mut state, clock.now(), 1)))
        });
    });
}

/// Calendar windows against the same algorithm over a fixed window of the same
/// length, alternated in one group: the calendar's boundaries are cached per window,
/// so a decision pays a sequence-locked read of them instead of a division.
fn calendar(c: &mut Criterion) {
    use limiter_core::algorithm::Window;
    use limiter_core::calendar::{Calendar, CalendarUnit, WeekStart};
    let day = nz(86_400_000_000_000);
    let zone = "Europe/Berlin";
    let cal_day =
        Window::Calendar(Calendar::try_new(CalendarUnit::Day, 1, zone, WeekStart::Monday).unwrap());
    let cal_month = Window::Calendar(
        Calendar::try_new(CalendarUnit::Month, 1, zone, WeekStart::Monday).unwrap(),
    );
    let limit = nz(1_000_000_000_000);
    let mut g = c.benchmark_group("calendar");
    for round in 1..=2 {
        decisions(&mut g, &format!("fixed_window_1d_epoch_{round}"), &FixedWindow::new(limit, day));
        let cal = FixedWindow::with_window(limit, cal_day);
        decisions(&mut g, &format!("fixed_window_1d_calendar_{round}"), &cal);
        let month = FixedWindow::with_window(limit, cal_month);
        decisions(&mut g, &format!("fixed_window_1mo_calendar_{round}"), &month);
        let fixed = SlidingCounter::new(limit, day);
        decisions(&mut g, &format!("sliding_counter_1d_epoch_{round}"), &fixed);
        let cal = SlidingCounter::with_window(limit, cal_day);
        decisions(&mut g, &format!("sliding_counter_1d_calendar_{round}"), &cal);
    }
    g.finish();
}

fn key_names() -> Vec<String> {
    (0..KEYS).map(|i| format!("key-{i:05}")).collect()
}

/// Decisions over 10,000 keys, round robin, from `threads` threads at once.
fn keyed_group(c: &mut Criterion, threads: usize) {
    let mut g = c.benchmark_group(format!("keyed_{KEYS}_keys_{threads}_threads"));
    let names = Arc::new(key_names());
    let limit = Arc::new(Limit::TokenBucket(bucket()));

    let table = Arc::new(StateTable::new(KEYS * 2, 64));
    let clock = ManualClock::new(0);
    run(&mut g, "ours_table", threads, {
        let (names, table, clock, limit) =
            (names.clone(), table.clone(), clock.clone(), limit.clone());
        move |i| {
            clock.advance(STEP);
            let now = clock.now();
            let key = [LimitKeyRef::new(Scope::Key, "tenant", "/route", &names[i % KEYS])];
            let mut locked = table.lock(&key);
            let slot = locked.slot_mut(0, &limit, now);
            limit.try_acquire(&mut slot.state, now, 1)
        }
    });

    let gclock = FakeRelativeClock::default();
    let gov = Arc::new(RateLimiter::dashmap_with_clock(quota(), gclock.clone()));
    run(&mut g, "governor_keyed", threads, {
        let (names, gov) = (names.clone(), gov.clone());
        move |i| {
            gclock.advance(STEP);
            gov.check_key(&names[i % KEYS]).is_ok()
        }
    });

    let map: Arc<Mutex<HashMap<String, TokenBucketState>>> = Arc::default();
    let tb = bucket();
    let mclock = ManualClock::new(0);
    run(&mut g, "mutex_hashmap", threads, {
        let (names, map) = (names.clone(), map.clone());
        move |i| {
            mclock.advance(STEP);
            let now = mclock.now();
            let mut m = map.lock();
            let name = &names[i % KEYS];
            let state = match m.get_mut(name.as_str()) {
                Some(s) => s,
                None => m.entry(name.clone()).or_default(),
            };
            tb.try_acquire(state, now, 1)
        }
    });

    // The whole decision: policy resolution and the hierarchy, one per-key level.
    let policy = Arc::new(
        from_yaml(
            "version: 1\ntenants:\n  tenant:\n    per_key: { algorithm: token_bucket, rate: 1000000/s, burst: 1000 }\n",
            "bench.yaml",
        )
        .unwrap(),
    );
    let limiter = Arc::new(Limiter::with_table(StateTable::new(KEYS * 2, 64)));
    let lclock = ManualClock::new(0);
    run(&mut g, "ours_policy_decide", threads, {
        let (names, policy, limiter) = (names.clone(), policy.clone(), limiter.clone());
        move |i| {
            lclock.advance(STEP);
            let req = Request::new("tenant", "/route").with_key(&names[i % KEYS]);
            let chain = policy.resolve(&req, &NameBounds::default()).unwrap();
            limiter.decide(&chain, lclock.now()).admitted()
        }
    });
    g.finish();
}

/// Times `iters` calls of `f` on each of `threads` threads (distinct key offsets);
/// reports wall time per round of one call per thread.
fn run<F, R>(
    g: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
    threads: usize,
    f: F,
) where
    F: Fn(usize) -> R + Send + Sync + Clone + 'static,
{
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            #[allow(clippy::disallowed_methods)] // measuring wall time is the point here
            let start = Instant::now();
            if threads == 1 {
                for i in 0..iters as usize {
                    black_box(f(i));
                }
            } else {
                std::thread::scope(|s| {
                    for t in 0..threads {
                        let f = f.clone();
                        s.spawn(move || {
                            for i in 0..iters as usize {
                                black_box(f(i + t * (KEYS / threads)));
                            }
                        });
                    }
                });
            }
            start.elapsed()
        });
    });
}

fn keyed(c: &mut Criterion) {
    keyed_group(c, 1);
    keyed_group(c, 2);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = algorithms, calendar, keyed
}
criterion_main!(benches);
