//! Several nodes sharing the tenants: the ring, membership, forwarding, planned moves
//! with handoff, and fencing after a node's loss.
//!
//! - Every tenant has one owner, chosen by rendezvous hashing over the live members
//!   ([`ring`]). A node that receives a request for a tenant it does not own forwards
//!   it once to the owner ([`peers`]); the owner answers, or, if its own view says
//!   someone else owns the tenant, names that node (one redirect, then whoever is
//!   asked decides: never a loop).
//! - Membership comes from a static list with health checks or a Redis registry
//!   ([`membership`]); a change installs a new ring here.
//! - Planned moves: when a node joins, each old owner sends the counters of the
//!   tenants that move to it (a handoff) before it redirects them; a draining node
//!   sends all of its counters to their new owners, then redirects. Requests for a
//!   tenant whose counters are on their way wait for them (at most the handoff
//!   timeout).
//! - Replicas ([`replica`]): each owner keeps the member that would own its tenants
//!   next up to date with their counters and leases (memory store).
//! - Unplanned loss: the new owner of a dead node's tenants decides them at once from
//!   its replica when the replica can stand for the old owner; the others (no
//!   current replica here, or owner and replica both lost) it fences for the longest
//!   lease TTL the old owner could have issued (meanwhile their requests follow each
//!   route's failure policy and lease calls are granted nothing new), and counts them
//!   in `limiter_state_resets_total` when they begin afresh.
//!
//! With the Redis store the counters are shared, so there is nothing to hand off and
//! nothing to fence: ownership only routes.

pub(crate) mod dns;
mod handoff;
pub mod membership;
pub mod peers;
pub mod replica;
pub mod ring;
pub mod slices;

pub use self::handoff::{LeaseBook, LocalState};
pub use self::replica::{LeaseChanges, Replication};

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use limiter_core::clock::{Clock, Nanos};
use limiter_core::decision::Scope;
use limiter_core::key::LimitKey;

use limiter_proto::limiter::v1 as pb;
use parking_lot::Mutex;

use self::peers::{Peer, Peers};
use self::ring::{GLOBAL_ROOT, Member, Ring, route_root};
use crate::config::{ClusterConfig, Membership};
use crate::convert;
use crate::metrics as m;

/// Where a tenant's (or root key's) requests are decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Placement {
    /// Here.
    Local,
    /// On another node.
    Remote(Member),
    /// Here, once the old owner's counters arrive (a planned move), at most until
    /// this instant.
    Wait {
        /// When to stop waiting.
        until: Nanos,
    },
    /// Here, but the old owner died: nothing is granted until this instant; requests
    /// follow their route's failure policy.
    Fenced {
        /// The fence's end.
        until: Nanos,
    },
}

/// A ring change as this node saw it.
#[derive(Debug, Clone)]
struct Transition {
    at: Nanos,
    before: Arc<Ring>,
    after: Arc<Ring>,
}

/// The ring name a stored counter belongs to.
pub fn ring_name(key: &LimitKey) -> String {
    let k = key.as_ref();
    owner_name(k.scope, k.tenant, k.route)
}

/// The ring name a level of `tenant` on `route` is owned under: the global ceiling's
/// and a route-wide limit's own names (root keys), else the tenant.
pub fn owner_name(scope: Scope, tenant: &str, route: &str) -> String {
    match scope {
        Scope::Global => GLOBAL_ROOT.to_owned(),
        Scope::Route => route_root(route),
        _ => tenant.to_owned(),
    }
}

/// The ring name a lease item is owned under: its tenant, or for a slice, its root
/// key's name.
pub fn lease_name(item: &pb::LeaseItem) -> String {
    match convert::scope_from(item.level) {
        Some(scope) => owner_name(scope, &item.tenant, &item.route),
        None => item.tenant.clone(),
    }
}

/// This node's share of the cluster.
pub struct Cluster {
    me: Member,
    config: ClusterConfig,
    /// Whether counters live here (memory store): moves hand them off, losses fence.
    stateful: bool,
    ring: ArcSwap<Ring>,
    /// While this node hands counters off: the ring it hands them to.
    moving: ArcSwap<Option<Arc<Ring>>>,
    transitions: Mutex<Vec<Transition>>,
    /// Complete handoffs received, by sender, and when.
    handoffs: Mutex<HashMap<Arc<str>, Nanos>>,
    /// Nodes that handed everything off because they are leaving, and when.
    left: Mutex<HashMap<Arc<str>, Nanos>>,
    /// Nodes the membership source lists that may not be in the ring yet (DNS).
    candidates: Mutex<Vec<Arc<str>>>,
    draining: AtomicBool,
    joined: AtomicBool,
    /// When the membership source last answered (for the view-age gauge).
    refreshed: Mutex<Nanos>,
    peers: Peers,
    clock: Arc<dyn Clock>,
    /// How long a dead node's tenants are fenced.
    fence: Nanos,
    slices: slices::Slices,
    /// Decisions on this node's counters hold it shared; taking counters away for a
    /// handoff holds it exclusively, so no decision runs on counters being moved.
    gate: tokio::sync::RwLock<()>,
    replication: Replication,
    /// Lost nodes whose replica this node took over, and when.
    promoted: Mutex<HashMap<Arc<str>, Nanos>>,
    /// Lost nodes whose replica here could not stand for them, and why.
    behind: Mutex<HashMap<Arc<str>, replica::Behind>>,
    /// Tenants already counted as begun afresh (a keyed hash of the name), by the
    /// transition that lost them: looked up on each of their requests, so no name is
    /// copied for it.
    afresh: Mutex<HashSet<(Nanos, u64)>>,
    afresh_key: std::hash::RandomState,
}

/// The most tenants remembered as begun afresh (beyond it the set starts over: a
/// tenant may be counted twice).
const MAX_AFRESH: usize = 100_000;

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("me", &self.me.id)
            .field("ring", &self.ring.load())
            .finish_non_exhaustive()
    }
}

fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Cluster {
    /// This node in a cluster configured by `config`, calling its peers with
    /// `security`; `stateful` for the memory store;
    /// `longest_ttl`: the longest lease TTL the policy can issue.
    pub fn new(
        config: ClusterConfig,
        security: limiter_proto::connect::ClientSecurity,
        stateful: bool,
        clock: Arc<dyn Clock>,
        longest_ttl: Nanos,
    ) -> Self {
        let me = Member {
            id: config.node_id.as_str().into(),
            address: config.advertise.as_str().into(),
            weight: config.weight,
        };
        let fence = if config.fence.is_zero() {
            longest_ttl.max(nanos(config.slice_ttl))
        } else {
            nanos(config.fence)
        };
        // Alone (or before the first view), this node owns everything.
        let ring = Ring::new(0, vec![me.clone()]);
        let single = config.membership == Membership::Single;
        Self {
            replication: Replication::new(&config, stateful, single, 1_000_000),
            promoted: Mutex::default(),
            behind: Mutex::default(),
            afresh: Mutex::default(),
            afresh_key: std::hash::RandomState::new(),
            peers: Peers::new(config.forward_timeout, security),
            slices: slices::Slices::default(),
            gate: tokio::sync::RwLock::new(()),
            me,
            stateful,
            ring: ArcSwap::from_pointee(ring),
            moving: ArcSwap::from_pointee(None),
            transitions: Mutex::default(),
            handoffs: Mutex::default(),
            left: Mutex::default(),
            candidates: Mutex::default(),
            draining: AtomicBool::new(false),
            joined: AtomicBool::new(single),
            refreshed: Mutex::new(clock.now()),
            clock,
            fence,
            config,
        }
    }

    /// Keeps at most `max` counters as replicas of other nodes.
    #[must_use]
    pub fn with_replica_room(mut self, max: usize) -> Self {
        self.replication = Replication::new(&self.config, self.stateful, self.is_single(), max);
        self
    }

    /// Replication of this node's tenants, and its replicas of others'.
    pub fn replication(&self) -> &Replication {
        &self.replication
    }

    /// How long after its last message a lost owner's replica still stands for it:
    /// the time to find a node dead, plus a replication round and its deadline.
    fn replica_current_for(&self) -> Nanos {
        let detect = match &self.config.membership {
            Membership::Registry { ttl, poll, .. } => *ttl + *poll,
            _ => {
                self.config.health_interval * (self.config.fail_after + 1)
                    + self.config.forward_timeout
            }
        };
        nanos(detect + self.config.replication_interval + self.config.replication_timeout)
    }

    /// This node.
    pub fn me(&self) -> &Member {
        &self.me
    }

    /// The configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// The current ring.
    pub fn ring(&self) -> Arc<Ring> {
        self.ring.load_full()
    }

    /// Whether this node is alone (no forwarding, no slices).
    pub fn is_single(&self) -> bool {
        self.config.membership == Membership::Single
    }

    /// Peer clients.
    pub fn peers(&self) -> &Peers {
        &self.peers
    }

    /// Slices of root keys leased from their owners.
    pub fn slices(&self) -> &slices::Slices {
        &self.slices
    }

    /// How long a slice of a root key is asked for (`cluster.slice_ttl_ms`).
    pub fn slice_ttl(&self) -> Nanos {
        nanos(self.config.slice_ttl)
    }

    /// The client of `member`.
    ///
    /// # Errors
    ///
    /// A malformed address.
    pub fn peer(&self, member: &Member) -> Result<Peer, tonic::Status> {
        self.peers.get(&member.address)
    }

    /// Records the nodes the membership source lists (DNS), so that their handoffs are
    /// accepted while their health is still being checked.
    pub(crate) fn set_candidates(&self, ids: Vec<Arc<str>>) {
        *self.candidates.lock() = ids;
    }

    /// Drops the clients of every node but `keep` (members that came and went under
    /// addresses that will not come back).
    pub(crate) fn forget_peers_except<'a>(&self, keep: impl Iterator<Item = &'a Member>) {
        let keep: Vec<&str> = keep.map(|m| &*m.address).collect();
        self.peers.retain(|address| keep.contains(&address));
    }

    /// Whether this node has joined the ring (its first view is in).
    pub fn joined(&self) -> bool {
        self.joined.load(Ordering::Relaxed)
    }

    /// Whether this node is draining.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// The owner of `name` in the current ring (this node when alone).
    pub fn owner_of(&self, name: &str) -> Member {
        self.ring.load().owner(name).cloned().unwrap_or_else(|| self.me.clone())
    }

    /// Where `name`'s requests are decided now.
    pub fn place(&self, name: &str, now: Nanos) -> Placement {
        let ring = self.ring.load();
        // Alone by configuration (or with shared counters) there is nothing to wait for
        // or fence; a cluster's last survivor still fences the tenants it lost.
        if ring.members().len() <= 1
            && self.moving.load().is_none()
            && (self.is_single() || !self.stateful)
        {
            return match ring.owner(name) {
                Some(o) if o.id != self.me.id => Placement::Remote(o.clone()),
                _ => Placement::Local,
            };
        }
        let Some(owner) = ring.owner(name) else { return Placement::Local };
        let moving = self.moving.load();
        if let Some(target) = &**moving {
            let to = target.owner(name).map(|m| m.id.clone());
            if owner.id == self.me.id && to.as_ref().is_none_or(|t| *t != self.me.id) {
                return Placement::Wait { until: now + nanos(self.config.handoff_timeout) };
            }
        }
        let transitions = self.transitions.lock();
        if owner.id != self.me.id {
            // The owner handed its tenants over because it is leaving, and this node
            // has not seen it go yet: the ones it sent here are decided here.
            let changed = transitions.last().map_or(0, |t| t.at);
            let left = self.left.lock().get(&owner.id).is_some_and(|at| *at > changed);
            if left && ring.without(&owner.id).owner(name).is_some_and(|o| o.id == self.me.id) {
                return Placement::Local;
            }
            return Placement::Remote(owner.clone());
        }
        if !self.stateful {
            return Placement::Local;
        }
        let handoff = nanos(self.config.handoff_timeout);
        for t in transitions.iter().rev() {
            let Some(before) = t.before.owner(name) else { continue };
            if before.id == self.me.id || t.after.owner(name).is_none_or(|a| a.id != self.me.id) {
                continue;
            }
            // A handoff counts for a planned move (the old owner stays in the ring) or
            // a drain; for a node lost without handing off, a handoff it sent shortly
            // before (the "nothing held" of its own first view, say) covers nothing.
            let planned = t.after.member(&before.id).is_some();
            let live = ring.member(&before.id).is_some();
            let handed = (planned || self.left.lock().contains_key(&before.id))
                && self.handoffs.lock().get(&before.id).is_some_and(|at| *at + handoff >= t.at);
            if handed {
                return Placement::Local;
            }
            if live {
                // A planned move from a live node: its counters are on their way.
                if now < t.at + handoff {
                    return Placement::Wait { until: t.at + handoff };
                }
            } else if self.stood_in(t, &before.id, name) {
                // The old owner is gone, and its replica here took its place.
                return Placement::Local;
            } else if now < t.at + self.fence {
                // The old owner is gone without handing off: fence.
                return Placement::Fenced { until: t.at + self.fence };
            } else {
                self.began_afresh(t, &before.id, name);
            }
            return Placement::Local;
        }
        Placement::Local
    }

    /// Whether `name`, lost with `lost` in transition `t`, was taken over here from
    /// its replica: this node was its next owner and took `lost`'s replica then.
    fn stood_in(&self, t: &Transition, lost: &str, name: &str) -> bool {
        let handoff = nanos(self.config.handoff_timeout);
        self.promoted.lock().get(lost).is_some_and(|at| *at + handoff >= t.at && *at <= t.at)
            && t.before.owner_without(name, lost).is_some_and(|m| m.id == self.me.id)
    }

    /// Counts `name` (lost with `lost` in `t`, fenced, its fence over) as begun afresh,
    /// once.
    fn began_afresh(&self, t: &Transition, lost: &str, name: &str) {
        use std::hash::BuildHasher as _;
        let id = (t.at, self.afresh_key.hash_one(name));
        let mut seen = self.afresh.lock();
        if seen.contains(&id) {
            return;
        }
        if seen.len() >= MAX_AFRESH {
            seen.clear();
        }
        seen.insert(id);
        drop(seen);
        let next = t.before.owner_without(name, lost);
        let reason = if next.is_some_and(|m| m.id != self.me.id && t.after.member(&m.id).is_none())
        {
            "owner_and_replica_lost"
        } else {
            self.behind.lock().get(lost).map_or("no_replica", |b| b.reason())
        };
        metrics::counter!(m::STATE_RESETS, "reason" => reason).increment(1);
        tracing::info!(node = %self.me.id, tenant = %limiter_core::text::shorten(name), reason, "counters begin afresh after their owner's loss");
    }

    /// Waits (at most the handoff timeout) until this node has joined the ring: before
    /// its first view it cannot know which tenants are its own. False if it has not.
    async fn wait_joined(&self) -> bool {
        let deadline = self.clock.now() + nanos(self.config.handoff_timeout);
        while !self.joined() {
            if self.clock.now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// Like [`Self::place`], waiting out handoffs on their way (and this node's
    /// joining the ring).
    pub async fn settle(&self, name: &str) -> Placement {
        if !self.wait_joined().await {
            return Placement::Fenced { until: self.clock.now() };
        }
        loop {
            let now = self.clock.now();
            match self.place(name, now) {
                Placement::Wait { until } if now < until => {
                    let left = Duration::from_nanos(until - now);
                    tokio::time::sleep(left.min(Duration::from_millis(5))).await;
                }
                Placement::Wait { .. } => {
                    metrics::counter!(m::HANDOFF_TIMEOUTS).increment(1);
                    return Placement::Local;
                }
                p => return p,
            }
        }
    }

    /// Holds off handoffs while a decision runs on this node's counters, once
    /// `tenant`'s counters are here (waiting out a handoff on its way). `Err` when
    /// they are not (fenced, or moved away since the request was routed): the
    /// route's failure policy decides.
    ///
    /// # Errors
    ///
    /// `Unavailable` with the reason.
    pub async fn hold(
        &self,
        tenant: &str,
    ) -> Result<Option<tokio::sync::RwLockReadGuard<'_, ()>>, crate::error::ServerError> {
        if !self.stateful || self.is_single() {
            return Ok(None);
        }
        if !self.wait_joined().await {
            return Err(crate::error::ServerError::Unavailable(
                "this node has not joined the ring yet".into(),
            ));
        }
        loop {
            let guard = self.gate.read().await;
            let now = self.clock.now();
            match self.place(tenant, now) {
                Placement::Local => return Ok(Some(guard)),
                Placement::Wait { until } if now < until => {
                    drop(guard);
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                Placement::Wait { .. } => {
                    metrics::counter!(m::HANDOFF_TIMEOUTS).increment(1);
                    return Ok(Some(guard));
                }
                Placement::Fenced { .. } => {
                    metrics::counter!(m::FENCED_DECISIONS).increment(1);
                    return Err(crate::error::ServerError::Unavailable(
                        "the tenant is fenced after its owner's loss".into(),
                    ));
                }
                Placement::Remote(o) => {
                    return Err(crate::error::ServerError::Unavailable(format!(
                        "the tenant moved to {} while its request was on its way",
                        o.id
                    )));
                }
            }
        }
    }

    /// Records that the membership source answered.
    pub fn refreshed(&self) {
        *self.refreshed.lock() = self.clock.now();
    }

    /// Publishes the ring gauges.
    #[allow(clippy::cast_precision_loss)] // gauge values
    pub fn publish(&self) {
        let ring = self.ring.load();
        metrics::gauge!(m::RING_MEMBERS).set(ring.members().len() as f64);
        metrics::gauge!(m::RING_EPOCH).set(ring.epoch as f64);
        let age = self.clock.now().saturating_sub(*self.refreshed.lock());
        metrics::gauge!(m::MEMBERSHIP_AGE).set(age as f64 / 1e9);
    }

    /// The topology answer for `tenants`.
    pub fn topology(&self, tenants: &[String], ready: bool) -> pb::TopologyResponse {
        let ring = self.ring.load();
        pb::TopologyResponse {
            epoch: ring.epoch,
            members: ring
                .members()
                .iter()
                .map(|m| pb::Member {
                    id: m.id.to_string(),
                    address: m.address.to_string(),
                    weight: m.weight,
                })
                .collect(),
            node_id: self.me.id.to_string(),
            ready,
            draining: self.draining(),
            owners: tenants
                .iter()
                .map(|t| ring.owner(t).map_or_else(String::new, |m| m.id.to_string()))
                .collect(),
            hashing: ring::HASHING.to_owned(),
        }
    }
}
