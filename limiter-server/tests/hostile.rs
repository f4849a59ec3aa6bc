//! Hostile callers and careless operators, one test per finding (numbered as in the
//! issue that listed them): no request resets a counter or slips past a limit, and no
//! file edit takes the policy down. Real gRPC on loopback, a server in-process.

mod common;

use common::envoy::{descriptor, header};

use std::time::Duration;

use common::{TestServer, ask, ask_key, eventually};
use limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use limiter_proto::limiter::v1 as pb;
use tonic::Code as Grpc;

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest { domain: domain.into(), descriptors, hits_addend: 0 }
}

fn forwarded<T>(message: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(message);
    r.metadata_mut().insert("x-limiter-forwarded", "1".parse().unwrap());
    r
}

const KEYED: &str = r"
version: 1
tenants:
  acme:
    per_key: { algorithm: fixed_window, limit: 2, window: 1h, name: per-key }
";

#[tokio::test]
async fn finding_1_a_node_alone_accepts_no_handoff_and_no_forwarded_call() {
    let s = TestServer::start(KEYED).await;
    let mut c = s.native().await;
    // Exhaust a key.
    for _ in 0..2 {
        assert!(c.should_allow(ask_key("acme", "/r", "k")).await.unwrap().into_inner().allowed);
    }
    assert!(!c.should_allow(ask_key("acme", "/r", "k")).await.unwrap().into_inner().allowed);
    // A forged handoff that would reset it to fresh, and one that would set a wait of
    // years: both refused outright, with or without the peer header.
    let fresh = pb::CounterState {
        scope: pb::Scope::Key.into(),
        tenant: "acme".into(),
        route: "/r".into(),
        key: "k".into(),
        state: br#""Fresh""#.to_vec(),
        version: 0,
        budget: 0,
    };
    let forged = pb::HandoffRequest {
        from: "someone".into(),
        counters: vec![fresh],
        complete: true,
        ..Default::default()
    };
    let e = c.handoff(forwarded(forged.clone())).await.unwrap_err();
    assert_eq!(e.code(), Grpc::PermissionDenied, "{e:?}");
    let e = c.handoff(forged.clone()).await.unwrap_err();
    assert_eq!(e.code(), Grpc::PermissionDenied, "{e:?}");
    // A forged replica (that could stand for this node's counters after a take-over):
    // refused the same way.
    let replica = pb::ReplicateRequest {
        from: "someone".into(),
        reset: true,
        synced: true,
        counters: forged.counters.clone(),
        ..Default::default()
    };
    let e = c.replicate(forwarded(replica.clone())).await.unwrap_err();
    assert_eq!(e.code(), Grpc::PermissionDenied, "{e:?}");
    let e = c.replicate(replica).await.unwrap_err();
    assert_eq!(e.code(), Grpc::PermissionDenied, "{e:?}");
    // A decision marked as forwarded is refused too: alone, a node has no peers.
    let e = c.should_allow(forwarded(ask_key("acme", "/r", "k"))).await.unwrap_err();
    assert_eq!(e.code(), Grpc::PermissionDenied, "{e:?}");
    assert!(e.message().contains("not in a cluster"), "{}", e.message());
    // The key is still exhausted.
    assert!(!c.should_allow(ask_key("acme", "/r", "k")).await.unwrap().into_inner().allowed);
    s.stop().await;
}

#[test]
fn finding_1_a_cluster_without_authentication_must_say_so() {
    let env = common::node_a;
    let e = limiter_server::config::ServerConfig::load_with_env(None, env(&[])).unwrap_err();
    assert!(e.to_string().contains("cluster.insecure_peers"), "{e}");
    limiter_server::config::ServerConfig::load_with_env(
        None,
        env(&[("LIMITER__CLUSTER__INSECURE_PEERS", "true")]),
    )
    .unwrap();
}

#[test]
fn finding_1_handed_off_states_no_algorithm_can_reach_are_refused() {
    use limiter_core::algorithm::Algorithm;
    use limiter_core::policy::from_yaml;
    let p = from_yaml(
        "version: 1\ntenants:\n  t:\n    limit: { algorithm: token_bucket, rate: 1/s, burst: 5 }\n    per_key: { algorithm: fixed_window, limit: 10, window: 1m }\n",
        "p.yaml",
    )
    .unwrap();
    let t = &p.tenants["t"];
    let bucket = t.limit.first().unwrap().limit.clone();
    let window = t.per_key.first().unwrap().limit.clone();
    let now = 1_800_000_000_000_000_000u64;
    let state = |json: &str| serde_json::from_str::<limiter_core::LimitState>(json).unwrap();
    // A bucket charged past its limit by a report: a debt of at most ten allowances.
    let mut s = limiter_core::LimitState::default();
    bucket.charge(&mut s, now, 1_000_000);
    assert!(bucket.plausible(&s, now, 0));
    assert_eq!(bucket.retry_after(&s, now, 1), 51_000_000_000, "debt capped at 55 tokens");
    // 31 years of wait, and a count of a window in the future: refused.
    let years =
        format!(r#"{{"TokenBucket":{{"tat":[0,{}]}}}}"#, now + 31 * 365 * 86_400 * 1_000_000_000);
    assert!(!bucket.plausible(&state(&years), now, 5_000_000_000));
    let future =
        format!(r#"{{"FixedWindow":{{"window":{},"count":1}}}}"#, now / 60_000_000_000 + 10);
    assert!(!window.plausible(&state(&future), now, 5_000_000_000));
    let huge =
        format!(r#"{{"FixedWindow":{{"window":{},"count":1000000}}}}"#, now / 60_000_000_000);
    assert!(!window.plausible(&state(&huge), now, 5_000_000_000));
    // A state of another algorithm is refused; a fresh one is fine.
    assert!(!bucket.plausible(&state(&future), now, 0));
    assert!(bucket.plausible(&limiter_core::LimitState::Fresh, now, 0));
}

#[tokio::test]
async fn finding_2_envoy_values_a_client_chooses_never_become_a_free_pass() {
    let policy = r"
version: 1
tenants:
  shop:
    routes:
      /cart: { algorithm: fixed_window, limit: 5, window: 1h, name: cart }
    per_key: { algorithm: fixed_window, limit: 2, window: 1h, name: per-user }
";
    let s = TestServer::start_with(policy, &[("LIMITER__LIMITS__MAX_KEYS_PER_TENANT", "3")]).await;
    let mut c = s.envoy().await;
    let long = "u".repeat(300);
    // A 300-byte value and a value with a TAB: decided, and limited like any key.
    for value in [long.as_str(), "a\tb"] {
        let d = || request("shop", vec![descriptor(&[("route", "/x"), ("user", value)], None)]);
        for _ in 0..2 {
            let r = c.should_rate_limit(d()).await.unwrap().into_inner();
            assert_eq!(r.overall_code(), Code::Ok);
        }
        let r = c.should_rate_limit(d()).await.unwrap().into_inner();
        assert_eq!(r.overall_code(), Code::OverLimit, "{value:?} is limited");
        assert_eq!(header(&r, "x-ratelimit-reason"), Some("KEY_LIMIT"));
    }
    // A cost that can never fit: over the limit, with the reason, nothing charged.
    let r = c
        .should_rate_limit(request(
            "shop",
            vec![
                descriptor(&[("route", "/cart")], Some(1)),
                descriptor(&[("route", "/cart")], Some(1_000)),
            ],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(r.statuses[0].code(), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 5, "the passing one is not charged");
    assert_eq!(r.statuses[1].code(), Code::OverLimit);
    assert_eq!(header(&r, "x-ratelimit-reason"), Some("TENANT_ROUTE_LIMIT"));
    assert!(header(&r, "x-ratelimit-detail").is_some_and(|d| d.contains("cost 1000")));
    // Keys beyond the tenant's cap: over the limit (two keys are held already).
    let r = c
        .should_rate_limit(request(
            "shop",
            vec![descriptor(&[("route", "/x"), ("user", "c")], None)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code(), Code::Ok);
    let r = c
        .should_rate_limit(request(
            "shop",
            vec![descriptor(&[("route", "/x"), ("user", "d")], None)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code(), Code::OverLimit, "a new key past the cap is no free pass");
    assert!(header(&r, "x-ratelimit-detail").is_some_and(|d| d.contains("max_keys_per_tenant")));
    // A long tenant (domain) and route: decided (the unknown tenant is rejected).
    let r = c
        .should_rate_limit(request(
            &"d".repeat(500),
            vec![descriptor(&[("route", &"r".repeat(500))], None)],
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code(), Code::OverLimit);
    assert_eq!(header(&r, "x-ratelimit-reason"), Some("UNKNOWN_TENANT"));
    s.stop().await;
}

/// The value of the counter or gauge `name` (with `labels`, as written) in `text`.
fn metric(text: &str, series: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

const TWO: &str = r"
version: 1
tenants:
  acme:
    limit: { algorithm: fixed_window, limit: 100000, window: 1h }
  globex:
    limit: { algorithm: fixed_window, limit: 100000, window: 1h }
";

#[tokio::test]
async fn finding_6_a_policy_written_in_place_in_two_parts_is_loaded_whole() {
    // A settle time well above the writer's pause, so a loaded machine cannot stretch
    // the pause past it.
    let s = TestServer::start_with(TWO, &[("LIMITER__RELOAD__SETTLE_MS", "1500")]).await;
    let mut c = s.native().await;
    let whole = format!(
        "{TWO}  initech:\n    limit: {{ algorithm: fixed_window, limit: 100, window: 1h }}\n"
    );
    // The first part alone is valid YAML without acme and globex.
    let (first, second) = whole.split_at(whole.find("  acme").unwrap());
    let (first, second) = (first.to_owned(), second.to_owned());
    let path = s.policy.clone();
    let writer = tokio::spawn(async move {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new().write(true).truncate(true).open(&path).unwrap();
        f.write_all(first.as_bytes()).unwrap();
        f.flush().unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        f.write_all(second.as_bytes()).unwrap();
    });
    // Every decision during the write and after it knows acme and globex.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(4);
    while tokio::time::Instant::now() < deadline {
        for t in ["acme", "globex"] {
            let r = c.should_allow(ask(t, "/r")).await.unwrap().into_inner();
            assert!(r.allowed, "{t} rejected during the write: {r:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    writer.await.unwrap();
    assert!(c.should_allow(ask("initech", "/r")).await.unwrap().into_inner().allowed);
    let (_, policy) = s.get("/policy").await;
    assert!(policy.contains("\"version\":2"), "loaded once: {policy}");
    s.stop().await;
}

#[test]
fn finding_7_policies_that_can_only_reject_are_refused() {
    use limiter_core::policy::from_yaml;
    let e = from_yaml("version: 1\nunknown_tenants: use_default\n", "p.yaml").unwrap_err();
    assert!(e.to_string().contains("p.yaml:2:") && e.to_string().contains("`default`"), "{e}");
    let e = from_yaml("version: 1\n", "p.yaml").unwrap_err();
    assert!(e.to_string().contains("every request would be"), "{e}");
    let e = from_yaml("version: 1\nunknown_tenants: reject\ntenants: {}\n", "p.yaml").unwrap_err();
    assert!(e.to_string().contains("UNKNOWN_TENANT"), "{e}");
    // With a tenant, or a default one, it loads.
    from_yaml(
        "version: 1\ntenants:\n  default:\n    limit: { algorithm: token_bucket, rate: 1/s }\n",
        "p",
    )
    .unwrap();
}

#[test]
fn finding_8_a_policy_above_its_size_limit_is_refused_naming_the_limit() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.yaml");
    std::fs::write(&path, "version: 1\ntenants:\n  t: {}\n").unwrap();
    let e = limiter_server::owner::reload::read_policy(&path, 10).unwrap_err().to_string();
    assert!(
        e.contains("limits.max_policy_bytes") && e.contains("LIMITER__LIMITS__MAX_POLICY_BYTES"),
        "{e}"
    );
    assert!(limiter_server::owner::reload::read_policy(&path, 1_000).is_ok());
}

#[test]
fn finding_8_a_policy_far_above_the_old_parser_budget_loads() {
    // 31,000 tenants was the most that loaded before; 60,000 take 480,000 nodes.
    let mut text = String::from("version: 1\ntenants:\n");
    for i in 0..60_000 {
        text.push_str(&format!(
            "  t{i}:\n    limit: {{ algorithm: token_bucket, rate: 10/s, burst: 20 }}\n"
        ));
    }
    let p = limiter_core::policy::from_yaml(&text, "big.yaml").unwrap();
    assert_eq!(p.tenants.len(), 60_000);
}

const SHOP: &str = r"
version: 1
tenants:
  shop:
    limit: { algorithm: fixed_window, limit: 10, window: 1h, name: shop-hour }
";

#[tokio::test]
async fn finding_9_a_rejected_call_reports_the_rejected_limit_and_real_remaining() {
    let s = TestServer::start(SHOP).await;
    let mut c = s.envoy().await;
    let r = c
        .should_rate_limit(request("shop", vec![descriptor(&[("route", "/a")], Some(9))]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code(), Code::Ok);
    // Two descriptors on the same limit: the first fits (1 left), the second not.
    let both = request(
        "shop",
        vec![descriptor(&[("route", "/a")], Some(1)), descriptor(&[("route", "/b")], Some(1))],
    );
    let r = c.should_rate_limit(both).await.unwrap().into_inner();
    assert_eq!(r.overall_code(), Code::OverLimit);
    let limit = header(&r, "RateLimit").unwrap();
    assert!(limit.starts_with("\"shop-hour\";r=0;"), "RateLimit agrees with OVER_LIMIT: {limit}");
    assert_eq!(r.statuses[0].code(), Code::Ok);
    assert_eq!(r.statuses[0].limit_remaining, 1, "uncharged: what is really left");
    // Nothing was charged: one unit is still there.
    let r = c
        .should_rate_limit(request("shop", vec![descriptor(&[("route", "/a")], Some(1))]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.overall_code(), Code::Ok);
    assert!(header(&r, "RateLimit").unwrap().contains(";r=0;"));
    s.stop().await;
}

#[tokio::test]
async fn finding_10_the_status_page_hides_keys_and_dates_a_failed_reload() {
    let s = TestServer::start(KEYED).await;
    let mut c = s.native().await;
    for _ in 0..3 {
        let _ = c.should_allow(ask_key("acme", "/r", "api-key-3")).await.unwrap();
    }
    let (_, data) = s.get("/dashboard/data").await;
    assert!(!data.contains("api-key-3"), "a raw key on the status page: {data}");
    assert!(data.contains("acme/#"), "{data}");
    // A failed reload is shown with its time, and cleared by a later good one.
    std::fs::write(&s.policy, "version: 1\ntenants: [\n").unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            s.get("/dashboard/data").await.1.contains("\"last_failure_at\":1")
        })
        .await
    );
    std::fs::write(
        &s.policy,
        format!(
            "{KEYED}  other:\n    per_key: {{ algorithm: fixed_window, limit: 2, window: 1h }}\n"
        ),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            s.get("/dashboard/data").await.1.contains("\"last_error\":null")
        })
        .await
    );
    s.stop().await;

    let s = TestServer::start_with(KEYED, &[("LIMITER__DASHBOARD__SHOW_KEYS", "true")]).await;
    let mut c = s.native().await;
    let _ = c.should_allow(ask_key("acme", "/r", "api-key-3")).await.unwrap();
    assert!(s.get("/dashboard/data").await.1.contains("acme/api-key-3"));
    s.stop().await;
}

#[tokio::test]
async fn finding_11_http1_on_the_grpc_port_gets_a_hint() {
    let s = TestServer::start(KEYED).await;
    let (status, body) = common::http_get(s.grpc, "/").await;
    assert_eq!(status, 426, "{body}");
    assert!(body.contains("speaks gRPC"), "{body}");
    // gRPC is still served.
    let mut c = s.native().await;
    assert!(c.should_allow(ask_key("acme", "/r", "x")).await.unwrap().into_inner().allowed);
    s.stop().await;
}

#[test]
fn finding_11_messages_name_what_is_wrong() {
    use limiter_core::policy::from_yaml;
    let e = from_yaml(
        "version: 1\ntenants:\n  t:\n    limit: { algorithm: fixed_window, limit: 99999999999999999999999, window: 1s }\n",
        "p.yaml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("too large"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.yaml");
    std::fs::write(&path, b"version: 1\ntenants:\n  t\xff: {}\n").unwrap();
    let max = limiter_server::owner::reload::DEFAULT_MAX_POLICY_BYTES;
    let e = limiter_server::owner::reload::read_policy(&path, max).unwrap_err().to_string();
    assert!(e.contains("p.yaml:3:4") && e.contains("byte 23"), "{e}");
}

#[tokio::test]
async fn finding_5_a_huge_value_is_quoted_short_everywhere() {
    let s = TestServer::start(KEYED).await;
    let huge = "9".repeat(2_000_000);
    std::fs::write(
        &s.policy,
        format!("version: 1\ntenants:\n  acme:\n    limit: {{ algorithm: token_bucket, rate: {huge}x/s }}\n"),
    )
    .unwrap();
    assert!(
        eventually(Duration::from_secs(5), || async {
            s.get("/policy").await.1.contains("last_error\":\"")
        })
        .await
    );
    let (_, policy) = s.get("/policy").await;
    let (_, data) = s.get("/dashboard/data").await;
    assert!(
        policy.len() < 20_000 && data.len() < 20_000,
        "{} and {} bytes",
        policy.len(),
        data.len()
    );
    assert!(policy.contains("bytes)"), "the length of what was cut is said: {policy}");
    // check-config prints it short too.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_limiter-server"))
        .args(["check-config", &s.policy.display().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(out.stdout.len() + out.stderr.len() < 2_000, "{} bytes", out.stderr.len());
    s.stop().await;
}

#[tokio::test]
async fn finding_4_an_idle_server_opens_its_policy_a_handful_of_times() {
    // A process of its own: the metrics of other tests in this binary would mix in.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.yaml");
    std::fs::write(&path, KEYED).unwrap();
    let mut server =
        common::process::Process::start(&path, &[("LIMITER__RELOAD__POLL_INTERVAL_MS", "200")])
            .await;
    let reads = |text: &str| metric(text, "limiter_policy_reads_total");
    let before = reads(&server.metrics().await);
    tokio::time::sleep(Duration::from_secs(10)).await;
    let idle = reads(&server.metrics().await) - before;
    assert!(idle <= 2.0, "{idle} reads in 10 s of an idle server");
    // A broken file: refused and counted once, however long it stays.
    std::fs::write(&path, "version: 1\ntenants: [\n").unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let text = server.metrics().await;
    assert_eq!(metric(&text, r#"limiter_policy_reloads_total{result="failed"}"#), 1.0, "{text}");
    assert!(reads(&text) - before <= 6.0, "{} reads", reads(&text) - before);
    server.stop();
}

#[tokio::test]
async fn finding_1_a_handoff_from_a_node_not_in_the_cluster_is_refused() {
    use std::sync::Arc;
    let env = common::node_a(&[("LIMITER__CLUSTER__INSECURE_PEERS", "true")]);
    let config = limiter_server::config::ServerConfig::load_with_env(None, env).unwrap();
    let now = 1_800_000_000_000_000_000u64;
    let clock = Arc::new(limiter_core::clock::ManualClock::new(now));
    let cluster = limiter_server::cluster::Cluster::new(
        config.cluster,
        limiter_proto::connect::ClientSecurity::default(),
        true,
        clock,
        1_000_000_000,
    );
    let policy = limiter_core::policy::from_yaml(KEYED, "p.yaml").unwrap();
    let limiter = limiter_core::Limiter::new(1_000);
    let leases = limiter_server::owner::lease::Leases::default();
    let counter = |state: String| pb::CounterState {
        scope: pb::Scope::Key.into(),
        tenant: "acme".into(),
        route: "/r".into(),
        key: "k".into(),
        state: state.into_bytes(),
        version: 0,
        budget: 0,
    };
    let window = now / 3_600_000_000_000;
    let good = counter(format!(r#"{{"FixedWindow":{{"window":{window},"count":2}}}}"#));
    let forged = counter(format!(r#"{{"FixedWindow":{{"window":{},"count":2}}}}"#, window + 100));
    let req = |from: &str| pb::HandoffRequest {
        from: from.into(),
        counters: vec![good.clone(), forged.clone()],
        complete: true,
        ..Default::default()
    };
    let e = cluster.receive(&req("mallory"), Some(&limiter), &leases, &policy).unwrap_err();
    assert!(e.contains("not a node of this cluster"), "{e}");
    // From a peer: the reachable state is stored, the one from a window to come is not.
    assert_eq!(cluster.receive(&req("b"), Some(&limiter), &leases, &policy), Ok(1));
}

/// An agent's reported demand is its own: one claiming any demand beside an honest
/// agent of 80 a second ([`common::claim_beside_an_honest_agent`]) counts for twice
/// the rate at most, so the honest agent keeps its share: its part is 100 x 80 / (80
/// + 200) = 28.6 a second, 57 units in 2 s (measured: 54 and 55). Counted whole (20 a
/// second per unit asked), the claim left it 0 or 1 unit in 2 s.
#[tokio::test]
async fn an_agent_that_claims_any_demand_leaves_the_others_their_share() {
    let s = TestServer::start(common::BATCHED).await;
    let got = common::claim_beside_an_honest_agent(&s).await;
    println!("the honest agent got {got} units in the last 2 s");
    // Four fifths of its part at least.
    assert!(got >= 45, "the honest agent got {got} units in the last 2 s");
    s.stop().await;
}
