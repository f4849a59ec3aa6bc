//! The Redis store's throughput against its floor, in one run on one machine:
//!
//! - floor: `redis-benchmark` sending `EVALSHA` of a trivial script (`return 1`) to the
//!   same `redis-server`, 64 clients; and the same tool sending our chain script for
//!   one decision (what Redis itself can do of our work);
//! - one server in this process on that Redis, `ShouldAllow` over loopback gRPC from
//!   64 concurrent callers: per request (every decision a script call) over one and
//!   over four multiplexed connections, and over a `bb8` pool of 16 connections (one
//!   call at a time on each), then with batches leased from Redis (and the
//!   Redis calls per 1000 decisions, from Redis's own `INFO commandstats`);
//! - the memory store on the same calls, for reference.
//!
//! ```text
//! cargo run --release -p limiter-server --example redis_bench
//! ```

#![allow(clippy::disallowed_methods)] // wall-clock throughput is what is measured

#[path = "../tests/common/redis.rs"]
mod redis_proc;

use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use limiter_server::Server;
use limiter_server::config::ServerConfig;
use redis_proc::{RedisServer, command, script_calls};

const POLICY: &str = r"
version: 1
tenants:
  acme:
    limit: { algorithm: token_bucket, rate: 100000000/s, burst: 100000000 }
    per_key: { algorithm: fixed_window, limit: 100000000, window: 1h }
";
const CALLERS: u64 = 64;
const KEYS: u64 = 1_000;
const PHASE: Duration = Duration::from_secs(4);
const WARM: Duration = Duration::from_secs(2);

/// `redis-benchmark`'s requests per second for one command.
fn redis_benchmark(port: u16, args: &[&str]) -> f64 {
    let out = Command::new("redis-benchmark")
        .args(["-p", &port.to_string(), "-c", "64", "-n", "200000", "-q"])
        .args(args)
        .output()
        .expect("redis-benchmark is installed (redis-tools)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("requests per second")
        .next()
        .and_then(|s| s.rsplit(':').next())
        .and_then(|s| s.trim().rsplit(' ').next())
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("cannot read redis-benchmark's output: {text}"))
}

fn load_script(port: u16, body: &str) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string(), "SCRIPT", "LOAD", body])
        .output()
        .expect("redis-cli is installed");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Decisions per second of a server configured by `env`, and the Redis calls made.
async fn server_rate(
    dir: &std::path::Path,
    policy: &str,
    env: &[(&str, String)],
    port: u16,
) -> (f64, u64, u64) {
    let path = dir.join("policies.yaml");
    std::fs::write(&path, policy).unwrap();
    let mut vars = vec![("LIMITER__POLICY_FILE".to_owned(), path.display().to_string())];
    vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let config = ServerConfig::load_with_env(None, vars).unwrap();
    let running = Server::new(config).unwrap().spawn_local().await.unwrap();
    let client = RateLimiterClient::connect(running.url()).await.unwrap();
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("user-{i}")).collect());
    // Warm up (connections, script load).
    for k in keys.iter().take(100) {
        let req = pb::ShouldAllowRequest {
            tenant: "acme".into(),
            route: "/search".into(),
            key: k.clone(),
            ..Default::default()
        };
        client.clone().should_allow(req).await.unwrap();
    }
    // The same load untimed for a while first: batches reach their steady size.
    load(&client, &keys, WARM).await;
    let calls_before = script_calls(port);
    let started = Instant::now();
    let n = load(&client, &keys, PHASE).await;
    let secs = started.elapsed().as_secs_f64();
    let calls = script_calls(port).saturating_sub(calls_before);
    running.stop().await.unwrap();
    (n as f64 / secs, n, calls)
}

/// `CALLERS` closed-loop callers over `keys` for `period`; returns the decisions made.
async fn load(
    client: &RateLimiterClient<tonic::transport::Channel>,
    keys: &Arc<Vec<String>>,
    period: Duration,
) -> u64 {
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let tasks: Vec<_> = (0..CALLERS)
        .map(|t| {
            let (mut c, keys, done) = (client.clone(), keys.clone(), done.clone());
            tokio::spawn(async move {
                let mut i = t;
                while started.elapsed() < period {
                    let req = pb::ShouldAllowRequest {
                        tenant: "acme".into(),
                        route: "/search".into(),
                        key: keys[(i % KEYS) as usize].clone(),
                        ..Default::default()
                    };
                    let r = c.should_allow(req).await.unwrap().into_inner();
                    assert!(r.allowed);
                    done.fetch_add(1, Ordering::Relaxed);
                    i += CALLERS;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    done.load(Ordering::Relaxed)
}

#[tokio::main]
async fn main() {
    let redis = RedisServer::start();
    let port = redis.port;
    let trivial = load_script(port, "return 1");
    let floor = redis_benchmark(port, &["EVALSHA", &trivial, "0"]);
    let chain = load_script(port, limiter_server::store::redis::SCRIPT);
    let ours = redis_benchmark(
        port,
        &[
            "EVALSHA",
            &chain,
            "2",
            "lim:{t.acme}:t:4.acme:0.:0.:tb.1.10.100000000",
            "lim:{t.acme}:k:4.acme:7./search:7.user-1:fw.100000000.3600000000.0",
            "decide",
            "-1",
            // cost 1, not a dry run, then the eight arguments other ops use
            "1",
            "0",
            "0",
            "0",
            "0",
            "0",
            "0",
            "0",
            "0",
            "0",
            "tb",
            "1",
            "10",
            "100000000",
            "fw",
            "100000000",
            "3600000000",
            "0",
        ],
    );
    let _ = command(port, "FLUSHALL");
    let dir = tempfile::tempdir().unwrap();
    let redis_env = |pool: &str, connections: u32, batches: bool| {
        vec![
            ("LIMITER__STORE__KIND", "redis".to_owned()),
            ("LIMITER__STORE__REDIS__URL", redis.url()),
            ("LIMITER__STORE__REDIS__POOL", pool.to_owned()),
            ("LIMITER__STORE__REDIS__CONNECTIONS", connections.to_string()),
            ("LIMITER__STORE__REDIS__BATCHES", batches.to_string()),
        ]
    };
    let d = dir.path();
    let one = server_rate(d, POLICY, &redis_env("multiplexed", 1, false), port).await;
    let four = server_rate(d, POLICY, &redis_env("multiplexed", 4, false), port).await;
    let pooled = server_rate(d, POLICY, &redis_env("bb8", 16, false), port).await;
    let batched = server_rate(d, POLICY, &redis_env("multiplexed", 2, true), port).await;
    let longer = format!("{POLICY}lease: {{ mode: leased, ttl: 5s, max_batch: 1000 }}\n");
    let batched5 = server_rate(d, &longer, &redis_env("multiplexed", 2, true), port).await;
    let memory = server_rate(d, POLICY, &[], port).await;
    let cores = std::thread::available_parallelism().map_or(0, usize::from);
    println!(
        "Redis store throughput, {cores} cores, {CALLERS} concurrent callers, {KEYS} keys, {} s per phase after {} s of warm-up",
        PHASE.as_secs(),
        WARM.as_secs()
    );
    println!();
    println!("| what | per second | ratio to the floor |");
    println!("| --- | ---: | ---: |");
    println!("| floor: redis-benchmark EVALSHA `return 1` (64 clients) | {floor:.0} | 1.00 |");
    println!(
        "| redis-benchmark EVALSHA of our chain script, one decision of two levels | {ours:.0} | {:.2} |",
        ours / floor
    );
    for (name, (rate, n, calls)) in [
        ("server on Redis, per request, 1 multiplexed connection", one),
        ("server on Redis, per request, 4 multiplexed connections", four),
        ("server on Redis, per request, bb8 pool of 16 connections", pooled),
        ("server on Redis, batches leased from Redis (lease ttl 2 s, the default)", batched),
        ("server on Redis, batches leased from Redis (lease ttl 5 s)", batched5),
        ("server on the memory store (reference)", memory),
    ] {
        let per_1000 = if n > 0 { calls as f64 * 1000.0 / n as f64 } else { 0.0 };
        println!(
            "| {name} | {rate:.0} | {:.2} | ({per_1000:.1} Redis calls per 1000 decisions)",
            rate / floor
        );
    }
}
