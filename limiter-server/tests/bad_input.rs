//! Bad input gets INVALID_ARGUMENT naming the field, and the server keeps serving.

mod common;

use common::{TestServer, ask, ask_cost, ask_key};
use limiter_proto::limiter::v1 as pb;
use tonic::Code;

const POLICY: &str = r"
version: 1
tenants:
  acme:
    limit: { algorithm: fixed_window, limit: 10, window: 1h }
";

#[tokio::test]
async fn each_bad_request_is_refused_and_the_server_keeps_serving() {
    let s = TestServer::start_with(
        POLICY,
        &[("LIMITER__LIMITS__MAX_TENANT_LEN", "16"), ("LIMITER__LIMITS__MAX_BATCH", "3")],
    )
    .await;
    let mut c = s.native().await;
    let long_key = "k".repeat(300);
    let cases: Vec<(pb::ShouldAllowRequest, &str)> = vec![
        (ask("", "/r"), "tenant"),
        (ask("acme", ""), "route"),
        (ask("a-tenant-name-longer-than-16", "/r"), "tenant"),
        (ask_key("acme", "/r", &long_key), "key"),
        (ask("acme\u{7}", "/r"), "tenant"),
        (ask_cost("acme", "/r", 0), "cost"),
        (ask_cost("acme", "/r", 11), "cost"),
        (ask_cost("acme", "/r", u64::MAX), "cost"),
    ];
    for (req, field) in cases {
        let e = c.should_allow(req.clone()).await.unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{req:?}");
        assert!(e.message().starts_with(field), "`{}` should name `{field}`", e.message());
        // Nothing was charged and the server still answers.
        let ok =
            c.should_allow(pb::ShouldAllowRequest { dry_run: true, ..ask("acme", "/r") }).await;
        assert_eq!(ok.unwrap().into_inner().remaining, 10, "after {req:?}");
    }
    let batch = pb::ShouldAllowBatchRequest { requests: vec![ask("acme", "/r"); 4] };
    let e = c.should_allow_batch(batch).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("requests is 4, above the maximum of 3"), "{}", e.message());
    let batch = pb::ShouldAllowBatchRequest { requests: vec![ask("acme", "/r"), ask("", "/r")] };
    let e = c.should_allow_batch(batch).await.unwrap_err();
    assert!(e.message().starts_with("requests[1]: tenant"), "{}", e.message());
    let e =
        c.should_allow_batch(pb::ShouldAllowBatchRequest { requests: vec![] }).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(c.should_allow(ask("acme", "/r")).await.unwrap().into_inner().allowed);
    // Refusals are counted by field, with no tenant in any label.
    let (_, metrics) = s.get("/metrics").await;
    assert!(
        metrics.contains("limiter_invalid_requests_total{api=\"native\",field=\"cost\"}"),
        "{metrics}"
    );
    s.stop().await;
}

#[tokio::test]
async fn oversized_messages_are_refused() {
    let s = TestServer::start_with(POLICY, &[("LIMITER__LIMITS__MAX_MESSAGE_BYTES", "1024")]).await;
    let mut c = s.native().await;
    let e = c.should_allow(ask_key("acme", "/r", &"x".repeat(4_096))).await.unwrap_err();
    assert_eq!(e.code(), Code::OutOfRange, "{e:?}");
    assert!(c.should_allow(ask("acme", "/r")).await.unwrap().into_inner().allowed);
    s.stop().await;
}
