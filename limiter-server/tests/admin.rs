//! The admin port: metrics after traffic (bounded labels, no tenant ids), health,
//! readiness through shutdown, the policy summary, and the key-cardinality cap.

mod common;

use std::time::Duration;

use common::{TestServer, allowed_of, ask, ask_key, eventually, http_get};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

const POLICY: &str = r"
version: 1
routes:
  /search: {}
tenants:
  acme-corp-4711:
    limit: { algorithm: fixed_window, limit: 3, window: 1h }
  default:
    per_key: { algorithm: token_bucket, rate: 1/h, burst: 1 }
";

#[tokio::test]
async fn metrics_show_decisions_by_reason_and_route_without_tenant_ids() {
    let s = TestServer::start(POLICY).await;
    let mut c = s.native().await;
    assert_eq!(allowed_of(&mut c, &ask("acme-corp-4711", "/search"), 5).await, 3);
    assert_eq!(allowed_of(&mut c, &ask("acme-corp-4711", "/unlisted-9f3a"), 1).await, 0);
    assert_eq!(allowed_of(&mut c, &ask_key("tenant-zz-0042", "/search", "user-77"), 2).await, 1);
    let (status, body) = s.get("/metrics").await;
    assert_eq!(status, 200);
    for needle in [
        r#"limiter_decisions_total{api="native",route="/search",decision="allowed",reason="none",scope="none"}"#,
        r#"limiter_decisions_total{api="native",route="/search",decision="rejected",reason="TENANT_LIMIT",scope="tenant"} 2"#,
        r#"limiter_decisions_total{api="native",route="other",decision="rejected",reason="TENANT_LIMIT",scope="tenant"} 1"#,
        r#"limiter_decisions_total{api="native",route="/search",decision="rejected",reason="KEY_LIMIT",scope="key"} 1"#,
        "limiter_decision_duration_seconds_bucket{api=\"native\",le=\"0.00001\"}",
        "limiter_policy_version 1",
        "limiter_build_info{version=",
    ] {
        assert!(body.contains(needle), "missing {needle} in\n{body}");
    }
    // No label anywhere carries a tenant, a key or an unlisted route.
    for secret in ["acme-corp-4711", "tenant-zz-0042", "user-77", "unlisted-9f3a"] {
        assert!(!body.contains(secret), "`{secret}` leaked into /metrics:\n{body}");
    }
    s.stop().await;
}

#[tokio::test]
async fn health_readiness_and_policy_summary() {
    let s = TestServer::start_with(POLICY, &[("LIMITER__SHUTDOWN__DRAIN_DELAY_MS", "600")]).await;
    assert_eq!(s.get("/healthz").await.0, 200);
    assert_eq!(s.get("/readyz").await.0, 200);
    let (status, body) = s.get("/policy").await;
    assert_eq!(status, 200);
    assert!(body.contains(r#""version":1"#), "{body}");
    assert!(body.contains(r#""routes":["/search"]"#), "{body}");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", s.grpc)).unwrap();
    let mut health = HealthClient::new(channel.connect().await.unwrap());
    let check = |service: &str| HealthCheckRequest { service: service.to_owned() };
    let serving = ServingStatus::Serving as i32;
    for service in ["", "limiter.v1.RateLimiter", "envoy.service.ratelimit.v3.RateLimitService"] {
        let status = health.check(check(service)).await.unwrap().into_inner().status;
        assert_eq!(status, serving, "`{service}`");
    }
    let admin = s.admin;
    let mut c = s.native().await;
    let stopping = tokio::spawn(s.stop());
    // During the drain delay: not ready, but calls are still answered.
    assert!(
        eventually(Duration::from_secs(2), || async { http_get(admin, "/readyz").await.0 == 503 })
            .await
    );
    let status = health.check(check("")).await.unwrap().into_inner().status;
    assert_eq!(status, ServingStatus::NotServing as i32);
    assert!(c.should_allow(ask("acme-corp-4711", "/search")).await.is_ok());
    stopping.await.unwrap();
}

#[tokio::test]
async fn a_flood_of_distinct_keys_cannot_grow_past_the_cap() {
    let s = TestServer::start_with(POLICY, &[("LIMITER__STORE__MAX_KEYS", "256")]).await;
    let mut c = s.native().await;
    for i in 0..3_000 {
        let r = c.should_allow(ask_key("flood", "/search", &format!("k{i}"))).await.unwrap();
        assert!(r.into_inner().allowed, "each new key has its own fresh bucket");
    }
    let (_, body) = s.get("/metrics").await;
    let value = |name: &str| -> f64 {
        body.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} missing in\n{body}"))
    };
    let max = value("limiter_store_max_keys");
    assert!((256.0..2_000.0).contains(&max), "{max}");
    assert!(value("limiter_store_keys") <= max);
    assert!(value("limiter_store_evictions_total{kind=\"live\"}") >= 3_000.0 - max);
    s.stop().await;
}
