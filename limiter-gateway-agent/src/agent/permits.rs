//! Local permits: a key's pool of permit blocks ([`crate::pool`]) for the concurrency
//! levels of its chain. Requests take and return permits with atomics; blocks are
//! asked for when the pool runs short (doubling up to `max_permit_block`), renewed
//! at half their TTL while needed, and given back when the pool's peak use over a
//! renewal interval fits without them. Every unit lent here belongs to a block the
//! owner counts as held, so the agents' permits in use never exceed the limit.
//!
//! A pool that lends all it holds is asked each round (one early renewal) whether
//! others were refused lately; if so, the renewed block drains: nothing more is lent
//! from it, and it goes back once what runs fits in the rest. Freed permits go to
//! whoever asks the owner first, so agents that wait are served within rounds, not
//! when the busy ones idle. A pool that gave a block back because others wait does
//! not ask for one again for [`YIELD`]: its own next request would otherwise reach
//! the owner first (its release and its ask leave together) and take the same
//! permits back, and the agents that wait would never see them.
//!
//! A refused pool waits in the owner's line for its levels: it sends the turn the
//! refusal gave with its next ask, and the permits that come back go to the pools
//! that have waited longest (agents that retry in step would otherwise race, and the
//! same one would lose every time).

use super::*;
use crate::pool::PermitPool;
use crate::slot::Spend;
use limiter_core::Reason;
use limiter_core::holder::Margin;
use limiter_proto::limiter::v1 as pb;
use std::sync::Weak;
use std::sync::atomic::{AtomicBool, AtomicU8};

/// How long a pool that gave a block back to agents that wait holds its own asks
/// (its requests wait that long for a permit, then ask as everyone else does).
const YIELD: std::time::Duration = std::time::Duration::from_millis(20);

/// The pool does not decide (the chain has no concurrency level, or the owner does
/// not lease it).
const OFF: u8 = 0;
/// Requests take a permit here and units from the key's balance.
const WITH_UNITS: u8 = 1;
/// The chain has nothing but concurrency levels: a permit is the whole decision.
const ONLY: u8 = 2;

/// A key's pool: the atomics the hot path uses, and its blocks.
#[derive(Debug, Default)]
pub(super) struct Pool {
    pub(super) atomics: PermitPool,
    /// Local decisions taken through a [`PermitHandle`] (which skips the key's
    /// lookup and its shard's count), counted beside the atomics it has just written.
    pub(super) handle_hits: AtomicU64,
    mode: AtomicU8,
    blocks: Mutex<Blocks>,
    /// One request asks for a block at a time (the others wait, then look again).
    growing: tokio::sync::Mutex<()>,
    /// When the owner last refused a block (asks are then the request's cost).
    refused_at: AtomicU64,
    /// A block drains: a returned permit wakes the pool's task to give it back.
    draining: AtomicBool,
    wake: tokio::sync::Notify,
    /// When the pool last gave a block back because others waited.
    yielded_at: AtomicU64,
    /// The pool's place in the owner's line for its levels' permits (0: none).
    turn: AtomicU64,
}

#[derive(Debug, Default)]
struct Blocks {
    held: Vec<Block>,
    /// The pool's task is running (it ends when no block is held).
    tending: bool,
}

#[derive(Debug)]
struct Block {
    id: String,
    units: u64,
    /// When it was issued (agent clock, when asked for).
    since: Nanos,
    /// Renewed from then (half its TTL).
    renew_at: Nanos,
    /// Ours until then (agent clock, less the margin).
    ends: Nanos,
    /// Others wait for permits of its levels: nothing more is lent from it (its
    /// units are out of the pool's capacity); it goes back once what is in use fits
    /// in the rest, and is renewed until then.
    draining: bool,
}

impl Pool {
    /// Whether requests take permits here, and whether a permit is all they need.
    #[inline]
    pub(super) fn mode(&self) -> Option<bool> {
        match self.mode.load(Ordering::Relaxed) {
            WITH_UNITS => Some(false),
            ONLY => Some(true),
            _ => None,
        }
    }

    /// What the owner said of the key's chain in a grant.
    pub(super) fn set_mode(&self, permits: bool, only: bool) {
        let m = match (permits, only) {
            (false, _) => OFF,
            (true, false) => WITH_UNITS,
            (true, true) => ONLY,
        };
        self.mode.store(m, Ordering::Relaxed);
    }

    /// Returns `units` lent; wakes the pool's task when a block drains.
    #[inline]
    fn give(&self, units: u64) {
        self.atomics.release(units);
        if self.draining.load(Ordering::Relaxed) {
            self.wake.notify_one();
        }
    }

    /// Units the blocks hold and units in use.
    pub(super) fn units(&self) -> (u64, u64) {
        self.atomics.units()
    }

    /// Takes out the draining blocks that what is in use no longer needs (what runs
    /// beyond the capacity runs on the draining blocks still held), for release.
    fn drained(&self, b: &mut Blocks) -> Vec<String> {
        let mut draining: u64 = b.held.iter().filter(|k| k.draining).map(|k| k.units).sum();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.held.len() {
            let k = &b.held[i];
            let (cap, used) = self.atomics.units();
            if k.draining && used <= cap + draining - k.units {
                draining -= k.units;
                out.push(b.held.remove(i).id);
            } else {
                i += 1;
            }
        }
        self.draining.store(draining > 0, Ordering::Relaxed);
        out
    }

    /// Notes that blocks went back to agents that wait (at `now`).
    fn yielded(&self, now: Nanos) {
        self.yielded_at.store(now.max(1), Ordering::Relaxed);
    }

    /// Drops the blocks ended by `now` (their units are the owner's again) and sets
    /// the pool's deadline to the earliest end left.
    fn tidy(&self, b: &mut Blocks, now: Nanos) {
        b.held.retain(|k| {
            let live = k.ends > now;
            if !live && !k.draining {
                self.atomics.lose(k.units);
            }
            live
        });
        self.atomics.set_deadline(b.held.iter().map(|k| k.ends).min().unwrap_or(0));
    }
}

/// A permit taken from the agent's local pool for one request: returned when
/// released or dropped (whichever comes first; once).
pub struct LocalPermit {
    slot: Arc<Slot>,
    units: AtomicU64,
}

impl LocalPermit {
    /// Returns the permit to the pool; false if it was returned already.
    pub fn release(&self) -> bool {
        let units = self.units.swap(0, Ordering::AcqRel);
        if units > 0
            && let Some(p) = self.slot.pool.get()
        {
            p.give(units);
        }
        units > 0
    }

    /// Units it holds (0 once returned).
    pub fn units(&self) -> u64 {
        self.units.load(Ordering::Relaxed)
    }

    /// How long the pool's blocks are ours from `now` (renewed while permits are in
    /// use; 0 once they lapsed: the request then runs uncounted at the owner).
    pub(super) fn expires_in(&self, now: Nanos) -> Nanos {
        self.slot.pool.get().map_or(0, |p| p.atomics.deadline().saturating_sub(now))
    }
}

impl Drop for LocalPermit {
    fn drop(&mut self) {
        self.release();
    }
}

impl std::fmt::Debug for LocalPermit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalPermit").field("units", &self.units()).finish_non_exhaustive()
    }
}

impl PartialEq for LocalPermit {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

impl Eq for LocalPermit {}

/// A key's pool held by the caller, as one holds a semaphore: permits taken through
/// it skip the key's lookup. Made by [`super::Agent::permit_handle`] once the key has
/// a pool (after its first [`super::Agent::decide`]). When it finds nothing (the pool
/// must grow, the key's units are spent, or the key was forgotten after idling),
/// [`super::Agent::decide`] asks the owner.
pub struct PermitHandle {
    pub(super) agent: super::Agent,
    pub(super) slot: Arc<Slot>,
}

impl PermitHandle {
    /// A permit of `cost` from the pool (and `cost` units of the key's balance when
    /// its chain has other levels), or `None` when the owner is needed. No
    /// allocation, no reference count: one clock read, one CAS to take, an add to
    /// count the decision (in the pool, beside what the CAS wrote), one subtraction
    /// to give back.
    #[inline]
    pub fn try_acquire(&self, cost: u64) -> Option<HandlePermit<'_>> {
        let pool = self.slot.pool.get()?;
        let only = pool.mode()?;
        let inner = &self.agent.inner;
        let now = inner.clock.now();
        if !pool.atomics.acquire(now, cost) {
            return None;
        }
        let permit = HandlePermit { pool, units: cost };
        if only {
            self.slot.balance.hit(now);
        } else {
            // Not enough units: the permit goes back as it drops.
            inner.spend(&self.slot, now, cost)?;
        }
        pool.handle_hits.fetch_add(1, Ordering::Relaxed);
        Some(permit)
    }
}

impl std::fmt::Debug for PermitHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (tenant, route, key) = self.slot.key.parts();
        f.debug_struct("PermitHandle")
            .field("tenant", &tenant)
            .field("route", &route)
            .field("key", &key)
            .finish()
    }
}

/// A permit taken through a [`PermitHandle`]: back to the pool when dropped.
pub struct HandlePermit<'a> {
    pool: &'a Pool,
    units: u64,
}

impl HandlePermit<'_> {
    /// Units it holds.
    pub fn units(&self) -> u64 {
        self.units
    }
}

impl Drop for HandlePermit<'_> {
    #[inline]
    fn drop(&mut self) {
        self.pool.give(self.units);
    }
}

impl std::fmt::Debug for HandlePermit<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandlePermit").field("units", &self.units).finish_non_exhaustive()
    }
}

/// What asking for a permit came to.
pub(super) enum Took {
    /// A permit, and whether a block was asked for it.
    Permit(LocalPermit, bool),
    /// The request's answer without a permit: the owner's refusal, or the failure
    /// policy's decision.
    Answer(Outcome),
    /// The chain has no concurrency level any more: decided without a permit.
    Off,
}

impl Slot {
    /// Takes `units` permits from the key's pool at `now`, if it has them.
    #[inline]
    pub(super) fn take_permit(self: &Arc<Self>, now: Nanos, units: u64) -> Option<LocalPermit> {
        let p = self.pool.get()?;
        p.atomics
            .acquire(now, units)
            .then(|| LocalPermit { slot: self.clone(), units: AtomicU64::new(units) })
    }

    /// Says whether the key's chain has concurrency levels held in its pool, and
    /// whether a permit is all its requests need.
    pub(super) fn set_permits(&self, permits: bool, only: bool) {
        self.pool.get_or_init(Box::default).set_mode(permits, only);
        self.balance.set_needs_permit(permits);
    }

    /// Whether the pool holds nothing and lends nothing (the key may be forgotten).
    pub(super) fn pool_empty(&self) -> bool {
        self.pool.get().is_none_or(|p| p.units() == (0, 0))
    }
}

impl Outcome {
    /// An admission holding `permit` (taken at `now`).
    pub(super) fn with_local(mut self, permit: LocalPermit, now: Nanos) -> Self {
        self.permit = Some(Permit::local(permit, now));
        self
    }
}

impl Permit {
    pub(super) fn local(permit: LocalPermit, now: Nanos) -> Self {
        Self {
            id: String::new(),
            tenant: String::new(),
            route: String::new(),
            key: String::new(),
            expires_in: permit.expires_in(now),
            local: Some(Arc::new(permit)),
        }
    }
}

impl Inner {
    /// Spends `cost` from the key's balance (the lease's fast path): the units left.
    #[inline]
    pub(super) fn spend(&self, slot: &Arc<Slot>, now: Nanos, cost: u64) -> Option<u64> {
        match slot.balance.try_spend(now, cost) {
            Spend::Hit { remaining, renew } => {
                if renew {
                    // Once per grant: renewed in the renewer's next round.
                    self.schedule.want(slot);
                }
                Some(remaining)
            }
            Spend::Miss => None,
        }
    }

    /// A permit from the key's pool and, unless the permit is the whole decision
    /// (`only`), units from its balance: the permit and the units left.
    #[inline]
    pub(super) fn take_local(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        now: Nanos,
        cost: u64,
        only: bool,
    ) -> Option<(LocalPermit, u64)> {
        let permit = slot.take_permit(now, cost)?;
        if let Some(pool) = slot.pool.get() {
            // Served here: a place in the owner's line is waited in no longer.
            self.give_up_place(slot, pool);
        }
        if only {
            slot.balance.hit(now);
            return Some((permit, 0));
        }
        // Not enough units: the permit goes back as it drops.
        let remaining = self.spend(slot, now, cost)?;
        Some((permit, remaining))
    }

    /// The slow path of a key with a pool: its permit first (from the pool, or a new
    /// block), then its units (the lease's slow path); a refusal returns the permit.
    pub(super) async fn pooled(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        cost: u64,
    ) -> Result<Outcome, AgentError> {
        let (permit, called) = match self.permit(slot, cost).await? {
            Took::Permit(p, called) => {
                if called {
                    self.stats[SLOW].fetch_add(1, Ordering::Relaxed);
                }
                (p, called)
            }
            Took::Answer(o) => return Ok(o),
            Took::Off => return self.slow(slot, cost).await,
        };
        let now = self.clock.now();
        match slot.pool.get().and_then(Pool::mode) {
            Some(true) => {
                slot.balance.hit(now);
                if !called {
                    self.slots.count(slot);
                }
                return Ok(Outcome::local(0).with_local(permit, now));
            }
            Some(false) => {}
            // The chain lost its concurrency level meanwhile.
            None => return self.slow(slot, cost).await,
        }
        if let Some(remaining) = self.spend(slot, now, cost) {
            if !called {
                self.slots.count(slot);
            }
            return Ok(Outcome::local(remaining).with_local(permit, now));
        }
        let o = self.slow(slot, cost).await?;
        // A direct decision holds the owner's own permit: the pool's goes back.
        Ok(if o.allowed && o.permit.is_none() && o.source != Source::Fallback {
            o.with_local(permit, self.clock.now())
        } else {
            o
        })
    }

    /// An admission `o` of a key whose first grant said its chain has a concurrency
    /// level: with its permit, or the permit's refusal instead.
    pub(super) async fn with_permit(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        o: Outcome,
        cost: u64,
    ) -> Result<Outcome, AgentError> {
        if slot.pool.get().and_then(Pool::mode).is_none() {
            return Ok(o);
        }
        Ok(match self.permit(slot, cost).await? {
            Took::Permit(p, _) => o.with_local(p, self.clock.now()),
            Took::Answer(refused) => refused,
            Took::Off => o,
        })
    }

    /// A permit for a request of `cost` on `slot`'s key: from the pool, or from a new
    /// block the owner issues (twice the pool's size up to `max_permit_block`, or the
    /// cost when the owner refused one a moment ago or this one).
    pub(super) async fn permit(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        cost: u64,
    ) -> Result<Took, AgentError> {
        let pool = slot.pool.get_or_init(|| Box::new(Pool::default()));
        if let Some(p) = slot.take_permit(self.clock.now(), cost) {
            return Ok(self.served_here(slot, pool, p));
        }
        let _one = pool.growing.lock().await;
        let now = self.clock.now();
        if let Some(p) = slot.take_permit(now, cost) {
            return Ok(self.served_here(slot, pool, p));
        }
        // Gave a block back to agents that wait: they ask first.
        let yielded = pool.yielded_at.load(Ordering::Relaxed);
        let hold = nanos(YIELD);
        let now = if yielded > 0 && now.saturating_sub(yielded) < hold {
            let wait = hold - now.saturating_sub(yielded);
            tokio::time::sleep(std::time::Duration::from_nanos(wait)).await;
            // Meanwhile a permit may have come back here.
            let now = self.clock.now();
            if let Some(p) = slot.take_permit(now, cost) {
                return Ok(self.served_here(slot, pool, p));
            }
            now
        } else {
            now
        };
        if !self.breaker.allow(now) {
            return Ok(Took::Answer(self.fallback(slot.key.route(), cost)));
        }
        let interval = nanos(self.config.renew_interval);
        let refused_lately = now.saturating_sub(pool.refused_at.load(Ordering::Relaxed)) < interval;
        let held = pool.units().0;
        let mut ask = if refused_lately {
            cost
        } else {
            cost.max(held.min(u64::from(self.config.max_permit_block)))
        };
        for _ in 0..3 {
            let sent_at = self.clock.now();
            let turn = pool.turn.load(Ordering::Relaxed);
            let d = match self.ask_block(slot, ask, turn).await {
                Ok(d) => d,
                Err(s) if s.code() == tonic::Code::InvalidArgument => {
                    // The chain lost its concurrency level (a new policy), or the
                    // cost is above its limit.
                    if s.message().contains("permit_block") {
                        slot.set_permits(false, false);
                        return Ok(Took::Off);
                    }
                    return Err(AgentError::Invalid(s.message().to_owned()));
                }
                Err(_) => return Ok(Took::Answer(self.fallback(slot.key.route(), cost))),
            };
            let Some(p) = d.permit.as_ref().filter(|_| d.allowed) else {
                if d.allowed {
                    // The owner's own failure policy admitted it: no permit held.
                    return Ok(Took::Answer(from_owner(&d)));
                }
                pool.refused_at.store(self.clock.now(), Ordering::Relaxed);
                pool.turn.store(d.turn, Ordering::Relaxed);
                if ask > cost {
                    ask = cost;
                    continue;
                }
                return Ok(Took::Answer(from_owner(&d)));
            };
            pool.turn.store(0, Ordering::Relaxed);
            let ttl = duration_nanos(p.expires_in.as_ref());
            self.add_block(slot, pool, p.id.clone(), p.units.max(ask), sent_at, ttl);
            if let Some(p) = slot.take_permit(self.clock.now(), cost) {
                return Ok(Took::Permit(p, true));
            }
            // Others took the new block's units first: ask again.
        }
        Ok(Took::Answer(Outcome::rejected(Reason::LimiterUnavailable, 0, Source::Owner)))
    }

    /// Files a block issued at `sent_at` for `ttl`; starts the pool's task if idle.
    fn add_block(
        self: &Arc<Self>,
        slot: &Arc<Slot>,
        pool: &Pool,
        id: String,
        units: u64,
        sent_at: Nanos,
        ttl: Nanos,
    ) {
        let ends = self.block_end(sent_at, ttl);
        let mut b = pool.blocks.lock();
        // The owner had permits to give: nobody waits now, so the blocks draining
        // for others lend again (what runs on them would otherwise take the new
        // block's units from the request that asked for it).
        for k in b.held.iter_mut().filter(|k| k.draining) {
            k.draining = false;
            pool.atomics.add(k.units, k.ends);
        }
        pool.draining.store(false, Ordering::Relaxed);
        b.held.push(Block {
            id,
            units,
            since: sent_at,
            renew_at: sent_at + ttl / 2,
            ends,
            draining: false,
        });
        pool.atomics.add(units, ends);
        pool.tidy(&mut b, self.clock.now());
        if !b.tending {
            b.tending = true;
            tokio::spawn(tend_loop(Arc::downgrade(self), slot.clone(), self.cancel.clone()));
        }
    }

    fn block_end(&self, sent_at: Nanos, ttl: Nanos) -> Nanos {
        // The configured fraction in thousandths (a fraction of 0 to 1).
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let permille = (self.config.deadline_margin.clamp(0.0, 1.0) * 1_000.0).round() as u64;
        Margin { permille, at_least: 1 }.spendable_until(sent_at, ttl)
    }

    /// One permit-block call, within the RPC timeout (counted on the breaker), holding
    /// the pool's place `turn` in the owner's line (0: none yet).
    async fn ask_block(
        &self,
        slot: &Slot,
        units: u64,
        turn: u64,
    ) -> Result<pb::ShouldAllowResponse, tonic::Status> {
        let (tenant, route, key) = slot.key.parts();
        let req = pb::ShouldAllowRequest {
            tenant: tenant.to_owned(),
            route: route.to_owned(),
            key: key.to_owned(),
            cost: Some(units),
            permit_block: true,
            turn: Some(turn),
            ..Default::default()
        };
        let mut client = self.client.clone();
        self.counted_call(
            async move { client.should_allow(req).await.map(tonic::Response::into_inner) },
        )
        .await
    }

    /// One look at a pool: blocks its peak use did not need go back, blocks at half
    /// their TTL are renewed, lapsed ones are dropped. Returns when to look again
    /// (`None`: no block is held; the task ends).
    async fn tend(&self, slot: &Arc<Slot>, pool: &Pool) -> Option<Nanos> {
        let now = self.clock.now();
        let peak = pool.atomics.take_peak();
        let (spare, due) = {
            let mut b = pool.blocks.lock();
            pool.tidy(&mut b, now);
            // Drained; or not needed: the peak fits without it (largest first).
            let mut spare = pool.drained(&mut b);
            if !spare.is_empty() {
                pool.yielded(now);
            }
            b.held.sort_by_key(|k| std::cmp::Reverse(k.units));
            let mut i = 0;
            while i < b.held.len() {
                let k = &b.held[i];
                let cap = pool.units().0;
                if !k.draining
                    && cap.checked_sub(k.units).is_some_and(|r| r >= peak)
                    && pool.atomics.shrink(k.units)
                {
                    spare.push(b.held.remove(i).id);
                } else {
                    i += 1;
                }
            }
            pool.tidy(&mut b, now);
            let mut due: Vec<String> =
                b.held.iter().filter(|k| k.renew_at <= now).map(|k| k.id.clone()).collect();
            // A pool that lent all it holds may be keeping others waiting: one of
            // its blocks held for a round at least is renewed early to learn whether
            // they are (once a round). A block is never asked about sooner: the
            // pools that wait are given blocks in turn, and one given back after a
            // request or two would leave its pool a sliver of the time the pools
            // that kept theirs for a round had.
            let cap = pool.units().0;
            let round = nanos(self.config.renew_interval);
            if due.is_empty()
                && cap > 0
                && peak >= cap
                && let Some(k) =
                    b.held.iter().find(|k| !k.draining && now.saturating_sub(k.since) >= round)
            {
                due.push(k.id.clone());
            }
            (spare, due)
        };
        for id in spare {
            let _ = self.permit_call(slot, id, false).await;
        }
        for id in due {
            let sent_at = self.clock.now();
            let answer = self.permit_call(slot, id.clone(), true).await;
            let mut b = pool.blocks.lock();
            let Some(k) = b.held.iter_mut().find(|k| k.id == id) else { continue };
            match answer {
                Ok((ttl, contended)) => {
                    k.renew_at = sent_at + ttl / 2;
                    k.ends = self.block_end(sent_at, ttl);
                    if contended && !k.draining {
                        // Others were refused: this block stops lending and goes
                        // back once what runs fits in the rest.
                        k.draining = true;
                        pool.atomics.lose(k.units);
                        pool.draining.store(true, Ordering::Relaxed);
                    }
                }
                // Gone at the owner (it lapsed): its units are lost here too.
                Err(s) if s.code() == tonic::Code::InvalidArgument => k.ends = 0,
                // Unreachable: tried again soon, until it lapses.
                Err(_) => k.renew_at = sent_at + nanos(self.config.probe_interval),
            }
            pool.tidy(&mut b, self.clock.now());
        }
        let b = pool.blocks.lock();
        let renew = b.held.iter().map(|k| k.renew_at).min()?;
        // Looked at every renewal interval for blocks not needed any more, and when
        // a block has been held for a round (to be asked about then, not a round
        // later: each pool's turn with a block lasts as long as the others').
        let round = nanos(self.config.renew_interval);
        let now = self.clock.now();
        let held_a_round =
            b.held.iter().filter(|k| !k.draining).map(|k| k.since + round).filter(|&at| at > now);
        Some(held_a_round.fold(renew.min(now + round), Nanos::min))
    }

    /// Renews (`renew`) or releases a block; a renewal's answer is its new TTL and
    /// whether others wait for its levels' permits.
    async fn permit_call(
        &self,
        slot: &Slot,
        id: String,
        renew: bool,
    ) -> Result<(Nanos, bool), tonic::Status> {
        let (tenant, route, key) = slot.key.parts();
        let (tenant, route, key) = (tenant.to_owned(), route.to_owned(), key.to_owned());
        let mut client = self.client.clone();
        if renew {
            let req = pb::RenewRequest { tenant, route, key, permit: id };
            self.counted_call(
                async move { client.renew(req).await.map(tonic::Response::into_inner) },
            )
            .await
            .map(|r| (duration_nanos(r.expires_in.as_ref()), r.contended))
        } else {
            self.release_call(slot, id, 0).await.map(|()| (0, false))
        }
    }

    /// One `Release` call for `slot`'s key: of block `permit`, or (empty) of nothing
    /// but the place `turn` in the owner's line (0: none).
    async fn release_call(
        &self,
        slot: &Slot,
        permit: String,
        turn: u64,
    ) -> Result<(), tonic::Status> {
        let (tenant, route, key) = slot.key.parts();
        let (tenant, route, key) = (tenant.to_owned(), route.to_owned(), key.to_owned());
        let req = pb::ReleaseRequest { tenant, route, key, permit, turn };
        let mut client = self.client.clone();
        self.counted_call(async move { client.release(req).await.map(tonic::Response::into_inner) })
            .await
            .map(|_| ())
    }

    /// Gives up the pool's place `turn` in the owner's line (it no longer waits:
    /// served by its own blocks, or stopping).
    async fn leave_line(&self, slot: &Slot, turn: u64) {
        if let Err(e) = self.release_call(slot, String::new(), turn).await {
            // Its place lapses at the owner within a fifth of a second.
            tracing::debug!(error = %e, "place in line not given up");
        }
    }

    /// A permit taken from the pool by a request that had to ask: the pool waits no
    /// longer, so its place in the owner's line (if any) is given up, off the
    /// request's path.
    fn served_here(self: &Arc<Self>, slot: &Arc<Slot>, pool: &Pool, p: LocalPermit) -> Took {
        self.give_up_place(slot, pool);
        Took::Permit(p, false)
    }

    /// Gives up the pool's place in the owner's line, if it holds one, off the
    /// request's path: a request served from the pool (on the fast path too) means
    /// the pool waits no longer, and a place kept until it lapses (a fifth of a
    /// second) holds permits that come back for a waiter that is gone. (Outside a
    /// runtime, where the fast path may be called from, the place lapses.)
    #[inline]
    fn give_up_place(self: &Arc<Self>, slot: &Arc<Slot>, pool: &Pool) {
        // Read first: the swap (a write) only where there is a place to give up.
        if pool.turn.load(Ordering::Relaxed) == 0 {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else { return };
        let turn = pool.turn.swap(0, Ordering::Relaxed);
        if turn != 0 {
            let (inner, slot) = (self.clone(), slot.clone());
            rt.spawn(async move { inner.leave_line(&slot, turn).await });
        }
    }

    /// Gives every block of `slot`'s pool back (a stopping gateway).
    pub(super) async fn give_back_blocks(&self, slot: &Slot) {
        let Some(pool) = slot.pool.get() else { return };
        let turn = pool.turn.swap(0, Ordering::Relaxed);
        if turn != 0 {
            self.leave_line(slot, turn).await;
        }
        let ids: Vec<String> = {
            let mut b = pool.blocks.lock();
            let held = std::mem::take(&mut b.held);
            for k in held.iter().filter(|k| !k.draining) {
                pool.atomics.lose(k.units);
            }
            pool.atomics.set_deadline(0);
            held.into_iter().map(|k| k.id).collect()
        };
        for id in ids {
            let _ = self.permit_call(slot, id, false).await;
        }
    }
}

/// A pool's task: tends it while it holds blocks.
async fn tend_loop(inner: Weak<Inner>, slot: Arc<Slot>, cancel: CancellationToken) {
    loop {
        let next = {
            let Some(inner) = inner.upgrade() else { return };
            let Some(pool) = slot.pool.get() else { return };
            match inner.tend(&slot, pool).await {
                Some(at) => at.saturating_sub(inner.clock.now()),
                None => {
                    let mut b = pool.blocks.lock();
                    if b.held.is_empty() {
                        b.tending = false;
                        return;
                    }
                    0
                }
            }
        };
        let Some(pool) = slot.pool.get() else { return };
        let sleep = tokio::time::sleep(std::time::Duration::from_nanos(next.max(1_000_000)));
        tokio::pin!(sleep);
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = &mut sleep => break,
                // A permit came back while a block drains: give back what fits now.
                () = pool.wake.notified() => {
                    let Some(inner) = inner.upgrade() else { return };
                    let drained = pool.drained(&mut pool.blocks.lock());
                    if !drained.is_empty() {
                        pool.yielded(inner.clock.now());
                    }
                    for id in drained {
                        let _ = inner.permit_call(&slot, id, false).await;
                    }
                }
            }
        }
    }
}
