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

use crate::convert;
use crate::error::ServerError;
use crate::metrics::{self as m, Api};
use crate::owner::Owner;

/// A chain's identity in the book: tenant, route, key.
type ChainKey = (Box<str>, Box<str>, Option<Box<str>>);

/// Agents count as active this long after their last call.
const ACTIVE_FOR: Nanos = 2 * NANOS_PER_SEC;

/// The owner's lease state.
#[derive(Debug, Default)]
pub struct Leases {
    book: Mutex<LeaseBook<ChainKey>>,
    agents: Mutex<HashMap<u64, Nanos>>,
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
            let chain = active_policy
                .policy
                .resolve(&req, &self.limits().names)
                .map_err(|e| (i, e.into()))?;
            let now = self.clock().now();
            if item.lease_id != 0 {
                let settled = leases.book.lock().settle(item.lease_id, holder, now, item.unspent);
                if let Settled::Closed { record, refund } = settled {
                    self.store()
                        .refund_grant(&chain, now, record.granted_at, record.hold, refund)
                        .await
                        .map_err(|e| (i, e))?;
                }
            }
            let mut grant = pb::LeaseGrant {
                mode: pb::LeaseMode::Leased.into(),
                on_failure: Some(failure_policy(chain.route.on_limiter_failure)),
                policy_version: active_policy.version,
                ..Default::default()
            };
            if item.want == 0 && item.cost == 0 {
                grants.push(grant);
                continue;
            }
            let remaining = self.store().remaining(&chain, now).await.map_err(|e| (i, e))?;
            let need = item.cost.max(1);
            if chain.route.lease.exact || remaining < need.saturating_mul(active) {
                grant.mode = pb::LeaseMode::Direct.into();
                if item.cost > 0 {
                    let outcome = self
                        .decide(Api::Lease, std::slice::from_ref(&req), false, false)
                        .await
                        .map_err(|(_, e)| (i, e))?;
                    grant.decision = Some(convert::response(&outcome[0]));
                }
                grants.push(grant);
                continue;
            }
            // How long the grant can be spent: the route's TTL, cut by window ends.
            let hold = chain.grant_hold(now, chain.route.lease.ttl);
            // No more than the agent can spend in that time at its demand.
            let by_time =
                u128::from(item.demand_per_sec) * u128::from(hold) / u128::from(NANOS_PER_SEC) + 1;
            let capacity =
                chain.levels().map(|l| l.rule.limit.capacity()).min().unwrap_or(u64::MAX);
            // Near the limit, every active agent may strand only a small share.
            let share =
                if remaining < capacity / 5 { remaining / (2 * active) } else { remaining / 2 };
            let size = item
                .want
                .clamp(1, chain.route.lease.max_batch.get())
                .min(u64::try_from(by_time).unwrap_or(u64::MAX))
                .min(share)
                .max(item.cost);
            let g = self
                .store()
                .grant(&chain, now, size, chain.route.lease.ttl)
                .await
                .map_err(|e| (i, e))?;
            if g.units < item.cost || g.units == 0 {
                // Not enough to hold: give back any partial grant and decide the
                // waiting request itself (charged if it fits), as in direct mode.
                self.store()
                    .refund_grant(&chain, now, g.granted_at, g.hold, g.units)
                    .await
                    .map_err(|e| (i, e))?;
                let probe = Request { dry_run: item.cost == 0, ..req };
                let outcome = self
                    .decide(Api::Lease, &[probe], false, false)
                    .await
                    .map_err(|(_, e)| (i, e))?;
                grant.decision = Some(convert::response(&outcome[0]));
                grants.push(grant);
                continue;
            }
            let key =
                (item.tenant.as_str().into(), item.route.as_str().into(), req.key.map(Into::into));
            let id = leases.book.lock().open(LeaseRecord {
                holder,
                key,
                units: g.units,
                granted_at: g.granted_at,
                hold: g.hold,
            });
            grant.lease_id = id;
            grant.units = g.units;
            grant.hold = Some(convert::duration(g.hold));
            grants.push(grant);
        }
        Ok(grants)
    }
}
