//! The chaos runner, shortened: three nodes on a real `redis-server`, ten gateway
//! processes with leases, random faults of every kind; every invariant must hold.

mod common;

use std::path::PathBuf;

use loadtest::scenario::{Action, Scenario};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invariants_hold_under_random_faults() {
    let file = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios/chaos.yaml");
    let text = std::fs::read_to_string(file).unwrap();
    let text = text
        .replace("{ rate: 1500, for: 20s }", "{ rate: 600, for: 12s }")
        .replace("faults: 6", "faults: 4")
        .replace("until: 17s", "until: 10s");
    let mut s = Scenario::from_yaml(&text).unwrap();
    s.policy = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scenarios").join(&s.policy);
    // The draw is the seed's: every kind of fault, inside the interval, and every
    // killed node restarted.
    assert!(s.chaos);
    let kills = s.faults.iter().filter(|f| matches!(f.action, Action::Kill(_))).count();
    let restarts = s.faults.iter().filter(|f| matches!(f.action, Action::Restart(_))).count();
    assert_eq!(kills, restarts, "{:?}", s.faults);
    assert_eq!(s.faults.len() - restarts, 4, "{:?}", s.faults);
    assert!(s.faults.iter().all(|f| f.at.as_secs_f64() >= 2.0 && f.at.as_secs_f64() <= 10.0));

    let r = common::run_checked(&s).await;
    assert_eq!(r.invariants.len(), 7);
    for i in &r.invariants {
        assert!(i.holds, "{}: {}", i.name, i.detail);
    }
}

#[test]
fn chaos_that_cannot_be_placed_is_refused() {
    let e = Scenario::from_yaml(
        "
name: x
target: agent
policy: p.yaml
servers: { nodes: 1, store: memory }
gateways: 2
gateway_processes: true
tenants: { count: 2 }
routes: [{ name: /a }]
phases: [{ rate: 10, for: 5s }]
chaos: { faults: 3, kinds: [stop_redis], outage: 1s, from: 1s, until: 4s }
",
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("stop_redis needs servers.store: redis"), "{e:#}");
}
