//! Decisions over real gRPC on loopback: every algorithm, the hierarchy's reasons and
//! scopes, batches, dry runs, shadow mode and unknown tenants; the same tests on the
//! memory store and on the Redis store (a `redis-server` started per test).

mod common;

use common::{Backend, TestServer, allowed_of, ask, ask_cost, ask_key};
use limiter_proto::limiter::v1 as pb;

const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 1000/s, burst: 1000 }
routes:
  /limited:
    limit: { algorithm: fixed_window, limit: 4, window: 1h, name: limited-route }
  /shadow:
    shadow: true
tenants:
  tb:
    limit: { algorithm: token_bucket, rate: 1/h, burst: 5 }
  fw:
    limit: { algorithm: fixed_window, limit: 5, window: 1h }
  sl:
    limit: { algorithm: sliding_log, limit: 5, window: 1h }
  sc:
    limit: { algorithm: sliding_counter, limit: 5, window: 1h }
  nested:
    limit: { algorithm: fixed_window, limit: 100, window: 1h }
    routes:
      /r: { algorithm: fixed_window, limit: 3, window: 1h, cost: 1 }
    per_key: { algorithm: fixed_window, limit: 2, window: 1h }
  tiny:
    limit: { algorithm: fixed_window, limit: 1, window: 1h }
";

/// The tests, for one store.
macro_rules! decision_tests {
    () => {
        #[tokio::test]
        async fn each_algorithm_is_enforced() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            for tenant in ["tb", "fw", "sl", "sc"] {
                let allowed = allowed_of(&mut c, &ask(tenant, "/any"), 8).await;
                assert_eq!(allowed, 5, "{tenant}");
                let r = c.should_allow(ask(tenant, "/any")).await.unwrap().into_inner();
                assert!(!r.allowed);
                assert_eq!(r.reason(), pb::Reason::TenantLimit, "{tenant}");
                assert_eq!(r.scope(), pb::Scope::Tenant);
                let wait = r.retry_after.unwrap();
                // Within the window (1 h), or two for the sliding counter, whose previous
                // window's weight fades through the next one. A sliding log's units taken
                // in a batch (the Redis store's) are logged at the end of the batch's hold
                // (the route's lease TTL, 2 s): they leave the window that much later.
                let most = match (tenant, BACKEND) {
                    ("sc", _) => 7_200,
                    ("sl", Backend::Redis) => 3_602,
                    _ => 3_600,
                };
                assert!(wait.seconds > 0 && wait.seconds <= most, "{tenant}: {wait:?}");
                let limit = r.limit.unwrap();
                assert_eq!(limit.quota, 5);
                assert_eq!(limit.name, "tenant");
            }
            s.stop().await;
        }

        #[tokio::test]
        async fn reasons_and_scopes_follow_the_hierarchy() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            // Key level: 2 per key.
            assert_eq!(allowed_of(&mut c, &ask_key("nested", "/r", "k1"), 3).await, 2);
            let r = c.should_allow(ask_key("nested", "/r", "k1")).await.unwrap().into_inner();
            assert_eq!((r.reason(), r.scope()), (pb::Reason::KeyLimit, pb::Scope::Key));
            // Tenant x route: 3 in all on /r; one more key's worth exhausts it.
            assert_eq!(allowed_of(&mut c, &ask_key("nested", "/r", "k2"), 1).await, 1);
            let r = c.should_allow(ask_key("nested", "/r", "k3")).await.unwrap().into_inner();
            assert_eq!((r.reason(), r.scope()), (pb::Reason::TenantRouteLimit, pb::Scope::TenantRoute));
            // Route across tenants: 4 on /limited, then ROUTE_LIMIT for everyone.
            assert_eq!(allowed_of(&mut c, &ask("nested", "/limited"), 4).await, 4);
            let r = c.should_allow(ask("fw", "/limited")).await.unwrap().into_inner();
            assert_eq!((r.reason(), r.scope()), (pb::Reason::RouteLimit, pb::Scope::Route));
            assert_eq!(r.limit.unwrap().name, "limited-route");
            // Allowed answers carry the tightest level and the policy version.
            let r = c.should_allow(ask("nested", "/other")).await.unwrap().into_inner();
            assert!(r.allowed);
            assert_eq!(r.policy_version, 1);
            assert_eq!(r.cost, 1);
            s.stop().await;
        }

        #[tokio::test]
        async fn global_ceiling_applies_across_tenants() {
            let policy = "version: 1\nglobal:\n  ceiling: { algorithm: fixed_window, limit: 3, window: 1h }\ntenants:\n  default: {}\n";
            let s = TestServer::start_on(BACKEND, policy).await;
            let mut c = s.native().await;
            assert_eq!(allowed_of(&mut c, &ask("a", "/x"), 2).await, 2);
            assert_eq!(allowed_of(&mut c, &ask("b", "/y"), 2).await, 1);
            let r = c.should_allow(ask("c", "/z")).await.unwrap().into_inner();
            assert_eq!((r.reason(), r.scope()), (pb::Reason::GlobalCeiling, pb::Scope::Global));
            s.stop().await;
        }

        #[tokio::test]
        async fn unknown_tenants_dry_runs_shadow_and_batches() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            // No default tenant: unknown tenants are rejected with UNKNOWN_TENANT.
            let r = c.should_allow(ask("stranger", "/x")).await.unwrap().into_inner();
            assert_eq!(r.reason(), pb::Reason::UnknownTenant);
            assert!(!r.allowed);
            // Dry runs charge nothing.
            let dry = pb::ShouldAllowRequest { dry_run: true, ..ask("tiny", "/x") };
            for _ in 0..3 {
                let r = c.should_allow(dry.clone()).await.unwrap().into_inner();
                assert!(r.allowed);
                assert_eq!(r.cost, 0);
            }
            assert_eq!(allowed_of(&mut c, &ask("tiny", "/x"), 2).await, 1);
            // Shadow route: the rejection is computed and reported, the request allowed.
            let r = c.should_allow(ask("tiny", "/shadow")).await.unwrap().into_inner();
            assert!(r.allowed && r.shadow);
            assert_eq!(r.reason(), pb::Reason::TenantLimit);
            // A batch answers each request in order.
            let batch = pb::ShouldAllowBatchRequest {
                requests: vec![ask("fw", "/a"), ask("tiny", "/a"), ask_cost("sl", "/a", 5)],
            };
            let b = c.should_allow_batch(batch).await.unwrap().into_inner();
            let allowed: Vec<bool> = b.responses.iter().map(|r| r.allowed).collect();
            assert_eq!(allowed, vec![true, false, true]);
            c.ping(pb::PingRequest {}).await.unwrap();
            s.stop().await;
        }
    };
}

on_each_store!(decision_tests);
