//! Planned and unplanned changes under load, with three real server processes: a
//! rolling restart (SIGTERM, wait, start) of every node, and a node killed with
//! SIGKILL whose tenants are fenced, then served again by their new owners.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use parking_lot::Mutex;
use tokio::time::Instant;
use tonic::transport::Channel;

#[path = "../../limiter-server/tests/common/redis.rs"]
mod redis_proc;

mod common;
use common::*;
use redis_proc::RedisServer;

/// A client that knows every node and tries the next one when a node does not
/// answer (what a gateway behind a load balancer does): `None` when none answered.
async fn ask(
    clients: &[RateLimiterClient<Channel>],
    first: usize,
    req: &pb::ShouldAllowRequest,
) -> Option<pb::ShouldAllowResponse> {
    for k in 0..clients.len() {
        let mut c = clients[(first + k) % clients.len()].clone();
        if let Ok(r) = c.should_allow(req.clone()).await {
            return Some(r.into_inner());
        }
    }
    None
}

const ROLLING: &str = r"
version: 1
lease: { ttl: 1s }
on_limiter_failure: { mode: fail_closed }
unknown_tenants: use_default
routes:
  /r: {}
tenants:
  default:
    limit: { algorithm: sliding_log, limit: 50, window: 1h }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_under_load_fails_nothing_and_overshoots_nothing() {
    rolling_restart(Members::Static).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_with_the_redis_registry_fails_nothing_and_overshoots_nothing() {
    let redis = RedisServer::start();
    rolling_restart(Members::Registry(&redis.url())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_restart_with_dns_membership_fails_nothing_and_overshoots_nothing() {
    rolling_restart(Members::Dns).await;
}

/// Where a rolling restart's nodes find each other.
#[derive(Debug, Clone, Copy)]
enum Members<'a> {
    Static,
    /// A Redis registry at this URL.
    Registry(&'a str),
    /// A DNS server listing 127.0.0.1-3, the nodes sharing one port; a node's record
    /// is removed while it restarts.
    Dns,
}

/// Restarts each of three nodes in turn (SIGTERM, wait, start) under steady load,
/// finding each other as `members` says.
async fn rolling_restart(members: Members<'_>) {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, ROLLING).unwrap();
    let ips: Vec<std::net::IpAddr> =
        (1..=3).map(|k| std::net::IpAddr::from([127, 0, 0, k])).collect();
    let nodes: Vec<Node> = match members {
        Members::Dns => {
            let port = limiter_tests::free_port_on(&ips);
            ips.iter().map(|ip| Node::at(std::net::SocketAddr::new(*ip, port))).collect()
        }
        _ => ["a", "b", "c"].iter().map(|id| Node::new(id)).collect(),
    };
    let mut dns = matches!(members, Members::Dns)
        .then(|| limiter_tests::DnsServer::start("limiter-headless.test", &ips));
    let dns_server = dns.as_ref().map(|d| d.addr.to_string()).unwrap_or_default();
    let (peers, extra) = match members {
        Members::Static => (Node::static_peers(&nodes), Vec::new()),
        Members::Registry(url) => (
            String::new(),
            vec![
                ("LIMITER__CLUSTER__MEMBERSHIP", "redis"),
                ("LIMITER__CLUSTER__REGISTRY_URL", url),
                ("LIMITER__CLUSTER__REGISTRY_TTL_MS", "1000"),
                ("LIMITER__CLUSTER__REGISTRY_POLL_MS", "100"),
            ],
        ),
        Members::Dns => (
            String::new(),
            vec![
                ("LIMITER__CLUSTER__MEMBERSHIP", "dns"),
                ("LIMITER__CLUSTER__NODE_ID", ""),
                ("LIMITER__CLUSTER__DNS_NAME", "limiter-headless.test."),
                ("LIMITER__CLUSTER__DNS_SERVER", dns_server.as_str()),
                ("LIMITER__CLUSTER__DNS_INTERVAL_MS", "500"),
            ],
        ),
    };
    let mut procs: Vec<_> = nodes.iter().map(|n| n.spawn(&policy, &peers, &extra)).collect();
    for (p, n) in procs.iter().zip(&nodes) {
        p.wait_ready().await;
        wait_members(&mut client(n.grpc).await, 3).await;
    }
    let mut clients = Vec::new();
    for n in &nodes {
        clients.push(client(n.grpc).await);
    }
    let tenants: Vec<String> = (0..20).map(|k| format!("tenant-{k}")).collect();
    let admitted: Arc<Mutex<HashMap<String, u64>>> = Arc::default();
    let (sent, failed, fallback) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    // 200 requests per second over 20 tenants, 4 workers, every node in turn.
    let mut load = Vec::new();
    for w in 0..4 {
        let (clients, tenants, admitted) = (clients.clone(), tenants.clone(), admitted.clone());
        let (sent, failed, fallback, stop) =
            (sent.clone(), failed.clone(), fallback.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut i = w;
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                i += 4;
                let tenant = &tenants[i % tenants.len()];
                let r = ask(&clients, i % 3, &allow(tenant)).await;
                sent.fetch_add(1, Ordering::Relaxed);
                match r {
                    None => {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                    Some(r) => {
                        if r.allowed {
                            *admitted.lock().entry(tenant.clone()).or_default() += 1;
                        }
                        if r.reason == pb::Reason::LimiterUnavailable as i32 {
                            fallback.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            }
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    for i in 0..3 {
        let started = Instant::now();
        // As Kubernetes does: a terminating pod's record goes as it is told to stop,
        // and its replacement's comes with it.
        if let Some(d) = dns.as_mut() {
            let others: Vec<std::net::IpAddr> =
                ips.iter().enumerate().filter(|(k, _)| *k != i).map(|(_, ip)| *ip).collect();
            d.set(&others);
        }
        procs[i].terminate();
        assert!(
            procs[i].wait_exit(Duration::from_secs(10)).await,
            "node {} did not stop",
            nodes[i].id
        );
        procs[i] = nodes[i].spawn(&policy, &peers, &extra);
        if let Some(d) = dns.as_mut() {
            d.set(&ips);
        }
        procs[i].wait_ready().await;
        for n in &nodes {
            wait_members(&mut client(n.grpc).await, 3).await;
        }
        println!("node {} restarted in {:?}", nodes[i].id, started.elapsed());
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    let admitted = admitted.lock().clone();
    let total: u64 = admitted.values().sum();
    println!(
        "rolling restart ({}): {} requests, {} failed, {} answered by the failure policy, {total} admitted \
         (at most {} allowed); per tenant: {:?}",
        match members {
            Members::Static => "static peers",
            Members::Registry(_) => "Redis registry",
            Members::Dns => "DNS",
        },
        sent.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        fallback.load(Ordering::Relaxed),
        50 * tenants.len(),
        admitted.values().collect::<Vec<_>>()
    );
    assert_eq!(failed.load(Ordering::Relaxed), 0, "every request got an answer");
    for (t, n) in &admitted {
        assert!(*n <= 50, "{t} admitted {n} of 50: overshoot");
    }
    assert!(total >= 50 * tenants.len() as u64 * 9 / 10, "the limits were used: {total}");
}

/// When a request was sent, whether on the fail-open route, whether admitted, and
/// the reason. (Sent after the kill, it cannot have been decided by the dead node.)
type Answer = (Duration, bool, bool, i32);

const KILL: &str = r"
version: 1
lease: { ttl: 1s }
unknown_tenants: use_default
routes:
  /open:
    on_limiter_failure: { mode: fail_open, emergency_ceiling: 10/s }
  /closed:
    on_limiter_failure: { mode: fail_closed }
tenants:
  default:
    limit: { algorithm: token_bucket, rate: 20/s, burst: 20 }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_tenants_are_fenced_then_served_by_their_new_owners() {
    killed_node(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_nodes_tenants_are_served_from_their_replicas_once_it_is_found_dead() {
    killed_node(true).await;
}

/// Kills one of three nodes under load on a fail-open and a fail-closed route: with
/// `replication`, its tenants are served from their replicas once it is found dead;
/// without, they are fenced first.
async fn killed_node(replication: bool) {
    let dir = tempfile::tempdir().unwrap();
    // Fence: the longest lease or slice TTL (1 s leases, 2 s slices): 2 s.
    let extra = [
        ("LIMITER__CLUSTER__SLICE_TTL_MS", "2000"),
        ("LIMITER__CLUSTER__REPLICATION", if replication { "true" } else { "false" }),
    ];
    let (_, nodes, mut procs) = start_nodes(dir.path(), KILL, &["a", "b", "c"], &extra).await;
    let mut a = client(nodes[0].grpc).await;
    let tenants: Vec<String> = (0..30).map(|k| format!("tenant-{k}")).collect();
    let owners = owners(&mut a, &tenants).await;
    let victims: Vec<String> =
        tenants.iter().zip(&owners).filter(|(_, o)| *o == "c").map(|(t, _)| t.clone()).collect();
    assert!(!victims.is_empty());
    let survivors = vec![client(nodes[0].grpc).await, client(nodes[1].grpc).await];

    // Each victim tenant is asked 50 times a second on each route (over its 20/s).
    let start = Instant::now();
    let killed_at = Duration::from_secs(3);
    let log: Arc<Mutex<Vec<Answer>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for (w, tenant) in victims.iter().enumerate() {
        for open in [true, false] {
            let (survivors, log, stop, tenant) =
                (survivors.clone(), log.clone(), stop.clone(), tenant.clone());
            load.push(tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(20));
                let mut i = w;
                let route = if open { "/open" } else { "/closed" };
                while !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    i += 1;
                    let req = pb::ShouldAllowRequest {
                        tenant: tenant.clone(),
                        route: route.to_owned(),
                        ..Default::default()
                    };
                    let sent = start.elapsed();
                    let r = ask(&survivors, i % 2, &req).await.expect("a survivor answers");
                    log.lock().push((sent, open, r.allowed, r.reason));
                }
            }));
        }
    }
    tokio::time::sleep(killed_at).await;
    procs[2].kill();
    // Counted from when the process is gone.
    let killed_at = start.elapsed();
    tokio::time::sleep(Duration::from_secs(5)).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    let log = log.lock().clone();
    // Detection: 3 failed checks 100 ms apart, plus one interval of slack.
    let detection = Duration::from_millis(400);
    // What the tenants' buckets admitted over the whole run (both routes share the
    // tenant's 20/s, burst 20; failure-policy admissions apart): replicas keep the
    // counts, so the new owner starts from them, less what the dead owner decided in
    // its last replication round (README's bound: the rate times 100 ms, 2 units).
    let span = log.iter().map(|(t, ..)| *t).max().unwrap().as_secs_f64() + 0.1;
    let unavailable = pb::Reason::LimiterUnavailable as i32;
    let by_limits =
        log.iter().filter(|(_, _, allowed, reason)| *allowed && *reason != unavailable).count();
    let bucket_bound = victims.len() as f64 * (20.0 + 20.0 * span + 2.0);
    let recovered = log
        .iter()
        .filter(|(t, open, allowed, _)| *t > killed_at && !*open && *allowed)
        .map(|(t, ..)| *t - killed_at)
        .min()
        .expect("the closed route is served again");
    if replication {
        let rejected = log
            .iter()
            .filter(|(t, open, allowed, reason)| {
                *t > killed_at
                    && !*open
                    && !*allowed
                    && *reason == pb::Reason::LimiterUnavailable as i32
            })
            .count();
        println!(
            "kill -9 of c ({} tenants) with replicas: served again after {recovered:?} \
             (detection {detection:?}, no fence); {rejected} closed-route requests failed \
             closed meanwhile; the limits admitted {by_limits} over {span:.1} s (the buckets \
             allow {bucket_bound:.0})",
            victims.len()
        );
        assert!(recovered < Duration::from_secs(2), "served only after {recovered:?}");
        assert!(by_limits as f64 <= bucket_bound, "{by_limits} > {bucket_bound}");
        let _ = procs;
        return;
    }
    let fence = Duration::from_secs(2);
    let closed_meanwhile = log
        .iter()
        .filter(|(t, open, allowed, _)| {
            *t > killed_at && *t < killed_at + fence && !*open && *allowed
        })
        .count();
    // Until the fence ends (it starts only at detection), every decision for these
    // tenants is the failure policy's.
    let open_meanwhile = log
        .iter()
        .filter(|(t, open, allowed, _)| {
            *t > killed_at && *t < killed_at + fence && *open && *allowed
        })
        .count() as f64;
    // Documented bound: every node that decides by the failure policy admits at
    // most its emergency ceiling (10/s, burst 10) for the route.
    let bound = 2.0 * (10.0 * fence.as_secs_f64() + 10.0);
    let normal = victims.len() as f64 * 20.0 * fence.as_secs_f64();
    println!(
        "kill -9 of c ({} tenants): served again after {recovered:?} (fence {fence:?} + detection); \
         fail_closed admitted {closed_meanwhile} meanwhile; fail_open admitted {open_meanwhile} \
         in the fence's first {fence:?} (bound {bound:.0}; their own limits would have allowed {normal:.0})",
        victims.len()
    );
    assert_eq!(closed_meanwhile, 0, "a fail_closed route admitted during the fence");
    assert!(recovered >= fence, "served before the fence ended: {recovered:?}");
    assert!(
        recovered <= fence + detection + Duration::from_millis(1_000),
        "recovery took {recovered:?}"
    );
    assert!(open_meanwhile <= bound, "fail_open admitted {open_meanwhile} > {bound}");
    let _ = procs;
}

const LEASES: &str = r"
version: 1
lease: { ttl: 5s, max_batch: 40 }
unknown_tenants: use_default
routes:
  /r: {}
tenants:
  default:
    limit: { algorithm: sliding_log, limit: 100, window: 1h }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_owner_hands_its_agents_leases_to_the_next_owner() {
    use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest};
    let dir = tempfile::tempdir().unwrap();
    let (_, nodes, mut procs) = start_nodes(dir.path(), LEASES, &["a", "b"], &[]).await;
    let mut a = client(nodes[0].grpc).await;
    let tenants: Vec<String> = (0..50).map(|k| format!("tenant-{k}")).collect();
    let owners = owners(&mut a, &tenants).await;
    let tenant = tenants.iter().zip(&owners).find(|(_, o)| *o == "b").unwrap().0.clone();
    // An agent talking to a leases units of b's tenant (forwarded to b).
    let agent = Agent::new(AgentConfig::new(format!("http://{}", nodes[0].grpc), "gw")).unwrap();
    let req = AgentRequest { tenant: &tenant, route: "/r", key: None, cost: 1 };
    for _ in 0..3 {
        assert!(agent.decide(&req).await.unwrap().allowed);
    }
    // A new key's first grant may be just what these three spend (its tenant's demand
    // here is unknown); their pace asks for more at the agent's next round.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let probe = pb::ShouldAllowRequest { dry_run: true, ..allow(&tenant) };
    let held = a.should_allow(probe.clone()).await.unwrap().into_inner().remaining;
    assert!(held < 97, "the agent holds a lease beyond what it spent: {held} left");
    // b drains: its counters and the agent's lease go to a.
    procs[1].terminate();
    assert!(procs[1].wait_exit(Duration::from_secs(10)).await);
    wait_members(&mut a, 1).await;
    // The agent gives back what it did not spend; a settles the lease b granted.
    agent.shutdown().await;
    let left = a.should_allow(probe).await.unwrap().into_inner().remaining;
    println!("lease handed over: {held} left while the agent held it, {left} after it returned it");
    assert_eq!(left, 97, "exactly the 3 spent units are gone");
    // a refunded the lease b granted (the book's totals are published every 500 ms).
    tokio::time::sleep(Duration::from_millis(700)).await;
    let returned = procs[0].metric("limiter_lease_units_total", &["returned"]).await;
    assert_eq!(returned, f64::from(u32::try_from(97 - held).unwrap()), "a settled b's lease");
}
