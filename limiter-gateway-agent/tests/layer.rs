//! The tower layer in front of a real HTTP service over loopback: 429 with the
//! rate-limit headers past the limit, 503 on a fail-closed route without an owner.

mod common;

use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use common::Owner;
use limiter_core::clock::{Clock, MonotonicClock};
use limiter_gateway_agent::layer::{RateLimitLayer, RequestInfo};
use limiter_gateway_agent::{Agent, AgentConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn classify(req: &http::Request<axum::body::Body>) -> Option<RequestInfo> {
    let tenant = req.headers().get("x-tenant")?.to_str().ok()?.to_owned();
    Some(RequestInfo { tenant, route: req.uri().path().to_owned(), key: None, cost: 1 })
}

async fn serve(agent: Agent) -> std::net::SocketAddr {
    let app = Router::new()
        .route("/hello", get(|| async { "hello\n" }))
        .layer(RateLimitLayer::new(agent, classify));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// One HTTP/1.1 request: (status, head).
async fn get_as(addr: std::net::SocketAddr, tenant: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "GET /hello HTTP/1.1\r\nHost: x\r\nx-tenant: {tenant}\r\nConnection: close\r\n\r\n"
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).to_lowercase();
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rejections_become_429_with_headers() {
    let policy = "version: 1\ntenants:\n  acme:\n    limit: { algorithm: fixed_window, limit: 3, window: 1h, name: hourly }\n";
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(policy, clock.clone()).await;
    let agent = Agent::with_clock(AgentConfig::new(owner.url(), "edge"), clock).unwrap();
    let addr = serve(agent).await;
    for _ in 0..3 {
        let (status, text) = get_as(addr, "acme").await;
        assert_eq!(status, 200, "{text}");
        assert!(text.ends_with("hello\n"));
    }
    let (status, head) = get_as(addr, "acme").await;
    assert_eq!(status, 429, "{head}");
    assert!(head.contains("retry-after: "), "{head}");
    assert!(head.contains("x-ratelimit-reason: tenant_limit"), "{head}");
    assert!(head.contains(r#"ratelimit-policy: "hourly";q=3;w=3600"#), "{head}");
    assert!(head.contains(r#"ratelimit: "hourly";r=0;t="#), "{head}");
    // Requests the classifier does not name pass unlimited.
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET /hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_closed_route_without_its_owner_answers_503() {
    // Nothing listens on the owner's port: calls fail at once.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let agent = Agent::with_clock(AgentConfig::new(url, "edge"), clock).unwrap();
    let addr = serve(agent).await;
    let (status, head) = get_as(addr, "acme").await;
    assert_eq!(status, 503, "{head}");
    assert!(head.contains("x-ratelimit-reason: limiter_unavailable"), "{head}");
}
