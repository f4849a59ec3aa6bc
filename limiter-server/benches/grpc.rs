//! `ShouldAllow` throughput against the transport floor (an empty `Ping` RPC) on the
//! same in-process server, over real gRPC on loopback, in the same run.
//!
//! Each iteration batch runs `iters` calls from 64 concurrent tasks over one HTTP/2
//! connection; the figure is wall time per call, so throughput = 1 / time.
//!
//! The same `ShouldAllow` is also measured against a second server that serves TLS and
//! asks for a bearer token (`security.grpc.auth: token`), for the cost of both.
//!
//! Run: `cargo bench -p limiter-server --bench grpc` (needs the `openssl` command for
//! the test certificates).

#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use limiter_proto::connect::{AuthChannel, ClientSecurity};
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use limiter_server::Server;
use limiter_server::config::ServerConfig;

#[path = "../tests/common/pki.rs"]
mod pki;

mod common;
use common::POLICY;

const CONCURRENCY: u64 = 64;
const KEYS: u64 = 1_000;

type Client = RateLimiterClient<AuthChannel>;

/// A server on `POLICY` with `env` settings, and a client made with `security`.
async fn start(
    dir: &std::path::Path,
    env: &[(&str, String)],
    security: &ClientSecurity,
) -> (limiter_server::Running, Client) {
    let path = dir.join("policies.yaml");
    std::fs::write(&path, POLICY).unwrap();
    let mut vars = vec![("LIMITER__POLICY_FILE".to_owned(), path.display().to_string())];
    vars.extend(env.iter().map(|(k, v)| ((*k).to_owned(), v.clone())));
    let config = ServerConfig::load_with_env(None, vars).unwrap();
    let running = Server::new(config).unwrap().spawn_local().await.unwrap();
    let channel = security.endpoint(&running.grpc.to_string()).unwrap().connect().await.unwrap();
    let client = RateLimiterClient::new(tonic::service::interceptor::InterceptedService::new(
        channel,
        security.auth(),
    ));
    (running, client)
}

/// A server serving TLS and asking for a token, and a client that has both.
async fn start_secured(dir: &std::path::Path) -> (limiter_server::Running, Client) {
    let ca = pki::Ca::new(dir, "ca");
    let cert = ca.issue("server", &["localhost", "127.0.0.1"]);
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, "bench client bench-token\n").unwrap();
    let env = [
        ("LIMITER__SECURITY__TOKENS_FILE", tokens.display().to_string()),
        ("LIMITER__SECURITY__GRPC__CERT_FILE", cert.cert.display().to_string()),
        ("LIMITER__SECURITY__GRPC__KEY_FILE", cert.key.display().to_string()),
        ("LIMITER__SECURITY__GRPC__AUTH", "token".to_owned()),
    ];
    let security = ClientSecurity::tls(ca.pem()).with_token("bench-token").unwrap();
    start(dir, &env, &security).await
}

/// `ShouldAllow` on five levels, key `i` of `KEYS`.
fn allow_call(
    client: &Client,
    keys: &Arc<Vec<String>>,
    i: u64,
) -> impl Future<Output = ()> + use<> {
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
    let (_running, client) = rt.block_on(start(dir.path(), &[], &ClientSecurity::plaintext()));
    let secured_dir = tempfile::tempdir().unwrap();
    let (_secured, secured) = rt.block_on(start_secured(secured_dir.path()));
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
    for (name, client) in
        [("should_allow_5_levels", &client), ("should_allow_5_levels_tls_token", &secured)]
    {
        g.bench_function(name, |b| {
            b.to_async(&rt).iter_custom(|iters| {
                let (client, keys) = (client.clone(), keys.clone());
                drive(iters, move |i| allow_call(&client, &keys, i))
            });
        });
    }
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
