//! Envoy's Rate Limit Quota Service, spoken with the protocol's own messages: what a
//! first report subscribes, what an assignment looks like to Envoy (whole seconds,
//! a token bucket Envoy can build), what bad reports get, and what a stream sees when
//! its buckets go idle or its node drains.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::TestServer;
use limiter_proto::envoy::service::rate_limit_quota::v3 as rlqs;
use limiter_proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use rlqs::rate_limit_quota_response::BucketAction;
use rlqs::rate_limit_quota_response::bucket_action::BucketAction as Action;
use rlqs::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use rlqs::rate_limit_quota_usage_reports::BucketQuotaUsage;
use tokio::sync::mpsc;

const POLICY: &str = "version: 1
tenants:
  acme:
    routes:
      /api: { algorithm: token_bucket, rate: 100/s, burst: 100 }
";

/// Fast rounds, so that the tests take little time.
const FAST: &[(&str, &str)] = &[
    ("LIMITER__RLQS__ROUND_MS", "200"),
    ("LIMITER__RLQS__TTL_S", "1"),
    ("LIMITER__RLQS__IDLE_MS", "1000"),
];

fn id(entries: &[(&str, &str)]) -> rlqs::BucketId {
    rlqs::BucketId {
        bucket: entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
    }
}

fn usage(id: &rlqs::BucketId, allowed: u64, denied: u64) -> BucketQuotaUsage {
    BucketQuotaUsage {
        bucket_id: Some(id.clone()),
        time_elapsed: Some(prost_types::Duration { seconds: 0, nanos: 0 }),
        num_requests_allowed: allowed,
        num_requests_denied: denied,
        last_report: None,
    }
}

fn reports(domain: &str, usages: Vec<BucketQuotaUsage>) -> rlqs::RateLimitQuotaUsageReports {
    rlqs::RateLimitQuotaUsageReports { domain: domain.to_owned(), bucket_quota_usages: usages }
}

/// One RLQS stream, as an Envoy holds it.
struct Stream {
    tx: mpsc::UnboundedSender<rlqs::RateLimitQuotaUsageReports>,
    rx: tonic::Streaming<rlqs::RateLimitQuotaResponse>,
}

impl Stream {
    async fn open(server: &TestServer, first: rlqs::RateLimitQuotaUsageReports) -> Self {
        let mut client =
            RateLimitQuotaServiceClient::connect(format!("http://{}", server.grpc)).await.unwrap();
        let (tx, rx) = mpsc::unbounded_channel();
        tx.send(first).unwrap();
        let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
        let rx = client.stream_rate_limit_quotas(stream).await.unwrap().into_inner();
        Self { tx, rx }
    }

    fn send(&self, r: rlqs::RateLimitQuotaUsageReports) {
        self.tx.send(r).unwrap();
    }

    /// The next message's actions, or the status the stream ended with.
    async fn next(&mut self) -> Result<Vec<BucketAction>, tonic::Status> {
        match tokio::time::timeout(Duration::from_secs(5), self.rx.message()).await {
            Ok(Ok(Some(m))) => Ok(m.bucket_action),
            Ok(Ok(None)) => Err(tonic::Status::ok("ended")),
            Ok(Err(s)) => Err(s),
            Err(_) => panic!("no message within 5 s"),
        }
    }
}

/// What an action does to Envoy, in short.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Seen {
    Tokens { max_tokens: u32, per_fill: u32, fill_secs: i64, ttl_secs: i64 },
    Deny { ttl_secs: i64 },
    Abandon,
    Other(String),
}

impl Seen {
    /// A token bucket's rate, units a second.
    fn rate(&self) -> Option<f64> {
        match self {
            Self::Tokens { per_fill, fill_secs, .. } => {
                Some(f64::from(*per_fill) / *fill_secs as f64)
            }
            _ => None,
        }
    }
}

fn seen(a: &BucketAction) -> Seen {
    match &a.bucket_action {
        Some(Action::AbandonAction(_)) => Seen::Abandon,
        Some(Action::QuotaAssignmentAction(q)) => {
            let ttl = q.assignment_time_to_live.unwrap_or_default();
            assert_eq!(ttl.nanos, 0, "Envoy reads whole seconds of a TTL only");
            match q.rate_limit_strategy.as_ref().and_then(|s| s.strategy.as_ref()) {
                Some(Strategy::TokenBucket(tb)) => {
                    let fill = tb.fill_interval.unwrap_or_default();
                    assert_eq!(fill.nanos, 0, "Envoy reads whole seconds of a fill interval");
                    Seen::Tokens {
                        max_tokens: tb.max_tokens,
                        per_fill: tb.tokens_per_fill.unwrap_or(1),
                        fill_secs: fill.seconds,
                        ttl_secs: ttl.seconds,
                    }
                }
                Some(Strategy::BlanketRule(r)) if *r == BlanketRule::DenyAll as i32 => {
                    Seen::Deny { ttl_secs: ttl.seconds }
                }
                other => Seen::Other(format!("{other:?}")),
            }
        }
        None => Seen::Other("no action".into()),
    }
}

/// Every action received until `until` returns true for what was seen so far, by
/// bucket id (its entries sorted).
async fn collect(
    s: &mut Stream,
    mut until: impl FnMut(&HashMap<String, Vec<Seen>>) -> bool,
) -> HashMap<String, Vec<Seen>> {
    let mut all: HashMap<String, Vec<Seen>> = HashMap::new();
    while !until(&all) {
        for a in s.next().await.expect("the stream goes on") {
            let mut e: Vec<_> = a
                .bucket_id
                .as_ref()
                .unwrap()
                .bucket
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect();
            e.sort();
            all.entry(e.join(",")).or_default().push(seen(&a));
        }
    }
    all
}

/// Reports `usages` on `s`'s stream every 200 ms (Envoy's reporting interval here)
/// until aborted.
fn report_every_200ms(s: &Stream, usages: Vec<BucketQuotaUsage>) -> tokio::task::JoinHandle<()> {
    let tx = s.tx.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if tx.send(reports("acme", usages.clone())).is_err() {
                return;
            }
        }
    })
}

#[tokio::test]
async fn a_first_report_subscribes_and_its_bucket_is_a_token_bucket_envoy_can_build() {
    let server = TestServer::start_with(POLICY, FAST).await;
    let bucket = id(&[("route", "/api"), ("user", "u1")]);
    let mut s = Stream::open(&server, reports("acme", vec![usage(&bucket, 1, 0)])).await;
    // Assigned at once, before the first round.
    let first = s.next().await.unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].bucket_id.as_ref(), Some(&bucket));
    let Seen::Tokens { max_tokens, per_fill, fill_secs, ttl_secs } = seen(&first[0]) else {
        panic!("{:?}", seen(&first[0]));
    };
    assert!(max_tokens >= 1 && per_fill >= 1, "{max_tokens} {per_fill}");
    assert!(fill_secs >= 1, "a fill interval under a second divides by zero in Envoy");
    assert!(ttl_secs >= 1, "a TTL under a second expires at once in Envoy");
    // Envoy reports every interval; at 80 a second the rate follows the demand, and
    // the same bucket is re-sent each round to extend its TTL.
    let reporter = report_every_200ms(&s, vec![usage(&bucket, 16, 0)]);
    let all =
        collect(&mut s, |all| all.get("route=/api,user=u1").is_some_and(|v| v.len() >= 12)).await;
    reporter.abort();
    let seen = &all["route=/api,user=u1"];
    let rates: Vec<f64> = seen.iter().filter_map(Seen::rate).collect();
    assert_eq!(rates.len(), seen.len(), "token buckets only: {seen:?}");
    let last = *rates.last().unwrap();
    // Demand 80 a second, asked for with headroom, within the limit of 100.
    assert!((80.0..=100.0).contains(&last), "{last} a second: {seen:?}");
    // Re-sent unchanged, mostly: a change costs Envoy's bucket state.
    let same = seen.windows(2).filter(|w| w[0] == w[1]).count();
    assert!(same * 2 >= seen.len(), "mostly re-sent as it was: {seen:?}");
    server.stop().await;
}

#[tokio::test]
async fn bad_reports_are_refused_by_field_or_denied_never_passed() {
    let server = TestServer::start_with(POLICY, FAST).await;
    // A stream whose first report names no domain ends, naming the field.
    let mut s =
        Stream::open(&server, reports("", vec![usage(&id(&[("route", "/api")]), 1, 0)])).await;
    let status = s.next().await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().starts_with("domain:"), "{}", status.message());

    // A bucket that maps to no route (no `route` entry, no default route) is denied;
    // one beyond the stream's cap too; the stream and its other buckets go on.
    let ok = id(&[("route", "/api")]);
    let unmapped = id(&[("user", "u1")]);
    let mut s =
        Stream::open(&server, reports("acme", vec![usage(&ok, 1, 0), usage(&unmapped, 1, 0)]))
            .await;
    let all = collect(&mut s, |all| all.len() >= 2).await;
    assert!(matches!(all["route=/api"][0], Seen::Tokens { .. }), "{all:?}");
    assert!(matches!(all["user=u1"][0], Seen::Deny { ttl_secs } if ttl_secs >= 1), "{all:?}");

    // Another domain on the same stream ends it, naming the field.
    s.send(reports("other", vec![usage(&ok, 1, 0)]));
    let status = loop {
        match s.next().await {
            Ok(_) => {}
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(status.message().starts_with("domain:"), "{}", status.message());
    // The service still serves.
    let mut s = Stream::open(&server, reports("acme", vec![usage(&ok, 1, 0)])).await;
    assert!(matches!(seen(&s.next().await.unwrap()[0]), Seen::Tokens { .. }));
    server.stop().await;
}

#[tokio::test]
async fn buckets_beyond_a_streams_cap_are_denied() {
    let env = [FAST, &[("LIMITER__RLQS__MAX_BUCKETS", "2")]].concat();
    let server = TestServer::start_with(POLICY, &env).await;
    let usages = (0..3)
        .map(|i| usage(&id(&[("route", "/api"), ("user", &format!("u{i}"))]), 1, 0))
        .collect();
    let mut s = Stream::open(&server, reports("acme", usages)).await;
    let all = collect(&mut s, |all| all.len() >= 3).await;
    let denied = all.values().filter(|v| matches!(v[0], Seen::Deny { .. })).count();
    let assigned = all.values().filter(|v| matches!(v[0], Seen::Tokens { .. })).count();
    assert_eq!((assigned, denied), (2, 1), "{all:?}");
    server.stop().await;
}

#[tokio::test]
async fn buckets_beyond_a_nodes_cap_are_denied_until_a_stream_lets_its_own_go() {
    let env = [FAST, &[("LIMITER__RLQS__MAX_TOTAL_BUCKETS", "3")]].concat();
    let server = TestServer::start_with(POLICY, &env).await;
    let bucket = |u: &str| id(&[("route", "/api"), ("user", u)]);
    let first = Stream::open(
        &server,
        reports("acme", vec![usage(&bucket("a"), 1, 0), usage(&bucket("b"), 1, 0)]),
    )
    .await;
    let mut first = first;
    collect(&mut first, |all| all.len() >= 2).await;
    let mut second = Stream::open(
        &server,
        reports("acme", vec![usage(&bucket("c"), 1, 0), usage(&bucket("d"), 1, 0)]),
    )
    .await;
    let all = collect(&mut second, |all| all.len() >= 2).await;
    let denied = all.values().filter(|v| matches!(v[0], Seen::Deny { .. })).count();
    assert_eq!(denied, 1, "three buckets on the node, the fourth denied: {all:?}");
    // The first stream ends: its two buckets no longer count.
    drop(first);
    let mut third = None;
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut s = Stream::open(&server, reports("acme", vec![usage(&bucket("e"), 1, 0)])).await;
        if matches!(seen(&s.next().await.unwrap()[0]), Seen::Tokens { .. }) {
            third = Some(s);
            break;
        }
    }
    assert!(third.is_some(), "a bucket is assigned again once the first stream's are gone");
    server.stop().await;
}

#[tokio::test]
async fn an_abandoned_bucket_no_longer_counts_against_the_nodes_cap() {
    let env = [FAST, &[("LIMITER__RLQS__MAX_TOTAL_BUCKETS", "1")]].concat();
    let server = TestServer::start_with(POLICY, &env).await;
    let (a, b) = (id(&[("route", "/api"), ("user", "a")]), id(&[("route", "/api"), ("user", "b")]));
    let mut s = Stream::open(&server, reports("acme", vec![usage(&a, 1, 0)])).await;
    // Reported twice with no requests, then no traffic for `rlqs.idle_ms` (1 s):
    // abandoned.
    let reporter = {
        let (tx, a) = (s.tx.clone(), a.clone());
        tokio::spawn(async move {
            for _ in 0..2 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let _ = tx.send(reports("acme", vec![usage(&a, 0, 0)]));
            }
        })
    };
    collect(&mut s, |all| all.get("route=/api,user=a").is_some_and(|v| v.contains(&Seen::Abandon)))
        .await;
    reporter.abort();
    // The node holds no bucket now: a new one is assigned, not denied for the cap.
    s.send(reports("acme", vec![usage(&b, 1, 0)]));
    let all = collect(&mut s, |all| all.contains_key("route=/api,user=b")).await;
    assert!(
        matches!(all["route=/api,user=b"][0], Seen::Tokens { .. }),
        "the abandoned bucket's place is free again: {all:?}"
    );
    server.stop().await;
}

#[tokio::test]
async fn an_idle_bucket_is_abandoned_and_a_draining_node_ends_its_streams_abandoning_nothing() {
    let server = TestServer::start_with(POLICY, FAST).await;
    let idle = id(&[("route", "/api"), ("user", "idle")]);
    let busy = id(&[("route", "/api"), ("user", "busy")]);
    let mut s =
        Stream::open(&server, reports("acme", vec![usage(&idle, 1, 0), usage(&busy, 1, 0)])).await;
    let reporter = report_every_200ms(&s, vec![usage(&idle, 0, 0), usage(&busy, 3, 1)]);
    // No requests for `rlqs.idle_ms` (1 s): abandoned; the busy one is not.
    let all = collect(&mut s, |all| {
        all.get("route=/api,user=idle").is_some_and(|v| v.contains(&Seen::Abandon))
    })
    .await;
    assert!(!all["route=/api,user=busy"].contains(&Seen::Abandon), "{all:?}");
    // Draining: the stream ends with UNAVAILABLE and the busy bucket is not
    // abandoned (Envoy would apply its no-assignment behaviour until it reconnects):
    // it keeps its assignment, paid until it has reconnected, or gets a smaller one.
    let stopping = tokio::spawn(server.stop());
    let mut last = Vec::new();
    let status = loop {
        match s.next().await {
            Ok(actions) => {
                last.extend(
                    actions.iter().filter(|a| a.bucket_id.as_ref() == Some(&busy)).map(seen),
                );
            }
            Err(status) => break status,
        }
    };
    reporter.abort();
    assert!(!last.contains(&Seen::Abandon), "nothing abandoned on drain: {last:?}");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    stopping.await.unwrap();
}

/// An Envoy's denied requests are its own to report: one that claims any demand
/// for a bucket counts as twice the bucket's rate at most, so the other Envoys keep
/// a part by their demand. Here the limit is 100 a second, an honest Envoy's demand
/// 80 a second: its part is 100 x 80 / (80 + 200) = 28.6 a second however much the
/// other claims (counted whole, a claim of 2^62 requests a report left it `DENY_ALL`
/// in most rounds and 3.2 a second at most).
#[tokio::test]
async fn an_envoy_that_claims_any_demand_leaves_the_others_their_parts() {
    let server = TestServer::start_with(POLICY, FAST).await;
    let bucket = id(&[("route", "/api")]);
    let mut greedy = Stream::open(&server, reports("acme", vec![usage(&bucket, 1, 0)])).await;
    let claims = report_every_200ms(&greedy, vec![usage(&bucket, 0, 1 << 62)]);
    // The greedy stream's actions are not read here; drained so its sends go on.
    let drain =
        tokio::spawn(async move { while greedy.rx.message().await.is_ok_and(|m| m.is_some()) {} });
    tokio::time::sleep(Duration::from_millis(600)).await;
    let mut honest = Stream::open(&server, reports("acme", vec![usage(&bucket, 1, 0)])).await;
    let reporter = report_every_200ms(&honest, vec![usage(&bucket, 8, 8)]);
    let all = collect(&mut honest, |all| all.get("route=/api").is_some_and(|v| v.len() >= 8)).await;
    reporter.abort();
    claims.abort();
    drain.abort();
    let last = all["route=/api"].iter().rev().find_map(Seen::rate);
    // Within a tenth of its part (a held rate moves only when a tenth off).
    assert!(last.is_some_and(|r| r >= 25.7), "{last:?} a second: {all:?}");
    server.stop().await;
}
