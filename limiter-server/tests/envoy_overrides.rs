//! Envoy's per-descriptor `limit` override over real gRPC, on both stores: ignored by
//! default; with `envoy.descriptor_limits: apply`, a fixed window of its own keyed by
//! the descriptor, in addition to the policy's levels, capped by
//! `envoy.descriptor_limit_cap`, charged with the descriptor's `hits_addend`, and
//! keeping its count when the override's size changes.

mod common;

use common::envoy::{descriptor, header};
use common::{Backend, TestServer};
use limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use limiter_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::RateLimitOverride;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use limiter_proto::envoy::r#type::v3::RateLimitUnit;

/// Roomy policy levels: what refuses in these tests is the override.
const POLICY: &str = r"
version: 1
tenants:
  shop:
    limit: { algorithm: fixed_window, limit: 100000, window: 1d }
    per_key: { algorithm: token_bucket, rate: 1000/s, burst: 10000 }
";

const APPLY: &[(&str, &str)] = &[
    ("LIMITER__ENVOY__DESCRIPTOR_LIMITS", "apply"),
    ("LIMITER__ENVOY__DESCRIPTOR_LIMIT_CAP", "1/h"),
];

fn with_limit(
    user: &str,
    requests: u32,
    unit: RateLimitUnit,
    hits: Option<u64>,
) -> RateLimitDescriptor {
    let mut d = descriptor(&[("route", "/api"), ("user", user)], hits);
    d.limit = Some(RateLimitOverride { requests_per_unit: requests, unit: unit.into() });
    d
}

fn request(d: RateLimitDescriptor) -> RateLimitRequest {
    RateLimitRequest { domain: "shop".into(), descriptors: vec![d], hits_addend: 0 }
}

/// A result's count. The metrics recorder is one per test process, shared by the
/// servers of every test in this file running at once: a test checks that its own
/// descriptors were counted (at least so many), not an exact total.
fn counted(metrics: &str, result: &str) -> u64 {
    let line = format!("limiter_envoy_descriptor_limits_total{{result=\"{result}\"}} ");
    metrics.lines().find_map(|l| l.strip_prefix(&line)).map_or(0, |v| v.trim().parse().unwrap())
}

macro_rules! store_tests {
    () => {
        #[tokio::test]
        async fn ignored_by_default() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.envoy().await;
            for _ in 0..5 {
                let r = c
                    .should_rate_limit(request(with_limit("u", 2, RateLimitUnit::Day, None)))
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(r.overall_code(), Code::Ok);
            }
            assert!(counted(&s.get("/metrics").await.1, "ignored") >= 5);
            s.stop().await;
        }

        #[tokio::test]
        async fn applied_as_a_level_of_its_own_with_hits_addend() {
            let s = TestServer::start_on_with(BACKEND, POLICY, APPLY).await;
            let mut c = s.envoy().await;
            let ask = |hits| request(with_limit("u", 10, RateLimitUnit::Day, hits));
            // 4 + 4 of 10; a dry check (hits_addend 0) charges nothing; 4 more do not fit.
            for hits in [Some(4), Some(4), Some(0)] {
                let r = c.should_rate_limit(ask(hits)).await.unwrap().into_inner();
                assert_eq!(r.overall_code(), Code::Ok, "{hits:?}");
            }
            let r = c.should_rate_limit(ask(Some(4))).await.unwrap().into_inner();
            assert_eq!(r.overall_code(), Code::OverLimit);
            assert_eq!(header(&r, "x-ratelimit-reason"), Some("KEY_LIMIT"));
            let st = &r.statuses[0];
            assert_eq!(st.current_limit.as_ref().unwrap().name, "override");
            assert_eq!(st.current_limit.as_ref().unwrap().requests_per_unit, 10);
            let policy = header(&r, "RateLimit-Policy").unwrap();
            assert!(policy.contains(r#""override";q=10;w=86400"#), "{policy}");
            // The 2 left still fit; another user's descriptor has its own count.
            assert_eq!(
                c.should_rate_limit(ask(Some(2))).await.unwrap().into_inner().overall_code(),
                Code::Ok
            );
            let other = request(with_limit("v", 10, RateLimitUnit::Day, Some(10)));
            assert_eq!(
                c.should_rate_limit(other).await.unwrap().into_inner().overall_code(),
                Code::Ok
            );
            // A cost above the override can never fit: OVER_LIMIT, not an error.
            let r =
                c.should_rate_limit(request(with_limit("w", 3, RateLimitUnit::Day, Some(5)))).await;
            assert_eq!(r.unwrap().into_inner().overall_code(), Code::OverLimit);
            assert!(counted(&s.get("/metrics").await.1, "applied") >= 6);
            s.stop().await;
        }

        #[tokio::test]
        async fn capped_and_changing_its_size_keeps_the_count() {
            let s = TestServer::start_on_with(BACKEND, POLICY, APPLY).await;
            let mut c = s.envoy().await;
            // Asked 1000 a day, capped at 1/h over a day: 24.
            let big = request(with_limit("u", 1_000, RateLimitUnit::Day, Some(12)));
            for expect in [Code::Ok, Code::Ok, Code::OverLimit] {
                let r = c.should_rate_limit(big.clone()).await.unwrap().into_inner();
                assert_eq!(r.overall_code(), expect);
            }
            assert!(counted(&s.get("/metrics").await.1, "capped") >= 3);
            // The same descriptor now says 30 a day (capped at 24 again) or 20: the 24
            // counted stay counted, so nothing more fits either way.
            for n in [30, 20, 1_000] {
                let r = c
                    .should_rate_limit(request(with_limit("u", n, RateLimitUnit::Day, Some(1))))
                    .await
                    .unwrap()
                    .into_inner();
                assert_eq!(r.overall_code(), Code::OverLimit, "{n} a day");
            }
            // An unknown unit or zero requests is no override (the policy's levels decide).
            for (n, unit) in [(5, RateLimitUnit::Unknown), (0, RateLimitUnit::Day)] {
                let r = c.should_rate_limit(request(with_limit("u", n, unit, Some(1)))).await;
                assert_eq!(r.unwrap().into_inner().overall_code(), Code::Ok);
            }
            assert!(counted(&s.get("/metrics").await.1, "invalid") >= 2);
            s.stop().await;
        }
    };
}

on_each_store!(store_tests);

#[test]
fn apply_needs_a_cap_and_bad_values_are_named() {
    use limiter_server::config::ServerConfig;
    let load = |pairs: &[(&str, &str)]| {
        let vars: Vec<(String, String)> =
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        ServerConfig::load_with_env(None, vars).unwrap_err().to_string()
    };
    let e = load(&[("LIMITER__ENVOY__DESCRIPTOR_LIMITS", "apply")]);
    assert!(e.contains("envoy.descriptor_limit_cap"), "{e}");
    let e = load(&[("LIMITER__ENVOY__DESCRIPTOR_LIMITS", "always")]);
    assert!(e.contains("envoy.descriptor_limits: expected `ignore` or `apply`"), "{e}");
    let e = load(&[
        ("LIMITER__ENVOY__DESCRIPTOR_LIMITS", "apply"),
        ("LIMITER__ENVOY__DESCRIPTOR_LIMIT_CAP", "lots"),
    ]);
    assert!(e.contains("envoy.descriptor_limit_cap"), "{e}");
}
