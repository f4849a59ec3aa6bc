//! What the decision path pays for its spans when no trace is exported: a
//! `ShouldAllow` handled in-process (the service called directly, no transport) on a
//! chain of four levels, its `decide` span made (and disabled) in the handler.
//!
//! The build without the spans is the same bench without the `otlp` feature; run
//! both, alternating, and compare the figures:
//!
//! ```text
//! cargo bench -p limiter-server --bench tracing_off
//! cargo bench -p limiter-server --bench tracing_off --no-default-features
//! ```
//!
//! Each build also measures `Ping` (an empty handler), its baseline in the same run.
//! The subscriber is the server's own (`trace::init` without an endpoint: logs to
//! stderr, at `RUST_LOG` or `info`).

#![allow(missing_docs)]

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_server::RateLimiter as _;
use limiter_server::Server;
use limiter_server::api::native::NativeService;
use limiter_server::config::ServerConfig;

mod common;
use common::POLICY;

fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policies.yaml");
    std::fs::write(&path, POLICY).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let config = ServerConfig::for_policy(&path).unwrap();
    let (_traces, server) = {
        let _rt = rt.enter();
        // The subscriber the server installs: logs on stderr, no OTLP endpoint.
        let traces = limiter_server::trace::init(&config.tracing, "bench").unwrap();
        (traces, Server::new(config).unwrap())
    };
    let service = NativeService::new(server.owner().clone());
    let feature = if cfg!(feature = "otlp") { "with spans" } else { "without spans" };
    let mut g = c.benchmark_group(format!("tracing_off/{feature}"));
    let req = pb::ShouldAllowRequest {
        tenant: "acme".to_owned(),
        route: "/search".to_owned(),
        ..Default::default()
    };
    g.bench_function("ping", |b| {
        b.iter(|| {
            rt.block_on(service.ping(tonic::Request::new(pb::PingRequest {}))).unwrap();
        });
    });
    // One span of the exported target, as a handler makes it, around an empty future:
    // what a decision pays for its span while none is exported.
    g.bench_function("disabled_span", |b| {
        use tracing::Instrument as _;
        b.iter(|| {
            let span = tracing::info_span!(
                target: "limiter::otel",
                "decide",
                api = "native",
                tenant = %req.tenant,
                route = %req.route,
            );
            rt.block_on(async { black_box(1) }.instrument(span));
        });
    });
    g.bench_function("should_allow", |b| {
        b.iter(|| {
            let r = rt.block_on(service.should_allow(tonic::Request::new(req.clone()))).unwrap();
            black_box(r.into_inner().allowed);
        });
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
