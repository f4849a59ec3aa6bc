//! The lease protocol on the owner: agents acquire, renew and return pre-paid batches
//! of units, batched across keys in one call per (agent, owner).
//!
//! - A grant is debited from every level of its chain when made, so leased units can
//!   never be spent twice; the owner's book ([`LeaseBook`]) decides what may come back.
//! - A grant may be spent for `hold` (the route's lease TTL, cut to the end of any
//!   window level's window), counted by the agent from when it sent its request, so
//!   the agent always stops first; the owner writes the lease off at `granted + hold`.
//! - Renewal is return-and-replace: the agent hands back what it did not spend (refunded
//!   exactly while the lease is open) and receives a fresh grant.
//! - Size: what the agent wants (about two renewal intervals of its demand), at least
//!   the waiting request's cost, at most the route's `max_batch`, at most what its
//!   demand can spend before the grant ends (a window's end), and at most half of what
//!   is left (near the limit, below a fifth of capacity: half of it shared among the
//!   active agents), so no more than half the remaining budget can be stranded.
//! - Direct mode: when what is left is less than one request's cost for each active
//!   agent (or the route asks for exact mode), the owner grants nothing to hold and
//!   decides each waiting request itself.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

use limiter_core::algorithm::Algorithm;
use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::lease::{LeaseBook, LeaseRecord, Settled};
use limiter_core::policy::{FailurePolicy, Request};
use limiter_proto::limiter::v1 as pb;
use parking_lot::Mutex;

use crate::cluster::slices::Remote;
use crate::convert;
use crate::error::ServerError;
use crate::metrics::{self as m, Api};
use crate::owner::{Charge, Outcome, Owner, Reach, Report};

/// A chain's identity in the book: tenant, route, key.
type ChainKey = (Box<str>, Box<str>, Option<Box<str>>);

/// Agents count as active this long after their last call.
const ACTIVE_FOR: Nanos = 2 * NANOS_PER_SEC;

/// The owner's lease state.
#[derive(Debug)]
pub struct Leases {
    book: Mutex<LeaseBook<ChainKey>>,
    agents: Mutex<HashMap<u64, Nanos>>,
}

impl Default for Leases {
    fn default() -> Self {
        // Ids start at a random point, so leases that move between nodes keep ids
        // no other node has issued.
        let first = std::hash::RandomState::new().hash_one(0u64) >> 2;
        Self { book: Mutex::new(LeaseBook::starting_at(first)), agents: Mutex::default() }
    }
}

/// A stable 64-bit id for an agent's name.
fn holder(agent: &str) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(agent)
}

fn failure_policy(p: FailurePolicy) -> pb::FailurePolicy {
    match p {
        FailurePolicy::FailOpen { emergency_ceiling } => pb::FailurePolicy {
            fail_open: true,
            emergency_amount: emergency_ceiling.amount().get(),
            emergency_period: Some(convert::duration(emergency_ceiling.period().get())),
        },
        FailurePolicy::FailClosed => pb::FailurePolicy::default(),
    }
}

impl Leases {
    /// Writes off leases that reached their end; publishes the book's totals.
    #[allow(clippy::cast_precision_loss)] // gauge values
    pub fn expire(&self, now: Nanos) {
        let mut book = self.book.lock();
        let gone = book.expire(now);
        let t = book.totals();
        drop(book);
        if !gone.is_empty() {
            tracing::debug!(leases = gone.len(), "leases written off at their end");
        }
        metrics::gauge!(m::LEASES_OUTSTANDING).set(t.outstanding as f64);
        metrics::gauge!(m::LEASES_OPEN).set(t.open as f64);
        metrics::counter!(m::LEASE_UNITS, "fate" => "granted").absolute(t.granted);
        metrics::counter!(m::LEASE_UNITS, "fate" => "returned").absolute(t.returned);
        metrics::counter!(m::LEASE_UNITS, "fate" => "spent").absolute(t.spent);
        metrics::counter!(m::LEASE_UNITS, "fate" => "written_off").absolute(t.written_off);
    }

    /// The book's totals.
    pub fn totals(&self) -> limiter_core::lease::LeaseTotals {
        self.book.lock().totals()
    }

    /// Removes the open leases whose ring name (tenant, or a root key's name)
    /// `moving` accepts, as handoff messages with that name.
    pub fn take_moving(&self, moving: impl Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        self.book
            .lock()
            .take_where(|k| moving(&k.0))
            .into_iter()
            .map(|(id, r)| pb::LeaseState {
                id,
                holder: r.holder,
                tenant: r.key.0.to_string(),
                route: r.key.1.to_string(),
                key: r.key.2.map(|k| k.to_string()),
                units: r.units,
                granted_at: r.granted_at,
                hold: r.hold,
            })
            .collect()
    }

    /// Takes over leases another node granted; returns how many.
    pub fn adopt(&self, leases: &[pb::LeaseState]) -> u64 {
        let mut book = self.book.lock();
        let mut n = 0;
        for l in leases {
            let key = (
                l.tenant.as_str().into(),
                l.route.as_str().into(),
                l.key.as_deref().map(Into::into),
            );
            let record = LeaseRecord {
                holder: l.holder,
                key,
                units: l.units,
                granted_at: l.granted_at,
                hold: l.hold,
            };
            n += u64::from(book.adopt(l.id, record));
        }
        n
    }

    fn active_agents(&self, agent: u64, now: Nanos) -> u64 {
        let mut agents = self.agents.lock();
        agents.insert(agent, now);
        if agents.len() > 1_024 {
            agents.retain(|_, seen| now.saturating_sub(*seen) < ACTIVE_FOR);
        }
        agents.values().filter(|seen| now.saturating_sub(**seen) < ACTIVE_FOR).count() as u64
    }
}

impl Owner {
    /// The answer for a lease item's waiting request when its owner cannot decide it
    /// (out of reach, or fenced after a loss): its route's failure policy.
    ///
    /// # Errors
    ///
    /// A request that can never succeed (names, costs).
    pub async fn fallback_decision(
        &self,
        req: &Request<'_>,
    ) -> Result<Option<pb::ShouldAllowResponse>, ServerError> {
        let o = self
            .decide_with(
                Api::Lease,
                std::slice::from_ref(req),
                Charge::Each,
                Report::Now,
                Reach::Unreachable,
            )
            .await
            .map_err(|(_, e)| e)?;
        Ok(o.first().map(Outcome::response))
    }

    /// Handles one lease call: every item settles its previous lease (if any) and
    /// receives a new grant, a direct decision, or the reason it got nothing.
    ///
    /// # Errors
    ///
    /// An item that can never succeed (names, costs), by index.
    pub async fn lease(
        &self,
        agent: &str,
        items: &[pb::LeaseItem],
    ) -> Result<Vec<pb::LeaseGrant>, (usize, ServerError)> {
        if agent.is_empty() {
            return Err((0, ServerError::invalid("agent_id", "must not be empty")));
        }
        let holder = holder(agent);
        let leases = self.leases();
        let now = self.clock().now();
        let active = leases.active_agents(holder, now);
        let active_policy = self.policies().current();
        let mut grants = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let req = Request {
                tenant: &item.tenant,
                route: &item.route,
                key: (!item.key.is_empty()).then_some(item.key.as_str()),
                cost: Some(item.cost.max(1)),
                dry_run: false,
            };
            let full = active_policy
                .policy
                .resolve(&req, &self.limits().names)
                .map_err(|e| (i, e.into()))?;
            // A node leasing a slice of one root level, or an agent leasing a chain
            // whose root levels other nodes own (paid from this node's slices).
            let slice_of = convert::scope_from(item.level);
            let (chain, slices) = match slice_of {
                Some(level) => (full.retain_levels(|l| l.scope == level), Remote::default()),
                None => self.split(&full),
            };
            let now = self.clock().now();
            if item.lease_id != 0 {
                let settled = leases.book.lock().settle(item.lease_id, holder, now, item.unspent);
                if let Settled::Closed { record, refund } = settled {
                    self.store()
                        .refund_grant(&chain, now, record.granted_at, record.hold, refund)
                        .await
                        .map_err(|e| (i, e))?;
                    if let Some(c) = self.shared() {
                        c.slices().returned(item.lease_id, refund, now);
                    }
                }
            }
            let mut grant = pb::LeaseGrant {
                mode: pb::LeaseMode::Leased.into(),
                on_failure: Some(failure_policy(full.route.on_limiter_failure)),
                policy_version: active_policy.version,
                ..Default::default()
            };
            if item.want == 0 && item.cost == 0 {
                grants.push(grant);
                continue;
            }
            // A new key beyond its tenant's cap: nothing granted, the waiting request
            // refused (the agent's other items go on).
            if self.store().admits(&chain).is_err() {
                let refused = limiter_core::Decision::Rejected {
                    reason: limiter_core::Reason::KeyLimit,
                    scope: limiter_core::Scope::Key,
                    limit: None,
                    retry_after: NANOS_PER_SEC,
                };
                grant.decision = Some(self.response(refused, now));
                grants.push(grant);
                continue;
            }
            // The counters must be here: not fenced after their owner's loss (nothing
            // new is granted then), not moving away. Held until the grant is made.
            let name = crate::cluster::lease_name(item);
            let mut held = match self.shared() {
                Some(c) => match c.hold(&name).await {
                    Ok(guard) => guard,
                    Err(_) => {
                        grant.mode = pb::LeaseMode::Direct.into();
                        if slice_of.is_some() {
                            grant.decision = Some(self.refusal(&chain, now, 1_000_000));
                        } else if item.cost > 0 {
                            // The waiting request: its route's failure policy.
                            grant.decision =
                                self.fallback_decision(&req).await.map_err(|e| (i, e))?;
                        }
                        grants.push(grant);
                        continue;
                    }
                },
                None => None,
            };
            let remaining = self.store().remaining(&chain, now).await.map_err(|e| (i, e))?;
            let need = item.cost.max(1);
            let exact = chain.route.lease.exact && slice_of.is_none();
            if exact || (slice_of.is_none() && remaining < need.saturating_mul(active)) {
                grant.mode = pb::LeaseMode::Direct.into();
                // Deciding takes the gate itself.
                drop(held.take());
                if item.cost > 0 {
                    let outcome = self
                        .decide(Api::Lease, std::slice::from_ref(&req), Charge::Each, Report::Now)
                        .await
                        .map_err(|(_, e)| (i, e))?;
                    grant.decision = outcome.first().map(Outcome::response);
                }
                grants.push(grant);
                continue;
            }
            // How long the grant can be spent: the route's TTL (a slice's own TTL),
            // cut by window ends.
            let ttl = match (slice_of, self.cluster()) {
                (Some(_), Some(c)) => {
                    u64::try_from(c.config().slice_ttl.as_nanos()).unwrap_or(u64::MAX)
                }
                _ => chain.route.lease.ttl,
            };
            let mut hold = chain.grant_hold(now, ttl);
            let capacity =
                chain.levels().map(|l| l.rule.limit.capacity()).min().unwrap_or(u64::MAX);
            let most =
                if slice_of.is_some() { u64::MAX } else { chain.route.lease.max_batch.get() };
            let mut size = grant_size(&Ask {
                want: item.want,
                cost: item.cost,
                demand_per_sec: item.demand_per_sec,
                hold,
                remaining,
                capacity,
                active,
                most,
            });
            // Root levels owned elsewhere: the grant comes out of this node's slices
            // and never outlives them.
            let mut from_slices = 0;
            let mut slices_until = Nanos::MAX;
            if let (false, Some(c)) = (slices.is_empty(), self.shared()) {
                match self.take_slices(c, &full, &slices, size, item.cost, &item.tenant).await {
                    Ok((units, until)) => {
                        size = units;
                        from_slices = units;
                        slices_until = until;
                        hold = hold.min(until.saturating_sub(now));
                    }
                    Err(ServerError::Exhausted(_)) => size = 0,
                    Err(e) => return Err((i, e)),
                }
            }
            let g = if size == 0 {
                limiter_core::Grant { units: 0, granted_at: now, hold, binding: None }
            } else {
                self.store().grant(&chain, now, size, hold).await.map_err(|e| (i, e))?
            };
            if let (false, Some(c)) = (slices.is_empty(), self.shared()) {
                c.slices().give_back(&slices.keys, from_slices - g.units.min(from_slices), now);
            }
            if g.units < item.cost || g.units == 0 {
                // Not enough to hold: give back any partial grant and decide the
                // waiting request itself (charged if it fits), as in direct mode.
                self.store()
                    .refund_grant(&chain, now, g.granted_at, g.hold, g.units)
                    .await
                    .map_err(|e| (i, e))?;
                if let (false, Some(c)) = (slices.is_empty(), self.shared()) {
                    c.slices().give_back(&slices.keys, g.units, now);
                }
                if slice_of.is_some() {
                    grant.decision = Some(self.refusal(&chain, now, 0));
                    grants.push(grant);
                    continue;
                }
                drop(held.take());
                let probe = Request { dry_run: item.cost == 0, ..req };
                let outcome = self
                    .decide(Api::Lease, &[probe], Charge::Each, Report::Now)
                    .await
                    .map_err(|(_, e)| (i, e))?;
                grant.decision = outcome.first().map(Outcome::response);
                grants.push(grant);
                continue;
            }
            // Filed under its ring name (a slice: its root key's), so that a move
            // hands it to the next owner of what it was granted from.
            let key = (name.into_boxed_str(), item.route.as_str().into(), req.key.map(Into::into));
            let id = leases.book.lock().open(LeaseRecord {
                holder,
                key,
                units: g.units,
                granted_at: g.granted_at,
                hold: g.hold,
            });
            if let (false, Some(c)) = (slices.is_empty(), self.shared()) {
                c.slices().funded(id, &slices.keys, slices_until);
            }
            grant.lease_id = id;
            grant.units = g.units;
            grant.hold = Some(convert::duration(g.hold));
            grants.push(grant);
            drop(held);
        }
        Ok(grants)
    }

    /// Takes up to `want` (at least `min`) units from the slices `remote`, refilling
    /// them from their owners as needed: the units and the slices' end.
    /// `Exhausted` when an owner refuses.
    async fn take_slices(
        &self,
        cluster: &crate::cluster::Cluster,
        chain: &limiter_core::policy::Chain<'_>,
        remote: &Remote,
        want: u64,
        min: u64,
        tenant: &str,
    ) -> Result<(u64, Nanos), ServerError> {
        // A refill for an agent asks for the whole grant (never more than the root
        // level can hold): near the limit the owner refuses, and the refusal, kept
        // for a few milliseconds, answers this node's agents at once instead of
        // turning each of their calls into a call to the owner.
        let capacity = chain
            .levels()
            .filter(|l| remote.holds(l))
            .map(|l| l.rule.limit.capacity())
            .min()
            .unwrap_or(u64::MAX);
        let need = want.max(min).min(capacity).max(1);
        for _ in 0..3 {
            let now = self.clock().now();
            match cluster.slices().take_up_to(&remote.keys, want, min, now) {
                Ok(got) => return Ok(got),
                Err(crate::cluster::slices::Take::Short(key)) => {
                    let Some(owner) = remote.owner(&key) else {
                        return Err(ServerError::Exhausted("slice".into()));
                    };
                    cluster.refill(&key, owner, tenant, need, want).await?;
                }
                Err(_) => return Err(ServerError::Exhausted("slice".into())),
            }
        }
        Err(ServerError::Exhausted("slice".into()))
    }

    /// A refusal by `chain`'s levels as they stand (a dry run), for grants that found
    /// nothing; `floor` is the least wait reported.
    fn refusal(
        &self,
        chain: &limiter_core::policy::Chain<'_>,
        now: Nanos,
        floor: Nanos,
    ) -> pb::ShouldAllowResponse {
        let mut probe = *chain;
        probe.dry_run = true;
        let decision = match self.store().limiter() {
            Some(l) => l.decide(&probe, now).decision,
            None => limiter_core::Decision::Rejected {
                reason: limiter_core::Reason::LimiterUnavailable,
                scope: limiter_core::Scope::Global,
                limit: None,
                retry_after: floor,
            },
        };
        let decision = match decision {
            limiter_core::Decision::Rejected { reason, scope, limit, retry_after } => {
                limiter_core::Decision::Rejected {
                    reason,
                    scope,
                    limit,
                    retry_after: retry_after.max(floor),
                }
            }
            // The levels would admit one unit but not the asked cost: wait a little.
            limiter_core::Decision::Allowed { binding, .. } => {
                let level = chain.levels().next();
                limiter_core::Decision::Rejected {
                    reason: level.map_or(limiter_core::Reason::GlobalCeiling, |l| l.scope.reason()),
                    scope: binding.map_or(limiter_core::Scope::Global, |b| b.scope),
                    limit: level.map(|l| *l.rule.limit),
                    retry_after: floor.max(1_000_000),
                }
            }
        };
        self.response(decision, now)
    }

    /// The answer carrying `decision`, decided here at `now`, charging nothing.
    fn response(&self, decision: limiter_core::Decision, now: Nanos) -> pb::ShouldAllowResponse {
        let outcome = crate::owner::Outcome {
            verdict: limiter_core::Verdict { decision, shadow: false },
            charged: 0,
            limit_name: None,
            policy_version: self.policies().current().version,
            charged_at: crate::store::Charged { at: now, hold: 0 },
            ticket: None,
        };
        outcome.response()
    }
}

/// What a grant is sized from.
#[derive(Debug, Clone, Copy)]
struct Ask {
    /// Units the holder asked for.
    want: u64,
    /// The request waiting for the grant (it must fit).
    cost: u64,
    /// The holder's demand, units per second.
    demand_per_sec: u64,
    /// How long the grant may be spent.
    hold: Nanos,
    /// Units left at the chain's tightest level.
    remaining: u64,
    /// The tightest level's capacity.
    capacity: u64,
    /// Holders with open leases on the chain (at least 1).
    active: u64,
    /// The route's `max_batch` (no cap for a node's slice).
    most: u64,
}

/// The grant rule: what the holder asked for (at least 1, at most `most`), no more
/// than it can spend in the hold at its demand, no more than half of what is left
/// (near the limit, when less than a fifth of the capacity is left, a share of it for
/// each active holder), and never less than the waiting request's cost.
fn grant_size(a: &Ask) -> u64 {
    let by_time = u128::from(a.demand_per_sec) * u128::from(a.hold) / u128::from(NANOS_PER_SEC) + 1;
    let share = if a.remaining < a.capacity / 5 {
        a.remaining / (2 * a.active.max(1))
    } else {
        a.remaining / 2
    };
    a.want
        .clamp(1, a.most.max(1))
        .min(u64::try_from(by_time).unwrap_or(u64::MAX))
        .min(share)
        .max(a.cost)
}

impl crate::cluster::LeaseBook for Leases {
    fn take_moving(&self, moving: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        Self::take_moving(self, moving)
    }

    fn adopt(&self, leases: &[pb::LeaseState]) -> u64 {
        Self::adopt(self, leases)
    }
}

#[cfg(test)]
mod grant_rule {
    use super::*;

    const SEC: Nanos = NANOS_PER_SEC;

    fn ask() -> Ask {
        Ask {
            want: 100,
            cost: 1,
            demand_per_sec: 1_000,
            hold: SEC,
            remaining: 10_000,
            capacity: 10_000,
            active: 1,
            most: 500,
        }
    }

    #[test]
    fn a_grant_is_what_was_asked_within_the_batch_cap() {
        assert_eq!(grant_size(&ask()), 100);
        assert_eq!(grant_size(&Ask { want: 10_000, ..ask() }), 500, "max_batch");
        assert_eq!(grant_size(&Ask { want: 0, ..ask() }), 1, "at least one unit");
    }

    #[test]
    fn a_grant_is_no_more_than_the_holder_can_spend_in_its_hold() {
        // 10 units a second for 2 s: 21 (the +1 keeps a slow key from getting 0).
        assert_eq!(grant_size(&Ask { demand_per_sec: 10, hold: 2 * SEC, ..ask() }), 21);
        assert_eq!(grant_size(&Ask { demand_per_sec: 0, ..ask() }), 1);
    }

    #[test]
    fn near_the_limit_each_active_holder_gets_a_small_share() {
        // Half of what is left while plenty is left.
        let busy = Ask { want: 10_000, most: u64::MAX, demand_per_sec: 1_000_000, ..ask() };
        assert_eq!(grant_size(&Ask { remaining: 4_000, ..busy }), 2_000);
        // Below a fifth of the capacity: a share per active holder of half of it.
        let near = Ask { remaining: 1_000, active: 10, ..busy };
        assert_eq!(grant_size(&near), 50);
        // Never below the waiting request's cost, even when that is all there is.
        assert_eq!(grant_size(&Ask { remaining: 3, active: 10, cost: 3, ..ask() }), 3);
        assert_eq!(
            grant_size(&Ask { active: 0, remaining: 100, ..ask() }),
            50,
            "active 0 reads as 1"
        );
    }
}
