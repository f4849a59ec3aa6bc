//! Concurrency limits over real gRPC: permits held by admitted requests, returned by
//! Release, extended by Renew, reclaimed at their TTL; what cannot hold a permit
//! (Envoy, check-now-charge-later) is refused, never a free pass.

mod common;

use std::time::Duration;

use common::envoy::descriptor;
use common::{Backend, TestServer};
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::Code as EnvoyCode;
use limiter_proto::limiter::v1 as pb;
use tonic::Code;

/// Two exports of acme's at once (each a permit for 1 s unless renewed), under a
/// rate limit of the route that release never refunds.
const POLICY: &str = r"
version: 1
routes:
  /export:
    limit: { algorithm: fixed_window, limit: 1000, window: 1h }
tenants:
  acme:
    routes:
      /export: { algorithm: concurrency, limit: 2, permit_ttl: 1s }
";

fn export() -> pb::ShouldAllowRequest {
    pb::ShouldAllowRequest { tenant: "acme".into(), route: "/export".into(), ..Default::default() }
}

fn release(permit: &str) -> pb::ReleaseRequest {
    pb::ReleaseRequest {
        tenant: "acme".into(),
        route: "/export".into(),
        key: String::new(),
        permit: permit.into(),
        turn: 0,
    }
}

fn renew(permit: &str) -> pb::RenewRequest {
    pb::RenewRequest {
        tenant: "acme".into(),
        route: "/export".into(),
        key: String::new(),
        permit: permit.into(),
    }
}

/// The tests, for one store.
macro_rules! store_tests {
    () => {
        #[tokio::test]
        async fn permits_are_held_until_released_and_released_once() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let a = c.should_allow(export()).await.unwrap().into_inner();
            let b = c.should_allow(export()).await.unwrap().into_inner();
            assert!(a.allowed && b.allowed);
            let pa = a.permit.clone().expect("a permit for an admission");
            let pb_ = b.permit.clone().unwrap();
            assert_ne!(pa.id, pb_.id);
            assert_eq!(pa.units, 1);
            let ttl = pa.expires_in.unwrap();
            assert!(ttl.seconds == 0 && ttl.nanos > 900_000_000, "{ttl:?}");
            let full = c.should_allow(export()).await.unwrap().into_inner();
            assert!(!full.allowed);
            assert_eq!(full.reason(), pb::Reason::TenantRouteLimit);
            assert_eq!(full.limit.unwrap().algorithm(), pb::Algorithm::Concurrency);
            assert!(full.permit.is_none(), "no permit for a refusal");

            let r = c.release(release(&pa.id)).await.unwrap().into_inner();
            assert!(r.released && r.units == 1);
            let again = c.release(release(&pa.id)).await.unwrap().into_inner();
            assert!(!again.released, "a duplicated release frees nothing");
            let next = c.should_allow(export()).await.unwrap().into_inner();
            assert!(next.allowed, "the released permit is back");
            let after = c.should_allow(export()).await.unwrap().into_inner();
            assert!(!after.allowed, "and only it: b and next hold both");

            // The route's rate level was charged three times and refunded nothing.
            let usage = c
                .usage(pb::UsageRequest {
                    tenant: "acme".into(),
                    route: "/export".into(),
                    key: String::new(),
                })
                .await
                .unwrap()
                .into_inner();
            let remaining: Vec<u64> = usage.levels.iter().map(|l| l.remaining).collect();
            assert_eq!(remaining, vec![997, 0]);
            assert_eq!((usage.held_permits, usage.held_permit_units), (2, 2));
            s.stop().await;
        }

        #[tokio::test]
        async fn permits_expire_at_their_ttl_unless_renewed() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let kept = c.should_allow(export()).await.unwrap().into_inner().permit.unwrap();
            let lost = c.should_allow(export()).await.unwrap().into_inner().permit.unwrap();
            assert!(!c.should_allow(export()).await.unwrap().into_inner().allowed);
            // Renewed half way: `kept` lives on, `lost` (its holder gone) does not.
            tokio::time::sleep(Duration::from_millis(500)).await;
            let renewed = c.renew(renew(&kept.id)).await.unwrap().into_inner();
            assert!(renewed.expires_in.unwrap().nanos > 900_000_000);
            tokio::time::sleep(Duration::from_millis(700)).await;
            let one = c.should_allow(export()).await.unwrap().into_inner();
            assert!(one.allowed, "the lost holder's permit came back within its TTL");
            assert!(!c.should_allow(export()).await.unwrap().into_inner().allowed);
            // Renewing or releasing the expired one changes nothing.
            let e = c.renew(renew(&lost.id)).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.message().starts_with("permit"), "{}", e.message());
            assert!(!c.release(release(&lost.id)).await.unwrap().into_inner().released);
            assert!(!c.should_allow(export()).await.unwrap().into_inner().allowed);
            assert!(c.release(release(&kept.id)).await.unwrap().into_inner().released);
            assert!(c.should_allow(export()).await.unwrap().into_inner().allowed);
            s.stop().await;
        }

        #[tokio::test]
        async fn a_permit_is_released_only_by_its_own_names() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let p = c.should_allow(export()).await.unwrap().into_inner().permit.unwrap();
            let mut other = release(&p.id);
            other.tenant = "globex".into();
            let e = c.release(other).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{}", e.message());
            let mut keyed = release(&p.id);
            keyed.key = "k".into();
            assert_eq!(c.release(keyed).await.unwrap_err().code(), Code::InvalidArgument);
            for bad in ["", "p1.", "p1.zz", "v1.1.2.3.4", &"f".repeat(10_000)] {
                let e = c.release(release(bad)).await.unwrap_err();
                assert_eq!(e.code(), Code::InvalidArgument);
                assert!(e.message().len() < 300, "short: {}", e.message().len());
            }
            assert!(c.release(release(&p.id)).await.unwrap().into_inner().released);
            s.stop().await;
        }

        /// An agent's pool: a block holds permits of the concurrency levels only
        /// (the route's rate level is not charged), is renewed and released like a
        /// permit; a lease for a pool covers the rate levels only.
        #[tokio::test]
        async fn a_permit_block_holds_permits_and_nothing_else() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let block = pb::ShouldAllowRequest { cost: Some(2), permit_block: true, ..export() };
            let b = c.should_allow(block.clone()).await.unwrap().into_inner();
            assert!(b.allowed, "{b:?}");
            let held = b.permit.expect("a block is a permit");
            assert_eq!(held.units, 2);
            assert!(!c.should_allow(export()).await.unwrap().into_inner().allowed, "both held");
            let refused = c.should_allow(block).await.unwrap().into_inner();
            assert!(!refused.allowed && refused.permit.is_none());
            let usage =
                |mut c: limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient<
                    tonic::transport::Channel,
                >| async move {
                    c.usage(pb::UsageRequest {
                        tenant: "acme".into(),
                        route: "/export".into(),
                        key: String::new(),
                    })
                    .await
                    .unwrap()
                    .into_inner()
                };
            let u = usage(c.clone()).await;
            let remaining: Vec<u64> = u.levels.iter().map(|l| l.remaining).collect();
            assert_eq!(remaining, vec![1000, 0], "the block charged no rate level");
            assert_eq!((u.held_permits, u.held_permit_units), (1, 2));
            assert!(c.renew(renew(&held.id)).await.is_ok());
            let r = c.release(release(&held.id)).await.unwrap().into_inner();
            assert!(r.released && r.units == 2);
            // A chain without a concurrency level has nothing to hold.
            let none =
                pb::ShouldAllowRequest { route: "/search".into(), permit_block: true, ..export() };
            let e = c.should_allow(none).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.message().starts_with("permit_block"), "{}", e.message());
            // A lease for a pool: the rate level's units, no permit held.
            let item = pb::LeaseItem {
                tenant: "acme".into(),
                route: "/export".into(),
                want: 10,
                cost: 1,
                local_permits: true,
                ..Default::default()
            };
            let lease = pb::LeaseRequest { agent_id: "edge".into(), items: vec![item], epoch: 0 };
            let g = c.lease(lease).await.unwrap().into_inner().grants.remove(0);
            assert!(g.permits && !g.permits_only, "{g:?}");
            assert_eq!(g.mode(), pb::LeaseMode::Leased);
            assert!(g.units >= 1 && g.decision.is_none(), "{g:?}");
            let u = usage(c.clone()).await;
            assert_eq!(u.levels[0].remaining, 1000 - g.units);
            assert_eq!((u.held_permits, u.levels[1].remaining), (0, 2), "no permit held");
            s.stop().await;
        }

        #[tokio::test]
        async fn permits_that_come_back_go_to_the_caller_that_waited_longest() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let waiting = |turn: u64| pb::ShouldAllowRequest { turn: Some(turn), ..export() };
            let allowed = |r: &pb::ShouldAllowResponse| r.allowed;
            let a = c.should_allow(export()).await.unwrap().into_inner();
            let b = c.should_allow(export()).await.unwrap().into_inner();
            assert!(a.allowed && b.allowed);
            // Full: a caller that asks to wait gets a turn; one that does not, none.
            let plain = c.should_allow(export()).await.unwrap().into_inner();
            assert!(!plain.allowed);
            assert_eq!(plain.turn, 0, "no turn unless asked for");
            let first = c.should_allow(waiting(0)).await.unwrap().into_inner();
            let second = c.should_allow(waiting(0)).await.unwrap().into_inner();
            assert!(!first.allowed && !second.allowed);
            assert_eq!(first.reason(), pb::Reason::TenantRouteLimit);
            let (t1, t2) = (first.turn, second.turn);
            assert!(t1 != 0 && t2 != 0 && t1 != t2, "{t1} {t2}");
            // A permit comes back: neither a turn nobody gave nor the second waiter
            // takes it before the first.
            c.release(release(&a.permit.unwrap().id)).await.unwrap();
            let forged = c.should_allow(waiting(t1 ^ t2 | 1)).await.unwrap().into_inner();
            assert!(!forged.allowed, "a forged turn took the first waiter's permit");
            assert_eq!(forged.reason(), pb::Reason::TenantRouteLimit);
            // A new place at the back, not the turn it named.
            let f = forged.turn;
            assert!(f != 0 && f != t1 && f != t2, "{forged:?}");
            let early = c.should_allow(waiting(t2)).await.unwrap().into_inner();
            assert!(!early.allowed, "the second waiter took the first waiter's permit");
            let got = c.should_allow(waiting(t1)).await.unwrap().into_inner();
            assert!(got.allowed, "the first waiter is served: {got:?}");
            assert_eq!(got.turn, 0);
            // The next permit is the second waiter's: it kept its place by asking,
            // ahead of the forged turn's place and of a newcomer.
            c.release(release(&b.permit.unwrap().id)).await.unwrap();
            let newcomer = c.should_allow(waiting(0)).await.unwrap().into_inner();
            assert!(!newcomer.allowed && newcomer.turn != 0, "{newcomer:?}");
            assert!(!allowed(&c.should_allow(waiting(f)).await.unwrap().into_inner()));
            let got2 = c.should_allow(waiting(t2)).await.unwrap().into_inner();
            assert!(got2.allowed, "the second waiter is served: {got2:?}");
            // Then the forged caller's place, ahead of the newcomer's.
            c.release(release(&got.permit.unwrap().id)).await.unwrap();
            assert!(!allowed(&c.should_allow(waiting(newcomer.turn)).await.unwrap().into_inner()));
            // A caller that does not wait in line is decided on what is free, as
            // before lines: it is not held behind them.
            let racer = c.should_allow(export()).await.unwrap().into_inner();
            assert!(racer.allowed, "{racer:?}");
            c.release(release(&racer.permit.unwrap().id)).await.unwrap();
            let got3 = c.should_allow(waiting(f)).await.unwrap().into_inner();
            assert!(got3.allowed, "{got3:?}");
            // A waiter that gives up its place (Release with its turn) leaves the
            // line at once: what it waited for is free again for anyone.
            c.release(release(&got3.permit.unwrap().id)).await.unwrap();
            let leave = pb::ReleaseRequest { turn: newcomer.turn, ..release("") };
            let left = c.release(leave).await.unwrap().into_inner();
            assert!(!left.released && left.units == 0, "{left:?}");
            let x = c.should_allow(waiting(0)).await.unwrap().into_inner();
            assert!(x.allowed, "given up: {x:?}");
            // One that stops asking leaves it a fifth of a second after its last ask.
            let quiet = c.should_allow(waiting(0)).await.unwrap().into_inner();
            assert!(!quiet.allowed && quiet.turn != 0);
            c.release(release(&x.permit.unwrap().id)).await.unwrap();
            let held = c.should_allow(waiting(0)).await.unwrap().into_inner();
            assert!(!held.allowed, "reserved for the quiet waiter: {held:?}");
            tokio::time::sleep(Duration::from_millis(250)).await;
            let lapsed = c.should_allow(waiting(0)).await.unwrap().into_inner();
            assert!(lapsed.allowed, "the quiet waiters left: {lapsed:?}");
            s.stop().await;
        }

        #[tokio::test]
        async fn what_cannot_hold_a_permit_is_refused_not_let_through() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            // Check now, charge later: a permit is released, not reported.
            let later = pb::ShouldAllowRequest { report_later: true, ..export() };
            let e = c.should_allow(later).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.message().contains("report_later"), "{}", e.message());
            // Envoy cannot release: refused, and nothing is held.
            let mut envoy = s.envoy().await;
            let answer = envoy
                .should_rate_limit(RateLimitRequest {
                    domain: "acme".into(),
                    descriptors: vec![descriptor(&[("route", "/export")], None)],
                    hits_addend: 1,
                })
                .await
                .unwrap()
                .into_inner();
            assert_eq!(answer.overall_code(), EnvoyCode::OverLimit);
            // A route without a concurrency level holds no permits.
            let mut none = release("p1.1");
            none.route = "/search".into();
            let e = c.release(none).await.unwrap_err();
            assert!(e.message().starts_with("route"), "{}", e.message());
            // Both permits are still free.
            assert!(c.should_allow(export()).await.unwrap().into_inner().allowed);
            assert!(c.should_allow(export()).await.unwrap().into_inner().allowed);
            s.stop().await;
        }
    };
}

on_each_store!(store_tests);
