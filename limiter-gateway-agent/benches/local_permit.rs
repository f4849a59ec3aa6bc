//! A permit taken from and returned to the agent's local pool against a
//! `tokio::sync::Semaphore`'s `try_acquire` and drop, single thread and two threads
//! on one key (one semaphore), in the same run: by the key (`acquire_local`: the
//! key's lookup each time) and through a handle on the key's pool (`PermitHandle`,
//! held like the semaphore).
//!
//! The agent runs against a real owner in-process (a concurrency level far above
//! what the threads hold); its side pays what a request pays: the key's lookup
//! (hash, shard lock, probe), the CAS that lends the permit, and the subtraction
//! that returns it. A miss (the pool growing) stops the clock while the agent asks
//! the owner, and is not one of the iterations.
//!
//! Run: `cargo bench -p limiter-gateway-agent --bench local_permit`

#![allow(missing_docs)]

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use limiter_gateway_agent::{Agent, AgentRequest};

const POLICY: &str = r"
version: 1
tenants:
  t:
    routes:
      /pool: { algorithm: concurrency, limit: 1000000, permit_ttl: 60s }
";

const REQ: AgentRequest<'static> = AgentRequest { tenant: "t", route: "/pool", key: None, cost: 1 };

/// Times `iters` local acquire-and-release pairs per thread (`take` takes a permit
/// and gives it back: whether it found one); a miss asks the owner off the clock and
/// off the count.
fn run_agent(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    threads: usize,
    iters: u64,
    take: impl Fn() -> bool + Sync,
) -> Duration {
    common::slowest(threads, |_| {
        let mut timed = Duration::ZERO;
        let mut done = 0;
        while done < iters {
            #[allow(clippy::disallowed_methods)] // measuring wall time
            let start = Instant::now();
            let mut missed = false;
            while done < iters {
                if !take() {
                    missed = true;
                    break;
                }
                done += 1;
            }
            timed += start.elapsed();
            if missed {
                let o = rt.block_on(agent.decide(&REQ)).unwrap();
                assert!(o.allowed, "the pool grows: {o:?}");
            }
        }
        timed
    })
}

fn run_semaphore(sem: &tokio::sync::Semaphore, threads: usize, iters: u64) -> Duration {
    common::slowest(threads, |_| {
        #[allow(clippy::disallowed_methods)] // measuring wall time
        let start = Instant::now();
        for _ in 0..iters {
            drop(black_box(sem.try_acquire()).unwrap());
        }
        start.elapsed()
    })
}

fn bench(c: &mut Criterion) {
    let s = common::setup(POLICY);
    let (rt, agent) = (&s.rt, &s.agent);
    // The pool holds a block before timing starts.
    let first = rt.block_on(agent.decide(&REQ)).unwrap();
    assert!(first.allowed && first.permit.is_some(), "{first:?}");
    drop(first);
    let by_key = || black_box(agent.acquire_local(&REQ)).is_some();
    run_agent(rt, agent, 2, 100_000, by_key);
    let handle = agent.permit_handle(&REQ).expect("the key has a pool");
    let sem = tokio::sync::Semaphore::new(1_000_000);
    for threads in [1, 2] {
        let mut g = c.benchmark_group(format!("local_permit_{threads}_threads"));
        g.bench_function("agent_pool", |b| {
            b.iter_custom(|iters| run_agent(rt, agent, threads, iters, by_key));
        });
        g.bench_function("agent_pool_handle", |b| {
            let by_handle = || black_box(handle.try_acquire(1)).is_some();
            b.iter_custom(|iters| run_agent(rt, agent, threads, iters, by_handle));
        });
        g.bench_function("tokio_semaphore", |b| {
            b.iter_custom(|iters| run_semaphore(&sem, threads, iters));
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
