//! A `tower` layer that puts an [`Agent`] in front of an HTTP service.
//!
//! The caller says how to read tenant, route, key and cost from a request (or that a
//! request is not limited). A rejection becomes `429 Too Many Requests` with
//! `Retry-After`, the `RateLimit` / `RateLimit-Policy` fields when the limit is known,
//! and the reason in `x-ratelimit-reason`; `LIMITER_UNAVAILABLE` (a fail-closed route
//! whose owner is unreachable) becomes `503 Service Unavailable`; a request that can
//! never succeed (a cost above the limit) becomes `400 Bad Request`.
//!
//! An admission that holds permits of a concurrency level keeps them for the life of
//! the inner service's call: renewed at half their time left while it runs, released
//! when it returns its response, and released as well when the request is dropped
//! unfinished (the client went away), by a guard's `Drop`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response, StatusCode};
use limiter_core::Reason;
use limiter_core::headers;
use tower::{Layer, Service};

use crate::agent::{Agent, AgentRequest, Outcome, Permit};

/// What a request is, for the limiter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestInfo {
    /// Tenant.
    pub tenant: String,
    /// Route.
    pub route: String,
    /// Key (API key, user), if any.
    pub key: Option<String>,
    /// Units; at least 1.
    pub cost: u64,
}

/// Reads [`RequestInfo`] from a request; `None` lets it through unlimited.
pub trait Classify<B>: Clone + Send + Sync + 'static {
    /// Classifies `req`.
    fn classify(&self, req: &Request<B>) -> Option<RequestInfo>;
}

impl<B, F> Classify<B> for F
where
    F: Fn(&Request<B>) -> Option<RequestInfo> + Clone + Send + Sync + 'static,
{
    fn classify(&self, req: &Request<B>) -> Option<RequestInfo> {
        self(req)
    }
}

/// The layer.
#[derive(Debug, Clone)]
pub struct RateLimitLayer<C> {
    agent: Agent,
    classify: C,
}

impl<C> RateLimitLayer<C> {
    /// A layer deciding with `agent`, reading requests with `classify`.
    pub fn new(agent: Agent, classify: C) -> Self {
        Self { agent, classify }
    }
}

impl<S, C: Clone> Layer<S> for RateLimitLayer<C> {
    type Service = RateLimit<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimit { inner, agent: self.agent.clone(), classify: self.classify.clone() }
    }
}

/// The service the layer makes.
#[derive(Debug, Clone)]
pub struct RateLimit<S, C> {
    inner: S,
    agent: Agent,
    classify: C,
}

fn header(v: &str) -> HeaderValue {
    HeaderValue::from_str(v).unwrap_or_else(|_| HeaderValue::from_static("invalid"))
}

/// The response for a rejected request.
pub fn rejection<RB: Default>(o: &Outcome) -> Response<RB> {
    let status = if o.reason == Some(Reason::LimiterUnavailable) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::TOO_MANY_REQUESTS
    };
    let mut r = Response::new(RB::default());
    *r.status_mut() = status;
    let h = r.headers_mut();
    if let Some(reason) = o.reason {
        h.insert(headers::REASON_HEADER, HeaderValue::from_static(reason.as_str()));
    }
    if status == StatusCode::TOO_MANY_REQUESTS {
        h.insert(http::header::RETRY_AFTER, header(&headers::retry_after(o.retry_after)));
    }
    if let Some(l) = &o.limit {
        h.insert("ratelimit-policy", header(&headers::policy_item(&l.name, l.quota, l.window)));
        h.insert("ratelimit", header(&headers::limit_item(&l.name, o.remaining, o.retry_after)));
    }
    r
}

impl<S, C, B, RB> Service<Request<B>> for RateLimit<S, C>
where
    S: Service<Request<B>, Response = Response<RB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Send,
    B: Send + 'static,
    RB: Default + Send + 'static,
    C: Classify<B>,
{
    type Response = Response<RB>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let info = self.classify.classify(&req);
        // The clone that was polled ready handles this request.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let agent = self.agent.clone();
        Box::pin(async move {
            let Some(info) = info else { return inner.call(req).await };
            let ask = AgentRequest {
                tenant: &info.tenant,
                route: &info.route,
                key: info.key.as_deref(),
                cost: info.cost,
            };
            let outcome = match agent.decide_local(&ask) {
                Some(o) => Ok(o),
                None => agent.decide(&ask).await,
            };
            match outcome {
                Ok(Outcome { allowed: true, permit: Some(permit), .. }) => {
                    let guard = PermitGuard { agent: agent.clone(), permit: Some(permit) };
                    guard.hold(inner.call(req)).await
                }
                Ok(o) if o.allowed => inner.call(req).await,
                Ok(o) => Ok(rejection(&o)),
                Err(_) => {
                    let mut r = Response::new(RB::default());
                    *r.status_mut() = StatusCode::BAD_REQUEST;
                    Ok(r)
                }
            }
        })
    }
}

/// A request's permits, released when dropped: when its response is ready, or when
/// the request is dropped before (the client went away).
struct PermitGuard {
    agent: Agent,
    permit: Option<Permit>,
}

impl PermitGuard {
    /// Runs `call` holding the permits, renewing them at half their time left.
    async fn hold<F: Future>(self, call: F) -> F::Output {
        let mut call = std::pin::pin!(call);
        let mut left = self.permit.as_ref().map_or(u64::MAX, |p| p.expires_in);
        loop {
            let wait = std::time::Duration::from_nanos(left / 2);
            tokio::select! {
                out = &mut call => return out,
                () = tokio::time::sleep(wait) => {
                    let Some(p) = &self.permit else { return call.await };
                    match self.agent.renew(p).await {
                        Ok(l) => left = l,
                        // Expired or unreachable: the call goes on; the permits are
                        // the owner's again at their TTL (counted on the owner).
                        Err(e) => {
                            tracing::debug!(error = %e, "permit not renewed");
                            return call.await;
                        }
                    }
                }
            }
        }
    }
}

impl Drop for PermitGuard {
    fn drop(&mut self) {
        let Some(p) = self.permit.take() else { return };
        if let Some(local) = &p.local {
            // The agent's own pool: back at once, no call.
            local.release();
            return;
        }
        let agent = self.agent.clone();
        // A guard dropped outside a runtime leaves the permits to their TTL.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = agent.release(&p).await {
                    tracing::debug!(error = %e, "permit not released: it expires at its TTL");
                }
            });
        }
    }
}
