//! What idle keys cost an agent: the memory of 1,000,000 keys that hold nothing (as
//! after their leases went back, before they are forgotten) and the renewer's CPU
//! while they sit, against the same agent without them, in the same run; and what a
//! new key costs with them held (its first request, the owner unreachable: the slot
//! is made and the route's failure policy answers).
//!
//! Run: `cargo bench -p limiter-gateway-agent --bench idle_keys` (prints its figures;
//! Linux: reads `/proc/self`).

#![allow(missing_docs)]

use std::time::Duration;

use limiter_gateway_agent::{Agent, AgentConfig, AgentRequest};

const KEYS: usize = 1_000_000;
const SPAN: Duration = Duration::from_secs(10);
/// New keys timed after the idle ones are in.
const NEW: usize = 20_000;

/// Resident memory, bytes.
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

/// CPU time used by the process so far (user and system), in clock ticks (1/100 s).
fn cpu_ticks() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// The share of one core the process used over `SPAN`, in percent.
fn cpu_over_span(rt: &tokio::runtime::Runtime) -> f64 {
    let (t0, c0) = (tokio::time::Instant::now(), cpu_ticks());
    rt.block_on(async { tokio::time::sleep(SPAN).await });
    let ticks = cpu_ticks() - c0;
    let elapsed = rt.block_on(async { t0.elapsed() });
    ticks as f64 / 100.0 / elapsed.as_secs_f64() * 100.0
}

fn main() {
    let rt =
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // Nothing listens there: the agent connects lazily and idle keys call nobody.
    let config = AgentConfig::new("http://127.0.0.1:9", "idle");
    let agent: Agent = rt.block_on(async { Agent::new(config).unwrap() });
    let without = cpu_over_span(&rt);
    let before = rss();
    let key_bytes = rt.block_on(async { agent.preload_idle_keys("tenant", "/route", KEYS) });
    let held = rss() - before;
    let with = cpu_over_span(&rt);
    let again = {
        // The same agent once more without new work: the figure's noise.
        cpu_over_span(&rt)
    };
    // New keys while the idle ones are held: the first requests open the breaker
    // (nothing listens), the rest are a slot made and the failure policy's answer.
    let names: Vec<String> = (0..NEW).map(|i| format!("new-{i:08}")).collect();
    let ask = |key: &str| {
        let req = AgentRequest { tenant: "tenant", route: "/route", key: Some(key), cost: 1 };
        rt.block_on(agent.decide(&req)).unwrap();
    };
    ask("warm-0");
    ask("warm-1");
    #[allow(clippy::disallowed_methods)] // measuring wall time
    let started = std::time::Instant::now();
    for k in &names {
        ask(k);
    }
    let per_new = started.elapsed().as_secs_f64() * 1e6 / NEW as f64;
    println!(
        "new keys with {KEYS} held: {per_new:.1} us each (slot made, failure policy answered)"
    );
    let per_key = held as f64 / KEYS as f64;
    println!(
        "idle keys: {KEYS} held, {per_key:.0} bytes each resident ({:.0} beyond the key's own {} \
         bytes of names); renewer and runtime CPU {with:.2}% and {again:.2}% of a core with them, \
         {without:.2}% without",
        per_key - key_bytes as f64 / KEYS as f64,
        key_bytes / KEYS,
    );
    drop(agent);
}
