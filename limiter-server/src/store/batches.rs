//! Batches leased from the Redis store, so that Redis sees one call per batch rather
//! than one per request: the agent's lease protocol, with this server as the agent.
//!
//! - Pre-paid: a batch is debited from every level of its chain in Redis when it is
//!   granted, so the units one server holds can never be spent by another; several
//!   servers sharing one Redis never admit more than the limits allow.
//! - Sized by demand (about a hold's worth of what this server spends, the estimate of
//!   `limiter_core::holder`), at most the route's `max_batch`, and at most half of what is left in
//!   Redis (the script's rule), so one server strands at most half the rest.
//! - Spent for at most the grant's hold (counted from when this server asked, less a
//!   margin), then what is left goes back with the next grant, or on the idle sweep,
//!   or at shutdown. Rejections are never decided from a batch: when a batch cannot
//!   cover a request, Redis decides it exactly (reason, scope and wait included).
//! - One renewal in flight per chain: requests of the same chain queue behind it.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher, RandomState};
use std::sync::Arc;

use limiter_core::clock::Nanos;
use limiter_core::decision::{Binding, Decision};
use limiter_core::holder::{self, Demand, Margin, Refusal};
use limiter_core::key::LimitKey;
use limiter_core::policy::{Chain, NameBounds, Policy, Request};
use limiter_core::{Limit, Verdict};
use parking_lot::Mutex;

use super::Charged;
use super::redis::RedisStore;
use crate::error::ServerError;

/// A request that resolves to the chain (to give a batch back after a while).
type Origin = (Box<str>, Box<str>, Option<Box<str>>);

/// A batch is given up a tenth of its hold early, at least 1 ms (the server's clock
/// against Redis's `TIME`).
const MARGIN: Margin = Margin { permille: 100, at_least: 1_000_000 };

#[derive(Debug, Default)]
struct Batch {
    /// The chain's counters and limits (a reload that changes a limit is another
    /// chain, with batches of its own).
    levels: Vec<(LimitKey, Limit)>,
    origin: Option<Origin>,
    /// Dropped from the map: a caller that found it just before must look again.
    retired: bool,
    /// A refusal Redis made, remembered for a moment: its decision.
    denied: Option<Refusal<Decision>>,
    units: u64,
    granted_at: Nanos,
    hold: Nanos,
    /// Spendable until this instant of the server's clock.
    until: Nanos,
    /// Units per second at which this server spends the chain's batches.
    demand: Demand,
    left: u64,
    tight: usize,
    reset_at: Nanos,
    used_at: Nanos,
}

type Cell = Arc<tokio::sync::Mutex<Batch>>;

/// The batches this server holds, filed by a fingerprint of their chain (its
/// counters and limits): found without allocating, checked against the chain itself.
#[derive(Debug, Default)]
pub(crate) struct Batches {
    map: Mutex<HashMap<u64, Cell>>,
    hasher: RandomState,
}

impl Batch {
    /// Whether this batch is `chain`'s.
    fn is_for(&self, chain: &Chain<'_>) -> bool {
        self.levels.len() == chain.len()
            && chain
                .levels()
                .zip(&self.levels)
                .all(|(l, (key, limit))| l.key.matches(key) && *l.rule.limit == *limit)
    }
}

impl Batches {
    fn fingerprint(&self, chain: &Chain<'_>) -> u64 {
        let mut h = self.hasher.build_hasher();
        for l in chain.levels() {
            l.key.hash(&mut h);
            l.rule.limit.hash(&mut h);
        }
        h.finish()
    }
}

impl Batches {
    /// Decides a request from its chain's batch, renewing it when it cannot cover the
    /// request.
    pub(crate) async fn decide(
        &self,
        store: &RedisStore,
        req: &Request<'_>,
        chain: &Chain<'_>,
        now: Nanos,
        local: impl Fn() -> Nanos,
    ) -> Result<(Verdict, Charged), ServerError> {
        let fingerprint = self.fingerprint(chain);
        // Behind a renewal in flight for at most one call's deadline: a request never
        // waits for a queue of calls to a slow Redis (the failure policy answers it).
        let deadline = store.settings().command_timeout;
        let mut b = loop {
            let cell = self.map.lock().entry(fingerprint).or_default().clone();
            let Ok(mut b) = tokio::time::timeout(deadline, cell.lock_owned()).await else {
                return Err(ServerError::Unavailable("a batch renewal is still in flight".into()));
            };
            if b.retired {
                continue;
            }
            if b.levels.is_empty() {
                b.levels = chain.levels().map(|l| (l.key.to_owned_key(), *l.rule.limit)).collect();
                b.origin = Some((req.tenant.into(), req.route.into(), req.key.map(Into::into)));
            }
            if !b.is_for(chain) {
                // Another chain with the same fingerprint: this one is decided exactly.
                drop(b);
                return store.decide(chain, now).await;
            }
            break b;
        };
        let cost = chain.cost;
        let t = local();
        b.used_at = t;
        if b.units >= cost && t < b.until {
            b.units -= cost;
            b.demand.spend(cost);
            return Ok((allowed(&b, chain, t), Charged { at: b.granted_at, hold: b.hold }));
        }
        if let Some(d) = &b.denied
            && let Some(retry_after) = d.wait(t, cost)
            && let Decision::Rejected { reason, scope, limit, .. } = d.detail
        {
            let decision = Decision::Rejected { reason, scope, limit, retry_after };
            return Ok((Verdict { decision, shadow: chain.shadow }, Charged { at: now, hold: 0 }));
        }
        // Renew: return what is left, ask for about a hold of demand.
        let ttl = chain.route.lease.ttl;
        let want = holder::want(b.demand.update(t), ttl, cost, chain.route.lease.max_batch.get());
        let back = (b.units, b.granted_at, b.hold);
        b.units = 0;
        let g = store.grant_raw(chain, now, want, ttl, cost, back).await?;
        if g.units < cost {
            let Some(level) = g.failed.checked_sub(1).and_then(|i| chain.levels().nth(i)) else {
                drop(b);
                // A Cluster group granted less than an earlier one: decide exactly.
                return store.decide(chain, now).await;
            };
            // Refused, as a decision would be (the script checked `cost` the same way).
            // Requests as large until the wait is over, or a hold at most, are refused
            // here without asking Redis again (under-admission only: a refund elsewhere
            // may free units sooner).
            let decision = Decision::Rejected {
                reason: level.scope.reason(),
                scope: level.scope,
                limit: Some(*level.rule.limit),
                retry_after: g.wait,
            };
            b.denied = Some(Refusal::new(t, g.wait, g.hold / 4, cost, decision));
            return Ok((
                Verdict { decision, shadow: chain.shadow },
                Charged { at: g.granted_at, hold: 0 },
            ));
        }
        let mut demand = b.demand;
        demand.spend(cost);
        *b = Batch {
            levels: std::mem::take(&mut b.levels),
            origin: b.origin.take(),
            retired: false,
            denied: None,
            units: g.units - cost,
            granted_at: g.granted_at,
            hold: g.hold,
            until: MARGIN.spendable_until(t, g.hold),
            demand,
            left: g.left,
            tight: g.tight,
            reset_at: t + g.reset,
            used_at: t,
        };
        Ok((allowed(&b, chain, t), Charged { at: b.granted_at, hold: b.hold }))
    }

    /// Returns the units of batches idle for half a hold, or of all of them (`all`, at
    /// shutdown), and forgets them. A batch still in use goes back with its renewal
    /// (in the same call as the next grant), never in a call of its own.
    pub(crate) async fn flush(
        &self,
        store: &RedisStore,
        policy: &Policy,
        now: Nanos,
        local: Nanos,
        all: bool,
    ) {
        let cells: Vec<(u64, Cell)> =
            self.map.lock().iter().map(|(k, v)| (*k, v.clone())).collect();
        for (fingerprint, cell) in cells {
            let Ok(mut b) = cell.try_lock() else { continue };
            let idle = local.saturating_sub(b.used_at) >= b.hold / 2;
            if !(all || idle) {
                continue;
            }
            if let (true, Some((tenant, route, key))) = (b.units > 0, &b.origin) {
                let req =
                    Request { tenant, route, key: key.as_deref(), cost: Some(1), dry_run: true };
                let unbounded =
                    NameBounds { tenant: usize::MAX, route: usize::MAX, key: usize::MAX };
                // A chain the policy no longer resolves the same way keeps its units
                // charged until they expire (under-admission, never over).
                if let Ok(chain) = policy.resolve(&req, &unbounded)
                    && b.is_for(&chain)
                    && store.refund_grant(&chain, now, b.granted_at, b.hold, b.units).await.is_err()
                {
                    tracing::debug!("a batch's units could not be returned: Redis is away");
                }
                b.units = 0;
            }
            b.retired = true;
            let mut map = self.map.lock();
            if map.get(&fingerprint).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                map.remove(&fingerprint);
            }
        }
    }

    /// Batches held.
    pub(crate) fn len(&self) -> usize {
        self.map.lock().len()
    }
}

fn allowed(b: &Batch, chain: &Chain<'_>, t: Nanos) -> Verdict {
    let binding = (b.tight > 0)
        .then(|| chain.levels().nth(b.tight - 1))
        .flatten()
        .map(|l| Binding { scope: l.scope, limit: *l.rule.limit });
    Verdict {
        decision: Decision::Allowed {
            remaining: b.left.saturating_add(b.units),
            reset_after: b.reset_at.saturating_sub(t),
            binding,
        },
        shadow: chain.shadow,
    }
}
