//! Handoffs: installing a new ring (a planned move hands the counters and leases of
//! the tenants that move to their new owner first), draining (everything to the ring
//! without this node), and receiving what another node hands over, checked: only from
//! a node of this cluster, and only states an algorithm can reach.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use limiter_core::Limiter;
use limiter_core::Scope;
use limiter_core::algorithm::Algorithm;
use limiter_core::clock::Nanos;
use limiter_core::key::LimitKeyRef;
use limiter_core::limit::LimitState;
use limiter_core::policy::Policy;
use limiter_proto::limiter::v1 as pb;

use super::ring::{Member, Ring};
use super::{Cluster, Transition, nanos, ring_name};
use crate::config::Membership;
use crate::convert;
use crate::metrics as m;

/// The lease book as a handoff and a replica see it: what moves with tenants, what
/// changed, and what arrives. The owner's book implements it (the cluster sits below
/// the owner).
pub trait LeaseBook: Send + Sync {
    /// Takes out the open leases whose ring name `moving` accepts.
    fn take_moving(&self, moving: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState>;
    /// The leases opened or settled since the last call.
    fn take_changes(&self) -> super::LeaseChanges;
    /// Copies of the open leases whose ring name `pick` accepts.
    fn open_where(&self, pick: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState>;
    /// Adopts leases handed to this node; returns how many.
    fn adopt(&self, leases: &[pb::LeaseState]) -> u64;
}

/// What this node holds that moves when tenants change owner: its counters (the
/// memory store's, `None` on Redis) and its lease book. The owner implements it.
pub trait LocalState: Send + Sync {
    /// The counters, when they live in this process.
    fn counters(&self) -> Option<&Limiter>;
    /// The lease book.
    fn leases(&self) -> &dyn LeaseBook;
    /// Runs `f` with the active policy (what counters taken over are checked
    /// against).
    fn with_policy(&self, f: &mut dyn FnMut(&Policy));
}

/// Whether a handoff's sender is leaving the ring (draining) or only gives up the
/// tenants that moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leaving {
    No,
    Yes,
}

impl Cluster {
    /// Installs a new ring. Counters of tenants that move to a member that was not in
    /// the old ring are handed to it first (planned moves); this node marks itself
    /// joined once it is in a ring.
    pub async fn install(&self, new: Ring, state: &dyn LocalState) {
        let (limiter, leases) = (state.counters(), state.leases());
        let old = self.ring.load_full();
        if *old == new {
            return;
        }
        let new = Arc::new(new);
        if self.draining() {
            // A draining node keeps redirecting by the ring it handed off to.
            self.ring.store(Arc::new(new.without(&self.me.id)));
            return;
        }
        let joined_now = new.member(&self.me.id).is_some();
        let gained: Vec<Member> = new
            .members()
            .iter()
            .filter(|m| m.id != self.me.id && old.member(&m.id).is_none())
            .cloned()
            .collect();
        let was_alone = old.members().len() <= 1 && !self.joined();
        if self.stateful {
            // A node's first view: it held nothing for the others, and says so at
            // once so that they do not wait for it.
            let to: Vec<Member> = if was_alone {
                new.members().iter().filter(|m| m.id != self.me.id).cloned().collect()
            } else {
                gained.clone()
            };
            if !to.is_empty() {
                let gate = self.gate.write().await;
                self.moving.store(Arc::new(Some(new.clone())));
                drop(gate);
                let me = self.me.id.clone();
                let moving = |name: &str| {
                    old.owner(name).is_some_and(|o| o.id == me)
                        && new.owner(name).is_some_and(|n| to.iter().any(|g| g.id == n.id))
                };
                let (taken, leased) = match limiter {
                    Some(l) if !was_alone => (
                        l.table().take_where(|k| moving(&ring_name(k))),
                        leases.take_moving(&moving),
                    ),
                    _ => (Vec::new(), Vec::new()),
                };
                self.hand_off(&new, &to, taken, leased, Leaving::No).await;
            }
        }
        if self.stateful && !was_alone {
            self.replace_lost(&old, &new, state);
        }
        let now = self.clock.now();
        {
            let mut t = self.transitions.lock();
            let keep = self.fence.max(nanos(self.config.handoff_timeout)) * 2;
            t.retain(|x| now.saturating_sub(x.at) < keep);
            // A node's first view: everything it owns comes from the ring without it.
            let before = if was_alone { Arc::new(new.without(&self.me.id)) } else { old.clone() };
            t.push(Transition { at: now, before, after: new.clone() });
        }
        tracing::info!(
            node = %self.me.id,
            epoch = new.epoch,
            members = ?new.members().iter().map(|m| &*m.id).collect::<Vec<_>>(),
            "ring changed"
        );
        self.ring.store(new);
        self.moving.store(Arc::new(None));
        if joined_now {
            self.joined.store(true, Ordering::Relaxed);
        }
        self.publish();
    }

    /// What becomes of the replicas when the ring goes from `old` to `new`: a member
    /// that joins (or comes back) starts its copies afresh, one that handed off has
    /// none left, and one lost without handing off is replaced by its replica here,
    /// for the tenants this node was next in line for, when the replica can stand
    /// for it.
    fn replace_lost(&self, old: &Ring, new: &Ring, state: &dyn LocalState) {
        for m in new.members().iter().filter(|m| old.member(&m.id).is_none()) {
            self.replication.forget(&m.id);
        }
        let now = self.clock.now();
        for gone in old.members().iter().filter(|m| new.member(&m.id).is_none()) {
            if self.left.lock().contains_key(&gone.id) {
                self.replication.forget(&gone.id);
                continue;
            }
            if !self.replication.is_on() {
                continue;
            }
            let taken = self.replication.take_over(&gone.id, old, now, self.replica_current_for());
            let held = match taken {
                Ok(held) => held,
                Err(why) => {
                    self.behind.lock().insert(gone.id.clone(), why);
                    tracing::warn!(node = %self.me.id, lost = %gone.id, reason = why.reason(), "a lost node's tenants are fenced: no replica here can stand for it");
                    continue;
                }
            };
            let me = &self.me.id;
            let mine = |name: &str| {
                new.owner(name).is_some_and(|o| o.id == *me)
                    && old.owner_without(name, &gone.id).is_some_and(|o| o.id == *me)
            };
            let mut stored = 0u64;
            let mut refused = 0u64;
            let mut names = HashSet::new();
            if let Some(limiter) = state.counters() {
                state.with_policy(&mut |policy| {
                    for c in &held.counters {
                        let Some(name) = super::replica::counter_name(c) else { continue };
                        if !mine(&name) {
                            continue;
                        }
                        match store_counter(limiter, policy, c, now) {
                            Stored::Yes => {
                                stored += 1;
                                names.insert(name);
                            }
                            Stored::Implausible => refused += 1,
                            Stored::NoSuchLevel => {}
                        }
                    }
                });
            }
            let leases: Vec<pb::LeaseState> =
                held.leases.into_iter().filter(|l| mine(&l.tenant)).collect();
            let adopted = state.leases().adopt(&leases);
            self.promoted.lock().insert(gone.id.clone(), now);
            metrics::counter!(m::REPLICA_TAKEOVERS).increment(names.len() as u64);
            if refused > 0 {
                metrics::counter!(m::HANDOFF_REFUSED, "reason" => "state").increment(refused);
            }
            tracing::info!(node = %self.me.id, lost = %gone.id, counters = stored, tenants = names.len(), leases = adopted, refused, "took over a lost node's tenants from their replica");
        }
    }

    /// Drains: hands every counter to its owner in the ring without this node, then
    /// redirects every request there.
    pub async fn drain(&self, limiter: Option<&Limiter>, leases: &dyn LeaseBook) {
        if self.draining.swap(true, Ordering::Relaxed) {
            return;
        }
        let old = self.ring.load_full();
        let target = Arc::new(old.without(&self.me.id));
        if target.is_empty() {
            return;
        }
        let gate = self.gate.write().await;
        self.moving.store(Arc::new(Some(target.clone())));
        drop(gate);
        if let Some(limiter) = limiter {
            let taken = limiter.table().take_where(|_| true);
            let leased = leases.take_moving(&|_| true);
            self.hand_off(&target, target.members(), taken, leased, Leaving::Yes).await;
        }
        self.ring.store(target);
        self.moving.store(Arc::new(None));
    }

    /// Sends `taken` counters to their owners in `target` (one complete message to
    /// each of `to`, even an empty one: it tells the receiver nothing else is coming).
    async fn hand_off(
        &self,
        target: &Ring,
        to: &[Member],
        taken: Vec<limiter_core::table::Slot>,
        leased: Vec<pb::LeaseState>,
        leaving: Leaving,
    ) {
        let leaving = leaving == Leaving::Yes;
        let mut leases_of: HashMap<Arc<str>, Vec<pb::LeaseState>> = HashMap::new();
        for l in leased {
            if let Some(owner) = target.owner(&l.tenant) {
                leases_of.entry(owner.id.clone()).or_default().push(l);
            }
        }
        let mut by_owner: HashMap<Arc<str>, Vec<pb::CounterState>> = HashMap::new();
        for slot in taken {
            let Some(owner) = target.owner(&ring_name(slot.key())) else { continue };
            let k = slot.key().as_ref();
            let Ok(state) = serde_json::to_vec(&slot.state) else { continue };
            tracing::debug!(node = %self.me.id, to = %owner.id, key = %k, state = %String::from_utf8_lossy(&state).chars().take(60).collect::<String>(), "handing off");
            by_owner.entry(owner.id.clone()).or_default().push(pb::CounterState {
                scope: convert::scope(k.scope).into(),
                tenant: k.tenant.to_owned(),
                route: k.route.to_owned(),
                key: k.key.to_owned(),
                state,
                version: 0,
                budget: u32::from(k.budget),
            });
        }
        let sends = to.iter().map(|member| {
            let counters = by_owner.remove(&member.id).unwrap_or_default();
            let n = counters.len();
            let req = pb::HandoffRequest {
                from: self.me.id.to_string(),
                epoch: target.epoch,
                counters,
                complete: true,
                leaving,
                leases: leases_of.remove(&member.id).unwrap_or_default(),
            };
            async move {
                // A node that has just joined may not see this one in its ring yet and
                // refuses the sender; its view catches up within a poll, so a refusal
                // is retried (backing off) until the handoff timeout, not dropped.
                let deadline = tokio::time::Instant::now() + self.config.handoff_timeout;
                let mut pause = Duration::from_millis(50);
                let sent = loop {
                    let sent = match self.peer(member) {
                        Ok(p) => p.handoff(req.clone(), self.config.handoff_timeout).await,
                        Err(e) => Err(e),
                    };
                    match sent {
                        Err(s)
                            if s.code() == tonic::Code::PermissionDenied
                                && tokio::time::Instant::now() + pause < deadline =>
                        {
                            tracing::debug!(to = %member.id, "handoff refused, retried: {}", s.message());
                            tokio::time::sleep(pause).await;
                            pause *= 2;
                        }
                        other => break other,
                    }
                };
                match sent {
                    Ok(_) => {
                        metrics::counter!(m::HANDOFF_COUNTERS, "direction" => "sent")
                            .increment(n as u64);
                        tracing::info!(node = %self.me.id, to = %member.id, counters = n, leaving, "handed off");
                    }
                    Err(e) => {
                        metrics::counter!(m::HANDOFF_FAILURES).increment(1);
                        tracing::warn!(to = %member.id, counters = n, "handoff failed: {e}");
                    }
                }
            }
        });
        for send in sends {
            send.await;
        }
    }

    /// Whether `id` names a node of this cluster: a member of the current ring, one of
    /// the configured static peers or of the addresses DNS lists (which may be out of
    /// the ring for a moment).
    pub(super) fn knows(&self, id: &str) -> bool {
        if id == &*self.me.id {
            return false;
        }
        self.ring.load().member(id).is_some()
            || matches!(&self.config.membership, Membership::Static(peers) if peers.iter().any(|p| p.id == id))
            || self.candidates.lock().iter().any(|c| **c == *id)
            || self.left.lock().contains_key(id)
    }

    /// Stores counters handed to this node; returns how many were accepted.
    /// Counters in a state no algorithm can reach are refused one by one and counted.
    ///
    /// # Errors
    ///
    /// A sender that is not a node of this cluster (nothing is stored).
    pub fn receive(
        &self,
        req: &pb::HandoffRequest,
        limiter: Option<&Limiter>,
        leases: &dyn LeaseBook,
        policy: &Policy,
    ) -> Result<u64, String> {
        if !self.knows(&req.from) {
            metrics::counter!(m::HANDOFF_REFUSED, "reason" => "sender").increment(1);
            tracing::warn!(node = %self.me.id, from = %limiter_core::text::shorten(&req.from), "handoff from a node not in this cluster refused");
            return Err(format!(
                "handoff refused: `{}` is not a node of this cluster",
                limiter_core::text::shorten(&req.from)
            ));
        }
        let now = self.clock.now();
        let mut accepted = 0;
        let mut refused = 0;
        if let Some(limiter) = limiter {
            for c in &req.counters {
                match store_counter(limiter, policy, c, now) {
                    Stored::Yes => accepted += 1,
                    Stored::Implausible => refused += 1,
                    Stored::NoSuchLevel => {}
                }
            }
        }
        if refused > 0 {
            metrics::counter!(m::HANDOFF_REFUSED, "reason" => "state").increment(refused);
            tracing::warn!(node = %self.me.id, from = %req.from, refused, "handed-off counters in states no algorithm can reach were refused");
        }
        let adopted = leases.adopt(&req.leases);
        metrics::counter!(m::HANDOFF_COUNTERS, "direction" => "received").increment(accepted);
        if req.complete {
            self.handoffs.lock().insert(req.from.as_str().into(), now);
        }
        if req.leaving {
            self.left.lock().insert(req.from.as_str().into(), now);
        }
        tracing::info!(node = %self.me.id, from = %req.from, counters = accepted, leases = adopted, leaving = req.leaving, "handoff received");
        Ok(accepted)
    }
}

/// How far another node's clock may run ahead of this one's for a handed-off state
/// to still count as plausible.
const HANDOFF_SKEW: Nanos = 5 * limiter_core::clock::NANOS_PER_SEC;

/// What became of one handed-off counter.
pub(super) enum Stored {
    Yes,
    /// The policy has no such level here (it changed, or the sender's differs).
    NoSuchLevel,
    /// A state no algorithm can reach under this node's limit for it.
    Implausible,
}

/// Stores one handed-off counter under this node's limit for it.
pub(super) fn store_counter(
    limiter: &Limiter,
    policy: &Policy,
    c: &pb::CounterState,
    now: Nanos,
) -> Stored {
    let Some(scope) = convert::scope_from(c.scope) else { return Stored::NoSuchLevel };
    let Ok(state) = serde_json::from_slice::<LimitState>(&c.state) else {
        return Stored::Implausible;
    };
    let Ok(budget) = u8::try_from(c.budget) else { return Stored::NoSuchLevel };
    let key = LimitKeyRef::new(scope, &c.tenant, &c.route, &c.key).with_budget(budget);
    // Names a request could not carry have no counter here (and would not fit one).
    let bounds = limiter_core::policy::NameBounds::default();
    let fits = |name: &str, max: usize, needed: bool| {
        name.len() <= max && !name.chars().any(char::is_control) && (!needed || !name.is_empty())
    };
    let (t, r, k) = match scope {
        Scope::Global => (false, false, false),
        Scope::Route => (false, true, false),
        Scope::Tenant => (true, false, false),
        Scope::TenantRoute => (true, true, false),
        Scope::Key => (true, true, true),
    };
    if !(fits(key.tenant, bounds.tenant, t)
        && fits(key.route, bounds.route, r)
        && fits(key.key, bounds.key, k))
    {
        return Stored::NoSuchLevel;
    }
    let Some(rule) = policy.rule_of(&key) else {
        return Stored::NoSuchLevel;
    };
    let level = limiter_core::policy::Level { scope, rule, key };
    if !level.rule.limit.plausible(&state, now, HANDOFF_SKEW) {
        return Stored::Implausible;
    }
    limiter.table().put(level.key, &level.rule.limit, state, now);
    Stored::Yes
}
