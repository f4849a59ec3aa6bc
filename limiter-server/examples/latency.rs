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

/// Runs `call(caller, i)` from 16 closed-loop callers for `run`; every call's latency.
async fn measure<F, Fut>(run: Duration, call: F) -> anyhow::Result<Vec<Duration>>
where
    F: Fn(u64, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let tasks: Vec<_> = (0..16)
        .map(|t| {
            let call = call.clone();
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let start = Instant::now();
                let mut i = 0;
                while start.elapsed() < run {
                    let at = Instant::now();
                    call(t, i).await;
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
    Ok(all)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, POLICY)?;
    let config = ServerConfig::for_policy(&path)?;
    let running = Server::new(config)?.spawn_local().await?;
    let url = running.url();
    let run = Duration::from_secs(5);

    let envoy = RateLimitServiceClient::connect(url.clone()).await?;
    let lat = measure(run, move |t, i| {
        let mut c = envoy.clone();
        async move {
            let d = RateLimitDescriptor {
                entries: vec![
                    Entry { key: "route".into(), value: "/search".into() },
                    Entry { key: "user".into(), value: format!("u{}", (t * 1_000 + i) % 5_000) },
                ],
                limit: None,
                hits_addend: None,
            };
            let req =
                RateLimitRequest { domain: "acme".into(), descriptors: vec![d], hits_addend: 1 };
            c.should_rate_limit(req).await.expect("answer");
        }
    })
    .await?;
    percentiles("ShouldRateLimit", lat);

    let native = RateLimiterClient::connect(url).await?;
    let n = native.clone();
    let lat = measure(run, move |t, i| {
        let mut c = n.clone();
        async move {
            let req = pb::ShouldAllowRequest {
                tenant: "acme".into(),
                route: "/search".into(),
                key: format!("u{}", (t * 1_000 + i) % 5_000),
                ..Default::default()
            };
            c.should_allow(req).await.expect("answer");
        }
    })
    .await?;
    percentiles("ShouldAllow", lat);

    // The transport floor: the same server answering an empty call.
    let lat = measure(run, move |_, _| {
        let mut c = native.clone();
        async move {
            c.ping(pb::PingRequest {}).await.expect("answer");
        }
    })
    .await?;
    percentiles("Ping (empty RPC)", lat);
    Ok(())
}
