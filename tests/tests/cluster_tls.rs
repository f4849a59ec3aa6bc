//! Two real `limiter-server` processes serving TLS with mutual authentication: nodes
//! forward to each other with their own certificates, a gateway and an agent reach
//! them with theirs, and a node whose certificate its peers do not name cannot pass
//! for a peer.

use std::time::Duration;

use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest};
use limiter_proto::connect::{AuthChannel, ClientSecurity};
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;

mod common;
use common::*;

#[path = "../../limiter-server/tests/common/pki.rs"]
mod pki;

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

fn tls_client(
    security: &ClientSecurity,
    addr: std::net::SocketAddr,
) -> RateLimiterClient<AuthChannel> {
    let channel =
        security.connect_lazy(&addr.to_string(), |e| e.timeout(Duration::from_secs(5))).unwrap();
    RateLimiterClient::new(channel)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_agents_and_gateways_talk_over_mutual_tls() {
    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, POLICY).unwrap();
    let ca = pki::Ca::new(dir.path(), "ca");
    let node_cert = ca.issue("node", &["node.limiter.internal", "127.0.0.1"]);
    let gateway = ca.issue("gateway", &["gateway.example"]);
    let path = |p: &std::path::Path| p.display().to_string();
    let (cert, key, ca_file) = (path(&node_cert.cert), path(&node_cert.key), path(&ca.cert));
    let tls_env = [
        ("LIMITER__SECURITY__GRPC__CERT_FILE", cert.as_str()),
        ("LIMITER__SECURITY__GRPC__KEY_FILE", key.as_str()),
        ("LIMITER__SECURITY__GRPC__CLIENT_CA_FILE", ca_file.as_str()),
        ("LIMITER__SECURITY__GRPC__AUTH", "mtls"),
        ("LIMITER__SECURITY__GRPC__PEER_NAMES", "node.limiter.internal"),
        ("LIMITER__SECURITY__PEERS__CA_FILE", ca_file.as_str()),
        ("LIMITER__SECURITY__PEERS__CERT_FILE", cert.as_str()),
        ("LIMITER__SECURITY__PEERS__KEY_FILE", key.as_str()),
    ];
    let nodes: Vec<Node> = ["a", "b"].iter().map(|id| Node::new(id)).collect();
    let peers = Node::static_peers(&nodes);
    let procs: Vec<_> = nodes.iter().map(|n| n.spawn(&policy, &peers, &tls_env)).collect();
    for p in &procs {
        p.wait_ready().await;
    }

    let gw = ClientSecurity::tls(ca.pem()).with_identity(gateway.cert_pem(), gateway.key_pem());
    let mut a = tls_client(&gw, nodes[0].grpc);
    // Both nodes see each other: their health checks pass over mTLS.
    let mut members = 0;
    for _ in 0..100 {
        members =
            a.topology(pb::TopologyRequest::default()).await.unwrap().into_inner().members.len();
        if members == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(members, 2, "the nodes see each other");

    // Tenants owned by b, asked of a: forwarded over mTLS, decided exactly once.
    let tenants: Vec<String> = (0..40).map(|i| format!("tenant-{i}")).collect();
    let owners: Vec<String> = {
        let r = a.topology(pb::TopologyRequest { tenants: tenants.clone() }).await.unwrap();
        r.into_inner().owners
    };
    let remote = tenants.iter().zip(&owners).find(|(_, o)| *o == "b").unwrap().0.clone();
    let mut admitted = 0;
    for _ in 0..15 {
        admitted += u32::from(a.should_allow(allow(&remote)).await.unwrap().into_inner().allowed);
    }
    assert_eq!(admitted, 10, "b decided every request a forwarded");
    assert!(procs[0].metric("limiter_forwards_total", &["answered"]).await >= 15.0);

    // An agent with the gateway's certificate leases straight from each owner.
    let config = AgentConfig::new(format!("https://{}", nodes[0].grpc), "gw-tls")
        .with_ring_routing()
        .with_security(gw.clone());
    let agent = Agent::new(config).unwrap();
    let local = tenants.iter().zip(&owners).find(|(_, o)| *o == "a").unwrap().0.clone();
    for t in [&local, &tenants[39]] {
        let req = AgentRequest { tenant: t, route: "/r", key: None, cost: 1 };
        assert!(agent.decide(&req).await.unwrap().allowed, "{t}");
    }
    assert_eq!(agent.stats().failed_calls, 0);
    agent.shutdown().await;

    // A gateway's certificate does not make it a peer.
    let mut r = tonic::Request::new(allow(&remote));
    r.metadata_mut().insert("x-limiter-forwarded", "1".parse().unwrap());
    let e = a.should_allow(r).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(procs[0].metric("limiter_auth_refusals_total", &["not_allowed"]).await >= 1.0);
}
