//! The admin HTTP port: `/metrics` (Prometheus), `/healthz` (liveness), `/readyz`
//! (readiness: policy loaded and not draining), `/policy` (the active policy), and the
//! status page `/dashboard` with its data at `/dashboard/data` ([`dashboard`]).

pub(crate) mod dashboard;

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use limiter_core::clock::NANOS_PER_SEC;
use limiter_core::policy::UnknownTenants;
use serde_json::json;

use self::dashboard::History;
use crate::metrics;
use crate::owner::Owner;

#[derive(Clone)]
struct Admin {
    owner: Arc<Owner>,
    history: Arc<History>,
    members: Arc<Vec<String>>,
}

/// The admin router over `owner`; `members` are the ring's members as shown.
pub(crate) fn router(owner: Arc<Owner>, history: Arc<History>, members: Vec<String>) -> Router {
    let dash = Admin { owner: owner.clone(), history, members: Arc::new(members) };
    let page = || async { ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], dashboard::PAGE) };
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .route("/policy", get(policy))
        .route("/v1/usage", get(usage))
        .with_state(owner)
        .merge(
            Router::new()
                .route("/dashboard", get(page))
                .route("/dashboard/", get(page))
                .route("/dashboard/data", get(dashboard_data))
                .with_state(dash),
        )
}

async fn dashboard_data(State(d): State<Admin>) -> impl IntoResponse {
    let body = dashboard::data(&d.owner, &d.history, &d.members).to_string();
    ([(header::CONTENT_TYPE, "application/json")], body)
}

async fn render_metrics(State(owner): State<Arc<Owner>>) -> impl IntoResponse {
    owner.sweep_stats();
    let handle = metrics::handle();
    handle.run_upkeep();
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render())
}

async fn ready(State(owner): State<Arc<Owner>>) -> impl IntoResponse {
    if owner.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
    }
}

/// `GET /v1/usage?tenant=&route=&key=`: the levels of a tenant, route and key as
/// this node holds them (in a cluster, ask the tenant's owner, or use the native
/// `Usage` call, which forwards to it).
#[derive(Debug, serde::Deserialize)]
struct UsageQuery {
    tenant: Option<String>,
    route: Option<String>,
    key: Option<String>,
}

async fn usage(
    State(owner): State<Arc<Owner>>,
    query: Result<axum::extract::Query<UsageQuery>, axum::extract::rejection::QueryRejection>,
) -> impl IntoResponse {
    let bad = |field: &str, why: &str| {
        let body = json!({ "error": format!("{field}: {why}"), "field": field });
        (StatusCode::BAD_REQUEST, [(header::CONTENT_TYPE, "application/json")], body.to_string())
    };
    let Ok(axum::extract::Query(q)) = query else {
        return bad("query", "expected tenant=, route= and optionally key=");
    };
    let (Some(tenant), Some(route)) = (q.tenant.as_deref(), q.route.as_deref()) else {
        let field = if q.tenant.is_none() { "tenant" } else { "route" };
        return bad(field, "required");
    };
    let req = limiter_core::policy::Request {
        tenant,
        route,
        key: q.key.as_deref().filter(|k| !k.is_empty()),
        cost: None,
        dry_run: true,
    };
    match owner.usage(&req).await {
        Ok(u) => {
            let levels: Vec<_> = u
                .levels
                .iter()
                .map(|l| {
                    let (quota, window) = l.limit.quota_at(u.now);
                    json!({
                        "scope": l.scope.as_str(),
                        "name": &*l.name,
                        "algorithm": l.limit.kind().as_str(),
                        "limit": quota,
                        "window_seconds": window as f64 / NANOS_PER_SEC as f64,
                        "description": l.limit.to_string(),
                        "remaining": l.remaining,
                        "reset_after_seconds": l.reset_after as f64 / NANOS_PER_SEC as f64,
                        "reset_at": crate::convert::rfc3339(u.now.saturating_add(l.reset_after)),
                        "shared": l.shared,
                    })
                })
                .collect();
            let body = json!({
                "tenant": limiter_core::text::shorten(tenant),
                "route": limiter_core::text::shorten(route),
                "key": q.key.as_deref().map(limiter_core::text::shorten),
                "policy_version": u.policy_version,
                "unknown_tenant": u.unknown_tenant,
                "at": crate::convert::rfc3339(u.now),
                "levels": levels,
                "open_tickets": u.open_tickets,
                "open_ticket_units": u.open_ticket_units,
                "held_permits": u.held_permits,
                "held_permit_units": u.held_permit_units,
            });
            (StatusCode::OK, [(header::CONTENT_TYPE, "application/json")], body.to_string())
        }
        Err(e) => match e.field() {
            "none" => {
                let body = json!({ "error": e.to_string() });
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(header::CONTENT_TYPE, "application/json")],
                    body.to_string(),
                )
            }
            field => bad(field, &e.to_string()),
        },
    }
}

async fn policy(State(owner): State<Arc<Owner>>) -> impl IntoResponse {
    let active = owner.policies().current();
    let status = owner.policies().status();
    let now = owner.clock().now();
    let p = &active.policy;
    let mut routes: Vec<&str> = p.routes.keys().map(AsRef::as_ref).collect();
    routes.sort_unstable();
    let body = json!({
        "version": active.version,
        "file": owner.policies().path().display().to_string(),
        "loaded_at_unix_seconds": active.loaded_at / NANOS_PER_SEC,
        "seconds_since_load": now.saturating_sub(active.loaded_at) / NANOS_PER_SEC,
        "digest": format!("{:016x}", active.digest),
        "summary": {
            "global_ceiling": p.global.as_ref().map(|g| g.limit.to_string()),
            "routes": routes,
            "tenants": p.tenants.len(),
            "default_tenant": p.default_tenant.is_some(),
            "unknown_tenants": match p.unknown_tenants {
                UnknownTenants::UseDefault => "use_default",
                UnknownTenants::Reject => "reject",
            },
            "shadow": p.shadow,
        },
        "reloads": {
            "ok": status.reloads,
            "failed": status.failures,
            "last_error": status.last_error,
            "seconds_since_last_failure": status.last_failure_at.map(|t| now.saturating_sub(t) / NANOS_PER_SEC),
        },
    });
    ([(header::CONTENT_TYPE, "application/json")], body.to_string())
}
