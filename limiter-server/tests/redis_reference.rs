//! The Lua scripts against the independent reference (`limiter-reference`) on a real
//! `redis-server` started here: random schedules of decisions, unchecked charges,
//! grants and refunds, at Unix-scale times passed to the scripts (microseconds, the
//! scripts' unit), every answer compared. Runs a fixed seed and a random one (or
//! `REFERENCE_SEED`), each printed, so a failure can be replayed.
//!
//! Redis expires keys in real time, from TTLs the scripts compute off the time they
//! are given (plus a millisecond). So that a key never vanishes while the schedule's
//! time still needs it: the schedule's clock advances at least as fast as real time
//! between calls, one call is made per instant, and right after each call the test
//! takes the TTLs off its keys (`PERSIST`). A key can then only be dropped between a
//! call and its `PERSIST`, and the next call's instant is already past the key's end.
//! Each operation is followed by a reading of what is left, at the next instant.
//! The TTLs themselves are checked by `redis_golden`'s
//! `idle_keys_expire_and_no_key_lives_forever`. The schedule's draws are the seed's;
//! its instants also carry the real time the calls took.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::redis::RedisServer;
use limiter_core::Decision;
use limiter_core::clock::MonotonicClock;
use limiter_core::policy::{NameBounds, Request, from_yaml};
use limiter_reference::rng::{Rng, seeds};
use limiter_reference::{Level, Spec};
use limiter_server::store::Store;
use limiter_server::store::redis::{PoolKind, RedisClock, RedisSettings, RedisStore};

/// 2027 in microseconds since the epoch.
const UNIX_NOW_US: u64 = 1_800_000_000_000_000;
const US: u64 = 1_000;

fn store(url: String, prefix: String) -> Store {
    let settings = RedisSettings {
        url,
        cluster_nodes: Vec::new(),
        connections: 1,
        tls_ca_file: None,
        pool: PoolKind::Multiplexed,
        connect_timeout: Duration::from_secs(2),
        command_timeout: Duration::from_secs(2),
        breaker_threshold: 5,
        probe_interval: Duration::from_millis(200),
        key_prefix: prefix,
        clock: RedisClock::Server,
        batches: false,
    };
    let clock = Arc::new(MonotonicClock::new());
    Store::redis(RedisStore::new(settings, clock.clone()).unwrap(), clock)
}

/// A random limit: its policy text and the reference's spec (times in microseconds).
fn random_limit(rng: &mut Rng, kind: u64) -> (String, Spec) {
    // Microsecond windows reach every rounding edge; millisecond ones, real limits.
    let (us, text) = if rng.chance(50) {
        let us = rng.range(1, 3_000);
        (us, format!("{us}us"))
    } else {
        let ms = rng.range(5, 4_000);
        (ms * 1_000, format!("{ms}ms"))
    };
    let limit = rng.range(1, 40);
    match kind {
        0 => {
            let amount = rng.range(1, 500);
            let rule =
                format!("{{ algorithm: token_bucket, rate: {amount}/{text}, burst: {limit} }}");
            (rule, Spec::TokenBucket { amount, period: us, burst: limit })
        }
        1 => (
            format!("{{ algorithm: fixed_window, limit: {limit}, window: {text} }}"),
            Spec::FixedWindow { limit, window: us },
        ),
        2 => (
            format!("{{ algorithm: sliding_log, limit: {limit}, window: {text} }}"),
            Spec::SlidingLog { limit, window: us },
        ),
        _ => (
            format!("{{ algorithm: sliding_counter, limit: {limit}, window: {text} }}"),
            Spec::SlidingCounter { limit, window: us },
        ),
    }
}

/// One random schedule on one limit; returns the first disagreement.
/// What the schedules exercised, so that a run that never reaches a limit fails.
#[derive(Debug, Default)]
struct Seen {
    admitted: u64,
    rejected: u64,
    granted: u64,
    refunded: u64,
}

/// Takes the TTLs off every key under `prefix`.
fn persist(port: u16, prefix: &str) {
    let script = "for _, k in ipairs(redis.call('KEYS', ARGV[1])) do redis.call('PERSIST', k) end";
    let reply = common::redis::command(port, &format!("EVAL \"{script}\" 0 {prefix}*"));
    assert!(reply.is_some_and(|r| !r.starts_with('-')), "PERSIST under {prefix}");
}

async fn run_one(
    store: &Store,
    (port, prefix): (u16, &str),
    rng: &mut Rng,
    kind: u64,
    steps: usize,
    seen: &mut Seen,
) -> Result<(), String> {
    let (rule, spec) = random_limit(rng, kind);
    let policy = from_yaml(&format!("version: 1\ntenants:\n  t:\n    limit: {rule}\n"), "p.yaml")
        .map_err(|e| e.to_string())?;
    store.check_policy(&policy).map_err(|e| e.to_string())?;
    let mut reference = Level::new(spec);
    let cap = spec.capacity();
    // The scripts' time line is whole microseconds; the reference's tick is one.
    let mut now = UNIX_NOW_US + rng.range(0, u64::from(u32::MAX));
    let mut grants: Vec<(u64, u64, u64)> = Vec::new(); // (granted at, hold, units)
    let mut decisions: Vec<(u64, u64)> = Vec::new(); // (at, cost)
    let w = spec.window();
    let mut real = tokio::time::Instant::now();
    for step in 0..steps {
        let elapsed = real.elapsed();
        real += elapsed;
        now += u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX) + 1;
        let what = rng.range(0, 99);
        let cost = rng.range(1, cap);
        let req = Request { tenant: "t", route: "/r", key: None, cost: Some(cost), dry_run: false };
        let chain = policy.resolve(&req, &NameBounds::default()).map_err(|e| e.to_string())?;
        let at = format!("{rule}, step {step} at +{} us", now - UNIX_NOW_US);
        let ns = now * US;
        match what {
            0..=24 => now += rng.range(0, w / 3),
            25..=29 => now += rng.range(0, 3 * w),
            30..=64 => {
                let got = store.decide(&req, &chain, ns).await.map_err(|e| e.to_string())?.0;
                let want = reference.try_take(now, cost);
                match got.decision {
                    Decision::Allowed { remaining, reset_after, .. } => {
                        seen.admitted += 1;
                        decisions.push((now, cost));
                        let exp = (true, reference.remaining(now), reference.reset_after(now) * US);
                        if (want, remaining, reset_after) != exp {
                            return Err(format!(
                                "{at}: decide({cost}) allowed, remaining {remaining}, reset {reset_after} ns; reference {want}, {exp:?}"
                            ));
                        }
                    }
                    Decision::Rejected { retry_after, .. } => {
                        seen.rejected += 1;
                        let exp = reference.retry_after(now, cost) * US;
                        if want || retry_after != exp {
                            return Err(format!(
                                "{at}: decide({cost}) rejected, retry {retry_after} ns; reference admits {want}, retry {exp} ns"
                            ));
                        }
                    }
                }
            }
            65..=72 => {
                let units = rng.range(1, 3 * cap);
                store.charge(&chain, ns, units).await.map_err(|e| e.to_string())?;
                reference.charge(now, units);
            }
            73..=84 => {
                let (max, hold) = (rng.range(1, cap), rng.range(0, w / 2));
                let g = store.grant(&chain, ns, max, hold * US).await.map_err(|e| e.to_string())?;
                let (units, held, _) = reference.grant(now, max, hold);
                if (g.units, g.hold) != (units, held * US) {
                    return Err(format!(
                        "{at}: grant({max}, {hold} us) gave {} for {} ns; reference {units} for {} ns",
                        g.units,
                        g.hold,
                        held * US
                    ));
                }
                seen.granted += u64::from(units > 0);
                grants.push((now, held, units));
            }
            85..=92 if !grants.is_empty() => {
                let i = usize::try_from(rng.range(0, grants.len() as u64 - 1)).unwrap();
                let (granted, held, units) = grants[i];
                let back = rng.range(0, units);
                seen.refunded += u64::from(back > 0);
                store
                    .refund_grant(&chain, ns, granted * US, held * US, back)
                    .await
                    .map_err(|e| e.to_string())?;
                reference.refund(now, spec.grant_stamp(granted, held), back);
            }
            93..=96 if !decisions.is_empty() => {
                let i = usize::try_from(rng.range(0, decisions.len() as u64 - 1)).unwrap();
                let (at_, c) = decisions[i];
                store.refund(&chain, ns, at_ * US, c).await.map_err(|e| e.to_string())?;
                reference.refund(now, at_, c);
            }
            _ => {}
        }
        persist(port, prefix);
        // What is left, at the next instant (the clock moved on by the real time the
        // call and the PERSIST took, so the reading is safe from real-time expiry too).
        let elapsed = real.elapsed();
        real += elapsed;
        now += u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX) + 1;
        let left = store.remaining(&chain, now * US).await.map_err(|e| e.to_string())?;
        if left != reference.remaining(now) {
            let want = reference.remaining(now);
            return Err(format!("{at}: then remaining {left}, reference {want}"));
        }
        persist(port, prefix);
    }
    Ok(())
}

#[tokio::test]
async fn the_scripts_match_the_reference_on_random_schedules() {
    let redis = RedisServer::start();
    let mut ops = 0;
    let mut seen = Seen::default();
    for seed in seeds(18) {
        eprintln!("redis_reference: seed {seed} (replay: REFERENCE_SEED={seed})");
        let mut rng = Rng::new(seed);
        for case in 0..40u64 {
            let prefix = format!("ref{seed}:{case}");
            let store = store(redis.url(), prefix.clone());
            let steps = 120;
            let keys = (redis.port, prefix.as_str());
            if let Err(e) = run_one(&store, keys, &mut rng, case % 4, steps, &mut seen).await {
                panic!("seed {seed}, case {case}: {e}");
            }
            ops += steps;
        }
    }
    assert!(ops >= 9_000, "{ops} operations");
    eprintln!("redis_reference: {ops} operations, {seen:?}");
    assert!(seen.admitted > 500 && seen.rejected > 500 && seen.granted > 100, "{seen:?}");
    assert!(seen.refunded > 100, "{seen:?}");
}

/// The lease script divides what is left as the grant rule does
/// (`limiter_core::lease::grant_size`, which the memory store runs): the same limit
/// charged to the same level, the same ask and the same others' asks, on both stores,
/// give the same answer, near the limit (proportional shares, their fraction paid by
/// the same draw) and away from it, and direct mode on the same budgets.
#[tokio::test]
async fn the_lease_script_divides_what_is_left_as_the_grant_rule_does() {
    use limiter_core::lease::{Ask, Shares};
    use limiter_server::store::{Leased, Renewal};
    let redis = RedisServer::start();
    let mut rng = Rng::new(seeds(19)[0]);
    let mut near = 0;
    for case in 0..300u64 {
        let limit = rng.range(1, 400);
        let rule = format!("{{ algorithm: fixed_window, limit: {limit}, window: 1h }}");
        let policy =
            from_yaml(&format!("version: 1\ntenants:\n  t:\n    limit: {rule}\n"), "p.yaml")
                .unwrap();
        let redis_store = store(redis.url(), format!("shares:{case}"));
        let memory = Store::memory(1_000, 1_000, false);
        let now = (UNIX_NOW_US + case * 10) * US;
        let spent = rng.range(0, limit);
        let charge = Request {
            tenant: "t",
            route: "/r",
            key: None,
            cost: Some(spent.max(1)),
            dry_run: false,
        };
        let chain = policy.resolve(&charge, &NameBounds::default()).unwrap();
        if spent > 0 {
            for s in [&redis_store, &memory] {
                assert!(s.decide(&charge, &chain, now).await.unwrap().0.decision.is_allowed());
            }
        }
        let cost = rng.range(0, 1);
        let ask = Ask {
            want: rng.range(1, limit),
            cost,
            demand_per_sec: rng.range(0, 2 * limit),
            hold: 60_000_000_000,
            most: rng.range(1, 2 * limit),
            // Mostly any grant, sometimes more than the share gives.
            least: if rng.range(0, 3) == 0 { rng.range(1, limit) } else { 0 },
        };
        let shares = Shares {
            active: rng.range(1, 12),
            others: rng.range(0, 3 * limit),
            dice: rng.next_u64(),
            // The script divides by the asks: compared with demands unknown.
            demand: (0, 0),
            // And keeps the half-of-what-is-left cap (no rate holders on Redis).
            whole: false,
        };
        near += u64::from(ask.cap() + shares.others > limit - spent);
        let renewal = Renewal { back: None, ask, shares, keep_back: (0, 0) };
        let at = now + 1;
        let from_redis = redis_store.lease(&chain, at, &renewal).await.unwrap();
        let from_memory = memory.lease(&chain, at, &renewal).await.unwrap();
        let units = |l: &Leased| match l {
            Leased::Granted(g) => Some(g.units),
            _ => None,
        };
        assert_eq!(
            (units(&from_redis), std::mem::discriminant(&from_redis)),
            (units(&from_memory), std::mem::discriminant(&from_memory)),
            "case {case}: limit {limit}, spent {spent}, {ask:?}, {shares:?}: Redis {from_redis:?}, memory {from_memory:?}"
        );
    }
    assert!(near > 50, "the cases reach the proportional rule: {near} of 300");
}
