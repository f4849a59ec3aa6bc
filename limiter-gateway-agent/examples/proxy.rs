//! A reverse proxy with the agent embedded: every request is decided locally from
//! leased tokens (or by the owner, or by the route's failure policy) before it is
//! forwarded upstream.
//!
//! ```text
//! cargo run -p limiter-gateway-agent --example proxy -- \
//!     --listen 127.0.0.1:8080 --upstream http://127.0.0.1:8000 \
//!     --owner http://127.0.0.1:50051 [--agent-id proxy-1]
//! curl -H 'x-tenant: acme' -H 'x-api-key: k1' http://127.0.0.1:8080/search
//! ```
//!
//! The tenant comes from `x-tenant`, the route is the path, the key is `x-api-key`
//! (optional) and the cost `x-cost` (default 1). Requests without `x-tenant` pass
//! unlimited.

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use limiter_gateway_agent::layer::{RateLimitLayer, RequestInfo};
use limiter_gateway_agent::{Agent, AgentConfig};

const USAGE: &str = "usage: proxy --listen ADDR --upstream URL --owner URL [--agent-id ID]";

#[derive(Clone)]
struct Upstream {
    base: String,
    client: Client<HttpConnector, Body>,
}

fn classify(req: &Request) -> Option<RequestInfo> {
    let header =
        |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok()).map(str::to_owned);
    Some(RequestInfo {
        tenant: header("x-tenant")?,
        route: req.uri().path().to_owned(),
        key: header("x-api-key"),
        cost: header("x-cost").and_then(|c| c.parse().ok()).unwrap_or(1),
    })
}

async fn forward(State(up): State<Upstream>, mut req: Request) -> Response {
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str());
    let Ok(uri) = format!("{}{path}", up.base).parse::<Uri>() else {
        return (StatusCode::BAD_GATEWAY, "bad upstream address\n").into_response();
    };
    *req.uri_mut() = uri;
    match up.client.request(req).await {
        Ok(r) => r.map(Body::new),
        Err(e) => (StatusCode::BAD_GATEWAY, format!("upstream: {e}\n")).into_response(),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut listen, mut upstream, mut owner, mut id) = (None, None, None, "proxy-1".to_owned());
    while let Some(a) = args.next() {
        let v = args.next().ok_or_else(|| anyhow::anyhow!(USAGE))?;
        match a.as_str() {
            "--listen" => listen = Some(v),
            "--upstream" => upstream = Some(v.trim_end_matches('/').to_owned()),
            "--owner" => owner = Some(v),
            "--agent-id" => id = v,
            _ => anyhow::bail!(USAGE),
        }
    }
    let (Some(listen), Some(base), Some(owner)) = (listen, upstream, owner) else {
        anyhow::bail!(USAGE)
    };
    let agent = Agent::new(AgentConfig::new(owner, id))?;
    let client = Client::builder(TokioExecutor::new()).build_http();
    let app = Router::new()
        .fallback(forward)
        .with_state(Upstream { base, client })
        .layer(RateLimitLayer::new(agent.clone(), classify));
    let listener = tokio::net::TcpListener::bind(&listen).await?;
    println!("proxying {listen} with the limiter agent");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    // Give leased tokens back before exiting.
    agent.shutdown().await;
    Ok(())
}
