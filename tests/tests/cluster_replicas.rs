//! An owner's death loses no counters: three real server processes, tenants limited
//! per hour (a fixed window, a sliding log and a token bucket with a slow refill),
//! requests spread over the nodes (native and Envoy), one agent leasing; a node is
//! killed with SIGKILL half way. With replicas, every tenant's admissions over the
//! whole run stay within its hourly allowance (per-request decisions: plus what the
//! dead owner decided in its last replication round; leases: nothing); without them,
//! the killed node's tenants get a second allowance once their fence ends.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use limiter_proto::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use limiter_tests::ServerProcess;
use parking_lot::Mutex;
use tonic::transport::Channel;

mod common;
use common::*;

/// Each tenant's hourly allowance.
const HOURLY: u64 = 50;
/// Requests per second offered per tenant.
const RATE: u64 = 10;
/// Tenants decided per request, by algorithm, and tenants an agent leases for.
const PER_REQUEST: &[&str] = &[
    "fw-0", "fw-1", "fw-2", "fw-3", "sl-0", "sl-1", "sl-2", "sl-3", "tb-0", "tb-1", "tb-2", "tb-3",
];
const LEASED: &[&str] = &["lease-fw-0", "lease-fw-1", "lease-tb-0", "lease-tb-1"];

fn policy() -> String {
    let spec = |t: &str| {
        if t.contains("fw") {
            format!("{{ algorithm: fixed_window, limit: {HOURLY}, window: 1h }}")
        } else if t.contains("sl") {
            format!("{{ algorithm: sliding_log, limit: {HOURLY}, window: 1h }}")
        } else {
            format!("{{ algorithm: token_bucket, rate: {HOURLY}/h, burst: {HOURLY} }}")
        }
    };
    let tenants: String = PER_REQUEST
        .iter()
        .chain(LEASED)
        .map(|t| format!("  {t}:\n    limit: {}\n", spec(t)))
        .collect();
    format!(
        "version: 1\nlease: {{ ttl: 2s, max_batch: 5 }}\non_limiter_failure: {{ mode: fail_closed }}\n\
         unknown_tenants: reject\nroutes:\n  /r: {{}}\ntenants:\n{tenants}"
    )
}

/// Hour windows (of the Unix clock) a span of `secs` from now touches: a fixed
/// window's allowance is one per window.
fn hours_touched(secs: u64) -> u64 {
    use limiter_core::clock::Clock as _;
    let now = limiter_core::clock::MonotonicClock::new().now() / 1_000_000_000;
    (now + secs) / 3_600 - now / 3_600 + 1
}

/// What each tenant may admit over a run of `secs` by its own limit.
fn allowance(tenant: &str, secs: u64) -> u64 {
    if tenant.contains("fw") {
        HOURLY * hours_touched(secs)
    } else if tenant.contains("tb") {
        // The burst plus the refill over the run (with a second of slack for the
        // run's start and end).
        HOURLY + HOURLY * (secs + 1) / 3_600
    } else {
        HOURLY
    }
}

async fn envoy(addr: std::net::SocketAddr) -> RateLimitServiceClient<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    RateLimitServiceClient::new(ch)
}

/// Asks the nodes in turn from `first` until one answers (a gateway behind a load
/// balancer): whether admitted, `None` when none answered.
async fn ask(
    native: &[RateLimiterClient<Channel>],
    rls: &[RateLimitServiceClient<Channel>],
    first: usize,
    tenant: &str,
    use_envoy: bool,
) -> Option<bool> {
    for k in 0..native.len() {
        let i = (first + k) % native.len();
        if use_envoy {
            let req = RateLimitRequest {
                domain: tenant.to_owned(),
                descriptors: vec![RateLimitDescriptor {
                    entries: vec![Entry { key: "route".into(), value: "/r".into() }],
                    limit: None,
                    hits_addend: None,
                }],
                hits_addend: 1,
            };
            if let Ok(r) = rls[i].clone().should_rate_limit(req).await {
                return Some(r.into_inner().overall_code() == Code::Ok);
            }
        } else if let Ok(r) = native[i].clone().should_allow(allow(tenant)).await {
            return Some(r.into_inner().allowed);
        }
    }
    None
}

/// Admitted per tenant.
type Admitted = Arc<Mutex<HashMap<String, u64>>>;

/// Offers every tenant `RATE` requests per second until `stop`: per-request tenants
/// over every node in turn (native and Envoy alternately), leased ones through an
/// agent on node `agent_at`.
fn offer(
    nodes: &[Node],
    agent_at: usize,
    admitted: &Admitted,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut load = Vec::new();
    let addrs: Vec<_> = nodes.iter().map(|n| n.grpc).collect();
    for (w, tenant) in PER_REQUEST.iter().enumerate() {
        let (addrs, admitted, stop) = (addrs.clone(), admitted.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut native = Vec::new();
            let mut rls = Vec::new();
            for a in &addrs {
                native.push(client(*a).await);
                rls.push(envoy(*a).await);
            }
            let mut tick = tokio::time::interval(Duration::from_millis(1_000 / RATE));
            let mut i = w;
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                i += 1;
                if ask(&native, &rls, i % addrs.len(), tenant, i % 2 == 0).await == Some(true) {
                    *admitted.lock().entry((*tenant).to_owned()).or_default() += 1;
                }
            }
        }));
    }
    let mut config = limiter_gateway_agent::AgentConfig::new(
        format!("http://{}", nodes[agent_at].grpc),
        "replica-test-gateway",
    );
    config.rpc_timeout = Duration::from_millis(500);
    let agent = Arc::new(limiter_gateway_agent::Agent::new(config).unwrap());
    for tenant in LEASED {
        let (agent, admitted, stop) = (agent.clone(), admitted.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(1_000 / RATE));
            let req =
                limiter_gateway_agent::AgentRequest { tenant, route: "/r", key: None, cost: 1 };
            while !stop.load(Ordering::Relaxed) {
                tick.tick().await;
                if agent.decide(&req).await.is_ok_and(|o| o.allowed) {
                    *admitted.lock().entry((*tenant).to_owned()).or_default() += 1;
                }
            }
        }));
    }
    load
}

/// The node owning the most tenants (as node 0 sees the ring).
async fn busiest(nodes: &[Node]) -> usize {
    let tenants: Vec<String> = PER_REQUEST.iter().chain(LEASED).map(|t| (*t).to_owned()).collect();
    let owners = owners(&mut client(nodes[0].grpc).await, &tenants).await;
    (0..nodes.len()).max_by_key(|i| owners.iter().filter(|o| **o == nodes[*i].id).count()).unwrap()
}

/// Admissions beyond each tenant's allowance over a run of `secs`: per-request
/// tenants, leased tenants.
fn excess(admitted: &HashMap<String, u64>, secs: u64) -> (u64, u64, Vec<String>) {
    let mut per_request = 0;
    let mut leased = 0;
    let mut lines = Vec::new();
    for t in PER_REQUEST.iter().chain(LEASED) {
        let got = admitted.get(*t).copied().unwrap_or(0);
        let over = got.saturating_sub(allowance(t, secs));
        if LEASED.contains(t) {
            leased += over;
        } else {
            per_request += over;
        }
        lines.push(format!("{t}: {got}"));
    }
    (per_request, leased, lines)
}

/// The most a per-request tenant may admit beyond its allowance per owner death: what
/// its owner decided after its last acknowledged replication round (an interval of
/// 50 ms and the round's own round trip: 100 ms at `RATE`, rounded up).
const PER_DEATH: u64 = RATE.div_ceil(10);

/// One run: start three nodes (replication on or off), offer load for `secs`, kill
/// the busiest node at `kill_at`; returns the admissions per tenant.
async fn kill_once(replication: bool, secs: u64, kill_at: Duration) -> HashMap<String, u64> {
    let dir = tempfile::tempdir().unwrap();
    let on = if replication { "true" } else { "false" };
    let extra = [("LIMITER__CLUSTER__REPLICATION", on), ("LIMITER__CLUSTER__FENCE_MS", "1000")];
    let (_, nodes, mut procs) = start_nodes(dir.path(), &policy(), &["a", "b", "c"], &extra).await;
    let victim = busiest(&nodes).await;
    let agent_at = (victim + 1) % nodes.len();
    let admitted: Admitted = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let load = offer(&nodes, agent_at, &admitted, &stop);
    tokio::time::sleep(kill_at).await;
    procs[victim].kill();
    tokio::time::sleep(Duration::from_secs(secs) - kill_at).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    drop(procs);
    admitted.lock().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_owner_gives_its_tenants_no_second_allowance() {
    let secs = 8;
    let kill_at = Duration::from_secs(3);
    // Without replicas (the check can fail): the killed node's tenants start afresh
    // once their fence (1 s) ends.
    let off = kill_once(false, secs, kill_at).await;
    let (off_req, off_leased, off_lines) = excess(&off, secs);
    println!(
        "replication off: {} over the hourly allowances ({off_lines:?})",
        off_req + off_leased
    );
    assert!(off_req + off_leased > 0, "without replicas a killed owner's tenants start afresh");
    let on = kill_once(true, secs, kill_at).await;
    let (on_req, on_leased, on_lines) = excess(&on, secs);
    println!(
        "replication on: {on_req} over on per-request tenants (bound {}), {on_leased} on leased \
         ones (bound 0) ({on_lines:?})",
        PER_DEATH * PER_REQUEST.len() as u64
    );
    for t in PER_REQUEST {
        let got = on.get(*t).copied().unwrap_or(0);
        assert!(got <= allowance(t, secs) + PER_DEATH, "{t}: {got} admitted");
        // Exact when healthy: the allowance was used (the run offers 80).
        assert!(got + PER_DEATH >= allowance(t, secs).min(HOURLY), "{t}: only {got} admitted");
    }
    assert_eq!(on_leased, 0, "leases are replicated before they are granted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_node_killed_once_and_restarted_within_the_hour_keeps_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    let extra = [("LIMITER__CLUSTER__FENCE_MS", "1000")];
    let policy = policy();
    let (file, nodes, mut procs) = start_nodes(dir.path(), &policy, &["a", "b", "c"], &extra).await;
    let peers = Node::static_peers(&nodes);
    let admitted: Admitted = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    // The agent's node dies too: it reaches the others through its own node only,
    // and decides by the failure policy (closed) while its node is down.
    let load = offer(&nodes, 0, &admitted, &stop);
    let started = tokio::time::Instant::now();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    for i in 0..nodes.len() {
        procs[i].kill();
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let back: ServerProcess = nodes[i].spawn(&file, &peers, &extra);
        back.wait_ready().await;
        procs[i] = back;
        for n in &nodes {
            wait_members(&mut client(n.grpc).await, nodes.len()).await;
        }
        // Its tenants handed back and their replicas placed again.
        tokio::time::sleep(Duration::from_millis(1_000)).await;
    }
    let secs = started.elapsed().as_secs() + 1;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    let admitted = admitted.lock().clone();
    let (per_request, leased, lines) = excess(&admitted, secs);
    println!(
        "every node killed once in {secs} s: {per_request} over on per-request tenants (bound {} \
         each), {leased} on leased ones ({lines:?})",
        3 * PER_DEATH
    );
    for t in PER_REQUEST.iter().chain(LEASED) {
        let got = admitted.get(*t).copied().unwrap_or(0);
        let bound = if LEASED.contains(t) { 0 } else { 3 * PER_DEATH };
        assert!(got <= allowance(t, secs) + bound, "{t}: {got} admitted over {secs} s");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_and_its_replica_killed_together_count_their_tenants_reset() {
    let dir = tempfile::tempdir().unwrap();
    let extra = [("LIMITER__CLUSTER__FENCE_MS", "500")];
    let (_, nodes, mut procs) = start_nodes(dir.path(), &policy(), &["a", "b", "c"], &extra).await;
    let mut a = client(nodes[0].grpc).await;
    let tenants: Vec<String> = PER_REQUEST.iter().map(|t| (*t).to_owned()).collect();
    let owners = owners(&mut a, &tenants).await;
    // Use part of every tenant's allowance, so that a tenant that begins afresh shows.
    for t in &tenants {
        for _ in 0..5 {
            assert!(a.should_allow(allow(t)).await.unwrap().into_inner().allowed);
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = procs[0].metric("limiter_state_resets_total", &[]).await;
    procs[1].kill();
    procs[2].kill();
    wait_members(&mut a, 1).await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let mut remaining = HashMap::new();
    for t in &tenants {
        let probe = pb::ShouldAllowRequest { dry_run: true, ..allow(t) };
        let r = a.should_allow(probe).await.unwrap().into_inner();
        remaining.insert(t.clone(), r.remaining);
    }
    let after = procs[0].metric("limiter_state_resets_total", &[]).await;
    // The tenants whose owner and replica both died: neither b nor c is left to tell.
    let ring = limiter_core::ring::Ring::new(
        1,
        nodes
            .iter()
            .map(|n| limiter_core::ring::Member {
                id: n.id.as_str().into(),
                address: n.grpc.to_string().into(),
                weight: 1,
            })
            .collect(),
    );
    let lost_both: Vec<&String> = tenants
        .iter()
        .zip(&owners)
        .filter(|(t, o)| *o != "a" && ring.owner_without(t, o).is_some_and(|m| &*m.id != "a"))
        .map(|(t, _)| t)
        .collect();
    let moved = owners.iter().filter(|o| *o != "a").count();
    println!(
        "b and c killed together: {} tenants lost with their replicas, {} moved to a; \
         limiter_state_resets_total went from {before} to {after}; remaining {remaining:?}",
        lost_both.len(),
        moved
    );
    assert!(!lost_both.is_empty(), "some tenant had both its owner and its replica on b and c");
    let counted = after - before;
    assert!(counted >= lost_both.len() as f64, "{counted} resets counted");
    assert!(counted <= moved as f64, "{counted} resets counted of {moved} tenants moved");
    for (t, o) in tenants.iter().zip(&owners).filter(|(_, o)| *o != "a") {
        if lost_both.contains(&t) {
            assert!(remaining[t] >= HOURLY - 1, "{t} began afresh: {}", remaining[t]);
        } else if counted == lost_both.len() as f64 {
            // Taken over from the replica here: it kept its 5 units used.
            assert!(remaining[t] <= HOURLY - 5, "{t} (owner {o}) kept its count: {}", remaining[t]);
        }
    }
}
