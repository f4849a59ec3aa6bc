//! The Redis store when Redis goes away under load: paused (slow: nothing answers)
//! and stopped (refusing connections), then back. Every decision follows its route's
//! failure policy within the breaker's threshold, no call waits past its deadline, the
//! server stays up and ready, and Redis's counters are intact when it returns.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use common::redis::RedisServer;
use common::{TestServer, ask, eventually};
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use tonic::transport::Channel;

const POLICY: &str = r"
version: 1
on_limiter_failure: { mode: fail_closed }
routes:
  # Decided in Redis request by request: no batch units held here, so what the
  # outage admits is the failure policy's alone (units of a batch are pre-paid in
  # Redis and stay spendable until the batch ends; see the batch test).
  /open:
    on_limiter_failure: { mode: fail_open, emergency_ceiling: 20/s }
    lease: { mode: exact }
  /closed:
    on_limiter_failure: { mode: fail_closed }
    lease: { mode: exact }
  /batched:
    on_limiter_failure: { mode: fail_closed }
    lease: { mode: leased, ttl: 1s, max_batch: 50 }
  /exact:
    lease: { mode: exact }
tenants:
  t:
    limit: { algorithm: fixed_window, limit: 100000, window: 1h }
  # A bucket refilling one unit an hour: no window boundary the run could cross (a
  # window aligned on the clock's hour would start afresh mid-test at some hour).
  counted:
    limit: { algorithm: token_bucket, rate: 1/h, burst: 10 }
";

/// The call deadline: the store's 50 ms command timeout, plus the server's own work
/// and a loaded 2-core machine's scheduling.
const DEADLINE: Duration = Duration::from_millis(400);

#[derive(Debug, Default)]
struct Tally {
    calls: u64,
    allowed: u64,
    by_reason: std::collections::BTreeMap<String, u64>,
    slowest: Duration,
}

/// Sends requests to `route` for `period`, one after another; tallies the answers.
async fn drive(c: &mut RateLimiterClient<Channel>, route: &str, period: Duration) -> Tally {
    let mut t = Tally::default();
    let end = Instant::now() + period;
    while Instant::now() < end {
        let started = Instant::now();
        let r = c.should_allow(ask("t", route)).await.expect("the server answers").into_inner();
        t.slowest = t.slowest.max(started.elapsed());
        t.calls += 1;
        if r.allowed {
            t.allowed += 1;
        } else {
            *t.by_reason.entry(r.reason().as_str_name().to_owned()).or_default() += 1;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_away_and_back_under_load() {
    let mut redis = RedisServer::start();
    let url = redis.url();
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__STORE__KIND", "redis"),
            ("LIMITER__STORE__REDIS__URL", &url),
            ("LIMITER__STORE__REDIS__COMMAND_TIMEOUT_MS", "50"),
            ("LIMITER__STORE__REDIS__BREAKER_THRESHOLD", "3"),
            ("LIMITER__STORE__REDIS__PROBE_INTERVAL_MS", "200"),
        ],
    )
    .await;
    let mut c = s.native().await;
    // Healthy: counters in Redis.
    let counted = ask("counted", "/exact");
    for left in [9, 8, 7, 6] {
        let r = c.should_allow(counted.clone()).await.unwrap().into_inner();
        assert!(r.allowed);
        assert_eq!(r.remaining, left);
    }
    for route in ["/open", "/batched"] {
        let healthy = drive(&mut c, route, Duration::from_millis(300)).await;
        assert_eq!(healthy.allowed, healthy.calls, "{healthy:?}");
    }

    for (phase, stop) in [("paused", false), ("stopped", true)] {
        if stop {
            redis.stop_saving();
        } else {
            redis.pause();
        }
        let outage = Instant::now();
        let (mut c1, mut c2, mut c3) = (c.clone(), c.clone(), c.clone());
        let (mut c4, mut c5) = (c.clone(), c.clone());
        let period = Duration::from_millis(1_500);
        // Three callers on the batched chain: none waits behind another's call.
        let (open, closed, batched, b2, b3) = tokio::join!(
            drive(&mut c1, "/open", period),
            drive(&mut c2, "/closed", period),
            drive(&mut c3, "/batched", period),
            drive(&mut c4, "/batched", period),
            drive(&mut c5, "/batched", period),
        );
        println!(
            "{phase}: /open {open:?}\n{phase}: /closed {closed:?}\n{phase}: /batched {batched:?}"
        );
        for t in [&open, &closed, &batched, &b2, &b3] {
            assert!(t.slowest < DEADLINE, "{phase}: a call waited too long: {t:?}");
        }
        // A batch's units were paid for in Redis before the outage: spendable until the
        // batch ends (1 s), never more than one batch; then the policy (fail closed).
        assert!(batched.allowed + b2.allowed + b3.allowed <= 50, "{phase}: {batched:?}");
        for t in [&batched, &b2, &b3] {
            assert!(t.by_reason.keys().all(|r| r == "LIMITER_UNAVAILABLE"), "{phase}: {t:?}");
        }
        // Fail closed: nothing admitted once the breaker has opened (the calls before
        // it, at most the threshold, failed too: a failed call never admits).
        assert_eq!(closed.allowed, 0, "{phase}: {closed:?}");
        assert_eq!(closed.by_reason.get("LIMITER_UNAVAILABLE").copied(), Some(closed.calls));
        // Fail open: within the emergency ceiling (20/s over 1.5 s, its burst of 20
        // included), the rest EMERGENCY_CEILING.
        let ceiling = 20 + 20 * outage.elapsed().as_millis() as u64 / 1_000;
        assert!(open.allowed > 0 && open.allowed <= ceiling, "{phase}: {open:?}");
        assert!(open.by_reason.keys().all(|r| r == "EMERGENCY_CEILING"), "{phase}: {open:?}");
        // Up and ready throughout.
        assert_eq!(s.get("/readyz").await.0, 200);
        assert_eq!(s.get("/healthz").await.0, 200);
        let metrics = s.get("/metrics").await.1;
        assert!(metrics.contains("limiter_store_breaker_open 1"), "{phase}");
        // /open, /closed and /batched decided by their failure policies.
        assert!(metrics.contains("limiter_fallback_routes 3"), "{phase}");

        if stop {
            redis.restart();
        } else {
            redis.resume();
        }
        let back = Instant::now();
        // Within the probe interval (200 ms) and a reconnection, Redis decides again.
        let recovered = eventually(Duration::from_secs(5), || {
            let mut c = c.clone();
            async move {
                let r = c.should_allow(ask("t", "/closed")).await.unwrap().into_inner();
                r.allowed
            }
        })
        .await;
        assert!(recovered, "{phase}: decisions return to Redis");
        println!("{phase}: Redis decides again {:?} after it returned", back.elapsed());
        assert!(s.get("/metrics").await.1.contains("limiter_store_breaker_open 0"));
    }
    // The counter kept in Redis survived both outages: 4 of 10 were spent before.
    let r = c.should_allow(counted.clone()).await.unwrap().into_inner();
    assert!(r.allowed);
    assert_eq!(r.remaining, 5, "counters in Redis are intact");
    s.stop().await;
}

#[tokio::test]
async fn a_server_starts_while_redis_is_down_and_follows_its_policies() {
    let port = common::redis::free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__STORE__KIND", "redis"),
            ("LIMITER__STORE__REDIS__URL", &url),
            ("LIMITER__STORE__REDIS__COMMAND_TIMEOUT_MS", "50"),
        ],
    )
    .await;
    assert_eq!(s.get("/readyz").await.0, 200);
    let mut c = s.native().await;
    let r = c.should_allow(ask("t", "/closed")).await.unwrap().into_inner();
    assert_eq!(r.reason(), pb::Reason::LimiterUnavailable);
    let r = c.should_allow(ask("t", "/open")).await.unwrap().into_inner();
    assert!(r.allowed);
    s.stop().await;
}

#[tokio::test]
async fn a_password_protected_redis_with_the_right_and_a_wrong_password() {
    let redis = RedisServer::start_with(&["--requirepass", "s3cret"]);
    let good = format!("redis://:s3cret@127.0.0.1:{}", redis.port);
    let s = TestServer::start_with(
        POLICY,
        &[("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__URL", &good)],
    )
    .await;
    let mut c = s.native().await;
    for left in [9, 8] {
        let r = c.should_allow(ask("counted", "/exact")).await.unwrap().into_inner();
        assert!(r.allowed);
        assert_eq!(r.remaining, left, "decided in Redis");
    }
    s.stop().await;
    let bad = format!("redis://:wrong@127.0.0.1:{}", redis.port);
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__STORE__KIND", "redis"),
            ("LIMITER__STORE__REDIS__URL", &bad),
            ("LIMITER__STORE__REDIS__COMMAND_TIMEOUT_MS", "200"),
        ],
    )
    .await;
    let mut c = s.native().await;
    let r = c.should_allow(ask("t", "/closed")).await.unwrap().into_inner();
    assert_eq!(r.reason(), pb::Reason::LimiterUnavailable, "refused by Redis: the policy applies");
    s.stop().await;
}

#[tokio::test]
async fn tls_to_redis_with_a_private_ca() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let openssl = |args: &[&str]| {
        let ok = std::process::Command::new("openssl")
            .args(args)
            .current_dir(d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(ok.success(), "openssl {args:?}");
    };
    // A CA of the test's own, and a certificate it signs for 127.0.0.1.
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        "key.pem",
        "-out",
        "req.csr",
    ]);
    std::fs::write(d.join("san.ext"), "subjectAltName=IP:127.0.0.1,DNS:localhost\n").unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "req.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "1",
        "-extfile",
        "san.ext",
        "-out",
        "cert.pem",
    ]);
    let port = common::redis::free_port();
    /// Kills the server even when an assertion fails first.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _server = Killed(
        std::process::Command::new("redis-server")
            .args(["--port", "0", "--bind", "127.0.0.1", "--save", "", "--tls-auth-clients", "no"])
            .args(["--tls-port", &port.to_string()])
            .args([
                "--tls-cert-file",
                "cert.pem",
                "--tls-key-file",
                "key.pem",
                "--tls-ca-cert-file",
                "ca.pem",
            ])
            .current_dir(d)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let up = eventually(Duration::from_secs(10), || async move {
        tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_ok()
    })
    .await;
    assert!(up, "redis-server with TLS did not start");
    let url = format!("rediss://127.0.0.1:{port}");
    let ca = d.join("ca.pem").display().to_string();
    let s = TestServer::start_with(
        POLICY,
        &[
            ("LIMITER__STORE__KIND", "redis"),
            ("LIMITER__STORE__REDIS__URL", &url),
            ("LIMITER__STORE__REDIS__TLS_CA_FILE", &ca),
            ("LIMITER__STORE__REDIS__COMMAND_TIMEOUT_MS", "2000"),
        ],
    )
    .await;
    let mut c = s.native().await;
    for left in [9, 8] {
        let r = c.should_allow(ask("counted", "/exact")).await.unwrap().into_inner();
        assert_eq!((r.allowed, r.remaining), (true, left), "{r:?}");
    }
    s.stop().await;
    // Without the CA, the server does not trust Redis: the failure policy applies.
    let s = TestServer::start_with(
        POLICY,
        &[("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__URL", &url)],
    )
    .await;
    let mut c = s.native().await;
    let r = c.should_allow(ask("t", "/closed")).await.unwrap().into_inner();
    assert_eq!(r.reason(), pb::Reason::LimiterUnavailable);
    s.stop().await;
}
