//! Envoy's Rate Limit Quota Service (RLQS,
//! `envoy.service.rate_limit_quota.v3.RateLimitQuotaService/StreamRateLimitQuotas`),
//! on the same port and behind the same authentication as the other services.
//!
//! An Envoy's `rate_limit_quota` filter opens one stream per (server, domain), reports
//! every bucket it tracks each reporting interval (a bucket's first report subscribes
//! it), and enforces what the server assigns: here, a token bucket per bucket.
//!
//! - **Mapping.** A bucket id (a map of strings) is mapped as Envoy's RLS descriptors
//!   are ([`EnvoyMapping`]): the tenant is the stream's `domain` (or the entry named by
//!   `envoy.tenant_key`), the route the `envoy.route_key` entry (or the default route),
//!   and every other entry, sorted by name (a bucket id has no order), `name=value`
//!   joined by `|`, is the key.
//! - **Paid rates.** A stream is a lease holder of the lease protocol (one per
//!   Envoy): every round (`rlqs.round_ms`) it pays its tenant's owner, through the
//!   grant rule the agents use, for what each bucket's assignment lets the Envoy
//!   admit until the next round has reached it (`rlqs.round_ms` and `rlqs.slack_ms`
//!   of delivery): the rate over that time, and a new or changed assignment's full
//!   bucket (`max_tokens`: Envoy starts a new bucket full) besides; a changed
//!   assignment counts the held one's paid time at the lower of the two rates (the
//!   Envoy spends one bucket or the other, never both). What the grant
//!   does not cover is not assigned: the rate comes down, to `DENY_ALL` at nothing.
//!   Units a round did not use go back with the next round's call (refunded
//!   exactly). Keeps are paid first; `BUYS_AFTER` later (spread over
//!   `BUYS_SPREAD` among streams) new buckets where the Envoy holds none, and
//!   `BUYS_SPREAD` after those the changes (a bucket that rises pays its keep with
//!   the keeps and hands it back with its new bucket's ask), each leaving the next
//!   keeps their units (`LeaseItem::after_keeps`). So while rounds arrive, every unit an Envoy can admit was paid before
//!   it could be spent, from the same levels every other caller spends: exact. When
//!   they stop (this node dies, or is cut off from its Envoys), an Envoy goes on
//!   spending its last assignment until its TTL: at most its rate over the TTL past
//!   what was paid, the bound README states.
//! - **Shares.** Each bucket's ask carries the Envoy's demand (allowed plus denied
//!   requests per second, counted on our clock, never Envoy's `time_elapsed`; a swing
//!   taken at once, per bucket or, where a stream's slow buckets swing together, per
//!   stream: `stream_swing`), so near
//!   the limit the owner divides what is left in proportion to demand; a rate is never
//!   sent direct, held back, cut to the route's `max_batch` or to half of what is
//!   left (`LeaseItem::rates`), and within its part gets what is left up to the ask;
//!   a new bucket's ask gets nothing rather than less than the smallest bucket costs
//!   (`LeaseItem::least`). A stock in a level of token buckets, beyond what new
//!   buckets leave for the keeps, is divided into what the parts may take too, but
//!   held as rates only up to a twentieth of the level's rate (what the rounds
//!   leave where held rates run below their parts): a full level's burst pays new
//!   buckets and rises once, not rates that outlive it.
//! - **Assignments** are token buckets: `tokens_per_fill` over a `fill_interval` of
//!   whole seconds (Envoy reads no fraction of it, and a fill interval under a second
//!   divides by zero there), `max_tokens` the rate over `rlqs.burst_ms` (at least 2),
//!   a TTL of `rlqs.ttl_s` whole seconds, or more where the Envoy reports less often
//!   than twice a TTL; `DENY_ALL` where nothing was granted. The same bucket is
//!   re-sent once half its TTL has gone, to extend it (Envoy keeps its tokens);
//!   Envoy tells a changed bucket by `max_tokens` and `tokens_per_fill` only, so a
//!   change always changes one of those. A change costs a full new bucket: a held
//!   rate changes only where the difference pays for it soon
//!   ([`CHANGE_PAYS_WITHIN`]), and a new bucket is bought from what the part earned.
//! - **Failures.** When the owner cannot be reached, a bucket gets its route's failure
//!   policy, as an agent does: fail-open, its emergency ceiling as a token bucket;
//!   fail-closed, `DENY_ALL`. A bucket that cannot be mapped or named is denied, and
//!   a stream's buckets beyond `rlqs.max_buckets`: never a free pass.
//! - **Drain.** When this node shuts down (after its counters went to their next
//!   owners), each stream pays for what its Envoy's assignments let it admit until
//!   it has reconnected and been assigned again (its reporting interval, measured,
//!   and the delivery slack), gives a bucket it cannot keep the best smaller one
//!   it can pay for (or `DENY_ALL`), and ends with
//!   `UNAVAILABLE`; the Envoy keeps its assignments, reopens the stream (to another
//!   node) at its next report, and subscribes every bucket again there, whose first
//!   report carries its traffic. Buckets are not abandoned: Envoy would apply its
//!   no-assignment behaviour (often allow-all) until then. A tenant moving between
//!   owners needs nothing: rounds are routed to the tenant's owner of the moment.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::policy::Request;
use limiter_proto::envoy::service::rate_limit_quota::v3 as rlqs;
use limiter_proto::envoy::r#type::v3::{RateLimitStrategy, TokenBucket, rate_limit_strategy};
use limiter_proto::limiter::v1 as pb;
use rlqs::rate_limit_quota_response::BucketAction;
use rlqs::rate_limit_quota_response::bucket_action::{
    AbandonAction, BucketAction as Action, QuotaAssignmentAction,
};
use rlqs::rate_limit_quota_service_server::RateLimitQuotaService;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::{Request as GrpcRequest, Response, Status, Streaming};

use crate::config::{EnvoyMapping, RlqsConfig, TenantFrom};
use crate::owner::Owner;

use crate::metrics::{
    RLQS_ACTIONS as ACTIONS, RLQS_BUCKETS as BUCKETS, RLQS_PAID as PAID, RLQS_REFUSED as REFUSED,
    RLQS_STREAMS as STREAMS,
};

/// A held rate is kept unless a new bucket would buy more than this factor of it
/// (each change gives the Envoy a full new bucket); and a round asks only for what
/// keeping costs while the held rate is within this factor of its part either way.
const KEEP_WITHIN: f64 = 1.1;
/// A rate held above its part by more than this factor comes down.
const COME_DOWN: f64 = 1.1;
/// A rate held above its part by more than this factor comes down to `DENY_ALL`
/// where no smaller bucket was bought (see [`keeps`]).
const COME_DOWN_WHOLE: f64 = 1.5;
/// How soon a change of rate must pay for its new bucket: a held rate is changed
/// only where the difference over this long is at least the new bucket's
/// `max_tokens` (what the change costs at once). A slow part's rate moves with the
/// noise of a few requests; changing it each time would spend more on new buckets
/// than the difference is worth. Seconds, for a rate that goes up (the Envoy's own
/// loss while it waits) and for one that comes down (the others' loss: sooner). A
/// come-down where the demand swung need not pay soon ([`Bucket::settle`]).
const CHANGE_PAYS_WITHIN: (f64, f64) = (2.0, 4.0);
/// A come-down whose new bucket is worth more than this many rounds of its part
/// goes by `DENY_ALL` and a drawn wait ([`Bucket::slow_come_down`]): Envoy starts
/// the new bucket full, a gift of its `max_tokens` at once, and the wait costs the
/// Envoy a round or so at nothing where it draws the least, so it pays where the
/// gift is worth several. (At the four seconds a come-down must pay for itself
/// within, [`CHANGE_PAYS_WITHIN`], parts of 0.5 to 2 a second came down at once: the
/// reversed fleet's faller, whose estimate in the report that straddled the swing
/// read over its new demand, came down so in a third of its twenty smallest buckets
/// and leaned 23% over its share there.)
const COME_DOWN_GIFT_ROUNDS: f64 = 4.0;
/// A bucket whose part rose may buy its new bucket from what the new rate will earn
/// over the held one in this many rounds (see [`Bucket::may_buy_capacity`]).
const BUY_AHEAD_ROUNDS: f64 = 2.0;
/// What is asked for above the measured demand, so that growth shows as demand.
const HEADROOM: f64 = 1.5;
/// The least rate asked for a subscribed bucket, units a second (a bucket that sees
/// no traffic would otherwise deny its first requests for a round).
const FLOOR_RATE: f64 = 1.0;
/// The most a bucket's standing owes, in seconds of its part (or a new bucket's
/// worth, the smaller; see [`Bucket::earn`]). A bucket sent `DENY_ALL` buys again
/// once it owes nothing, so this is how long a slow part that fell waits: its new
/// bucket (at least 2 tokens, Envoy starts it full) is that much of its part,
/// given at once. Owing a whole bucket, the Envoy whose demand fell tenfold sat at
/// `DENY_ALL` for seconds after a swing (13-20% under its share in the fleet test,
/// on earlier code); owing a second of its part, it bought its 2 tokens (ten
/// seconds of a part of 0.2 a second) within one or two, and leaned 35% over its
/// share in the twenty smallest buckets (mean of 13 runs, +10 to +53%); at five
/// seconds, 15% (-11 to +38%), and over all buckets its mean share from 7.6% over
/// to 1.9% under, the spread as wide (README "Envoy RLQS").
const OWES_SECS: f64 = 5.0;
/// The smallest `max_tokens` sent.
const MIN_CAPACITY: u64 = 2;
/// The longest fill interval used to express a slow rate, seconds.
const MAX_FILL_SECS: u32 = 60;
/// Actions per response message (Envoy's gRPC client caps message sizes).
const ACTIONS_PER_MESSAGE: usize = 1_000;
/// How much of the latest round's demand the estimate takes (the rest is history).
const DEMAND_WEIGHT: f64 = 0.25;
/// How long after a round's keeps its buys and probes ask (at most half the
/// delivery slack): see [`Session::round`].
const BUYS_AFTER: Duration = Duration::from_millis(20);
/// How far apart the streams' buys of one round are spread (see [`Session::round`]).
const BUYS_SPREAD: Duration = Duration::from_millis(10);
/// Two measures in a row off the estimate the same way, each short of a swing, are
/// a shift of demand where together (as one measure over both spans, against the
/// estimate before them) they are this many standard deviations off, on the
/// square-root scale: a swing of half the demand is then taken within two reports
/// rather than smoothed over many.
const SHIFT_EVIDENCE: f64 = 3.0;
/// How many measures a new bucket's demand is the mean of everything counted since
/// its subscription, rather than smoothed ([`Bucket::measure`]): about two seconds
/// at Envoy's usual reporting interval.
const WARM_MEASURES: u32 = 4;
/// The requests a new bucket's first measures start from in place of the one that
/// subscribed it ([`WARM_MEASURES`]): the span they are counted over starts at that
/// request, so counted whole it is a request too many (a bucket of one request
/// every 2.3 s read 2.5 a second from its first half-second report), and left out,
/// a slow bucket reads nothing for seconds. Half a request is the posterior mean
/// of a Poisson rate under Jeffreys' prior, `(n + 1/2) / t`.
const WARM_PRIOR: f64 = 0.5;
/// The fewest requests (counted, or expected by the estimate) that make the measure
/// after a swing a measure to take whole: fewer are a few requests' noise (at half a
/// second's report, a part of 0.4 a second counts none four times in five), and a
/// slow bucket that took them whole sat at an estimate of 0, its part with it, until
/// a request came; its stream's factor moves it instead ([`stream_swing`]).
const WHOLE_MEASURE: f64 = 10.0;
/// The shortest span demand is measured over, seconds (Envoy reports every 100 ms
/// at most often).
const MIN_MEASURE: f64 = 0.05;
/// The longest reporting interval the TTLs and a drain's payment follow (30 s):
/// TTLs are at most twice it, a drain pays at most this long of a bucket's rate.
const MAX_REPORT_GAP: Nanos = 30 * NANOS_PER_SEC;

/// The service over an [`Owner`].
#[derive(Debug, Clone)]
pub struct RlqsService {
    owner: Arc<Owner>,
    mapping: Arc<EnvoyMapping>,
    config: RlqsConfig,
    stop: CancellationToken,
    next: Arc<AtomicU64>,
    /// Buckets subscribed on this node's streams (all of them: `rlqs.max_total_buckets`).
    total: Arc<AtomicUsize>,
    /// Drawn at start, so that holder names of different nodes never meet.
    node: u64,
}

impl RlqsService {
    /// The service; `stop` cancelled makes every stream abandon its buckets and end.
    pub fn new(
        owner: Arc<Owner>,
        mapping: EnvoyMapping,
        config: RlqsConfig,
        stop: CancellationToken,
    ) -> Self {
        let node = draw(owner.clock().now());
        Self {
            owner,
            mapping: Arc::new(mapping),
            config,
            stop,
            next: Arc::new(AtomicU64::new(1)),
            total: Arc::default(),
            node,
        }
    }
}

#[tonic::async_trait]
impl RateLimitQuotaService for RlqsService {
    type StreamRateLimitQuotasStream =
        tokio_stream::wrappers::ReceiverStream<Result<rlqs::RateLimitQuotaResponse, Status>>;

    async fn stream_rate_limit_quotas(
        &self,
        request: GrpcRequest<Streaming<rlqs::RateLimitQuotaUsageReports>>,
    ) -> Result<Response<Self::StreamRateLimitQuotasStream>, Status> {
        let inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let session = Session {
            owner: self.owner.clone(),
            mapping: self.mapping.clone(),
            config: self.config,
            holder: format!("rlqs:{:016x}:{id}", self.node),
            domain: None,
            buckets: HashMap::new(),
            total: self.total.clone(),
            report_gap: 0,
            last_message: 0,
            tx,
        };
        tokio::spawn(session.run(inbound, self.stop.clone()));
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

/// What an Envoy holds for a bucket, as sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sent {
    Deny,
    Tokens { max_tokens: u32, tokens: u32, fill_secs: u32 },
}

impl Sent {
    /// Units a second.
    fn rate(self) -> f64 {
        match self {
            Self::Deny => 0.0,
            Self::Tokens { tokens, fill_secs, .. } => f64::from(tokens) / f64::from(fill_secs),
        }
    }

    /// Whether Envoy would take `self` for `other` (it compares `max_tokens`,
    /// `tokens_per_fill` and the fill interval's nanoseconds, always 0 here).
    fn same_for_envoy(self, other: Self) -> bool {
        match (self, other) {
            (Self::Deny, Self::Deny) => true,
            (
                Self::Tokens { max_tokens: a, tokens: b, .. },
                Self::Tokens { max_tokens: c, tokens: d, .. },
            ) => a == c && b == d,
            _ => false,
        }
    }

    fn strategy(self) -> RateLimitStrategy {
        let strategy = match self {
            Self::Deny => rate_limit_strategy::Strategy::BlanketRule(
                rate_limit_strategy::BlanketRule::DenyAll.into(),
            ),
            Self::Tokens { max_tokens, tokens, fill_secs } => {
                rate_limit_strategy::Strategy::TokenBucket(TokenBucket {
                    max_tokens,
                    tokens_per_fill: Some(tokens),
                    fill_interval: Some(prost_types::Duration {
                        seconds: i64::from(fill_secs),
                        nanos: 0,
                    }),
                    name: String::new(),
                })
            }
        };
        RateLimitStrategy { strategy: Some(strategy) }
    }
}

/// Whether changing a held rate `from` to `to` is worth a new bucket that costs
/// `cost` units at once (see [`CHANGE_PAYS_WITHIN`], [`Bucket::change_cost`]).
fn worth_changing(from: f64, to: f64, cost: u64) -> bool {
    let within = if to > from { CHANGE_PAYS_WITHIN.0 } else { CHANGE_PAYS_WITHIN.1 };
    (from - to).abs() * within >= cost as f64
}

/// `rate` (units a second) as whole tokens per whole seconds, never above it: the
/// shortest fill interval within 3% of it, else the closest; `None` below one token
/// a minute.
fn tokens_for(rate: f64) -> Option<(u32, u32)> {
    if !rate.is_finite() || rate * f64::from(MAX_FILL_SECS) < 1.0 {
        return None;
    }
    let mut best: Option<(u32, u32, f64)> = None;
    for secs in 1..=MAX_FILL_SECS {
        let tokens = (rate * f64::from(secs)).floor().min(f64::from(u32::MAX));
        if tokens < 1.0 {
            continue;
        }
        let got = tokens / f64::from(secs);
        // `tokens` is whole and at most u32::MAX: the cast is exact.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let t = tokens as u32;
        if got >= rate * 0.97 {
            return Some((t, secs));
        }
        if best.is_none_or(|b| got > b.2) {
            best = Some((t, secs, got));
        }
    }
    best.map(|(t, s, _)| (t, s))
}

fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// `x` rounded down to a whole number of units (0 below 0; saturating).
fn whole(x: f64) -> u64 {
    // Saturating float-to-int conversion is what is wanted.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let u = x.max(0.0) as u64;
    u
}

/// A token bucket's `max_tokens` for `rate`: the rate over `burst` seconds, at least
/// [`MIN_CAPACITY`] (a bucket of one token loses what refills while it is full:
/// about a tenth of a slow rate at twice its demand).
fn capacity(rate: f64, burst: f64) -> u64 {
    whole(rate * burst).max(MIN_CAPACITY)
}

/// How long `units` last at `rate` (units a second), rounded down.
fn nanos_for(units: u64, rate: f64) -> Nanos {
    if rate <= 0.0 {
        return 0;
    }
    whole((units as f64 / rate * NANOS_PER_SEC as f64).floor())
}

/// What a new bucket of `cap` tokens at `rate` costs until `span` nanoseconds from
/// now (saturating).
fn buy_ask(cap: u64, rate: f64, span: Nanos) -> u64 {
    cap.saturating_add(units_over(rate, span))
}

/// Whether a paid bucket `held` is kept against `changed`, what the grant buys
/// instead, for a bucket that should hold `fair` (see [`KEEP_WITHIN`],
/// [`COME_DOWN`]): it comes down where it is over its part by more than a tenth and
/// coming down pays for the new bucket soon (to a smaller bucket; to nothing only
/// where its part cannot hold a bucket at all), and changes where a new bucket
/// would buy more than a tenth more and pay for itself soon (a change costs a full
/// new bucket). A bucket less than [`COME_DOWN_WHOLE`] over its part for which
/// nothing smaller was bought keeps what it holds while its keep is paid: sent
/// `DENY_ALL` instead, its tokens were lost and its Envoy refused until it bought
/// a bucket again, a full one, from the units its part left in the level (a part a
/// little off the held rate is often the noise of a few requests). Likewise, below
/// that, it comes down only to a bucket nearer its part than what it holds: the
/// grant paid a keep, and the bucket those units buy (its rate over the round
/// after its `max_tokens`) may be far below the part; held there, it waited a
/// second or more to earn its rise (a trace: the Envoy of the largest part after
/// a swing held half its part for 1.0 s so, and for 1.3 s after coming down from
/// over half again, which still comes down at once; 11% under its share there).
/// Kept, its next round asks for a new bucket at its part. (`DENY_ALL` is nearer
/// only where the held rate is over twice the part, so over half again.) Where it
/// owes all its standing may owe (`owed`, [`Bucket::owes_in_full`]), it comes down
/// to a bucket nearer its part however little it is over.
/// `cost`: what a change to a rate must pay for soon: what a new bucket of that rate
/// costs at once ([`Bucket::change_cost`]), or nothing (see [`Bucket::settle`]).
fn keeps(held: Sent, changed: Sent, fair: f64, owed: bool, cost: impl Fn(f64) -> u64) -> bool {
    let to_nothing = tokens_for(fair).is_none() || held.rate() > fair * COME_DOWN_WHOLE;
    let nearer = (changed.rate() - fair).abs() < held.rate() - fair;
    let comes_down = (owed && nearer)
        || held.rate() > fair * COME_DOWN
            && worth_changing(held.rate(), fair, cost(fair))
            && (to_nothing || nearer);
    let better = changed.rate() > held.rate() * KEEP_WITHIN
        && worth_changing(held.rate(), changed.rate(), cost(changed.rate()));
    !comes_down && !better
}

/// A round's instants and sizes.
#[derive(Debug, Clone, Copy)]
struct Moment {
    now: Nanos,
    /// Seconds to the next round.
    round: f64,
    /// Until when the round pays (the next round and its delivery).
    horizon: Nanos,
    ttl: Duration,
    /// `max_tokens` of a bucket: its rate over this many seconds.
    burst: f64,
    /// The span a keep's ask pays for (to the horizon and a burst), and in seconds.
    period_nanos: Nanos,
    period: f64,
    /// Envoys start a bucket that replaces a live one with its share of the old
    /// one's tokens (`rlqs.envoys_carry_tokens`).
    carry: Option<Carry>,
}

/// How long an assignment sent lives at the least and may take to arrive: a token
/// bucket sent is live at its Envoy until then (see [`Bucket::fill_cost`]).
#[derive(Debug, Clone, Copy)]
struct Carry {
    ttl: Nanos,
    slack: Nanos,
}

/// A bucket's item in a round's call, and what keeping what it holds costs.
struct Planned {
    name: String,
    keep_need: Option<u64>,
    item: pb::LeaseItem,
    /// A keep that is to rise: the new bucket's ask and the time it pays for, asked
    /// after the keeps (see [`Session::round`]), and what it holds.
    rise: Option<(u64, Nanos, Sent)>,
}

/// What a round (or a drain) sent and paid, for the metrics.
#[derive(Debug, Default)]
struct Tally {
    assigned: usize,
    extended: usize,
    deny: usize,
    fallback: usize,
    paid: u64,
}

impl Tally {
    fn record(&self) {
        metrics::counter!(PAID).increment(self.paid);
        counted("assign", self.assigned);
        counted("extend", self.extended);
        counted("deny", self.deny);
        counted("fallback", self.fallback);
    }
}

/// How many standard deviations off its estimate a count must be to be a swing.
const SWING: f64 = 3.0;

/// How far a count of Poisson arrivals is off what was `expected`, in standard
/// deviations: on Anscombe's scale, `2 sqrt(x + 3/8)`, where their spread is about 1
/// whatever the mean.
fn off(counted: f64, expected: f64) -> f64 {
    let scaled = |x: f64| 2.0 * (x + 0.375).sqrt();
    scaled(counted) - scaled(expected)
}

/// Whether `counted` is a swing from what was `expected` ([`SWING`]).
fn swings(counted: f64, expected: f64) -> bool {
    off(counted, expected).abs() > SWING
}

/// The factor by which a stream's demand swung since the last round, if it did: the
/// requests reported of its buckets that did not swing on their own, together more
/// than three standard deviations (on Anscombe's scale) off what their estimates
/// expected. An Envoy's traffic often moves as a whole (a load balancer shifts it
/// between Envoys), and a slow bucket's few requests a round cannot tell such a
/// swing from noise for seconds: their sum can at once. (A bucket that swings on its
/// own takes its own count, and one far off would otherwise set the factor for all.)
///
/// Likewise a shift: where the buckets' measures before were off the same way, both
/// measures together [`SHIFT_EVIDENCE`] standard deviations off the estimates before
/// them (each bucket's, as [`Bucket::measure`] weighs its own shift). A sixth of an
/// Envoy's traffic moved elsewhere is about two standard deviations of a report of
/// 300 requests, and smoothed, each bucket took seconds to follow it. The factor is
/// the latest measure's, against the estimates it would update.
///
/// Either way the whole stream must show it: its buckets split in two, those that
/// expect half of its requests (the largest) and the rest, each half nearer the
/// swung estimates than the old ones ([`moves_as_a_whole`]). A burst in the slow
/// buckets alone (a client calling many routes at once) is no swing of the stream:
/// an Envoy of the fleet test whose slow buckets each counted one request in the
/// same report (their arrivals had fallen into step) read as a stream 1.8 times its
/// demand while its large buckets counted what they expected, and every bucket of
/// it changed twice.
fn stream_swing<'a>(buckets: impl Iterator<Item = &'a Bucket>) -> Option<f64> {
    // This measure against the estimates; and, over the buckets whose measure before
    // was plain, both measures against the estimates before them.
    let mut now = (0.0, 0.0);
    let mut both = (0.0, 0.0);
    let mut before = 0.0;
    let mut each = Vec::new();
    for b in buckets.filter(|b| b.sent.is_some()) {
        let Some((c, e)) = b.pending().filter(|&(c, e)| !swings(c, e)) else { continue };
        now = (now.0 + c, now.1 + e);
        each.push((c, e));
        let (was_counted, was_secs, was_demand) = b.last;
        if was_secs > 0.0 {
            both.0 += was_counted as f64 + c;
            both.1 += was_demand * (was_secs + b.pending_secs());
            before += was_counted as f64 - was_demand * was_secs;
        }
    }
    let (counted, expected) = now;
    let shift = (counted - expected) * before > 0.0
        && both.1 > 0.0
        && off(both.0, both.1).abs() > SHIFT_EVIDENCE;
    // Finite only: counts are the Envoy's to choose.
    (expected > 0.0 && (swings(counted, expected) || shift))
        .then(|| counted / expected)
        .filter(|&r| r.is_finite() && moves_as_a_whole(&mut each, r))
}

/// Whether the buckets' (counted, expected) moved by the factor `r` as a whole: the
/// largest, expecting half of the requests together, and the rest, each nearer
/// (on Anscombe's scale) to their estimates times `r` than to their estimates.
fn moves_as_a_whole(each: &mut [(f64, f64)], r: f64) -> bool {
    each.sort_by(|a, b| b.1.total_cmp(&a.1));
    let half = each.iter().map(|x| x.1).sum::<f64>() / 2.0;
    let (mut large, mut rest) = ((0.0, 0.0), (0.0, 0.0));
    for &(c, e) in each.iter() {
        let h = if large.1 < half { &mut large } else { &mut rest };
        *h = (h.0 + c, h.1 + e);
    }
    [large, rest].iter().filter(|h| h.1 > 0.0).all(|&(c, e)| off(c, e * r).abs() < off(c, e).abs())
}

/// The most a bucket whose part is `fair` (units a second) may owe: a new bucket's
/// worth at that rate, or [`OWES_SECS`] of it, the smaller (see [`Bucket::earn`]).
fn most_owed(fair: f64, burst: f64) -> f64 {
    (capacity(fair, burst) as f64).min(fair * OWES_SECS)
}

/// Whether a come-down to a bucket of `max_tokens` for a part of `fair` units a
/// second, rounds `round` seconds apart, goes by [`Bucket::slow_come_down`]'s wait:
/// its bucket is worth more than [`COME_DOWN_GIFT_ROUNDS`] of its part.
fn comes_down_slowly(max_tokens: u64, fair: f64, round: f64) -> bool {
    max_tokens as f64 > fair * round * COME_DOWN_GIFT_ROUNDS
}

/// 64 random bits, drawn by hashing `key` with a freshly seeded hasher (the node's
/// id, a stream's place among a round's buys, a slow come-down's wait).
fn draw(key: impl std::hash::Hash) -> u64 {
    std::hash::BuildHasher::hash_one(&std::collections::hash_map::RandomState::new(), key)
}

/// Units to pay for `rate` over `span` nanoseconds, rounded up.
fn units_over(rate: f64, span: Nanos) -> u64 {
    whole((rate * span as f64 / NANOS_PER_SEC as f64).ceil())
}

/// A new bucket's first measures ([`Bucket::warm`]) where its first report counted
/// `requests`: one is the request that subscribed it ([`WARM_PRIOR`]); more come from
/// an Envoy that had the bucket before this stream, and its demand starts from them.
fn warm_start(requests: u64) -> (f64, f64, u32) {
    match requests {
        0 => (0.0, 0.0, 0),
        1 => (WARM_PRIOR, 0.0, 0),
        _ => (0.0, 0.0, WARM_MEASURES),
    }
}

/// One subscribed bucket of a stream.
#[derive(Debug)]
struct Bucket {
    id: rlqs::BucketId,
    tenant: String,
    route: String,
    key: Option<String>,
    /// Requests reported (allowed and denied) since the demand was last measured.
    counted: u64,
    /// The report the demand was last measured up to (or the subscription).
    since: Nanos,
    /// When the last report of it arrived.
    reported: Nanos,
    /// Requests a second, smoothed over rounds.
    demand: f64,
    /// The last report with requests in it.
    last_traffic: Nanos,
    /// What the Envoy holds, as sent; `None` before the first assignment.
    sent: Option<Sent>,
    /// Until when what the Envoy may admit under `sent` is paid.
    paid_until: Nanos,
    /// When `sent` was last sent (its TTL runs from about then).
    sent_at: Nanos,
    /// The last grant: its id and the units it left unused (handed back next round).
    lease: (u64, u64),
    /// The route's failure policy, from the last grant.
    on_failure: Option<pb::FailurePolicy>,
    /// Its part of the chain's rate, units a second, from the last grant (infinite
    /// while unknown).
    part: f64,
    /// Units its part has earned and its assignments have not spent (earned at what
    /// it should hold, spent as paid), within a new bucket's worth either way: a
    /// new bucket's `max_tokens` (paid at once, however slow its rate) is bought
    /// only from what it earned, so a slow part does not gain a bucket's worth over
    /// its part at each change.
    credit: f64,
    /// When `credit` was last earned up to.
    credited_at: Nanos,
    /// Its demand swung (or shifted) since the last grant: the part that grant
    /// said divided the old demands.
    swung: bool,
    /// The last measure if it was neither a swing nor a shift: its requests, its
    /// seconds and the estimate before it.
    last: (u64, f64, f64),
    /// The last measure was a swing or a shift (its own or the stream's): the next
    /// is taken whole.
    settling: bool,
    /// What it holds is its route's failure policy, sent while the owner could not
    /// be reached: not paid for, so a bucket replacing it carries nothing paid.
    fallback: bool,
    /// Its first measures ([`WARM_MEASURES`]): the requests counted since its
    /// subscription (from [`WARM_PRIOR`]), the seconds since, and how many measures
    /// were taken; the last is [`WARM_MEASURES`] once it is measured as usual.
    warm: (f64, f64, u32),
    /// Where it came down to `DENY_ALL` from a bucket and waits before buying a
    /// slow one ([`Bucket::slow_come_down`]): from when it may buy (0: once it owes
    /// nothing).
    wait_until: Nanos,
}

impl Bucket {
    /// The requests reported since the last measure and what the estimate expected
    /// of them (`None`: no report since).
    fn pending(&self) -> Option<(f64, f64)> {
        let secs = self.pending_secs();
        (secs >= MIN_MEASURE).then_some((self.counted as f64, self.demand * secs))
    }

    /// Seconds between the report the demand was last measured up to and the latest.
    fn pending_secs(&self) -> f64 {
        self.reported.saturating_sub(self.since) as f64 / NANOS_PER_SEC as f64
    }

    /// Folds the requests reported since the last measure into the demand, over the
    /// time between the reports that carried them: an Envoy may report less often
    /// than every round (a round with no report in it says nothing of demand).
    /// `stream`: the factor by which the whole stream's demand swung this round, if
    /// it did ([`stream_swing`]); a bucket that did not swing on its own takes it at
    /// once, then its own count as usual.
    fn measure(&mut self, stream: Option<f64>) {
        let upto = self.reported;
        let secs = self.pending_secs();
        if secs < MIN_MEASURE {
            // Too short to say anything (a report just after the subscription: one
            // request over a few milliseconds is no rate); counted on.
            return;
        }
        // The measure after a swing or a shift is taken whole as well, where it holds
        // enough requests to be one ([`WHOLE_MEASURE`]): the swing fell somewhere
        // inside the span that showed it, so that span's rate was part old demand and
        // part new, and smoothing from it took the new demand rounds to reach (a count
        // off by less than a swing then moves a quarter a round).
        let after_swing = std::mem::take(&mut self.settling);
        let mut stream_swung = false;
        if let Some(r) = stream
            && !swings(self.counted as f64, self.demand * secs)
        {
            self.demand *= r;
            self.swung = true;
            stream_swung = true;
            self.last = (0, 0.0, 0.0);
        }
        // A new bucket's first measures: all it counted since its subscription over
        // the time since, until one swings from that mean (or its stream swings).
        // Smoothed from nothing instead, a bucket of four or five requests a report
        // started at a quarter of its demand and took seconds to reach it (a part of
        // the chain's rate by demand a fifth short, in the fleet test, until the
        // swing), and a first measure alone is a few requests' noise.
        let (sum, span, n) = self.warm;
        if n < WARM_MEASURES {
            let own_swing = span > 0.0 && swings(self.counted as f64, self.demand * secs);
            if !stream_swung && !own_swing {
                self.warm = (sum + self.counted as f64, span + secs, n + 1);
                self.demand = self.warm.0 / self.warm.1;
                self.counted = 0;
                self.since = upto;
                return;
            }
            self.warm.2 = WARM_MEASURES;
        }
        let latest = self.counted as f64 / secs;
        // A swing (a count more than three standard deviations of Poisson arrivals
        // off the estimate, on Anscombe's square-root scale, `2 sqrt(x + 3/8)`, where
        // their spread is about 1 whatever the mean: a fall from 11 expected to 1 is
        // one, which the normal bound, 3 * sqrt(11), misses; no request where 2 were
        // expected is not, which the plain square root, blind to small counts, took
        // for one) is taken at once; the noise of a few requests a round is
        // smoothed, so that it does not change the bucket (each change costs a full
        // new bucket).
        let expected = self.demand * secs;
        let by = off(self.counted as f64, expected);
        let swing = by.abs() > SWING;
        // The measure before, if it was neither: both together against the estimate
        // before them, where both were off the same way.
        let (was_counted, was_secs, was_demand) = self.last;
        let both = was_counted.saturating_add(self.counted) as f64;
        let shift = !swing
            && was_secs > 0.0
            && (was_counted as f64 - was_demand * was_secs) * by > 0.0
            && off(both, was_demand * (was_secs + secs)).abs() > SHIFT_EVIDENCE;
        let before = self.demand;
        let take_whole = after_swing && (self.counted as f64).max(expected) >= WHOLE_MEASURE;
        self.demand = if swing || take_whole {
            latest
        } else if shift {
            // Both measures, over both spans.
            both / (was_secs + secs)
        } else {
            DEMAND_WEIGHT * latest + (1.0 - DEMAND_WEIGHT) * self.demand
        };
        self.swung |= swing || shift;
        self.settling = swing || shift || stream_swung;
        self.last = if swing || shift || after_swing {
            (0, 0.0, 0.0)
        } else {
            (self.counted, secs, before)
        };
        self.counted = 0;
        self.since = upto;
    }

    /// Units paid for its token bucket's time after `now`: paid, not yet its
    /// Envoy's to spend (every round pays its whole horizon ahead).
    fn prepaid(&self, now: Nanos) -> f64 {
        match self.sent {
            Some(s @ Sent::Tokens { .. }) => {
                s.rate() * self.paid_until.saturating_sub(now) as f64 / NANOS_PER_SEC as f64
            }
            _ => 0.0,
        }
    }

    /// What its part earned and its assignments have not been given up to `now`:
    /// the credit with the units paid for later added back.
    fn standing(&self, now: Nanos) -> f64 {
        self.credit + self.prepaid(now)
    }

    /// Earns its part's rate (what it should hold) since it last earned, up to
    /// `now`; its standing saves at most a new bucket's worth (its `max_tokens`) and
    /// a unit (enough to buy one whatever the rounding), and owes at most a new
    /// bucket's worth or [`OWES_SECS`] of its part, the smaller.
    fn earn(&mut self, now: Nanos, burst: f64) {
        let fair = self.target().min(self.part);
        if fair.is_finite() {
            let secs = now.saturating_sub(self.credited_at) as f64 / NANOS_PER_SEC as f64;
            let cap = capacity(fair, burst) as f64;
            let ahead = self.prepaid(now);
            self.credit = (self.credit + ahead + fair * secs)
                .clamp(-most_owed(fair, burst), cap + 1.0)
                - ahead;
        }
        self.credited_at = now;
    }

    /// Whether it holds a rate above `fair` (what it should hold) and owes all its
    /// standing may owe ([`Self::earn`], within half a unit), where its come-down
    /// buys its new bucket at once, not by [`Self::slow_come_down`]'s wait (which a
    /// small overdraft is not worth), at the round `m`. Its debt is then
    /// forgiven as it grows: a held rate within [`KEEP_WITHIN`] of its part, kept
    /// because a change would not pay within seconds, was kept for good, and the
    /// rates held in a level summed above its rate. The round's keeps that came last
    /// then went unpaid: in the fleet test the largest Envoy held 83 a second of a
    /// part of 78 in the largest bucket, the rates held summed to 438 of 431, and the
    /// smallest Envoy's keep there was cut, its Envoy sent `DENY_ALL` and refused its
    /// new bucket for 3.7 s (a third of its share in the three largest buckets lost
    /// before the swing). Owing a bucket's worth, it has been over its part long
    /// enough to pay for the new one. (Where its part held only the smallest bucket,
    /// it was kept over for good, parts whose come-down is no wait included, such
    /// as the smallest Envoys' parts of the fleet test's largest bucket, 7.8 and 15.7
    /// a second; coming down, the fleets' shares were no wider: README "Envoy
    /// RLQS".)
    fn owes_in_full(&self, m: &Moment, fair: f64) -> bool {
        let Some(held @ Sent::Tokens { .. }) = self.sent else { return false };
        if !fair.is_finite()
            || held.rate() <= fair
            || comes_down_slowly(capacity(fair, m.burst), fair, m.round)
        {
            return false;
        }
        self.standing(m.now) <= 0.5 - most_owed(fair, m.burst)
    }

    /// Whether it may buy `s` as a new bucket at `now`, rounds `round` seconds apart
    /// (see [`Self::may_buy_capacity`]).
    fn may_buy(&self, s: Sent, now: Nanos, round: f64, carry: Option<Carry>) -> bool {
        match s {
            Sent::Tokens { max_tokens, .. } => {
                self.may_buy_capacity(u64::from(max_tokens), s.rate(), now, round, carry)
            }
            Sent::Deny => true,
        }
    }

    /// Whether it may buy a new bucket of `cap` tokens at `rate` at `now`, rounds
    /// `round` seconds apart: its first assignment, one no larger and no faster than
    /// the bucket it holds (coming down leaves units to the others), one in place of
    /// `DENY_ALL` once its credit is not negative, or one whose `max_tokens` its
    /// standing covers within [`BUY_AHEAD_ROUNDS`]: what its part earned beyond what
    /// it was given (the units paid for later not counted as given: a round pays its
    /// whole horizon ahead, and counting that as spent kept a bucket whose part rose
    /// from buying for up to two seconds after a swing), and what the new rate would
    /// earn over the held one in those rounds (a part that rose pays for its new
    /// bucket soon: waiting for it to be earned first left the rise unspent a round
    /// or more, while the parts that fell came down at once).
    fn may_buy_capacity(
        &self,
        cap: u64,
        rate: f64,
        now: Nanos,
        round: f64,
        carry: Option<Carry>,
    ) -> bool {
        match self.sent {
            None => true,
            Some(held @ Sent::Tokens { max_tokens, .. })
                if cap <= u64::from(max_tokens) && rate <= held.rate() =>
            {
                true
            }
            // Denied, it admits nothing while it earns: it may leave once it owes
            // nothing (a slow part saving up a whole bucket would be denied for
            // seconds: the smallest Envoy of the fleet test lost a quarter of its
            // share so).
            Some(Sent::Deny) if self.wait_until > 0 => now >= self.wait_until,
            Some(Sent::Deny) => self.credit >= 0.0,
            Some(held) => {
                let gain = (rate - held.rate()).max(0.0) * round * BUY_AHEAD_ROUNDS;
                self.standing(now) + gain >= self.fill_cost(cap, now, carry) as f64
            }
        }
    }

    /// What a new bucket of `cap` tokens sent at `now` costs for its tokens at once:
    /// all of them (Envoy starts a new bucket full), or, where Envoys carry tokens
    /// (`carry`) and it replaces a paid token bucket (not a failure policy's) still
    /// live at its Envoy when it arrives, what it holds beyond the old one's
    /// `max_tokens`: Envoy 1.33 and later start it with `max_tokens x left / old
    /// max_tokens`, rounded down, which is at most the old one's tokens (paid
    /// already) and the difference.
    fn fill_cost(&self, cap: u64, now: Nanos, carry: Option<Carry>) -> u64 {
        match (carry, self.sent) {
            (Some(c), Some(Sent::Tokens { max_tokens, .. }))
                if !self.fallback
                    && now.saturating_add(c.slack) < self.sent_at.saturating_add(c.ttl) =>
            {
                cap.saturating_sub(u64::from(max_tokens))
            }
            _ => cap,
        }
    }

    /// What changing to a bucket at `rate` loses at once, to weigh whether it is
    /// worth it: its fill cost, and where tokens are carried, the token Envoy's
    /// rounding down may drop.
    fn change_cost(&self, rate: f64, burst: f64, now: Nanos, carry: Option<Carry>) -> u64 {
        let cap = capacity(rate, burst);
        self.fill_cost(cap, now, carry).saturating_add(1).min(cap)
    }

    /// The rate it asks for: its demand with headroom, at least [`FLOOR_RATE`].
    fn target(&self) -> f64 {
        (self.demand * HEADROOM).max(FLOOR_RATE)
    }

    /// What keeping its token bucket until `horizon` costs (`None`: it holds none).
    fn keep_need(&self, horizon: Nanos) -> Option<u64> {
        match self.sent {
            Some(s @ Sent::Tokens { .. }) => {
                Some(units_over(s.rate(), horizon.saturating_sub(self.paid_until)))
            }
            _ => None,
        }
    }

    /// Its lease item asking for `want` units (for `period` nanoseconds of its rate),
    /// handing back what its last grant left.
    fn item(&self, want: u64, period: Nanos) -> pb::LeaseItem {
        pb::LeaseItem {
            tenant: self.tenant.clone(),
            route: self.route.clone(),
            key: self.key.clone().unwrap_or_default(),
            lease_id: self.lease.0,
            unspent: self.lease.1,
            want,
            cost: 0,
            // Never 0, which the owner reads as "not reported": one holder that
            // reported none would make the owner divide by asks for every holder.
            demand_per_sec: units_over(self.demand, NANOS_PER_SEC).max(1),
            demand_milli: units_over(self.demand * 1_000.0, NANOS_PER_SEC).max(1),
            // The time its ask pays for: the owner caps it at its part of the chain's
            // rate over it.
            renews_within: Some(crate::convert::duration(period)),
            rates: true,
            ..Default::default()
        }
    }

    /// Settles this round's grant for it (`None`: the owner could not be reached),
    /// where keeping what it holds costs `keep_need`: what it holds next, and the
    /// action to send, if any.
    fn settle(
        &mut self,
        grant: Option<pb::LeaseGrant>,
        keep_need: Option<u64>,
        m: &Moment,
        tally: &mut Tally,
    ) -> Option<BucketAction> {
        let Some(g) = grant else {
            // The owner could not be reached: the route's failure policy, for as
            // long as an assignment lives.
            self.lease = (0, 0);
            let sent = self.failure_policy();
            self.fallback = true;
            tally.fallback += 1;
            self.sent = Some(sent);
            self.sent_at = m.now;
            return Some(assignment(self.id.clone(), sent, m.ttl));
        };
        if g.on_failure.is_some() {
            self.on_failure = g.on_failure;
        }
        let units = g.units;
        // Its part of the chain's rate (the owner's, by demand, unrounded); what it
        // should hold is that or its demand, the lower.
        self.part = match (g.rate_part_milli, g.rate_part) {
            (0, 0) => f64::INFINITY,
            (0, units) => units as f64 / m.period,
            (milli, _) => milli as f64 / 1_000.0,
        };
        let swung = std::mem::take(&mut self.swung);
        let fair = self.target().min(self.part);
        let (changed, used) = match self.choose(units, m.now, m.horizon, m.burst, fair, m.carry) {
            (s, _) if self.sent != Some(s) && !self.may_buy(s, m.now, m.round, m.carry) => {
                (Sent::Deny, 0)
            }
            c => c,
        };
        // Where its demand swung this round, a come-down need not pay for its new
        // bucket soon ([`CHANGE_PAYS_WITHIN`]): the held rate was bought for a demand
        // that is gone, not moved by a few requests' noise, and the difference lasts.
        // (Held to that test, a bucket of the fleet test whose part fell from 1.55 to
        // 0.55 a second at a swing kept 1 a second to the end, admitting all of its
        // demand, about twice its share there: 0.45 a second over 4 s does not pay
        // for 2 tokens.)
        let held_rate = self.sent.map_or(0.0, Sent::rate);
        let cost = |r: f64| {
            if swung && r < held_rate { 0 } else { self.change_cost(r, m.burst, m.now, m.carry) }
        };
        let (sent, used) = match (self.sent, keep_need) {
            (Some(held), Some(need))
                if units >= need
                    && keeps(held, changed, fair, self.owes_in_full(m, fair), cost) =>
            {
                (held, need)
            }
            _ => (changed, used),
        };
        let (sent, used) = self.slow_come_down(sent, used, fair, m.now, m.round);
        tally.paid += used;
        self.credit -= used as f64;
        self.lease = (g.lease_id, units - used);
        // Paid until when: whole units buy a little past the horizon, which the next
        // round need not pay again (a slow rate would otherwise pay a unit every
        // round).
        self.paid_until = match sent {
            Sent::Deny => {
                tally.deny += 1;
                m.now
            }
            _ if self.sent == Some(sent) => {
                tally.extended += 1;
                self.paid_until.saturating_add(nanos_for(used, sent.rate()))
            }
            Sent::Tokens { max_tokens, .. } => {
                tally.assigned += 1;
                let fill = self.fill_cost(u64::from(max_tokens), m.now, m.carry);
                self.new_paid_until(used - fill, sent.rate(), m.now)
            }
        };
        // Re-sent unchanged only when half its TTL has gone: that extends it.
        let action = (self.sent != Some(sent)
            || m.now.saturating_sub(self.sent_at) >= nanos(m.ttl) / 2)
            .then(|| {
                self.sent_at = m.now;
                assignment(self.id.clone(), sent, m.ttl)
            });
        if self.sent != Some(sent) {
            // Replaced: what it holds now was paid for.
            self.fallback = false;
        }
        self.sent = Some(sent);
        action
    }

    /// What it holds next where `sent` (bought with `used` units) replaces what it
    /// holds, for a part of `fair` units a second at `now`, rounds `round` seconds
    /// apart. A bucket coming down to one whose `max_tokens` (Envoy starts it full)
    /// are worth more than [`COME_DOWN_GIFT_ROUNDS`] of its part (2 tokens are ten
    /// seconds of 0.2 a second, two of 1 a second) is sent `DENY_ALL` instead and
    /// waits a random part of that worth before it buys. Given at once, each such
    /// bucket was a gift of its whole worth, and every bucket of an Envoy whose
    /// demand fell came down in the same round: its share leaned over in the same
    /// seconds in all of its slow buckets (the faller of the fleet test, Envoys
    /// 1.33+, +24% and +27% in the twenty smallest on average, in two sets of
    /// rounds). Drawn, the gift is half on average and falls at different times in
    /// different buckets.
    fn slow_come_down(
        &mut self,
        sent: Sent,
        used: u64,
        fair: f64,
        now: Nanos,
        round: f64,
    ) -> (Sent, u64) {
        match (self.sent, sent) {
            (Some(held @ Sent::Tokens { .. }), Sent::Tokens { max_tokens, .. })
                if sent.rate() < held.rate()
                    && fair > 0.0
                    && comes_down_slowly(u64::from(max_tokens), fair, round) =>
            {
                let worth = (f64::from(max_tokens) / fair).min(f64::from(MAX_FILL_SECS));
                let part = (draw((now, &self.route)) >> 11) as f64 / (1u64 << 53) as f64;
                let wait = whole(part * worth * NANOS_PER_SEC as f64).max(1);
                self.wait_until = now.saturating_add(wait);
                (Sent::Deny, 0)
            }
            (_, Sent::Tokens { .. }) => {
                self.wait_until = 0;
                (sent, used)
            }
            _ => (sent, used),
        }
    }

    /// Units of its token bucket's paid time after `now` that a new bucket at `rate`
    /// sent at `now` counts as paid for its own rate: the Envoy spends the held
    /// bucket until the new one arrives and the new one after, never both, so the
    /// time paid for the held rate pays the new one up to the lower of the two
    /// rates. (Not counted, it was paid twice at every change: the delivery slack's
    /// worth of the held rate, about 2% of the limits in the fleet test.)
    fn carried(&self, rate: f64, now: Nanos) -> f64 {
        match self.sent {
            Some(held @ Sent::Tokens { .. }) if rate > 0.0 => {
                let secs = self.paid_until.saturating_sub(now) as f64 / NANOS_PER_SEC as f64;
                rate.min(held.rate()) * secs
            }
            _ => 0.0,
        }
    }

    /// Units a new bucket at `rate` sent at `now` costs for its rate until `horizon`
    /// (its `max_tokens` apart), rounded up: the rate over the time, less what the
    /// held bucket's paid time carries ([`Self::carried`]).
    fn new_rate_cost(&self, rate: f64, now: Nanos, horizon: Nanos) -> u64 {
        let secs = horizon.saturating_sub(now) as f64 / NANOS_PER_SEC as f64;
        whole((rate * secs - self.carried(rate, now)).ceil())
    }

    /// Until when a new bucket at `rate` sent at `now` is paid by `units` for its
    /// rate (its `max_tokens` apart) and what the held bucket carries into it.
    fn new_paid_until(&self, units: u64, rate: f64, now: Nanos) -> Nanos {
        if rate <= 0.0 {
            return now;
        }
        let secs = (units as f64 + self.carried(rate, now)) / rate;
        now.saturating_add(whole((secs * NANOS_PER_SEC as f64).floor()))
    }

    /// The route's failure policy as an assignment: fail-open, the emergency
    /// ceiling; fail-closed (or never known), nothing.
    fn failure_policy(&self) -> Sent {
        match &self.on_failure {
            Some(p) if p.fail_open && p.emergency_amount > 0 => {
                let period = p.emergency_period.as_ref().map_or(1, |d| d.seconds.max(1));
                let tokens = u32::try_from(p.emergency_amount).unwrap_or(u32::MAX);
                let fill_secs = u32::try_from(period).unwrap_or(MAX_FILL_SECS);
                Sent::Tokens { max_tokens: tokens, tokens, fill_secs }
            }
            _ => Sent::Deny,
        }
    }

    /// The assignment `units` pay for from `now` until `horizon`: `fair` (units a
    /// second) or less, with its full bucket; and the units it uses.
    fn choose(
        &self,
        units: u64,
        now: Nanos,
        horizon: Nanos,
        burst: f64,
        fair: f64,
        carry: Option<Carry>,
    ) -> (Sent, u64) {
        let span = horizon.saturating_sub(now) as f64 / NANOS_PER_SEC as f64;
        let mut rate = fair.min((units as f64 + self.carried(fair, now)) / (span + burst));
        while let Some((tokens, fill_secs)) = tokens_for(rate) {
            let r = f64::from(tokens) / f64::from(fill_secs);
            let max_tokens = u32::try_from(capacity(r, burst)).unwrap_or(u32::MAX);
            let mut s = Sent::Tokens { max_tokens, tokens, fill_secs };
            if let Some(Sent::Tokens { max_tokens: m, .. }) =
                self.sent.filter(|o| o.same_for_envoy(s) && *o != s)
            {
                // Envoy would keep the old bucket and its old fill interval: differ
                // by a token of capacity.
                s = Sent::Tokens { max_tokens: m.saturating_add(1), tokens, fill_secs };
            }
            let cost = if self.sent == Some(s) {
                // The same as held: kept, so paid as a keep.
                units_over(r, horizon.saturating_sub(self.paid_until))
            } else {
                let Sent::Tokens { max_tokens: m, .. } = s else { return (Sent::Deny, 0) };
                let fill = self.fill_cost(u64::from(m), now, carry);
                fill.saturating_add(self.new_rate_cost(r, now, horizon))
            };
            if cost <= units {
                return (s, cost);
            }
            rate *= 0.9;
        }
        (Sent::Deny, 0)
    }
}

/// One stream: its buckets and its rounds.
struct Session {
    owner: Arc<Owner>,
    mapping: Arc<EnvoyMapping>,
    config: RlqsConfig,
    holder: String,
    domain: Option<String>,
    buckets: HashMap<String, Bucket>,
    /// The node's count of subscribed buckets.
    total: Arc<AtomicUsize>,
    /// The longest recent gap between two report messages (the Envoy's reporting
    /// interval, on our clock).
    report_gap: Nanos,
    last_message: Nanos,
    tx: mpsc::Sender<Result<rlqs::RateLimitQuotaResponse, Status>>,
}

/// Counts one action sent.
fn counted(action: &'static str, n: usize) {
    if n > 0 {
        metrics::counter!(ACTIONS, "action" => action).increment(n as u64);
    }
}

fn refused(reason: &'static str) {
    metrics::counter!(REFUSED, "reason" => reason).increment(1);
}

fn assignment(id: rlqs::BucketId, sent: Sent, ttl: Duration) -> BucketAction {
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(Action::QuotaAssignmentAction(QuotaAssignmentAction {
            assignment_time_to_live: Some(prost_types::Duration {
                seconds: i64::try_from(ttl.as_secs()).unwrap_or(i64::MAX),
                nanos: 0,
            }),
            rate_limit_strategy: Some(sent.strategy()),
        })),
    }
}

fn abandon(id: rlqs::BucketId) -> BucketAction {
    BucketAction {
        bucket_id: Some(id),
        bucket_action: Some(Action::AbandonAction(AbandonAction {})),
    }
}

/// A bucket id's entries sorted by name, as one string (the bucket's identity).
fn canonical(id: &rlqs::BucketId) -> String {
    let mut entries: Vec<(&String, &String)> = id.bucket.iter().collect();
    entries.sort();
    let mut out = String::new();
    for (k, v) in entries {
        out.push_str(k);
        out.push('\u{0}');
        out.push_str(v);
        out.push('\u{0}');
    }
    out
}

/// Maps a bucket id onto tenant, route and key (see the module's documentation).
fn map_bucket(
    m: &EnvoyMapping,
    max_key: usize,
    domain: &str,
    id: &rlqs::BucketId,
) -> Result<(String, String, Option<String>), String> {
    let entry = |name: &str| id.bucket.get(name).map(String::as_str);
    let (tenant, tenant_key) = match &m.tenant_from {
        TenantFrom::Domain => (domain, None),
        TenantFrom::Entry(k) => match entry(k) {
            Some(t) => (t, Some(k.as_str())),
            None => return Err(format!("has no `{k}` entry (the tenant)")),
        },
    };
    let route = match (entry(&m.route_key), &m.default_route) {
        (Some(r), _) => r,
        (None, Some(r)) => r.as_str(),
        (None, None) => {
            return Err(format!(
                "has no `{}` entry (the route) and no default route is configured",
                m.route_key
            ));
        }
    };
    let mut entries: Vec<(&String, &String)> = id
        .bucket
        .iter()
        .filter(|(k, _)| **k != m.route_key && Some(k.as_str()) != tenant_key)
        .collect();
    entries.sort();
    let key = entries.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join("|");
    let key = (!key.is_empty()).then(|| match super::envoy::name_from(&key, max_key) {
        Cow::Owned(k) => k,
        Cow::Borrowed(_) => key,
    });
    Ok((tenant.to_owned(), route.to_owned(), key))
}

impl Session {
    async fn run(
        mut self,
        mut inbound: Streaming<rlqs::RateLimitQuotaUsageReports>,
        stop: CancellationToken,
    ) {
        if stop.is_cancelled() {
            // Shutting down: the Envoy is to open its stream elsewhere.
            let _ = self.tx.send(Err(Status::unavailable("this node is shutting down"))).await;
            return;
        }
        metrics::gauge!(STREAMS).increment(1.0);
        // Every stream's rounds fall on the same instants of the clock (multiples of
        // the round): holders of a chain then ask together, after the same refill,
        // rather than whoever's round follows a refill taking it.
        let round = nanos(self.config.round).max(1);
        let phase = round - self.owner.clock().now() % round;
        let first = tokio::time::Instant::now() + Duration::from_nanos(phase);
        let mut tick = tokio::time::interval_at(first, self.config.round);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let end = loop {
            tokio::select! {
                () = stop.cancelled() => {
                    self.handover().await;
                    break Some(Status::unavailable(
                        "this node is shutting down: reconnect and subscribe again",
                    ));
                }
                m = inbound.message() => match m {
                    Ok(Some(reports)) => match self.reports(reports).await {
                        Ok(()) => {}
                        Err(status) => break Some(status),
                    },
                    Ok(None) | Err(_) => break None,
                },
                _ = tick.tick() => self.round(false).await,
                () = self.tx.closed() => break None,
            }
        };
        if let Some(status) = end {
            let _ = self.tx.send(Err(status)).await;
        }
        self.forget_all();
        metrics::gauge!(STREAMS).decrement(1.0);
    }

    /// This node is shutting down: pays for what each bucket's assignment lets its
    /// Envoy admit until it has reconnected elsewhere and been assigned again (its
    /// reporting interval, measured, and the delivery slack), hands back what is
    /// left, and gives a bucket whose keep could not be paid the best smaller one
    /// the grant pays for (or `DENY_ALL`). Nothing is abandoned:
    /// Envoy erases an abandoned bucket and applies its no-assignment behaviour
    /// (often allow-all) to its requests until the stream is open again, and it
    /// reopens the stream only at its next report; a held assignment outlives the
    /// stream until its TTL, and the next server's assignment replaces it.
    async fn handover(&mut self) {
        let now = self.owner.clock().now();
        let ttl = self.ttl();
        let gap = self.report_gap.max(nanos(self.config.round));
        let horizon = now.saturating_add(gap + nanos(self.config.slack));
        let period = horizon.saturating_sub(now);
        let burst = self.config.burst.as_secs_f64();
        let carry = self.carry();
        let mut plan = Vec::new();
        let mut items = Vec::new();
        for (name, b) in &self.buckets {
            let need = b.keep_need(horizon).unwrap_or(0);
            if need == 0 && b.lease.1 == 0 {
                continue;
            }
            plan.push((name.clone(), need));
            items.push(b.item(need, period));
        }
        let grants = self.pay(items).await;
        let mut actions = Vec::new();
        let mut left = Vec::new();
        let mut tally = Tally::default();
        for ((name, need), grant) in plan.into_iter().zip(grants) {
            let Some(b) = self.buckets.get_mut(&name) else { continue };
            let sent = match (grant, b.sent) {
                (Some(g), Some(held)) if g.units >= need => {
                    tally.paid += need;
                    b.lease = (g.lease_id, g.units - need);
                    if b.lease.1 > 0 {
                        left.push(b.item(0, period));
                    }
                    // Paid through the horizon: re-sent (the same bucket, its tokens
                    // kept) where its TTL would end before.
                    if b.sent_at.saturating_add(nanos(ttl)) >= horizon {
                        continue;
                    }
                    tally.extended += 1;
                    held
                }
                (Some(g), _) => {
                    // Not enough to keep it: the best smaller bucket what was
                    // granted pays for until the horizon, else nothing.
                    let fair = b.target().min(b.part);
                    let (sent, used) = b.choose(g.units, now, horizon, burst, fair, carry);
                    tally.paid += used;
                    b.lease = (g.lease_id, g.units - used);
                    if b.lease.1 > 0 {
                        left.push(b.item(0, period));
                    }
                    if sent == Sent::Deny {
                        tally.deny += 1;
                    } else {
                        tally.assigned += 1;
                    }
                    sent
                }
                (None, _) => {
                    tally.fallback += 1;
                    b.failure_policy()
                }
            };
            actions.push(assignment(b.id.clone(), sent, ttl));
        }
        // What the grants left goes back now: there is no next round to take it.
        self.pay(left).await;
        tally.record();
        self.send(actions).await;
        self.forget_all();
    }

    /// Drops every bucket from the counts.
    fn forget_all(&mut self) {
        let n = self.buckets.len();
        self.buckets.clear();
        self.total.fetch_sub(n, Ordering::Relaxed);
        metrics::gauge!(BUCKETS).decrement(n as f64);
    }

    /// Sends `actions` in messages of at most [`ACTIONS_PER_MESSAGE`].
    async fn send(&self, actions: Vec<BucketAction>) {
        let mut actions = actions.into_iter().peekable();
        while actions.peek().is_some() {
            let chunk: Vec<_> = actions.by_ref().take(ACTIONS_PER_MESSAGE).collect();
            let msg = rlqs::RateLimitQuotaResponse { bucket_action: chunk };
            if self.tx.send(Ok(msg)).await.is_err() {
                return;
            }
        }
    }

    /// Takes one message of reports: counts demand, subscribes new buckets (and
    /// assigns them at once).
    async fn reports(&mut self, r: rlqs::RateLimitQuotaUsageReports) -> Result<(), Status> {
        match (&self.domain, r.domain.is_empty()) {
            (None, true) => {
                return Err(Status::invalid_argument(
                    "domain: must be set in a stream's first report",
                ));
            }
            (None, false) => {
                // The domain is kept for the stream's life: bounded like a tenant's
                // name (at least 256 bytes, where it names no tenant).
                let most = self.owner.limits().names.tenant.max(256);
                if r.domain.len() > most {
                    return Err(Status::invalid_argument(format!(
                        "domain: longer than {most} bytes"
                    )));
                }
                self.domain = Some(r.domain);
            }
            (Some(d), false) if *d != r.domain => {
                return Err(Status::invalid_argument(format!(
                    "domain: `{}` differs from the stream's `{}` (open a stream per domain)",
                    limiter_core::text::shorten(&r.domain),
                    limiter_core::text::shorten(d)
                )));
            }
            _ => {}
        }
        let now = self.owner.clock().now();
        if self.last_message > 0 {
            // Counted up to a bound: a client that reports rarely would otherwise
            // choose its TTLs and what a drain pays for it.
            let gap = now.saturating_sub(self.last_message).min(MAX_REPORT_GAP);
            self.report_gap = gap.max(self.report_gap - self.report_gap / 8);
        }
        self.last_message = now;
        let mut fresh = Vec::new();
        let mut denied = Vec::new();
        for usage in r.bucket_quota_usages {
            let Some(id) = usage.bucket_id.filter(|id| !id.bucket.is_empty()) else {
                refused("invalid");
                continue;
            };
            let name = canonical(&id);
            let requests = usage.num_requests_allowed.saturating_add(usage.num_requests_denied);
            if let Some(b) = self.buckets.get_mut(&name) {
                b.counted = b.counted.saturating_add(requests);
                b.reported = now;
                if requests > 0 {
                    b.last_traffic = now;
                }
                continue;
            }
            if self.buckets.len() >= self.config.max_buckets
                || self.total.load(Ordering::Relaxed) >= self.config.max_total_buckets
            {
                refused("over_cap");
                denied.push(assignment(id, Sent::Deny, self.config.ttl));
                continue;
            }
            let elapsed = usage.time_elapsed.map_or(0, |d| u64::try_from(d.seconds).unwrap_or(0));
            match self.subscribe(id.clone(), requests, elapsed, now) {
                Ok(b) => {
                    self.buckets.insert(name.clone(), b);
                    self.total.fetch_add(1, Ordering::Relaxed);
                    metrics::gauge!(BUCKETS).increment(1.0);
                    fresh.push(name);
                }
                Err(why) => {
                    refused("invalid");
                    tracing::debug!(bucket = %limiter_core::text::shorten(&name), %why, "RLQS bucket denied");
                    denied.push(assignment(id, Sent::Deny, self.config.ttl));
                }
            }
        }
        counted("deny", denied.len());
        self.send(denied).await;
        if !fresh.is_empty() {
            self.round(true).await;
        }
        Ok(())
    }

    /// A new bucket from its first report (`requests` over `elapsed` whole seconds,
    /// as the Envoy says).
    fn subscribe(
        &self,
        id: rlqs::BucketId,
        requests: u64,
        elapsed: u64,
        now: Nanos,
    ) -> Result<Bucket, String> {
        let domain = self.domain.as_deref().unwrap_or_default();
        let names = &self.owner.limits().names;
        let (tenant, route, key) = map_bucket(&self.mapping, names.key, domain, &id)?;
        let probe = Request {
            tenant: &tenant,
            route: &route,
            key: key.as_deref(),
            cost: Some(1),
            dry_run: true,
        };
        self.owner.validate(std::iter::once(probe)).map_err(|(_, e)| e.to_string())?;
        Ok(Bucket {
            id,
            tenant,
            route,
            key,
            counted: 0,
            since: now,
            reported: now,
            // A bucket an Envoy reports with traffic at once (it had it before this
            // stream: it comes from a node that shut down) starts from that traffic,
            // over a round at least (Envoy's `time_elapsed` is whole seconds, often
            // 0), rather than from nothing.
            demand: if requests > 1 {
                requests as f64 / (elapsed as f64).max(self.config.round.as_secs_f64())
            } else {
                0.0
            },
            last_traffic: now,
            sent: None,
            paid_until: now,
            sent_at: 0,
            lease: (0, 0),
            on_failure: None,
            part: f64::INFINITY,
            credit: 0.0,
            credited_at: now,
            swung: false,
            last: (0, 0.0, 0.0),
            settling: false,
            fallback: false,
            warm: warm_start(requests),
            wait_until: 0,
        })
    }

    /// The TTL sent: `rlqs.ttl_s`, or more whole seconds where the Envoy reports
    /// less often than every half of it.
    fn ttl(&self) -> Duration {
        let twice = Duration::from_nanos(self.report_gap.saturating_mul(2));
        self.config
            .ttl
            .max(Duration::from_secs(twice.as_secs() + u64::from(twice.subsec_nanos() > 0)))
    }

    /// The instants and sizes of a round starting at `now`.
    fn moment(&self, now: Nanos) -> Moment {
        let horizon = now.saturating_add(nanos(self.config.round) + nanos(self.config.slack));
        let period_nanos = horizon.saturating_sub(now) + nanos(self.config.burst);
        Moment {
            now,
            round: self.config.round.as_secs_f64(),
            horizon,
            ttl: self.ttl(),
            burst: self.config.burst.as_secs_f64(),
            period_nanos,
            period: period_nanos as f64 / NANOS_PER_SEC as f64,
            carry: self.carry(),
        }
    }

    /// How Envoys start a bucket that replaces one, if they carry its tokens.
    fn carry(&self) -> Option<Carry> {
        self.config
            .envoys_carry_tokens
            .then(|| Carry { ttl: nanos(self.config.ttl), slack: nanos(self.config.slack) })
    }

    /// One round: pays for what every bucket's assignment lets its Envoy admit until
    /// the next round (and its delivery), and sends them (`fresh_only`: the buckets
    /// not yet assigned, right after they subscribed). Keeps are paid first (a rise's
    /// keep among them); buys, rises and probes ask [`BUYS_AFTER`] later, from what
    /// every stream's keeps left:
    /// rounds of all streams fall on the same instants, and a new bucket asked for
    /// in the same instant as the others' keeps would take units they hold.
    async fn round(&mut self, fresh_only: bool) {
        let m = self.moment(self.owner.clock().now());
        let mut actions = Vec::new();
        if !fresh_only {
            self.abandon_idle(m.now, &mut actions);
        }
        let (keeps, mut buys) = self.plan(fresh_only, &m, &mut actions);
        let mut tally = Tally::default();
        let kept_any = !keeps.is_empty();
        // A bucket that rises keeps what it holds with the others' keeps first: asked
        // only after them, its new bucket met a level they had emptied, and the grant
        // then paid neither (a trace of a 15-a-second bucket: an Envoy with credit
        // for the new bucket sent to `DENY_ALL` for a second so). Its keep's grant goes
        // back whole in the same item as its new bucket's ask, so that the ask finds
        // at least the keep's units; the keep is settled again with it.
        let rises: Vec<_> =
            keeps.iter().filter_map(|p| Some((p.name.clone(), p.keep_need?, p.rise?))).collect();
        if kept_any {
            self.pay_and_settle(keeps, m, &mut tally, &mut actions).await;
        }
        for (name, need, (want, paid_for, held)) in rises {
            let Some(b) = self.buckets.get_mut(&name) else { continue };
            if b.sent != Some(held) {
                // Its keep fell short: it changed already.
                continue;
            }
            // The keep undone (it used its `need`, paid until that much later): its
            // units go back with the ask.
            b.paid_until = b.paid_until.saturating_sub(nanos_for(need, held.rate()));
            b.credit += need as f64;
            b.lease.1 = b.lease.1.saturating_add(need);
            tally.paid = tally.paid.saturating_sub(need);
            tally.extended = tally.extended.saturating_sub(1);
            // At least the keep's units: a rise that cannot be paid keeps its bucket.
            let item =
                pb::LeaseItem { least: need, after_keeps: true, ..b.item(want.max(1), paid_for) };
            buys.push(Planned { name, keep_need: Some(need), item, rise: None });
        }
        if !buys.is_empty() {
            if kept_any && !fresh_only {
                self.send(std::mem::take(&mut actions)).await;
                // Streams' buys take what is left first come: a draw of up to
                // `BUYS_SPREAD` a round, so that no stream's come last every round (a
                // trace: one stream's new bucket granted nothing for 19 rounds in a
                // row, the others' buys having taken what was left each time).
                let spread =
                    Duration::from_nanos(draw((m.now, &self.holder)) % nanos(BUYS_SPREAD).max(1));
                let after = (BUYS_AFTER + spread).min(self.config.slack / 4);
                tokio::time::sleep(after).await;
            }
            // Buckets where the Envoy has held none for a round first (it refuses
            // all until then), then every stream's changes, [`BUYS_SPREAD`] later: a
            // rise asks for more than a new bucket, and first come it took what the
            // smallest holders' buckets needed (a holder of the smallest parts
            // refused for seconds, its share a tenth short). One just sent
            // `DENY_ALL` waits with the changes: first, the buckets that fell in a
            // swing bought their new ones at once, each a full bucket over its part.
            let round = nanos(self.config.round);
            let waited = |p: &Planned| {
                self.buckets.get(&p.name).is_some_and(|b| {
                    b.sent.is_none()
                        || b.sent == Some(Sent::Deny) && m.now.saturating_sub(b.sent_at) > round
                })
            };
            let (fresh, changes): (Vec<_>, Vec<_>) =
                buys.into_iter().partition(|p| p.keep_need.is_none() && waited(p));
            for (i, buys) in [fresh, changes].into_iter().enumerate() {
                if buys.is_empty() {
                    continue;
                }
                if i > 0 && kept_any && !fresh_only {
                    tokio::time::sleep(BUYS_SPREAD.min(self.config.slack / 4)).await;
                }
                let later = Moment { now: self.owner.clock().now().max(m.now), ..m };
                self.pay_and_settle(buys, later, &mut tally, &mut actions).await;
            }
        }
        tally.record();
        self.send(actions).await;
    }

    /// What each bucket asks for this round: enough to keep what it holds (the
    /// first list, paid first), or enough for the rate it wants as a new bucket or a
    /// unit to learn its part (the second); re-sends of buckets paid beyond the
    /// horizon go to `actions`.
    fn plan(
        &mut self,
        fresh_only: bool,
        m: &Moment,
        actions: &mut Vec<BucketAction>,
    ) -> (Vec<Planned>, Vec<Planned>) {
        let (mut keeps, mut buys) = (Vec::new(), Vec::new());
        let stream = if fresh_only { None } else { stream_swing(self.buckets.values()) };
        for (name, b) in &mut self.buckets {
            if fresh_only && b.sent.is_some() {
                continue;
            }
            if !fresh_only {
                b.measure(stream);
            }
            b.earn(m.now, m.burst);
            let keep_need = b.keep_need(m.horizon);
            // Asked for: what keeping costs while what it holds is within a tenth of
            // what it should hold (its demand, within its part of the rate as last
            // granted) or a change would not pay for its new bucket soon, or while
            // its part has not earned a new bucket; else what a new bucket at that
            // rate costs. Units asked for and not used are out of reach of the
            // others until the next round. After a swing of demand the part last
            // granted is stale (the owner divided the old demands): the ask follows
            // the demand, and the owner's grant says the new part. One over its part
            // that owes all it may owe asks for its new bucket however little it is
            // over ([`Bucket::owes_in_full`]).
            let fair = if b.swung { b.target() } else { b.target().min(b.part) };
            let owed = !b.swung && b.owes_in_full(m, fair);
            let keeps_it = !owed
                && b.sent.is_some_and(|s| {
                    s != Sent::Deny
                        && ((s.rate() <= fair * KEEP_WITHIN && s.rate() * KEEP_WITHIN >= fair)
                            || !worth_changing(
                                s.rate(),
                                fair,
                                b.change_cost(fair, m.burst, m.now, m.carry),
                            ))
                });
            let cap = capacity(fair, m.burst);
            let buys_it = b.may_buy_capacity(cap, fair, m.now, m.round, m.carry);
            let (want, paid_for) = match keep_need {
                Some(need) if keeps_it || !buys_it => (need, m.period_nanos),
                None if !buys_it => (1, m.period_nanos),
                _ => {
                    let span = m.horizon.saturating_sub(m.now);
                    let lasts = nanos_for(cap, fair)
                        .clamp(nanos(self.config.burst), u64::from(MAX_FILL_SECS) * NANOS_PER_SEC);
                    let carried = whole(b.carried(fair, m.now));
                    let fill = b.fill_cost(cap, m.now, m.carry);
                    (buy_ask(fill, fair, span).saturating_sub(carried), span.saturating_add(lasts))
                }
            };
            if keeps_it && want == 0 && b.lease.1 == 0 {
                // A slow bucket paid beyond the horizon, nothing to give back: no
                // call; its assignment is re-sent when due.
                if m.now.saturating_sub(b.sent_at) >= nanos(m.ttl) / 2 {
                    b.sent_at = m.now;
                    actions.push(assignment(b.id.clone(), b.sent.unwrap_or(Sent::Deny), m.ttl));
                }
                continue;
            }
            let item = b.item(want.max(1), paid_for);
            let mut planned = Planned { name: name.clone(), keep_need, item, rise: None };
            if keep_need.is_some() && (keeps_it || !buys_it) {
                keeps.push(planned);
            } else if let (Some(need @ 1..), Some(held @ Sent::Tokens { .. })) = (keep_need, b.sent)
                && !fresh_only
                && fair > held.rate()
            {
                // A rise: its keep first, its new bucket after (see `round`).
                let item = b.item(need, m.period_nanos);
                keeps.push(Planned { item, rise: Some((want, paid_for, held)), ..planned });
            } else {
                if buys_it && keep_need.is_none() {
                    // A new bucket where it holds none: a grant that cannot buy the
                    // smallest is no use to it, and would stay out of the level
                    // until its next round.
                    planned.item.least = MIN_CAPACITY + 1;
                }
                planned.item.after_keeps = true;
                buys.push(planned);
            }
        }
        (keeps, buys)
    }

    /// Pays for `planned` in one call per owner batch and settles each grant: the
    /// assignment it buys (or keeps) from `m.now` until `m.horizon`.
    async fn pay_and_settle(
        &mut self,
        planned: Vec<Planned>,
        m: Moment,
        tally: &mut Tally,
        actions: &mut Vec<BucketAction>,
    ) {
        let (names, items): (Vec<_>, Vec<_>) =
            planned.into_iter().map(|p| ((p.name, p.keep_need), p.item)).unzip();
        let grants = self.pay(items).await;
        for ((name, keep_need), grant) in names.into_iter().zip(grants) {
            let Some(b) = self.buckets.get_mut(&name) else { continue };
            if let Some(action) = b.settle(grant, keep_need, &m, tally) {
                actions.push(action);
            }
        }
    }

    /// Abandons the buckets with no requests for `rlqs.idle_ms`.
    fn abandon_idle(&mut self, now: Nanos, actions: &mut Vec<BucketAction>) {
        let idle = nanos(self.config.idle);
        let gone: Vec<String> = self
            .buckets
            .iter()
            .filter(|(_, b)| b.counted == 0 && now.saturating_sub(b.last_traffic) >= idle)
            .map(|(n, _)| n.clone())
            .collect();
        counted("abandon", gone.len());
        for n in gone {
            if let Some(b) = self.buckets.remove(&n) {
                self.total.fetch_sub(1, Ordering::Relaxed);
                metrics::gauge!(BUCKETS).decrement(1.0);
                actions.push(abandon(b.id));
            }
        }
    }

    /// One lease call per owner batch: a grant per item, `None` where the owner could
    /// not be reached or refused the item.
    async fn pay(&self, items: Vec<pb::LeaseItem>) -> Vec<Option<pb::LeaseGrant>> {
        let mut out = Vec::with_capacity(items.len());
        let batch = self.owner.limits().max_batch.max(1);
        let mut items = items.into_iter().peekable();
        while items.peek().is_some() {
            let chunk: Vec<_> = items.by_ref().take(batch).collect();
            let n = chunk.len();
            let req = pb::LeaseRequest { agent_id: self.holder.clone(), items: chunk, epoch: 0 };
            match super::routing::lease_routed(&self.owner, &req, 0).await {
                Ok(grants) if grants.len() == n => {
                    out.extend(grants.into_iter().map(|g| g.redirect.is_empty().then_some(g)));
                }
                Ok(_) | Err(_) => out.extend(std::iter::repeat_n(None, n)),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rate_is_whole_tokens_over_whole_seconds_never_above_it() {
        assert_eq!(tokens_for(150.0), Some((150, 1)));
        assert_eq!(tokens_for(0.5), Some((1, 2)));
        // 2.5 a second: 5 every 2 s.
        assert_eq!(tokens_for(2.5), Some((5, 2)));
        assert_eq!(tokens_for(1.0 / 120.0), None);
        for r in [0.02, 0.3, 1.7, 33.3, 1234.5] {
            let (t, s) = tokens_for(r).unwrap();
            let got = f64::from(t) / f64::from(s);
            assert!(got <= r && got >= r * 0.9, "{r}: {t}/{s}");
        }
    }

    #[test]
    fn envoy_tells_buckets_apart_by_capacity_and_tokens_only() {
        let a = Sent::Tokens { max_tokens: 5, tokens: 10, fill_secs: 1 };
        let b = Sent::Tokens { max_tokens: 5, tokens: 10, fill_secs: 2 };
        assert!(a.same_for_envoy(b));
        assert!(!a.same_for_envoy(Sent::Tokens { max_tokens: 6, tokens: 10, fill_secs: 1 }));
        assert!(!a.same_for_envoy(Sent::Deny));
    }

    #[test]
    fn a_bucket_id_maps_in_any_order_of_its_entries() {
        let m = EnvoyMapping {
            tenant_from: TenantFrom::Domain,
            route_key: "route".into(),
            default_route: None,
            descriptor_limits: crate::config::DescriptorLimits::Ignore,
        };
        let id = |pairs: &[(&str, &str)]| rlqs::BucketId {
            bucket: pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
        };
        let a = id(&[("route", "/api"), ("user", "u1"), ("plan", "gold")]);
        let (t, r, k) = map_bucket(&m, 256, "acme", &a).unwrap();
        assert_eq!(
            (t.as_str(), r.as_str(), k.as_deref()),
            ("acme", "/api", Some("plan=gold|user=u1"))
        );
        let b = id(&[("plan", "gold"), ("user", "u1"), ("route", "/api")]);
        assert_eq!(canonical(&a), canonical(&b));
        let err = map_bucket(&m, 256, "acme", &id(&[("user", "u1")])).unwrap_err();
        assert!(err.contains("`route`"), "{err}");
    }

    fn bucket(demand: f64) -> Bucket {
        Bucket {
            id: rlqs::BucketId::default(),
            tenant: "t".into(),
            route: "/r".into(),
            key: None,
            counted: 0,
            since: 0,
            reported: 0,
            demand,
            last_traffic: 0,
            sent: Some(Sent::Tokens { max_tokens: 2, tokens: 10, fill_secs: 1 }),
            paid_until: 0,
            sent_at: 0,
            lease: (0, 0),
            on_failure: None,
            part: f64::INFINITY,
            credit: 0.0,
            credited_at: 0,
            swung: false,
            last: (0, 0.0, 0.0),
            settling: false,
            fallback: false,
            warm: (0.0, 0.0, WARM_MEASURES),
            wait_until: 0,
        }
    }

    /// A round at `now` (rounds 0.25 s apart, `max_tokens` 0.1 s of a rate) paying
    /// 0.6 s ahead, where Envoys start a new bucket full.
    fn moment(now: Nanos) -> Moment {
        Moment {
            now,
            round: 0.25,
            horizon: now + 600_000_000,
            ttl: Duration::from_secs(2),
            burst: 0.1,
            period_nanos: 700_000_000,
            period: 0.7,
            carry: None,
        }
    }

    /// `b` reports `counted` requests at `at`, and its demand is measured.
    fn report(b: &mut Bucket, counted: u64, at: Nanos) {
        b.counted = counted;
        b.reported = at;
        b.measure(None);
    }

    /// The demand estimate after `counted` requests over half a second, from `demand`.
    fn measured(demand: f64, counted: u64) -> f64 {
        let mut b = bucket(demand);
        report(&mut b, counted, NANOS_PER_SEC / 2);
        b.demand
    }

    /// A new bucket subscribed by one request at 0, then reporting `counts`, one
    /// report every half second.
    fn subscribed(counts: &[u64]) -> Bucket {
        let mut b = Bucket { warm: warm_start(1), ..bucket(0.0) };
        for (i, &c) in (1..).zip(counts) {
            report(&mut b, c, i * NANOS_PER_SEC / 2);
        }
        b
    }

    #[test]
    fn a_new_buckets_demand_is_what_it_counted_since_its_subscription() {
        let close = |b: Bucket, x: f64| assert!((b.demand - x).abs() < 1e-9, "{} != {x}", b.demand);
        // Nine a second after the subscribing request: (4 + 1/2) / 0.5 s at once, not
        // a quarter of it.
        close(subscribed(&[4]), 9.0);
        close(subscribed(&[4, 5, 4, 5]), 18.5 / 2.0);
        // One request every 2.5 s: its subscribing request is not a rate of 2 a
        // second, and nothing since is not none.
        close(subscribed(&[0]), 1.0);
        close(subscribed(&[0, 0, 1, 0]), 1.5 / 2.0);
        // Smoothed as usual after four measures, from their mean.
        close(subscribed(&[4, 5, 4, 5, 5]), 0.25 * 10.0 + 0.75 * 9.25);
        // A swing from the mean ends them: taken at once.
        close(subscribed(&[4, 5, 40]), 80.0);
        // A bucket an Envoy had before this stream starts from its traffic.
        assert_eq!(warm_start(30).2, WARM_MEASURES);
        // Counts are the Envoy's to choose: the mean stays finite.
        assert!(subscribed(&[u64::MAX, u64::MAX, u64::MAX]).demand.is_finite());
    }

    #[test]
    fn a_fall_in_demand_is_taken_at_once_and_noise_is_smoothed() {
        // 22 a second, then 1 request in half a second (11 expected): a swing.
        assert!((measured(22.0, 1) - 2.0).abs() < 1e-9);
        // And a rise from 2 a second to 20.
        assert!((measured(2.0, 10) - 20.0).abs() < 1e-9);
        // No request where 2 were expected: noise (a slow bucket's estimate does
        // not collapse to nothing, and its part with it).
        assert!((measured(4.0, 0) - 3.0).abs() < 1e-9);
        // 9 of 11 expected, 120 of 100: noise, a quarter of the way.
        assert!((measured(22.0, 9) - (0.25 * 18.0 + 0.75 * 22.0)).abs() < 1e-9);
        assert!((measured(200.0, 120) - (0.25 * 240.0 + 0.75 * 200.0)).abs() < 1e-9);
    }

    #[test]
    fn a_rate_changes_only_where_the_difference_pays_for_the_new_bucket() {
        // Two tokens of capacity: up by a unit a second pays within 2 s, down by half
        // a unit within 4 s.
        assert!(worth_changing(1.0, 2.0, capacity(2.0, 0.1)));
        assert!(!worth_changing(1.0, 1.9, capacity(1.9, 0.1)));
        assert!(worth_changing(2.0, 1.5, capacity(1.5, 0.1)));
        assert!(!worth_changing(2.0, 1.6, capacity(1.6, 0.1)));
        // 100 to 90 a second: a new bucket of 9 tokens, worth it.
        assert!(worth_changing(100.0, 90.0, capacity(90.0, 0.1)));
    }

    #[test]
    fn a_new_bucket_is_bought_from_what_the_part_earned() {
        // Holds a quarter of a unit a second; buys half.
        let mut b = bucket(2.0);
        b.sent = Some(Sent::Tokens { max_tokens: 2, tokens: 1, fill_secs: 4 });
        b.part = 0.5;
        let new = Sent::Tokens { max_tokens: 2, tokens: 1, fill_secs: 2 };
        assert!(!b.may_buy(new, 0, 0.5, None), "nothing earned yet");
        // Half a unit a second (its demand's target is higher): 2 tokens in 4 s.
        let s = NANOS_PER_SEC;
        b.earn(3 * s, 0.1);
        assert!(!b.may_buy(new, 3 * s, 0.5, None));
        b.earn(4 * s, 0.1);
        assert!(b.may_buy(new, 4 * s, 0.5, None));
        // Earned within a new bucket's worth and a unit: idle time is not saved up.
        b.earn(100 * s, 0.1);
        assert!((b.credit - 3.0).abs() < 1e-9, "{}", b.credit);
        // A first assignment needs nothing earned; nothing is bought for `DENY`.
        b.sent = None;
        b.credit = -5.0;
        assert!(b.may_buy(new, 100 * s, 0.5, None));
        assert!(b.may_buy(Sent::Deny, 100 * s, 0.5, None));
        // Denied, it leaves once it owes nothing.
        b.sent = Some(Sent::Deny);
        b.credit = -0.1;
        assert!(!b.may_buy(new, 100 * s, 0.5, None));
        b.credit = 0.0;
        assert!(b.may_buy(new, 100 * s, 0.5, None));
    }

    #[test]
    fn a_debt_is_at_most_five_seconds_of_the_part() {
        // Denied after a fall: a part of 0.1 a second owing a whole bucket (2 tokens)
        // would wait 20 s to leave `DENY_ALL`; it owes at most 0.5 and leaves after
        // five seconds.
        let mut b = bucket(0.05);
        b.sent = Some(Sent::Deny);
        b.part = 0.1;
        b.credit = -2.0;
        b.earn(0, 0.1);
        assert!((b.credit + 0.5).abs() < 1e-9, "{}", b.credit);
        let new = Sent::Tokens { max_tokens: 2, tokens: 1, fill_secs: 10 };
        assert!(!b.may_buy(new, 0, 0.5, None));
        b.earn(4 * NANOS_PER_SEC, 0.1);
        assert!(!b.may_buy(new, 4 * NANOS_PER_SEC, 0.5, None));
        let later = 5 * NANOS_PER_SEC + NANOS_PER_SEC / 2;
        b.earn(later, 0.1);
        assert!(b.may_buy(new, later, 0.5, None));
        // A fast part owes at most a bucket, its `max_tokens`.
        let mut b = bucket(200.0);
        b.part = 100.0;
        b.paid_until = 0;
        b.credit = -50.0;
        b.earn(0, 0.1);
        assert!((b.credit + 10.0).abs() < 1e-9, "{}", b.credit);
    }

    #[test]
    fn units_paid_ahead_are_not_counted_as_given() {
        // 20 a second held, paid 0.6 s ahead at a round (12 units): its credit fell
        // by them, but its Envoy has not had them yet.
        let mut b = bucket(40.0);
        b.sent = Some(Sent::Tokens { max_tokens: 2, tokens: 20, fill_secs: 1 });
        b.part = 40.0;
        b.paid_until = 600_000_000;
        b.credit = -12.0;
        assert!((b.standing(0) - 0.0).abs() < 1e-9);
        // Its part rose to 40 a second. With rounds half a second apart, a bucket of 4
        // tokens is bought at once: what the rise earns in the next two rounds covers
        // it. Without that look-ahead, once its part has earned the 4 tokens beyond
        // what it held (a tenth of a second), not once the credit has caught up with
        // the horizon paid ahead.
        let bigger = Sent::Tokens { max_tokens: 4, tokens: 40, fill_secs: 1 };
        assert!(b.may_buy(bigger, 0, 0.5, None));
        assert!(!b.may_buy(bigger, 0, 0.0, None));
        let tenth = NANOS_PER_SEC / 10;
        b.earn(tenth, 0.1);
        // Earned 4, given 2 (its held rate's tenth of a second).
        assert!((b.standing(tenth) - 2.0).abs() < 1e-9, "{}", b.standing(tenth));
        b.earn(2 * tenth, 0.1);
        assert!(b.may_buy(bigger, 2 * tenth, 0.0, None), "{}", b.standing(2 * tenth));
        // Earning is capped at a new bucket's worth of standing and a unit, whatever
        // is paid ahead.
        b.earn(100 * NANOS_PER_SEC, 0.1);
        assert!((b.standing(100 * NANOS_PER_SEC) - 5.0).abs() < 1e-9);
    }

    #[test]
    fn a_demand_is_never_reported_as_none() {
        // The owner reads 0 as "not reported" and then divides by asks for every
        // holder of the chain.
        let item = bucket(0.0).item(1, NANOS_PER_SEC);
        assert_eq!((item.demand_per_sec, item.demand_milli), (1, 1));
        let item = bucket(0.0004).item(1, NANOS_PER_SEC);
        assert_eq!((item.demand_per_sec, item.demand_milli), (1, 1));
        assert_eq!(bucket(2.5).item(1, NANOS_PER_SEC).demand_milli, 2_500);
    }

    #[test]
    fn a_steady_shift_is_taken_within_two_reports() {
        // 60 a second, then 45 in each of two half seconds (30 expected): each short
        // of a swing, both together one.
        let mut b = bucket(60.0);
        report(&mut b, 45, NANOS_PER_SEC / 2);
        assert!((b.demand - (0.25 * 90.0 + 0.75 * 60.0)).abs() < 1e-9, "{}", b.demand);
        assert!(!b.swung);
        report(&mut b, 45, NANOS_PER_SEC);
        assert!((b.demand - 90.0).abs() < 1e-9, "{}", b.demand);
        assert!(b.swung, "the part last granted is stale");
        // Off both ways in turn: noise, smoothed.
        let mut b = bucket(60.0);
        for (i, n) in [38, 24].into_iter().enumerate() {
            report(&mut b, n, (i as u64 + 1) * NANOS_PER_SEC / 2);
        }
        assert!(!b.swung && (b.demand - 60.0).abs() < 8.0, "{}", b.demand);
    }

    /// A swing seen in a span it fell inside of is taken as measured (part old
    /// demand, part new); the next measure is taken whole rather than smoothed.
    #[test]
    fn the_measure_after_a_swing_is_taken_whole() {
        // 10 a second, then 25 in half a second where it rose to 80 part way
        // through (5 expected): a swing, to 50; then the whole new rate, 40 in half
        // a second, which is no swing from 50 but is taken as it is.
        let mut b = bucket(10.0);
        report(&mut b, 25, NANOS_PER_SEC / 2);
        assert!((b.demand - 50.0).abs() < 1e-9, "{}", b.demand);
        report(&mut b, 40, NANOS_PER_SEC);
        assert!((b.demand - 80.0).abs() < 1e-9, "{}", b.demand);
        // After that, noise is smoothed again.
        report(&mut b, 42, 3 * NANOS_PER_SEC / 2);
        assert!((b.demand - (0.25 * 84.0 + 0.75 * 80.0)).abs() < 1e-9, "{}", b.demand);
        // A slow bucket's measure after a swing holds a few requests' noise: not
        // taken whole. 40 a second, then 1 in half a second (20 expected): a swing,
        // to 2 a second; then no request in half a second (1 expected) is smoothed,
        // not an estimate of 0 (which left its part at nothing until a request came).
        let mut b = bucket(40.0);
        report(&mut b, 1, NANOS_PER_SEC / 2);
        assert!((b.demand - 2.0).abs() < 1e-9, "{}", b.demand);
        report(&mut b, 0, NANOS_PER_SEC);
        assert!((b.demand - 1.5).abs() < 1e-9, "{}", b.demand);
        // Where the estimate expects enough, an empty measure after a swing is one:
        // 400 a second, then 20 in half a second (200 expected), then none.
        let mut b = bucket(400.0);
        report(&mut b, 20, NANOS_PER_SEC / 2);
        report(&mut b, 0, NANOS_PER_SEC);
        assert!(b.demand.abs() < 1e-9, "{}", b.demand);
    }

    #[test]
    fn counts_an_envoy_chooses_cannot_overflow_the_estimate() {
        let mut b = bucket(5.0);
        for i in 1..4 {
            report(&mut b, u64::MAX, i * NANOS_PER_SEC / 2);
            assert!(b.demand.is_finite(), "{}", b.demand);
            let item = b.item(u64::MAX, NANOS_PER_SEC);
            assert_eq!(item.demand_milli, u64::MAX);
        }
    }

    #[test]
    fn coming_down_to_a_bucket_no_larger_needs_no_credit() {
        // Holds 10 a second in 2 tokens; nothing earned.
        let b = bucket(5.0);
        assert!(b.may_buy(Sent::Tokens { max_tokens: 2, tokens: 5, fill_secs: 1 }, 0, 0.5, None));
        assert!(!b.may_buy(Sent::Tokens { max_tokens: 3, tokens: 5, fill_secs: 1 }, 0, 0.5, None));
        // Faster by a unit a second: what that earns in two rounds half a second
        // apart does not cover 2 tokens; by two units, it does.
        assert!(!b.may_buy(Sent::Tokens { max_tokens: 2, tokens: 11, fill_secs: 1 }, 0, 0.5, None));
        assert!(b.may_buy(Sent::Tokens { max_tokens: 2, tokens: 12, fill_secs: 1 }, 0, 0.5, None));
    }

    #[test]
    fn a_paid_bucket_comes_down_to_its_part_and_goes_up_where_it_pays() {
        let held = Sent::Tokens { max_tokens: 2, tokens: 10, fill_secs: 1 };
        let cost = |r: f64| capacity(r, 0.1);
        // A bucket of 2 tokens at `t` a second.
        let two = |t| Sent::Tokens { max_tokens: 2, tokens: t, fill_secs: 1 };
        let smaller = Sent::Tokens { max_tokens: 2, tokens: 7, fill_secs: 1 };
        // Its part 8 a second: over by a quarter, down where something smaller
        // was bought, else held; to nothing where it is over half again its part, or its
        // part holds no bucket (under a token a minute).
        assert!(!keeps(held, smaller, 8.0, false, cost));
        assert!(keeps(held, Sent::Deny, 8.0, false, cost));
        assert!(!keeps(held, Sent::Deny, 6.6, false, cost));
        assert!(!keeps(held, Sent::Deny, 0.01, false, cost));
        // Down only to a bucket nearer its part than 10 a second, unless it is over
        // half again its part: 4 a second, where its part is 8, is held a round.
        let far = Sent::Tokens { max_tokens: 2, tokens: 4, fill_secs: 1 };
        assert!(keeps(held, far, 8.0, false, cost));
        assert!(!keeps(held, far, 6.0, false, cost));
        assert!(!keeps(held, two(1), 6.0, false, cost));
        // Within a tenth either way: held.
        assert!(keeps(held, two(11), 10.0, false, cost));
        assert!(keeps(held, Sent::Deny, 9.5, false, cost));
        // A fifth more, and it pays within 2 s: changed.
        assert!(!keeps(held, two(12), 12.0, false, cost));
    }

    #[test]
    fn a_rate_over_its_part_comes_down_once_it_owes_all_it_may() {
        // Holds 83 a second; its part is 78 (within a tenth: kept while a change
        // does not pay within seconds).
        let held = Sent::Tokens { max_tokens: 8, tokens: 83, fill_secs: 1 };
        let down = Sent::Tokens { max_tokens: 7, tokens: 78, fill_secs: 1 };
        let mut b = Bucket { sent: Some(held), part: 78.0, ..bucket(200.0) };
        let cost = |r: f64| capacity(r, 0.1);
        assert!(keeps(held, down, 78.0, false, cost));
        // Each round it pays its keep at 83 and earns 78: it owes 1.25 more each
        // round until it owes all it may (a new bucket at its part, 7 tokens), in
        // the sixth, and then comes down.
        let round = NANOS_PER_SEC / 4;
        let mut owed_at = None;
        for i in 1..=12u64 {
            let now = i * round;
            b.credit -= 83.0 * 0.25;
            b.earn(now, 0.1);
            if b.owes_in_full(&moment(now), 78.0) {
                owed_at.get_or_insert(i);
            }
        }
        assert_eq!(owed_at, Some(6), "{b:?}");
        assert!(!keeps(held, down, 78.0, true, cost));
        // Not where it holds under its part, nor to a bucket no nearer its part.
        assert!(!b.owes_in_full(&moment(12 * round), 90.0));
        assert!(keeps(
            held,
            Sent::Tokens { max_tokens: 7, tokens: 70, fill_secs: 1 },
            78.0,
            true,
            cost
        ));
        // Where its part holds only the smallest bucket (2 tokens), as well, where
        // that bucket is worth at most four rounds of its part; not where coming
        // down is the slow come-down's (a wait at `DENY_ALL`), which a small
        // overdraft is not worth.
        let mut small = bucket(20.0);
        small.credit = -2.0;
        for (part, owed) in [(9.0, true), (2.0, true), (1.9, false), (1.0, false)] {
            small.part = part;
            assert_eq!(small.owes_in_full(&moment(0), part), owed, "part {part}");
        }
    }

    #[test]
    fn a_slow_come_down_waits_a_random_part_of_its_buckets_worth() {
        let now = 10 * NANOS_PER_SEC;
        let m = moment(now);
        let grant = |units, milli| pb::LeaseGrant {
            lease_id: 1,
            units,
            rate_part_milli: milli,
            ..Default::default()
        };
        let slow = Sent::Tokens { max_tokens: 2, tokens: 1, fill_secs: 5 };
        let mut waits = Vec::new();
        for _ in 0..20 {
            // Holds 10 a second; its part falls to 0.2, whose bucket (2 tokens) is
            // ten seconds of it: `DENY_ALL`, and it buys once its wait is over.
            let mut b = bucket(0.4);
            b.settle(Some(grant(3, 200)), Some(3), &m, &mut Tally::default());
            assert_eq!(b.sent, Some(Sent::Deny));
            let wait = b.wait_until - now;
            assert!(wait > 0 && wait <= 10 * NANOS_PER_SEC, "{wait}");
            assert!(!b.may_buy(slow, b.wait_until - 1, 0.25, None));
            assert!(b.may_buy(slow, b.wait_until, 0.25, None));
            waits.push(wait);
        }
        // Drawn: not the same wait for every bucket.
        waits.sort_unstable();
        assert!(waits[0] < waits[19], "{waits:?}");
        // Down to 1 a second, whose bucket (2 tokens) is eight rounds of it: the same.
        let mut b = bucket(4.0);
        b.settle(Some(grant(10, 1_000)), Some(3), &m, &mut Tally::default());
        assert_eq!(b.sent, Some(Sent::Deny));
        assert!(b.wait_until > now && b.wait_until <= now + 2 * NANOS_PER_SEC);
        // Down to 3 a second, whose bucket is under three rounds of it: at once.
        let mut b = bucket(4.0);
        b.settle(Some(grant(10, 3_000)), Some(3), &m, &mut Tally::default());
        assert!(
            matches!(b.sent, Some(Sent::Tokens { tokens: 3, fill_secs: 1, .. })),
            "{:?}",
            b.sent
        );
        assert_eq!(b.wait_until, 0);
    }

    #[test]
    fn a_rate_held_over_its_part_after_a_swing_comes_down_though_it_pays_late() {
        let now = 10 * NANOS_PER_SEC;
        let m = moment(now);
        let grant =
            pb::LeaseGrant { lease_id: 1, units: 1, rate_part_milli: 550, ..Default::default() };
        let one = Sent::Tokens { max_tokens: 2, tokens: 1, fill_secs: 1 };
        // Holds 1 a second, its part now 0.55: 0.45 a second over 4 s does not pay
        // for a new bucket's 2 tokens, so the noise of a few requests keeps it...
        let mut b = bucket(1.0);
        b.sent = Some(one);
        b.settle(Some(grant.clone()), Some(1), &m, &mut Tally::default());
        assert_eq!(b.sent, Some(one));
        // ...but where its demand swung, it comes down (here to `DENY_ALL`: the unit
        // granted buys no bucket).
        let mut b = bucket(1.0);
        b.sent = Some(one);
        b.swung = true;
        b.settle(Some(grant), Some(1), &m, &mut Tally::default());
        assert_eq!(b.sent, Some(Sent::Deny));
        assert!(!b.swung);
    }

    #[test]
    fn a_new_bucket_counts_the_held_buckets_paid_time_at_the_lower_rate() {
        // Holds 10 a second, paid 200 ms past the round; the round pays 600 ms.
        let mut b = bucket(20.0);
        b.paid_until = 200_000_000;
        let (horizon, burst) = (600_000_000, 0.1);
        // Up to 20 a second: 2 tokens and 20 x 0.6 s, less 10 x 0.2 s carried.
        let twenty = Sent::Tokens { max_tokens: 2, tokens: 20, fill_secs: 1 };
        assert_eq!(b.choose(100, 0, horizon, burst, 20.0, None), (twenty, 12));
        // Exactly that is enough; a unit less is not.
        assert_eq!(b.choose(12, 0, horizon, burst, 20.0, None).0, twenty);
        assert_ne!(b.choose(11, 0, horizon, burst, 20.0, None).0, twenty);
        // Down to 5 a second: the held time carries at 5 a second (5 x 0.4 s).
        let five = Sent::Tokens { max_tokens: 2, tokens: 5, fill_secs: 1 };
        assert_eq!(b.choose(100, 0, horizon, burst, 5.0, None), (five, 4));
        // Either way the new bucket is paid to the horizon, not past it.
        for (units, rate) in [(10, 20.0), (2, 5.0)] {
            let until = b.new_paid_until(units, rate, 0);
            assert!((599_999_000..=horizon).contains(&until), "{rate}: {until}");
        }
        // Nothing held, or `DENY_ALL`: nothing carried.
        b.sent = Some(Sent::Deny);
        assert_eq!(b.choose(100, 0, horizon, burst, 20.0, None), (twenty, 14));
    }

    #[test]
    fn where_envoys_carry_tokens_a_change_pays_only_the_capacity_it_adds() {
        // Holds 10 a second in 2 tokens, sent at 0 with a 2 s TTL; delivery 100 ms.
        let mut b = bucket(20.0);
        b.paid_until = 200_000_000;
        let (horizon, burst) = (600_000_000, 0.1);
        let carry = Some(Carry { ttl: 2 * NANOS_PER_SEC, slack: 100_000_000 });
        let twenty = Sent::Tokens { max_tokens: 2, tokens: 20, fill_secs: 1 };
        // The same capacity: only the rate, 20 x 0.6 s less 10 x 0.2 s carried.
        assert_eq!(b.choose(100, 0, horizon, burst, 20.0, carry), (twenty, 10));
        assert_eq!(b.choose(100, 0, horizon, burst, 20.0, None), (twenty, 12));
        // A larger bucket pays for the tokens it adds: Envoy starts it at 4 x left / 2,
        // at most what is left (paid already) and 2.
        assert_eq!(b.fill_cost(4, 0, carry), 2);
        assert_eq!(b.fill_cost(4, 0, None), 4);
        // The held bucket expires (TTL 2 s) before a change sent at 1.95 s arrives:
        // Envoy starts the new one full.
        assert_eq!(b.fill_cost(2, 1_899_999_999, carry), 0);
        assert_eq!(b.fill_cost(2, 1_900_000_000, carry), 2);
        // Nothing held, `DENY_ALL`, or a failure policy's bucket (not paid): full.
        b.fallback = true;
        assert_eq!(b.fill_cost(2, 0, carry), 2);
        b.fallback = false;
        b.sent = Some(Sent::Deny);
        assert_eq!(b.fill_cost(2, 0, carry), 2);
        b.sent = None;
        assert_eq!(b.fill_cost(2, 0, carry), 2);
        // A change is weighed at its fill cost and the token rounding may drop.
        b.sent = Some(Sent::Tokens { max_tokens: 2, tokens: 10, fill_secs: 1 });
        assert_eq!(b.change_cost(20.0, burst, 0, carry), 1);
        assert_eq!(b.change_cost(20.0, burst, 0, None), 2);
        assert_eq!(b.change_cost(100.0, burst, 0, carry), 9);
    }

    #[test]
    fn a_new_buckets_ask_follows_its_rate_and_saturates() {
        assert_eq!(buy_ask(2, 1.0, 600_000_000), 3);
        assert_eq!(buy_ask(10, 100.0, 600_000_000), 70);
        assert_eq!(buy_ask(u64::MAX, 1e300, u64::MAX), u64::MAX);
        assert_eq!(buy_ask(5, f64::INFINITY, NANOS_PER_SEC), u64::MAX);
    }

    #[test]
    fn a_stream_that_swings_as_a_whole_moves_its_slow_buckets_at_once() {
        // Twenty buckets expecting 1.5 requests each in half a second, given 0 or 1:
        // none swings on its own, the stream does (10 of 30).
        let mut buckets: Vec<Bucket> = (0..20).map(|_| bucket(3.0)).collect();
        for (i, b) in buckets.iter_mut().enumerate() {
            b.counted = u64::from(i % 2 == 0);
            b.reported = NANOS_PER_SEC / 2;
        }
        let r = stream_swing(buckets.iter()).expect("the stream swung");
        assert!((r - 1.0 / 3.0).abs() < 1e-9, "{r}");
        for b in &mut buckets {
            b.measure(Some(r));
            assert!(b.swung && b.demand < 1.5, "{}", b.demand);
        }
        // The same counts in one bucket alone are noise; and a bucket far off on its
        // own (here 200 of 1.5) takes its own count and sets nothing for the others.
        let mut few: Vec<Bucket> = (0..2).map(|_| bucket(3.0)).collect();
        for b in &mut few {
            b.reported = NANOS_PER_SEC / 2;
        }
        assert_eq!(stream_swing(few.iter()), None);
        few[0].counted = 200;
        few[1].counted = 2;
        assert_eq!(stream_swing(few.iter()), None);
        // A fifth fewer requests than expected over the stream, twice: each short of
        // a swing, together (against the estimates before both) a shift, taken at the
        // latest measure's factor against the estimates it updates.
        let mut buckets: Vec<Bucket> = (0..20).map(|_| bucket(15.0)).collect();
        for b in &mut buckets {
            b.counted = 6;
            b.reported = NANOS_PER_SEC / 2;
        }
        assert_eq!(stream_swing(buckets.iter()), None, "one measure is noise");
        for b in &mut buckets {
            b.measure(None);
            assert_eq!(b.last, (6, 0.5, 15.0));
            b.counted = 6;
            b.reported = NANOS_PER_SEC;
        }
        // The estimates moved a quarter of the way: 14.25 a second, 142.5 expected.
        let r = stream_swing(buckets.iter()).expect("a shift");
        assert!((r - 120.0 / 142.5).abs() < 1e-9, "{r}");
        // Not after measures off the other way.
        for b in &mut buckets {
            b.last = (9, 0.5, 15.0);
        }
        assert_eq!(stream_swing(buckets.iter()), None);
        // A burst in the slow buckets alone: three large buckets (16, 7.5 and 4.5 a
        // second) count what they expect in a half-second report, thirty slow ones
        // (0.6 a second) a request each. Together 44 where 23 were expected, a swing
        // by the sum; but the largest, which expect half of the requests, did not
        // move.
        let stream_of = |large: [u64; 3], slow: &dyn Fn(usize) -> u64| {
            let mut v: Vec<Bucket> =
                [16.0, 7.5, 4.5].into_iter().chain([0.6; 30]).map(bucket).collect();
            for (i, b) in v.iter_mut().enumerate() {
                b.reported = NANOS_PER_SEC / 2;
                b.counted = if i < 3 { large[i] } else { slow(i) };
            }
            v
        };
        let burst = stream_of([8, 4, 2], &|_| 1);
        assert!(swings(44.0, 23.0));
        assert_eq!(stream_swing(burst.iter()), None, "the large buckets did not move");
        // The same stream 1.8 times busier in every bucket (three slow ones in five
        // count a request) swung as a whole.
        let busier = stream_of([14, 7, 4], &|i| [1, 0, 1, 1, 0][i % 5]);
        let r = stream_swing(busier.iter()).expect("the whole stream swung");
        assert!((r - 43.0 / 23.0).abs() < 1e-9, "{r}");
        // A report just after the subscription is no rate: counted on.
        let mut b = bucket(0.0);
        b.sent = None;
        report(&mut b, 1, 5_000_000);
        assert_eq!((b.demand, b.counted), (0.0, 1));
    }

    /// A stream on an owner of one token bucket route `/r` of tenant `t` (10 a second,
    /// a second of burst), on a manual clock; the time, and what it sends.
    fn stream(dir: &tempfile::TempDir) -> (Session, Nanos, Sends) {
        use crate::config::ServerConfig;
        use crate::owner::reload::PolicyHolder;
        use limiter_core::clock::{Clock, ManualClock};
        let path = dir.path().join("policies.yaml");
        let policy = "version: 1\nlease: { mode: leased, ttl: 2s, max_batch: 1000 }\ntenants:\n  \
                      t:\n    routes:\n      /r: { algorithm: token_bucket, rate: 10/s, burst: 10 }\n";
        std::fs::write(&path, policy).unwrap();
        let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(1_000 * NANOS_PER_SEC));
        let policies = Arc::new(PolicyHolder::load(&path, clock.clone()).unwrap());
        let config = ServerConfig::for_policy(&path).unwrap();
        let owner = Arc::new(Owner::in_memory(policies, clock.clone(), config.limits));
        let (tx, rx) = mpsc::channel(16);
        let s = Session {
            owner,
            mapping: Arc::new(config.envoy),
            // The tests' arithmetic is of rounds of 500 ms.
            config: RlqsConfig { round: Duration::from_millis(500), ..config.rlqs },
            holder: "rlqs:test:1".into(),
            domain: Some("t".into()),
            buckets: HashMap::new(),
            total: Arc::default(),
            report_gap: 0,
            last_message: 0,
            tx,
        };
        (s, clock.now(), rx)
    }

    type Sends = mpsc::Receiver<Result<rlqs::RateLimitQuotaResponse, Status>>;

    /// A bucket of `/r` holding 1 a second (paid 50 ms ahead) whose part rose to 5 a
    /// second, with the credit for a new bucket.
    fn rising(now: Nanos) -> Bucket {
        let mut b = bucket(8.0);
        b.tenant = "t".into();
        b.sent = Some(Sent::Tokens { max_tokens: 2, tokens: 1, fill_secs: 1 });
        (b.part, b.credit, b.credited_at) = (5.0, 3.0, now);
        (b.since, b.reported, b.last_traffic, b.sent_at) = (now, now, now, now);
        b.paid_until = now + NANOS_PER_SEC / 20;
        b
    }

    async fn left(s: &Session) -> u64 {
        let u = s.owner.usage(&Request::new("t", "/r")).await.unwrap();
        u.levels.iter().map(|l| l.remaining).min().unwrap()
    }

    /// A rate holder's ask for `want` units of `/r` over 30 s, at a demand of
    /// `demand_milli` thousandths of a unit a second.
    fn rate_ask(want: u64, demand_milli: u64) -> pb::LeaseItem {
        pb::LeaseItem {
            tenant: "t".into(),
            route: "/r".into(),
            want,
            demand_milli,
            demand_per_sec: 1,
            renews_within: Some(crate::convert::duration(30 * NANOS_PER_SEC)),
            rates: true,
            ..Default::default()
        }
    }

    /// A rate holder's ask within its part gets what the level has left, up to the
    /// ask: what is left is not divided by demand again (which gave a holder of a
    /// hundredth of the demand nothing of 2 units, and several buyers a unit each
    /// that bought nothing and was held out of the level for a round).
    #[tokio::test]
    async fn an_ask_within_its_part_takes_what_is_left() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _, _sent) = stream(&dir);
        let ask = rate_ask;
        // Demands within the chain's rate (10 a second): beyond twice it, a demand
        // counts as twice the rate.
        let big = s.owner.lease("rlqs:test:big", &[ask(8, 9_900)]).await.unwrap();
        assert_eq!(big[0].units, 8);
        assert_eq!(left(&s).await, 2);
        // A hundredth of the demand: its part over 30 s is 3 units.
        let small = s.owner.lease("rlqs:test:small", &[ask(3, 100)]).await.unwrap();
        assert_eq!((small[0].units, small[0].rate_part), (2, 3));
        assert_eq!(left(&s).await, 0);
    }

    /// An Envoy's denied requests are its own to report: a claim of any demand counts
    /// for twice the chain's rate at most, so one Envoy cannot take the others' parts
    /// by reporting it. Here 10 a second, an honest holder's demand 5 a second: its
    /// part is 10 x 5 / (5 + 20) a second whatever the other claims (bounded only by
    /// what the other asked, it was a thousandth of a unit a second). A demand of
    /// 15 a second counts whole.
    #[tokio::test]
    async fn a_claimed_demand_counts_for_twice_the_chains_rate_at_most() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _, _sent) = stream(&dir);
        let greedy = pb::LeaseItem { demand_per_sec: u64::MAX, ..rate_ask(10_000, u64::MAX) };
        let g = s.owner.lease("rlqs:test:greedy", std::slice::from_ref(&greedy)).await.unwrap();
        // Alone, it is given the chain's rate.
        assert_eq!(g[0].rate_part_milli, 10_000);
        let honest = s.owner.lease("rlqs:test:honest", &[rate_ask(3, 5_000)]).await.unwrap();
        assert_eq!(honest[0].rate_part_milli, 2_000);
        let g = s.owner.lease("rlqs:test:greedy", &[greedy]).await.unwrap();
        assert_eq!(g[0].rate_part_milli, 8_000);
        // Within twice the rate, a demand counts whole: 15 against 5.
        let g = s.owner.lease("rlqs:test:greedy", &[rate_ask(3, 15_000)]).await.unwrap();
        assert_eq!(g[0].rate_part_milli, 7_500);
    }

    /// A new bucket (asked for after the round's keeps) is paid only from what the
    /// level holds beyond what the next keeps need (here 2 units: a twentieth of a
    /// second of its rate is under one); a keep may take the last units.
    #[tokio::test]
    async fn a_new_bucket_leaves_the_next_keeps_their_units() {
        let dir = tempfile::tempdir().unwrap();
        let (s, _, _sent) = stream(&dir);
        let ask =
            |want: u64, after_keeps: bool| pb::LeaseItem { after_keeps, ..rate_ask(want, 5_000) };
        // A level of 10 keeps 2 units: a quarter of its capacity, under
        // `RATE_PART_MIN`.
        let buy = s.owner.lease("rlqs:test:a", &[ask(10, true)]).await.unwrap();
        assert_eq!((buy[0].units, left(&s).await), (8, 2));
        let again = s.owner.lease("rlqs:test:b", &[ask(1, true)]).await.unwrap();
        assert_eq!((again[0].units, left(&s).await), (0, 2));
        let keep = s.owner.lease("rlqs:test:b", &[ask(1, false)]).await.unwrap();
        assert_eq!((keep[0].units, left(&s).await), (1, 1));
        let keep = s.owner.lease("rlqs:test:c", &[ask(1, false)]).await.unwrap();
        assert_eq!((keep[0].units, left(&s).await), (1, 0));
    }

    /// A bucket holding nothing asks for at least the smallest new bucket: less
    /// would buy nothing (several buyers each held a unit out of the level so).
    #[tokio::test]
    async fn a_new_buckets_ask_takes_no_less_than_the_smallest_bucket() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, now, _sent) = stream(&dir);
        let mut denied = rising(now);
        denied.sent = Some(Sent::Deny);
        s.buckets.insert("b".into(), denied);
        let m = s.moment(now);
        let (keeps, buys) = s.plan(false, &m, &mut Vec::new());
        assert!(keeps.is_empty());
        assert_eq!((buys.len(), buys[0].item.least), (1, 3));
        // 2 units left: nothing is granted, and both stay in the level.
        s.owner.lease("other", &[buys[0].item.clone()]).await.unwrap();
        let drain = pb::LeaseItem { want: left(&s).await - 2, ..buys[0].item.clone() };
        let _ = s.owner.lease("other", &[pb::LeaseItem { least: 0, ..drain }]).await.unwrap();
        assert_eq!(left(&s).await, 2);
        let g = s.owner.lease("rlqs:test:1", &[buys[0].item.clone()]).await.unwrap();
        assert_eq!((g[0].units, left(&s).await), (0, 2));
    }

    #[tokio::test]
    async fn a_rise_keeps_with_the_keeps_then_buys_with_the_keeps_units_handed_back() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, now, _sent) = stream(&dir);
        s.buckets.insert("b".into(), rising(now));
        let m = s.moment(now);
        let (keeps, buys) = s.plan(false, &m, &mut Vec::new());
        assert!(buys.is_empty());
        assert_eq!(keeps.len(), 1);
        // Its keep (1 unit: to the horizon at 1 a second), and the rise's ask after:
        // a new bucket of 2 tokens and 5 a second to the horizon.
        assert_eq!((keeps[0].item.want, keeps[0].rise.map(|r| r.0)), (1, Some(5)));
        s.buckets.insert("b".into(), rising(now));
        assert_eq!(left(&s).await, 10);
        s.round(false).await;
        let b = &s.buckets["b"];
        // A new bucket (the grant's part, 10 a second, is above its demand's 8: the
        // 5 units granted buy what they pay for, 14 tokens over 3 s), paid to the
        // horizon.
        assert_eq!(b.sent, Some(Sent::Tokens { max_tokens: 2, tokens: 14, fill_secs: 3 }));
        assert!(b.paid_until >= m.horizon, "{} < {}", b.paid_until, m.horizon);
        // Its 5 units are all that is out: the keep's unit went back with the ask.
        assert_eq!((b.lease.1, left(&s).await), (0, 5));
    }

    #[tokio::test]
    async fn a_rise_that_cannot_be_paid_keeps_what_it_holds() {
        let dir = tempfile::tempdir().unwrap();
        let (mut s, now, _sent) = stream(&dir);
        // Others spent all but 1 unit: the keep's.
        let spend = Request::new("t", "/r").with_cost(9);
        let api = crate::metrics::Api::Native;
        s.owner
            .decide(api, &[spend], crate::owner::Charge::Each, crate::owner::Report::Now)
            .await
            .unwrap();
        s.buckets.insert("b".into(), rising(now));
        s.round(false).await;
        let b = &s.buckets["b"];
        assert_eq!(b.sent, Some(Sent::Tokens { max_tokens: 2, tokens: 1, fill_secs: 1 }));
        assert_eq!(b.paid_until, now + NANOS_PER_SEC / 20 + NANOS_PER_SEC);
        assert_eq!(left(&s).await, 0);
    }
}
