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

type Boxed = tower::util::BoxCloneService<
    http::Request<String>,
    http::Response<String>,
    std::convert::Infallible,
>;

fn export(wait: bool) -> http::Request<String> {
    let mut b = http::Request::builder().uri("/export");
    if wait {
        b = b.header("wait", "yes");
    }
    b.body(String::new()).unwrap()
}

/// A request that finishes at once: its status.
async fn quick(svc: &Boxed) -> u16 {
    use tower::ServiceExt as _;
    svc.clone().oneshot(export(false)).await.unwrap().status().as_u16()
}

/// Whether a quick request is admitted within a second: sooner than a permit of 3 s
/// renewed at half its time left (1.4 s left at least) could expire, so only a
/// release explains it.
async fn admitted_soon(svc: &Boxed) -> bool {
    for _ in 0..20 {
        if quick(svc).await == 200 {
            return true;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    false
}

/// A request's permits of a concurrency level are held for the life of the inner
/// call (renewed past their TTL), released when it answers, and released when the
/// request is dropped unfinished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_holds_its_permit_for_its_life_and_gives_it_back_when_done_or_dropped() {
    use std::time::Duration;
    use tower::{Layer as _, ServiceExt as _};

    let policy = "version: 1\ntenants:\n  acme:\n    routes:\n      /export: { algorithm: concurrency, limit: 2, permit_ttl: 3s }\n";
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let owner = Owner::start(policy, clock.clone()).await;
    let agent = Agent::with_clock(AgentConfig::new(owner.url(), "edge"), clock).unwrap();
    // `wait` requests finish when the test lets one go; the others at once.
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let g = gate.clone();
    let inner = tower::service_fn(move |req: http::Request<String>| {
        let g = g.clone();
        async move {
            if req.headers().contains_key("wait") {
                g.acquire().await.unwrap().forget();
            }
            Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
        }
    });
    let classify = |_: &http::Request<String>| {
        Some(RequestInfo { tenant: "acme".into(), route: "/export".into(), key: None, cost: 1 })
    };
    let svc: Boxed = Boxed::new(RateLimitLayer::new(agent, classify).layer(inner));
    let a = tokio::spawn(svc.clone().oneshot(export(true)));
    let b = tokio::spawn(svc.clone().oneshot(export(true)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(quick(&svc).await, 429, "both permits are held");
    // Past the permits' TTL: renewed while their calls run.
    tokio::time::sleep(Duration::from_millis(3_300)).await;
    assert_eq!(quick(&svc).await, 429, "still held after their first TTL");
    // One call answers: its permit comes back.
    gate.add_permits(1);
    assert!(admitted_soon(&svc).await, "released when the response was ready");
    let (mut a, mut b) = (a, b);
    let (done, held) = tokio::select! {
        r = &mut a => (r, b),
        r = &mut b => (r, a),
    };
    assert_eq!(done.unwrap().unwrap().status(), 200);
    // Another long call takes the free permit (once the last quick request's
    // release, sent after its response, has landed); the held one is dropped
    // unfinished.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let c = tokio::spawn(svc.clone().oneshot(export(true)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(quick(&svc).await, 429);
    held.abort();
    assert!(admitted_soon(&svc).await, "released when the request was dropped");
    gate.add_permits(1);
    assert_eq!(c.await.unwrap().unwrap().status(), 200);
}
