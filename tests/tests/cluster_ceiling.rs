//! The global ceiling over three nodes and ten embedded agents under skewed load:
//! each node leases slices of the ceiling from its owner, each agent leases tokens
//! from its tenants' owners (through the node it talks to). Judged by the reference
//! (`limiter-reference`) at zero tolerance: every admitted request may have been
//! charged at any instant from a lease's hold before it was sent until it was
//! answered (units are paid when granted, `DESIGN.md`), and no choice of those
//! instants may break the bucket: `burst + rate x (interval + hold)` over every
//! interval, reported per second. The ceiling must also be used while the demand
//! swings between nodes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use limiter_gateway_agent::{AgentRequest, Source};
use limiter_reference::Spec;
use limiter_reference::judge::judge;
use tokio::time::Instant;

mod common;
use common::*;

/// The ceiling: 1000 units per second (burst 500); tenants are far above it.
const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 1000/s, burst: 500 }
lease: { ttl: 1s, max_batch: 200 }
unknown_tenants: use_default
routes:
  /r: {}
tenants:
  default:
    limit: { algorithm: token_bucket, rate: 100000/s, burst: 100000 }
";

const RATE: f64 = 1000.0;
/// The run, seconds: a warm-up ([`WARM_UP`]), the steady phase to [`SWING_AT`], the
/// swing's phase after it (its last second not counted: requests in flight at the end).
const RUN: u64 = 22;
/// Seconds before the steady phase is counted.
const WARM_UP: u64 = 2;
/// When half of the demand moves between nodes, seconds into the run. The steady
/// phase is 14 s: its count's edge effect (the units agents hold at either end, up to
/// about 100 of 7,000 over 7 s) was the floor's whole margin over a 7 s phase, and
/// the floor failed in suite runs at 0.9827 and 0.9847 while runs alone read 0.9936 on
/// average (2026-12-07); over 14 s the same units are half the share.
const SWING_AT: u64 = 16;
/// The policy's lease TTL: how long after its grant a leased unit may be spent.
const HOLD: Duration = Duration::from_secs(1);

/// A request: when it was sent, when it was answered, whether it was admitted.
type Sent = (Duration, Duration, bool);

/// Requests certainly admitted between `from` and `to` (seconds): sent after `from`
/// and answered before `to`.
fn certainly_admitted(log: &[Sent], from: f64, to: f64) -> u64 {
    let admitted = log.iter().filter(|(.., allowed)| *allowed);
    admitted.filter(|x| x.0.as_secs_f64() >= from && x.1.as_secs_f64() <= to).count() as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_global_ceiling_holds_across_three_nodes_and_ten_agents() {
    let dir = tempfile::tempdir().unwrap();
    let (_, nodes, procs) = start_nodes(dir.path(), POLICY, &["a", "b", "c"], &[]).await;
    // Ten agents, each talking to one node (agents 0, 3, 6, 9 to a).
    let agents = agents_over(&nodes, 10);
    // 30 tenants, skewed (Zipf, s = 1): tenant k gets weight 1/(k+1).
    let tenants: Vec<String> = (0..30).map(|k| format!("tenant-{k}")).collect();
    let weights: Vec<f64> = (0..30).map(|k| 1.0 / f64::from(k + 1)).collect();
    let total_w: f64 = weights.iter().sum();

    // Offered: twice the ceiling. Phase 1 (to `SWING_AT`): a's agents carry 60%. Phase
    // 2 (to `RUN`): half of the demand moves from a's agents to b's.
    let offered = 2.0 * RATE;
    let share = |agent: usize, swung: bool| -> f64 {
        let node = agent % 3;
        let on_node = [4.0, 3.0, 3.0][node];
        let node_share = if swung { [0.1, 0.6, 0.3][node] } else { [0.6, 0.1, 0.3][node] };
        node_share / on_node
    };
    let start = Instant::now();
    let windows: Arc<Vec<AtomicU64>> = Arc::new((0..RUN).map(|_| AtomicU64::new(0)).collect());
    let local = Arc::new(AtomicU64::new(0));
    let fallback = Arc::new(AtomicU64::new(0));
    // Every request's send and answer times and whether it was admitted.
    let sent_log: Arc<parking_lot::Mutex<Vec<Sent>>> = Arc::default();
    let total = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for (i, agent) in agents.iter().enumerate() {
        let (agent, windows, local, total) =
            (agent.clone(), windows.clone(), local.clone(), total.clone());
        let fallback = fallback.clone();
        let (tenants, weights, sent_log) = (tenants.clone(), weights.clone(), sent_log.clone());
        tasks.push(tokio::spawn(async move {
            let mut requests = tokio::task::JoinSet::new();
            let mut n: u64 = 0;
            let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ (i as u64);
            loop {
                let t = start.elapsed().as_secs_f64();
                if t >= RUN as f64 {
                    // Every request is answered and counted before the judging.
                    while let Some(r) = requests.join_next().await {
                        r.unwrap();
                    }
                    return;
                }
                // Open loop: the n-th request of this agent is due at n / rate.
                let rate = offered * share(i, t >= SWING_AT as f64);
                let due = n as f64 / rate;
                if due > t {
                    tokio::time::sleep(Duration::from_secs_f64((due - t).min(0.01))).await;
                    continue;
                }
                n += 1;
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                let mut pick = (seed >> 11) as f64 / (1u64 << 53) as f64 * total_w;
                let mut k = 0;
                while k < 29 && pick >= weights[k] {
                    pick -= weights[k];
                    k += 1;
                }
                let (agent, windows, local, total) =
                    (agent.clone(), windows.clone(), local.clone(), total.clone());
                let fallback = fallback.clone();
                let tenant = tenants[k].clone();
                let (sent_log, sent) = (sent_log.clone(), start.elapsed());
                requests.spawn(async move {
                    let req = AgentRequest { tenant: &tenant, route: "/r", key: None, cost: 1 };
                    let o = agent.decide(&req).await.unwrap();
                    sent_log.lock().push((sent, start.elapsed(), o.allowed));
                    total.fetch_add(1, Ordering::Relaxed);
                    if o.source == Source::Local {
                        local.fetch_add(1, Ordering::Relaxed);
                    }
                    if o.source == Source::Fallback {
                        fallback.fetch_add(1, Ordering::Relaxed);
                    }
                    let w = start.elapsed().as_secs() as usize;
                    if o.allowed && w < RUN as usize {
                        windows[w].fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let per: Vec<u64> = windows.iter().map(|w| w.load(Ordering::Relaxed)).collect();
    let log = sent_log.lock().clone();
    let spends = admitted_spends(&log, HOLD);
    let ceiling = Spec::TokenBucket { amount: 1000, period: 1_000_000_000, burst: 500 };
    let verdict = judge(ceiling, &spends, 1_000_000_000);
    let by_second: Vec<(u64, u64)> = verdict
        .by_window
        .iter()
        .map(|&(w, u)| ((w - ticks(Duration::ZERO)) / 1_000_000_000, u))
        .collect();
    let (warm, swing_at, end) = (WARM_UP as f64, SWING_AT as f64, (RUN - 1) as f64);
    let steady = certainly_admitted(&log, warm, swing_at);
    let swing = certainly_admitted(&log, swing_at, end);
    let (steady_allowed, swing_allowed) = ((swing_at - warm) * RATE, (end - swing_at) * RATE);
    let local_share = local.load(Ordering::Relaxed) as f64 / total.load(Ordering::Relaxed) as f64;
    println!(
        "admitted per second: {per:?}\nover the ceiling (units no instant within a hold of \
         their send could admit), per second: {:?}, {} in all of {}\nsteady \
         ({WARM_UP}-{SWING_AT} s): at least {steady} admitted = {:.4} x the ceiling; swing \
         ({SWING_AT}-{end} s): at least {swing} = {:.4} (requests sent and answered inside \
         the interval); decided locally {:.1}%",
        by_second,
        verdict.overshoot,
        verdict.units,
        steady as f64 / steady_allowed,
        swing as f64 / swing_allowed,
        local_share * 100.0
    );
    let failed: u64 = agents.iter().map(|a| a.stats().failed_calls).sum();
    println!(
        "{} decisions by the failure policy; {failed} lease calls failed",
        fallback.load(Ordering::Relaxed)
    );
    assert!(fallback.load(Ordering::Relaxed) <= 2, "owners stayed reachable");
    for p in &procs {
        let mut line = String::new();
        for fate in ["granted", "returned", "spent", "written_off"] {
            let v = p.metric("limiter_lease_units_total", &[fate]).await;
            line.push_str(&format!("{fate} {v} "));
        }
        for o in ["granted", "refused", "unreachable", "redirected"] {
            let v = p.metric("limiter_slice_calls_total", &[o]).await;
            line.push_str(&format!("slice-{o} {v} "));
        }
        println!("{line}");
    }
    // Zero tolerance: not one unit over the bucket, per the design's bound.
    assert_eq!(verdict.overshoot, 0, "over the ceiling per second (s, units): {by_second:?}");
    // The ceiling is used: what was certainly admitted inside each interval (the
    // burst in the bucket at either end moves the 14 s count by up to about 0.75%, the
    // 5 s swing's by up to about 2%).
    assert!(steady as f64 >= 0.985 * steady_allowed, "steady: {steady} admitted");
    assert!(swing as f64 >= 0.95 * swing_allowed, "swing: {swing} admitted");
    for a in &agents {
        a.shutdown().await;
    }
}
