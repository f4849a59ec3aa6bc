//! Envoy's `ShouldRateLimit` over real gRPC: descriptor mapping, several descriptors,
//! per-descriptor `hits_addend`, statuses in order, headers, and all-or-nothing.

mod common;

use common::envoy::{descriptor, header};

use common::{Backend, TestServer};
use limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use limiter_proto::envoy::service::ratelimit::v3::RateLimitRequest;
use limiter_proto::envoy::service::ratelimit::v3::rate_limit_response::{Code, rate_limit::Unit};
use tonic::Code as Grpc;

const POLICY: &str = r"
version: 1
tenants:
  shop:
    limit: { algorithm: fixed_window, limit: 10, window: 1m, name: shop-minute }
    routes:
      /cart: { algorithm: fixed_window, limit: 3, window: 1h, name: cart }
    per_key: { algorithm: token_bucket, rate: 2/s, burst: 4, name: per-user }
";

fn request(descriptors: Vec<RateLimitDescriptor>, hits: u32) -> RateLimitRequest {
    RateLimitRequest { domain: "shop".into(), descriptors, hits_addend: hits }
}

/// The tests, for one store.
macro_rules! store_tests {
    () => {
        #[tokio::test]
        async fn several_descriptors_answered_in_order_with_headers() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.envoy().await;
            let req = request(
                vec![
                    descriptor(&[("route", "/cart")], None),
                    descriptor(&[("route", "/search"), ("user", "u1")], Some(2)),
                ],
                0,
            );
            let r = c.should_rate_limit(req.clone()).await.unwrap().into_inner();
            assert_eq!(r.overall_code(), Code::Ok);
            assert_eq!(r.statuses.len(), 2);
            // Descriptor 0: tenant x route, 3 per hour (an hour: no window ends mid-test), 1 used.
            let d0 = &r.statuses[0];
            assert_eq!(d0.code(), Code::Ok);
            let l0 = d0.current_limit.as_ref().unwrap();
            assert_eq!(
                (l0.requests_per_unit, l0.unit(), l0.name.as_str()),
                (3, Unit::Hour, "cart")
            );
            assert_eq!(d0.limit_remaining, 2);
            // Descriptor 1: its own hits_addend (2) against the per-user bucket of 4.
            let d1 = &r.statuses[1];
            assert_eq!(d1.current_limit.as_ref().unwrap().name, "per-user");
            assert_eq!(d1.limit_remaining, 2);
            assert!(d1.duration_until_reset.is_some());
            let policy = header(&r, "RateLimit-Policy").unwrap();
            assert!(policy.contains(r#""cart";q=3;w=3600"#), "{policy}");
            assert!(policy.contains(r#""per-user";q=4;w=2"#), "{policy}");
            let limit = header(&r, "RateLimit").unwrap();
            assert!(limit.contains(r#""cart";r=2;t="#), "{limit}");
            assert!(header(&r, "Retry-After").is_none());

            // Two more /cart calls use it up; the next is OVER_LIMIT with Retry-After and reason.
            let only_cart = request(vec![descriptor(&[("route", "/cart")], None)], 1);
            for _ in 0..2 {
                let r = c.should_rate_limit(only_cart.clone()).await.unwrap().into_inner();
                assert_eq!(r.overall_code(), Code::Ok);
            }
            let r = c.should_rate_limit(only_cart).await.unwrap().into_inner();
            assert_eq!(r.overall_code(), Code::OverLimit);
            assert_eq!(r.statuses[0].code(), Code::OverLimit);
            assert_eq!(r.statuses[0].limit_remaining, 0);
            let retry: u64 = header(&r, "Retry-After").unwrap().parse().unwrap();
            assert!((1..=3_600).contains(&retry), "{retry}");
            assert_eq!(header(&r, "x-ratelimit-reason"), Some("TENANT_ROUTE_LIMIT"));
            s.stop().await;
        }

        #[tokio::test]
        async fn one_rejected_descriptor_charges_none() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.envoy().await;
            // Use the per-user bucket up (4), then ask for it and /cart together.
            let user = descriptor(&[("route", "/search"), ("user", "u9")], Some(4));
            let r = c.should_rate_limit(request(vec![user.clone()], 0)).await.unwrap().into_inner();
            assert_eq!(r.overall_code(), Code::Ok);
            let both = request(vec![descriptor(&[("route", "/cart")], None), user], 0);
            let r = c.should_rate_limit(both).await.unwrap().into_inner();
            assert_eq!(r.overall_code(), Code::OverLimit);
            assert_eq!(r.statuses[0].code(), Code::Ok);
            assert_eq!(r.statuses[1].code(), Code::OverLimit);
            // /cart was not charged: all 3 remain.
            let r = c
                .should_rate_limit(request(vec![descriptor(&[("route", "/cart")], Some(0))], 0))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.statuses[0].limit_remaining, 3);
            s.stop().await;
        }

        #[tokio::test]
        async fn hits_addend_rules() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.envoy().await;
            // Request-level 0 is read as 1; per-descriptor 0 checks without charging.
            let check = request(vec![descriptor(&[("route", "/cart")], Some(0))], 0);
            for _ in 0..5 {
                let r = c.should_rate_limit(check.clone()).await.unwrap().into_inner();
                assert_eq!(r.statuses[0].limit_remaining, 3);
            }
            let r = c
                .should_rate_limit(request(vec![descriptor(&[("route", "/cart")], None)], 0))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.statuses[0].limit_remaining, 2);
            // Request-level 2 applies to descriptors without their own.
            let r = c
                .should_rate_limit(request(vec![descriptor(&[("route", "/cart")], None)], 2))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(r.statuses[0].limit_remaining, 0);
            s.stop().await;
        }

        #[tokio::test]
        async fn malformed_envoy_requests_are_invalid_arguments_and_impossible_costs_over_limit() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.envoy().await;
            let e = c.should_rate_limit(request(vec![], 0)).await.unwrap_err();
            assert_eq!(e.code(), Grpc::InvalidArgument);
            assert!(e.message().contains("descriptors"), "{}", e.message());
            let e = c
                .should_rate_limit(request(vec![descriptor(&[("user", "x")], None)], 0))
                .await
                .unwrap_err();
            assert_eq!(e.code(), Grpc::InvalidArgument);
            assert!(e.message().contains("`route`"), "{}", e.message());
            let mut no_domain = request(vec![descriptor(&[("route", "/a")], None)], 0);
            no_domain.domain.clear();
            let e = c.should_rate_limit(no_domain).await.unwrap_err();
            assert!(e.message().starts_with("domain"), "{}", e.message());
            let too_many =
                request((0..17).map(|_| descriptor(&[("route", "/a")], None)).collect(), 0);
            let e = c.should_rate_limit(too_many).await.unwrap_err();
            assert_eq!(e.code(), Grpc::InvalidArgument);
            // A cost that can never fit is no error (Envoy would let it through): it
            // is over the limit, with the reason and why.
            let huge = request(vec![descriptor(&[("route", "/cart")], Some(1_000))], 0);
            let r = c.should_rate_limit(huge).await.unwrap().into_inner();
            assert_eq!(r.overall_code(), Code::OverLimit);
            assert_eq!(header(&r, "x-ratelimit-reason"), Some("TENANT_LIMIT"));
            assert!(header(&r, "x-ratelimit-detail").is_some_and(|d| d.contains("cost 1000")));
            // Still serving.
            let ok = c
                .should_rate_limit(request(vec![descriptor(&[("route", "/x")], None)], 0))
                .await
                .unwrap();
            assert_eq!(ok.into_inner().overall_code(), Code::Ok);
            s.stop().await;
        }
    };
}

on_each_store!(store_tests);
