//! Two stateless servers sharing one Redis enforce one tenant's limits exactly under
//! concurrent load: the batches each server leases are pre-paid in Redis, so neither
//! can spend what the other holds, and every unit not spent goes back.

mod common;

use std::time::Duration;

use tokio::time::Instant;

use common::redis::{RedisServer, script_calls};
use common::{TestServer, ask, eventually};
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use tonic::transport::Channel;

const POLICY: &str = r"
version: 1
lease: { mode: leased, ttl: 1s, max_batch: 200 }
tenants:
  fw:
    limit: { algorithm: fixed_window, limit: 3000, window: 1h }
  tb:
    limit: { algorithm: token_bucket, rate: 400/s, burst: 400 }
";

/// Sends `tenant`'s requests until `stop_after` rejections in a row or `period` ends.
async fn hammer(
    mut c: RateLimiterClient<Channel>,
    tenant: &'static str,
    period: Duration,
    stop_after: u32,
) -> (u64, u64) {
    let (mut allowed, mut rejected, mut streak) = (0, 0, 0);
    let end = Instant::now() + period;
    while Instant::now() < end && streak < stop_after {
        let r = c.should_allow(ask(tenant, "/any")).await.unwrap().into_inner();
        if r.allowed {
            allowed += 1;
            streak = 0;
        } else {
            assert_eq!(r.reason(), pb::Reason::TenantLimit);
            rejected += 1;
            streak += 1;
        }
    }
    (allowed, rejected)
}

async fn two_servers(redis: &RedisServer) -> (TestServer, TestServer) {
    let url = redis.url();
    let env = [("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__URL", url.as_str())];
    (TestServer::start_with(POLICY, &env).await, TestServer::start_with(POLICY, &env).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_limit_is_exact_across_two_servers() {
    let redis = RedisServer::start();
    let (a, b) = two_servers(&redis).await;
    let calls_before = script_calls(redis.port);
    let mut tasks = Vec::new();
    for s in [&a, &b] {
        for _ in 0..4 {
            tasks.push(tokio::spawn(hammer(s.native().await, "fw", Duration::from_secs(20), 50)));
        }
    }
    let (mut allowed, mut rejected) = (0, 0);
    for t in tasks {
        let (y, n) = t.await.unwrap();
        allowed += y;
        rejected += n;
    }
    let calls = script_calls(redis.port) - calls_before;
    let decisions = allowed + rejected;
    println!(
        "fixed window 3000/h on two servers: {allowed} admitted, {rejected} rejected; \
         {calls} Redis calls for {decisions} decisions ({:.1} per 1000)",
        calls as f64 * 1000.0 / decisions as f64
    );
    assert!(allowed <= 3_000, "overshoot: {allowed} admitted of 3000");
    // Once the batches are back (at their end, 1 s), Redis holds exactly what was
    // admitted: nothing stranded, nothing lost.
    let mut c = a.native().await;
    let exact = eventually(Duration::from_secs(5), || {
        let mut c = c.clone();
        async move {
            let dry = pb::ShouldAllowRequest { dry_run: true, ..ask("fw", "/any") };
            let r = c.should_allow(dry).await.unwrap().into_inner();
            r.remaining + allowed == 3_000
        }
    })
    .await;
    let dry = pb::ShouldAllowRequest { dry_run: true, ..ask("fw", "/any") };
    let left = c.should_allow(dry).await.unwrap().into_inner().remaining;
    assert!(exact, "{allowed} admitted + {left} left in Redis != 3000");
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_bucket_never_overshoots_across_two_servers() {
    let redis = RedisServer::start();
    let (a, b) = two_servers(&redis).await;
    let started = Instant::now();
    let mut tasks = Vec::new();
    for s in [&a, &b] {
        for _ in 0..3 {
            tasks.push(tokio::spawn(hammer(
                s.native().await,
                "tb",
                Duration::from_secs(2),
                u32::MAX,
            )));
        }
    }
    let mut allowed = 0;
    for t in tasks {
        allowed += t.await.unwrap().0;
    }
    let elapsed = started.elapsed().as_secs_f64();
    // The bucket's own bound: its burst plus its rate over the run.
    let bound = 400.0 + 400.0 * elapsed;
    println!(
        "token bucket 400/s on two servers: {allowed} admitted in {elapsed:.2} s (bound {bound:.0})"
    );
    assert!((allowed as f64) <= bound, "{allowed} > {bound}");
    // And close to it: the servers are not starved by each other's batches.
    assert!((allowed as f64) >= 0.7 * bound, "{allowed} far below {bound}");
    a.stop().await;
    b.stop().await;
}

/// Left at `tenant`'s limit, read with a dry run.
async fn left(c: &mut RateLimiterClient<Channel>, tenant: &str) -> u64 {
    let dry = pb::ShouldAllowRequest { dry_run: true, ..ask(tenant, "/any") };
    c.should_allow(dry).await.unwrap().into_inner().remaining
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewal_is_one_script_call_that_returns_and_takes() {
    let redis = RedisServer::start();
    let url = redis.url();
    let env = [("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__URL", url.as_str())];
    let server = TestServer::start_with(POLICY, &env).await;
    let c = server.native().await;
    let mut dry = c.clone();
    let item = |lease_id, unspent, cost| pb::LeaseItem {
        tenant: "fw".into(),
        route: "/any".into(),
        lease_id,
        unspent,
        want: 50,
        cost,
        demand_per_sec: 1_000,
        ..Default::default()
    };
    let lease = |items: Vec<pb::LeaseItem>| {
        let mut c = c.clone();
        async move {
            let req = pb::LeaseRequest { agent_id: "agent-1".into(), items, epoch: 0 };
            let mut grants = c.lease(req).await.unwrap().into_inner().grants;
            assert_eq!(grants.len(), 1);
            grants.remove(0)
        }
    };
    // The first call of all loads the script (a NOSCRIPT, then EVAL): done here.
    assert_eq!(left(&mut dry, "fw").await, 3_000);
    let before = script_calls(redis.port);
    let first = lease(vec![item(0, 0, 1)]).await;
    assert_eq!(script_calls(redis.port) - before, 1, "a first grant is one call");
    assert_eq!((first.mode(), first.units), (pb::LeaseMode::Leased, 50));
    let mut id = first.lease_id;
    // Each renewal hands back 10 of its 50 and takes 50 more, in one call.
    for n in 1..=5u64 {
        let before = script_calls(redis.port);
        let g = lease(vec![item(id, 10, 0)]).await;
        assert_eq!(script_calls(redis.port) - before, 1, "renewal {n} is one script call");
        assert_eq!((g.mode(), g.units), (pb::LeaseMode::Leased, 50), "renewal {n}");
        assert_ne!(g.lease_id, id);
        id = g.lease_id;
        // Outstanding: every grant (50 each) less what came back (10 each).
        assert_eq!(left(&mut dry, "fw").await, 3_000 - 50 * (n + 1) + 10 * n, "renewal {n}");
    }
    // A last return with nothing asked for settles the lease: all 50 back.
    lease(vec![pb::LeaseItem { want: 0, ..item(id, 50, 0) }]).await;
    assert_eq!(left(&mut dry, "fw").await, 3_000 - 50 * 6 + 10 * 5 + 50);
    server.stop().await;
}

/// The Redis script divides what is left by the asks: given the others' asks weighed
/// by demand, an agent claiming any demand and asking a whole batch beside an honest
/// agent of 80 a second (`hostile.rs`) leaves it its share by the grant rule. Each
/// round the claimer takes half of what is left and the honest agent 80 / 280 of the
/// rest: in the steady state 2.2 of the 15.6 units a round, 44 in 2 s (measured 43-47
/// in six runs). Given the others' asks as they were, it got 4 and 5.
#[tokio::test]
async fn a_claimed_demand_leaves_an_honest_agent_its_share_on_redis() {
    let redis = RedisServer::start();
    let url = redis.url();
    let env = [("LIMITER__STORE__KIND", "redis"), ("LIMITER__STORE__REDIS__URL", url.as_str())];
    let server = TestServer::start_with(common::BATCHED, &env).await;
    let got = common::claim_beside_an_honest_agent(&server).await;
    println!("the honest agent got {got} units in the last 2 s");
    // Four fifths of that at least.
    assert!(got >= 35, "the honest agent got {got} units in the last 2 s");
    server.stop().await;
}
