//! Open-loop behaviour against a server made slow on purpose: the offered rate stays
//! at its target whatever the server does, and what cannot be sent on time is counted.

use std::time::Duration;

use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_server::{RateLimiter, RateLimiterServer};
use loadtest::scenario::Scenario;
use tonic::{Request, Response, Status};

/// Answers `ShouldAllow` after 50 ms, always allowed.
struct Slow;

#[tonic::async_trait]
impl RateLimiter for Slow {
    async fn should_allow(
        &self,
        _: Request<pb::ShouldAllowRequest>,
    ) -> Result<Response<pb::ShouldAllowResponse>, Status> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(Response::new(pb::ShouldAllowResponse { allowed: true, ..Default::default() }))
    }
    async fn should_allow_batch(
        &self,
        _: Request<pb::ShouldAllowBatchRequest>,
    ) -> Result<Response<pb::ShouldAllowBatchResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn report_cost(
        &self,
        _: Request<pb::ReportCostRequest>,
    ) -> Result<Response<pb::ReportCostResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn release(
        &self,
        _: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn renew(
        &self,
        _: Request<pb::RenewRequest>,
    ) -> Result<Response<pb::RenewResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn usage(
        &self,
        _: Request<pb::UsageRequest>,
    ) -> Result<Response<pb::UsageResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn ping(
        &self,
        _: Request<pb::PingRequest>,
    ) -> Result<Response<pb::PingResponse>, Status> {
        Ok(Response::new(pb::PingResponse {}))
    }
    async fn lease(
        &self,
        _: Request<pb::LeaseRequest>,
    ) -> Result<Response<pb::LeaseResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn topology(
        &self,
        _: Request<pb::TopologyRequest>,
    ) -> Result<Response<pb::TopologyResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn handoff(
        &self,
        _: Request<pb::HandoffRequest>,
    ) -> Result<Response<pb::HandoffResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
    async fn replicate(
        &self,
        _: Request<pb::ReplicateRequest>,
    ) -> Result<Response<pb::ReplicateResponse>, Status> {
        Err(Status::unimplemented("slow test server"))
    }
}

async fn slow_server() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RateLimiterServer::new(Slow))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    format!("http://{addr}")
}

fn scenario(url: &str, max_in_flight: usize) -> Scenario {
    let policy = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios/roomy-policy.yaml");
    Scenario::from_yaml(&format!(
        "
name: slow
target: native
policy: {policy}
address: {url}
gateways: 2
arrivals: fixed
tenants: {{ count: 5 }}
routes: [{{ name: /search }}]
phases:
  - {{ rate: 400, for: 3s }}
max_in_flight: {max_in_flight}
timeout: 2s
"
    ))
    .unwrap()
}

/// Each gateway may have 4 requests out: with 50 ms answers, at most 80/s each, 160/s
/// in all, against 400/s offered. A closed loop would quietly offer 160/s; this one
/// keeps offering 400/s and counts what it could not send.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offered_rate_holds_and_unsent_requests_are_counted() {
    let url = slow_server().await;
    let r =
        loadtest::run::run(&scenario(&url, 4), loadtest::run::Options::default()).await.unwrap();
    let t = &r.totals;
    // Fixed arrivals: 200/s from each of 2 gateways for 3 s.
    assert!((1190..=1200).contains(&t.offered), "offered {}", t.offered);
    for s in &r.per_second[..3] {
        assert!((395..=405).contains(&s.offered), "second {}: offered {}", s.t, s.offered);
    }
    assert_eq!(t.offered, t.sent + t.unsent);
    assert_eq!(t.sent, t.admitted + t.rejected + t.errors);
    // About 160/s could go out; the rest is reported, second by second.
    assert!(t.unsent > 600, "unsent {}", t.unsent);
    assert!(t.sent < 600, "sent {}", t.sent);
    assert!(r.per_second[..3].iter().all(|s| s.late > 100), "{:?}", r.per_second);
    assert!(r.latency.p50 >= 50_000.0, "p50 {} µs", r.latency.p50);
}

/// With room for every request, all of them go out on time although each answer takes
/// 50 ms: sends follow the schedule, not the answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sends_follow_the_schedule_not_the_answers() {
    let url = slow_server().await;
    let r =
        loadtest::run::run(&scenario(&url, 1000), loadtest::run::Options::default()).await.unwrap();
    let t = &r.totals;
    assert!((1190..=1200).contains(&t.offered), "offered {}", t.offered);
    assert_eq!(t.unsent, 0);
    assert_eq!(t.admitted, t.offered);
    // A few sends may miss the 5 ms tolerance on a loaded machine; not a tenth.
    assert!(t.late < t.offered / 10, "late {}", t.late);
    assert!(r.latency.p50 >= 50_000.0 && r.latency.p50 < 100_000.0, "p50 {} µs", r.latency.p50);
}
