//! Accuracy with leases: 10 agents against one owner, Zipf-skewed demand over 100
//! tenants, each offered twice its limit, on all four algorithms at once (one route
//! per algorithm). Admitted units per tenant never exceed the algorithm's allowance
//! (overshoot 0), and the agents together use at least 95% (97% for the token
//! bucket) of what an exact single-node limiter admits on the same arrivals.

mod common;

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::Duration;

use common::{Owner, agent};
use limiter_core::Limiter;
use limiter_core::clock::{Clock, MonotonicClock, NANOS_PER_SEC};
use limiter_core::policy::{NameBounds, Request, from_yaml};
use limiter_gateway_agent::{AgentRequest, Source};

const TENANTS: usize = 100;
const AGENTS: usize = 10;
const OFFERED_PER_SEC: f64 = 2_000.0;
const RUN: Duration = Duration::from_secs(8);
const ROUTES: [&str; 4] = ["/tb", "/fw", "/sl", "/sc"];

fn limits() -> Vec<u64> {
    let weights: Vec<f64> = (0..TENANTS).map(|i| 1.0 / ((i + 1) as f64).powf(1.1)).collect();
    let total: f64 = weights.iter().sum();
    // Per route, per second: half of what the tenant is offered there.
    weights
        .iter()
        .map(|w| ((OFFERED_PER_SEC * w / total / 4.0 / 2.0).round() as u64).max(1))
        .collect()
}

fn policy(limits: &[u64]) -> String {
    let mut p = String::from("version: 1\ntenants:\n");
    for (i, l) in limits.iter().enumerate() {
        let _ = write!(
            p,
            "  t{i}:\n    routes:\n      /tb: {{ algorithm: token_bucket, rate: {l}/s, burst: {l} }}\n      /fw: {{ algorithm: fixed_window, limit: {l}, window: 1s }}\n      /sl: {{ algorithm: sliding_log, limit: {}, window: 2s }}\n      /sc: {{ algorithm: sliding_counter, limit: {l}, window: 1s }}\n",
            2 * l
        );
    }
    p
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leased_agents_stay_within_the_allowance_and_use_it() {
    let limits = limits();
    let text = policy(&limits);
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(&text, clock.clone()).await;
    let agents: Vec<_> =
        (0..AGENTS).map(|i| agent(&owner.url(), &format!("gw{i}"), clock.clone())).collect();
    let names: Vec<String> = (0..TENANTS).map(|i| format!("t{i}")).collect();

    // Open loop: every millisecond, each (tenant, route) stream emits what its rate
    // owes, to a random gateway; each gateway decides its queue in its own task.
    let results = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let mut queues = Vec::new();
    let mut workers = Vec::new();
    for a in &agents {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(usize, usize)>();
        queues.push(tx);
        let (a, clock, names, results) = (a.clone(), clock.clone(), names.clone(), results.clone());
        workers.push(tokio::spawn(async move {
            while let Some((t, r)) = rx.recv().await {
                let req = AgentRequest { tenant: &names[t], route: ROUTES[r], key: None, cost: 1 };
                let before = clock.now();
                let o = a.decide(&req).await.unwrap();
                // A local spend happens at once; the owner charges a slow-path request
                // somewhere between the question and the answer.
                let after = if o.source == Source::Local { before } else { clock.now() };
                results.lock().push((t, r, before, after, o.allowed));
            }
        }));
    }
    let mut owed = vec![0.0f64; TENANTS * 4];
    let mut seed: u64 = 0x2545_f491_4f6c_dd1d;
    let start = clock.now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    let mut last = start;
    while clock.now() - start < RUN.as_nanos() as u64 {
        tick.tick().await;
        let now = clock.now();
        let dt = (now - last) as f64 / NANOS_PER_SEC as f64;
        last = now;
        for (s, o) in owed.iter_mut().enumerate() {
            *o += 2.0 * limits[s / 4] as f64 * dt;
            while *o >= 1.0 {
                *o -= 1.0;
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                queues[(seed % AGENTS as u64) as usize].send((s / 4, s % 4)).unwrap();
            }
        }
    }
    drop(queues);
    for w in workers {
        w.await.unwrap();
    }
    let mut arrivals = std::mem::take(&mut *results.lock());
    arrivals.sort_by_key(|a| a.2);
    // The exact single-node reference on the same arrivals.
    let policy = from_yaml(&text, "accuracy.yaml").unwrap();
    let reference = Limiter::new(100_000);
    let mut got = vec![[0u64; 4]; TENANTS];
    let mut exact = vec![[0u64; 4]; TENANTS];
    let mut times: HashMap<(usize, usize), Vec<(u64, u64)>> = HashMap::new();
    let mut span: HashMap<(usize, usize), (u64, u64)> = HashMap::new();
    for &(t, r, at, answered, admitted) in &arrivals {
        let chain =
            policy.resolve(&Request::new(&names[t], ROUTES[r]), &NameBounds::default()).unwrap();
        exact[t][r] += u64::from(reference.decide(&chain, at).admitted());
        got[t][r] += u64::from(admitted);
        if admitted {
            times.entry((t, r)).or_default().push((at, answered));
        }
        let e = span.entry((t, r)).or_insert((at, answered));
        e.1 = answered;
    }

    let mut report = String::new();
    for (r, name) in
        ["token_bucket", "fixed_window", "sliding_log", "sliding_counter"].iter().enumerate()
    {
        let mut overshoot = 0i64;
        for t in 0..TENANTS {
            let l = limits[t];
            let (first, last) = span[&(t, r)];
            let ts = times.get(&(t, r)).cloned().unwrap_or_default();
            let windows = |w: u64| last / w - first / w + 1;
            let allowance = match r {
                // burst + rate x span
                0 => l + l * (last - first) / NANOS_PER_SEC,
                1 | 3 => l * windows(NANOS_PER_SEC),
                _ => 2 * l * ((last - first) / (2 * NANOS_PER_SEC) + 1),
            };
            overshoot = overshoot.max(got[t][r] as i64 - allowance as i64);
            // The algorithm's own bound on the admitted instants, counting only what
            // certainly fell inside a window (asked and answered within it).
            match r {
                1 | 3 => {
                    let mut per: HashMap<u64, u64> = HashMap::new();
                    for &(b, a) in &ts {
                        if b / NANOS_PER_SEC == a / NANOS_PER_SEC {
                            *per.entry(b / NANOS_PER_SEC).or_default() += 1;
                        }
                    }
                    assert!(per.values().all(|&c| c <= l), "{name} t{t}: {per:?} over {l}");
                }
                2 => {
                    let w = 2 * NANOS_PER_SEC;
                    for &(_, end) in &ts {
                        let inside =
                            ts.iter().filter(|&&(b, a)| b + w > end && a <= end).count() as u64;
                        assert!(
                            inside <= 2 * l,
                            "{name} t{t}: {inside} in a window, limit {}",
                            2 * l
                        );
                    }
                }
                _ => {}
            }
        }
        let admitted: u64 = got.iter().map(|g| g[r]).sum();
        let ideal: u64 = exact.iter().map(|g| g[r]).sum();
        let offered = arrivals.iter().filter(|a| a.1 == r).count();
        let used = admitted as f64 / ideal as f64;
        let _ = writeln!(
            report,
            "{name:>16}: offered {offered}, exact single-node {ideal}, agents {admitted} ({:.1}%), max overshoot over the allowance {overshoot}",
            used * 100.0
        );
        assert!(overshoot <= 0, "{name}: overshoot {overshoot}\n{report}");
        let floor = if r == 0 { 0.97 } else { 0.95 };
        assert!(
            used >= floor,
            "{name}: used {:.1}% < {:.0}%\n{report}",
            used * 100.0,
            floor * 100.0
        );
    }
    let failed: u64 = agents.iter().map(|a| a.stats().failed_calls).sum();
    let fallback: u64 = agents.iter().map(|a| a.stats().fallback).sum();
    let _ = writeln!(report, "failed owner calls {failed}, fallback decisions {fallback}");
    let calls: u64 = agents.iter().map(|a| a.stats().owner_calls).sum();
    let local: u64 = agents.iter().map(|a| a.stats().local).sum();
    let _ = writeln!(
        report,
        "decisions {}, local {:.1}%, owner calls per 1000 decisions {:.1}",
        arrivals.len(),
        local as f64 * 100.0 / arrivals.len() as f64,
        calls as f64 * 1_000.0 / arrivals.len() as f64
    );
    println!("{report}");
}
