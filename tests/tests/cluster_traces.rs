//! Traces across nodes: two real server processes export their spans with OTLP/gRPC
//! to a collector stand-in this test serves (the OpenTelemetry protocol's own
//! messages). A request sent to the node that does not own its tenant, with a W3C
//! `traceparent`, is forwarded to the owner: both nodes' spans arrive under the
//! caller's trace id, the owner's server span a child of the forward's client span,
//! with the tenant and the route as attributes. A request without one starts a trace
//! at the first node that the owner's spans join.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use parking_lot::Mutex;

mod common;
use common::*;

/// One received span: the node that sent it, and the span.
#[derive(Debug, Clone)]
struct Got {
    node: String,
    span: opentelemetry_proto::tonic::trace::v1::Span,
}

#[derive(Default, Clone)]
struct Collector(Arc<Mutex<Vec<Got>>>);

fn text(attrs: &[KeyValue], key: &str) -> Option<String> {
    attrs.iter().find(|kv| kv.key == key).and_then(|kv| {
        match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(s) => Some(s.clone()),
            _ => None,
        }
    })
}

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut got = self.0.lock();
        for rs in request.into_inner().resource_spans {
            let attrs = rs.resource.map(|r| r.attributes).unwrap_or_default();
            let node = text(&attrs, "service.instance.id").unwrap_or_default();
            assert_eq!(text(&attrs, "service.name").as_deref(), Some("limiter"));
            for ss in rs.scope_spans {
                for span in ss.spans {
                    got.push(Got { node: node.clone(), span });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Waits until the collector holds spans of trace `trace` from both `nodes`, named as
/// `want` says per node; returns them.
async fn trace_of(c: &Collector, trace: &str, want: &[(&str, &[&str])]) -> Vec<Got> {
    for _ in 0..200 {
        let spans: Vec<Got> =
            c.0.lock().iter().filter(|g| hex(&g.span.trace_id) == trace).cloned().collect();
        let complete = want.iter().all(|(node, names)| {
            names.iter().all(|n| spans.iter().any(|g| g.node == *node && g.span.name == *n))
        });
        if complete {
            return spans;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let all: Vec<(String, String, String)> =
        c.0.lock()
            .iter()
            .map(|g| (g.node.clone(), g.span.name.clone(), hex(&g.span.trace_id)))
            .collect();
    panic!("trace {trace} incomplete; received {all:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_request_is_one_trace_across_two_nodes() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let dir = tempfile::tempdir().unwrap();
    let policy = dir.path().join("policies.yaml");
    std::fs::write(&policy, MEMBERSHIP_POLICY).unwrap();
    let nodes: Vec<Node> = ["a", "b"].iter().map(|id| Node::new(id)).collect();
    let peers = Node::static_peers(&nodes);
    let env = [
        ("LIMITER__TRACING__OTLP_ENDPOINT", endpoint.as_str()),
        ("LIMITER__TRACING__SAMPLE_RATIO", "1.0"),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let procs: Vec<_> = nodes.iter().map(|n| n.spawn(&policy, &peers, &env)).collect();
    for (p, n) in procs.iter().zip(&nodes) {
        p.wait_ready().await;
        wait_members(&mut client(n.grpc).await, 2).await;
    }
    let mut a = client(nodes[0].grpc).await;
    let tenants: Vec<String> = (0..50).map(|k| format!("tenant-{k}")).collect();
    let owners = owners(&mut a, &tenants).await;
    let on_b = tenants.iter().zip(&owners).find(|(_, o)| *o == "b").unwrap().0.clone();

    // With the caller's traceparent.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let mut req = tonic::Request::new(allow(&on_b));
    req.metadata_mut()
        .insert("traceparent", format!("00-{trace_id}-00f067aa0ba902b7-01").parse().unwrap());
    let answer = a.should_allow(req).await.unwrap().into_inner();
    assert!(answer.allowed);
    let spans = trace_of(
        &collector,
        trace_id,
        &[("a", &["grpc", "decide", "forward"]), ("b", &["grpc", "decide"])],
    )
    .await;
    let one = |node: &str, name: &str| {
        spans.iter().find(|g| g.node == node && g.span.name == name).unwrap().span.clone()
    };
    let (a_server, a_decide, a_forward) =
        (one("a", "grpc"), one("a", "decide"), one("a", "forward"));
    let (b_server, b_decide) = (one("b", "grpc"), one("b", "decide"));
    assert_eq!(
        hex(&a_server.parent_span_id),
        "00f067aa0ba902b7",
        "a's server span is the caller's child"
    );
    assert_eq!(a_decide.parent_span_id, a_server.span_id);
    assert_eq!(a_forward.parent_span_id, a_decide.span_id, "the forward is part of a's decision");
    assert_eq!(
        b_server.parent_span_id, a_forward.span_id,
        "b's server span is a's forward's child"
    );
    assert_eq!(b_decide.parent_span_id, b_server.span_id);
    for d in [&a_decide, &b_decide] {
        assert_eq!(text(&d.attributes, "tenant").as_deref(), Some(on_b.as_str()));
        assert_eq!(text(&d.attributes, "route").as_deref(), Some("/r"));
    }
    assert_eq!(
        text(&a_forward.attributes, "peer").as_deref(),
        Some(nodes[1].grpc.to_string().as_str())
    );

    // Without one: a starts the trace, b's spans join it.
    let before: std::collections::HashSet<Vec<u8>> =
        collector.0.lock().iter().map(|g| g.span.trace_id.clone()).collect();
    assert!(a.should_allow(allow(&on_b)).await.unwrap().into_inner().allowed);
    let mut joined = None;
    for _ in 0..200 {
        let by_trace: HashMap<Vec<u8>, Vec<String>> =
            collector.0.lock().iter().filter(|g| !before.contains(&g.span.trace_id)).fold(
                HashMap::new(),
                |mut m, g| {
                    m.entry(g.span.trace_id.clone())
                        .or_default()
                        .push(format!("{}:{}", g.node, g.span.name));
                    m
                },
            );
        joined = by_trace.into_iter().find(|(_, names)| {
            names.iter().any(|n| n == "a:forward") && names.iter().any(|n| n == "b:decide")
        });
        if joined.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (trace, names) = joined.expect("a trace started at a, joined by b");
    println!("trace {} spans {names:?}", hex(&trace));
    server.abort();
}
