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
        req: &Request<'_>,
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
    /// levels (`u64::MAX` when none is divided), counting `asked` units (what its
    /// holder spent since its last call, and the request waiting) as the class's
    /// demand; a refusal when a class's share is used up.
    pub(crate) fn room(
        &self,
        req: &Request<'_>,
        chain: &Chain<'_>,
        asked: u64,
        now: Nanos,
    ) -> Result<u64, Box<Refused>> {
        let mut room = u64::MAX;
        self.walk(req, chain, now, |level, _, e, shares, class| {
            let r = e.gate.room(shares, class, asked, now);
            room = room.min(r.map_err(|d| Box::new(refused(level, shares, class, &d)))?);
            Ok(())
        })?;
        Ok(room)
    }

    /// Charges `units` granted to a lease of `req` to its classes; what they return
    /// unspent goes back with [`Self::give_back_units`].
    pub(crate) fn charge(&self, req: &Request<'_>, chain: &Chain<'_>, units: u64, now: Nanos) {
        let _ = self.walk(req, chain, now, |_, _, e, _, class| {
            e.gate.charge(class, units, now);
            Ok(())
        });
    }

    /// Gives back `units` of a lease of `req` granted at `granted_at`, returned unspent.
    pub(crate) fn give_back_units(
        &self,
        req: &Request<'_>,
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
        req: &Request<'_>,
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
            f(&level, &id, entry, shares, shares.class_of(req.tenant, req.route, req.key))?;
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
/// limit) in a cluster, where other nodes spend slices of the level that the owner's
/// gates never see.
///
/// # Errors
///
/// Every such level, one line each.
pub fn check_policy(policy: &Policy, clustered: bool) -> Result<(), String> {
    const WHY: &str = "in a cluster, the global ceiling and routes' limits are spent \
                       through slices held by every node, which the classes' shares do not \
                       divide yet; put the shares on tenants' limits (tenants.<t>.shares), \
                       or run one node";
    if !clustered {
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
