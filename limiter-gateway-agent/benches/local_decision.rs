//! A local decision on a lease hit against `governor`'s keyed check, on the same
//! 1,000 keys, single thread and two threads, in the same run.
//!
//! The agent runs against a real owner in-process (huge limits); only hits are
//! timed and counted: a miss (a lease running out) stops the clock while the agent
//! refills it, and is not one of the iterations (the figure is the cost of a hit).
//! Both read the time-stamp counter through `quanta`: the agent its production clock
//! (`Agent::new`), governor its default clock. `agent_amortised` (one thread) times
//! every decision, a miss's slow path included; the renewer's calls run on the
//! runtime's worker beside it, and the closing line counts them.
//!
//! Run: `cargo bench -p limiter-gateway-agent --bench local_decision`

#![allow(missing_docs)]

mod common;

use std::hint::black_box;
use std::num::NonZeroU32;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use governor::{Quota, RateLimiter};
use limiter_gateway_agent::{Agent, AgentRequest};

const KEYS: usize = 1_000;

const POLICY: &str = r"
version: 1
lease: { ttl: 5s, max_batch: 1000000000 }
tenants:
  t:
    per_key: { algorithm: token_bucket, rate: 1000000000/s, burst: 1000000000 }
";

/// Times `iters` local hits per thread over the keys; misses refill off the clock and
/// off the count.
fn run_agent(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    keys: &[String],
    threads: usize,
    iters: u64,
) -> Duration {
    // Wall time of the slowest thread: the same shape as governor's side.
    common::slowest(threads, |t| {
        let mut timed = Duration::ZERO;
        let mut i = t * (KEYS / threads.max(1));
        let mut done = 0;
        while done < iters {
            #[allow(clippy::disallowed_methods)] // measuring wall time
            let start = Instant::now();
            let mut missed = None;
            while done < iters {
                let req =
                    AgentRequest { tenant: "t", route: "/r", key: Some(&keys[i % KEYS]), cost: 1 };
                if black_box(agent.spend_local(&req)).is_none() {
                    missed = Some(i % KEYS);
                    break;
                }
                i += 1;
                done += 1;
            }
            timed += start.elapsed();
            if let Some(k) = missed {
                let req = AgentRequest { tenant: "t", route: "/r", key: Some(&keys[k]), cost: 1 };
                rt.block_on(agent.decide(&req)).unwrap();
                i += 1;
            }
        }
        timed
    })
}

/// Times `iters` decisions on one thread, misses included: a hit from the balance,
/// a miss through the agent's slow path (a renewal out, or an owner call) on the clock.
fn run_agent_amortised(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    keys: &[String],
    iters: u64,
) -> Duration {
    #[allow(clippy::disallowed_methods)] // measuring wall time
    let start = Instant::now();
    for i in 0..iters as usize {
        let req = AgentRequest { tenant: "t", route: "/r", key: Some(&keys[i % KEYS]), cost: 1 };
        if black_box(agent.spend_local(&req)).is_none() {
            black_box(rt.block_on(agent.decide(&req)).unwrap());
        }
    }
    start.elapsed()
}

fn run_governor<F: Fn(usize) -> bool + Sync>(threads: usize, iters: u64, check: F) -> Duration {
    common::slowest(threads, |t| {
        #[allow(clippy::disallowed_methods)] // measuring wall time
        let start = Instant::now();
        let offset = t * (KEYS / threads.max(1));
        for i in 0..iters as usize {
            black_box(check((offset + i) % KEYS));
        }
        start.elapsed()
    })
}

fn bench(c: &mut Criterion) {
    let s = common::setup(POLICY);
    let (rt, agent) = (&s.rt, &s.agent);
    let keys: Vec<String> = (0..KEYS).map(|i| format!("user-{i}")).collect();
    // Warm up: every key holds a lease, and demand estimates are high.
    for _ in 0..3 {
        run_agent(rt, agent, &keys, 1, 200_000);
    }
    let quota = Quota::per_second(NonZeroU32::new(1_000_000_000).unwrap());
    let gov = RateLimiter::dashmap(quota);
    for k in &keys {
        let _ = gov.check_key(k);
    }
    for threads in [1, 2] {
        let mut g = c.benchmark_group(format!("local_decision_{KEYS}_keys_{threads}_threads"));
        g.bench_function("agent_lease_hit", |b| {
            b.iter_custom(|iters| run_agent(rt, agent, &keys, threads, iters));
        });
        if threads == 1 {
            g.bench_function("agent_amortised", |b| {
                b.iter_custom(|iters| run_agent_amortised(rt, agent, &keys, iters));
            });
        }
        g.bench_function("governor_keyed", |b| {
            b.iter_custom(|iters| {
                run_governor(threads, iters, |i| gov.check_key(&keys[i]).is_ok())
            });
        });
        g.finish();
    }
    let st = agent.stats();
    println!("agent: {} local, {} slow, {} owner calls", st.local, st.slow, st.owner_calls);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3));
    targets = bench
}
criterion_main!(benches);
