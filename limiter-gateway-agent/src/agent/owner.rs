//! The owner client: the slow path of one key, owner calls, grants installed, the failure policy.

use super::*;
use crate::error::AgentError;
use crate::slot::Spend;
use limiter_core::clock::Nanos;
use limiter_core::holder::{Margin, Refusal};
use limiter_core::ring::{Member, Ring};
use limiter_core::{Decision, Reason};
use limiter_proto::connect::AuthChannel;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use std::sync::Arc;
use std::sync::atomic::Ordering;

impl Inner {
    pub(super) fn item(
        &self,
        slot: &Slot,
        lease_id: u64,
        unspent: u64,
        want: u64,
        cost: u64,
        demand: u64,
    ) -> pb::LeaseItem {
        let (tenant, route, key) = slot.key.parts();
        pb::LeaseItem {
            tenant: tenant.to_owned(),
            route: route.to_owned(),
            key: key.to_owned(),
            lease_id,
            unspent,
            want,
            cost,
            demand_per_sec: demand,
            level: 0,
            local_permits: self.config.local_permits,
            share_class: String::new(),
            // A rationed key is renewed at least this often while used.
            renews_within: Some(duration(self.rationed_every())),
            rates: false,
            demand_milli: 0,
            least: 0,
            after_keeps: false,
        }
    }

    /// One call to the owner, with the RPC timeout; counts failures on the breaker.
    /// With ring routing, one call per owner (at once), each key to its tenant's.
    pub(super) async fn call(
        &self,
        items: Vec<pb::LeaseItem>,
    ) -> Result<Vec<pb::LeaseGrant>, tonic::Status> {
        self.stats[ITEMS].fetch_add(items.len() as u64, Ordering::Relaxed);
        let started = self.clock.now();
        let ring = self.ring.lock().clone();
        let result = match ring {
            Some(ring) => self.call_by_ring(&ring, items).await,
            // Epoch 0: everything goes to one node, which forwards each item to its
            // tenant's owner.
            None => self.send(self.client.clone(), items, 0).await,
        };
        if result.is_ok() {
            self.measured(self.clock.now().saturating_sub(started));
        }
        self.note_health(&result);
        result
    }

    /// One call of another kind (a permit block's), counted like a lease call with
    /// one item, within the RPC timeout.
    pub(super) async fn counted_call<T>(
        &self,
        call: impl std::future::Future<Output = Result<T, tonic::Status>>,
    ) -> Result<T, tonic::Status> {
        self.stats[CALLS].fetch_add(1, Ordering::Relaxed);
        self.stats[ITEMS].fetch_add(1, Ordering::Relaxed);
        let started = self.clock.now();
        let result = match tokio::time::timeout(self.config.rpc_timeout, call).await {
            Ok(r) => r,
            Err(_) => Err(tonic::Status::deadline_exceeded("owner did not answer in time")),
        };
        if result.is_ok() {
            self.measured(self.clock.now().saturating_sub(started));
        }
        self.note_health(&result);
        result
    }

    /// Counts a call's result on the breaker.
    fn note_health<T>(&self, result: &Result<T, tonic::Status>) {
        let healthy = match result {
            Ok(_) => true,
            // A malformed request is ours, not the owner's trouble.
            Err(s) => s.code() == tonic::Code::InvalidArgument,
        };
        if healthy {
            if self.breaker.success() {
                tracing::info!("owner reachable again: leaving fallback mode");
                metrics::gauge!(crate::FALLBACK).set(0.0);
            }
        } else {
            self.stats[FAILED].fetch_add(1, Ordering::Relaxed);
            if self.breaker.failure(self.clock.now()) {
                tracing::warn!("owner unreachable: routes follow their failure policy");
                metrics::gauge!(crate::FALLBACK).set(1.0);
            }
        }
    }

    /// The lease calls of `items` to one node, each within the RPC timeout: one call,
    /// or several at once when there are more items than the owner takes in one.
    pub(super) async fn send(
        &self,
        client: RateLimiterClient<AuthChannel>,
        items: Vec<pb::LeaseItem>,
        epoch: u64,
    ) -> Result<Vec<pb::LeaseGrant>, tonic::Status> {
        let most = self.config.max_items.max(1);
        if items.len() <= most {
            return self.send_one(client, items, epoch).await;
        }
        // Above the owner's items per call: several calls at once, answers in order.
        let mut items = items;
        let mut parts = Vec::with_capacity(items.len().div_ceil(most));
        while !items.is_empty() {
            let rest = items.split_off(most.min(items.len()));
            parts.push(self.send_one(client.clone(), std::mem::replace(&mut items, rest), epoch));
        }
        let mut grants = Vec::new();
        for answer in join_all(parts).await {
            grants.extend(answer?);
        }
        Ok(grants)
    }

    /// One lease call of at most `max_items` items.
    async fn send_one(
        &self,
        mut client: RateLimiterClient<AuthChannel>,
        items: Vec<pb::LeaseItem>,
        epoch: u64,
    ) -> Result<Vec<pb::LeaseGrant>, tonic::Status> {
        self.stats[CALLS].fetch_add(1, Ordering::Relaxed);
        let n = items.len();
        let req = pb::LeaseRequest { agent_id: self.config.agent_id.clone(), items, epoch };
        match tokio::time::timeout(self.config.rpc_timeout, client.lease(req)).await {
            Ok(Ok(r)) if r.get_ref().grants.len() == n => Ok(r.into_inner().grants),
            Ok(Ok(_)) => Err(tonic::Status::internal("owner answered the wrong number of grants")),
            Ok(Err(s)) => Err(s),
            Err(_) => Err(tonic::Status::deadline_exceeded("owner did not answer in time")),
        }
    }

    /// The client of the node at `address`.
    pub(super) fn member(
        &self,
        address: &Arc<str>,
    ) -> Result<RateLimiterClient<AuthChannel>, tonic::Status> {
        let mut members = self.members.lock();
        if let Some(c) = members.get(address) {
            return Ok(c.clone());
        }
        let timeout = self.config.rpc_timeout;
        let channel = self
            .config
            .security
            .connect_lazy(address, |e| e.connect_timeout(timeout).tcp_nodelay(true))
            .map_err(|e| tonic::Status::internal(format!("member {address}: {e}")))?;
        let c = RateLimiterClient::new(channel);
        members.insert(address.clone(), c.clone());
        Ok(c)
    }

    /// Sends each item to its tenant's owner (one call per owner, all at once). An
    /// owner that names another (the ring moved), or that cannot be reached while
    /// others can, gets its items sent through the owner endpoint instead, and the
    /// ring is read again.
    pub(super) async fn call_by_ring(
        &self,
        ring: &Ring,
        items: Vec<pb::LeaseItem>,
    ) -> Result<Vec<pb::LeaseGrant>, tonic::Status> {
        let mut groups: Vec<(Arc<str>, Vec<usize>)> = Vec::new();
        for (i, item) in items.iter().enumerate() {
            let Some(owner) = ring.owner(&item.tenant) else {
                return self.send(self.client.clone(), items, 0).await;
            };
            match groups.iter_mut().find(|(a, _)| *a == owner.address) {
                Some((_, v)) => v.push(i),
                None => groups.push((owner.address.clone(), vec![i])),
            }
        }
        let mut calls = Vec::with_capacity(groups.len());
        for (address, idx) in &groups {
            let client = self.member(address)?;
            let part: Vec<pb::LeaseItem> = idx.iter().map(|&i| items[i].clone()).collect();
            calls.push(self.send(client, part, ring.epoch));
        }
        let mut out: Vec<Option<pb::LeaseGrant>> = vec![None; items.len()];
        let mut redirected = Vec::new();
        // The calls run together; each is bounded by the RPC timeout.
        let answers = join_all(calls).await;
        for ((address, idx), answer) in groups.iter().zip(answers) {
            let via_endpoint = !self.config.owner.trim_end_matches('/').ends_with(&**address);
            match answer {
                Ok(grants) => {
                    for (&i, g) in idx.iter().zip(grants) {
                        if g.redirect.is_empty() {
                            out[i] = Some(g);
                        } else {
                            redirected.push(i);
                        }
                    }
                }
                // An owner out of reach: its keys go through the endpoint, which
                // forwards them or answers by each route's failure policy (one dead
                // owner does not fail the other owners' keys).
                Err(e) if via_endpoint => {
                    tracing::debug!("owner unreachable ({e}); asking through the endpoint");
                    redirected.extend(idx);
                }
                Err(e) => return Err(e),
            }
        }
        if !redirected.is_empty() {
            self.stale.notify_one();
            let part: Vec<pb::LeaseItem> = redirected.iter().map(|&i| items[i].clone()).collect();
            for (&i, g) in redirected.iter().zip(self.send(self.client.clone(), part, 0).await?) {
                out[i] = Some(g);
            }
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Reads the ring from the owner endpoint (kept as it was when that fails).
    pub(super) async fn refresh_ring(&self) {
        let mut client = self.client.clone();
        let call = client.topology(pb::TopologyRequest::default());
        let Ok(Ok(t)) = tokio::time::timeout(self.config.rpc_timeout, call).await else { return };
        let t = t.into_inner();
        if t.members.is_empty() || t.hashing != limiter_core::ring::HASHING {
            return;
        }
        let members = t
            .members
            .into_iter()
            .map(|m| Member { id: m.id.into(), address: m.address.into(), weight: m.weight })
            .collect();
        *self.ring.lock() = Some(Arc::new(Ring::new(t.epoch, members)));
    }

    /// How far ahead of a grant's end its renewal is sent: a round of the renewer
    /// (half `renew_interval`: it may be that late) with a quarter more, and two owner
    /// calls.
    pub(super) fn lead(&self) -> Nanos {
        let round = nanos(self.config.renew_interval) / 2;
        round + round / 4 + 2 * self.rtt.load(Ordering::Relaxed)
    }

    /// Units to ask for: two rounds of the renewer (one `renew_interval`) and the
    /// owner's latency of demand with room for its swings ([`with_swings`]), at
    /// least `cost`; when the key's last grant was cut short, its demand over two
    /// spans without the room (near the limit the owner divides in proportion to the
    /// asks, which must then be in proportion to demand).
    pub(super) fn want(&self, st: &LeaseState, demand_per_sec: u64, cost: u64) -> u64 {
        let span = nanos(self.config.renew_interval) + self.rtt.load(Ordering::Relaxed);
        if st.cut {
            // Its demand over two spans, rounded down (as asks were before rounds):
            // asking more (a second of demand, or the fraction paid with its
            // probability) made nodes hold slices of a divided level their agents
            // did not spend (the cluster ceiling test's floor).
            limiter_core::holder::want(demand_per_sec, 2 * span, cost, u64::MAX)
        } else {
            with_swings(demand_per_sec, span).max(cost)
        }
    }

    /// Counts an owner call's latency into the average.
    fn measured(&self, took: Nanos) {
        let old = self.rtt.load(Ordering::Relaxed);
        let new = if old == 0 { took } else { old - old / 8 + took / 8 };
        self.rtt.store(new, Ordering::Relaxed);
    }

    /// The demand a new key of `tenant` starts from: what the tenant's keys here
    /// spend on average.
    pub(super) fn first_demand(&self, tenant: &str) -> u64 {
        self.tenants.lock().get(tenant).copied().unwrap_or(limiter_core::holder::FIRST_DEMAND)
    }

    /// Counts a key's demand into its tenant's average.
    pub(super) fn tenant_demand(&self, tenant: &str, demand: u64) {
        let mut tenants = self.tenants.lock();
        if let Some(d) = tenants.get_mut(tenant) {
            *d = *d - *d / 8 + demand / 8;
            return;
        }
        // Bounded: past this many tenants the averages start again.
        if tenants.len() >= 10_000 {
            tenants.clear();
        }
        tenants.insert(tenant.into(), demand);
    }

    /// Installs a grant of units (at least one) in the key's balance, which the call
    /// that brought it emptied (its spare units stay); `consume` of them go to the
    /// request that waited for it.
    pub(super) fn install(
        &self,
        slot: &Arc<Slot>,
        st: &mut LeaseState,
        g: &pb::LeaseGrant,
        sent_at: Nanos,
        consume: u64,
    ) {
        // Spent while the call was out (from the spare units): counted at the next
        // renewal.
        st.demand.spend(st.counted.saturating_sub(slot.balance.units()));
        let hold = duration_nanos(g.hold.as_ref());
        // The configured fraction in thousandths (a fraction of 0 to 1).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let permille = (self.config.deadline_margin.clamp(0.0, 1.0) * 1_000.0).round() as u64;
        st.mode = Mode::Leased;
        st.lease_id = g.lease_id;
        st.sent_at = sent_at;
        st.hold = hold;
        st.window_end = g.window_end;
        let deadline = Margin { permille, at_least: 1 }.spendable_until(sent_at, hold);
        let units = g.units - consume;
        // Low water: what the key spends before a renewal sent now comes back, with
        // room for its swings.
        let low = with_swings(st.demand.rate(), self.lead()).min(units);
        slot.balance.install(units, deadline, low);
        st.counted = slot.balance.units();
    }

    /// Takes the key's lease out of its balance: the lease and its unspent units (0
    /// once it has lapsed), for an item that settles it. Spare units stay.
    pub(super) fn take_lease(&self, slot: &Slot, st: &mut LeaseState) -> (u64, u64) {
        let expired = self.clock.now() >= slot.balance.deadline();
        let unspent = slot.balance.clear();
        st.counted = slot.balance.units();
        (std::mem::take(&mut st.lease_id), if expired { 0 } else { unspent })
    }

    /// The item giving back everything the key holds, if it holds a lease; nothing is
    /// spendable afterwards.
    pub(super) fn give_back(&self, slot: &Slot, st: &mut LeaseState) -> Option<pb::LeaseItem> {
        slot.balance.drop_spare();
        let (id, unspent) = self.take_lease(slot, st);
        (id != 0).then(|| self.item(slot, id, unspent, 0, 0, 0))
    }

    /// When the renewer is to look at a key next, as it stands at `now`.
    pub(super) fn next_due(&self, slot: &Slot, st: &LeaseState, now: Nanos) -> When {
        let idle_after = nanos(self.config.idle_after);
        let idle_at = slot.balance.last_used(now).max(now.saturating_sub(idle_after)) + idle_after;
        // Rationed (the owner cut its share, perhaps to nothing): asked again every
        // round while used.
        if st.denied.is_some() && st.cut && idle_at > now {
            // A refusal that lapses before the next round: asked again just ahead of
            // its lapse, so that the answer is here when it does (a request after it
            // would otherwise wait for the owner).
            // A hold-back's lapse may ride a round that comes a little before it
            // (the owner judges shares with slack); a level's refusal would be
            // refused again before its time, and gets a round of its own.
            if let Some(ask) = self.before_lapse(st, now) {
                let at = ask.min(idle_at);
                return if st.held_back { When::near(at) } else { When::at(at) };
            }
            return When::by((now + self.rationed_every()).min(idle_at));
        }
        if st.lease_id == 0 {
            return When::by(slot.balance.last_used(now) + FORGET_AFTER_IDLE * idle_after + 1);
        }
        if st.denied.is_some() {
            return When::by((now + self.rationed_every()).min(idle_at).max(now + 1));
        }
        let (renew_at, exact) = if st.window_end {
            // A grant ending with a window: renewed just past the end (when the
            // owner's next window has begun), not before, or before when it runs low.
            (st.sent_at + st.hold + self.rtt.load(Ordering::Relaxed) + 1_000_000, true)
        } else if self.short(st) {
            // A hold shorter than a renewal's lead (a sliding log's): topped up just
            // before it lapses, two round trips and 2 ms ahead (at least half way).
            let ahead = 2 * self.rtt.load(Ordering::Relaxed) + 2_000_000;
            (slot.balance.deadline().saturating_sub(ahead).max(st.sent_at + st.hold / 2), true)
        } else {
            (slot.balance.deadline().saturating_sub(self.lead()), false)
        };
        let at = renew_at.min(idle_at).max(now + 1);
        if exact { When::at(at) } else { When::by(at) }
    }

    /// When a leased key's refusal by the owner is to be asked about again so that the
    /// answer is back as it lapses: two owner round trips and a millisecond ahead, or
    /// at the lapse when that is too late (an answer to an early ask that said to come
    /// back a moment later), if before the key's next round. A refusal of a holder
    /// past its share near the limit is asked about early with success (a share is
    /// judged with some slack); one that names when a unit is refilled, at its lapse.
    pub(super) fn before_lapse(&self, st: &LeaseState, now: Nanos) -> Option<Nanos> {
        let r = st.denied.as_ref()?;
        let ahead = 2 * self.rtt.load(Ordering::Relaxed) + 1_000_000;
        let at = match r.until.saturating_sub(ahead) {
            early if early > now => early,
            _ => r.until,
        };
        (st.mode == Mode::Leased && at > now && at < now + self.rationed_every()).then_some(at)
    }

    /// How often, at the latest, a rationed key (its share cut near the limit) is
    /// renewed while used: one `renew_interval` (the renewer's rounds, every half of
    /// it, may take it up to a round early). Renewing it every round instead cost the
    /// accuracy test's token buckets their floor (95.5% used).
    pub(super) fn rationed_every(&self) -> Nanos {
        nanos(self.config.renew_interval)
    }

    /// Whether the key's grant is held for less than a renewal's lead (a sliding
    /// log's): renewed just before it lapses rather than a lead ahead.
    pub(super) fn short(&self, st: &LeaseState) -> bool {
        !st.window_end && st.hold <= 2 * self.lead()
    }

    /// The longest a refusal from the owner stands here: `refusal_cap`, within one
    /// renewal round (the key's renewal asks again by then).
    fn refusal_cap(&self) -> Nanos {
        duration_nanos_of(self.config.refusal_cap).min(nanos(self.config.renew_interval))
    }

    /// Keeps the failure policy an owner's answer gives for the key's route, and
    /// whether the key's permits are held in its pool.
    pub(super) fn learn_failure_policy(&self, slot: &Slot, g: &pb::LeaseGrant) {
        if let Some(p) = &g.on_failure {
            self.routes.lock().insert(slot.key.route().into(), failure_policy(p));
        }
        if g.permits || slot.pool.get().is_some() {
            slot.set_permits(g.permits, g.permits_only);
        }
    }

    /// The limit that cut a grant or refused a key's request, kept to answer its like
    /// requests here until the renewer's next round asks again (and never past what
    /// the owner said).
    pub(super) fn rationed(&self, o: &Outcome, now: Nanos) -> Option<Box<Refusal<Outcome>>> {
        let wait = self.refusal_cap().min(o.retry_after);
        (by_a_limit(o) && wait > 0).then(|| {
            let detail = Outcome { retry_after: wait, ..o.clone() };
            Box::new(Refusal::new(now, wait, wait, 1, detail))
        })
    }

    pub(super) fn fallback(&self, route: &str, cost: u64) -> Outcome {
        self.stats[FALLBACK].fetch_add(1, Ordering::Relaxed);
        let policy = self
            .routes
            .lock()
            .get(route)
            .copied()
            .or_else(|| self.config.routes.get(route).copied())
            .unwrap_or(self.config.default_failure);
        match self.ceilings.decide(route, policy, cost, self.clock.rates_now()) {
            Decision::Allowed { remaining, .. } => {
                Outcome { remaining, source: Source::Fallback, ..Outcome::local(remaining) }
            }
            Decision::Rejected { reason, retry_after, .. } => {
                Outcome::rejected(reason, retry_after, Source::Fallback)
            }
        }
    }

    /// The slow path: one owner call for this key (others wait for it, then retry
    /// locally), or a local refusal while the key's share is spent, or the failure
    /// policy.
    pub(super) async fn slow(&self, slot: &Arc<Slot>, cost: u64) -> Result<Outcome, AgentError> {
        // A request that waits here for another's owner call (a renewal out with the
        // balance spent) is not decided locally, whatever the call brings.
        let (mut st, waited) = match self.slots.try_lease(slot) {
            Some(st) => (st, false),
            None => (self.slots.lease(slot).await, true),
        };
        let now = self.clock.now();
        slot.balance.touch(now);
        if let Spend::Hit { remaining, .. } = slot.balance.try_spend(now, cost) {
            if !waited {
                self.slots.count(slot);
            }
            let source = if waited { Source::Granted } else { Source::Local };
            return Ok(Outcome { source, ..Outcome::local(remaining) });
        }
        // The owner refused a request like this one a moment ago, or cut this key's
        // share: the same answer from here, with the wait left, until it lapses.
        if let Some(r) = &st.denied
            && let Some(wait) = r.wait(now, cost)
        {
            let source = if waited { Source::Owner } else { Source::Local };
            let o = Outcome { retry_after: wait, source, ..r.detail.clone() };
            if !waited {
                self.stats[REFUSED].fetch_add(1, Ordering::Relaxed);
            }
            // Refused units are demand too: the next renewal asks for them.
            st.demand.spend(cost);
            return Ok(o);
        }
        self.stats[SLOW].fetch_add(1, Ordering::Relaxed);
        if !self.breaker.allow(now) {
            return Ok(self.fallback(slot.key.route(), cost));
        }
        let (tenant, _, _) = slot.key.parts();
        let fresh = st.mode == Mode::Unknown && st.lease_id == 0;
        let demand = if fresh {
            // A new key: its tenant's keys' demand here (no history of its own).
            st.demand.spend(self.first_demand(tenant).max(cost));
            st.demand.update(now)
        } else {
            let units = slot.balance.units();
            st.demand(now, units, cost)
        };
        let want = if st.mode == Mode::Direct { 0 } else { self.want(&st, demand, cost) };
        // The balance cannot cover the request: what it holds goes back with the call.
        let (id, unspent) = self.take_lease(slot, &mut st);
        let answer = self.call(vec![self.item(slot, id, unspent, want, cost, demand)]).await;
        let now_back = self.clock.now();
        let reply = match answer {
            Ok(grants) => grants.last().cloned(),
            Err(s) if s.code() == tonic::Code::InvalidArgument => {
                return Err(AgentError::Invalid(s.message().to_owned()));
            }
            Err(_) => None,
        };
        // An answer without the grant asked for is the owner's fault: fall back.
        let Some(g) = reply else {
            self.schedule.at(slot, self.next_due(slot, &st, now_back));
            return Ok(self.fallback(slot.key.route(), cost));
        };
        self.learn_failure_policy(slot, &g);
        st.cut = g.units < want;
        st.held_back = g.held_back;
        if g.permits_only {
            // Nothing but concurrency levels: the key's pool decides its requests.
            st.mode = Mode::Leased;
            st.denied = None;
            self.schedule.at(slot, self.next_due(slot, &st, now_back));
            return Ok(Outcome { source: Source::Granted, ..Outcome::local(0) });
        }
        let o = if g.mode() != pb::LeaseMode::Direct && g.units >= cost && g.units > 0 {
            self.install(slot, &mut st, &g, now, cost);
            st.denied = g.decision.as_ref().and_then(|d| self.rationed(&from_owner(d), now));
            Outcome { source: Source::Granted, ..Outcome::local(g.units - cost) }
        } else {
            // A direct decision, or a grant that could not cover the cost.
            st.mode = if g.mode() == pb::LeaseMode::Direct { Mode::Direct } else { Mode::Leased };
            let o = g.decision.as_ref().map_or_else(
                || Outcome::rejected(Reason::LimiterUnavailable, 0, Source::Owner),
                |d| from_owner_for(d, slot),
            );
            let hold = duration_nanos(g.hold.as_ref()).max(st.hold);
            let cap = (hold / REFUSAL_CAP_SHARE).min(self.refusal_cap());
            st.denied = refusal(&o, now, cost, cap).map(Box::new);
            o
        };
        self.schedule.at(slot, self.next_due(slot, &st, now_back));
        Ok(o)
    }
}

/// What of the owner's answer `o` to a request of `cost` at `now` stands for the key's
/// like requests: a refusal by a limit with a wait, kept at most `cap` and never past
/// the wait. A failure policy's refusal, an unknown tenant or an admission leaves
/// nothing.
fn refusal(o: &Outcome, now: Nanos, cost: u64, cap: Nanos) -> Option<Refusal<Outcome>> {
    (by_a_limit(o) && o.retry_after > 0 && cap > 0)
        .then(|| Refusal::new(now, o.retry_after, cap, cost, o.clone()))
}

/// The units a key at `demand_per_sec` spends over `span`, with room for arrivals'
/// swings: the mean, two standard deviations of a Poisson count of that mean, and
/// one unit, rounded up (a key at 1 unit a span holds 4, at 50 holds 66), so that a
/// key at steady demand runs dry before its renewal comes back in about one span in
/// forty.
fn with_swings(demand_per_sec: u64, span: Nanos) -> u64 {
    #[allow(clippy::cast_precision_loss)]
    let mean = demand_per_sec as f64 * span as f64 / limiter_core::clock::NANOS_PER_SEC as f64;
    // Saturating: a float beyond u64's range becomes u64::MAX.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let units = ((mean + 2.0 * mean.sqrt()).ceil() + 1.0) as u64;
    units
}

/// Whether `o` is a refusal by one of the policy's limits.
fn by_a_limit(o: &Outcome) -> bool {
    !o.allowed
        && matches!(
            o.reason,
            Some(
                Reason::GlobalCeiling
                    | Reason::RouteLimit
                    | Reason::TenantLimit
                    | Reason::TenantRouteLimit
                    | Reason::KeyLimit
                    | Reason::ShareLimit
            )
        )
}

fn duration_nanos_of(d: std::time::Duration) -> Nanos {
    Nanos::try_from(d.as_nanos()).unwrap_or(Nanos::MAX)
}
