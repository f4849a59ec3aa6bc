//! Real `limiter-server` processes: an owner killed under an agent (each route
//! follows its failure policy, and the agent comes back when the owner does), and a
//! planned stop by SIGTERM (readiness off first, then a clean exit).

use std::time::Duration;

use limiter_core::Reason;
use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest, Source};
use limiter_tests::{ServerProcess, free_addr};
use tokio::time::Instant;

const POLICY: &str = r"
version: 1
lease: { ttl: 1s }
routes:
  /open:
    on_limiter_failure: { mode: fail_open, emergency_ceiling: 10/s }
  /closed:
    on_limiter_failure: { mode: fail_closed }
tenants:
  t:
    limit: { algorithm: token_bucket, rate: 10000/s, burst: 10000 }
";

fn bin() -> &'static std::path::Path {
    std::path::Path::new(env!("CARGO_BIN_EXE_limiter-server-under-test"))
}

fn req(route: &str) -> AgentRequest<'_> {
    AgentRequest { tenant: "t", route, key: None, cost: 1 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_outlives_its_owner_being_killed_and_restarted() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let (grpc, admin) = (free_addr(), free_addr());
    let mut owner = ServerProcess::start(bin(), &policy, grpc, admin, 0).await;
    let config = AgentConfig::new(owner.url(), "gw").with_rpc_timeout(Duration::from_millis(200));
    let agent = Agent::new(config).unwrap();
    for _ in 0..10 {
        assert!(agent.decide(&req("/open")).await.unwrap().allowed);
        assert!(agent.decide(&req("/closed")).await.unwrap().allowed);
    }

    owner.kill();
    // Past the lease (1 s) and the detection, every decision is the failure policy's.
    let killed = Instant::now();
    let (mut open_ok, mut closed_seen) = (0u32, false);
    while killed.elapsed() < Duration::from_millis(2_500) {
        let o = agent.decide(&req("/open")).await.unwrap();
        if o.source == Source::Fallback {
            open_ok += u32::from(o.allowed);
            if !o.allowed {
                assert_eq!(o.reason, Some(Reason::EmergencyCeiling));
            }
        }
        let c = agent.decide(&req("/closed")).await.unwrap();
        if c.source == Source::Fallback {
            assert!(!c.allowed);
            assert_eq!(c.reason, Some(Reason::LimiterUnavailable));
            closed_seen = true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(agent.in_fallback());
    assert!(closed_seen, "the fail-closed route answered LIMITER_UNAVAILABLE");
    assert!(open_ok > 0 && open_ok <= 10 + 25, "fail-open admitted {open_ok} under 10/s");

    // The owner comes back on the same address: the agent leaves fallback by itself.
    let _owner = ServerProcess::start(bin(), &policy, grpc, admin, 0).await;
    let back = Instant::now();
    let mut recovered = false;
    while back.elapsed() < Duration::from_secs(10) {
        let c = agent.decide(&req("/closed")).await.unwrap();
        if c.allowed && c.source != Source::Fallback {
            recovered = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(recovered, "the agent did not return to its restarted owner");
    assert!(!agent.in_fallback());
    println!(
        "owner killed: fail-open admitted {open_ok}; recovered {:?} after the restart",
        back.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_turns_readiness_off_then_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let mut server = ServerProcess::start(bin(), &policy, free_addr(), free_addr(), 800).await;
    assert_eq!(server.status("/readyz").await, Some(200));
    server.terminate();
    let mut not_ready = false;
    for _ in 0..40 {
        if server.status("/readyz").await == Some(503) {
            not_ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(not_ready, "readiness did not go false during the drain");
    assert_eq!(server.status("/healthz").await, Some(200), "still alive while draining");
    let deadline = Instant::now() + Duration::from_secs(10);
    let code = loop {
        if let Some(status) = server.child.try_wait().unwrap() {
            break status.code();
        }
        assert!(Instant::now() < deadline, "did not exit after SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code, Some(0));
}

#[path = "../../limiter-server/tests/common/redis.rs"]
mod redis;

/// The server's command line on the Redis store: the store's connection tasks start
/// inside the runtime (they once panicked the process before it served anything).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_serves_from_redis() {
    let redis = redis::RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let (grpc, admin) = (free_addr(), free_addr());
    let env = [
        ("LIMITER__STORE__KIND".to_owned(), "redis".to_owned()),
        ("LIMITER__STORE__REDIS__URL".to_owned(), redis.url()),
    ];
    let owner = ServerProcess::spawn(bin(), &policy, grpc, admin, 0, &env);
    owner.wait_ready().await;
    let agent = Agent::new(AgentConfig::new(owner.url(), "gw")).unwrap();
    assert!(agent.decide(&req("/closed")).await.unwrap().allowed);
    assert!(owner.metric("limiter_store_calls_total", &[]).await > 0.0);
}
