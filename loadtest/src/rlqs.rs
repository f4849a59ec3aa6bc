//! A simulated Envoy `rate_limit_quota` filter: an RLQS client that behaves as
//! Envoy's implementation does, so that a fleet of Envoys can be measured without an
//! Envoy binary.
//!
//! What it copies of Envoy (its `rate_limit_quota` filter's client):
//! - one stream per process and domain, opened by the first bucket and reopened on
//!   the next report after it ends (on the cluster's next endpoint, here), keeping
//!   its buckets and their assignments meanwhile; every bucket it tracks is reported each
//!   `reporting_interval`, and a new bucket at once, by itself (its first report is
//!   its subscription);
//! - each request takes one token; `time_elapsed` is whole seconds (so often 0);
//! - an assignment's TTL is read in whole seconds (a fraction is dropped: under a
//!   second expires at once); unset, it never expires;
//! - a token bucket refills continuously at `tokens_per_fill` over the fill
//!   interval's whole seconds (0 seconds divides by zero: an endless rate); a new
//!   bucket starts full, and so does one replacing another before Envoy 1.33; from
//!   1.33 (`EnvoyConfig::carries_tokens`) a bucket replacing a live one starts with
//!   its share of the old one's tokens, `floor(max_tokens x left / old max_tokens)`;
//! - a token bucket equal to the one held in `max_tokens`, `tokens_per_fill` and the
//!   fill interval's nanoseconds (only) is kept with its tokens and its TTL
//!   extended; anything else replaces it;
//! - `requests_per_time_unit` is not supported: the action is dropped;
//! - abandon erases the bucket (its next request subscribes again);
//! - before any assignment, and after one expired without a fallback, the
//!   no-assignment behaviour decides; after expiry, the fallback if configured.
//!
//! Every admission under a token bucket is recorded with when that bucket was
//! created, for the judge: what it admits was paid for no earlier than the
//! assignment that created the bucket was sent (a token carried from a replaced
//! bucket, no earlier than the first bucket of the chain it was carried along; a
//! bucket spends its carried tokens first).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::{Clock, NANOS_PER_SEC, Nanos};
use limiter_proto::envoy::service::rate_limit_quota::v3 as rlqs;
use limiter_proto::envoy::r#type::v3::rate_limit_strategy::{BlanketRule, Strategy};
use parking_lot::Mutex;
use rlqs::rate_limit_quota_response::bucket_action::BucketAction as Action;
use rlqs::rate_limit_quota_service_client::RateLimitQuotaServiceClient;
use rlqs::rate_limit_quota_usage_reports::BucketQuotaUsage;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What a simulated Envoy does where no assignment applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blanket {
    /// Admit.
    Allow,
    /// Refuse.
    Deny,
}

/// A simulated Envoy's filter configuration.
#[derive(Debug, Clone)]
pub struct EnvoyConfig {
    /// The RLQS cluster's endpoints, `http://host:port`: a stream opens on the first;
    /// when a stream ends or cannot open, the next one is tried (as Envoy's load
    /// balancer moves off a host that went away).
    pub urls: Vec<String>,
    /// The stream's domain.
    pub domain: String,
    /// How often every bucket is reported.
    pub reporting_interval: Duration,
    /// Before the first assignment (and after abandon).
    pub no_assignment: Blanket,
    /// After an assignment expired; `None`: the no-assignment behaviour.
    pub expired: Option<Blanket>,
    /// Envoy 1.33 and later: a token bucket replaced by another while it lives
    /// starts the new one with the old one's share of tokens,
    /// `floor(max_tokens x left / old max_tokens)`, not full.
    pub carries_tokens: bool,
}

/// One admission under a token bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admitted {
    /// When it was admitted.
    pub at: Nanos,
    /// When the token bucket it came from was created (its assignment received);
    /// where the token was carried from a replaced bucket, when the first bucket
    /// it was carried from was (its payment was no later).
    pub bucket_since: Nanos,
}

/// What a simulated Envoy counted for one bucket.
#[derive(Debug, Clone, Default)]
pub struct BucketLog {
    /// Admissions under a token bucket.
    pub admitted: Vec<Admitted>,
    /// Admitted by a blanket rule or a no-assignment/expired behaviour.
    pub admitted_blanket: u64,
    /// Refused.
    pub denied: u64,
    /// When requests were refused by a blanket rule (`DENY_ALL`, or a deny as the
    /// no-assignment or expired behaviour).
    pub denied_blanket: Vec<Nanos>,
    /// Refill a full token bucket could not hold (when a request found it so, and
    /// how much): paid for, never spendable.
    pub refill_lost: Vec<(Nanos, f64)>,
    /// Tokens left in a token bucket when an assignment replaced it (less what the
    /// new one carried of them).
    pub discarded: Vec<(Nanos, f64)>,
    /// Token buckets created (first assignments and changes).
    pub buckets_created: u64,
    /// Assignments received.
    pub assignments: u64,
    /// Abandons received.
    pub abandoned: u64,
}

#[derive(Debug, Clone, Copy)]
struct Tokens {
    max: f64,
    /// Tokens a second (infinite for a fill interval under a second).
    rate: f64,
    tokens: f64,
    last: Nanos,
    since: Nanos,
    /// Tokens carried from a replaced bucket, not yet spent (spent first), and when
    /// the earliest bucket they came from was created.
    carried: f64,
    carried_since: Nanos,
    /// As Envoy compares: max tokens, tokens per fill, fill interval nanoseconds.
    identity: (u32, u32, i32),
}

impl Tokens {
    /// Takes a token if it holds one: when the bucket the token was paid in was
    /// created, if it did; and the refill it could not hold, if any.
    fn take(&mut self, now: Nanos) -> (Option<Nanos>, f64) {
        let lost;
        (self.tokens, lost) = self.left_at(now);
        self.last = now;
        if self.tokens < 1.0 {
            return (None, lost);
        }
        self.tokens -= 1.0;
        let since = if self.carried > 0.0 { self.carried_since } else { self.since };
        self.carried = (self.carried - 1.0).max(0.0);
        (Some(since), lost)
    }

    /// Its tokens and the refill it could not hold, brought up to `now`.
    fn left_at(&self, now: Nanos) -> (f64, f64) {
        let dt = now.saturating_sub(self.last) as f64 / NANOS_PER_SEC as f64;
        let filled = self.tokens + dt * self.rate;
        (filled.min(self.max), (filled - self.max).max(0.0))
    }
}

#[derive(Debug, Clone, Copy)]
enum Held {
    Blanket(Blanket),
    Tokens(Tokens),
}

#[derive(Debug)]
struct Bucket {
    id: rlqs::BucketId,
    allowed: u64,
    denied: u64,
    last_report: Nanos,
    held: Option<Held>,
    /// When the held assignment expires (`None`: never).
    expires: Option<Nanos>,
}

#[derive(Debug, Default)]
struct State {
    buckets: HashMap<String, Bucket>,
    logs: HashMap<String, BucketLog>,
    /// Report messages sent.
    reports: u64,
    /// Streams opened.
    streams: u64,
}

/// A simulated Envoy process.
pub struct Envoy {
    config: EnvoyConfig,
    clock: Arc<dyn Clock>,
    state: Arc<Mutex<State>>,
    /// Reports to send at once (a new bucket's).
    urgent: mpsc::UnboundedSender<rlqs::RateLimitQuotaUsageReports>,
    stop: CancellationToken,
}

impl std::fmt::Debug for Envoy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Envoy").field("config", &self.config).finish_non_exhaustive()
    }
}

/// A bucket id from its entries.
pub fn bucket_id(entries: &[(&str, &str)]) -> rlqs::BucketId {
    rlqs::BucketId {
        bucket: entries.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
    }
}

/// A bucket id's entries sorted, as one string.
pub fn bucket_name(id: &rlqs::BucketId) -> String {
    let mut e: Vec<_> = id.bucket.iter().map(|(k, v)| format!("{k}={v}")).collect();
    e.sort();
    e.join(",")
}

impl Envoy {
    /// Starts the simulated Envoy (its reporting task); the stream opens with the
    /// first bucket.
    ///
    /// # Errors
    ///
    /// A malformed URL.
    pub fn start(config: EnvoyConfig, clock: Arc<dyn Clock>) -> anyhow::Result<Arc<Self>> {
        anyhow::ensure!(!config.urls.is_empty(), "an Envoy needs an RLQS endpoint");
        let clients = config
            .urls
            .iter()
            .map(|u| Ok(RateLimitQuotaServiceClient::new(crate::target::channel(u)?)))
            .collect::<anyhow::Result<Vec<_>>>()?;
        let (urgent, rx) = mpsc::unbounded_channel();
        let envoy = Arc::new(Self {
            config,
            clock,
            state: Arc::default(),
            urgent,
            stop: CancellationToken::new(),
        });
        tokio::spawn(envoy.clone().stream_loop(clients, rx));
        Ok(envoy)
    }

    /// Stops reporting and closes the stream.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Decides one request matched into bucket `id`.
    pub fn decide(&self, id: &rlqs::BucketId) -> bool {
        let now = self.clock.now();
        let name = bucket_name(id);
        let mut st = self.state.lock();
        let st = &mut *st;
        let Some(b) = st.buckets.get_mut(&name) else {
            // A new bucket: the no-assignment behaviour, and a report at once.
            let allowed = self.config.no_assignment == Blanket::Allow;
            st.buckets.insert(
                name.clone(),
                Bucket {
                    id: id.clone(),
                    allowed: 0,
                    denied: 0,
                    last_report: now,
                    held: None,
                    expires: None,
                },
            );
            let log = st.logs.entry(name).or_default();
            if allowed {
                log.admitted_blanket += 1;
            } else {
                log.denied += 1;
            }
            st.reports += 1;
            let _ = self.urgent.send(rlqs::RateLimitQuotaUsageReports {
                domain: self.config.domain.clone(),
                bucket_quota_usages: vec![BucketQuotaUsage {
                    bucket_id: Some(id.clone()),
                    time_elapsed: Some(prost_types::Duration { seconds: 0, nanos: 0 }),
                    num_requests_allowed: u64::from(allowed),
                    num_requests_denied: u64::from(!allowed),
                    last_report: None,
                }],
            });
            return allowed;
        };
        let log = st.logs.entry(name).or_default();
        let expired = b.expires.is_some_and(|e| now >= e);
        let rule = match (&mut b.held, expired) {
            (Some(Held::Tokens(t)), false) => {
                let (ok, lost) = t.take(now);
                if lost > 0.0 {
                    log.refill_lost.push((now, lost));
                }
                if let Some(since) = ok {
                    log.admitted.push(Admitted { at: now, bucket_since: since });
                    b.allowed += 1;
                } else {
                    log.denied += 1;
                    b.denied += 1;
                }
                return ok.is_some();
            }
            (Some(Held::Blanket(r)), false) => *r,
            (Some(_), true) => self.config.expired.unwrap_or(self.config.no_assignment),
            (None, _) => self.config.no_assignment,
        };
        if rule == Blanket::Allow {
            log.admitted_blanket += 1;
            b.allowed += 1;
            true
        } else {
            log.denied += 1;
            log.denied_blanket.push(now);
            b.denied += 1;
            false
        }
    }

    /// What it counted, per bucket (by [`bucket_name`]).
    pub fn logs(&self) -> HashMap<String, BucketLog> {
        self.state.lock().logs.clone()
    }

    /// Report messages sent and streams opened.
    pub fn counts(&self) -> (u64, u64) {
        let st = self.state.lock();
        (st.reports, st.streams)
    }

    /// Buckets tracked now.
    pub fn buckets(&self) -> usize {
        self.state.lock().buckets.len()
    }

    /// Every bucket's usage since its last report, reset.
    fn report_all(&self) -> Option<rlqs::RateLimitQuotaUsageReports> {
        let now = self.clock.now();
        let mut st = self.state.lock();
        if st.buckets.is_empty() {
            return None;
        }
        let usages = st
            .buckets
            .values_mut()
            .map(|b| {
                let elapsed = now.saturating_sub(b.last_report) / NANOS_PER_SEC;
                b.last_report = now;
                BucketQuotaUsage {
                    bucket_id: Some(b.id.clone()),
                    time_elapsed: Some(prost_types::Duration {
                        seconds: i64::try_from(elapsed).unwrap_or(i64::MAX),
                        nanos: 0,
                    }),
                    num_requests_allowed: std::mem::take(&mut b.allowed),
                    num_requests_denied: std::mem::take(&mut b.denied),
                    last_report: None,
                }
            })
            .collect();
        st.reports += 1;
        Some(rlqs::RateLimitQuotaUsageReports {
            domain: self.config.domain.clone(),
            bucket_quota_usages: usages,
        })
    }

    /// Applies one response's actions, in order.
    fn apply(&self, response: rlqs::RateLimitQuotaResponse) {
        let now = self.clock.now();
        let mut st = self.state.lock();
        let st = &mut *st;
        for action in response.bucket_action {
            let Some(id) = action.bucket_id.filter(|i| !i.bucket.is_empty()) else { continue };
            let name = bucket_name(&id);
            let Some(b) = st.buckets.get_mut(&name) else { continue };
            let log = st.logs.entry(name.clone()).or_default();
            match action.bucket_action {
                Some(Action::AbandonAction(_)) => {
                    log.abandoned += 1;
                    st.buckets.remove(&name);
                }
                Some(Action::QuotaAssignmentAction(a)) => {
                    let held = match a.rate_limit_strategy.and_then(|s| s.strategy) {
                        // Unset: allow all.
                        None => Held::Blanket(Blanket::Allow),
                        Some(Strategy::BlanketRule(r)) => {
                            Held::Blanket(if r == BlanketRule::DenyAll as i32 {
                                Blanket::Deny
                            } else {
                                Blanket::Allow
                            })
                        }
                        // Not supported by Envoy: the action is dropped.
                        Some(Strategy::RequestsPerTimeUnit(_)) => continue,
                        Some(Strategy::TokenBucket(tb)) => {
                            let per_fill = tb.tokens_per_fill.unwrap_or(1);
                            let interval = tb.fill_interval.unwrap_or_default();
                            let identity = (tb.max_tokens, per_fill, interval.nanos);
                            let live = b.expires.is_none_or(|e| now < e);
                            match b.held {
                                Some(Held::Tokens(t)) if t.identity == identity && live => {
                                    Held::Tokens(t)
                                }
                                _ => {
                                    let secs = interval.seconds.max(0) as f64;
                                    log.buckets_created += 1;
                                    let max = f64::from(tb.max_tokens);
                                    // Envoy 1.33 and later: the old bucket's share,
                                    // rounded down as its double becomes an integer.
                                    let carried = match b.held {
                                        Some(Held::Tokens(old))
                                            if live && self.config.carries_tokens =>
                                        {
                                            let share = max * (old.left_at(now).0 / old.max);
                                            let from = if old.carried > 0.0 {
                                                old.carried_since
                                            } else {
                                                old.since
                                            };
                                            Some((share.floor(), from))
                                        }
                                        _ => None,
                                    };
                                    let (tokens, carried, carried_since) = match carried {
                                        Some((t, from)) => (t, t, from),
                                        None => (max, 0.0, now),
                                    };
                                    Held::Tokens(Tokens {
                                        max,
                                        rate: f64::from(per_fill) / secs,
                                        tokens,
                                        last: now,
                                        since: now,
                                        carried,
                                        carried_since,
                                        identity,
                                    })
                                }
                            }
                        }
                    };
                    log.assignments += 1;
                    if let Some(Held::Tokens(old)) = b.held {
                        let kept = matches!(held, Held::Tokens(t) if t.since == old.since);
                        if !kept {
                            let (left, lost) = old.left_at(now);
                            let carried = match held {
                                Held::Tokens(t) => t.carried,
                                Held::Blanket(_) => 0.0,
                            };
                            log.discarded.push((now, (left - carried).max(0.0)));
                            if lost > 0.0 {
                                log.refill_lost.push((now, lost));
                            }
                        }
                    }
                    b.held = Some(held);
                    b.expires = a.assignment_time_to_live.map(|ttl| {
                        now + u64::try_from(ttl.seconds.max(0)).unwrap_or(0) * NANOS_PER_SEC
                    });
                }
                None => {}
            }
        }
    }

    async fn stream_loop(
        self: Arc<Self>,
        mut clients: Vec<RateLimitQuotaServiceClient<tonic::transport::Channel>>,
        mut urgent: mpsc::UnboundedReceiver<rlqs::RateLimitQuotaUsageReports>,
    ) {
        // The endpoint the next stream opens on.
        let mut at = 0;
        let mut tick = tokio::time::interval(self.config.reporting_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The open stream's sender, if any.
        let mut out: Option<mpsc::UnboundedSender<rlqs::RateLimitQuotaUsageReports>> = None;
        let (ended_tx, mut ended) = mpsc::unbounded_channel::<()>();
        loop {
            let report = tokio::select! {
                () = self.stop.cancelled() => return,
                _ = ended.recv() => {
                    out = None;
                    at = (at + 1) % clients.len();
                    continue;
                }
                _ = tick.tick() => match self.report_all() {
                    Some(r) => r,
                    None => continue,
                },
                r = urgent.recv() => match r {
                    Some(r) => r,
                    None => return,
                },
            };
            if out.as_ref().is_none_or(mpsc::UnboundedSender::is_closed) {
                // (Re)open the stream with this report.
                let (tx, rx) = mpsc::unbounded_channel();
                let stream = tokio_stream::wrappers::UnboundedReceiverStream::new(rx);
                let _ = tx.send(report);
                match clients[at].stream_rate_limit_quotas(stream).await {
                    Ok(resp) => {
                        self.state.lock().streams += 1;
                        out = Some(tx);
                        let (me, ended_tx) = (self.clone(), ended_tx.clone());
                        let mut inbound = resp.into_inner();
                        tokio::spawn(async move {
                            while let Ok(Some(msg)) = inbound.message().await {
                                me.apply(msg);
                            }
                            let _ = ended_tx.send(());
                        });
                    }
                    Err(_) => {
                        out = None;
                        at = (at + 1) % clients.len();
                    }
                }
                continue;
            }
            if let Some(tx) = &out {
                let _ = tx.send(report);
            }
        }
    }
}

/// What [`scale`] measured.
#[derive(Debug, Clone)]
pub struct Scale {
    /// Buckets subscribed on the one stream.
    pub buckets: usize,
    /// Buckets that received an assignment.
    pub assigned: usize,
    /// Seconds until every bucket had one.
    pub subscribe_secs: f64,
    /// Server resident memory grown by the subscriptions, bytes a bucket.
    pub bytes_per_bucket: f64,
    /// Report messages (each every bucket) sent while CPU was measured.
    pub reports: u64,
    /// Server CPU per report message, milliseconds (its rounds included).
    pub cpu_ms_per_report: f64,
    /// The same per bucket reported, microseconds.
    pub cpu_us_per_bucket: f64,
}

impl Scale {
    /// As a Markdown table row with its header.
    pub fn markdown(&self) -> String {
        format!(
            "| buckets | assigned | all assigned after | server memory a bucket | reports | server CPU a report | a bucket |\n\
             | --- | --- | --- | --- | --- | --- | --- |\n\
             | {} | {} | {:.1} s | {:.0} B | {} | {:.1} ms | {:.2} µs |",
            self.buckets,
            self.assigned,
            self.subscribe_secs,
            self.bytes_per_bucket,
            self.reports,
            self.cpu_ms_per_report,
            self.cpu_us_per_bucket
        )
    }
}

fn rss_bytes(pid: u32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .ok_or_else(|| anyhow::anyhow!("no VmRSS for {pid}"))?;
    Ok(kb * 1024)
}

/// One server process (this binary), one simulated Envoy subscribing `buckets`
/// buckets on one stream (each with one request, reported at once as Envoy does),
/// then reporting them all every second for `secs` seconds: the server's memory
/// a bucket and CPU a report. Files go to `dir`.
///
/// # Errors
///
/// The server does not start, or the buckets are not all assigned within a minute.
pub async fn scale(buckets: usize, secs: u64, dir: &std::path::Path) -> anyhow::Result<Scale> {
    use limiter_core::clock::MonotonicClock;
    let policy = dir.join("rlqs-scale.yaml");
    std::fs::write(
        &policy,
        "version: 1\ntenants:\n  fleet:\n    routes:\n      /api: { algorithm: token_bucket, rate: 1000000/s, burst: 1000000 }\n",
    )?;
    let env = vec![("LIMITER__RLQS__MAX_BUCKETS".to_owned(), buckets.max(1).to_string())];
    let nodes = crate::procs::Node::start_all(1, &policy, &env).await?;
    let node = &nodes[0];
    let pid = node.pid().ok_or_else(|| anyhow::anyhow!("no server process"))?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss0 = rss_bytes(pid)?;
    let clock: Arc<dyn Clock> = Arc::new(MonotonicClock::new());
    let envoy = Envoy::start(
        EnvoyConfig {
            urls: vec![node.url()],
            domain: "fleet".into(),
            reporting_interval: Duration::from_secs(1),
            no_assignment: Blanket::Deny,
            expired: None,
            carries_tokens: false,
        },
        clock.clone(),
    )?;
    let ids: Vec<_> =
        (0..buckets).map(|i| bucket_id(&[("route", "/api"), ("user", &format!("u{i}"))])).collect();
    let started = clock.now();
    for id in &ids {
        envoy.decide(id);
    }
    let assigned = |e: &Envoy| e.logs().values().filter(|l| l.assignments > 0).count();
    let mut done = assigned(&envoy);
    while done < buckets && clock.now() - started < 60 * NANOS_PER_SEC {
        tokio::time::sleep(Duration::from_millis(100)).await;
        done = assigned(&envoy);
    }
    let subscribe_secs = (clock.now() - started) as f64 / NANOS_PER_SEC as f64;
    anyhow::ensure!(done == buckets, "{done} of {buckets} buckets assigned within a minute");
    // Settled: a few rounds and reports, then memory, then CPU over `secs`.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss1 = rss_bytes(pid)?;
    let (reports0, _) = envoy.counts();
    let cpu0 = crate::cpu::cpu_ns(pid)?;
    tokio::time::sleep(Duration::from_secs(secs.max(1))).await;
    let cpu1 = crate::cpu::cpu_ns(pid)?;
    let (reports1, _) = envoy.counts();
    envoy.stop();
    let reports = reports1 - reports0;
    let per_report = (cpu1 - cpu0) as f64 / reports.max(1) as f64;
    Ok(Scale {
        buckets,
        assigned: done,
        subscribe_secs,
        bytes_per_bucket: rss1.saturating_sub(rss0) as f64 / buckets.max(1) as f64,
        reports,
        cpu_ms_per_report: per_report / 1e6,
        cpu_us_per_bucket: per_report / 1e3 / buckets.max(1) as f64,
    })
}
