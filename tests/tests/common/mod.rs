//! Helpers shared by the cluster tests: nodes on loopback ports, gRPC clients and
//! topology queries.

#![allow(dead_code)] // each test binary uses a different part

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use limiter_tests::{ServerProcess, free_addr};
use tonic::transport::Channel;

/// Every tenant 1,000 an hour on route `/r`, leases of 1 s: the membership tests'
/// policy, where only who owns a tenant matters.
pub(crate) const MEMBERSHIP_POLICY: &str = r"
version: 1
lease: { ttl: 1s }
unknown_tenants: use_default
routes:
  /r: {}
tenants:
  default:
    limit: { algorithm: fixed_window, limit: 1000, window: 1h }
";

/// The server binary built for these tests.
pub(crate) fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_limiter-server-under-test"))
}

/// One node's identity and ports (kept across restarts).
#[derive(Debug, Clone)]
pub(crate) struct Node {
    pub id: String,
    pub grpc: SocketAddr,
    pub admin: SocketAddr,
}

impl Node {
    pub(crate) fn new(id: &str) -> Self {
        Self { id: id.to_owned(), grpc: free_addr(), admin: free_addr() }
    }

    /// A node whose gRPC port is at `grpc` (nodes found through DNS share one port
    /// on addresses of their own).
    pub(crate) fn at(grpc: SocketAddr) -> Self {
        Self { id: grpc.to_string(), grpc, admin: free_addr() }
    }

    /// `cluster.peers` naming every node.
    pub(crate) fn static_peers(nodes: &[Node]) -> String {
        nodes.iter().map(|n| format!("{}={}", n.id, n.grpc)).collect::<Vec<_>>().join(",")
    }

    /// Starts this node with static membership over `peers`, plus `extra` settings.
    pub(crate) fn spawn(
        &self,
        policy: &Path,
        peers: &str,
        extra: &[(&str, &str)],
    ) -> ServerProcess {
        let mut env = vec![
            ("LIMITER__CLUSTER__MEMBERSHIP".to_owned(), "static".to_owned()),
            ("LIMITER__CLUSTER__PEERS".to_owned(), peers.to_owned()),
            ("LIMITER__CLUSTER__NODE_ID".to_owned(), self.id.clone()),
            ("LIMITER__CLUSTER__HEALTH_INTERVAL_MS".to_owned(), "100".to_owned()),
            ("LIMITER__LIMITS__MAX_BATCH".to_owned(), "10000".to_owned()),
            // Loopback test clusters without TLS say so explicitly.
            ("LIMITER__CLUSTER__INSECURE_PEERS".to_owned(), "true".to_owned()),
        ];
        for (k, v) in extra {
            env.retain(|(x, _)| x != k);
            env.push(((*k).to_owned(), (*v).to_owned()));
        }
        ServerProcess::spawn(bin(), policy, self.grpc, self.admin, 500, &env)
    }
}

/// A client of the node at `addr`.
pub(crate) async fn client(addr: SocketAddr) -> RateLimiterClient<Channel> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_millis(500))
        .timeout(Duration::from_secs(5))
        .connect_lazy();
    RateLimiterClient::new(ch)
}

/// Waits until the node sees `n` members (and is ready).
pub(crate) async fn wait_members(
    c: &mut RateLimiterClient<Channel>,
    n: usize,
) -> pb::TopologyResponse {
    match members(c, n).await {
        Ok(t) => t,
        Err(e) => panic!("the ring did not reach {n} members: {e}"),
    }
}

/// Waits up to 15 s until the node sees `n` members (and is ready); the last answer
/// or error otherwise.
async fn members(
    c: &mut RateLimiterClient<Channel>,
    n: usize,
) -> Result<pb::TopologyResponse, String> {
    let mut last = "no answer".to_owned();
    for _ in 0..300 {
        match c.topology(pb::TopologyRequest::default()).await {
            Ok(t) => {
                let t = t.into_inner();
                if t.members.len() == n && t.ready {
                    return Ok(t);
                }
                last = format!("{t:?}");
            }
            Err(e) => last = format!("{}: {}", e.code(), e.message()),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(last)
}

/// The owners of `tenants` as the node sees them.
pub(crate) async fn owners(c: &mut RateLimiterClient<Channel>, tenants: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(tenants.len());
    for chunk in tenants.chunks(5_000) {
        let t =
            c.topology(pb::TopologyRequest { tenants: chunk.to_vec() }).await.unwrap().into_inner();
        out.extend(t.owners);
    }
    out
}

/// A request of cost 1 on route `/r`.
pub(crate) fn allow(tenant: &str) -> pb::ShouldAllowRequest {
    pb::ShouldAllowRequest {
        tenant: tenant.to_owned(),
        route: "/r".to_owned(),
        ..Default::default()
    }
}

/// Writes `policy` to a file in `dir`, starts nodes `ids` with static membership over
/// all of them (plus `extra` settings), and waits until each is ready and sees them all.
pub(crate) async fn start_nodes(
    dir: &Path,
    policy: &str,
    ids: &[&str],
    extra: &[(&str, &str)],
) -> (std::path::PathBuf, Vec<Node>, Vec<ServerProcess>) {
    let file = dir.join("policies.yaml");
    std::fs::write(&file, policy).unwrap();
    let (nodes, procs) = start_first(&file, ids, ids.len(), extra).await;
    (file, nodes, procs)
}

/// Makes nodes `ids` with static membership over all of them (plus `extra`
/// settings), starts the first `up` of them on `policy`, and waits until each started
/// one is ready and sees the `up` members.
pub(crate) async fn start_first(
    policy: &Path,
    ids: &[&str],
    up: usize,
    extra: &[(&str, &str)],
) -> (Vec<Node>, Vec<ServerProcess>) {
    // A port chosen free may be taken by another test before the node binds it (the
    // node then exits, and its admin port may even answer for another test's node):
    // the cluster starts again on new ports, three times at most.
    'again: for _ in 0..3 {
        let nodes: Vec<Node> = ids.iter().map(|id| Node::new(id)).collect();
        let peers = Node::static_peers(&nodes);
        let mut procs: Vec<ServerProcess> =
            nodes[..up].iter().map(|n| n.spawn(policy, &peers, extra)).collect();
        if !all_up(&mut procs).await {
            continue;
        }
        for (i, n) in nodes[..up].iter().enumerate() {
            procs[i].wait_ready().await;
            if let Err(e) = members(&mut client(n.grpc).await, up).await {
                if procs.iter_mut().any(|p| p.child.try_wait().ok().flatten().is_some()) {
                    continue 'again;
                }
                panic!("node {} did not see {up} members: {e}", n.id);
            }
        }
        return (nodes, procs);
    }
    panic!("a node exited while starting, three times");
}

/// Waits until every process answers ready; false as soon as one has exited.
async fn all_up(procs: &mut [ServerProcess]) -> bool {
    for _ in 0..400 {
        if procs.iter_mut().any(|p| p.child.try_wait().ok().flatten().is_some()) {
            return false;
        }
        let mut ready = true;
        for p in procs.iter() {
            ready &= p.status("/readyz").await == Some(200);
        }
        if ready {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// `n` agents, agent `i` talking to node `i % nodes.len()` (RPC timeout 1 s).
pub(crate) fn agents_over(
    nodes: &[Node],
    n: usize,
) -> Vec<std::sync::Arc<limiter_gateway_agent::Agent>> {
    (0..n)
        .map(|i| {
            let url = format!("http://{}", nodes[i % nodes.len()].grpc);
            let config = limiter_gateway_agent::AgentConfig::new(url, format!("gw-{i}"))
                .with_rpc_timeout(Duration::from_secs(1));
            std::sync::Arc::new(limiter_gateway_agent::Agent::new(config).unwrap())
        })
        .collect()
}

/// Nanoseconds on the judge's time line (offset so that a hold before the start
/// stays positive).
pub(crate) fn ticks(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap() + 10_000_000_000
}

/// The admitted requests of `log` (sent, answered, admitted) as the judge's spends:
/// each may have been charged at any instant from `hold` before it was sent (units
/// are paid when granted) until it was answered.
pub(crate) fn admitted_spends(
    log: &[(Duration, Duration, bool)],
    hold: Duration,
) -> Vec<limiter_reference::judge::Spend> {
    log.iter()
        .filter(|(.., allowed)| *allowed)
        .map(|&(sent, answered, _)| limiter_reference::judge::Spend {
            from: ticks(sent.saturating_sub(hold)),
            to: ticks(answered),
            cost: 1,
        })
        .collect()
}
