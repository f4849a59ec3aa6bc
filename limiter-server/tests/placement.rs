//! Placement of tenants on one node of a three-node cluster, through its public API
//! and a manual clock: the ring decides the owner; a node that died without handing
//! off leaves its tenants fenced for the fence; tenants moving from a live node wait
//! for its handoff, and are decided here once it has arrived (or its wait is over).

use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::ManualClock;
use limiter_proto::limiter::v1 as pb;
use limiter_server::cluster::ring::{Member, Ring};
use limiter_server::cluster::{Cluster, LocalState, Placement};
use limiter_server::owner::lease::Leases;

/// What a node holds: counters (or none), leases, the policy.
struct State {
    limiter: Option<limiter_core::Limiter>,
    leases: Leases,
    policy: limiter_core::policy::Policy,
}

impl State {
    fn new(limiter: Option<limiter_core::Limiter>) -> Self {
        Self { limiter, leases: Leases::default(), policy: policy() }
    }
}

impl LocalState for State {
    fn counters(&self) -> Option<&limiter_core::Limiter> {
        self.limiter.as_ref()
    }
    fn leases(&self) -> &dyn limiter_server::cluster::LeaseBook {
        &self.leases
    }
    fn with_policy(&self, f: &mut dyn FnMut(&limiter_core::policy::Policy)) {
        f(&self.policy);
    }
}

/// Every tenant held to 10 an hour (a fixed window).
fn policy() -> limiter_core::policy::Policy {
    limiter_core::policy::from_yaml(
        "version: 1\ntenants:\n  default:\n    limit: { algorithm: fixed_window, limit: 10, window: 1h }\n",
        "p.yaml",
    )
    .unwrap()
}

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
async fn steady() -> (Arc<ManualClock>, Cluster, State, Ring) {
    let clock = Arc::new(ManualClock::new(START));
    let a = node(&clock);
    let state = State::new(None);
    let all = Ring::new(1, vec![member("a", 1), member("b", 2), member("c", 3)]);
    a.install(all.clone(), &state).await;
    clock.advance(Duration::from_secs(10));
    (clock, a, state, all)
}

#[tokio::test]
async fn the_ring_places_tenants_and_a_lost_owner_is_fenced_then_taken_over() {
    let (clock, a, state, all) = steady().await;
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
    a.install(without_c.clone(), &state).await;
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
    let state = State::new(None);
    // `a`'s first view: b and c own everything; then `a` joins.
    let bc = Ring::new(1, vec![member("b", 2), member("c", 3)]);
    a.install(bc.clone(), &state).await;
    clock.advance(Duration::from_secs(10));
    let abc = Ring::new(2, vec![member("a", 1), member("b", 2), member("c", 3)]);
    a.install(abc.clone(), &state).await;
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
    assert_eq!(a.receive(&done, None, &state.leases, &policy), Ok(0));
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
    let (_clock, a, _state, all) = steady().await;
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

/// The number `limiter_state_resets_total{reason}` reads in this process.
fn resets(reason: &str) -> u64 {
    let text = limiter_server::metrics::handle().render();
    let series = format!("limiter_state_resets_total{{reason=\"{reason}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .map_or(0, |v| v.trim().parse().unwrap())
}

/// A fixed window's state with `count` units used in the hour of `now`.
fn used(count: u64, now: u64) -> Vec<u8> {
    let window = now / 3_600_000_000_000;
    format!("{{\"FixedWindow\":{{\"window\":{window},\"count\":{count}}}}}").into_bytes()
}

fn counter(tenant: &str, state: Vec<u8>, version: u64) -> pb::CounterState {
    pb::CounterState {
        version,
        budget: 0,
        scope: pb::Scope::Tenant.into(),
        tenant: tenant.into(),
        route: String::new(),
        key: String::new(),
        state,
    }
}

/// Node `a` with counters, ten seconds after its first view of `a`, `b` and `c`.
struct Steady {
    clock: Arc<ManualClock>,
    a: Cluster,
    state: State,
    all: Ring,
    now: u64,
    tenants: Vec<(String, String)>,
}

async fn steady_with_counters() -> Steady {
    let clock = Arc::new(ManualClock::new(START));
    let a = node(&clock);
    let state = State::new(Some(limiter_core::Limiter::new(10_000)));
    let all = Ring::new(1, vec![member("a", 1), member("b", 2), member("c", 3)]);
    a.install(all.clone(), &state).await;
    clock.advance(Duration::from_secs(10));
    let now = clock_now(&clock);
    let tenants = owners(&all, 120);
    Steady { clock, a, state, all, now, tenants }
}

/// The tenants `owner` owns in `ring` whose next owner is `next`.
fn next_of<'t>(
    ring: &Ring,
    tenants: &'t [(String, String)],
    owner: &str,
    next: &str,
) -> Vec<&'t String> {
    tenants
        .iter()
        .filter(|(t, o)| o == owner && ring.owner_without(t, owner).is_some_and(|m| &*m.id == next))
        .map(|(t, _)| t)
        .collect()
}

#[tokio::test]
async fn a_lost_owner_is_replaced_by_its_replica_and_a_double_loss_is_fenced_and_counted() {
    let Steady { clock, a, state, all, now, tenants } = steady_with_counters().await;
    // c's tenants whose next owner is a: their replica is here.
    let next_a = next_of(&all, &tenants, "c", "a");
    assert!(next_a.len() > 5, "{}", next_a.len());
    let copy = pb::ReplicateRequest {
        from: "c".into(),
        seq: 7,
        reset: true,
        synced: true,
        counters: next_a.iter().map(|t| counter(t, used(3, now), 10)).collect(),
        ring: vec!["c".into(), "a".into(), "b".into()],
        ..Default::default()
    };
    assert_eq!(a.replication().receive(&a, &copy), Ok(false));
    // The next change, then the same message again (an answer lost): both in order.
    let change = pb::ReplicateRequest {
        from: "c".into(),
        seq: 8,
        counters: vec![counter(next_a[0], used(9, now), 20)],
        ..Default::default()
    };
    assert_eq!(a.replication().receive(&a, &change), Ok(false));
    assert_eq!(a.replication().receive(&a, &change), Ok(false));
    // A lease grant's copy sent at once, older than the change (it left before it and
    // arrived after): the newer copy stays.
    let late = pb::ReplicateRequest {
        from: "c".into(),
        direct: true,
        counters: vec![counter(next_a[0], used(1, now), 15)],
        ..Default::default()
    };
    assert_eq!(a.replication().receive(&a, &late), Ok(false));
    // A message out of order (or from an owner that never sent a full copy) asks for one.
    let gap = pb::ReplicateRequest { from: "b".into(), seq: 3, ..Default::default() };
    assert_eq!(a.replication().receive(&a, &gap), Ok(true));
    // A stranger is refused and nothing is stored.
    let stranger = pb::ReplicateRequest { from: "z".into(), reset: true, ..copy.clone() };
    assert!(a.replication().receive(&a, &stranger).unwrap_err().contains("not a node"));
    assert_eq!(a.replication().held(), next_a.len());

    // b and c die together: c's tenants with their replica here are decided at once
    // with c's counts; those whose replica died with b are fenced, then counted as
    // begun afresh; b's are fenced (nothing of b's is here).
    let before = resets("owner_and_replica_lost");
    let alone = Ring::new(2, vec![member("a", 1)]);
    a.install(alone.clone(), &state).await;
    let died = clock_now(&clock);
    let table = state.limiter.as_ref().unwrap().table();
    let mut lost_both = 0;
    for (t, o) in tenants.iter().filter(|(_, o)| o != "a") {
        let next = all.owner_without(t, o).unwrap().id.to_string();
        let p = a.place(t, died);
        if o == "c" && next == "a" {
            assert!(matches!(p, Placement::Local), "{t}: {p:?}");
            let held = table.snapshot_where(|k| k.as_ref().tenant == t.as_str());
            assert_eq!(held.len(), 1, "{t}");
            let want = if t == next_a[0] { 9 } else { 3 };
            assert_eq!(serde_json::to_vec(&held[0].1).unwrap(), used(want, now), "{t}");
        } else {
            assert!(matches!(p, Placement::Fenced { .. }), "{t}: {p:?}");
            lost_both += u64::from(next != "a");
        }
    }
    assert!(lost_both > 0);
    clock.advance(Duration::from_millis(FENCE_MS));
    for (t, _) in tenants.iter().filter(|(_, o)| o != "a") {
        // Asked twice: counted once.
        assert!(matches!(a.place(t, clock_now(&clock)), Placement::Local), "{t}");
        assert!(matches!(a.place(t, clock_now(&clock)), Placement::Local), "{t}");
    }
    assert_eq!(resets("owner_and_replica_lost") - before, lost_both);
}

#[tokio::test]
async fn a_replica_behind_its_owner_does_not_stand_for_it() {
    let Steady { clock, a, state, all, now, tenants } = steady_with_counters().await;
    let next_a = next_of(&all, &tenants, "c", "a");
    // A full copy begun but never finished.
    let start = pb::ReplicateRequest {
        from: "c".into(),
        reset: true,
        counters: next_a.iter().map(|t| counter(t, used(3, now), 1)).collect(),
        ..Default::default()
    };
    assert_eq!(a.replication().receive(&a, &start), Ok(false));
    a.install(Ring::new(2, vec![member("a", 1), member("b", 2)]), &state).await;
    for t in &next_a {
        assert!(matches!(a.place(t, clock_now(&clock)), Placement::Fenced { .. }), "{t}");
    }
}
