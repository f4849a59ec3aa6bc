//! Slices of root keys: a node that decides a tenant whose chain has a level owned by
//! another node (the global ceiling, a route-wide limit) leases units of that level
//! from its owner with the lease protocol the agents use, and spends them locally.
//!
//! - A slice is pre-paid: its owner debited it when granting, so what this node
//!   spends from it can never be spent twice, and every level stays within its
//!   algorithm's bound.
//! - Size follows the demand this node aggregates (about two renewal periods of it,
//!   at least the waiting request's cost); the owner gives at most half of what is
//!   left, less near the limit.
//! - Renewal retires the old slice: what is left of it, and what agents give back
//!   from leases it funded, stays spendable here until its end (spent first), and
//!   its lease is settled, the rest given back, just before (`Slices::settle_due`),
//!   so that nothing agents return lapses here. The cost: a node whose demand falls
//!   hands what is left back at the slice's end rather than at its renewal (settling
//!   a slice at its renewal when half of it or more was left, tried, gave 0.984-0.994
//!   of the ceiling in `cluster_ceiling` against 0.987-0.998).
//! - A slice is spendable until `sent + hold x (1 - margin)` on this node's clock;
//!   the owner writes it off only at `granted + hold`, so this node always stops
//!   first. Agent leases granted from a slice end `LEND_LEAD` before it, so that
//!   what agents give back reaches this node before the slice is settled.
//! - When the owner refuses (the level is exhausted), the refusal (reason, scope,
//!   wait) is remembered for at most a few milliseconds, so a burst of requests does
//!   not turn into a burst of calls.

use std::collections::HashMap;
use std::sync::Arc;
use tracing::Instrument as _;

use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::decision::Scope;
use limiter_core::holder::{Demand, Margin, Refusal};
use limiter_core::policy::{Chain, Level};
use limiter_proto::limiter::v1 as pb;
use parking_lot::Mutex;

use super::ring::Member;
use super::{Cluster, nanos, owner_name};
use crate::convert;
use crate::error::ServerError;
use crate::metrics as m;

/// A slice's identity: the level's scope and, for a route-wide limit, its route.
pub type SliceKey = (Scope, Box<str>, Box<str>);

/// A slice is given up 2% of its hold early.
const MARGIN: Margin = Margin::permille(20);

/// A retired slice's lease is settled this long before its end (two renewal ticks:
/// the settle reaches the owner before the lease lapses there).
const SETTLE_LEAD: Nanos = 200 * 1_000_000;

/// An agent's lease funded by a slice ends this long before the slice (its settle
/// lead and a renewal tick): the agent renews it, giving back what is left, before
/// the slice is settled with its owner, so that nothing it gives back lapses here.
pub const LEND_LEAD: Nanos = SETTLE_LEAD + 100 * 1_000_000;

/// A refusal is remembered at most this long.
const DENIED_FOR: Nanos = 20 * 1_000_000;

/// Demand is measured over periods this long.
const PERIOD: Nanos = 250 * 1_000_000;

/// One slice held by this node.
#[derive(Debug, Default, Clone)]
pub struct Slice {
    /// The owner's lease id (0: none held).
    pub lease_id: u64,
    /// Units left to spend.
    pub units: u64,
    /// Units of the last grant.
    pub granted: u64,
    /// Spendable until (this node's clock).
    pub until: Nanos,
    /// The owner's last refusal, while it stands (and whether it was the class's
    /// share that refused).
    pub denied: Option<Refusal<bool>>,
    /// Units per second this node spends from it, updated every [`PERIOD`].
    demand: Demand,
    /// Last time a request needed this slice.
    pub last_used: Nanos,
    /// Units of earlier slices: what was left of a slice when it was renewed, and
    /// what agents gave back from leases an earlier slice funded. Spendable until
    /// that slice's end (never later), spent first.
    carry: Vec<Carry>,
}

/// Units of an earlier slice.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Carry {
    /// Spendable until (the slice's end).
    until: Nanos,
    units: u64,
    /// The owner's lease of that slice while it is open there (0: settled). A slice
    /// renewed is not settled at once: agents give back units it funded until its
    /// end, and what is left then goes back to the owner (settled as its end nears,
    /// [`Slices::settle_due`]) instead of lapsing here.
    lease: u64,
}

impl Carry {
    /// Whether it is still worth keeping at `now`: spendable, with units left or a
    /// lease still to settle.
    fn kept(&self, now: Nanos) -> bool {
        now < self.until && (self.units > 0 || self.lease != 0)
    }
}

impl Slice {
    fn live(&self, now: Nanos) -> bool {
        self.lease_id != 0 && now < self.until
    }

    /// Units spendable now: the balance and what was carried over.
    fn available(&mut self, now: Nanos) -> u64 {
        self.available_until(now, now)
    }

    /// Units spendable now and still at `from` (an agent's lease is lent only what
    /// it can spend for a while): the balance and what was carried over.
    fn available_until(&mut self, now: Nanos, from: Nanos) -> u64 {
        self.carry.retain(|c| c.kept(now));
        let own = if self.live(now) && self.until > from { self.units } else { 0 };
        own + self.carry.iter().filter(|c| c.until > from).map(|c| c.units).sum::<u64>()
    }

    /// Spends `n` of what is available and still spendable at `from` (carried units
    /// first, soonest ending first); returns the earliest end among the units spent.
    fn spend(&mut self, mut n: u64, now: Nanos, from: Nanos) -> Nanos {
        self.carry.sort_unstable_by_key(|c| c.until);
        let mut until = Nanos::MAX;
        for c in &mut self.carry {
            if n == 0 {
                break;
            }
            if c.until <= from || c.until <= now {
                continue;
            }
            let k = n.min(c.units);
            c.units -= k;
            n -= k;
            if k > 0 {
                until = until.min(c.until);
            }
        }
        if n > 0 {
            self.units -= n;
            until = until.min(self.until);
        }
        self.note_spend(0, now);
        until
    }

    fn note_spend(&mut self, units: u64, now: Nanos) {
        if now.saturating_sub(self.demand.since()) >= PERIOD {
            self.demand.update(now);
        }
        self.demand.spend(units);
        self.last_used = now;
    }

    /// Units per second this node spends from the slice.
    pub fn demand(&self) -> u64 {
        self.demand.rate()
    }
}

/// What taking units from slices found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Take {
    /// Taken from every slice.
    Taken,
    /// This slice needs (more) units from its owner.
    Short(SliceKey),
    /// This slice's owner refused recently: (the slice, the wait left, whether its
    /// class's share refused).
    Denied(SliceKey, Nanos, bool),
}

/// The slices this node holds.
#[derive(Debug, Default)]
pub struct Slices {
    held: Mutex<HashMap<SliceKey, Slice>>,
    fills: Mutex<HashMap<SliceKey, Arc<tokio::sync::Mutex<()>>>>,
    /// Agent leases funded from slices: agent lease id -> the slices and until when
    /// the units they gave may be spent.
    funded: Mutex<HashMap<u64, (Vec<SliceKey>, Nanos)>>,
}

/// The hold of a slice granted for `hold`, less the safety margin, from `sent`.
pub fn spend_until(sent: Nanos, hold: Nanos) -> Nanos {
    MARGIN.spendable_until(sent, hold)
}

impl Slices {
    /// Takes `units` from every slice in `keys` at once, or from none.
    pub fn take(&self, keys: &[SliceKey], units: u64, now: Nanos) -> Take {
        let mut held = self.held.lock();
        for k in keys {
            let s = held.entry(k.clone()).or_default();
            s.last_used = now;
            if let Some(r) = s.denied {
                if let Some(wait) = r.wait(now, 0) {
                    return Take::Denied(k.clone(), wait, r.detail);
                }
                s.denied = None;
            }
            if s.available(now) < units.max(1) {
                return Take::Short(k.clone());
            }
        }
        for k in keys {
            let s = held.get_mut(k).expect("checked above");
            s.spend(units, now, now);
            s.note_spend(units, now);
        }
        Take::Taken
    }

    /// Takes up to `want` (at least `min`) units from every slice in `keys`, for an
    /// agent's lease, of those still spendable at `from` (units that end sooner,
    /// carried from an earlier slice, stay for this node's own decisions: a lease of
    /// a few milliseconds strands them at the agent); returns the units and the
    /// slices' end (the lease's hold must not pass it), or `Short` / `Denied` like
    /// [`Self::take`].
    pub fn take_up_to(
        &self,
        keys: &[SliceKey],
        want: u64,
        min: u64,
        now: Nanos,
        from: Nanos,
    ) -> Result<(u64, Nanos), Take> {
        let mut held = self.held.lock();
        let mut units = want;
        let mut until = Nanos::MAX;
        for k in keys {
            let s = held.entry(k.clone()).or_default();
            s.last_used = now;
            if let Some(r) = s.denied
                && let Some(wait) = r.wait(now, 0)
            {
                return Err(Take::Denied(k.clone(), wait, r.detail));
            }
            let available = s.available_until(now, from.max(now));
            if available < min.max(1) {
                return Err(Take::Short(k.clone()));
            }
            units = units.min(available);
        }
        for k in keys {
            let s = held.get_mut(k).expect("checked above");
            until = until.min(s.spend(units, now, from.max(now)));
            s.note_spend(units, now);
        }
        Ok((units, until))
    }

    /// Puts back `units` taken from `keys` at `now` and not spent (a local level
    /// refused): they may be spent until `until` (what [`Self::take_up_to`] said, or
    /// the current slice's end for [`Self::take`]).
    pub fn give_back(&self, keys: &[SliceKey], units: u64, now: Nanos) {
        if units == 0 {
            return;
        }
        let mut held = self.held.lock();
        for k in keys {
            if let Some(s) = held.get_mut(k)
                && s.live(now)
            {
                // Carried units taken first come back as the slice's own only if
                // they end no earlier: put them back with the earliest carried ones.
                let end = s.carry.iter().map(|c| c.until).min().unwrap_or(s.until).min(s.until);
                match s.carry.iter_mut().find(|c| c.until == end) {
                    Some(c) if end < s.until => c.units += units,
                    _ => s.units += units,
                }
                s.demand.unspend(units);
            }
        }
    }

    /// The lock that makes one refill of `key` at a time.
    pub fn fill_lock(&self, key: &SliceKey) -> Arc<tokio::sync::Mutex<()>> {
        self.fills.lock().entry(key.clone()).or_default().clone()
    }

    /// Retires `key`'s slice before a new one is asked for: what is left of it is
    /// carried, spendable until its end, its lease kept open at the owner (settled
    /// by [`Self::settle_due`]). Returns the slice's demand per second.
    pub fn retire(&self, key: &SliceKey, now: Nanos) -> u64 {
        let mut held = self.held.lock();
        let s = held.entry(key.clone()).or_default();
        if s.live(now) {
            let c = Carry { until: s.until, units: s.units, lease: s.lease_id };
            s.carry.push(c);
        }
        s.lease_id = 0;
        s.units = 0;
        s.demand()
    }

    /// The open leases of retired slices whose end is within `lead` of `now` (every
    /// one when `lead` is `Nanos::MAX`), with their units left, to be settled with
    /// their owners: (slice, lease, units). They are no longer spendable here.
    pub fn settle_due(&self, now: Nanos, lead: Nanos) -> Vec<(SliceKey, u64, u64)> {
        let mut out = Vec::new();
        let mut held = self.held.lock();
        for (k, s) in held.iter_mut() {
            for c in &mut s.carry {
                if c.lease != 0 && c.until <= now.saturating_add(lead) {
                    let units = if now < c.until { c.units } else { 0 };
                    out.push((k.clone(), c.lease, units));
                    c.lease = 0;
                    c.units = 0;
                }
            }
            s.carry.retain(|c| c.kept(now));
        }
        out
    }

    /// Detaches `key`'s balance to return it with the next grant: (lease id, unspent,
    /// demand per second).
    pub fn detach(&self, key: &SliceKey, now: Nanos) -> (u64, u64, u64) {
        let mut held = self.held.lock();
        let s = held.entry(key.clone()).or_default();
        let out = (s.lease_id, if s.live(now) { s.units } else { 0 }, s.demand());
        s.lease_id = 0;
        s.units = 0;
        out
    }

    /// Whether `key` has `units` to spend now and still at `from` (a refill that
    /// raced this one may already have filled it).
    pub fn has(&self, key: &SliceKey, units: u64, now: Nanos, from: Nanos) -> bool {
        self.held
            .lock()
            .get_mut(key)
            .is_some_and(|s| s.available_until(now, from.max(now)) >= units.max(1))
    }

    /// Units `key`'s slice could spend now, and until when (0 and `now`: none held).
    pub fn available(&self, key: &SliceKey, now: Nanos) -> (u64, Nanos) {
        self.held.lock().get_mut(key).map_or((0, now), |s| (s.available(now), s.until.max(now)))
    }

    /// Installs a grant for `key`.
    pub fn install(&self, key: &SliceKey, lease_id: u64, units: u64, until: Nanos) {
        let mut held = self.held.lock();
        let s = held.entry(key.clone()).or_default();
        s.lease_id = lease_id;
        s.units = units;
        s.granted = units;
        s.until = until;
        s.denied = None;
    }

    /// Records the owner's refusal of `key` for the next `wait` (at most a few ms).
    pub fn deny(&self, key: &SliceKey, now: Nanos, wait: Nanos, by_share: bool) {
        let mut held = self.held.lock();
        let s = held.entry(key.clone()).or_default();
        s.denied = Some(Refusal::new(now, wait, DENIED_FOR, 0, by_share));
    }

    /// Slices due for renewal: low (under a quarter of the last grant), near their
    /// end, or idle (to be returned: `want` 0).
    pub fn due(&self, now: Nanos, idle_after: Nanos) -> Vec<(SliceKey, bool)> {
        let held = self.held.lock();
        held.iter()
            .filter(|(_, s)| s.lease_id != 0)
            .filter_map(|(k, s)| {
                let idle = now.saturating_sub(s.last_used) >= idle_after;
                let low = s.units < s.granted / 4;
                let ending = s.until.saturating_sub(now)
                    < (s.until.saturating_sub(s.demand.since())).min(NANOS_PER_SEC) / 2;
                (idle || low || ending).then(|| (k.clone(), idle))
            })
            .collect()
    }

    /// Every held slice (at shutdown, to return them).
    pub fn all(&self) -> Vec<SliceKey> {
        self.held.lock().iter().filter(|(_, s)| s.lease_id != 0).map(|(k, _)| k.clone()).collect()
    }

    /// Units held in all slices.
    pub fn units(&self) -> u64 {
        self.held.lock().values().map(|s| s.units).sum()
    }

    /// Records that slices `keys` funded agent lease `lease` with units spendable
    /// until `until`.
    pub fn funded(&self, lease: u64, keys: &[SliceKey], until: Nanos) {
        let mut f = self.funded.lock();
        if f.len() > 100_000 {
            f.clear();
        }
        f.insert(lease, (keys.to_vec(), until));
    }

    /// An agent gave back `units` of lease `lease`: they can be spent here again
    /// until the end of the slices that funded them (carried over even when those
    /// slices have been renewed since; never beyond their end).
    pub fn returned(&self, lease: u64, units: u64, now: Nanos) {
        let Some((keys, until)) = self.funded.lock().remove(&lease) else { return };
        if units == 0 || now >= until {
            return;
        }
        let mut held = self.held.lock();
        for k in keys {
            let s = held.entry(k).or_default();
            if s.lease_id != 0 && s.until == until {
                // The slice that funded them is the current one.
                s.units += units;
            } else if let Some(c) = s.carry.iter_mut().find(|c| c.until == until) {
                c.units += units;
            } else {
                s.carry.push(Carry { until, units, lease: 0 });
            }
        }
    }
}

/// Whether a level is a root key (decided by its own owner, not the tenant's).
pub fn is_root(scope: Scope) -> bool {
    matches!(scope, Scope::Global | Scope::Route)
}

/// The root levels of a chain that other nodes own: their slices and owners, in the
/// chain's order.
#[derive(Debug, Default)]
pub struct Remote {
    /// The slices.
    pub keys: Vec<SliceKey>,
    /// Their owners.
    pub owners: Vec<Member>,
}

impl Remote {
    /// Whether every level is this node's.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The owner of slice `key`.
    pub fn owner(&self, key: &SliceKey) -> Option<&Member> {
        self.keys.iter().position(|k| k == key).map(|i| &self.owners[i])
    }

    /// Whether `level` is one of these.
    pub fn holds(&self, level: &Level<'_>) -> bool {
        self.keys.iter().any(|(s, r, _)| *s == level.scope && **r == *level.key.route)
    }
}

impl Cluster {
    /// `chain` split into the levels this node's counters decide and the root
    /// levels other nodes own (none when counters are shared or this node is alone).
    pub fn split<'a>(&self, chain: &Chain<'a>) -> (Chain<'a>, Remote) {
        let mut remote = Remote::default();
        if !self.stateful || self.is_single() || self.ring.load().members().len() <= 1 {
            return (*chain, remote);
        }
        for l in chain.levels().filter(|l| is_root(l.scope)) {
            let owner = self.owner_of(&owner_name(l.scope, "", l.key.route));
            if owner.id != self.me.id {
                // A divided level's slices are per class: the root owner sizes each
                // by its class's share.
                let class = l.rule.shares.as_ref().map_or("", |s| {
                    let (tenant, route, key) = chain.names();
                    &s.classes()[s.class_of(tenant, route, key)].name
                });
                remote.keys.push((l.scope, l.key.route.into(), class.into()));
                remote.owners.push(owner);
            }
        }
        if remote.is_empty() {
            return (*chain, remote);
        }
        (chain.retain_levels(|l| !remote.holds(l)), remote)
    }

    /// Asks `owner` for a fresh slice of `key` (returning what is left of the old
    /// one), unless a concurrent refill already made `cost` available, spendable
    /// still at `from` (0: now).
    ///
    /// # Errors
    ///
    /// `Unavailable` when the owner cannot be reached or no longer owns the key.
    pub async fn refill(
        &self,
        key: &SliceKey,
        owner: &Member,
        cost: u64,
        want: u64,
        from: Nanos,
    ) -> Result<(), ServerError> {
        let lock = self.slices.fill_lock(key);
        let _one = lock.lock().await;
        let now = self.clock.now();
        if self.slices.has(key, cost, now, from) {
            return Ok(());
        }
        // The old slice's lease stays open (its units carried here, and those agents
        // give back, until it is settled near its end): a new lease is asked for.
        let (lease_id, unspent) = (0, 0);
        let demand = self.slices.retire(key, now);
        let ttl = nanos(self.config.slice_ttl);
        // About half a second of this node's demand (or what an agent's grant
        // needs), at least the waiting request.
        let want = (demand / 2).max(want).max(cost).max(1);
        let item = pb::LeaseItem {
            // A root level is no tenant's: the owner resolves it alone.
            tenant: String::new(),
            route: key.1.to_string(),
            key: String::new(),
            lease_id,
            unspent,
            want,
            cost,
            demand_per_sec: demand,
            level: convert::scope(key.0).into(),
            local_permits: false,
            share_class: key.2.to_string(),
            renews_within: None,
            rates: false,
            demand_milli: 0,
            least: 0,
            after_keeps: false,
        };
        let req = pb::LeaseRequest {
            agent_id: format!("node:{}", self.me.id),
            items: vec![item],
            epoch: self.ring.load().epoch,
        };
        let sent = self.clock.now();
        let answer = match self.peer(owner) {
            Ok(p) => p.lease(req, 1).await,
            Err(e) => Err(e),
        };
        let grant = match answer {
            Ok(r) => r.grants.into_iter().next(),
            Err(e) => {
                metrics::counter!(m::SLICE_CALLS, "outcome" => "unreachable").increment(1);
                return Err(ServerError::Unavailable(format!(
                    "root owner {}: {}",
                    owner.id,
                    e.message()
                )));
            }
        };
        let Some(grant) = grant.filter(|g| g.redirect.is_empty()) else {
            metrics::counter!(m::SLICE_CALLS, "outcome" => "redirected").increment(1);
            return Err(ServerError::Unavailable(format!("root owner {} moved", owner.id)));
        };
        if grant.units >= cost && grant.lease_id != 0 {
            let hold = grant.hold.map_or(ttl, |d| convert::nanos_of(&d)).min(ttl);
            self.slices.install(key, grant.lease_id, grant.units, spend_until(sent, hold));
            metrics::counter!(m::SLICE_CALLS, "outcome" => "granted").increment(1);
        } else {
            let wait = grant
                .decision
                .as_ref()
                .and_then(|d| d.retry_after.as_ref())
                .map_or(1_000_000, convert::nanos_of);
            let by_share =
                grant.decision.as_ref().is_some_and(|d| d.reason() == pb::Reason::ShareLimit);
            self.slices.deny(key, self.clock.now(), wait, by_share);
            metrics::counter!(m::SLICE_CALLS, "outcome" => "refused").increment(1);
        }
        #[allow(clippy::cast_precision_loss)] // gauge value
        metrics::gauge!(m::SLICE_UNITS).set(self.slices.units() as f64);
        Ok(())
    }

    /// Renews slices that are low or ending, returns idle ones, and settles retired
    /// slices' leases as their ends near (background).
    pub async fn renew_slices(&self) {
        let now = self.clock.now();
        self.settle_retired(now, SETTLE_LEAD).await;
        for (key, idle) in self.slices.due(now, 2 * PERIOD * 4) {
            let owner = self.owner_of(&owner_name(key.0, "", &key.1));
            let span = crate::trace::span!(
                "slice_renewal",
                scope = ?key.0,
                route = %key.1,
                owner = %owner.id,
                returning = idle,
            );
            async {
                if idle {
                    self.return_slice(&key, &owner).await;
                } else if let Err(e) = self.refill(&key, &owner, 1, 1, 0).await {
                    tracing::debug!("slice renewal: {e}");
                }
            }
            .instrument(span)
            .await;
        }
    }

    /// Returns every slice (at drain), retired ones included.
    pub async fn return_slices(&self) {
        self.settle_retired(self.clock.now(), Nanos::MAX).await;
        for key in self.slices.all() {
            let owner = self.owner_of(&owner_name(key.0, "", &key.1));
            self.return_slice(&key, &owner).await;
        }
    }

    /// Settles with their owners the leases of retired slices ending within `lead`,
    /// giving back their units left (one call per slice).
    async fn settle_retired(&self, now: Nanos, lead: Nanos) {
        let mut by_key: Vec<(SliceKey, Vec<pb::LeaseItem>)> = Vec::new();
        for (key, lease_id, unspent) in self.slices.settle_due(now, lead) {
            let item = give_back_item(&key, lease_id, unspent);
            match by_key.iter_mut().find(|(k, _)| *k == key) {
                Some((_, items)) => items.push(item),
                None => by_key.push((key, vec![item])),
            }
        }
        for (key, items) in by_key {
            let owner = self.owner_of(&owner_name(key.0, "", &key.1));
            self.give_back_to(&owner, items).await;
        }
    }

    async fn return_slice(&self, key: &SliceKey, owner: &Member) {
        let lock = self.slices.fill_lock(key);
        let _one = lock.lock().await;
        let (lease_id, unspent, _) = self.slices.detach(key, self.clock.now());
        if lease_id != 0 {
            self.give_back_to(owner, vec![give_back_item(key, lease_id, unspent)]).await;
        }
    }

    /// Sends `items` (slices given back) to their owner, unless that is this node;
    /// a failure leaves the leases to lapse there.
    async fn give_back_to(&self, owner: &Member, items: Vec<pb::LeaseItem>) {
        if owner.id == self.me.id {
            return;
        }
        let req = pb::LeaseRequest {
            agent_id: format!("node:{}", self.me.id),
            items,
            epoch: self.ring.load().epoch,
        };
        if let Ok(p) = self.peer(owner) {
            let _ = p.lease(req, 1).await;
        }
    }
}

/// The item that settles slice `key`'s lease `lease_id`, giving back `unspent`.
fn give_back_item(key: &SliceKey, lease_id: u64, unspent: u64) -> pb::LeaseItem {
    pb::LeaseItem {
        route: key.1.to_string(),
        lease_id,
        unspent,
        level: convert::scope(key.0).into(),
        share_class: key.2.to_string(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests;
