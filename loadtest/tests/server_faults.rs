//! Faults on the servers a run starts: a node killed and restarted, Redis stopped.
//! Every request still gets an answer or an error within its deadline, nothing
//! crashes, and service comes back.

mod common;

use loadtest::scenario::Scenario;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_and_restarted_and_redis_stopped() {
    let policy = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios/tight-policy.yaml");
    let s = Scenario::from_yaml(&format!(
        "
name: server-faults-check
target: native
policy: {policy}
servers: {{ nodes: 2, store: redis }}
gateways: 2
seed: 4
tenants: {{ count: 10 }}
routes:
  - {{ name: /search, weight: 3, cost: 1 }}
  - {{ name: /export, weight: 1, cost: 4 }}
phases:
  - {{ rate: 300, for: 8s }}
timeout: 500ms
faults:
  - {{ at: 1s, kill: node1 }}
  - {{ at: 2500ms, restart: node1 }}
  - {{ at: 5s, stop_redis: 1s }}
"
    ))
    .unwrap();
    let r = common::run_checked(&s).await;
    let t = &r.totals;
    // Answers (or errors) came within the deadline: nothing waited longer.
    assert!(r.latency.max < 600_000.0, "max {} µs", r.latency.max);
    // While node1 was down, gateway1 (which calls it) got errors.
    assert!(t.errors > 0, "{t:?}");
    // The last second is served normally again.
    let last = r.per_second.iter().rev().find(|s| s.offered > 0).unwrap();
    assert_eq!(last.errors, 0, "{last:?}");
    assert!(last.admitted > 0, "{last:?}");
}
