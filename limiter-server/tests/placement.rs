//! Placement of tenants on one node of a three-node cluster, through its public API
//! and a manual clock: the ring decides the owner; a node that died without handing
//! off leaves its tenants fenced for the fence; tenants moving from a live node wait
//! for its handoff, and are decided here once it has arrived (or its wait is over).

use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::ManualClock;
use limiter_proto::limiter::v1 as pb;
use limiter_server::cluster::ring::{Member, Ring};
use limiter_server::cluster::{Cluster, Placement};
use limiter_server::owner::lease::Leases;

const START: u64 = 1_800_000_000_000_000_000;
const FENCE_MS: u64 = 1_000;

fn member(id: &str, port: u16) -> Member {
    Member { id: id.into(), address: format!("127.0.0.1:{port}").into(), weight: 1 }
}

/// Node `a` of `a`, `b`, `c` (peers on ports nothing listens on).
fn node(clock: &Arc<ManualClock>) -> Cluster {
    let env: Vec<(String, String)> = [
        ("LIMITER__POLICY_FILE", "p.yaml"),
        ("LIMITER__CLUSTER__MEMBERSHIP", "static"),
        ("LIMITER__CLUSTER__PEERS", "a=127.0.0.1:1,b=127.0.0.1:2,c=127.0.0.1:3"),
        ("LIMITER__CLUSTER__NODE_ID", "a"),
        ("LIMITER__CLUSTER__INSECURE_PEERS", "true"),
        ("LIMITER__CLUSTER__FENCE_MS", "1000"),
        ("LIMITER__CLUSTER__HANDOFF_TIMEOUT_MS", "2000"),
        ("LIMITER__CLUSTER__FORWARD_TIMEOUT_MS", "100"),
    ]
    .iter()
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    let config = limiter_server::config::ServerConfig::load_with_env(None, env).unwrap();
    Cluster::new(
        config.cluster,
        limiter_proto::connect::ClientSecurity::default(),
        true,
        clock.clone(),
        1_000_000_000,
    )
}

/// Tenant names, each paired with its owner in `ring`.
fn owners(ring: &Ring, n: usize) -> Vec<(String, String)> {
    (0..n)
        .map(|i| {
            let t = format!("t{i}");
            let o = ring.owner(&t).unwrap().id.to_string();
            (t, o)
        })
        .collect()
}

/// Node `a` ten seconds after its first view of the ring of `a`, `b` and `c`.
async fn steady() -> (Arc<ManualClock>, Cluster, Leases, Ring) {
    let clock = Arc::new(ManualClock::new(START));
    let a = node(&clock);
    let leases = Leases::default();
    let all = Ring::new(1, vec![member("a", 1), member("b", 2), member("c", 3)]);
    a.install(all.clone(), None, &leases).await;
    clock.advance(Duration::from_secs(10));
    (clock, a, leases, all)
}

#[tokio::test]
async fn the_ring_places_tenants_and_a_lost_owner_is_fenced_then_taken_over() {
    let (clock, a, leases, all) = steady().await;
    // Steady state: the ring's owner decides, here or there.
    let tenants = owners(&all, 60);
    for (t, o) in &tenants {
        match a.place(t, clock_now(&clock)) {
            Placement::Local => assert_eq!(o, "a", "{t}"),
            Placement::Remote(m) => assert_eq!(&*m.id, o.as_str(), "{t}"),
            other => panic!("{t}: {other:?} in a steady ring"),
        }
    }
    // `c` dies without a handoff: its tenants that come to `a` are fenced for the fence,
    // the others keep their owners.
    let without_c = Ring::new(2, vec![member("a", 1), member("b", 2)]);
    a.install(without_c.clone(), None, &leases).await;
    let died = clock_now(&clock);
    let mut fenced = 0;
    for (t, before) in &tenants {
        let after = without_c.owner(t).unwrap().id.to_string();
        let p = a.place(t, died);
        match (before.as_str(), after.as_str()) {
            ("c", "a") => {
                fenced += 1;
                assert!(
                    matches!(p, Placement::Fenced { until } if until == died + FENCE_MS * 1_000_000),
                    "{t}: {p:?}"
                );
            }
            (_, "a") => assert!(matches!(p, Placement::Local), "{t}: {p:?}"),
            (_, b) => assert!(matches!(&p, Placement::Remote(m) if &*m.id == b), "{t}: {p:?}"),
        }
    }
    assert!(fenced > 0, "some of c's tenants move to a");
    // After the fence, they are decided here.
    clock.advance(Duration::from_millis(FENCE_MS));
    for (t, before) in &tenants {
        if before == "c" && without_c.owner(t).is_some_and(|o| &*o.id == "a") {
            assert!(matches!(a.place(t, clock_now(&clock)), Placement::Local), "{t}");
        }
    }
}

#[tokio::test]
async fn tenants_from_a_live_node_wait_for_its_handoff() {
    let clock = Arc::new(ManualClock::new(START));
    let a = node(&clock);
    let leases = Leases::default();
    // `a`'s first view: b and c own everything; then `a` joins.
    let bc = Ring::new(1, vec![member("b", 2), member("c", 3)]);
    a.install(bc.clone(), None, &leases).await;
    clock.advance(Duration::from_secs(10));
    let abc = Ring::new(2, vec![member("a", 1), member("b", 2), member("c", 3)]);
    a.install(abc.clone(), None, &leases).await;
    let joined = clock_now(&clock);
    let from_b: Vec<String> = owners(&abc, 90)
        .into_iter()
        .filter(|(t, o)| o == "a" && bc.owner(t).is_some_and(|m| &*m.id == "b"))
        .map(|(t, _)| t)
        .collect();
    assert!(!from_b.is_empty());
    for t in &from_b {
        let p = a.place(t, joined);
        assert!(
            matches!(p, Placement::Wait { until } if until == joined + 2_000_000_000),
            "{t}: {p:?}"
        );
    }
    // b's complete handoff arrives: decided here at once.
    let policy = limiter_core::policy::from_yaml(
        "version: 1\ntenants:\n  default:\n    limit: { algorithm: token_bucket, rate: 1/s }\n",
        "p.yaml",
    )
    .unwrap();
    let done = pb::HandoffRequest { from: "b".into(), complete: true, ..Default::default() };
    assert_eq!(a.receive(&done, None, &leases, &policy), Ok(0));
    for t in &from_b {
        assert!(matches!(a.place(t, joined), Placement::Local), "{t}");
    }
}

fn clock_now(clock: &ManualClock) -> u64 {
    use limiter_core::clock::Clock as _;
    clock.now()
}

#[tokio::test]
async fn routing_forwards_client_calls_and_answers_moved_to_forwarded_ones() {
    use limiter_server::api::routing::target;
    let (_clock, a, _leases, all) = steady().await;
    let tenants = owners(&all, 30);
    let (mine, theirs): (Vec<_>, Vec<_>) = tenants.iter().partition(|(_, o)| o == "a");
    assert!(!mine.is_empty() && !theirs.is_empty());
    for (t, _) in &mine {
        // Its own tenants are decided here, whatever the hop.
        for hop in 0..3 {
            assert!(target(&a, t, hop).await.is_none(), "{t} at hop {hop}");
        }
    }
    for (t, o) in &theirs {
        // A client's call is forwarded to the owner; a call forwarded once already is
        // answered "moved" (the owner is named); a redirected one is decided here.
        assert!(matches!(target(&a, t, 0).await, Some(Ok(m)) if &*m.id == o.as_str()), "{t}");
        assert!(matches!(target(&a, t, 1).await, Some(Err(m)) if &*m.id == o.as_str()), "{t}");
        assert!(target(&a, t, 2).await.is_none(), "{t}");
    }
}
