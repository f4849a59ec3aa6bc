//! Latency percentiles of `ShouldRateLimit` (Envoy's call, whose default timeout is
//! 20 ms) and `ShouldAllow` against a server started in this process, over loopback.
//!
//! ```text
//! cargo run --release -p limiter-server --example latency
//! ```
//!
//! 16 callers, each sending one call after another (closed loop) for 5 seconds per API,
//! then the same against `Ping`, an empty call: the transport floor.

#![allow(clippy::disallowed_methods)] // wall-clock latency is what is measured

use std::time::{Duration, Instant};

use limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use limiter_proto::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use limiter_server::Server;
use limiter_server::config::ServerConfig;

const POLICY: &str = r"
version: 1
routes:
  /search:
    limit: { algorithm: sliding_counter, limit: 100000000, window: 1s }
tenants:
  acme:
    limit: { algorithm: token_bucket, rate: 100000000/s, burst: 100000000 }
    per_key: { algorithm: token_bucket, rate: 1000000/s, burst: 1000000 }
";

fn percentiles(name: &str, mut v: Vec<Duration>) {
    v.sort_unstable();
    let at = |q: f64| v[((v.len() as f64 * q) as usize).min(v.len() - 1)];
    println!(
        "{name}: {} calls, p50 {:?}, p90 {:?}, p99 {:?}, p99.9 {:?}, max {:?}",
        v.len(),
        at(0.5),
        at(0.9),
        at(0.99),
        at(0.999),
        v[v.len() - 1]
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, POLICY)?;
    let config = ServerConfig::load_with_env(
        None,
        [("LIMITER__POLICY_FILE".to_owned(), path.display().to_string())],
    )?;
    let running = Server::new(config)?.spawn_local().await?;
    let url = running.url();
    let run = Duration::from_secs(5);

    let envoy = RateLimitServiceClient::connect(url.clone()).await?;
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let mut c = envoy.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut i = 0u64;
                while start.elapsed() < run {
                    let d = RateLimitDescriptor {
                        entries: vec![
                            Entry { key: "route".into(), value: "/search".into() },
                            Entry {
                                key: "user".into(),
                                value: format!("u{}", (t * 1_000 + i) % 5_000),
                            },
                        ],
                        limit: None,
                        hits_addend: None,
                    };
                    let req = RateLimitRequest {
                        domain: "acme".into(),
                        descriptors: vec![d],
                        hits_addend: 1,
                    };
                    let at = Instant::now();
                    c.should_rate_limit(req).await.expect("answer");
                    lat.push(at.elapsed());
                    i += 1;
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    percentiles("ShouldRateLimit", all);

    let native = RateLimiterClient::connect(url).await?;
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let mut c = native.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut i = 0u64;
                while start.elapsed() < run {
                    let req = pb::ShouldAllowRequest {
                        tenant: "acme".into(),
                        route: "/search".into(),
                        key: format!("u{}", (t * 1_000 + i) % 5_000),
                        ..Default::default()
                    };
                    let at = Instant::now();
                    c.should_allow(req).await.expect("answer");
                    lat.push(at.elapsed());
                    i += 1;
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    percentiles("ShouldAllow", all);

    // The transport floor: the same server answering an empty call.
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let mut c = native.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let start = Instant::now();
                while start.elapsed() < run {
                    let at = Instant::now();
                    c.ping(pb::PingRequest {}).await.expect("answer");
                    lat.push(at.elapsed());
                }
                lat
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await?);
    }
    percentiles("Ping (empty RPC)", all);
    Ok(())
}
