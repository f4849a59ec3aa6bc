//! Bad input gets INVALID_ARGUMENT naming the field, and the server keeps serving.

mod common;

use common::{TestServer, ask, ask_cost, ask_key};
use limiter_proto::limiter::v1 as pb;
use tonic::Code;

const POLICY: &str = r"
version: 1
tenants:
  acme:
    limit: { algorithm: fixed_window, limit: 10, window: 1h }
";

#[tokio::test]
async fn each_bad_request_is_refused_and_the_server_keeps_serving() {
    let s = TestServer::start_with(
        POLICY,
        &[("LIMITER__LIMITS__MAX_TENANT_LEN", "16"), ("LIMITER__LIMITS__MAX_BATCH", "3")],
    )
    .await;
    let mut c = s.native().await;
    let long_key = "k".repeat(300);
    let cases: Vec<(pb::ShouldAllowRequest, &str)> = vec![
        (ask("", "/r"), "tenant"),
        (ask("acme", ""), "route"),
        (ask("a-tenant-name-longer-than-16", "/r"), "tenant"),
        (ask_key("acme", "/r", &long_key), "key"),
        (ask("acme\u{7}", "/r"), "tenant"),
        (ask_cost("acme", "/r", 0), "cost"),
        (ask_cost("acme", "/r", 11), "cost"),
        (ask_cost("acme", "/r", u64::MAX), "cost"),
    ];
    for (req, field) in cases {
        let e = c.should_allow(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{req:?}");
        assert!(e.message().starts_with(field), "`{}` should name `{field}`", e.message());
        // Nothing was charged and the server still answers.
        let ok =
            c.should_allow(pb::ShouldAllowRequest { dry_run: true, ..ask("acme", "/r") }).await;
        assert_eq!(ok.unwrap().into_inner().remaining, 10, "after {req:?}");
    }
    let batch = pb::ShouldAllowBatchRequest { requests: vec![ask("acme", "/r"); 4] };
    let e = c.should_allow_batch(batch).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("requests is 4, above the maximum of 3"), "{}", e.message());
    let batch = pb::ShouldAllowBatchRequest { requests: vec![ask("acme", "/r"), ask("", "/r")] };
    let e = c.should_allow_batch(batch).await.unwrap_err();
    assert!(e.message().starts_with("requests[1]: tenant"), "{}", e.message());
    let e =
        c.should_allow_batch(pb::ShouldAllowBatchRequest { requests: vec![] }).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(c.should_allow(ask("acme", "/r")).await.unwrap().into_inner().allowed);
    // A client cannot lease a node's slice of a root level, nor name a class's, nor
    // ask as the RLQS service's rate holder does.
    let item = |level: pb::Scope, class: &str| pb::LeaseItem {
        route: "/r".into(),
        want: 5,
        cost: 1,
        level: level.into(),
        share_class: class.into(),
        ..Default::default()
    };
    let slice = |level: pb::Scope, class: &str| pb::LeaseRequest {
        agent_id: "gw-1".into(),
        items: vec![item(level, class)],
        epoch: 0,
    };
    let held = |rates: bool, least: u64, after_keeps: bool| pb::LeaseRequest {
        agent_id: "gw-1".into(),
        items: vec![
            item(pb::Scope::Unspecified, ""),
            pb::LeaseItem { rates, least, after_keeps, ..item(pb::Scope::Unspecified, "") },
        ],
        epoch: 0,
    };
    for (req, field) in [
        (slice(pb::Scope::Global, ""), "items[0]: level"),
        (slice(pb::Scope::Unspecified, "gold"), "items[0]: share_class"),
        (held(true, 0, false), "items[1]: rates"),
        (held(true, 3, true), "items[1]: rates"),
        (held(false, 3, false), "items[1]: least"),
        (held(false, 3, true), "items[1]: least"),
        (held(false, 0, true), "items[1]: after_keeps"),
    ] {
        let e = c.lease(req).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().starts_with(field), "`{}` should name `{field}`", e.message());
        // The whole request is refused: its valid first item leased nothing.
        let ok =
            c.should_allow(pb::ShouldAllowRequest { dry_run: true, ..ask("acme", "/r") }).await;
        assert_eq!(ok.unwrap().into_inner().remaining, 9, "after `{field}`");
    }
    // Refusals are counted by field, with no tenant in any label.
    let (_, metrics) = s.get("/metrics").await;
    assert!(
        metrics.contains("limiter_invalid_requests_total{api=\"native\",field=\"cost\"}"),
        "{metrics}"
    );
    s.stop().await;
}

#[tokio::test]
async fn oversized_messages_are_refused() {
    let s = TestServer::start_with(POLICY, &[("LIMITER__LIMITS__MAX_MESSAGE_BYTES", "1024")]).await;
    let mut c = s.native().await;
    let e = c.should_allow(ask_key("acme", "/r", &"x".repeat(4_096))).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    assert!(c.should_allow(ask("acme", "/r")).await.unwrap().into_inner().allowed);
    s.stop().await;
}

const KEYED: &str = r"
version: 1
tenants:
  default:
    per_key: { algorithm: token_bucket, rate: 100/s, burst: 100 }
";

#[tokio::test]
async fn a_tenant_cannot_hold_more_keys_than_its_cap_and_others_go_on() {
    let s = TestServer::start_with(KEYED, &[("LIMITER__LIMITS__MAX_KEYS_PER_TENANT", "5")]).await;
    let mut c = s.native().await;
    for k in 0..5 {
        let r = c.should_allow(ask_key("flood", "/r", &format!("k{k}"))).await.unwrap();
        assert!(r.into_inner().allowed);
    }
    let e = c.should_allow(ask_key("flood", "/r", "k5")).await.unwrap_err();
    assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
    assert!(
        e.message().contains("`flood` already holds 5 distinct keys")
            && e.message().contains("limits.max_keys_per_tenant"),
        "{}",
        e.message()
    );
    // Its known keys, its tenant-wide levels and other tenants are served.
    assert!(c.should_allow(ask_key("flood", "/r", "k0")).await.unwrap().into_inner().allowed);
    assert!(c.should_allow(ask("flood", "/r")).await.unwrap().into_inner().allowed);
    assert!(c.should_allow(ask_key("quiet", "/r", "k5")).await.unwrap().into_inner().allowed);

    // Envoy: the same refusal, as an answer (an error would be a free pass to Envoy).
    let mut envoy = s.envoy().await;
    let descriptor =
        |user: &str| limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor {
            entries: vec![
            limiter_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry {
                key: "route".into(),
                value: "/r".into(),
            },
            limiter_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry {
                key: "user".into(),
                value: user.into(),
            },
        ],
            ..Default::default()
        };
    let req = |user: &str| limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest {
        domain: "flood".into(),
        descriptors: vec![descriptor(user)],
        hits_addend: 1,
    };
    // `user=u0`..: new keys of a tenant already at its cap.
    let r = envoy.should_rate_limit(req("u0")).await.unwrap().into_inner();
    use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::Code as Envoy;
    assert_eq!(r.overall_code(), Envoy::OverLimit, "{r:?}");
    let detail = r.response_headers_to_add.iter().find(|h| h.key == "x-ratelimit-detail");
    assert!(
        detail.is_some_and(|h| h.value.contains("`flood` already holds 5 distinct keys")),
        "{r:?}"
    );

    // Leases: the new key's item is refused, the other items of the call are served.
    let item = |tenant: &str, key: &str| pb::LeaseItem {
        tenant: tenant.into(),
        route: "/r".into(),
        key: key.into(),
        want: 10,
        cost: 1,
        ..Default::default()
    };
    let grants = c
        .lease(pb::LeaseRequest {
            agent_id: "gw-1".into(),
            items: vec![item("flood", "k9"), item("flood", "k1"), item("calm", "k9")],
            epoch: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .grants;
    assert_eq!(grants[0].units, 0);
    let refused = grants[0].decision.as_ref().unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.reason, pb::Reason::KeyLimit as i32);
    assert!(grants[1].units >= 1 && grants[2].units >= 1, "{grants:?}");

    let (_, body) = s.get("/metrics").await;
    let line = body
        .lines()
        .find(|l| l.starts_with(r#"limiter_limit_refusals_total{limit="keys_per_tenant"}"#))
        .unwrap_or_default();
    let n: f64 = line.rsplit(' ').next().and_then(|v| v.parse().ok()).unwrap_or(0.0);
    assert!(n >= 3.0, "{line}");
    s.stop().await;
}

#[tokio::test]
async fn sliding_logs_larger_than_the_entry_cap_are_refused() {
    let policy = |limit: u64| {
        format!(
            "version: 1\ntenants:\n  default:\n    per_key: {{ algorithm: sliding_log, limit: {limit}, window: 1m }}\n"
        )
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, policy(5_000)).unwrap();
    let config = limiter_server::config::ServerConfig::load_with_env(
        None,
        [
            ("LIMITER__POLICY_FILE".to_owned(), path.display().to_string()),
            ("LIMITER__LIMITS__MAX_LOG_ENTRIES".to_owned(), "1000".to_owned()),
        ],
    )
    .unwrap();
    let e = limiter_server::Server::new(config).unwrap_err().to_string();
    assert!(
        e.contains("tenants.default.per_key: a sliding log of limit 5000")
            && e.contains("limits.max_log_entries (1000)"),
        "{e}"
    );
    // A reload to such a policy is refused too; the one in force stays.
    let s = TestServer::start_with(&policy(1_000), &[("LIMITER__LIMITS__MAX_LOG_ENTRIES", "1000")])
        .await;
    std::fs::write(&s.policy, policy(1_001)).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(1200)).await;
    let (_, body) = s.get("/policy").await;
    assert!(body.contains(r#""version":1"#), "still the first policy: {body}");
    let (_, body) = s.get("/metrics").await;
    assert!(body.contains(r#"limiter_policy_reloads_total{result="failed"}"#), "{body}");
    s.stop().await;
}
