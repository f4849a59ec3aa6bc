//! Replicas: every tenant's counters and leases kept up to date at the member that
//! would own it next (the second-highest rendezvous score), so that an owner's death
//! costs its tenants no fresh allowance.
//!
//! - The owner side ([`run`]): every `replication_interval`, the counters changed
//!   since the last round (the table tracks them, [`StateTable::take_changes`]) and
//!   the leases opened or settled go, as their state now, to the replica of their
//!   ring name. A lease grant is not answered before its replica has it: its
//!   counters and lease go at once, outside the rounds ([`Replication::send_grants`];
//!   copies are numbered, so a replica keeps the newest whatever the order of
//!   arrival). A replica that is new, that missed a message, or
//!   whose queue passed `replication_queue`, and every replica after a ring change,
//!   gets a full copy. Sending never blocks a decision: a replica that does not
//!   answer only makes its lag grow (exported per peer).
//! - The replica side ([`Replication::receive`]): what each owner sent, not served,
//!   in order (a gap or a restart asks for a full copy); complete once a full copy
//!   made under a ring has arrived whole.
//! - Take-over ([`Replication::take_over`]): when an owner leaves the ring without
//!   handing off, the node that was its tenants' next owner stores the replica's
//!   counters and adopts its leases, and decides at once, if the replica is
//!   complete, current (a message within the detection time) and made under the
//!   ring this node had; otherwise the tenants are fenced as without replicas, and
//!   counted in `limiter_state_resets_total` when they begin afresh.
//!
//! [`StateTable::take_changes`]: limiter_core::table::StateTable::take_changes

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use limiter_core::clock::Nanos;
use limiter_core::table::{Copy, StateTable};
use limiter_proto::limiter::v1 as pb;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use super::ring::Ring;
use super::{Cluster, LocalState, owner_name, ring_name};
use crate::config::ClusterConfig;
use crate::convert;
use crate::metrics as m;

/// Counters (or leases) per replication message.
const PER_MESSAGE: usize = 2_000;

/// A counter's identity on the wire: scope, tenant, route, key, budget.
type CounterId = (i32, String, String, String, u32);

fn counter_id(c: &pb::CounterState) -> CounterId {
    (c.scope, c.tenant.clone(), c.route.clone(), c.key.clone(), c.budget)
}

/// The ring name a replicated counter belongs to.
pub(super) fn counter_name(c: &pb::CounterState) -> Option<String> {
    convert::scope_from(c.scope).map(|s| owner_name(s, &c.tenant, &c.route))
}

fn wire((key, state, version): &Copy) -> Option<pb::CounterState> {
    let k = key.as_ref();
    Some(pb::CounterState {
        scope: convert::scope(k.scope).into(),
        tenant: k.tenant.to_owned(),
        route: k.route.to_owned(),
        key: k.key.to_owned(),
        state: serde_json::to_vec(state).ok()?,
        version: *version,
        budget: u32::from(k.budget),
    })
}

/// Keeps `c` unless a newer copy of its counter is held.
fn keep(counters: &mut HashMap<CounterId, pb::CounterState>, c: &pb::CounterState) {
    match counters.get(&counter_id(c)) {
        Some(held) if held.version > c.version => {}
        _ => {
            counters.insert(counter_id(c), c.clone());
        }
    }
}

/// What the owner keeps for one replica.
#[derive(Debug, Default)]
struct Outgoing {
    /// The number of the next message.
    seq: u64,
    /// The replica needs a full copy, and why.
    full: Option<&'static str>,
    counters: HashMap<CounterId, pb::CounterState>,
    /// Open leases, and `None` for settled ones (with their ring name's replica).
    leases: HashMap<u64, Option<pb::LeaseState>>,
    /// The earliest instant a change waiting here may date from.
    since: Option<Nanos>,
}

impl Outgoing {
    fn queued(&self) -> usize {
        self.counters.len() + self.leases.len()
    }

    fn needs_full(&mut self, why: &'static str) {
        self.full.get_or_insert(why);
        self.counters.clear();
        self.leases.clear();
    }
}

/// What a replica holds from one owner.
#[derive(Debug, Default)]
struct Held {
    /// The number of the next message expected.
    next: u64,
    /// A full copy is arriving.
    syncing: bool,
    /// A full copy arrived whole and nothing was missed since.
    complete: bool,
    /// More than this node keeps for replicas: behind until the next full copy.
    overflowed: bool,
    /// The members of the ring the full copy was made under.
    ring: Vec<String>,
    /// When the last message arrived (this node's clock).
    last_at: Nanos,
    counters: HashMap<CounterId, pb::CounterState>,
    leases: HashMap<u64, pb::LeaseState>,
}

/// Why a lost owner's tenants could not be taken over from a replica here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behind {
    /// Nothing was received from it.
    None,
    /// What was received is incomplete, stale, or made under another ring.
    Behind,
}

impl Behind {
    /// The `limiter_state_resets_total` reason for its tenants.
    pub fn reason(self) -> &'static str {
        match self {
            Self::None => "no_replica",
            Self::Behind => "replica_behind",
        }
    }
}

/// A lost owner's replica, taken over.
#[derive(Debug, Default)]
pub struct TakenOver {
    /// Its counters.
    pub counters: Vec<pb::CounterState>,
    /// Its open leases.
    pub leases: Vec<pb::LeaseState>,
}

/// Leases changed since the replicator last asked.
#[derive(Debug, Default)]
pub struct LeaseChanges {
    /// Open now.
    pub open: Vec<pb::LeaseState>,
    /// Settled: id and ring name.
    pub closed: Vec<(u64, Box<str>)>,
    /// More changed than the book keeps: the replicas need full copies.
    pub overflowed: bool,
}

/// Lease grants waiting to go to one replica: their counters, leases and callers,
/// sent together (grants that arrive while a batch is on its way go in the next).
#[derive(Debug, Default)]
struct Batch {
    counters: Vec<pb::CounterState>,
    leases: Vec<pb::LeaseState>,
    waiting: Vec<tokio::sync::oneshot::Sender<()>>,
    /// A task is sending this replica's batches.
    sending: bool,
}

/// Sends replica `to` the grants waiting for it, batch after batch, until none is.
async fn send_grant_batches(cluster: Arc<Cluster>, to: Arc<str>) {
    let r = cluster.replication();
    loop {
        let batch = {
            let mut grants = r.grants.lock();
            let Some(q) = grants.get_mut(&to) else { return };
            if q.waiting.is_empty() {
                q.sending = false;
                return;
            }
            Batch {
                counters: std::mem::take(&mut q.counters),
                leases: std::mem::take(&mut q.leases),
                waiting: std::mem::take(&mut q.waiting),
                sending: true,
            }
        };
        let peer = cluster.ring().member(&to).and_then(|m| cluster.peer(m).ok());
        let msg = pb::ReplicateRequest {
            from: cluster.me.id.to_string(),
            direct: true,
            counters: batch.counters,
            leases: batch.leases,
            sent_at: cluster.clock.now(),
            ..Default::default()
        };
        let sent = match peer {
            Some(p) => p.replicate(msg, r.timeout).await.map(|_| ()),
            None => Err(tonic::Status::unavailable("not in the ring")),
        };
        let result = if sent.is_ok() { "ok" } else { "failed" };
        metrics::counter!(m::REPLICATION_MESSAGES, "result" => result).increment(1);
        if let Err(e) = sent {
            tracing::debug!(to = %to, "lease grants answered before their replica had them: {e}");
        }
        for w in batch.waiting {
            let _ = w.send(());
        }
    }
}

/// Both sides of replication on one node.
#[derive(Debug)]
pub struct Replication {
    on: bool,
    interval: Duration,
    timeout: Duration,
    queue: usize,
    /// The most counters this node keeps as replicas of others.
    max_held: usize,
    held: Mutex<HashMap<Arc<str>, Held>>,
    /// Lease grants waiting for their replicas, by replica.
    grants: Mutex<HashMap<Arc<str>, Batch>>,
}

impl Replication {
    /// Replication as `config` says, on when the counters live here and there are
    /// other nodes; keeping at most `max_held` counters of others.
    pub fn new(config: &ClusterConfig, stateful: bool, single: bool, max_held: usize) -> Self {
        let on = config.replication && stateful && !single;
        if stateful && !single && !config.replication {
            tracing::warn!(
                "cluster.replication is off: a node's death gives its tenants fresh counters \
                 once their fence ends"
            );
        }
        Self {
            on,
            interval: config.replication_interval,
            timeout: config.replication_timeout,
            queue: config.replication_queue,
            max_held,
            held: Mutex::default(),
            grants: Mutex::default(),
        }
    }

    /// Whether this node replicates.
    pub fn is_on(&self) -> bool {
        self.on
    }

    /// Sends the counters `keys` of `table` as they are now, and the leases just
    /// granted on them, to their replicas at once, and waits (at most the replication
    /// timeout) for the answers: a grant is answered once its replica has it.
    pub async fn send_grants(
        &self,
        cluster: &Arc<Cluster>,
        table: &StateTable,
        keys: &[limiter_core::key::LimitKey],
        leases: Vec<pb::LeaseState>,
    ) {
        if !self.on || keys.is_empty() {
            return;
        }
        let ring = cluster.ring();
        let me = &cluster.me.id;
        let replica_of = |name: &str| -> Option<Arc<str>> {
            (ring.owner(name)?.id == *me)
                .then(|| ring.owner_without(name, me))
                .flatten()
                .map(|m| m.id.clone())
        };
        let refs: Vec<_> = keys.iter().map(|k| k.as_ref()).collect();
        let mut by_replica: HashMap<Arc<str>, Batch> = HashMap::new();
        for copy in table.copies_of(&refs) {
            let (Some(to), Some(c)) = (replica_of(&ring_name(&copy.0)), wire(&copy)) else {
                continue;
            };
            by_replica.entry(to).or_default().counters.push(c);
        }
        for l in leases {
            if let Some(to) = replica_of(&l.tenant) {
                by_replica.entry(to).or_default().leases.push(l);
            }
        }
        let mut answers = Vec::new();
        for (to, mut part) in by_replica {
            let (tx, rx) = tokio::sync::oneshot::channel();
            part.waiting.push(tx);
            answers.push(rx);
            let start = {
                let mut grants = self.grants.lock();
                let q = grants.entry(to.clone()).or_default();
                q.counters.append(&mut part.counters);
                q.leases.append(&mut part.leases);
                q.waiting.append(&mut part.waiting);
                !std::mem::replace(&mut q.sending, true)
            };
            if start {
                tokio::spawn(send_grant_batches(cluster.clone(), to));
            }
        }
        let all = async {
            for rx in answers {
                let _ = rx.await;
            }
        };
        if tokio::time::timeout(self.timeout, all).await.is_err() {
            tracing::debug!("a lease grant was answered before its replica acknowledged it");
        }
    }

    /// Stores what owner `req.from` sent; true to ask it for a full copy.
    ///
    /// # Errors
    ///
    /// A sender that is not a node of this cluster (nothing is stored).
    pub fn receive(&self, cluster: &Cluster, req: &pb::ReplicateRequest) -> Result<bool, String> {
        if !cluster.knows(&req.from) {
            metrics::counter!(m::HANDOFF_REFUSED, "reason" => "sender").increment(1);
            return Err(format!(
                "replica refused: `{}` is not a node of this cluster",
                limiter_core::text::shorten(&req.from)
            ));
        }
        let now = cluster.clock.now();
        let mut held = self.held.lock();
        let others: usize =
            held.iter().filter(|(id, _)| ***id != *req.from).map(|(_, h)| h.counters.len()).sum();
        let h = held.entry(req.from.as_str().into()).or_default();
        if req.direct {
            // A lease grant's: newest copies win whatever the order of arrival.
            if !h.overflowed {
                for c in &req.counters {
                    keep(&mut h.counters, c);
                }
                for l in &req.leases {
                    h.leases.insert(l.id, l.clone());
                }
            }
            return Ok(false);
        }
        h.last_at = now;
        if req.reset {
            *h = Held { next: req.seq, syncing: true, last_at: now, ..Held::default() };
        }
        let in_order = req.seq == h.next || (req.seq + 1 == h.next && !req.reset);
        if !in_order || !(h.complete || h.syncing) {
            let resync = !h.overflowed;
            h.complete = false;
            h.syncing = false;
            return Ok(resync);
        }
        if h.overflowed {
            return Ok(false);
        }
        for c in &req.counters {
            keep(&mut h.counters, c);
        }
        for l in &req.leases {
            h.leases.insert(l.id, l.clone());
        }
        for id in &req.closed_leases {
            h.leases.remove(id);
        }
        h.next = req.seq + 1;
        if others + h.counters.len() > self.max_held {
            tracing::warn!(from = %req.from, held = h.counters.len(), "replica full: behind until the next full copy");
            *h = Held { overflowed: true, last_at: now, next: h.next, ..Held::default() };
            return Ok(false);
        }
        if req.synced {
            h.syncing = false;
            h.complete = true;
            h.ring.clone_from(&req.ring);
            h.ring.sort_unstable();
        }
        Ok(false)
    }

    /// Forgets what `from` sent (it handed its tenants off, or it is back with a new
    /// life whose copy is to come).
    pub fn forget(&self, from: &str) {
        self.held.lock().remove(from);
    }

    /// Takes the replica of lost owner `from`, if it can stand for it: complete,
    /// heard from within `current_for` of `now`, made under `ring` (this node's view
    /// before the loss).
    ///
    /// # Errors
    ///
    /// Why it cannot.
    pub fn take_over(
        &self,
        from: &str,
        ring: &Ring,
        now: Nanos,
        current_for: Nanos,
    ) -> Result<TakenOver, Behind> {
        let Some(h) = self.held.lock().remove(from) else { return Err(Behind::None) };
        let mut ids: Vec<String> = ring.members().iter().map(|m| m.id.to_string()).collect();
        ids.sort_unstable();
        let current = now.saturating_sub(h.last_at) <= current_for;
        if !(h.complete && current && h.ring == ids) {
            tracing::warn!(
                from,
                complete = h.complete,
                current,
                same_ring = h.ring == ids,
                "the replica of a lost node cannot stand for it"
            );
            return Err(Behind::Behind);
        }
        Ok(TakenOver {
            counters: h.counters.into_values().collect(),
            leases: h
                .leases
                .into_values()
                .filter(|l| l.granted_at.saturating_add(l.hold) > now)
                .collect(),
        })
    }

    /// Counters held as replicas of others.
    pub fn held(&self) -> usize {
        self.held.lock().values().map(|h| h.counters.len()).sum()
    }
}

/// The owner side: sends changes to the replicas until `cancel`.
pub async fn run(cluster: Arc<Cluster>, state: Arc<dyn LocalState>, cancel: CancellationToken) {
    let r = cluster.replication();
    if !r.on || state.counters().is_none() {
        return;
    }
    let mut out: HashMap<Arc<str>, Outgoing> = HashMap::new();
    let mut members: Vec<Arc<str>> = Vec::new();
    let mut last_take = cluster.clock.now();
    let mut tick = tokio::time::interval(r.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => {}
        }
        if cluster.joined() {
            last_take = cluster.replicate_round(&state, &mut out, &mut members, last_take).await;
        }
    }
}

impl Cluster {
    /// One round: takes the changes, sends each replica its share (a full copy where
    /// needed); returns when it took them.
    async fn replicate_round(
        self: &Arc<Self>,
        state: &Arc<dyn LocalState>,
        out: &mut HashMap<Arc<str>, Outgoing>,
        members: &mut Vec<Arc<str>>,
        since: Nanos,
    ) -> Nanos {
        let ring = self.ring();
        let me = self.me.id.clone();
        let ids: Vec<Arc<str>> = ring.members().iter().map(|m| m.id.clone()).collect();
        if ids != *members {
            for o in out.values_mut() {
                o.needs_full("ring");
            }
            members.clone_from(&ids);
        }
        out.retain(|id, _| ring.member(id).is_some());
        for id in ids.iter().filter(|id| **id != me) {
            out.entry(id.clone())
                .or_insert_with(|| Outgoing { full: Some("new"), ..Outgoing::default() });
        }
        let now = self.clock.now();
        let table = state.counters().expect("checked by run").table();
        let changes = table.take_changes();
        let leases = state.leases().take_changes();
        if out.is_empty() {
            return now;
        }
        let replica_of = |name: &str| -> Option<Arc<str>> {
            let owner = ring.owner(name)?;
            if owner.id != me {
                return None;
            }
            ring.owner_without(name, &me).map(|m| m.id.clone())
        };
        for copy in &changes {
            let Some(o) = replica_of(&ring_name(&copy.0)).and_then(|to| out.get_mut(&to)) else {
                continue;
            };
            if o.full.is_none()
                && let Some(c) = wire(copy)
            {
                o.counters.insert(counter_id(&c), c);
                o.since.get_or_insert(since);
            }
        }
        for l in leases.open {
            if let Some(o) = replica_of(&l.tenant).and_then(|to| out.get_mut(&to))
                && o.full.is_none()
            {
                o.leases.insert(l.id, Some(l));
                o.since.get_or_insert(since);
            }
        }
        for (id, name) in leases.closed {
            if let Some(o) = replica_of(&name).and_then(|to| out.get_mut(&to))
                && o.full.is_none()
            {
                o.leases.insert(id, None);
                o.since.get_or_insert(since);
            }
        }
        for o in out.values_mut() {
            if leases.overflowed || o.queued() > self.replication.queue {
                o.needs_full("overflow");
            }
            if o.full.is_some() {
                o.since.get_or_insert(since);
            }
        }
        let mut sends = tokio::task::JoinSet::new();
        for (id, o) in out.drain() {
            let (cluster, state, ids) = (self.clone(), state.clone(), ids.clone());
            sends.spawn(async move {
                let o = cluster.send_replica(&state, &id, o, &ids).await;
                (id, o)
            });
        }
        while let Some(done) = sends.join_next().await {
            if let Ok((id, o)) = done {
                publish(&id, &o, self.clock.now());
                out.insert(id, o);
            }
        }
        now
    }

    /// Sends replica `to` what waits for it (or a full copy); returns what is left.
    async fn send_replica(
        &self,
        state: &Arc<dyn LocalState>,
        to: &Arc<str>,
        mut o: Outgoing,
        members: &[Arc<str>],
    ) -> Outgoing {
        let ring = self.ring();
        let Some(peer) = ring.member(to).and_then(|m| self.peer(m).ok()) else { return o };
        let timeout = self.replication.timeout;
        let base = pb::ReplicateRequest { from: self.me.id.to_string(), ..Default::default() };
        if let Some(why) = o.full {
            let me = self.me.id.clone();
            let picks = |name: &str| {
                ring.owner(name).is_some_and(|m| m.id == me)
                    && ring.owner_without(name, &me).is_some_and(|m| m.id == *to)
            };
            let started = self.clock.now();
            let table = state.counters().expect("checked by run").table();
            let counters: Vec<pb::CounterState> =
                table.snapshot_where(|k| picks(&ring_name(k))).iter().filter_map(wire).collect();
            let leases = state.leases().open_where(&picks);
            let chunks =
                counters.len().div_ceil(PER_MESSAGE).max(leases.len().div_ceil(PER_MESSAGE)).max(1);
            let (mut counters, mut leases) = (counters.into_iter(), leases.into_iter());
            for i in 0..chunks {
                let msg = pb::ReplicateRequest {
                    seq: o.seq,
                    reset: i == 0,
                    synced: i + 1 == chunks,
                    counters: counters.by_ref().take(PER_MESSAGE).collect(),
                    leases: leases.by_ref().take(PER_MESSAGE).collect(),
                    ring: if i + 1 == chunks {
                        members.iter().map(ToString::to_string).collect()
                    } else {
                        Vec::new()
                    },
                    sent_at: self.clock.now(),
                    ..base.clone()
                };
                match peer.replicate(msg, timeout).await {
                    Ok(_) => o.seq += 1,
                    Err(e) => {
                        metrics::counter!(m::REPLICATION_MESSAGES, "result" => "failed")
                            .increment(1);
                        tracing::debug!(to = %to, "full copy failed: {e}");
                        return o;
                    }
                }
                metrics::counter!(m::REPLICATION_MESSAGES, "result" => "ok").increment(1);
            }
            metrics::counter!(m::REPLICATION_FULL, "why" => why).increment(1);
            tracing::debug!(to = %to, why, chunks, "full copy sent");
            o.full = None;
            o.since = None;
            record_delay(self.clock.now().saturating_sub(started));
            return o;
        }
        // Changes, oldest state first is not needed: each entry is the newest.
        let mut ids: Vec<CounterId> = o.counters.keys().cloned().collect();
        let mut lease_ids: Vec<u64> = o.leases.keys().copied().collect();
        loop {
            let take_c: Vec<CounterId> = ids.drain(..ids.len().min(PER_MESSAGE)).collect();
            let take_l: Vec<u64> = lease_ids.drain(..lease_ids.len().min(PER_MESSAGE)).collect();
            let mut msg =
                pb::ReplicateRequest { seq: o.seq, sent_at: self.clock.now(), ..base.clone() };
            msg.counters = take_c.iter().filter_map(|id| o.counters.get(id).cloned()).collect();
            for id in &take_l {
                match o.leases.get(id) {
                    Some(Some(l)) => msg.leases.push(l.clone()),
                    Some(None) => msg.closed_leases.push(*id),
                    None => {}
                }
            }
            match peer.replicate(msg, timeout).await {
                Ok(resync) => {
                    metrics::counter!(m::REPLICATION_MESSAGES, "result" => "ok").increment(1);
                    o.seq += 1;
                    for id in &take_c {
                        o.counters.remove(id);
                    }
                    for id in &take_l {
                        o.leases.remove(id);
                    }
                    if resync {
                        o.needs_full("resync");
                        return o;
                    }
                }
                Err(e) => {
                    metrics::counter!(m::REPLICATION_MESSAGES, "result" => "failed").increment(1);
                    tracing::debug!(to = %to, queued = o.queued(), "replication failed: {e}");
                    return o;
                }
            }
            if ids.is_empty() && lease_ids.is_empty() {
                break;
            }
        }
        if let Some(since) = o.since.take() {
            record_delay(self.clock.now().saturating_sub(since));
        }
        o
    }
}

#[allow(clippy::cast_precision_loss)] // seconds as a metric
fn record_delay(nanos: Nanos) {
    metrics::histogram!(m::REPLICATION_DELAY).record(nanos as f64 / 1e9);
}

#[allow(clippy::cast_precision_loss)] // gauge values
fn publish(peer: &str, o: &Outgoing, now: Nanos) {
    let lag = o.since.map_or(0, |s| now.saturating_sub(s));
    metrics::gauge!(m::REPLICATION_LAG, "peer" => peer.to_owned()).set(lag as f64 / 1e9);
    metrics::gauge!(m::REPLICATION_QUEUE, "peer" => peer.to_owned()).set(o.queued() as f64);
}
