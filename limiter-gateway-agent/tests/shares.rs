//! Fair shares through leases: agents hold leased batches of a divided global ceiling.
//! Two agents send a reserved class's steady load (below its reservation), two flood
//! the ceiling at five times its rate from a best-effort class. The reserved class is
//! refused nothing once its demand is measured; the flood gets the rest; the ceiling
//! is never exceeded (judged by the independent reference, every admission placed
//! where it may have been charged, per second); and most decisions stay local.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Owner, agent, placement};
use limiter_core::clock::{Clock, MonotonicClock, NANOS_PER_SEC};
use limiter_gateway_agent::{AgentRequest, Source};
use limiter_reference::Spec;
use limiter_reference::judge::judge;

const LIMIT: u64 = 400;
const RUN_SECS: u64 = 10;
const SETTLE_SECS: u64 = 2;
/// The policy's lease TTL (the default).
const TTL: u64 = 2 * NANOS_PER_SEC;

const POLICY: &str = "version: 1
unknown_tenants: use_default
global:
  ceiling: { algorithm: token_bucket, rate: 400/s, burst: 400 }
  shares:
    critical: { tenants: [acme], reserved: 30% }
    best_effort: {}
tenants:
  default: {}
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_batches_keep_a_reserved_share_under_a_flood() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    // (tenant, per second): acme 2 x 40 (80 of its 120 reserved); the flood 2 x 1000.
    let load = [("acme", 40.0), ("acme", 40.0), ("flood-a", 1_000.0), ("flood-b", 1_000.0)];
    let into_second = clock.now() % NANOS_PER_SEC;
    tokio::time::sleep(Duration::from_nanos(NANOS_PER_SEC - into_second)).await;
    let start = clock.now();
    let mut tasks = Vec::new();
    for (i, &(tenant, rate)) in load.iter().enumerate() {
        let a = agent(&owner.url(), &format!("gw{i}"), clock.clone());
        let clock = clock.clone();
        tasks.push(tokio::spawn(async move {
            let mut owed = 0.0f64;
            let mut out = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(2));
            let mut last = clock.now();
            while clock.now() - start < RUN_SECS * NANOS_PER_SEC {
                tick.tick().await;
                let now = clock.now();
                owed += rate * (now - last) as f64 / NANOS_PER_SEC as f64;
                last = now;
                while owed >= 1.0 {
                    owed -= 1.0;
                    let req = AgentRequest { tenant, route: "/r", key: None, cost: 1 };
                    let before = clock.now();
                    let o = a.decide(&req).await.unwrap();
                    out.push((before, clock.now(), o.allowed, o.source == Source::Local));
                }
            }
            let stats = a.stats();
            println!("gw{i} {tenant}: {stats:?}");
            a.shutdown().await;
            (out, stats.local + stats.refused_locally)
        }));
    }
    let mut per_agent = Vec::new();
    let mut local_or_cached = 0;
    for t in tasks {
        let (out, here) = t.await.unwrap();
        local_or_cached += here;
        per_agent.push(out);
    }

    let spec = Spec::TokenBucket { amount: LIMIT, period: NANOS_PER_SEC, burst: LIMIT };
    let mut spends = Vec::new();
    let (mut decisions, mut local) = (0u64, 0u64);
    // Per second after the start: (acme admitted, acme asked, flood admitted).
    let mut seconds = vec![(0u64, 0u64, 0u64); RUN_SECS as usize];
    for (i, out) in per_agent.iter().enumerate() {
        for &(before, after, allowed, is_local) in out {
            decisions += 1;
            local += u64::from(is_local);
            let s = ((before - start) / NANOS_PER_SEC) as usize;
            let Some(sec) = seconds.get_mut(s) else { continue };
            if i < 2 {
                sec.1 += 1;
                sec.0 += u64::from(allowed);
            } else {
                sec.2 += u64::from(allowed);
            }
            if allowed {
                spends.push(placement(spec, is_local, before, after, TTL));
            }
        }
    }
    let verdict = judge(spec, &spends, NANOS_PER_SEC);
    let report = format!(
        "over the ceiling {}; local {local} (with refusals cached {local_or_cached}) of {decisions}; per second (acme admitted, asked, flood): {seconds:?}",
        verdict.overshoot
    );
    println!("{report}");
    assert_eq!(verdict.overshoot, 0, "{report}");
    for (s, &(acme, asked, flood)) in seconds.iter().enumerate().skip(SETTLE_SECS as usize) {
        assert_eq!(acme, asked, "second {s}: acme refused within its reservation: {report}");
        // The flood's share through leases: the design gives it the rest (400 less
        // acme's 80 and a quarter: 300, which the same load gets per request at the
        // owner); leased batches measure 232-259 a second (the closing note of this
        // change). The floor is above what leases gave when a class's demand was
        // read from its holders' asks (160-190), below what they give now.
        assert!(flood >= LIMIT / 2, "second {s}: flood {flood}: {report}");
    }
    // Refusals by a share are cached at the agent like any limit's: most decisions,
    // admissions and refusals, are made there.
    assert!(local_or_cached * 2 >= decisions, "most decisions local: {report}");
}
