//! Logs and traces. Logs go to stderr, filtered by `RUST_LOG`. With
//! `tracing.otlp_endpoint` set (and the `otlp` feature, on by default), the spans of
//! a decision (`decide`), a forward to another node (`forward`), a store call
//! (`store`) and a lease call or slice renewal (`lease`, `slice_renewal`) are exported
//! to an OpenTelemetry collector over OTLP/gRPC, with the tenant and the route as span
//! attributes (never metric labels). A call's W3C `traceparent` is taken from its gRPC
//! metadata and sent on with forwards, so one trace crosses nodes.
//!
//! Spans use their own target ([`TARGET`]), which the log output never records:
//! without an endpoint no layer wants them, so a span costs one check of its
//! callsite's interest and its fields are never evaluated.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// The `tracing` section of the configuration (`crate::config` reads and checks it): OpenTelemetry traces exported over OTLP/gRPC.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// The collector's `http://host:port` (none: no spans are made or exported).
    pub otlp_endpoint: Option<String>,
    /// The fraction of traces started here that are kept (0 to 1); a call whose
    /// `traceparent` says sampled is kept whatever this says.
    pub sample_ratio: f64,
    /// The `service.name` of the spans.
    pub service_name: String,
    /// Deadline of one export.
    pub export_timeout: Duration,
}

/// The target of every exported span.
pub(crate) const TARGET: &str = "limiter::otel";

/// Whether spans are exported (set once, at start).
#[cfg_attr(not(feature = "otlp"), allow(dead_code))]
static ON: AtomicBool = AtomicBool::new(false);

/// Whether spans are exported.
#[cfg_attr(not(feature = "otlp"), allow(dead_code))]
pub(crate) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The most of a caller's text a span attribute keeps (names are checked against
/// their bounds after the span is made; a span never holds a whole message).
const MAX_ATTRIBUTE: usize = 256;

/// `text` cut to [`MAX_ATTRIBUTE`] bytes at a character boundary, for a span
/// attribute. Evaluated only when the span is enabled.
#[cfg_attr(not(feature = "otlp"), allow(dead_code))]
pub(crate) fn short(text: &str) -> &str {
    if text.len() <= MAX_ATTRIBUTE {
        return text;
    }
    let mut end = MAX_ATTRIBUTE;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A span of [`TARGET`] (an enabled one only while spans are exported); without the
/// `otlp` feature, no span at all.
macro_rules! span {
    ($name:literal $(, $($fields:tt)*)?) => {{
        #[cfg(feature = "otlp")]
        let s = tracing::info_span!(target: "limiter::otel", $name $(, $($fields)*)?);
        // The fields are still named (and type-checked), never evaluated.
        #[cfg(not(feature = "otlp"))]
        let s = {
            if false {
                drop(tracing::info_span!(target: "limiter::otel", $name $(, $($fields)*)?));
            }
            tracing::Span::none()
        };
        s
    }};
}
pub(crate) use span;

/// Flushes the exported spans when dropped (at the end of `main`).
#[must_use = "spans are flushed when the guard is dropped"]
pub struct Guard {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard").finish_non_exhaustive()
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            tracing::warn!("flushing spans at exit: {e}");
        }
    }
}

fn log_filter() -> tracing_subscriber::EnvFilter {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Spans are for the exporter only, whatever RUST_LOG asks.
    match format!("{TARGET}=off").parse() {
        Ok(d) => filter.add_directive(d),
        Err(_) => filter,
    }
}

/// The log output: stderr, filtered by `RUST_LOG` (default `info`), spans left out.
fn logs<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use tracing_subscriber::Layer as _;
    tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_filter(log_filter())
}

/// Logs only (commands that serve nothing).
pub fn init_logs() {
    use tracing_subscriber::prelude::*;
    let _ = tracing_subscriber::registry().with(logs()).try_init();
}

/// Logs, and spans exported as `config` says, under `node`'s name. Call it within
/// the Tokio runtime that serves (the exporter's gRPC client runs there).
///
/// # Errors
///
/// An exporter that cannot be built (the endpoint was checked with the config).
pub fn init(config: &TracingConfig, node: &str) -> Result<Guard, String> {
    use tracing_subscriber::prelude::*;
    #[cfg(feature = "otlp")]
    {
        let Some(endpoint) = &config.otlp_endpoint else {
            let _ = tracing_subscriber::registry().with(logs()).try_init();
            return Ok(Guard { provider: None });
        };
        let (layer, provider) = otel::pipeline(config, endpoint, node)?;
        let _ = tracing_subscriber::registry().with(layer).with(logs()).try_init();
        ON.store(true, Ordering::Relaxed);
        tracing::info!(
            endpoint = %endpoint,
            sample_ratio = config.sample_ratio,
            "traces exported over OTLP"
        );
        Ok(Guard { provider: Some(provider) })
    }
    #[cfg(not(feature = "otlp"))]
    {
        let _ = tracing_subscriber::registry().with(logs()).try_init();
        if config.otlp_endpoint.is_some() {
            tracing::warn!(node, "tracing.otlp_endpoint is set, but this build has no OTLP export");
        }
        Ok(Guard {})
    }
}

#[cfg(feature = "otlp")]
pub(crate) use otel::{Traced, inject, sampled};

/// Without the `otlp` feature: nothing to carry.
#[cfg(not(feature = "otlp"))]
pub(crate) fn inject(_: &mut tonic::metadata::MetadataMap) {}

/// Without the `otlp` feature: nothing is sampled.
#[cfg(not(feature = "otlp"))]
pub(crate) fn sampled() -> bool {
    false
}

#[cfg(feature = "otlp")]
mod otel {
    use std::task::{Context, Poll};

    use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
    use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
    use opentelemetry_otlp::{WithExportConfig as _, WithTonicConfig as _};
    use opentelemetry_sdk::propagation::TraceContextPropagator;
    use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
    use tracing::Instrument as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    use tracing_subscriber::Layer as _;

    use super::{TARGET, TracingConfig, on};

    type Boxed = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

    /// The layer that turns [`TARGET`] spans into OpenTelemetry spans, and the
    /// provider that exports them in batches (a bounded queue: spans past it are
    /// dropped, never waited for).
    pub(super) fn pipeline(
        config: &TracingConfig,
        endpoint: &str,
        node: &str,
    ) -> Result<(Boxed, SdkTracerProvider), String> {
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(config.export_timeout)
            .with_compression(opentelemetry_otlp::Compression::Gzip)
            .build()
            .or_else(|_| {
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .with_timeout(config.export_timeout)
                    .build()
            })
            .map_err(|e| format!("tracing.otlp_endpoint: {e}"))?;
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(config.service_name.clone())
            .with_attribute(opentelemetry::KeyValue::new("service.instance.id", node.to_owned()))
            .with_attribute(opentelemetry::KeyValue::new(
                "service.version",
                env!("CARGO_PKG_VERSION"),
            ))
            .build();
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                config.sample_ratio,
            ))))
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("limiter-server");
        let only_ours =
            tracing_subscriber::filter::Targets::new().with_target(TARGET, tracing::Level::INFO);
        let layer = tracing_opentelemetry::layer().with_tracer(tracer).with_filter(only_ours);
        Ok((Box::new(layer), provider))
    }

    struct Headers<'a>(&'a http::HeaderMap);

    impl Extractor for Headers<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            self.0.get(key).and_then(|v| v.to_str().ok())
        }
        fn keys(&self) -> Vec<&str> {
            self.0.keys().map(http::HeaderName::as_str).collect()
        }
    }

    struct Metadata<'a>(&'a mut tonic::metadata::MetadataMap);

    impl Injector for Metadata<'_> {
        fn set(&mut self, key: &str, value: String) {
            if let (Ok(k), Ok(v)) = (
                tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
                tonic::metadata::MetadataValue::try_from(value.as_str()),
            ) {
                self.0.insert(k, v);
            }
        }
    }

    /// Adds the current span's context (`traceparent`, `tracestate`) to `metadata`.
    pub(crate) fn inject(metadata: &mut tonic::metadata::MetadataMap) {
        if !on() {
            return;
        }
        let cx = tracing::Span::current().context();
        if cx.span().span_context().is_valid() {
            TraceContextPropagator::new().inject_context(&cx, &mut Metadata(metadata));
        }
    }

    /// Whether the current span is sampled (its forward is sent on its own, with its
    /// context, rather than in a batch of others').
    pub(crate) fn sampled() -> bool {
        on() && tracing::Span::current().context().span().span_context().is_sampled()
    }

    /// A tower layer for the gRPC server: each call runs in a `grpc` span whose parent
    /// is the call's `traceparent`, while spans are exported; otherwise it only
    /// passes the call on.
    #[derive(Debug, Clone, Copy)]
    pub(crate) struct Traced;

    impl<S> tower::Layer<S> for Traced {
        type Service = TracedService<S>;
        fn layer(&self, inner: S) -> Self::Service {
            TracedService { inner }
        }
    }

    #[derive(Debug, Clone)]
    pub(crate) struct TracedService<S> {
        inner: S,
    }

    impl<S, B> tower::Service<http::Request<B>> for TracedService<S>
    where
        S: tower::Service<http::Request<B>>,
    {
        type Response = S::Response;
        type Error = S::Error;
        // A disabled span when spans are not exported: entering it on each poll is a
        // check of an empty option, and nothing is allocated.
        type Future = tracing::instrument::Instrumented<S::Future>;

        fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
            self.inner.poll_ready(cx)
        }

        fn call(&mut self, req: http::Request<B>) -> Self::Future {
            if !on() {
                return self.inner.call(req).instrument(tracing::Span::none());
            }
            let parent = TraceContextPropagator::new().extract(&Headers(req.headers()));
            let span = tracing::info_span!(
                target: "limiter::otel",
                "grpc",
                otel.kind = "server",
                rpc.system = "grpc",
                rpc.method = %req.uri().path().chars().take(128).collect::<String>(),
            );
            // A malformed or absent traceparent leaves the span a root.
            let _ = span.set_parent(parent);
            self.inner.call(req).instrument(span)
        }
    }
}

/// The gRPC server's tracing layer (a pass-through without the `otlp` feature).
#[cfg(not(feature = "otlp"))]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Traced;

#[cfg(not(feature = "otlp"))]
impl<S> tower::Layer<S> for Traced {
    type Service = S;
    fn layer(&self, inner: S) -> S {
        inner
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn attributes_are_cut_at_a_character_boundary() {
        assert_eq!(super::short("acme"), "acme");
        let long = "é".repeat(200); // 400 bytes
        let cut = super::short(&long);
        assert!(cut.len() <= super::MAX_ATTRIBUTE && cut.len() >= super::MAX_ATTRIBUTE - 1);
        assert!(long.starts_with(cut));
    }
}
