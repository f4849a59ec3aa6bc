//! Fair shares on the owner: the gates of the divided levels this node decides (the
//! global ceiling, routes' limits, listed tenants' limits with `shares`), taken before
//! the store is asked and given back when the store refuses.
//!
//! A gate lives as long as its level has shares in the active policy; a reload keeps
//! what each class (by name) took and its demand.

use std::collections::HashMap;
use std::sync::Arc;

use limiter_core::clock::Nanos;
use limiter_core::policy::{Chain, Level, Policy, Request};
use limiter_core::share::{ShareDenied, ShareGate, Shares};
use limiter_core::{Decision, Limit, Scope};
use parking_lot::Mutex;

use crate::metrics as m;

/// A divided level: its scope and the name that tells it apart (a route's, a
/// tenant's; none for the global ceiling).
type GateId = (Scope, Box<str>);

struct Entry {
    shares: Arc<Shares>,
    gate: ShareGate,
    /// When its classes' allocations were last published.
    published_at: Nanos,
}

/// The gates of the divided levels.
#[derive(Default)]
pub(crate) struct ShareGates {
    gates: Mutex<HashMap<GateId, Entry>>,
}

/// What one request took from the gates of its chain.
#[derive(Debug, Default)]
pub(crate) struct Taken {
    parts: Vec<(Scope, Box<str>, usize, u64)>,
    at: Nanos,
}

impl Taken {
    /// Whether nothing was taken (no divided level, a dry run, or a refusal).
    pub(crate) fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }
}

/// Whose class a gate is asked about: a request's (matched by its names), or a class
/// named outright (a node's slice of a divided root level, leased per class).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Who<'a> {
    Req(&'a Request<'a>),
    Class(&'a str),
}

impl Who<'_> {
    /// The class's index in `shares` (a name no longer in the policy: the catch-all).
    fn class(&self, shares: &Shares) -> usize {
        match self {
            Self::Req(r) => shares.class_of(r.tenant, r.route, r.key),
            Self::Class(name) => shares
                .classes()
                .iter()
                .position(|c| *c.name == **name)
                .unwrap_or(shares.classes().len() - 1),
        }
    }
}

/// A request refused by its class's share.
#[derive(Debug, Clone)]
pub(crate) struct Refused {
    /// The refusal.
    pub(crate) decision: Decision,
    /// The class.
    pub(crate) class: Arc<str>,
}

fn gate_id(level: &Level<'_>) -> Option<GateId> {
    let name = match level.scope {
        Scope::Global => "",
        Scope::Route => level.key.route,
        Scope::Tenant => level.key.tenant,
        Scope::TenantRoute | Scope::Key => return None,
    };
    Some((level.scope, name.into()))
}

/// Whether any level of `chain` is divided into shares.
pub(crate) fn divided(chain: &Chain<'_>) -> bool {
    chain.levels().any(|l| l.rule.shares.is_some())
}

impl ShareGates {
    /// Takes `chain.cost` from the class of `req` at every divided level of `chain`
    /// (a dry run checks only), all or nothing.
    pub(crate) fn take(
        &self,
        req: Who<'_>,
        chain: &Chain<'_>,
        now: Nanos,
    ) -> Result<Taken, Box<Refused>> {
        let mut taken = Taken { parts: Vec::new(), at: now };
        let charge = !chain.dry_run && chain.cost > 0;
        let walked = self.walk(req, chain, now, |level, id, e, shares, class| {
            let taking = e.gate.take(shares, class, chain.cost, charge, now);
            if now >= e.published_at.saturating_add(limiter_core::share::SLOT) {
                publish(level.scope, e, now);
            }
            let _ = taking.map_err(|d| Box::new(refused(level, shares, class, &d)))?;
            if charge {
                taken.parts.push((id.0, id.1.clone(), class, chain.cost));
            }
            Ok(())
        });
        match walked {
            Ok(()) => Ok(taken),
            Err(r) => {
                // All or nothing: what the levels before the refusing one took goes back.
                self.give_back(&taken, now);
                Err(r)
            }
        }
    }

    /// The most a lease for `req` may be granted by the classes of its chain's divided
    /// levels (`u64::MAX` when none is divided), counting as the class's demand what
    /// its holder `spent` since its last grant (`since`: spread over that time) and
    /// the `waiting` request; a refusal when a class's share is used up.
    pub(crate) fn room(
        &self,
        req: Who<'_>,
        chain: &Chain<'_>,
        (spent, since): (u64, Nanos),
        waiting: u64,
        now: Nanos,
    ) -> Result<u64, Box<Refused>> {
        let mut room = u64::MAX;
        self.walk(req, chain, now, |level, _, e, shares, class| {
            e.gate.spent(class, spent, since, now);
            let r = e.gate.room(shares, class, waiting, now);
            room = room.min(r.map_err(|d| Box::new(refused(level, shares, class, &d)))?);
            Ok(())
        })?;
        Ok(room)
    }

    /// Charges `units` granted to a lease of `req` to its classes; what they return
    /// unspent goes back with [`Self::give_back_units`].
    pub(crate) fn charge(&self, req: Who<'_>, chain: &Chain<'_>, units: u64, now: Nanos) {
        let _ = self.walk(req, chain, now, |_, _, e, _, class| {
            e.gate.charge(class, units, now);
            Ok(())
        });
    }

    /// Gives back `units` of a lease of `req` granted at `granted_at`, returned unspent.
    pub(crate) fn give_back_units(
        &self,
        req: Who<'_>,
        chain: &Chain<'_>,
        units: u64,
        granted_at: Nanos,
        now: Nanos,
    ) {
        if units > 0 {
            let _ = self.walk(req, chain, now, |_, _, e, _, class| {
                e.gate.give_back(class, units, granted_at, now);
                Ok(())
            });
        }
    }

    /// Calls `f` for every divided level of `chain` with its gate (made as needed)
    /// and `req`'s class there, under the gates' lock, until it refuses.
    fn walk(
        &self,
        req: Who<'_>,
        chain: &Chain<'_>,
        now: Nanos,
        mut f: impl FnMut(&Level<'_>, &GateId, &mut Entry, &Shares, usize) -> Result<(), Box<Refused>>,
    ) -> Result<(), Box<Refused>> {
        if !divided(chain) || chain.unknown_tenant {
            return Ok(());
        }
        let mut gates = self.gates.lock();
        for level in chain.levels() {
            let (Some(shares), Some(id)) = (&level.rule.shares, gate_id(&level)) else {
                continue;
            };
            let entry = entry(&mut gates, id.clone(), shares, *level.rule.limit, now);
            f(&level, &id, entry, shares, req.class(shares))?;
        }
        Ok(())
    }

    /// Gives back what `taken` took (the store refused the request, or it was
    /// refunded).
    pub(crate) fn give_back(&self, taken: &Taken, now: Nanos) {
        if !taken.parts.is_empty() {
            give_back(&mut self.gates.lock(), taken, now);
        }
    }

    /// Drops the gates of levels no longer divided, and publishes every class's
    /// allocation.
    pub(crate) fn sweep(&self, policy: &Policy, now: Nanos) {
        let mut gates = self.gates.lock();
        gates.retain(|(scope, name), e| {
            let rule = match scope {
                Scope::Global => policy.global.as_ref(),
                Scope::Route => policy.routes.get(name).and_then(|r| r.limit.as_ref()),
                Scope::Tenant => policy.tenants.get(name).and_then(|t| t.limit.first()),
                Scope::TenantRoute | Scope::Key => None,
            };
            rule.and_then(|r| r.shares.as_ref()).is_some_and(|s| **s == *e.shares)
        });
        for ((scope, _), e) in gates.iter_mut() {
            publish(*scope, e, now);
        }
    }
}

/// The refusal of `class` by its share of `level`, counted.
fn refused(level: &Level<'_>, shares: &Shares, class: usize, d: &ShareDenied) -> Refused {
    let name = shares.classes().get(class).map_or_else(|| Arc::from(""), |c| c.name.clone());
    metrics::counter!(
        m::SHARE_REJECTIONS,
        "scope" => level.scope.as_str(),
        "class" => name.to_string()
    )
    .increment(1);
    let decision = Decision::Rejected {
        reason: limiter_core::Reason::ShareLimit,
        scope: level.scope,
        limit: Some(d.limit.unwrap_or(*level.rule.limit)),
        retry_after: d.retry_after,
    };
    Refused { decision, class: name }
}

/// Publishes the allocations of a gate's classes (at most every slot from the
/// decision path; at every sweep).
#[allow(clippy::cast_precision_loss)] // gauge values
fn publish(scope: Scope, e: &mut Entry, now: Nanos) {
    e.published_at = now;
    for c in e.gate.view(&e.shares, now) {
        metrics::gauge!(
            m::SHARE_ALLOCATION,
            "scope" => scope.as_str(),
            "class" => c.name.to_string()
        )
        .set(c.ppm as f64 / limiter_core::share::PPM as f64);
    }
}

/// The gate of `id`, made (or carried over from another policy's) for `shares`.
fn entry<'g>(
    gates: &'g mut HashMap<GateId, Entry>,
    id: GateId,
    shares: &Arc<Shares>,
    base: Limit,
    now: Nanos,
) -> &'g mut Entry {
    let e = gates.entry(id).or_insert_with(|| Entry {
        shares: shares.clone(),
        gate: ShareGate::new(base, shares),
        published_at: 0,
    });
    if !Arc::ptr_eq(&e.shares, shares) {
        if *e.shares != **shares || *e.gate.base() != base {
            e.gate = e.gate.carried(&e.shares, base, shares, now);
        }
        e.shares = shares.clone();
    }
    e
}

fn give_back(gates: &mut HashMap<GateId, Entry>, taken: &Taken, now: Nanos) {
    for (scope, name, class, units) in &taken.parts {
        if let Some(e) = gates.get_mut(&(*scope, name.clone())) {
            e.gate.give_back(*class, *units, taken.at, now);
        }
    }
}

/// Refuses shares a node cannot keep: on a root level (the global ceiling, a route's
/// limit) in a cluster whose nodes share one store (Redis), where every node decides
/// the level itself and no gate sees the others' use. (On the memory store a root
/// level has one owner; other nodes lease slices of it per class, which its gates
/// size.)
///
/// # Errors
///
/// Every such level, one line each.
pub fn check_policy(policy: &Policy, shared_store_cluster: bool) -> Result<(), String> {
    const WHY: &str = "in a cluster on a shared store (Redis), every node decides the \
                       global ceiling and routes' limits itself, and no node sees the \
                       others' use of a class's share; put the shares on tenants' limits \
                       (tenants.<t>.shares), or use the memory store";
    if !shared_store_cluster {
        return Ok(());
    }
    let mut errors = Vec::new();
    if policy.global.as_ref().is_some_and(|g| g.shares.is_some()) {
        errors.push(format!("global.shares: {WHY}"));
    }
    let mut routes: Vec<&str> = policy
        .routes
        .iter()
        .filter(|(_, r)| r.limit.as_ref().is_some_and(|l| l.shares.is_some()))
        .map(|(n, _)| n.as_ref())
        .collect();
    routes.sort_unstable();
    for name in routes {
        errors.push(format!("routes.{name}.shares: {WHY}"));
    }
    if errors.is_empty() { Ok(()) } else { Err(errors.join("\n")) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Shares of root levels: kept on the memory store (one owner per level, slices
    /// per class), refused on a cluster sharing one store, each level named.
    #[test]
    fn root_levels_divided_are_refused_only_on_a_shared_store_cluster() {
        let text = "version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100/s }
  shares:
    critical: { tenants: [acme], reserved: 30% }
routes:
  /r:
    limit: { algorithm: fixed_window, limit: 10, window: 1s }
    shares:
      gold: { tenants: [acme], reserved: 50% }
tenants:
  acme:
    limit: { algorithm: token_bucket, rate: 10/s }
    shares:
      vip: { keys: [k1], reserved: 50% }
";
        let policy = limiter_core::policy::load::from_yaml(text, "policies.yaml").unwrap();
        check_policy(&policy, false).unwrap();
        let e = check_policy(&policy, true).unwrap_err();
        let lines: Vec<&str> = e.lines().collect();
        assert_eq!(lines.len(), 2, "{e}");
        assert!(lines[0].starts_with("global.shares: in a cluster on a shared store"), "{e}");
        assert!(lines[1].starts_with("routes./r.shares:"), "{e}");
    }
}
