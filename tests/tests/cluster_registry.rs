//! Membership from a Redis registry, with three real server processes and a real
//! `redis-server` on a free port: every node derives the same ring at the same epoch;
//! a node that stops renewing leaves within its TTL; the registry going away leaves
//! the last good ring serving; readiness waits for the ring and `/healthz` does not.

#[path = "../../limiter-server/tests/common/redis.rs"]
mod redis_proc;

use std::time::Duration;

use limiter_tests::ServerProcess;
use redis_proc::RedisServer;
use tokio::time::Instant;

mod common;
use common::*;

fn registry(url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LIMITER__CLUSTER__MEMBERSHIP", "redis".to_owned()),
        ("LIMITER__CLUSTER__REGISTRY_URL", url.to_owned()),
        ("LIMITER__CLUSTER__REGISTRY_TTL_MS", "1000".to_owned()),
        ("LIMITER__CLUSTER__REGISTRY_POLL_MS", "200".to_owned()),
    ]
}

fn spawn(n: &Node, policy: &std::path::Path, env: &[(&'static str, String)]) -> ServerProcess {
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    n.spawn(policy, "", &extra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_registry_derives_one_ring_drops_silent_nodes_and_survives_its_loss() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, MEMBERSHIP_POLICY).unwrap();
    let mut redis = RedisServer::start();
    let env = registry(&redis.url());
    let nodes: Vec<Node> = ["a", "b", "c"].iter().map(|id| Node::new(id)).collect();
    let mut procs: Vec<ServerProcess> = nodes.iter().map(|n| spawn(n, &policy, &env)).collect();
    let mut epochs = Vec::new();
    for (p, n) in procs.iter().zip(&nodes) {
        p.wait_ready().await;
        epochs.push(wait_members(&mut client(n.grpc).await, 3).await.epoch);
    }
    // Once stable, every node reports the same epoch.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut now = Vec::new();
    for n in &nodes {
        now.push(wait_members(&mut client(n.grpc).await, 3).await.epoch);
    }
    assert!(now.windows(2).all(|w| w[0] == w[1]), "epochs differ: {now:?}");
    let before = now[0];

    // c stops renewing (killed): it leaves every ring within its TTL (plus a poll).
    let killed = Instant::now();
    procs[2].kill();
    let mut a = client(nodes[0].grpc).await;
    let t = wait_members(&mut a, 2).await;
    let left_after = killed.elapsed();
    let mut b = client(nodes[1].grpc).await;
    let tb = wait_members(&mut b, 2).await;
    println!(
        "a node that stopped renewing left the ring after {left_after:?} (TTL 1 s); epoch {before} -> {}",
        t.epoch
    );
    assert!(left_after <= Duration::from_millis(1_000 + 2 * 200 + 300), "{left_after:?}");
    assert!(t.epoch > before, "the epoch only grows");
    assert_eq!(t.epoch, tb.epoch);

    // The registry goes away: the last good ring keeps serving, its age grows.
    redis.kill();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let t2 = wait_members(&mut a, 2).await;
    assert_eq!(t2.epoch, t.epoch);
    let tenants: Vec<String> = (0..50).map(|k| format!("tenant-{k}")).collect();
    let owners = owners(&mut a, &tenants).await;
    let on_b = tenants.iter().zip(&owners).find(|(_, o)| *o == "b").unwrap().0;
    let r = a.should_allow(allow(on_b)).await.unwrap().into_inner();
    assert!(r.allowed, "a forwards to b on the last good ring");
    let age = procs[0].metric("limiter_membership_view_age_seconds", &[]).await;
    println!("registry down 1.5 s: ring kept at epoch {}, view age {age:.2} s", t2.epoch);
    assert!(age >= 1.0, "the view's age is exported: {age}");
    assert_eq!(procs[0].status("/readyz").await, Some(200), "still ready on the last good ring");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_waits_for_the_ring_and_goes_false_while_draining() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, MEMBERSHIP_POLICY).unwrap();
    // The registry is not there yet.
    let mut redis = RedisServer::start();
    redis.kill();
    let env = registry(&redis.url());
    let node = Node::new("a");
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut extra = extra;
    extra.push(("LIMITER__SHUTDOWN__DRAIN_DELAY_MS", "1500"));
    let p = node.spawn(&policy, "", &extra);
    let mut live = false;
    for _ in 0..100 {
        if p.status("/healthz").await == Some(200) {
            live = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(live, "/healthz answers without the registry");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(p.status("/readyz").await, Some(503), "not ready before joining a ring");
    redis.restart();
    p.wait_ready().await;
    // Draining: readiness off at once, liveness on until the end.
    p.terminate();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(p.status("/readyz").await, Some(503), "not ready while draining");
    assert_eq!(p.status("/healthz").await, Some(200), "alive while draining");
}
