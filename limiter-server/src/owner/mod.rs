//! The token owner: resolves requests against the active policy, decides them on the
//! store, counts them, and settles costs reported after the fact; the lease book and
//! grants ([`lease`]), the active policy and its reload ([`reload`]), and the heavy
//! hitters ([`heavy`]).

pub mod heavy;
pub mod lease;
pub mod reload;
mod tickets;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use limiter_core::clock::{Clock, NANOS_PER_SEC, Nanos};
use limiter_core::failure::EmergencyCeilings;
use limiter_core::policy::{Chain, Request};
use limiter_core::{Decision, Verdict};
use limiter_proto::limiter::v1 as pb;
use metrics::Histogram;
use parking_lot::Mutex;

use crate::cluster::Cluster;
use crate::cluster::slices::{Remote, SliceKey, Take};
use crate::config::Limits;
use crate::convert;
use crate::error::ServerError;
use crate::metrics::{self as m, Api};
use crate::owner::heavy::HeavyHitters;
use crate::owner::lease::Leases;
use crate::owner::reload::PolicyHolder;
use crate::store::{Charged, Store};

use self::tickets::Tickets;

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
            ..Default::default()
        };
        let name = o.limit_name.as_deref();
        match o.verdict.decision {
            Decision::Allowed { remaining, reset_after, binding } => {
                r.remaining = remaining;
                r.reset_after = Some(convert::duration(reset_after));
                if let Some(b) = binding {
                    r.scope = convert::scope(b.scope).into();
                    r.limit = Some(convert::limit(&b.limit, name));
                }
            }
            Decision::Rejected { reason: why, scope: s, limit: l, retry_after } => {
                r.reason = convert::reason(why).into();
                r.scope = convert::scope(s).into();
                r.limit = l.as_ref().map(|l| convert::limit(l, name));
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

/// The server's decision logic, shared by its gRPC services and admin port.
pub struct Owner {
    policies: Arc<PolicyHolder>,
    store: Store,
    clock: Arc<dyn Clock>,
    limits: Limits,
    tickets: Tickets,
    ready: AtomicBool,
    latency: [Histogram; 3],
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
            ready: AtomicBool::new(false),
            latency: [Api::Native, Api::Envoy, Api::Lease]
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

    /// Decides one request on the store, with root levels owned elsewhere taken from
    /// this node's slices of them.
    async fn decide_one(
        &self,
        req: &Request<'_>,
        chain: &Chain<'_>,
        now: Nanos,
    ) -> Result<(Verdict, Charged), ServerError> {
        let Some(cluster) = self.shared() else { return self.store.decide(req, chain, now).await };
        let _held = cluster.hold(req.tenant).await?;
        let (local, remote) = cluster.split(chain);
        if remote.is_empty() {
            return self.store.decide(req, chain, now).await;
        }
        if let Some(v) = limiter_core::hierarchy::without_counters(chain) {
            return Ok((v, Charged { at: now, hold: 0 }));
        }
        let keys = &remote.keys;
        let cost = if chain.dry_run { 0 } else { chain.cost };
        let lost = || ServerError::Unavailable("a slice is not one of the chain's levels".into());
        let refuse = |key: &SliceKey, wait: Nanos| {
            let level = chain
                .levels()
                .find(|l| l.scope == key.0 && *l.key.route == *key.1)
                .ok_or_else(lost)?;
            let decision = Decision::Rejected {
                reason: level.scope.reason(),
                scope: level.scope,
                limit: Some(*level.rule.limit),
                retry_after: wait,
            };
            Ok((Verdict { decision, shadow: chain.shadow }, Charged { at: now, hold: 0 }))
        };
        let Some(mut last) = keys.first().cloned() else {
            return self.store.decide(req, chain, now).await;
        };
        for _ in 0..3 {
            let now = self.clock.now();
            match cluster.slices().take(keys, cost, now) {
                Take::Taken => {
                    let (v, at) = self.store.decide(req, &local, now).await?;
                    if !v.decision.is_allowed() && cost > 0 {
                        cluster.slices().give_back(keys, cost, now);
                    }
                    return Ok((v, at));
                }
                Take::Short(key) => {
                    let owner = remote.owner(&key).ok_or_else(lost)?;
                    cluster.refill(&key, owner, chain.cost, chain.cost).await?;
                    last = key;
                }
                Take::Denied(key, wait) => return refuse(&key, wait),
            }
        }
        // Other requests took every refill first: the owner has little to spare.
        refuse(&last, 1_000_000)
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

    /// Decides `requests` in order (their owner is this node). See [`Self::decide_with`].
    ///
    /// # Errors
    ///
    /// The first request that can never succeed, by index; or an unreachable store.
    pub async fn decide(
        &self,
        api: Api,
        requests: &[Request<'_>],
        charge: Charge,
        report: Report,
    ) -> Result<Vec<Outcome>, (usize, ServerError)> {
        self.decide_with(api, requests, charge, report, Reach::Owner).await
    }

    /// Checks that every request can be resolved against the active policy.
    ///
    /// # Errors
    ///
    /// The first request that can never succeed, by index.
    pub fn validate<'r>(
        &self,
        requests: impl Iterator<Item = Request<'r>>,
    ) -> Result<(), (usize, ServerError)> {
        let active = self.policies.current();
        for (i, r) in requests.enumerate() {
            active.policy.resolve(&r, &self.limits.names).map_err(|e| (i, e.into()))?;
        }
        Ok(())
    }

    /// Decides `requests` in order. With [`Charge::AllOrNothing`], a rejection refunds
    /// what the requests before it were charged (Envoy's descriptors: one HTTP
    /// request, so either every descriptor is charged or none); [`Report::Later`]
    /// gives admitted requests a ticket to report their actual cost with; with
    /// [`Reach::Unreachable`], the requests' owner could not be reached, and each
    /// route's failure policy decides.
    ///
    /// # Errors
    ///
    /// The first request that can never succeed, by index; or an unreachable store.
    pub async fn decide_with(
        &self,
        api: Api,
        requests: &[Request<'_>],
        charge: Charge,
        report: Report,
        reach: Reach,
    ) -> Result<Vec<Outcome>, (usize, ServerError)> {
        let unreachable = reach == Reach::Unreachable;
        let started = self.clock.now();
        let active = self.policies.current();
        let mut chains: Vec<Chain<'_>> = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            let chain = active.policy.resolve(r, &self.limits.names).map_err(|e| (i, e.into()))?;
            if !unreachable {
                self.store.admits(&chain).map_err(|e| (i, e))?;
            }
            chains.push(chain);
        }
        let mut outcomes = Vec::with_capacity(requests.len());
        for (i, (req, chain)) in requests.iter().zip(&chains).enumerate() {
            let now = self.clock.now();
            let decided = if unreachable {
                Err(ServerError::Unavailable("the tenant's owner is unreachable".into()))
            } else {
                self.decide_one(req, chain, now).await
            };
            let (verdict, fell_back, charged_at) = match decided {
                Ok((v, at)) => (v, false, at),
                // The store is away: the route's failure policy decides.
                Err(e @ (ServerError::Unavailable(_) | ServerError::Store(_))) => {
                    let why = e.to_string();
                    tracing::debug!(route = req.route, %why, "store unavailable: failure policy");
                    let label = active.counters.route_label(req.route);
                    self.fallback.lock().insert(label.into(), now);
                    let cost = if chain.dry_run { 0 } else { chain.cost };
                    let decision = self.ceilings.decide(
                        req.route,
                        chain.route.on_limiter_failure,
                        cost.max(1),
                        now,
                    );
                    (Verdict { decision, shadow: chain.shadow }, true, Charged { at: now, hold: 0 })
                }
                Err(e) => return Err((i, e)),
            };
            // A fallback decision charged nothing in the store (nothing to refund).
            let charged = match verdict.decision {
                Decision::Allowed { .. } if !chain.dry_run && !fell_back => chain.cost,
                _ => 0,
            };
            active.counters.record(api, req.route, &verdict);
            self.heavy.record(req.tenant, req.key, verdict.decision.is_allowed(), charged);
            if !verdict.decision.is_allowed() {
                tracing::debug!(
                    tenant = req.tenant,
                    route = req.route,
                    reason = ?verdict.decision.reason(),
                    shadow = verdict.shadow,
                    "rejected"
                );
            }
            let scope = match verdict.decision {
                Decision::Allowed { binding, .. } => binding.map(|b| b.scope),
                Decision::Rejected { scope, .. } => Some(scope),
            };
            let limit_name = scope
                .and_then(|s| chain.levels().find(|l| l.scope == s))
                .map(|l| l.rule.name.clone());
            let ticket = (report == Report::Later && charged > 0)
                .then(|| self.tickets.issue(req, charged_at, charged));
            outcomes.push(Outcome {
                verdict,
                charged,
                limit_name,
                policy_version: active.version,
                charged_at,
                ticket,
            });
        }
        let rejected = outcomes.iter().any(|o| !o.verdict.admitted());
        if charge == Charge::AllOrNothing && rejected {
            for (o, chain) in outcomes.iter_mut().zip(&chains) {
                if o.charged > 0 {
                    let now = self.clock.now();
                    let (local, slices) = self.split(chain);
                    self.store
                        .refund_grant(&local, now, o.charged_at.at, o.charged_at.hold, o.charged)
                        .await
                        .map_err(|e| (0, e))?;
                    if let Some(c) = &self.cluster {
                        c.slices().give_back(&slices.keys, o.charged, now);
                    }
                    // What is left is what it was: nothing stays charged.
                    if let Decision::Allowed { remaining, .. } = &mut o.verdict.decision {
                        *remaining = remaining.saturating_add(o.charged);
                    }
                    o.charged = 0;
                }
            }
        }
        let per = (self.clock.now().saturating_sub(started)) as f64 / NANOS_PER_SEC as f64;
        self.latency[api as usize].record(per / requests.len().max(1) as f64);
        Ok(outcomes)
    }

    /// Settles a request admitted on an estimate: charges the excess (even past the
    /// limit) or refunds the difference, on every level of its chain.
    ///
    /// # Errors
    ///
    /// An invalid request or ticket; a refund asked for a ticket that is no longer open.
    pub async fn report_cost(
        &self,
        req: &Request<'_>,
        ticket: &str,
        actual: u64,
    ) -> Result<Settlement, ServerError> {
        let t = self.tickets.parse(req, ticket)?;
        let active = self.policies.current();
        // The chain only: the amounts come from the ticket and the report.
        let probe = Request { cost: Some(1), dry_run: true, ..*req };
        let chain = active.policy.resolve(&probe, &self.limits.names)?;
        // Root levels owned elsewhere were paid from slices: settled here only.
        let (chain, _) = self.split(&chain);
        let now = self.clock.now();
        let open = self.tickets.close(&t, now);
        let (charged, refunded) = if actual >= t.estimate {
            let extra = actual - t.estimate;
            self.store.charge(&chain, now, extra).await?;
            (extra, 0)
        } else if open {
            let back = t.estimate - actual;
            self.store.refund_grant(&chain, now, t.admitted_at, t.hold, back).await?;
            (0, back)
        } else {
            return Err(ServerError::invalid(
                "ticket",
                "already settled or expired: refunds need an open ticket",
            ));
        };
        for (direction, units) in [("charge", charged), ("refund", refunded)] {
            if units > 0 {
                metrics::counter!(m::COST_REPORTS, "direction" => direction).increment(1);
                metrics::counter!(m::COST_REPORT_UNITS, "direction" => direction).increment(units);
            }
        }
        let remaining = self.store.remaining(&chain, now).await?;
        Ok(Settlement { charged, refunded, remaining })
    }

    /// Drops idle counters and publishes store gauges.
    pub fn sweep(&self) {
        self.leases.expire(self.clock.now());
        let dropped = self.store.sweep(self.clock.now());
        tracing::trace!(dropped, "swept idle counters");
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
    }
}

impl crate::cluster::LocalState for Owner {
    fn counters(&self) -> Option<&limiter_core::Limiter> {
        self.store.limiter()
    }

    fn leases(&self) -> &dyn crate::cluster::LeaseBook {
        &self.leases
    }
}
