//! The Lua scripts against the golden table that limiter-core passes too
//! (`limiter-core/tests/golden/cases.rs`), on a real `redis-server` started here, with
//! the table's fixed times passed to the scripts in place of Redis's clock.

#[path = "../../limiter-core/tests/golden/cases.rs"]
mod cases;
mod common;

use std::sync::Arc;
use std::time::Duration;

use cases::{BASE, CASES, Got, Op, check};
use common::redis::RedisServer;
use limiter_core::Decision;
use limiter_core::clock::MonotonicClock;
use limiter_core::policy::{NameBounds, Request, from_yaml};
use limiter_server::store::Store;
use limiter_server::store::redis::{RedisClock, RedisSettings, RedisStore};

fn settings(url: String, prefix: &str) -> RedisSettings {
    RedisSettings {
        url,
        cluster_nodes: Vec::new(),
        connections: 1,
        tls_ca_file: None,
        pool: limiter_server::store::redis::PoolKind::Multiplexed,
        connect_timeout: Duration::from_secs(2),
        command_timeout: Duration::from_secs(2),
        breaker_threshold: 5,
        probe_interval: Duration::from_millis(200),
        key_prefix: prefix.to_owned(),
        clock: RedisClock::Server,
        batches: false,
    }
}

#[tokio::test]
async fn every_script_passes_every_golden_case() {
    let redis = RedisServer::start();
    let mut failures = Vec::new();
    for (i, case) in CASES.iter().enumerate() {
        let clock = Arc::new(MonotonicClock::new());
        let store = Store::redis(
            RedisStore::new(settings(redis.url(), &format!("golden{i}")), clock.clone()).unwrap(),
            clock,
        );
        let policy = from_yaml(case.policy, "golden.yaml").unwrap();
        store.check_policy(&policy).unwrap();
        for (n, step) in case.steps.iter().enumerate() {
            let now = (BASE + step.at) * 1_000;
            let (key, cost, dry_run) = match step.op {
                Op::Decide { key, cost, dry_run } => {
                    ((!key.is_empty()).then_some(key), cost, dry_run)
                }
                _ => (None, 1, true),
            };
            let req = Request { tenant: "t", route: "/r", key, cost: Some(cost), dry_run };
            let chain = policy.resolve(&req, &NameBounds::default()).unwrap();
            let got = match step.op {
                Op::Decide { .. } => {
                    match store.decide(&req, &chain, now).await.unwrap().0.decision {
                        Decision::Allowed { remaining, reset_after, .. } => {
                            Got::Allowed { remaining, reset_after }
                        }
                        Decision::Rejected { scope, retry_after, .. } => {
                            Got::Rejected { scope, retry_after }
                        }
                    }
                }
                Op::Charge { units } => {
                    store.charge(&chain, now, units).await.unwrap();
                    Got::Done
                }
                Op::Refund { granted_at, hold, units } => {
                    let at = (BASE + granted_at) * 1_000;
                    store.refund_grant(&chain, now, at, hold * 1_000, units).await.unwrap();
                    Got::Done
                }
                Op::Grant { max, hold } => {
                    let g = store.grant(&chain, now, max, hold * 1_000).await.unwrap();
                    Got::Granted { units: g.units, hold: g.hold }
                }
                Op::Remaining => Got::Remaining(store.remaining(&chain, now).await.unwrap()),
            };
            if let Err(e) = check(case, n, step, got) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[tokio::test]
async fn idle_keys_expire_and_no_key_lives_forever() {
    let redis = RedisServer::start();
    let clock = Arc::new(MonotonicClock::new());
    let store =
        Store::redis(RedisStore::new(settings(redis.url(), "ttl"), clock.clone()).unwrap(), clock);
    let policy = from_yaml(CASES[7].policy, "golden.yaml").unwrap();
    let req = Request { tenant: "t", route: "/r", key: Some("k"), cost: Some(1), dry_run: false };
    let chain = policy.resolve(&req, &NameBounds::default()).unwrap();
    let now = BASE * 1_000;
    assert!(store.decide(&req, &chain, now).await.unwrap().0.admitted());
    // Every key written has a TTL within its limit's horizon (1 s windows, a
    // 100/s bucket of 100: at most two windows plus a tenth).
    let keys = common::redis::command(redis.port, "KEYS *").unwrap();
    let names: Vec<&str> = keys.lines().filter(|l| l.starts_with("ttl:")).collect();
    assert_eq!(names.len(), 6, "five levels, the sliding log with its own log key: {keys}");
    for k in names {
        let ttl = common::redis::command(redis.port, &format!("PTTL {k}")).unwrap();
        let ms: i64 = ttl.trim_start_matches(':').trim().parse().unwrap();
        assert!(ms > 0 && ms <= 2_201, "{k}: {ms} ms");
    }
    // A refund that restores a full allowance deletes the keys at once.
    store.refund(&chain, now, now, 1).await.unwrap();
    let left = common::redis::command(redis.port, "DBSIZE").unwrap();
    assert_eq!(left.trim(), ":0", "{left}");
}
