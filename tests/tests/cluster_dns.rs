//! Membership from DNS, as a Kubernetes headless Service gives it: three real server
//! processes on 127.0.0.1-3 at one port, found through a real DNS server (`dnsmasq`)
//! on a loopback port. They agree on one ring; a node whose address is not listed
//! waits; a record added or removed is followed within two intervals; the ring is
//! kept while the DNS server is down, with the view's age growing.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use limiter_tests::{DnsServer, ServerProcess, free_port_on};
use tokio::time::Instant;

mod common;
use common::*;

/// The lookup interval in this test.
const INTERVAL: Duration = Duration::from_millis(1_000);
const NAME: &str = "limiter-headless.test.";

fn ip(last: u8) -> IpAddr {
    IpAddr::from([127, 0, 0, last])
}

fn spawn(n: &Node, policy: &std::path::Path, dns: &DnsServer) -> ServerProcess {
    let server = dns.addr.to_string();
    let interval = INTERVAL.as_millis().to_string();
    n.spawn(
        policy,
        "",
        &[
            ("LIMITER__CLUSTER__MEMBERSHIP", "dns"),
            ("LIMITER__CLUSTER__NODE_ID", ""),
            ("LIMITER__CLUSTER__DNS_NAME", NAME),
            ("LIMITER__CLUSTER__DNS_SERVER", &server),
            ("LIMITER__CLUSTER__DNS_INTERVAL_MS", &interval),
        ],
    )
}

/// The ids in `node`'s ring, sorted.
async fn ring_of(node: &Node) -> Vec<String> {
    match client(node.grpc)
        .await
        .topology(limiter_proto::limiter::v1::TopologyRequest::default())
        .await
    {
        Ok(t) => {
            let mut ids: Vec<String> = t.into_inner().members.into_iter().map(|m| m.id).collect();
            ids.sort();
            ids
        }
        Err(_) => Vec::new(),
    }
}

/// Waits until every one of `nodes` has exactly `want` in its ring; how long it took.
async fn converge(nodes: &[&Node], want: &[&Node], within: Duration) -> Duration {
    let started = Instant::now();
    let mut want: Vec<String> = want.iter().map(|n| n.grpc.to_string()).collect();
    want.sort();
    loop {
        let mut all = true;
        for n in nodes {
            if ring_of(n).await != want {
                all = false;
                break;
            }
        }
        if all {
            return started.elapsed();
        }
        if started.elapsed() > within {
            let mut seen = Vec::new();
            for n in nodes {
                seen.push((n.id.clone(), ring_of(n).await));
            }
            panic!("rings did not reach {want:?} within {within:?}: {seen:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_found_through_dns_share_one_ring_and_follow_the_records() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, MEMBERSHIP_POLICY).unwrap();
    let ips: Vec<IpAddr> = (1..=4).map(ip).collect();
    let port = free_port_on(&ips);
    let nodes: Vec<Node> = ips.iter().map(|ip| Node::at(SocketAddr::new(*ip, port))).collect();
    let mut dns = DnsServer::start(NAME.trim_end_matches('.'), &ips[..3]);
    let mut procs: Vec<ServerProcess> =
        nodes[..3].iter().map(|n| spawn(n, &policy, &dns)).collect();
    for p in &procs {
        p.wait_ready().await;
    }
    let (a, b, c, d) = (&nodes[0], &nodes[1], &nodes[2], &nodes[3]);
    converge(&[a, b, c], &[a, b, c], Duration::from_secs(10)).await;
    // One ring: every node names the same owner for every tenant.
    let tenants: Vec<String> = (0..300).map(|k| format!("tenant-{k}")).collect();
    let first = owners(&mut client(a.grpc).await, &tenants).await;
    for n in [b, c] {
        assert_eq!(owners(&mut client(n.grpc).await, &tenants).await, first, "{} disagrees", n.id);
    }
    for n in [a, b, c] {
        assert!(first.iter().any(|o| *o == n.grpc.to_string()), "{} owns nothing", n.id);
    }
    // A request sent anywhere is decided by its owner.
    let on_c = &tenants[first.iter().position(|o| *o == c.grpc.to_string()).unwrap()];
    assert!(client(a.grpc).await.should_allow(allow(on_c)).await.unwrap().into_inner().allowed);

    // d starts before the records list it: it waits, and nobody counts it in.
    procs.push(spawn(d, &policy, &dns));
    tokio::time::sleep(INTERVAL * 2).await;
    assert_eq!(procs[3].status("/readyz").await, Some(503), "d is not ready while unlisted");
    assert_eq!(ring_of(a).await.len(), 3);

    // Its record is added: everyone has it within two intervals, and d is ready.
    dns.set(&ips);
    let took = converge(&[a, b, c, d], &[a, b, c, d], INTERVAL * 2).await;
    println!("a record added was followed in {took:?} (interval {INTERVAL:?})");
    procs[3].wait_ready().await;

    // A tenant of c's has used 5 of its 1000.
    let owners_before = owners(&mut client(a.grpc).await, &tenants).await;
    let of_c =
        tenants[owners_before.iter().rposition(|o| *o == c.grpc.to_string()).unwrap()].clone();
    assert_ne!(&of_c, on_c, "a tenant of c's not asked for before");
    for _ in 0..5 {
        assert!(
            client(c.grpc).await.should_allow(allow(&of_c)).await.unwrap().into_inner().allowed
        );
    }

    // c's record is removed (c still runs, as a terminating pod does): c drains, and
    // every ring drops it within two intervals, c's own included.
    dns.set(&[ips[0], ips[1], ips[3]]);
    let took = converge(&[a, b, c, d], &[a, b, d], INTERVAL * 2).await;
    println!("a record removed was followed in {took:?} (interval {INTERVAL:?})");
    assert_eq!(procs[2].status("/readyz").await, Some(503), "c drains once its record is gone");
    // Its tenants were handed over, counts and all: no fence, nothing begun afresh.
    let r = client(a.grpc).await.should_allow(allow(&of_c)).await.unwrap().into_inner();
    assert!(r.allowed, "c's tenant is served by its new owner at once: {r:?}");
    assert_eq!(r.remaining, 1000 - 6, "the count moved with the tenant");
    // The tenant asked for at the start kept its count too (1 used).
    let r = client(b.grpc).await.should_allow(allow(on_c)).await.unwrap().into_inner();
    assert!(r.allowed && r.remaining == 1000 - 2, "{r:?}");

    // The DNS server stops: the rings stay as they were, the view's age grows.
    dns.stop();
    tokio::time::sleep(INTERVAL * 3).await;
    converge(&[a, b, d], &[a, b, d], Duration::ZERO).await;
    let owners_now = owners(&mut client(b.grpc).await, &tenants).await;
    let on_d = &tenants[owners_now.iter().position(|o| *o == d.grpc.to_string()).unwrap()];
    assert!(client(a.grpc).await.should_allow(allow(on_d)).await.unwrap().into_inner().allowed);
    let age = procs[0].metric("limiter_membership_view_age_seconds", &[]).await;
    println!("DNS down for {:?}: rings kept, view age {age:.2} s", INTERVAL * 3);
    assert!(age >= 2.0, "the view's age is exported: {age}");
    assert_eq!(procs[0].status("/readyz").await, Some(200), "still ready on the last good ring");

    // Back: the age falls again.
    dns.restart();
    tokio::time::sleep(INTERVAL * 2).await;
    let age = procs[0].metric("limiter_membership_view_age_seconds", &[]).await;
    assert!(age < 2.0, "the view is fresh again: {age}");
}
