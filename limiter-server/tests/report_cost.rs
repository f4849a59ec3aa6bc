//! Check now, charge later: admitted on an estimate, settled by the actual cost.

mod common;

use common::{Backend, TestServer};
use limiter_proto::limiter::v1 as pb;
use tonic::Code;

const POLICY: &str = r"
version: 1
tenants:
  llm:
    limit: { algorithm: fixed_window, limit: 1000, window: 1h }
    routes:
      /complete: { algorithm: sliding_log, limit: 500, window: 1h }
";

fn estimate(cost: u64) -> pb::ShouldAllowRequest {
    pb::ShouldAllowRequest {
        tenant: "llm".into(),
        route: "/complete".into(),
        cost: Some(cost),
        report_later: true,
        ..Default::default()
    }
}

fn report(ticket: &str, actual: u64) -> pb::ReportCostRequest {
    pb::ReportCostRequest {
        tenant: "llm".into(),
        route: "/complete".into(),
        key: String::new(),
        ticket: ticket.into(),
        actual_cost: actual,
    }
}

/// The tests, for one store.
macro_rules! store_tests {
    () => {
        #[tokio::test]
        async fn refunds_an_overestimate_and_charges_an_underestimate() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let a = c.should_allow(estimate(100)).await.unwrap().into_inner();
            assert!(a.allowed && !a.ticket.is_empty());
            assert_eq!(a.remaining, 400);
            // Actual 30: 70 back on every level.
            let r = c.report_cost(report(&a.ticket, 30)).await.unwrap().into_inner();
            assert_eq!((r.charged, r.refunded, r.remaining), (0, 70, 470));
            // The same ticket cannot be refunded twice.
            let e = c.report_cost(report(&a.ticket, 0)).await.unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert!(e.message().starts_with("ticket"), "{}", e.message());

            // Underestimate: 400 admitted, 900 used: 500 more, past the route's 500: a debt.
            let b = c.should_allow(estimate(400)).await.unwrap().into_inner();
            assert!(b.allowed);
            let r = c.report_cost(report(&b.ticket, 900)).await.unwrap().into_inner();
            assert_eq!((r.charged, r.refunded, r.remaining), (500, 0, 0));
            let next = c.should_allow(estimate(1)).await.unwrap().into_inner();
            assert!(!next.allowed, "the debt is recorded, not lost");
            // The tenant level has room (30 + 900 of 1000); the route level is in debt.
            assert_eq!(next.reason(), pb::Reason::TenantRouteLimit);
            s.stop().await;
        }

        #[tokio::test]
        async fn a_report_far_above_its_estimate_owes_at_most_ten_allowances() {
            let policy = "version: 1\ntenants:\n  llm:\n    routes:\n      /complete: { algorithm: token_bucket, rate: 1/s, burst: 10 }\n";
            let s = TestServer::start_on(BACKEND, policy).await;
            let mut c = s.native().await;
            let a = c.should_allow(estimate(1)).await.unwrap().into_inner();
            assert!(a.allowed);
            c.report_cost(report(&a.ticket, 1_000_000)).await.unwrap();
            // 110 tokens owed at most (the burst and ten more allowances), not a million:
            // one more token is about 101 s away, not eleven days. (On Redis, units of
            // the batch leased before the report were paid for before it: spent first.)
            let mut next = c.should_allow(estimate(1)).await.unwrap().into_inner();
            for _ in 0..10 {
                if !next.allowed {
                    break;
                }
                next = c.should_allow(estimate(1)).await.unwrap().into_inner();
            }
            assert!(!next.allowed);
            let wait = next.retry_after.unwrap();
            assert!((100..=101).contains(&wait.seconds), "{wait:?}");
            s.stop().await;
        }

        #[tokio::test]
        async fn forged_tickets_are_refused() {
            let s = TestServer::start_on(BACKEND, POLICY).await;
            let mut c = s.native().await;
            let a = c.should_allow(estimate(10)).await.unwrap().into_inner();
            // The same ticket for another tenant, or altered, does not match.
            let mut other = report(&a.ticket, 1);
            other.route = "/other".into();
            assert_eq!(c.report_cost(other).await.unwrap_err().code(), Code::InvalidArgument);
            let forged = a.ticket.replacen(".a.", ".1f4.", 1);
            assert_eq!(
                c.report_cost(report(&forged, 1)).await.unwrap_err().code(),
                Code::InvalidArgument
            );
            assert_eq!(
                c.report_cost(report("garbage", 1)).await.unwrap_err().code(),
                Code::InvalidArgument
            );
            s.stop().await;
        }
    };
}

on_each_store!(store_tests);
