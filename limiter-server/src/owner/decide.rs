//! Decisions on the owner: a batch of requests resolved, placed and decided on the
//! store (with root levels owned elsewhere paid from this node's slices), counted,
//! and the costs reported after the fact settled.

use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::policy::{Chain, Request};
use limiter_core::{Decision, Verdict};

use crate::cluster::slices::{SliceKey, Take};
use crate::error::ServerError;
use crate::metrics::{self as m, Api};
use crate::store::Charged;

use super::permits::{self, Found, Permits};
use super::reload::ActivePolicy;
use super::{Charge, Outcome, Owner, Reach, Released, Report, Settlement};

impl Owner {
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
        let refuse = |key: &SliceKey, wait: Nanos, by_share: bool| {
            let level = chain
                .levels()
                .find(|l| l.scope == key.0 && *l.key.route == *key.1)
                .ok_or_else(lost)?;
            let reason = if by_share {
                // The class's slice was refused by its share at the root owner.
                metrics::counter!(
                    m::SHARE_REJECTIONS,
                    "scope" => level.scope.as_str(),
                    "class" => key.2.to_string()
                )
                .increment(1);
                limiter_core::Reason::ShareLimit
            } else {
                level.scope.reason()
            };
            let decision = Decision::Rejected {
                reason,
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
                    cluster.refill(&key, owner, chain.cost, chain.cost, 0).await?;
                    last = key;
                }
                Take::Denied(key, wait, by_share) => return refuse(&key, wait, by_share),
            }
        }
        // Other requests took every refill first: the owner has little to spare.
        refuse(&last, 1_000_000, false)
    }

    /// A refusal of `req` (holding `turn`, 0 for a new waiter) when one of its
    /// chain's concurrency levels has waiters ahead of it and cannot hold its cost on
    /// top of theirs: a dry run of that level alone, with the waiters' units added.
    /// `None`: nobody is ahead, or there is room for all.
    async fn behind_waiters(
        &self,
        req: &Request<'_>,
        chain: &Chain<'_>,
        turn: u64,
        now: Nanos,
    ) -> Result<Option<Verdict>, ServerError> {
        for (scope, ahead) in self.turns.ahead(chain, turn, now) {
            let mut probe =
                chain.retain_levels(|l| l.scope == scope && l.rule.limit.is_concurrency());
            probe.cost = chain.cost.saturating_add(ahead);
            probe.dry_run = true;
            let (v, _) = self.decide_one(req, &probe, now).await?;
            if !v.decision.is_allowed() {
                metrics::counter!(m::PERMITS, "event" => "held_for_waiters").increment(1);
                return Ok(Some(Verdict { decision: v.decision, shadow: chain.shadow }));
            }
        }
        Ok(None)
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
        self.decide_all(api, requests, Brought::default(), charge, report, reach).await
    }

    /// Like [`Self::decide_with`], request `i` holding its place `turns[i]` in the
    /// lines of its chain's concurrency levels (see [`super::turns`]): `None` waits in
    /// no line; `Some(0)` asks for a turn should a concurrency level refuse it; any
    /// other value is a turn given before. A refusal by a concurrency level answers
    /// with the caller's turn ([`Outcome::turn`]).
    ///
    /// # Errors
    ///
    /// As [`Self::decide_with`].
    pub async fn decide_waiting(
        &self,
        api: Api,
        requests: &[Request<'_>],
        turns: &[Option<u64>],
        charge: Charge,
        report: Report,
        reach: Reach,
    ) -> Result<Vec<Outcome>, (usize, ServerError)> {
        let brought = Brought { extra: &[], turns };
        self.decide_all(api, requests, brought, charge, report, reach).await
    }

    /// Like [`Self::decide_with`], request `i` also checked against `extra[i]`, a
    /// limit it brings with it (Envoy's per-descriptor override), as a level of its
    /// own after the policy's.
    ///
    /// # Errors
    ///
    /// As [`Self::decide_with`].
    pub async fn decide_with_extra(
        &self,
        api: Api,
        requests: &[Request<'_>],
        extra: &[Option<Extra<'_>>],
        charge: Charge,
        report: Report,
        reach: Reach,
    ) -> Result<Vec<Outcome>, (usize, ServerError)> {
        let brought = Brought { extra, turns: &[] };
        self.decide_all(api, requests, brought, charge, report, reach).await
    }

    async fn decide_all(
        &self,
        api: Api,
        requests: &[Request<'_>],
        brought: Brought<'_, '_>,
        charge: Charge,
        report: Report,
        reach: Reach,
    ) -> Result<Vec<Outcome>, (usize, ServerError)> {
        let Brought { extra, turns } = brought;
        let unreachable = reach == Reach::Unreachable;
        let started = self.clock.now();
        let active = self.policies.current();
        let mut chains: Vec<Chain<'_>> = Vec::with_capacity(requests.len());
        for (i, r) in requests.iter().enumerate() {
            let mut chain =
                active.policy.resolve(r, &self.limits.names).map_err(|e| (i, e.into()))?;
            if let Some(Some(x)) = extra.get(i) {
                chain = chain.with_level(x.scope, x.budget, x.rule).map_err(|e| (i, e.into()))?;
            }
            if api == Api::Permits {
                // A block for an agent's pool: the concurrency levels only (the
                // agent's leases pay the others).
                chain = chain.retain_levels(|l| l.rule.limit.is_concurrency());
                if chain.levels().next().is_none() && !chain.unknown_tenant {
                    return Err((
                        i,
                        ServerError::invalid("permit_block", "the chain has no concurrency level"),
                    ));
                }
            }
            if !unreachable {
                self.store.admits(&chain).map_err(|e| (i, e))?;
            }
            if report == Report::Later && permits::first_level(&chain).is_some() {
                return Err((
                    i,
                    ServerError::invalid(
                        "report_later",
                        "the chain has a concurrency level: its permits are released, not \
                         reported; call Release with the permit when the request ends",
                    ),
                ));
            }
            chains.push(chain);
        }
        let mut outcomes = Vec::with_capacity(requests.len());
        // What requests took of divided levels' shares (nothing allocated otherwise).
        let mut shares_taken = Vec::new();
        for (i, (req, chain)) in requests.iter().zip(&chains).enumerate() {
            let now = self.clock.now();
            let mut share_class = None;
            let mut taken = super::shares::Taken::default();
            let envoy_permit = (api == Api::Envoy)
                .then(|| chain.levels().find(|l| l.rule.limit.is_concurrency()))
                .flatten();
            let turn = turns.get(i).copied().flatten();
            // Callers that wait in line are served in turn: such a request is refused
            // while its levels cannot hold it on top of what the waiters ahead of it
            // wait for. One that does not wait in line is decided on what is free.
            let behind = if let Some(t) = turn
                && envoy_permit.is_none()
                && !unreachable
                && !chain.dry_run
                && permits::first_level(chain).is_some()
            {
                self.behind_waiters(req, chain, t, now).await
            } else {
                Ok(None)
            };
            let decided = if let Some(level) = envoy_permit {
                // Envoy cannot release a permit: refused, never a free pass and never
                // a permit held for nobody.
                tracing::debug!(route = req.route, "concurrency level reached through Envoy");
                let decision = Decision::Rejected {
                    reason: level.scope.reason(),
                    scope: level.scope,
                    limit: Some(*level.rule.limit),
                    retry_after: level.rule.limit.quota().1,
                };
                Ok((Verdict { decision, shadow: chain.shadow }, Charged { at: now, hold: 0 }))
            } else if unreachable {
                Err(ServerError::Unavailable("the tenant's owner is unreachable".into()))
            } else if let Some(v) = behind.as_ref().ok().copied().flatten() {
                Ok((v, Charged { at: now, hold: 0 }))
            } else if let Err(e) = behind {
                Err(e)
            } else {
                // The request's class takes its share first; what the store then
                // refuses goes back to it.
                match self.shares.take(super::shares::Who::Req(req), chain, now) {
                    Err(refused) => {
                        let refused = *refused;
                        share_class = Some(refused.class);
                        let verdict = Verdict { decision: refused.decision, shadow: chain.shadow };
                        Ok((verdict, Charged { at: now, hold: 0 }))
                    }
                    Ok(t) => {
                        let decided = self.decide_one(req, chain, now).await;
                        if matches!(&decided, Ok((v, _)) if v.decision.is_allowed()) {
                            taken = t;
                        } else {
                            self.shares.give_back(&t, self.clock.now());
                        }
                        decided
                    }
                }
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
            // A refusal by a divided level's share that this node did not take (a
            // class's slice the root owner refused): the class, named.
            if let (None, Decision::Rejected { reason, scope, .. }) =
                (&share_class, verdict.decision)
                && reason == limiter_core::Reason::ShareLimit
            {
                let (tenant, route, key) = chain.names();
                share_class = chain
                    .levels()
                    .find(|l| l.scope == scope)
                    .and_then(|l| l.rule.shares.as_ref())
                    .map(|s| s.classes()[s.class_of(tenant, route, key)].name.clone());
            }
            // A fallback decision charged nothing in the store (nothing to refund).
            let charged = match verdict.decision {
                Decision::Allowed { .. } if !chain.dry_run && !fell_back => chain.cost,
                _ => 0,
            };
            active.counters.record(api, req.route, &verdict);
            let mut my_turn = None;
            if let Decision::Rejected { scope, limit: Some(l), .. } = verdict.decision
                && l.is_concurrency()
            {
                self.permits.refused(chain, scope, now);
                if let Some(t) = turn
                    && !fell_back
                {
                    my_turn = Some(self.turns.wait(chain, scope, t, chain.cost, now));
                }
            } else if let Some(t) = turn.filter(|&t| t != 0 && verdict.decision.is_allowed()) {
                self.turns.served(chain, t);
            }
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
            let named = match verdict.decision {
                Decision::Allowed { binding, .. } => binding.map(|b| (b.scope, Some(b.limit))),
                Decision::Rejected { scope, limit, .. } => Some((scope, limit)),
            };
            let limit_name = named
                .and_then(|(s, l)| chain.level_named(s, l.as_ref()))
                .map(|l| l.rule.name.clone());
            let ticket = (report == Report::Later && charged > 0)
                .then(|| self.tickets.issue(req, charged_at, charged));
            let permit = match permits::expiry(chain, charged_at.at) {
                Some(expires_at) if charged > 0 => {
                    Some((self.permits.issue(req, charged_at.at, charged, expires_at), expires_at))
                }
                _ => None,
            };
            outcomes.push(Outcome {
                verdict,
                charged,
                limit_name,
                policy_version: active.version,
                charged_at,
                ticket,
                permit,
                share_class,
                turn: my_turn,
            });
            if !taken.is_empty() {
                shares_taken.push(taken);
            }
        }
        let rejected = outcomes.iter().any(|o| !o.verdict.admitted());
        if charge == Charge::AllOrNothing && rejected {
            for taken in &shares_taken {
                self.shares.give_back(taken, self.clock.now());
            }
            for ((o, chain), req) in outcomes.iter_mut().zip(&chains).zip(requests) {
                if let Some((text, _)) = o.permit.take()
                    && let Ok(id) = Permits::parse(&text)
                {
                    // Refunded below with the rest of its charge: no longer named.
                    let _ = self.permits.take(req, id, self.clock.now());
                }
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

    /// Returns a permit's units to the concurrency levels of `req`'s chain. A permit
    /// no longer held (released already, expired, forgotten) changes nothing.
    ///
    /// # Errors
    ///
    /// Malformed names or permit, a permit of another tenant, route or key, or the
    /// store unreachable (the permit is then still held: its units come back at
    /// expiry).
    pub async fn release(&self, req: &Request<'_>, permit: &str) -> Result<Released, ServerError> {
        let id = Permits::parse(permit)?;
        let active = self.policies.current();
        let chain = self.permit_chain(&active, req)?;
        let now = self.clock.now();
        let Found::Open(p) = self.permits.take(req, id, now)? else {
            metrics::counter!(m::PERMITS, "event" => "late_release").increment(1);
            return Ok(Released { released: false, units: 0 });
        };
        if let Err(e) = self.store.refund(&chain, now, p.charged_at, p.units).await {
            // Not refunded: named again, so that a retry can still release it.
            let expires_at = permits::expiry(&chain, p.charged_at).unwrap_or(now);
            self.permits.reopen(req, p, p.charged_at, expires_at);
            return Err(e);
        }
        metrics::counter!(m::PERMITS, "event" => "released").increment(1);
        Ok(Released { released: true, units: p.units })
    }

    /// Takes the caller holding `turn` out of the lines of `req`'s concurrency levels
    /// (it waits no longer). A turn that is in no line changes nothing.
    ///
    /// # Errors
    ///
    /// Malformed names, or a chain without a concurrency level.
    pub fn leave_line(&self, req: &Request<'_>, turn: u64) -> Result<(), ServerError> {
        let active = self.policies.current();
        let chain = self.permit_chain(&active, req)?;
        self.turns.served(&chain, turn);
        Ok(())
    }

    /// Extends a held permit by its levels' TTL from now, and returns when it is
    /// reclaimed unless renewed again, and whether one of its levels refused a
    /// request lately (a block's holder then gives back what others wait for).
    ///
    /// # Errors
    ///
    /// As [`Self::release`], and a permit no longer held (`permit`: it expired or was
    /// released; its holder must acquire anew).
    pub async fn renew(
        &self,
        req: &Request<'_>,
        permit: &str,
    ) -> Result<(Nanos, bool), ServerError> {
        let id = Permits::parse(permit)?;
        let active = self.policies.current();
        let chain = self.permit_chain(&active, req)?;
        let now = self.clock.now();
        let Found::Open(p) = self.permits.take(req, id, now)? else {
            metrics::counter!(m::PERMITS, "event" => "late_renewal").increment(1);
            return Err(ServerError::invalid(
                "permit",
                "no longer held (expired, released or forgotten): acquire a new one",
            ));
        };
        match self.store.move_permits(&chain, now, p.charged_at, p.units).await {
            Ok(at) => {
                let expires_at = permits::expiry(&chain, at).unwrap_or(at);
                self.permits.reopen(req, p, at, expires_at);
                metrics::counter!(m::PERMITS, "event" => "renewed").increment(1);
                Ok((expires_at.saturating_sub(now), self.permits.contended(&chain, now)))
            }
            Err(e) => {
                let old = permits::expiry(&chain, p.charged_at).unwrap_or(now);
                self.permits.reopen(req, p, p.charged_at, old);
                Err(e)
            }
        }
    }

    /// The concurrency levels of `req`'s chain, as this node's store holds them.
    fn permit_chain<'a>(
        &self,
        active: &'a ActivePolicy,
        req: &Request<'a>,
    ) -> Result<Chain<'a>, ServerError> {
        let probe = Request { cost: Some(1), dry_run: true, ..*req };
        let chain = active.policy.resolve(&probe, &self.limits.names)?;
        let (chain, _) = self.split(&chain);
        let chain = permits::concurrency_levels(&chain);
        if chain.is_empty() {
            return Err(ServerError::invalid(
                "route",
                "this tenant, route and key have no concurrency level: nothing holds permits",
            ));
        }
        Ok(chain)
    }

    /// Every level that applies to `req`'s tenant, route and key, outermost first,
    /// with what is left and when it resets, and the open cost tickets: nothing
    /// charged, no counter created. A root level owned by another node is reported as
    /// this node's slice of it (`shared`).
    ///
    /// # Errors
    ///
    /// Malformed names, or the store unreachable.
    pub async fn usage(&self, req: &Request<'_>) -> Result<Usage, ServerError> {
        let active = self.policies.current();
        let probe = Request { cost: Some(1), dry_run: true, ..*req };
        let chain = active.policy.resolve(&probe, &self.limits.names)?;
        let now = self.clock.now();
        let (local, remote) = self.split(&chain);
        let mut views = self.store.inspect(&local, now).await?.into_iter();
        let slices = self.shared().map(|c| c.slices());
        let mut levels = Vec::with_capacity(chain.len());
        for level in chain.levels() {
            let shared = remote.holds(&level);
            let (remaining, reset_after) = match (shared, slices) {
                (true, Some(slices)) => {
                    // The request's class's slice, for a divided level.
                    let key = remote
                        .keys
                        .iter()
                        .find(|k| k.0 == level.scope && *k.1 == *level.key.route)
                        .cloned()
                        .unwrap_or_else(|| (level.scope, level.key.route.into(), "".into()));
                    let (units, until) = slices.available(&key, now);
                    (units, until - now)
                }
                _ => views.next().ok_or_else(|| {
                    ServerError::Unavailable("the store answered fewer levels".into())
                })?,
            };
            levels.push(LevelUsage {
                scope: level.scope,
                name: level.rule.name.clone(),
                limit: *level.rule.limit,
                remaining,
                reset_after,
                shared,
            });
        }
        let (open_tickets, open_ticket_units) = self.tickets.open_for(req, now);
        let (held_permits, held_permit_units) = self.permits.live_for(req, now);
        Ok(Usage {
            levels,
            open_tickets,
            open_ticket_units,
            held_permits,
            held_permit_units,
            policy_version: active.version,
            unknown_tenant: chain.unknown_tenant,
            now,
        })
    }
}

/// One level of a [`Usage`].
#[derive(Debug, Clone)]
pub struct LevelUsage {
    /// The level.
    pub scope: limiter_core::Scope,
    /// Its limit's name.
    pub name: std::sync::Arc<str>,
    /// Its limit.
    pub limit: limiter_core::Limit,
    /// Units that would be admitted now.
    pub remaining: u64,
    /// Until the level is full again.
    pub reset_after: Nanos,
    /// A root level owned elsewhere: the values are this node's slice of it.
    pub shared: bool,
}

/// What [`Owner::usage`] reports.
#[derive(Debug, Clone)]
pub struct Usage {
    /// Every level, outermost first.
    pub levels: Vec<LevelUsage>,
    /// Open cost tickets of the tenant, route and key.
    pub open_tickets: u64,
    /// Their estimated units.
    pub open_ticket_units: u64,
    /// Permits of concurrency levels held by the tenant, route and key.
    pub held_permits: u64,
    /// Their units.
    pub held_permit_units: u64,
    /// The policy version that resolved the chain.
    pub policy_version: u64,
    /// The tenant is unlisted and such tenants are rejected.
    pub unknown_tenant: bool,
    /// When the levels were read (nanoseconds since the Unix epoch).
    pub now: Nanos,
}

/// What requests bring besides themselves, by index (missing: nothing).
#[derive(Debug, Default, Clone, Copy)]
struct Brought<'x, 'r> {
    /// A limit of its own (Envoy's per-descriptor override).
    extra: &'x [Option<Extra<'r>>],
    /// Its place in the lines of concurrency levels.
    turns: &'x [Option<u64>],
}

/// A limit a request brings with it, checked as a level of its own.
#[derive(Debug, Clone, Copy)]
pub struct Extra<'a> {
    /// The level's scope.
    pub scope: limiter_core::Scope,
    /// Its budget index (kept apart from the policy's).
    pub budget: u8,
    /// The limit.
    pub rule: &'a limiter_core::policy::LimitRule,
}
