//! `ShouldAllow` throughput against the transport floor (an empty `Ping` RPC) on the
//! same in-process server, over real gRPC on loopback, in the same run.
//!
//! Each iteration batch runs `iters` calls from 64 concurrent tasks over one HTTP/2
//! connection; the figure is wall time per call, so throughput = 1 / time.
//!
//! Run: `cargo bench -p limiter-server --bench grpc`

#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use limiter_server::Server;
use limiter_server::config::ServerConfig;
use tonic::transport::Channel;

const CONCURRENCY: u64 = 64;
const KEYS: u64 = 1_000;

const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100000000/s, burst: 100000000 }
routes:
  /search:
    limit: { algorithm: sliding_counter, limit: 100000000, window: 1s }
tenants:
  acme:
    limit: { algorithm: token_bucket, rate: 100000000/s, burst: 100000000 }
    routes:
      /search: { algorithm: fixed_window, limit: 100000000, window: 1s }
    per_key: { algorithm: token_bucket, rate: 1000000/s, burst: 1000000 }
";

async fn start(dir: &std::path::Path) -> (limiter_server::Running, RateLimiterClient<Channel>) {
    let path = dir.join("policies.yaml");
    std::fs::write(&path, POLICY).unwrap();
    let config = ServerConfig::for_policy(&path).unwrap();
    let running = Server::new(config).unwrap().spawn_local().await.unwrap();
    let client = RateLimiterClient::connect(running.url()).await.unwrap();
    (running, client)
}

/// Runs `iters` calls of `call` from `CONCURRENCY` tasks; returns the wall time.
async fn drive<F, Fut>(iters: u64, call: F) -> Duration
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let call = Arc::new(call);
    #[allow(clippy::disallowed_methods)] // measuring wall time is the point here
    let start = Instant::now();
    let tasks: Vec<_> = (0..CONCURRENCY)
        .map(|t| {
            let call = call.clone();
            tokio::spawn(async move {
                let mut i = t;
                while i < iters {
                    call(i).await;
                    i += CONCURRENCY;
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    start.elapsed()
}

fn grpc(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_running, client) = rt.block_on(start(dir.path()));
    let keys: Arc<Vec<String>> = Arc::new((0..KEYS).map(|i| format!("user-{i}")).collect());

    let mut g = c.benchmark_group("grpc_unary_64_concurrent");
    g.throughput(Throughput::Elements(1));
    g.bench_function("ping_empty_rpc", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let client = client.clone();
            drive(iters, move |_| {
                let mut c = client.clone();
                async move {
                    c.ping(pb::PingRequest {}).await.unwrap();
                }
            })
        });
    });
    g.bench_function("should_allow_5_levels", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (client, keys) = (client.clone(), keys.clone());
            drive(iters, move |i| {
                let mut c = client.clone();
                let req = pb::ShouldAllowRequest {
                    tenant: "acme".into(),
                    route: "/search".into(),
                    key: keys[(i % KEYS) as usize].clone(),
                    ..Default::default()
                };
                async move {
                    let r = c.should_allow(req).await.unwrap().into_inner();
                    assert!(r.allowed);
                }
            })
        });
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(5))
        .sample_size(20);
    targets = grpc
}
criterion_main!(benches);
