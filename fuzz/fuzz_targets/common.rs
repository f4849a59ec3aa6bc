//! A fresh server per input (so counters never fill up across inputs and every
//! admission path is reached), and what every answer must satisfy beyond "no panic":
//! consistent with the request it answers. Shared by the fuzz targets and by
//! limiter-server's `wire_checks` test, which runs the same checks on the committed
//! seeds and their mutations in CI.

#![allow(dead_code)] // each user takes some of it

use std::sync::{Arc, OnceLock};

use limiter_core::policy::{NameBounds, Policy, Request, from_yaml};
use limiter_proto::envoy::service::ratelimit::v3 as rls;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_server::RateLimiter;
use limiter_server::Server;
use limiter_server::api::envoy::EnvoyService;
use limiter_server::api::native::NativeService;
use limiter_server::config::ServerConfig;

/// Every algorithm, every level, shadow mode, fail-open and leases.
pub(crate) const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100000/s, burst: 100000 }
unknown_tenants: use_default
lease: { mode: leased, ttl: 1s, max_batch: 50 }
routes:
  /a:
    cost: 2
    limit: { algorithm: sliding_counter, limit: 1000, window: 1s }
    on_limiter_failure: { mode: fail_open, emergency_ceiling: 10/s }
  /b:
    shadow: true
    lease: { mode: exact }
tenants:
  t:
    limit: { algorithm: token_bucket, rate: 100/s, burst: 200 }
    routes:
      /a: { algorithm: fixed_window, limit: 50, window: 1s }
    per_key: { algorithm: sliding_log, limit: 20, window: 10s }
  default:
    limit: { algorithm: sliding_log, limit: 100, window: 10s }
";

/// The longest status message a caller gets (quoted input is shortened).
pub(crate) const MAX_MESSAGE: usize = 512;

pub(crate) struct Services {
    pub(crate) native: NativeService,
    pub(crate) envoy: EnvoyService,
    pub(crate) policy: &'static Policy,
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap())
}

fn config() -> &'static ServerConfig {
    static C: OnceLock<ServerConfig> = OnceLock::new();
    C.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("limiter-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("policies.yaml");
        std::fs::write(&file, POLICY).unwrap();
        let env = [("LIMITER__POLICY_FILE".to_owned(), file.display().to_string())];
        ServerConfig::load_with_env(None, env).unwrap()
    })
}

fn policy() -> &'static Policy {
    static P: OnceLock<Policy> = OnceLock::new();
    P.get_or_init(|| from_yaml(POLICY, "fuzz.yaml").unwrap())
}

/// A server with nothing counted yet.
pub(crate) fn fresh() -> Services {
    let config = config().clone();
    let server = {
        let _rt = runtime().enter();
        Server::new(config.clone()).unwrap()
    };
    let owner: Arc<_> = server.owner().clone();
    Services {
        native: NativeService::new(owner.clone()),
        envoy: EnvoyService::new(owner, config.envoy.clone()),
        policy: policy(),
    }
}

/// Runs `f` on the shared runtime.
pub(crate) fn block_on<F: std::future::Future>(f: F) -> F::Output {
    runtime().block_on(f)
}

fn check_status(s: &tonic::Status, what: &str) {
    assert!(!s.message().is_empty(), "{what}: an error must say why: {s:?}");
    assert!(s.message().len() <= MAX_MESSAGE, "{what}: {} bytes of message", s.message().len());
}

/// The scopes of the levels `req` is charged against (`None`: not resolvable).
fn scopes(policy: &Policy, req: &pb::ShouldAllowRequest) -> Option<Vec<i32>> {
    let key = (!req.key.is_empty()).then_some(req.key.as_str());
    let r = Request { tenant: &req.tenant, route: &req.route, key, cost: req.cost, dry_run: false };
    let chain = policy.resolve(&r, &NameBounds::default()).ok()?;
    Some(chain.levels().map(|l| scope_code(l.scope)).collect())
}

fn scope_code(s: limiter_core::decision::Scope) -> i32 {
    use limiter_core::decision::Scope;
    match s {
        Scope::Global => pb::Scope::Global as i32,
        Scope::Route => pb::Scope::Route as i32,
        Scope::Tenant => pb::Scope::Tenant as i32,
        Scope::TenantRoute => pb::Scope::TenantRoute as i32,
        Scope::Key => pb::Scope::Key as i32,
    }
}

/// One decision's answer against its request.
fn check_answer(policy: &Policy, req: &pb::ShouldAllowRequest, a: &pb::ShouldAllowResponse) {
    if let Some(l) = &a.limit {
        assert!(a.remaining <= l.quota, "remaining {} above the limit {l:?}", a.remaining);
    }
    if a.allowed {
        return;
    }
    assert_ne!(a.reason, pb::Reason::Unspecified as i32, "a rejection names its reason: {a:?}");
    let named_level =
        [pb::Reason::UnknownTenant, pb::Reason::LimiterUnavailable, pb::Reason::EmergencyCeiling]
            .iter()
            .all(|r| a.reason != *r as i32);
    if named_level && let Some(scopes) = scopes(policy, req) {
        assert!(
            scopes.contains(&a.scope),
            "rejected by scope {} outside the chain {scopes:?}",
            a.scope
        );
    }
}

/// `ShouldAllow`: the answer is consistent with the request, and a rejection charges
/// nothing (a dry run before and after reads no less left). Returns whether it was
/// admitted, or the error's code.
pub(crate) async fn should_allow(
    s: &Services,
    req: pb::ShouldAllowRequest,
) -> Result<bool, tonic::Code> {
    let dry = pb::ShouldAllowRequest { dry_run: true, report_later: false, ..req.clone() };
    let before = s.native.should_allow(tonic::Request::new(dry.clone())).await;
    let got = s.native.should_allow(tonic::Request::new(req.clone())).await;
    match &got {
        Ok(a) => check_answer(s.policy, &req, a.get_ref()),
        Err(e) => check_status(e, "ShouldAllow"),
    }
    let after = s.native.should_allow(tonic::Request::new(dry)).await;
    if let (Ok(b), Ok(a), Ok(g)) = (&before, &after, &got) {
        let (b, a, g) = (b.get_ref(), a.get_ref(), g.get_ref());
        if !g.allowed && !g.shadow && b.limit == a.limit {
            assert!(
                a.remaining >= b.remaining,
                "a rejection charged: {} then {}",
                b.remaining,
                a.remaining
            );
        }
    }
    got.map(|g| g.get_ref().allowed).map_err(|e| e.code())
}

/// One input of the `should_allow` target: its first byte picks a single request
/// (even) or a batch (odd), the rest is the message.
pub(crate) async fn should_allow_input(s: &Services, data: &[u8]) {
    use prost::Message as _;
    let Some((&which, bytes)) = data.split_first() else { return };
    if which % 2 == 0 {
        if let Ok(req) = pb::ShouldAllowRequest::decode(bytes) {
            let _ = should_allow(s, req).await;
        }
    } else if let Ok(req) = pb::ShouldAllowBatchRequest::decode(bytes) {
        should_allow_batch(s, req).await;
    }
}

/// `ShouldAllowBatch`: one answer per request, each consistent with its request.
pub(crate) async fn should_allow_batch(s: &Services, req: pb::ShouldAllowBatchRequest) {
    match s.native.should_allow_batch(tonic::Request::new(req.clone())).await {
        Ok(a) => {
            let a = a.into_inner();
            assert_eq!(a.responses.len(), req.requests.len(), "one answer per request");
            for (r, x) in req.requests.iter().zip(&a.responses) {
                check_answer(s.policy, r, x);
            }
        }
        Err(e) => check_status(&e, "ShouldAllowBatch"),
    }
}

/// Envoy's `ShouldRateLimit`: one status per descriptor, and the overall code is
/// `OVER_LIMIT` exactly when one of them is.
pub(crate) async fn should_rate_limit(s: &Services, req: rls::RateLimitRequest) {
    match s.envoy.should_rate_limit(tonic::Request::new(req.clone())).await {
        Ok(a) => {
            let a = a.into_inner();
            let over = rls::rate_limit_response::Code::OverLimit as i32;
            if !a.statuses.is_empty() {
                assert_eq!(a.statuses.len(), req.descriptors.len(), "one status per descriptor");
                let any = a.statuses.iter().any(|x| x.code == over);
                assert_eq!(
                    a.overall_code == over,
                    any,
                    "overall {} against {:?}",
                    a.overall_code,
                    a.statuses
                );
            }
        }
        Err(e) => check_status(&e, "ShouldRateLimit"),
    }
}

/// Leases: an agent's grant never exceeds the route's batch (a node's slice of a root
/// level, an item naming a level, is not bounded by it), and a second call (settling
/// the first) is answered too.
pub(crate) async fn lease(s: &Services, req: pb::LeaseRequest) {
    for _ in 0..2 {
        match s.native.lease(tonic::Request::new(req.clone())).await {
            Ok(a) => {
                let a = a.into_inner();
                assert!(
                    a.grants.len() <= req.items.len(),
                    "{} grants for {} items",
                    a.grants.len(),
                    req.items.len()
                );
                for (g, item) in a.grants.iter().zip(&req.items).filter(|(_, i)| i.level == 0) {
                    assert!(
                        g.units <= 50,
                        "a grant of {} beyond the policy's max_batch of 50, for {item:?}",
                        g.units
                    );
                }
            }
            Err(e) => check_status(&e, "Lease"),
        }
    }
}
