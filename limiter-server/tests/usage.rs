//! The usage view (`Usage` over gRPC, `GET /v1/usage` on the admin port): every level
//! of a tenant, route and key with its limit, what is left and when it resets, read
//! without charging anything or creating a counter, on both stores. Each level's
//! values are checked against what a dry run of that level alone reports (the same
//! policy cut down to that one level, on a server of its own charged alike).

mod common;

use common::{Backend, TestServer};
use limiter_proto::limiter::v1 as pb;

/// Every algorithm and every level; calendar windows in two timezones. Exact mode:
/// every decision is the store's own (no leased batch holds units back).
const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 1/h, burst: 100 }
routes:
  /r:
    lease: { mode: exact }
    limit: { algorithm: sliding_counter, limit: 5000, window: 1m }
tenants:
  t:
    limit: { algorithm: fixed_window, limit: 100, window: 1mo, align: calendar, timezone: Europe/Berlin }
    routes:
      /r: { algorithm: sliding_counter, limit: 50, window: 1d, align: calendar, timezone: Australia/Adelaide }
    per_key: { algorithm: sliding_log, limit: 20, window: 10s }
";

/// The policy with only the level `scope` of `POLICY`.
fn alone(scope: pb::Scope) -> String {
    let route = "  /r:\n    lease: { mode: exact }\n";
    match scope {
        pb::Scope::Global => format!(
            "version: 1\nglobal:\n  ceiling: {{ algorithm: token_bucket, rate: 1/h, burst: 100 }}\nroutes:\n{route}tenants:\n  t: {{}}\n"
        ),
        pb::Scope::Route => format!(
            "version: 1\nroutes:\n{route}    limit: {{ algorithm: sliding_counter, limit: 5000, window: 1m }}\ntenants:\n  t: {{}}\n"
        ),
        pb::Scope::Tenant => format!(
            "version: 1\nroutes:\n{route}tenants:\n  t:\n    limit: {{ algorithm: fixed_window, limit: 100, window: 1mo, align: calendar, timezone: Europe/Berlin }}\n"
        ),
        pb::Scope::TenantRoute => format!(
            "version: 1\nroutes:\n{route}tenants:\n  t:\n    routes:\n      /r: {{ algorithm: sliding_counter, limit: 50, window: 1d, align: calendar, timezone: Australia/Adelaide }}\n"
        ),
        _ => format!(
            "version: 1\nroutes:\n{route}tenants:\n  t:\n    per_key: {{ algorithm: sliding_log, limit: 20, window: 10s }}\n"
        ),
    }
}

fn usage_of(key: &str) -> pb::UsageRequest {
    pb::UsageRequest { tenant: "t".into(), route: "/r".into(), key: key.into() }
}

fn ask(cost: u64, dry_run: bool) -> pb::ShouldAllowRequest {
    pb::ShouldAllowRequest {
        tenant: "t".into(),
        route: "/r".into(),
        key: "k".into(),
        cost: Some(cost),
        dry_run,
        ..Default::default()
    }
}

fn secs(d: Option<prost_types::Duration>) -> f64 {
    let d = d.unwrap_or_default();
    d.seconds as f64 + f64::from(d.nanos) / 1e9
}

macro_rules! store_tests {
    () => {
        #[tokio::test]
        async fn every_level_is_reported_as_a_dry_run_of_it_alone_and_nothing_is_charged() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let before = c.usage(usage_of("k")).await.unwrap().into_inner();
            let scopes: Vec<pb::Scope> = before.levels.iter().map(|l| l.scope()).collect();
            use pb::Scope::*;
            assert_eq!(scopes, [Global, Route, Tenant, TenantRoute, Key]);
            for l in &before.levels {
                let limit = l.limit.as_ref().unwrap();
                assert_eq!(l.remaining, limit.quota, "{:?} untouched is full", l.scope());
                assert_eq!(secs(l.reset_after), 0.0, "{:?}", l.scope());
                assert!(!l.shared);
            }
            // Calendar windows report their current window's real length.
            let month = before.levels[2].limit.as_ref().unwrap().window.unwrap().seconds;
            assert!((28 * 86_400 - 3_600..=31 * 86_400 + 3_600).contains(&month), "{month}");
            let day = before.levels[3].limit.as_ref().unwrap().window.unwrap().seconds;
            assert!([23 * 3_600, 24 * 3_600, 25 * 3_600].contains(&day), "{day}");

            // Charged 7 on every level; reading usage three times charges nothing.
            assert!(c.should_allow(ask(7, false)).await.unwrap().into_inner().allowed);
            let mut seen = Vec::new();
            for _ in 0..3 {
                seen.push(c.usage(usage_of("k")).await.unwrap().into_inner());
            }
            let u = &seen[2];
            let left: Vec<u64> = u.levels.iter().map(|l| l.remaining).collect();
            // The bucket refills one token an hour; the rest count 7 of their limit.
            assert_eq!(left, [93, 4_993, 93, 43, 13]);
            assert!(
                seen.iter().all(|s| s.levels.iter().map(|l| l.remaining).eq(left.iter().copied()))
            );
            let probe = c.should_allow(ask(1, true)).await.unwrap().into_inner();
            // A dry run reports what is left without its cost: the key's log, 20 - 7.
            assert_eq!(probe.remaining, 13, "nothing charged by usage");

            // Each level against a dry run of that level alone, charged alike.
            for l in &u.levels {
                let one = TestServer::start_on(BACKEND, &alone(l.scope())).await;
                let mut oc = one.native().await;
                assert!(oc.should_allow(ask(7, false)).await.unwrap().into_inner().allowed);
                let dry = oc.should_allow(ask(1, true)).await.unwrap().into_inner();
                assert_eq!(dry.remaining, l.remaining, "{:?}", l.scope());
                let (ours, theirs) = (secs(l.reset_after), secs(dry.reset_after));
                // Read a moment apart: the same reset within the test's own delay.
                assert!((ours - theirs).abs() < 2.0, "{:?}: {ours} against {theirs}", l.scope());
                let alone_usage = oc.usage(usage_of("k")).await.unwrap().into_inner();
                let mine = alone_usage.levels.iter().find(|a| a.scope == l.scope).unwrap();
                assert_eq!(mine.remaining, l.remaining, "{:?}", l.scope());
                assert_eq!(mine.limit, l.limit, "{:?}", l.scope());
                one.stop().await;
            }

            // reset_at is the RFC 3339 form of now + reset_after.
            let key = &u.levels[4];
            assert!(key.reset_at.ends_with('Z') && key.reset_at.contains('T'), "{}", key.reset_at);
            assert!((9.0..=10.0).contains(&secs(key.reset_after)), "{:?}", key.reset_after);

            // The JSON view on the admin port says the same.
            let (status, body) = s.get("/v1/usage?tenant=t&route=/r&key=k").await;
            assert_eq!(status, 200, "{body}");
            let v: serde_json::Value = serde_json::from_str(&body).unwrap();
            let json_left: Vec<u64> = v["levels"]
                .as_array()
                .unwrap()
                .iter()
                .map(|l| l["remaining"].as_u64().unwrap())
                .collect();
            assert_eq!(json_left, left);
            assert_eq!(v["levels"][2]["algorithm"], "fixed_window");
            assert_eq!(v["levels"][3]["scope"], "tenant_route");
            s.stop().await;
        }

        #[tokio::test]
        async fn usage_creates_no_counter_and_bad_names_are_refused_by_field() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            // This server's own count (the `limiter_store_keys` gauge is the process's,
            // set by every server a test of this binary runs at the same time).
            let keys = || s.owner().store().stats().keys;
            let before = keys();
            for i in 0..50 {
                let u = c.usage(usage_of(&format!("fresh-{i}"))).await.unwrap().into_inner();
                assert_eq!(u.levels[4].remaining, 20);
            }
            assert_eq!(keys(), before, "usage created counters");
            if let Some(redis) = &s.redis {
                let n = common::redis::command(redis.port, "DBSIZE").unwrap();
                assert_eq!(n.trim(), ":0", "usage created Redis keys: {n}");
            }
            let e = c
                .usage(pb::UsageRequest {
                    tenant: String::new(),
                    route: "/r".into(),
                    key: String::new(),
                })
                .await
                .unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument);
            assert!(e.message().starts_with("tenant"), "{}", e.message());
            let (status, body) = s.get("/v1/usage?route=/r").await;
            assert_eq!(status, 400);
            assert!(body.contains("\"field\":\"tenant\""), "{body}");
            let long = "x".repeat(10_000);
            let (status, body) = s.get(&format!("/v1/usage?tenant={long}&route=/r")).await;
            assert_eq!(status, 400, "{body}");
            assert!(body.len() < 600, "quoted input is cut short: {} bytes", body.len());
            // Open tickets are counted for their own tenant, route and key.
            let mut est = ask(10, false);
            est.report_later = true;
            assert!(c.should_allow(est).await.unwrap().into_inner().allowed);
            let u = c.usage(usage_of("k")).await.unwrap().into_inner();
            assert_eq!((u.open_tickets, u.open_ticket_units), (1, 10));
            let other = c.usage(usage_of("other")).await.unwrap().into_inner();
            assert_eq!(other.open_tickets, 0);
            s.stop().await;
        }
    };
}

on_each_store!(store_tests);

#[tokio::test]
async fn every_budget_of_a_level_is_reported_by_name() {
    let policy = "version: 1
tenants:
  t:
    limit:
      - { name: per_minute, algorithm: fixed_window, limit: 10, window: 1m }
      - { name: per_month, algorithm: fixed_window, limit: 1000, window: 1mo, align: calendar }
";
    let s = TestServer::start(policy).await;
    let mut c = s.native().await;
    assert!(c.should_allow(ask(3, false)).await.unwrap().into_inner().allowed);
    let u = c.usage(usage_of("")).await.unwrap().into_inner();
    let got: Vec<(pb::Scope, String, u64)> = u
        .levels
        .iter()
        .map(|l| (l.scope(), l.limit.as_ref().unwrap().name.clone(), l.remaining))
        .collect();
    assert_eq!(
        got,
        [
            (pb::Scope::Tenant, "per_minute".to_owned(), 7),
            (pb::Scope::Tenant, "per_month".to_owned(), 997)
        ]
    );
    s.stop().await;
}
