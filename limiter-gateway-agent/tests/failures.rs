//! Failure behaviour with real gRPC over loopback: a dropped agent's lease is written
//! off at its end (never granted twice), and a partition between an agent and its
//! owner (a proxy that black-holes traffic) sends fail-open routes to their emergency
//! ceiling and fail-closed routes to LIMITER_UNAVAILABLE, detected within twice the
//! RPC timeout, and healed without help.

mod common;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use common::{Owner, Proxy, agent, req};
use limiter_core::Reason;
use limiter_core::clock::{Clock, MonotonicClock};
use limiter_gateway_agent::{Agent, AgentConfig, Source};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_agents_lease_is_written_off_and_never_granted_twice() {
    let policy = "version: 1\nlease: { ttl: 1s }\ntenants:\n  t:\n    limit: { algorithm: token_bucket, rate: 10/s, burst: 100 }\n";
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(policy, clock.clone()).await;
    let doomed = agent(&owner.url(), "doomed", clock.clone());
    // Build up demand so that it holds a sizeable lease, then die holding it.
    let mut spent = 0u64;
    for _ in 0..30 {
        spent += u64::from(doomed.decide(&req("t", "/r")).await.unwrap().allowed);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let held = owner.server.leases().totals();
    assert!(held.outstanding > 0, "{held:?}");
    drop(doomed);

    // While the dead agent's lease runs, the others get only what is left.
    let other = agent(&owner.url(), "survivor", clock.clone());
    let mut burst = 0u64;
    for _ in 0..200 {
        burst += u64::from(other.decide(&req("t", "/r")).await.unwrap().allowed);
    }
    assert!(spent + burst <= 100 + 10, "spent {spent} + {burst}: granted twice?");

    // After the lease's end it is written off, and the bucket refills for the others.
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    let after = owner.server.leases().totals();
    assert!(after.written_off >= held.outstanding.saturating_sub(after.returned), "{after:?}");
    // Spread over 300 ms, longer than the agent keeps an owner's refusal (250 ms): a
    // refusal its renewer was given during the wait (the bucket empty then) must not
    // stand for the budget refilled since. 10 refilled before, 3 more meanwhile.
    let mut again = 0;
    // Each answer, for the message if this fails: admitted or refused (upper case),
    // by the agent's balance (L), the owner (O), a grant for the request (G) or the
    // failure policy (F), with its retry-after in milliseconds when refused.
    let mut answers = String::new();
    for _ in 0..20 {
        let o = other.decide(&req("t", "/r")).await.unwrap();
        again += u64::from(o.allowed);
        let c = match o.source {
            Source::Local => 'l',
            Source::Owner => 'o',
            Source::Granted => 'g',
            Source::Fallback => 'f',
        };
        answers.push(if o.allowed { c.to_ascii_uppercase() } else { c });
        if !o.allowed {
            answers.push_str(&format!("{} ", o.retry_after / 1_000_000));
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
    let totals = owner.server.leases().totals();
    assert!(
        again >= 13,
        "the survivor gets budget back as the bucket refills: {again} ({answers}); before: \
         {after:?}, after: {totals:?}; survivor {:?}",
        other.stats()
    );
    println!(
        "dropped agent: spent {spent}, {} units out when it was dropped, {} written off by the lease's end ({} returned); survivor admitted {burst} during the lease, {again} after",
        held.outstanding, after.written_off, after.returned
    );
}

const PARTITION: &str = r"
version: 1
lease: { ttl: 1s }
routes:
  /open:
    on_limiter_failure: { mode: fail_open, emergency_ceiling: 20/s }
  /closed:
    on_limiter_failure: { mode: fail_closed }
tenants:
  t:
    limit: { algorithm: token_bucket, rate: 10000/s, burst: 10000 }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partition_fails_open_to_the_ceiling_or_closed_and_heals() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(PARTITION, clock.clone()).await;
    let proxy = Proxy::start(owner.addr).await;
    let timeout = Duration::from_millis(200);
    let config = AgentConfig::new(proxy.url(), "cut-off").with_rpc_timeout(timeout);
    let a = Agent::with_clock(config, clock.clone()).unwrap();
    let open = req("t", "/open");
    let closed = req("t", "/closed");
    for _ in 0..20 {
        assert!(a.decide(&open).await.unwrap().allowed);
        assert!(a.decide(&closed).await.unwrap().allowed);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    proxy.cut(true);
    let cut = Instant::now();
    let mut first_failure = None;
    let mut detected = None;
    let mut fallback_open = 0u64;
    let mut fallback_window = None;
    let mut closed_unavailable = false;
    // Two seconds of traffic at 200 requests per second per route.
    while cut.elapsed() < Duration::from_secs(3) {
        for r in [&open, &closed] {
            let o = a.decide(r).await.unwrap();
            if o.source == Source::Fallback {
                if r.route == "/open" {
                    fallback_window.get_or_insert_with(Instant::now);
                    fallback_open += u64::from(o.allowed);
                    if !o.allowed {
                        assert_eq!(o.reason, Some(Reason::EmergencyCeiling));
                    }
                } else {
                    assert!(!o.allowed);
                    assert_eq!(o.reason, Some(Reason::LimiterUnavailable));
                    closed_unavailable = true;
                }
            }
        }
        if first_failure.is_none() && a.stats().failed_calls > 0 {
            first_failure = Some(Instant::now());
        }
        if detected.is_none() && a.in_fallback() {
            detected = Some(Instant::now());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let first_failure = first_failure.expect("calls failed during the partition");
    let detected = detected.expect("fallback mode entered");
    // The first failed call began at most one timeout before it failed; the loop sees
    // both instants up to one iteration late (the slack).
    let detection = detected - (first_failure - timeout);
    assert!(detection <= 2 * timeout + Duration::from_millis(100), "detection took {detection:?}");
    assert!(closed_unavailable, "fail-closed route answered LIMITER_UNAVAILABLE");
    // The ceiling's bucket starts full (20) when the first fallback decision is made;
    // the window is measured from just after it: one unit of slack for that instant.
    let window = fallback_window.unwrap().elapsed().as_secs_f64();
    let ceiling = 20.0 + 20.0 * window + 1.0;
    assert!(fallback_open as f64 <= ceiling, "fail-open admitted {fallback_open} > {ceiling:.0}");
    assert!(fallback_open > 0);

    proxy.cut(false);
    let healed = Instant::now();
    let mut back = false;
    while healed.elapsed() < Duration::from_secs(5) {
        let o = a.decide(&closed).await.unwrap();
        if o.allowed && o.source != Source::Fallback {
            back = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(back, "the agent returned to the owner after the partition healed");
    assert!(!a.in_fallback());
    println!(
        "partition: detection {detection:?} (timeout {timeout:?}); fail-open admitted {fallback_open} in {window:.2}s under a 20/s ceiling; healed in {:?}",
        healed.elapsed()
    );
}
