//! Fair shares near the limit: ten agents share one tenant whose demand, split 1:2:...:10
//! between them, is twice its limit. Each agent's admissions must follow its demand
//! (within 10% of its demand's share of the limit, after a warm-up) and no agent may
//! fall below half of its fair share in any whole second; the admissions together
//! stay within the limit (judged by the independent reference, per second) and use
//! it.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{Owner, agent, placement};
use limiter_core::clock::{Clock, MonotonicClock, NANOS_PER_SEC};
use limiter_gateway_agent::{AgentRequest, Source};
use limiter_reference::judge::judge;
use limiter_reference::{Level, Spec};

const AGENTS: u64 = 10;
const LIMIT: u64 = 200;
const RUN_SECS: u64 = 12;
const WARM_UP_SECS: u64 = 2;
/// The policy's lease TTL (the default).
const TTL: u64 = 2 * NANOS_PER_SEC;

const POLICY: &str = "version: 1
tenants:
  shared:
    routes:
      /r: { algorithm: token_bucket, rate: 200/s, burst: 200 }
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_share_a_tenant_near_its_limit_in_proportion_to_their_demand() {
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(POLICY, clock.clone()).await;
    let weights: Vec<u64> = (1..=AGENTS).collect();
    let total: u64 = weights.iter().sum();
    let offered_per_sec = 2 * LIMIT;

    // Open loop: every millisecond each agent is sent what its rate owes (agent i:
    // i / 55 of twice the limit), decided in its own task.
    let mut tasks = Vec::new();
    let into_second = clock.now() % NANOS_PER_SEC;
    tokio::time::sleep(Duration::from_nanos(NANOS_PER_SEC - into_second)).await;
    let start = clock.now();
    for (i, &w) in weights.iter().enumerate() {
        let a = agent(&owner.url(), &format!("gw{i}"), clock.clone());
        let clock = clock.clone();
        tasks.push(tokio::spawn(async move {
            let rate = (offered_per_sec * w) as f64 / total as f64;
            let mut owed = 0.0f64;
            let mut out = Vec::new();
            let mut tick = tokio::time::interval(Duration::from_millis(1));
            let mut last = clock.now();
            while clock.now() - start < RUN_SECS * NANOS_PER_SEC {
                tick.tick().await;
                let now = clock.now();
                owed += rate * (now - last) as f64 / NANOS_PER_SEC as f64;
                last = now;
                while owed >= 1.0 {
                    owed -= 1.0;
                    let req = AgentRequest { tenant: "shared", route: "/r", key: None, cost: 1 };
                    let before = clock.now();
                    let o = a.decide(&req).await.unwrap();
                    out.push((before, clock.now(), o.allowed, o.source == Source::Local));
                }
            }
            let stats = a.stats();
            a.shutdown().await;
            (out, stats)
        }));
    }
    let mut per_agent = Vec::new();
    for t in tasks {
        per_agent.push(t.await.unwrap());
    }

    // Within the limit: every admission placed where it may have been charged.
    let spec = Spec::TokenBucket { amount: LIMIT, period: NANOS_PER_SEC, burst: LIMIT };
    let mut spends = Vec::new();
    let mut arrivals = Vec::new();
    for (out, _) in &per_agent {
        for &(before, after, allowed, local) in out {
            arrivals.push(before);
            if allowed {
                spends.push(placement(spec, local, before, after, TTL));
            }
        }
    }
    let verdict = judge(spec, &spends, NANOS_PER_SEC);
    arrivals.sort_unstable();
    let mut reference = Level::new(spec);
    let ideal: u64 = arrivals.iter().map(|&at| u64::from(reference.try_take(at, 1))).sum();

    // Shares after the warm-up, and the worst second of each agent.
    let from = start + WARM_UP_SECS * NANOS_PER_SEC;
    let seconds = RUN_SECS - WARM_UP_SECS;
    let admitted: Vec<Vec<u64>> = per_agent
        .iter()
        .map(|(out, _)| {
            let mut per_sec = vec![0u64; seconds as usize];
            for &(before, _, allowed, _) in out {
                if allowed && before >= from {
                    let s = ((before - from) / NANOS_PER_SEC) as usize;
                    if s < per_sec.len() {
                        per_sec[s] += 1;
                    }
                }
            }
            per_sec
        })
        .collect();
    let sum: u64 = admitted.iter().flatten().sum();
    let mut report = format!(
        "over the limit {} (of {} admitted, reference {ideal}); after {WARM_UP_SECS} s:\n",
        verdict.overshoot,
        spends.len()
    );
    let mut failures = Vec::new();
    for (i, (per_sec, (_, stats))) in admitted.iter().zip(&per_agent).enumerate() {
        let mine: u64 = per_sec.iter().sum();
        let share = mine as f64 / sum as f64;
        let fair = weights[i] as f64 / total as f64;
        let fair_per_sec = LIMIT as f64 * fair;
        let worst = *per_sec.iter().min().unwrap();
        report.push_str(&format!(
            "  gw{i} (demand {:>2}/55): share {:.3} (demand's {fair:.3}, {:+.1}%), worst second {worst} \
             (fair {fair_per_sec:.1}), local {} + {} refused, {} owner calls\n",
            weights[i],
            share,
            (share / fair - 1.0) * 100.0,
            stats.local,
            stats.refused_locally,
            stats.owner_calls,
        ));
        if (share / fair - 1.0).abs() > 0.10 {
            failures.push(format!("gw{i}: share {share:.3} against {fair:.3}"));
        }
        if (worst as f64) < fair_per_sec / 2.0 {
            failures.push(format!("gw{i}: a second with {worst} < half of {fair_per_sec:.1}"));
        }
    }
    println!("{report}");
    assert_eq!(verdict.overshoot, 0, "{report}");
    assert!(failures.is_empty(), "{failures:?}\n{report}");
    let used = spends.len() as f64 / ideal as f64;
    assert!(used >= 0.97, "used {:.1}% of what the reference admits\n{report}", used * 100.0);
}
