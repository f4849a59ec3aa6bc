//! The token owner: resolves requests against the active policy, decides them on the
//! store, counts them, and settles costs reported after the fact; the lease book and
//! grants ([`lease`]), the active policy and its reload ([`reload`]), and the heavy
//! hitters ([`heavy`]).

mod decide;
pub use decide::{Extra, LevelUsage, Usage};
pub mod heavy;
pub mod lease;
mod permits;
pub use permits::check_policy as check_concurrency;
pub mod reload;
mod shares;
pub use shares::check_policy as check_shares;
mod tickets;
mod turns;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use limiter_core::clock::{Clock, NANOS_PER_SEC, Nanos};
use limiter_core::failure::EmergencyCeilings;
use limiter_core::policy::Chain;
use limiter_core::{Decision, Verdict};
use limiter_proto::limiter::v1 as pb;
use metrics::Histogram;
use parking_lot::Mutex;

use crate::cluster::Cluster;
use crate::cluster::slices::Remote;
use crate::config::Limits;
use crate::convert;
use crate::metrics::{self as m, Api};
use crate::owner::heavy::HeavyHitters;
use crate::owner::lease::Leases;
use crate::owner::reload::PolicyHolder;
use crate::store::{Charged, Store};

use self::permits::Permits;
use self::shares::ShareGates;
use self::tickets::Tickets;
use self::turns::Turns;

/// A route counts as in fallback this long after its last failure-policy decision.
pub const FALLBACK_WINDOW: Nanos = 5 * NANOS_PER_SEC;

/// How long a check-now-charge-later ticket may be settled with a refund.
pub const TICKET_TTL: Nanos = 3_600 * NANOS_PER_SEC;

/// One decided request, with what the edges need to answer.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// The decision and shadow flag.
    pub verdict: Verdict,
    /// Units charged (0 for a rejection or dry run).
    pub charged: u64,
    /// The name of the binding level's limit, if any level applies.
    pub limit_name: Option<Arc<str>>,
    /// The policy version that decided.
    pub policy_version: u64,
    /// When and for how long the store charged it (what a refund names).
    pub charged_at: Charged,
    /// A ticket to report the actual cost with, when asked for.
    pub ticket: Option<String>,
    /// The permit an admission on a chain with a concurrency level holds, and when it
    /// is reclaimed unless renewed.
    pub permit: Option<(String, Nanos)>,
    /// The class whose share refused the request (`SHARE_LIMIT`).
    pub share_class: Option<Arc<str>>,
    /// A refusal by a concurrency level of a caller that waits in line: its turn (0:
    /// the line was full, no turn given).
    pub turn: Option<u64>,
}

impl Outcome {
    /// A refusal decided before the store was asked (nothing charged).
    pub fn refused(
        verdict: Verdict,
        limit_name: Arc<str>,
        policy_version: u64,
        now: Nanos,
    ) -> Self {
        Self {
            verdict,
            charged: 0,
            limit_name: Some(limit_name),
            policy_version,
            charged_at: Charged { at: now, hold: 0 },
            ticket: None,
            permit: None,
            share_class: None,
            turn: None,
        }
    }

    /// The wire response of this decision.
    pub fn response(&self) -> pb::ShouldAllowResponse {
        let o = self;
        let mut r = pb::ShouldAllowResponse {
            allowed: o.verdict.admitted(),
            policy_version: o.policy_version,
            shadow: o.verdict.shadow,
            cost: o.charged,
            ticket: o.ticket.clone().unwrap_or_default(),
            permit: o.permit.as_ref().map(|(id, expires_at)| pb::Permit {
                id: id.clone(),
                expires_in: Some(convert::duration(expires_at.saturating_sub(o.charged_at.at))),
                units: o.charged,
            }),
            share_class: o.share_class.as_deref().unwrap_or_default().to_owned(),
            turn: o.turn.unwrap_or_default(),
            ..Default::default()
        };
        let name = o.limit_name.as_deref();
        match o.verdict.decision {
            Decision::Allowed { remaining, reset_after, binding } => {
                r.remaining = remaining;
                r.reset_after = Some(convert::duration(reset_after));
                if let Some(b) = binding {
                    r.scope = convert::scope(b.scope).into();
                    r.limit = Some(convert::limit(&b.limit, name, o.charged_at.at));
                }
            }
            Decision::Rejected { reason: why, scope: s, limit: l, retry_after } => {
                r.reason = convert::reason(why).into();
                r.scope = convert::scope(s).into();
                r.limit = l.as_ref().map(|l| convert::limit(l, name, o.charged_at.at));
                r.retry_after = Some(convert::duration(retry_after));
                r.reset_after = Some(convert::duration(retry_after));
            }
        }
        r
    }
}

/// How the requests of one call are charged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Charge {
    /// Each on its own.
    Each,
    /// All of them or none (one HTTP request's descriptors).
    AllOrNothing,
}

/// When admitted requests' costs are known: now, or later (each charged request
/// then gets a ticket to report its actual cost with).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// The cost asked for is the cost.
    Now,
    /// Check now, charge later: a ticket for each charged request.
    Later,
}

/// Whether the requests' owner could be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reach {
    /// This node owns them, or forwarding is not needed.
    Owner,
    /// No owner answered: each route's failure policy decides.
    Unreachable,
}

impl Reach {
    /// `Unreachable` when `unreachable`.
    pub fn of(unreachable: bool) -> Self {
        if unreachable { Self::Unreachable } else { Self::Owner }
    }
}

/// What a cost report did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Settlement {
    /// Units charged beyond the estimate.
    pub charged: u64,
    /// Units given back.
    pub refunded: u64,
    /// Units left at the tightest level afterwards.
    pub remaining: u64,
}

/// What a permit's release did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// Its permits were held and are back now; false: it was no longer held
    /// (released already, expired, or forgotten) and nothing changed.
    pub released: bool,
    /// Permits it held.
    pub units: u64,
}

/// The server's decision logic, shared by its gRPC services and admin port.
pub struct Owner {
    policies: Arc<PolicyHolder>,
    store: Store,
    clock: Arc<dyn Clock>,
    limits: Limits,
    tickets: Tickets,
    permits: Permits,
    turns: Turns,
    shares: ShareGates,
    ready: AtomicBool,
    latency: [Histogram; 4],
    leases: Leases,
    heavy: HeavyHitters,
    ceilings: EmergencyCeilings,
    /// Routes (as metric labels: the policy's, or `other`) last decided by their failure
    /// policy, and when.
    fallback: Mutex<HashMap<Box<str>, Nanos>>,
    /// The other nodes, when there are any.
    cluster: Option<Arc<Cluster>>,
}

impl std::fmt::Debug for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Owner").field("store", &self.store).finish_non_exhaustive()
    }
}

impl Owner {
    /// An owner on the memory store, for the upper layers' unit tests.
    #[cfg(test)]
    pub(crate) fn in_memory(
        policies: Arc<PolicyHolder>,
        clock: Arc<dyn Clock>,
        limits: Limits,
    ) -> Self {
        Self::new(policies, Store::memory(10_000, 1_000, false), clock, limits)
    }

    /// An owner over a loaded policy and a store.
    pub fn new(
        policies: Arc<PolicyHolder>,
        store: Store,
        clock: Arc<dyn Clock>,
        limits: Limits,
    ) -> Self {
        m::handle();
        Self {
            policies,
            store,
            clock,
            limits,
            tickets: Tickets {
                key: std::hash::RandomState::new(),
                open: Mutex::default(),
                max: limits.max_open_tickets,
            },
            permits: Permits::new(limits.max_held_permits),
            turns: Turns::default(),
            shares: ShareGates::default(),
            ready: AtomicBool::new(false),
            latency: [Api::Native, Api::Envoy, Api::Lease, Api::Permits]
                .map(|a| metrics::histogram!(m::DECISION_SECONDS, "api" => a.as_str())),
            leases: Leases::default(),
            heavy: HeavyHitters::default(),
            ceilings: EmergencyCeilings::default(),
            fallback: Mutex::default(),
            cluster: None,
        }
    }

    /// With the status page's heavy hitters keeping keys as `display` says.
    #[must_use]
    pub fn with_key_display(mut self, display: crate::owner::heavy::KeyDisplay) -> Self {
        self.heavy = HeavyHitters::default().with_keys(display);
        self
    }

    /// With a cluster of nodes sharing the tenants.
    #[must_use]
    pub fn with_cluster(mut self, cluster: Arc<Cluster>) -> Self {
        self.cluster = Some(cluster);
        self
    }

    /// The cluster, when this node shares tenants with others.
    pub fn cluster(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref()
    }

    /// The part of `chain` this node's store decides, and the root levels other
    /// nodes own (taken from this node's slices of them).
    pub fn split<'a>(&self, chain: &Chain<'a>) -> (Chain<'a>, Remote) {
        match self.shared() {
            None => (*chain, Remote::default()),
            Some(c) => c.split(chain),
        }
    }

    /// The cluster when this node shares its tenants with others (`None`: alone, and
    /// nothing to route, gate or take from slices).
    pub(crate) fn shared(&self) -> Option<&Arc<Cluster>> {
        self.cluster.as_ref().filter(|c| !c.is_single())
    }

    /// The active policy and its reload state.
    pub fn policies(&self) -> &Arc<PolicyHolder> {
        &self.policies
    }

    /// The store.
    pub fn store(&self) -> &Store {
        &self.store
    }

    /// The heavy hitters (top tenants and keys).
    pub fn heavy(&self) -> &HeavyHitters {
        &self.heavy
    }

    /// The lease book.
    pub fn leases(&self) -> &Leases {
        &self.leases
    }

    /// The clock decisions are made on.
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    /// Caller bounds.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Whether the server takes traffic (policy loaded, not draining).
    pub fn is_ready(&self) -> bool {
        // Relaxed: a flag read on its own; nothing else is published through it.
        self.ready.load(Ordering::Relaxed)
            && self.cluster.as_ref().is_none_or(|c| c.joined() && !c.draining())
    }

    /// Marks the server ready or not (draining).
    pub fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Relaxed);
        metrics::gauge!(m::READY).set(if ready { 1.0 } else { 0.0 });
    }

    /// Drops idle counters and expired permits, and publishes store gauges.
    #[allow(clippy::cast_precision_loss)] // gauge values
    pub fn sweep(&self) {
        self.leases.expire(self.clock.now());
        let dropped = self.store.sweep(self.clock.now());
        tracing::trace!(dropped, "swept idle counters");
        self.permits.sweep(self.clock.now());
        self.shares.sweep(&self.policies.current().policy, self.clock.now());
        let (held, _) = self.permits.live(self.clock.now());
        metrics::gauge!(m::PERMITS_HELD).set(held as f64);
        self.sweep_stats();
    }

    /// Publishes how many routes decided by their failure policy in the last
    /// [`FALLBACK_WINDOW`].
    #[allow(clippy::cast_precision_loss)] // gauge values
    pub fn publish_fallback(&self, now: Nanos) {
        let mut routes = self.fallback.lock();
        routes.retain(|_, at| now.saturating_sub(*at) < FALLBACK_WINDOW);
        metrics::gauge!(m::FALLBACK_ROUTES).set(routes.len() as f64);
    }

    /// Publishes the store's gauges and eviction counters.
    #[allow(clippy::cast_precision_loss)] // gauge values
    pub fn sweep_stats(&self) {
        let s = self.store.stats();
        metrics::gauge!(m::STORE_KEYS).set(s.keys as f64);
        metrics::gauge!(m::STORE_MAX_KEYS).set(self.store.max_keys() as f64);
        metrics::counter!(m::STORE_EVICTIONS, "kind" => "idle").absolute(s.evicted_idle);
        metrics::counter!(m::STORE_EVICTIONS, "kind" => "live").absolute(s.evicted_live);
        // A live counter evicted begins afresh on its next decision.
        metrics::counter!(m::STATE_RESETS, "reason" => "evicted").absolute(s.evicted_live);
    }
}

impl crate::cluster::LocalState for Owner {
    fn counters(&self) -> Option<&limiter_core::Limiter> {
        self.store.limiter()
    }

    fn leases(&self) -> &dyn crate::cluster::LeaseBook {
        &self.leases
    }

    fn with_policy(&self, f: &mut dyn FnMut(&limiter_core::policy::Policy)) {
        f(&self.policies.current().policy);
    }
}
