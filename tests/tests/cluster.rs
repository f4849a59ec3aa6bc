//! Three (and four) real `limiter-server` processes sharing tenants over loopback:
//! the spread of tenants, what moves when a node leaves or joins, forwarding to the
//! owner, and exactness across nodes.

use limiter_proto::limiter::v1 as pb;
use std::time::Duration;

use limiter_tests::ServerProcess;
use std::collections::HashMap;

mod common;
use common::*;

const POLICY: &str = r"
version: 1
lease: { ttl: 1s }
unknown_tenants: use_default
routes:
  /r: {}
tenants:
  default:
    limit: { algorithm: fixed_window, limit: 10, window: 1h }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_spread_evenly_move_minimally_and_are_forwarded_once() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let (nodes, started) = start_first(&policy, &["a", "b", "c", "d"], 3, &[]).await;
    let peers = Node::static_peers(&nodes);
    let mut procs: Vec<Option<ServerProcess>> = started.into_iter().map(Some).collect();
    procs.push(None);
    let mut a = client(nodes[0].grpc).await;
    wait_members(&mut a, 3).await;

    // Spread: 10,000 tenants over three equal nodes.
    let tenants: Vec<String> = (0..10_000).map(|i| format!("tenant-{i}")).collect();
    let three = owners(&mut a, &tenants).await;
    let mut count: HashMap<&str, usize> = HashMap::new();
    for o in &three {
        *count.entry(o.as_str()).or_default() += 1;
    }
    let max = *count.values().max().unwrap() as f64;
    let spread = max / (10_000.0 / 3.0);
    println!("spread over 3 nodes: {count:?}, max/mean {spread:.3}");
    assert_eq!(count.len(), 3);
    assert!(spread <= 1.1, "max over mean {spread:.3}");
    // Every node derives the same owners.
    for n in &nodes[1..3] {
        let mut c = client(n.grpc).await;
        wait_members(&mut c, 3).await;
        assert_eq!(owners(&mut c, &tenants).await, three, "node {} disagrees", n.id);
    }

    // A request sent to a non-owner gets the owner's answer in one forward: a
    // tenant's 10 units are exact whichever nodes the requests go to.
    let tenant = tenants.iter().zip(&three).find(|(_, o)| *o == "b").unwrap().0.clone();
    let mut clients = Vec::new();
    for n in &nodes[..3] {
        clients.push(client(n.grpc).await);
    }
    let forwards_before =
        procs[0].as_ref().unwrap().metric("limiter_forwards_total", &["answered"]).await;
    let mut admitted = 0;
    for i in 0..30 {
        let r = clients[i % 3].should_allow(allow(&tenant)).await.unwrap().into_inner();
        assert!(r.moved_to.is_empty());
        admitted += u32::from(r.allowed);
    }
    assert_eq!(admitted, 10, "one owner decides every request");
    let forwarded =
        procs[0].as_ref().unwrap().metric("limiter_forwards_total", &["answered"]).await
            - forwards_before;
    assert_eq!(forwarded, 10.0, "a forwarded each of its 10 requests once");
    let decided_b =
        procs[1].as_ref().unwrap().metric("limiter_decisions_total", &["api=\"native\""]).await;
    assert!(decided_b >= 30.0, "b decided all 30: {decided_b}");

    // A caller that routes by the ring and sends to a non-owner with an older epoch
    // is told the owner instead of being served.
    let ring = wait_members(&mut clients[0], 3).await;
    let stale = pb::LeaseRequest {
        agent_id: "gw".to_owned(),
        items: vec![pb::LeaseItem {
            tenant: tenant.clone(),
            route: "/r".to_owned(),
            want: 5,
            cost: 1,
            ..Default::default()
        }],
        epoch: ring.epoch.saturating_sub(1).max(1),
    };
    let g = clients[0].lease(stale).await.unwrap().into_inner().grants.remove(0);
    assert_eq!(g.redirect, nodes[1].grpc.to_string(), "redirected to b");
    assert_eq!((g.units, g.epoch), (0, ring.epoch));

    // Removing c moves only c's tenants.
    procs[2].take().unwrap().kill();
    wait_members(&mut a, 2).await;
    let two = owners(&mut a, &tenants).await;
    let moved = three.iter().zip(&two).filter(|(x, y)| x != y).count();
    assert!(three.iter().zip(&two).all(|(x, y)| x == y || x == "c"), "a tenant of a or b moved");
    println!("c left: {moved} of 10000 tenants moved, all of them c's ({})", count["c"]);
    assert_eq!(moved, count["c"]);

    // c comes back and d joins: about a quarter moves, all of it to d.
    procs[2] = Some(nodes[2].spawn(&policy, &peers, &[]));
    procs[3] = Some(nodes[3].spawn(&policy, &peers, &[]));
    wait_members(&mut a, 4).await;
    let four = owners(&mut a, &tenants).await;
    let moved = three.iter().zip(&four).filter(|(x, y)| x != y).count();
    assert!(
        three.iter().zip(&four).all(|(x, y)| x == y || y == "d"),
        "a tenant moved between old nodes"
    );
    let share = moved as f64 / 10_000.0;
    println!("d joined: {moved} of 10000 tenants moved ({:.1}%), all to d", share * 100.0);
    assert!((0.22..=0.28).contains(&share), "moved {share}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_that_route_by_the_ring_lease_straight_from_the_owners() {
    use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest};
    let dir = tempfile::tempdir().unwrap();
    let policy = POLICY.replace("limit: 10, window: 1h", "limit: 1000, window: 1h");
    let (_, nodes, procs) = start_nodes(dir.path(), &policy, &["a", "b", "c"], &[]).await;
    let tenants: Vec<String> = (0..30).map(|k| format!("tenant-{k}")).collect();
    let entry = format!("http://{}", nodes[0].grpc);
    let forwards = || async {
        let mut n = 0.0;
        for p in &procs {
            n += p.metric("limiter_forwards_total", &["api=\"lease\""]).await;
        }
        n
    };
    for by_ring in [false, true] {
        let mut config = AgentConfig::new(entry.clone(), format!("gw-{by_ring}"));
        if by_ring {
            config = config.with_ring_routing();
        }
        let agent = Agent::new(config).unwrap();
        // Let it read the ring.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = forwards().await;
        for t in &tenants {
            for _ in 0..3 {
                let req = AgentRequest { tenant: t, route: "/r", key: None, cost: 1 };
                assert!(agent.decide(&req).await.unwrap().allowed);
            }
        }
        let forwarded = forwards().await - before;
        if by_ring {
            // An owner dies: keys of the other owners go on, the dead one's get their
            // route's failure policy (through the endpoint), and no call fails.
            let mut c = client(nodes[0].grpc).await;
            let fresh: Vec<String> = (100..160).map(|k| format!("tenant-{k}")).collect();
            let owned = owners(&mut c, &fresh).await;
            let pid = procs[2].child.id().to_string();
            assert!(
                std::process::Command::new("kill").args(["-9", &pid]).status().unwrap().success()
            );
            for (t, o) in fresh.iter().zip(&owned) {
                let req = AgentRequest { tenant: t, route: "/r", key: None, cost: 1 };
                let out = agent.decide(&req).await.unwrap();
                if o != "c" {
                    assert!(out.allowed, "{t} of {o} is served while c is down: {out:?}");
                }
            }
            assert_eq!(agent.stats().failed_calls, 0, "no lease call failed");
        }
        agent.shutdown().await;
        println!(
            "agent routing by the ring: {by_ring}: {forwarded} lease calls forwarded between nodes"
        );
        if by_ring {
            assert_eq!(forwarded, 0.0, "every call went straight to its owner");
        } else {
            assert!(forwarded > 0.0, "the entry node forwarded what it does not own");
        }
    }
}
