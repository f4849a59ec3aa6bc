//! Local permits: agents hold blocks of a concurrency level's permits and lend them to
//! requests with atomics. Checked over real gRPC against an owner in-process: a
//! permit is taken and returned with no call once the pool holds a block; the agents'
//! permits in use never exceed the limit, counted by the test itself (a request is
//! counted in flight from its admission until just before its release); an idle
//! agent's blocks go back so that others get them; a lost agent's come back at their
//! TTL; a chain with rate levels too takes both a permit and units, exactly.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::time::Instant;

use common::{Owner, agent};
use limiter_core::Reason;
use limiter_core::clock::{Clock, MonotonicClock};
use limiter_gateway_agent::{AgentRequest, Outcome};

fn export() -> AgentRequest<'static> {
    AgentRequest { tenant: "acme", route: "/export", key: None, cost: 1 }
}

fn clock() -> Arc<dyn Clock> {
    Arc::new(MonotonicClock::new())
}

const ONLY: &str = "version: 1
tenants:
  acme:
    routes:
      /export: { algorithm: concurrency, limit: 4, permit_ttl: 2s }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_are_lent_and_returned_locally_never_above_the_limit() {
    let clock = clock();
    let owner = Owner::start(ONLY, clock.clone()).await;
    let a = agent(&owner.url(), "a", clock.clone());
    let mut held: Vec<Outcome> = Vec::new();
    for _ in 0..4 {
        let o = a.decide(&export()).await.unwrap();
        assert!(o.allowed, "{o:?}");
        let p = o.permit.as_ref().expect("an admission holds a permit");
        assert!(p.id.is_empty(), "a permit of the agent's pool: {p:?}");
        held.push(o);
    }
    let full = a.decide(&export()).await.unwrap();
    assert!(!full.allowed, "four of four in use: {full:?}");
    assert_eq!(full.reason, Some(Reason::TenantRouteLimit));
    // Another agent finds them all held at the owner.
    let b = agent(&owner.url(), "b", clock.clone());
    assert!(!b.decide(&export()).await.unwrap().allowed);

    // Released here, taken again here: no call.
    let calls = a.stats().owner_calls;
    let first = held.remove(0);
    assert!(a.release(first.permit.as_ref().unwrap()).await.unwrap());
    assert!(!a.release(first.permit.as_ref().unwrap()).await.unwrap(), "released once");
    drop(first);
    for _ in 0..1_000 {
        let o = a.decide_local(&export()).expect("a local decision");
        assert!(o.allowed && o.permit.is_some());
        assert!(a.decide_local(&export()).is_none(), "one free permit, lent");
        drop(o);
    }
    // The same through a handle on the key's pool.
    let handle = a.permit_handle(&export()).expect("the key has a pool");
    for _ in 0..1_000 {
        let p = handle.try_acquire(1).expect("a permit from the handle");
        assert!(handle.try_acquire(1).is_none(), "one free permit, lent");
        assert!(a.decide_local(&export()).is_none(), "the handle and the key share the pool");
        drop(p);
    }
    // One call: its place in the owner's line (taken when it was refused above)
    // given up once a request was served from the pool, off the request's path;
    // none for a permit the pool holds.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(a.stats().owner_calls, calls + 1, "the place given up, and no call for a permit");
    assert!(a.stats().local >= 1_000);
    drop(held);
    a.shutdown().await;
    // Given back at shutdown: the other agent gets all four.
    let mut theirs = Vec::new();
    for _ in 0..4 {
        let o = b.decide(&export()).await.unwrap();
        assert!(o.allowed, "{o:?}");
        theirs.push(o);
    }
}

/// Ten agents each run requests of random length on one limit of 6 for 3 seconds:
/// in flight never above 6 (counted by the test), and every agent served at least
/// half of an even share.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_agents_never_hold_more_than_the_limit_and_all_are_served() {
    const LIMIT: u64 = 6;
    let policy = "version: 1
tenants:
  acme:
    routes:
      /export: { algorithm: concurrency, limit: 6, permit_ttl: 2s }
";
    let clock = clock();
    let owner = Owner::start(policy, clock.clone()).await;
    let in_flight = Arc::new(AtomicU64::new(0));
    let worst = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let run = Duration::from_secs(3);
    let mut tasks = Vec::new();
    for n in 0..10u64 {
        let a = agent(&owner.url(), &format!("agent-{n}"), clock.clone());
        let (in_flight, worst) = (in_flight.clone(), worst.clone());
        tasks.push(tokio::spawn(async move {
            let mut admitted = 0u64;
            let mut i = n;
            while started.elapsed() < run {
                let o = a.decide(&export()).await.unwrap();
                if o.allowed {
                    admitted += 1;
                    let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    worst.fetch_max(now, Ordering::SeqCst);
                    i = i.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    tokio::time::sleep(Duration::from_millis(1 + (i >> 33) % 8)).await;
                    in_flight.fetch_sub(1, Ordering::SeqCst);
                    assert!(a.release(o.permit.as_ref().unwrap()).await.unwrap());
                } else {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            (admitted, a.stats())
        }));
    }
    let mut each = Vec::new();
    let mut calls = 0;
    let mut all_stats = Vec::new();
    for t in tasks {
        let (admitted, stats) = t.await.unwrap();
        assert!(admitted > 0, "an agent was never served: {stats:?}");
        each.push(admitted);
        calls += stats.owner_calls;
        all_stats.push(stats);
    }
    let total: u64 = each.iter().sum();
    let worst = worst.load(Ordering::SeqCst);
    println!("admitted {total} {each:?}, owner calls {calls}, most in flight {worst}");
    // No agent kept out: the owner serves waiting pools in turn, and each pool's
    // turn with a block lasts a round, so each gets at least half of an even share.
    let least = each.iter().copied().min().unwrap_or(0);
    assert!(least * 20 >= total, "an agent got {least} of {total}: {each:?}\n{all_stats:#?}");
    assert!(worst <= LIMIT, "{worst} in flight with a limit of {LIMIT}");
    assert_eq!(worst, LIMIT, "the limit was reached (the test can see an excess)");
}

/// An agent holding every permit is lost (its tasks stop, nothing is given back):
/// another agent is refused until the blocks' TTL, and served within it after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_agents_blocks_come_back_at_their_ttl() {
    let clock = clock();
    let owner = Owner::start(ONLY, clock.clone()).await;
    let a = agent(&owner.url(), "a", clock.clone());
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(a.decide(&export()).await.unwrap());
    }
    assert!(held.iter().all(|o| o.allowed));
    let lost_at = Instant::now();
    std::mem::forget(held);
    drop(a);
    let b = agent(&owner.url(), "b", clock.clone());
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(!b.decide(&export()).await.unwrap().allowed, "held within the TTL");
    let back = loop {
        let o = b.decide(&export()).await.unwrap();
        if o.allowed {
            break lost_at.elapsed();
        }
        assert!(lost_at.elapsed() < Duration::from_millis(2_500), "not back within the TTL");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!("permits back after {back:?}");
    assert!(back >= Duration::from_millis(1_900), "back before the TTL: {back:?}");
}

/// A chain with a rate level and a concurrency level: a local decision takes a
/// permit and a unit; the rate is exact (50 of a burst of 50, then the refill) and
/// the permits are never more than 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_with_rates_and_permits_takes_both() {
    let policy = "version: 1
tenants:
  acme:
    limit: { algorithm: token_bucket, rate: 5/s, burst: 50 }
    routes:
      /export: { algorithm: concurrency, limit: 3, permit_ttl: 2s }
";
    let clock = clock();
    let owner = Owner::start(policy, clock.clone()).await;
    let a = agent(&owner.url(), "a", clock.clone());
    let started = Instant::now();
    let mut held = Vec::new();
    for _ in 0..3 {
        let o = a.decide(&export()).await.unwrap();
        assert!(o.allowed, "{o:?}");
        held.push(o);
    }
    let full = a.decide(&export()).await.unwrap();
    assert_eq!((full.allowed, full.reason), (false, Some(Reason::TenantRouteLimit)));
    drop(held);
    let mut admitted = 3;
    let mut local = 0;
    for _ in 0..100 {
        let o = a.decide(&export()).await.unwrap();
        if o.allowed {
            admitted += 1;
            local += u64::from(o.source == limiter_gateway_agent::Source::Local);
        } else {
            assert_eq!(o.reason, Some(Reason::TenantLimit), "{o:?}");
        }
    }
    let secs = started.elapsed().as_secs_f64();
    // At most the burst and what refilled in the time taken (one unit of slack for
    // the refill's rounding).
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let most = 50 + (5.0 * secs).ceil() as u64;
    assert!((50..=most).contains(&admitted), "{admitted} admitted, at most {most}");
    assert!(local > 0, "decided locally: {:?}", a.stats());
}
