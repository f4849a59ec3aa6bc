//! The Redis store on a three-master Redis Cluster started here: decisions for many
//! tenants across slots, each tenant's counters in one slot (its chain is never split),
//! and the limits that span tenants kept under tags of their own.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::redis::RedisCluster;
use common::{TestServer, ask_key};
use limiter_proto::limiter::v1 as pb;

const POLICY: &str = r"
version: 1
unknown_tenants: use_default
global:
  ceiling: { algorithm: token_bucket, rate: 100000/s, burst: 100000 }
routes:
  /r:
    limit: { algorithm: fixed_window, limit: 100000, window: 1h }
tenants:
  default:
    limit: { algorithm: fixed_window, limit: 3, window: 1h }
    routes:
      /r: { algorithm: sliding_counter, limit: 100, window: 1h }
    per_key: { algorithm: sliding_log, limit: 100, window: 1h }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_across_slots_each_in_one_slot() {
    let cluster = tokio::task::spawn_blocking(RedisCluster::start).await.unwrap();
    let urls = cluster.urls();
    let s = TestServer::start_with(
        POLICY,
        &[("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__CLUSTER_NODES", &urls)],
    )
    .await;
    let mut c = s.native().await;
    let tenants: Vec<String> = (0..60).map(|i| format!("tenant-{i}")).collect();
    for t in &tenants {
        let mut allowed = 0;
        for i in 0..5 {
            let r = c.should_allow(ask_key(t, "/r", &format!("k{}", i % 2))).await.unwrap();
            let r = r.into_inner();
            if r.allowed {
                allowed += 1;
            } else {
                assert_eq!((r.reason(), r.scope()), (pb::Reason::TenantLimit, pb::Scope::Tenant));
            }
        }
        assert_eq!(allowed, 3, "{t}: the tenant's limit is exact on the cluster");
    }

    // Where the keys are: every tenant's keys on one node, in one slot.
    let mut slot_of: BTreeMap<String, BTreeSet<i64>> = BTreeMap::new();
    let mut node_of: BTreeMap<String, BTreeSet<u16>> = BTreeMap::new();
    let mut spanning = 0;
    for node in &cluster.nodes {
        let client = redis::Client::open(node.url()).unwrap();
        let mut con = client.get_connection().unwrap();
        let keys: Vec<String> = redis::cmd("KEYS").arg("lim:*").query(&mut con).unwrap();
        for k in keys {
            let slot: i64 = redis::cmd("CLUSTER").arg("KEYSLOT").arg(&k).query(&mut con).unwrap();
            let tag = &k[k.find('{').unwrap() + 1..k.find('}').unwrap()];
            if let Some(tenant) = tag.strip_prefix("t.") {
                slot_of.entry(tenant.to_owned()).or_default().insert(slot);
                node_of.entry(tenant.to_owned()).or_default().insert(node.port);
            } else {
                assert!(tag == "g." || tag == "r./r", "{k}");
                spanning += 1;
            }
        }
    }
    assert_eq!(slot_of.len(), tenants.len(), "every tenant has counters");
    for (t, slots) in &slot_of {
        assert_eq!(slots.len(), 1, "{t}: keys in slots {slots:?}");
        assert_eq!(node_of[t].len(), 1, "{t}");
    }
    let nodes_used: BTreeSet<u16> = node_of.values().flatten().copied().collect();
    assert_eq!(nodes_used.len(), 3, "tenants spread over the three masters");
    // The route's window counter (the global bucket's key goes once it is full again).
    assert!(spanning >= 1, "the limits that span tenants, under their own tags");
    println!(
        "cluster: {} tenants over {} masters; tenants per master {:?}",
        slot_of.len(),
        nodes_used.len(),
        nodes_used
            .iter()
            .map(|p| node_of.values().filter(|n| n.contains(p)).count())
            .collect::<Vec<_>>()
    );
    s.stop().await;

    // A chain across groups: the route's group refuses first (outermost), the tenant's
    // group would refuse too; the wait is the longest of both, as on one node.
    let s = TestServer::start_with(
        SPLIT,
        &[("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__CLUSTER_NODES", &urls)],
    )
    .await;
    let mut c = s.native().await;
    let first = c.should_allow(common::ask("solo", "/tight")).await.unwrap().into_inner();
    assert!(first.allowed);
    let r = c.should_allow(common::ask("solo", "/tight")).await.unwrap().into_inner();
    assert_eq!((r.reason(), r.scope()), (pb::Reason::RouteLimit, pb::Scope::Route));
    assert!(
        r.retry_after.unwrap().seconds > 3_000,
        "the tenant's two hours, not the route's ten seconds: {r:?}"
    );
    s.stop().await;
}

const SPLIT: &str = r"
version: 1
routes:
  /tight:
    limit: { algorithm: sliding_log, limit: 1, window: 10s }
    lease: { mode: exact }
tenants:
  solo:
    limit: { algorithm: sliding_log, limit: 1, window: 2h }
";
