//! Metric names, their descriptions, and the Prometheus recorder.
//!
//! Labels are bounded enums only: `api`, `route` (a route the policy names, else
//! `other`), `decision`, `reason`, `scope`, `result`, `kind`, `field`, `listener`,
//! `what`, `limit`. Never a tenant or
//! a key: those go to logs.

use std::sync::OnceLock;

use limiter_core::{Reason, Scope, Verdict};
use metrics::{Counter, Unit, describe_counter, describe_gauge, describe_histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Decisions, by `api`, `route`, `decision` (`allowed`, `rejected`, `shadow_rejected`),
/// `reason` and `scope`.
pub const DECISIONS: &str = "limiter_decisions_total";
/// Time to decide one request, by `api`.
pub const DECISION_SECONDS: &str = "limiter_decision_duration_seconds";
/// Calls refused as invalid, by `api` and `field`.
pub const INVALID_REQUESTS: &str = "limiter_invalid_requests_total";
/// Calls refused for their credentials, by `listener` (`grpc`, `admin`) and `reason`
/// (`no_credentials`, `malformed`, `unknown_token`, `not_allowed`).
pub const AUTH_REFUSALS: &str = "limiter_auth_refusals_total";
/// TLS handshakes that failed, by `listener` and `kind` (`refused`, `timeout`).
pub const TLS_HANDSHAKE_FAILURES: &str = "limiter_tls_handshake_failures_total";
/// Certificate and token files read again after a change, by `what` (`grpc`,
/// `admin`, `tokens`) and `result` (`ok`, `failed`).
pub const SECURITY_RELOADS: &str = "limiter_security_reloads_total";
/// Requests refused for exceeding a bound on what callers may make the server hold,
/// by `limit` (`keys_per_tenant`).
pub const LIMIT_REFUSALS: &str = "limiter_limit_refusals_total";
/// Counters held in the memory store.
pub const STORE_KEYS: &str = "limiter_store_keys";
/// The most counters the memory store holds.
pub const STORE_MAX_KEYS: &str = "limiter_store_max_keys";
/// Counters dropped, by `kind` (`idle`: lossless; `live`: evicted because full).
pub const STORE_EVICTIONS: &str = "limiter_store_evictions_total";
/// Policy reloads, by `result` (`ok`, `failed`).
pub const POLICY_RELOADS: &str = "limiter_policy_reloads_total";
/// Reads of the policy file (each open of it).
pub const POLICY_READS: &str = "limiter_policy_reads_total";
/// The active policy's version.
pub const POLICY_VERSION: &str = "limiter_policy_version";
/// When the active policy was loaded (Unix seconds).
pub const POLICY_LOADED: &str = "limiter_policy_loaded_timestamp_seconds";
/// Reported costs settled after the fact, by `direction` (`charge`, `refund`).
pub const COST_REPORTS: &str = "limiter_cost_reports_total";
/// Units settled after the fact, by `direction`.
pub const COST_REPORT_UNITS: &str = "limiter_cost_report_units_total";
/// 1, with the build's `version` as a label.
pub const BUILD_INFO: &str = "limiter_build_info";
/// Leased units now out with agents.
pub const LEASES_OUTSTANDING: &str = "limiter_lease_outstanding_units";
/// Leases now open.
pub const LEASES_OPEN: &str = "limiter_leases_open";
/// Leased units by `fate`: `granted`, `returned`, `spent`, `written_off`.
pub const LEASE_UNITS: &str = "limiter_lease_units_total";
/// Store calls that failed, by `kind` (the memory store never fails; networked
/// stores report here).
pub const STORE_ERRORS: &str = "limiter_store_errors_total";
/// Calls to the store (Redis), by operation.
pub const STORE_CALLS: &str = "limiter_store_calls_total";
/// 1 while the store's circuit breaker is open.
pub const STORE_BREAKER_OPEN: &str = "limiter_store_breaker_open";
/// Routes now deciding by their failure policy (the store is unreachable).
pub const FALLBACK_ROUTES: &str = "limiter_fallback_routes";
/// Members of the ownership ring as this node sees it.
pub const RING_MEMBERS: &str = "limiter_ring_members";
/// The ring's version; it only grows.
pub const RING_EPOCH: &str = "limiter_ring_epoch";
/// Age of this node's membership view, in seconds.
pub const MEMBERSHIP_AGE: &str = "limiter_membership_view_age_seconds";
/// 1 while the server is ready to serve (policy loaded, not draining).
pub const READY: &str = "limiter_ready";
/// Calls forwarded to a tenant's owner, by `api` and `outcome` (`answered`,
/// `redirected`, `unreachable`).
pub const FORWARDS: &str = "limiter_forwards_total";
/// Envoy descriptors that carried their own limit, by what was done with it.
pub const ENVOY_DESCRIPTOR_LIMITS: &str = "limiter_envoy_descriptor_limits_total";
/// Counters handed to or received from other nodes in planned moves, by `direction`.
pub const HANDOFF_COUNTERS: &str = "limiter_handoff_counters_total";
/// Handoffs that could not be delivered.
pub const HANDOFF_FAILURES: &str = "limiter_handoff_failures_total";
/// Handed-off state refused: from a node not in the cluster, or a counter no
/// algorithm can reach (`reason`: `sender`, `state`).
pub const HANDOFF_REFUSED: &str = "limiter_handoff_refused_total";
/// Connections closed at accept because their listener was at its cap
/// (`listener`: `grpc`, `admin`; `grpc_http1`: HTTP/1 requests to the gRPC port).
pub const CONNECTIONS_REFUSED: &str = "limiter_connections_refused_total";
/// Connections closed for sending no request in time (`kind`: `header`, `idle`).
pub const CONNECTION_TIMEOUTS: &str = "limiter_connection_timeouts_total";
/// The cap on open connections per listener.
pub const CONNECTIONS_MAX: &str = "limiter_connections_max";
/// Requests that stopped waiting for a handoff that did not arrive in time.
pub const HANDOFF_TIMEOUTS: &str = "limiter_handoff_timeouts_total";
/// Decisions made by the failure policy because the tenant is fenced after its old
/// owner's loss.
pub const FENCED_DECISIONS: &str = "limiter_fenced_decisions_total";
/// Units of root keys (global ceiling, route-wide limits) this node holds in slices
/// leased from their owners.
pub const SLICE_UNITS: &str = "limiter_slice_units";
/// Slice leases asked of root owners, by `outcome`.
pub const SLICE_CALLS: &str = "limiter_slice_calls_total";
/// Age of the oldest change not yet acknowledged by a replica, by `peer` (0 when it
/// has everything).
pub const REPLICATION_LAG: &str = "limiter_replication_lag_seconds";
/// Changed counters and leases waiting for a replica, by `peer`.
pub const REPLICATION_QUEUE: &str = "limiter_replication_queue";
/// From a change to the replica's acknowledgement of it (at most: from the round
/// before the one that took it).
pub const REPLICATION_DELAY: &str = "limiter_replication_delay_seconds";
/// Replication messages sent, by `result` (`ok`, `failed`).
pub const REPLICATION_MESSAGES: &str = "limiter_replication_messages_total";
/// Full copies sent to a replica, by `why` (`new`, `ring`, `resync`, `overflow`).
pub const REPLICATION_FULL: &str = "limiter_replication_full_copies_total";
/// Tenants a node took over from a lost owner's replica.
pub const REPLICA_TAKEOVERS: &str = "limiter_replica_takeovers_total";
/// Permits of concurrency levels, by `event`: `acquired`, `released`, `renewed`,
/// `late_release` (a release of a permit no longer held: released already, expired or
/// forgotten; nothing changes), `late_renewal` (refused), `forgotten` (dropped from a
/// full book; its units come back at expiry).
pub const PERMITS: &str = "limiter_permits_total";
/// Permits of concurrency levels held now (named in this node's book), and their units.
pub const PERMITS_HELD: &str = "limiter_permits_held";
/// Tenants (or root keys, or evicted live counters) whose counters began afresh, by
/// `reason`.
pub const STATE_RESETS: &str = "limiter_state_resets_total";

/// Requests refused by their class's share of a divided level, by `scope` (of the
/// level) and `class` (named in the policy: a bounded set).
pub const SHARE_REJECTIONS: &str = "limiter_share_rejections_total";
/// The share of a divided level each class is allocated now (0 to 1), by `scope` and
/// `class`.
pub const SHARE_ALLOCATION: &str = "limiter_share_allocation_ratio";

/// Histogram buckets for decision latency: 5 µs to 1 s.
const LATENCY_BUCKETS: &[f64] = &[
    0.000_005, 0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// Histogram buckets for replication delay: 5 ms to 5 s (rounds are 50 ms apart).
const DELAY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5,
    1.0, 2.0, 5.0,
];

/// Metric: Envoy RLQS streams open now.
pub const RLQS_STREAMS: &str = "limiter_rlqs_streams";
/// Metric: buckets subscribed on this node's RLQS streams now.
pub const RLQS_BUCKETS: &str = "limiter_rlqs_buckets";
/// Metric: actions sent to Envoys, by `action` (`assign`: a new or changed token
/// bucket; `extend`: the same re-sent; `deny`; `fallback`: a failure policy's;
/// `abandon`).
pub const RLQS_ACTIONS: &str = "limiter_rlqs_actions_total";
/// Metric: RLQS buckets refused, by `reason` (`invalid`: no id, unmappable or bad
/// names; `over_cap`: beyond `rlqs.max_buckets` on the stream or
/// `rlqs.max_total_buckets` on the node).
pub const RLQS_REFUSED: &str = "limiter_rlqs_refused_buckets_total";
/// Metric: units paid for Envoys' RLQS assignments (granted less handed back).
pub const RLQS_PAID: &str = "limiter_rlqs_paid_units_total";

/// The process-wide recorder, installed on first use. Several servers in one process
/// (tests) share it.
pub fn handle() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Full(DECISION_SECONDS.to_owned()), LATENCY_BUCKETS)
            .expect("buckets are not empty")
            .set_buckets_for_metric(Matcher::Full(REPLICATION_DELAY.to_owned()), DELAY_BUCKETS)
            .expect("buckets are not empty")
            .build_recorder();
        let handle = recorder.handle();
        // Another recorder may already be installed (an embedding application's);
        // then ours still renders what it is given, which is nothing: say so.
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
        }
        describe();
        metrics::gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
        // Series that exist from the start, so that dashboards and alerts have data
        // before the first event of their kind.
        for result in ["ok", "failed"] {
            metrics::counter!(POLICY_RELOADS, "result" => result).increment(0);
        }
        for kind in ["error", "timeout", "breaker_open"] {
            metrics::counter!(STORE_ERRORS, "kind" => kind).increment(0);
        }
        metrics::gauge!(STORE_BREAKER_OPEN).set(0.0);
        metrics::gauge!(FALLBACK_ROUTES).set(0.0);
        // A single node with a static view of itself until membership is configured.
        metrics::gauge!(RING_MEMBERS).set(1.0);
        metrics::gauge!(RING_EPOCH).set(0.0);
        metrics::gauge!(MEMBERSHIP_AGE).set(0.0);
        for event in PERMIT_EVENTS {
            metrics::counter!(PERMITS, "event" => *event).increment(0);
        }
        metrics::gauge!(PERMITS_HELD).set(0.0);
        for reason in RESET_REASONS {
            metrics::counter!(STATE_RESETS, "reason" => *reason).increment(0);
        }
        handle
    })
}

/// What happens to permits (the `event` label of [`PERMITS`]).
pub const PERMIT_EVENTS: &[&str] = &[
    "acquired",
    "released",
    "renewed",
    "late_release",
    "late_renewal",
    "forgotten",
    "held_for_waiters",
];

/// Why counters began afresh: owner and replica both lost; the replica held was
/// behind (incomplete, stale, or from another ring); no replica was kept; a live
/// counter evicted because the store was full.
pub const RESET_REASONS: &[&str] =
    &["owner_and_replica_lost", "replica_behind", "no_replica", "evicted"];

fn describe() {
    describe_counter!(DECISIONS, "Decisions by api, route, decision, reason and scope.");
    describe_histogram!(DECISION_SECONDS, Unit::Seconds, "Time to decide one request.");
    describe_counter!(INVALID_REQUESTS, "Calls refused as invalid, by api and field.");
    describe_counter!(
        AUTH_REFUSALS,
        "Calls refused for their credentials, by listener and reason."
    );
    describe_counter!(TLS_HANDSHAKE_FAILURES, "TLS handshakes that failed, by listener and kind.");
    describe_counter!(
        SECURITY_RELOADS,
        "Certificate and token files reloaded, by what and result."
    );
    describe_counter!(LIMIT_REFUSALS, "Requests refused by a bound on held state, by limit.");
    describe_gauge!(STORE_KEYS, "Counters held in the memory store.");
    describe_gauge!(STORE_MAX_KEYS, "The most counters the memory store holds.");
    describe_counter!(STORE_EVICTIONS, "Counters dropped: idle (lossless) or live (store full).");
    describe_counter!(POLICY_RELOADS, "Policy reloads by result.");
    describe_counter!(POLICY_READS, "Reads of the policy file.");
    describe_gauge!(POLICY_VERSION, "Version of the active policy.");
    describe_gauge!(POLICY_LOADED, Unit::Seconds, "When the active policy was loaded.");
    describe_counter!(COST_REPORTS, "Costs settled after the fact, by direction.");
    describe_counter!(PERMITS, "Permits of concurrency levels, by event.");
    describe_gauge!(PERMITS_HELD, "Permits of concurrency levels held at this node.");
    describe_counter!(
        SHARE_REJECTIONS,
        "Requests refused by their class's share, by scope and class."
    );
    describe_gauge!(
        SHARE_ALLOCATION,
        "Share of a divided level allocated to a class now, by scope and class."
    );
    describe_counter!(COST_REPORT_UNITS, "Units settled after the fact, by direction.");
    describe_gauge!(BUILD_INFO, "Build information.");
    describe_gauge!(READY, "1 while ready to serve.");
    describe_gauge!(LEASES_OUTSTANDING, "Leased units now out with agents.");
    describe_counter!(STORE_ERRORS, "Store calls that failed, by kind.");
    describe_counter!(STORE_CALLS, "Calls to the Redis store, by operation.");
    describe_gauge!(STORE_BREAKER_OPEN, "1 while the store's circuit breaker is open.");
    describe_gauge!(
        FALLBACK_ROUTES,
        "Routes that decided by their failure policy (the store unreachable) in the last 5 s."
    );
    describe_gauge!(RING_MEMBERS, "Members of the ownership ring.");
    describe_gauge!(RING_EPOCH, "Version of the ownership ring.");
    describe_gauge!(MEMBERSHIP_AGE, Unit::Seconds, "Age of the membership view.");
    describe_gauge!(LEASES_OPEN, "Leases now open.");
    describe_counter!(LEASE_UNITS, "Leased units by fate: granted, returned, spent, written off.");
    describe_counter!(FORWARDS, "Calls forwarded to a tenant's owner, by api and outcome.");
    describe_counter!(
        ENVOY_DESCRIPTOR_LIMITS,
        "Envoy descriptors with their own limit, by result: applied, capped, ignored, invalid."
    );
    describe_counter!(HANDOFF_COUNTERS, "Counters handed off in planned moves, by direction.");
    describe_counter!(HANDOFF_FAILURES, "Handoffs that could not be delivered.");
    describe_counter!(
        HANDOFF_REFUSED,
        "Handoffs from unknown senders, and handed-off counters no algorithm can reach, refused."
    );
    describe_counter!(CONNECTIONS_REFUSED, "Connections closed at accept: the listener's cap.");
    describe_counter!(CONNECTION_TIMEOUTS, "Connections closed for sending no request in time.");
    describe_gauge!(CONNECTIONS_MAX, "The cap on open connections, per listener.");
    describe_counter!(HANDOFF_TIMEOUTS, "Requests that stopped waiting for a late handoff.");
    describe_counter!(FENCED_DECISIONS, "Failure-policy decisions for fenced tenants.");
    describe_gauge!(SLICE_UNITS, "Units of root keys held in slices leased from their owners.");
    describe_counter!(SLICE_CALLS, "Slice leases asked of root owners, by outcome.");
    describe_gauge!(REPLICATION_LAG, Unit::Seconds, "Oldest change a replica lacks, by peer.");
    describe_gauge!(REPLICATION_QUEUE, "Changes waiting for a replica, by peer.");
    describe_histogram!(REPLICATION_DELAY, Unit::Seconds, "From a change to its replica's ack.");
    describe_counter!(REPLICATION_MESSAGES, "Replication messages sent, by result.");
    describe_counter!(REPLICATION_FULL, "Full copies sent to a replica, by why.");
    describe_counter!(REPLICA_TAKEOVERS, "Tenants taken over from a lost owner's replica.");
    describe_counter!(STATE_RESETS, "Tenants whose counters began afresh, by reason.");
    describe_gauge!(RLQS_STREAMS, "Envoy RLQS streams open now.");
    describe_gauge!(RLQS_BUCKETS, "Buckets subscribed on this node's RLQS streams.");
    describe_counter!(
        RLQS_ACTIONS,
        "Actions sent to Envoys on RLQS streams, by action: assign, extend, deny, fallback, abandon."
    );
    describe_counter!(RLQS_REFUSED, "RLQS buckets refused (denied), by reason: invalid, over_cap.");
    describe_counter!(RLQS_PAID, "Units paid for Envoys' RLQS assignments.");
}

/// Which API a decision came through (a label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `limiter.v1.RateLimiter`.
    Native,
    /// `envoy.service.ratelimit.v3.RateLimitService`.
    Envoy,
    /// Direct decisions for agents (the lease protocol).
    Lease,
    /// Permit blocks for agents' local pools (`permit_block`).
    Permits,
}

impl Api {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Envoy => "envoy",
            Self::Lease => "lease",
            Self::Permits => "permits",
        }
    }
}

/// Counts a call refused as malformed, by API and the field at fault (a bounded
/// label: the fields are the server's own names).
pub fn count_invalid(api: Api, field: &'static str) {
    metrics::counter!(INVALID_REQUESTS, "api" => api.as_str(), "field" => field).increment(1);
}

/// The scope label of a rejection reason.
fn reason_scope(reason: Reason) -> &'static str {
    match reason {
        Reason::GlobalCeiling => Scope::Global.as_str(),
        Reason::RouteLimit => Scope::Route.as_str(),
        Reason::TenantLimit | Reason::UnknownTenant => Scope::Tenant.as_str(),
        Reason::TenantRouteLimit => Scope::TenantRoute.as_str(),
        Reason::KeyLimit => Scope::Key.as_str(),
        Reason::EmergencyCeiling | Reason::LimiterUnavailable => "none",
        // Of a divided level of any scope: `limiter_share_rejections_total` says which.
        Reason::ShareLimit => "share",
    }
}

const OUTCOMES: usize = 1 + 2 * Reason::ALL.len();
const APIS: usize = 4;

/// Decision counters of one policy, created on first use, so that the hot path does
/// one map lookup and one atomic add instead of building labels per request.
#[derive(Debug)]
pub struct DecisionCounters {
    routes: limiter_core::policy::Map<usize>,
    names: Vec<Box<str>>,
    counters: Vec<OnceLock<Counter>>,
}

impl DecisionCounters {
    /// Counters for the routes `policy` names (others count as `other`).
    pub fn new(policy: &limiter_core::policy::Policy) -> Self {
        let mut names: Vec<Box<str>> = policy.routes.keys().cloned().collect();
        names.sort_unstable();
        let routes = names.iter().enumerate().map(|(i, n)| (n.clone(), i)).collect();
        names.push("other".into());
        let counters = (0..APIS * names.len() * OUTCOMES).map(|_| OnceLock::new()).collect();
        Self { routes, names, counters }
    }

    /// The route label of `route`.
    pub fn route_label(&self, route: &str) -> &str {
        &self.names[self.route_index(route)]
    }

    fn route_index(&self, route: &str) -> usize {
        self.routes.get(route).copied().unwrap_or(self.names.len() - 1)
    }

    /// Counts one decision.
    pub fn record(&self, api: Api, route: &str, verdict: &Verdict) {
        let r = self.route_index(route);
        let outcome = match verdict.decision.reason() {
            None => 0,
            Some(reason) => {
                let i = Reason::ALL.iter().position(|x| *x == reason).unwrap_or(0);
                1 + 2 * i + usize::from(verdict.shadow)
            }
        };
        let a = api as usize;
        let slot = &self.counters[(a * self.names.len() + r) * OUTCOMES + outcome];
        slot.get_or_init(|| {
            let (decision, reason, scope) = match verdict.decision.reason() {
                None => ("allowed", "none", "none"),
                Some(reason) => (
                    if verdict.shadow { "shadow_rejected" } else { "rejected" },
                    reason.as_str(),
                    reason_scope(reason),
                ),
            };
            metrics::counter!(
                DECISIONS,
                "api" => api.as_str(),
                "route" => self.names[r].to_string(),
                "decision" => decision,
                "reason" => reason,
                "scope" => scope,
            )
        })
        .increment(1);
    }
}
