//! The agent against a real owner over gRPC: local decisions from leases, rejections
//! with the owner's reason, locality at steady demand, exact mode, and returns.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Owner, agent, req};
use limiter_core::Reason;
use limiter_core::clock::{Clock, MonotonicClock};
use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest, AgentStats, Source};

const POLICY: &str = r"
version: 1
routes:
  /exact:
    lease: { mode: exact }
tenants:
  small:
    limit: { algorithm: fixed_window, limit: 10, window: 1h }
  busy:
    limit: { algorithm: token_bucket, rate: 10000/s, burst: 10000 }
    per_key: { algorithm: token_bucket, rate: 1000/s, burst: 1000 }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decides_locally_from_a_lease_and_rejects_with_the_owners_reason() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    let a = agent(&owner.url(), "a1", clock.clone());
    let mut allowed = 0;
    let mut sources = Vec::new();
    for _ in 0..15 {
        let o = a.decide(&req("small", "/r")).await.unwrap();
        if o.allowed {
            allowed += 1;
        } else {
            assert_eq!(o.reason, Some(Reason::TenantLimit));
            assert!(o.retry_after > 0);
            assert_eq!(o.limit.as_ref().unwrap().quota, 10);
        }
        sources.push(o.source);
    }
    assert_eq!(allowed, 10, "never more than the limit");
    assert!(sources.contains(&Source::Local), "{sources:?}");
    // Cost 0 and a cost above the capacity are errors, not rejections.
    assert!(a.decide(&AgentRequest { cost: 0, ..req("small", "/r") }).await.is_err());
    assert!(
        a.decide(&AgentRequest { cost: 11, ..req("busy2", "/r") }).await.is_ok_and(|o| !o.allowed)
    );
    let e = a.decide(&AgentRequest { cost: 20_000, ..req("busy", "/r") }).await.unwrap_err();
    assert!(e.to_string().contains("cost"), "{e}");
}

/// `keys` keys of tenant `busy`, one request each every `every` for `rounds` rounds,
/// each admitted: the agent's stats after `warm` rounds and at the end.
async fn steady(
    a: &Agent,
    keys: usize,
    every: Duration,
    warm: usize,
    rounds: usize,
) -> (AgentStats, AgentStats) {
    let keys: Vec<String> = (0..keys).map(|i| format!("k{i}")).collect();
    let mut tick = tokio::time::interval(every);
    let mut warmed = None;
    for round in 0..rounds {
        if round == warm {
            warmed = Some(a.stats());
        }
        tick.tick().await;
        for k in &keys {
            let o = a.decide(&AgentRequest { key: Some(k), ..req("busy", "/r") }).await.unwrap();
            assert!(o.allowed);
        }
    }
    (warmed.unwrap(), a.stats())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_steady_demand_nearly_every_decision_is_local() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    let a = agent(&owner.url(), "a2", clock.clone());
    // 25 keys at 20 requests per second each: one second to warm up, then four measured.
    let (w, s) = steady(&a, 25, Duration::from_millis(50), 20, 100).await;
    let local = (s.local - w.local) as f64;
    let decisions = local + (s.slow - w.slow) as f64;
    let calls = (s.owner_calls - w.owner_calls) as f64;
    println!(
        "locality at 20 req/s per key: {decisions} decisions, {:.2}% local, {calls} owner calls ({:.2} per 1000 decisions)",
        local * 100.0 / decisions,
        calls * 1_000.0 / decisions,
    );
    assert!(local / decisions >= 0.99, "{s:?}");
}

/// More keys fall due in a round than the owner takes items in one call (its
/// `limits.max_batch`, 100 by default): the round goes out in several calls of at most
/// that many, every renewal lands, and the keys stay local.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_with_more_keys_due_than_one_call_takes_renews_them_all() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    let a = agent(&owner.url(), "a5", clock.clone());
    // 350 keys at 10 requests per second each: one second to warm up, two measured.
    let (w, s) = steady(&a, 350, Duration::from_millis(100), 10, 30).await;
    let local = (s.local - w.local) as f64;
    let decisions = local + (s.slow - w.slow) as f64;
    let (calls, items) = (s.owner_calls - w.owner_calls, s.owner_items - w.owner_items);
    println!(
        "350 keys: {decisions} decisions, {:.2}% local, {calls} calls carrying {items} items",
        local * 100.0 / decisions
    );
    assert!(items > 350, "the keys were renewed: {s:?}");
    assert!(items <= 100 * calls, "no call above the owner's 100 items: {s:?}");
    assert!(local / decisions >= 0.99, "{s:?}");
}

/// A key idle past `idle_after` gives its lease back and sheds its slow-path state
/// (an idle key costs its slot alone); used again, it leases afresh and decides
/// locally, and every unit is accounted for at the owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_key_gives_back_and_sheds_its_state_then_leases_afresh() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    let mut config =
        AgentConfig::new(owner.url(), "a6").with_rpc_timeout(Duration::from_millis(500));
    config.idle_after = Duration::from_millis(300);
    let a = Agent::with_clock(config, clock.clone()).unwrap();
    let keys: Vec<String> = (0..20).map(|i| format!("k{i}")).collect();
    fn ask(k: &str) -> AgentRequest<'_> {
        AgentRequest { key: Some(k), ..req("busy", "/r") }
    }
    for k in &keys {
        assert!(a.decide(&ask(k)).await.unwrap().allowed);
    }
    assert_eq!(a.key_counts(), (20, 20));
    assert!(owner.server.leases().totals().outstanding > 0);
    let mut shed = false;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if a.key_counts() == (20, 0) {
            shed = true;
            break;
        }
    }
    assert!(shed, "idle keys still carry their state: {:?}", a.key_counts());
    assert_eq!(owner.server.leases().totals().outstanding, 0, "every lease went back");
    let before = a.stats();
    for _ in 0..3 {
        for k in &keys {
            assert!(a.decide(&ask(k)).await.unwrap().allowed);
        }
    }
    let after = a.stats();
    assert_eq!(a.key_counts(), (20, 20));
    assert!(after.local - before.local >= 40, "leased afresh, then local: {after:?}");
    a.shutdown().await;
    let t = owner.server.leases().totals();
    assert_eq!(t.outstanding, 0);
    assert_eq!(t.granted, t.spent + t.returned + t.written_off, "{t:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_routes_ask_the_owner_for_every_request() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    let a = agent(&owner.url(), "a3", clock.clone());
    let mut allowed = 0;
    for _ in 0..12 {
        let o = a.decide(&req("small", "/exact")).await.unwrap();
        assert_eq!(o.source, Source::Owner);
        allowed += usize::from(o.allowed);
    }
    assert_eq!(allowed, 10);
    assert_eq!(a.stats().local, 0);
    // An exact route holds no lease, so no refusal is kept at the agent either.
    assert_eq!(a.stats().refused_locally, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_agent_returns_its_balance() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    let a = agent(&owner.url(), "a4", clock.clone());
    assert!(a.decide(&req("busy", "/r")).await.unwrap().allowed);
    let before = owner.server.leases().totals();
    assert!(before.outstanding > 0);
    a.shutdown().await;
    let after = owner.server.leases().totals();
    assert_eq!(after.outstanding, 0);
    // Everything but the one unit the request spent came back.
    assert_eq!(after.returned - before.returned, before.outstanding - 1);
}

/// An exhausted key's requests are refused at the agent from the owner's refusal (a
/// refused request, or the limit that cut the key's last grant), with the owner's
/// reason and the wait left, without a call of theirs; once the refusal lapses (a
/// renewal round at most) the owner is asked again (by the key's renewal or its next
/// request), and it never admits more than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owners_refusal_answers_the_keys_requests_locally_for_a_while() {
    // A 50 s lease TTL and a 1 s renewal round allow a 1 s cap: long enough that the
    // test's requests all fall inside it on a loaded machine.
    let policy = "version: 1\nlease: { ttl: 50s }\ntenants:\n  t:\n    limit: { algorithm: fixed_window, limit: 3, window: 1h }\n";
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(policy, clock.clone()).await;
    let config = AgentConfig::new(owner.url(), "refused")
        .with_rpc_timeout(Duration::from_millis(500))
        .with_refusal_cap(Duration::from_secs(1))
        .with_renew_interval(Duration::from_secs(1));
    let a = Agent::with_clock(config, clock.clone()).unwrap();
    let mut allowed = 0;
    // Until the owner has refused once.
    for _ in 0..20 {
        let o = a.decide(&req("t", "/r")).await.unwrap();
        if !o.allowed {
            assert_eq!(o.reason, Some(Reason::TenantLimit), "{o:?}");
            break;
        }
        allowed += 1;
    }
    assert_eq!(allowed, 3);
    let before = a.stats();
    let started = tokio::time::Instant::now();
    for _ in 0..50 {
        let o = a.decide(&req("t", "/r")).await.unwrap();
        assert!(!o.allowed);
        assert_eq!((o.reason, o.source), (Some(Reason::TenantLimit), Source::Local));
        assert!(o.retry_after > 0 && o.retry_after <= 3_600_000_000_000, "{o:?}");
    }
    let during = a.stats();
    if started.elapsed() < Duration::from_millis(900) {
        assert_eq!(during.refused_locally - before.refused_locally, 50, "{during:?}");
        assert_eq!(during.slow, before.slow, "no request asked the owner: {during:?}");
    }
    // Once it lapses the owner is asked again, and refuses again.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let o = a.decide(&req("t", "/r")).await.unwrap();
    assert!(!o.allowed, "{o:?}");
    assert!(a.stats().owner_calls > during.owner_calls);
}

/// A key refused near its limit is asked about again by the renewer as the refusal
/// lapses, so its first request after the lapse spends what the owner granted meanwhile
/// instead of waiting for an owner call (rounds a second apart here, and the refusal
/// shorter: without the early ask, that request would find nothing and ask the owner
/// itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_asked_about_again_as_it_lapses_so_the_next_request_is_local() {
    let policy = "version: 1\ntenants:\n  t:\n    limit: { algorithm: token_bucket, rate: 10/s, burst: 5 }\n";
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(policy, clock.clone()).await;
    let config = AgentConfig::new(owner.url(), "lapse")
        .with_rpc_timeout(Duration::from_millis(500))
        .with_renew_interval(Duration::from_secs(2))
        .with_refusal_cap(Duration::from_secs(1));
    let a = Agent::with_clock(config, clock.clone()).unwrap();
    // Spend the bucket until the owner refuses: it says when a unit is back.
    let mut refused = None;
    for _ in 0..20 {
        let o = a.decide(&req("t", "/r")).await.unwrap();
        if !o.allowed {
            refused = Some(o);
            break;
        }
    }
    let refused = refused.expect("the bucket ran out");
    assert_eq!(refused.reason, Some(Reason::TenantLimit), "{refused:?}");
    assert!(refused.retry_after <= 900_000_000, "{refused:?}");
    // Past the lapse by a few owner calls' time, before the renewer's next round.
    tokio::time::sleep(Duration::from_nanos(refused.retry_after) + Duration::from_millis(60)).await;
    let before = a.stats();
    let o = a.decide(&req("t", "/r")).await.unwrap();
    let after = a.stats();
    assert!(o.allowed, "{o:?}");
    assert_eq!(o.source, Source::Local, "{o:?}");
    assert_eq!(after.slow, before.slow, "no request asked the owner: {after:?}");
}
