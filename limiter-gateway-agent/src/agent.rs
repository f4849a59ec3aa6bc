//! The agent: local decisions from leased balances, a slow path to the owner, a
//! background renewer, and the failure policy when the owner cannot be reached.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use limiter_core::clock::{Clock, NANOS_PER_SEC, Nanos};
use limiter_core::failure::{Breaker, EmergencyCeilings};
use limiter_core::policy::FailurePolicy;
use limiter_core::rate::Rate;
use limiter_core::ring::{Member, Ring};
use limiter_core::{Decision, Reason, Scope};
use limiter_proto::connect::AuthChannel;
use limiter_proto::limiter::v1 as pb;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::config::AgentConfig;
use crate::error::AgentError;
use crate::slot::{Balance, Spend};

/// The agent's default clock: the CPU's invariant time-stamp counter where there is
/// one (a few nanoseconds a read, against a system call's twenty), else the OS's
/// monotonic clock. The agent only measures durations on it (its deadlines count
/// from its own send times), so it need not agree with the owner's.
#[derive(Debug, Clone)]
pub struct FastClock {
    clock: quanta::Clock,
    origin: quanta::Instant,
}

impl Default for FastClock {
    fn default() -> Self {
        let clock = quanta::Clock::new();
        let origin = clock.now();
        Self { clock, origin }
    }
}

impl Clock for FastClock {
    fn now(&self) -> Nanos {
        // Never zero: 0 means "no deadline" for a balance.
        u64::try_from(self.clock.now().duration_since(self.origin).as_nanos()).unwrap_or(u64::MAX)
            + 1
    }
}

/// Where a decision was made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// From the local leased balance.
    Local,
    /// By the owner (a grant for a waiting request, or a direct decision).
    Owner,
    /// By the route's failure policy (owner unreachable).
    Fallback,
}

/// A limit as the agent reports it (for headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitInfo {
    /// Its name.
    pub name: String,
    /// Units per window.
    pub quota: u64,
    /// The window.
    pub window: Nanos,
}

/// The agent's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Whether the request goes through.
    pub allowed: bool,
    /// Why not (or, in shadow mode, why it would not have).
    pub reason: Option<Reason>,
    /// The level that decided, when known.
    pub scope: Option<Scope>,
    /// Units left (locally, for a local decision).
    pub remaining: u64,
    /// When rejected: how long until the same request could be admitted.
    pub retry_after: Nanos,
    /// The binding limit, when the owner said.
    pub limit: Option<LimitInfo>,
    /// Where it was decided.
    pub source: Source,
}

impl Outcome {
    fn local(remaining: u64) -> Self {
        Self {
            allowed: true,
            reason: None,
            scope: None,
            remaining,
            retry_after: 0,
            limit: None,
            source: Source::Local,
        }
    }

    fn rejected(reason: Reason, retry_after: Nanos, source: Source) -> Self {
        Self {
            allowed: false,
            reason: Some(reason),
            scope: None,
            remaining: 0,
            retry_after,
            limit: None,
            source,
        }
    }
}

/// One request as the agent sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentRequest<'a> {
    /// Tenant.
    pub tenant: &'a str,
    /// Route.
    pub route: &'a str,
    /// Key, if any.
    pub key: Option<&'a str>,
    /// Units; at least 1.
    pub cost: u64,
}

/// Counters of what the agent did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AgentStats {
    /// Decisions made from the local balance.
    pub local: u64,
    /// Decisions that needed the owner (slow path).
    pub slow: u64,
    /// Decisions made by the failure policy.
    pub fallback: u64,
    /// Calls to the owner (slow path and renewals).
    pub owner_calls: u64,
    /// Calls that failed or timed out.
    pub failed_calls: u64,
}

/// A key's names in one allocation: `tenant`, `route` and `key` back to back.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotKey {
    text: Box<str>,
    tenant_len: u32,
    route_len: u32,
}

impl SlotKey {
    fn new(tenant: &str, route: &str, key: &str) -> Self {
        let text = [tenant, route, key].concat().into_boxed_str();
        let len = |s: &str| u32::try_from(s.len()).unwrap_or(u32::MAX);
        Self { text, tenant_len: len(tenant), route_len: len(route) }
    }

    fn parts(&self) -> (&str, &str, &str) {
        let t = self.tenant_len as usize;
        let r = t + self.route_len as usize;
        (&self.text[..t], &self.text[t..r], &self.text[r..])
    }

    fn route(&self) -> &str {
        self.parts().1
    }
}

/// The borrowed form a request looks a slot up with (no allocation).
#[derive(Hash)]
struct SlotRef<'a> {
    tenant: &'a str,
    route: &'a str,
    key: &'a str,
}

impl SlotRef<'_> {
    fn matches(&self, k: &SlotKey) -> bool {
        k.tenant_len as usize == self.tenant.len()
            && k.route_len as usize == self.route.len()
            && k.text.len() == self.tenant.len() + self.route.len() + self.key.len()
            && k.parts() == (self.tenant, self.route, self.key)
    }
}

impl SlotKey {
    fn as_ref(&self) -> SlotRef<'_> {
        let (tenant, route, key) = self.parts();
        SlotRef { tenant, route, key }
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum Mode {
    #[default]
    Unknown,
    Leased,
    Direct,
}

/// The slow-path side of a key's lease (behind an async mutex: one owner call per
/// key at a time).
#[derive(Debug, Default)]
struct LeaseState {
    lease_id: u64,
    /// Units installed in the balance by the current grant (spent = installed - taken).
    installed: u64,
    sent_at: Nanos,
    hold: Nanos,
    mode: Mode,
    last_renew: Nanos,
    demand_per_sec: u64,
}

/// A key idle this many times `idle_after`, holding nothing, is forgotten.
const FORGET_AFTER_IDLE: u64 = 30;

/// Assumed demand of a key seen for the first time, in units per second.
const FIRST_DEMAND: u64 = 1;

impl LeaseState {
    /// Updates the demand estimate with `spent` units since the last call: the rate
    /// over that time, decaying by half when it drops.
    fn demand(&mut self, now: Nanos, spent: u64) -> u64 {
        if self.last_renew == 0 {
            self.last_renew = now;
            self.demand_per_sec = FIRST_DEMAND.max(spent);
            return self.demand_per_sec;
        }
        let elapsed = now.saturating_sub(self.last_renew).max(1);
        let rate = u128::from(spent) * u128::from(NANOS_PER_SEC) / u128::from(elapsed);
        self.demand_per_sec = u64::try_from(rate).unwrap_or(u64::MAX).max(self.demand_per_sec / 2);
        self.demand_per_sec
    }
}

#[derive(Debug)]
struct Slot {
    balance: Balance,
    key: SlotKey,
    lease: Arc<tokio::sync::Mutex<LeaseState>>,
}

type SlotMap = hashbrown::HashTable<Arc<Slot>>;

/// Shards of the key map: a read is a lock-free load of one shard's map; a new key
/// copies one shard (copy-on-write), a sixty-fourth of the keys.
const SHARDS: usize = 64;

struct Slots {
    shards: Box<[ArcSwap<SlotMap>]>,
    hasher: hashbrown::DefaultHashBuilder,
    write: Mutex<()>,
}

impl Default for Slots {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| ArcSwap::default()).collect(),
            hasher: hashbrown::DefaultHashBuilder::default(),
            write: Mutex::new(()),
        }
    }
}

impl Slots {
    #[inline]
    fn hash(&self, r: &SlotRef<'_>) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(r)
    }

    /// The shard of a hash: its high bits (each map probes with the low ones).
    #[inline]
    fn shard(&self, hash: u64) -> &ArcSwap<SlotMap> {
        &self.shards[(hash >> 58) as usize % SHARDS]
    }

    /// Applies `f` to the key's slot, if there is one, without taking a reference.
    #[inline]
    fn with<T>(&self, r: &SlotRef<'_>, f: impl FnOnce(&Slot) -> T) -> Option<T> {
        let hash = self.hash(r);
        self.shard(hash).load().find(hash, |s| r.matches(&s.key)).map(|s| f(s))
    }

    fn get_or_insert(&self, r: &SlotRef<'_>, make: impl FnOnce() -> Slot) -> Arc<Slot> {
        let hash = self.hash(r);
        let shard = self.shard(hash);
        if let Some(s) = shard.load().find(hash, |s| r.matches(&s.key)) {
            return s.clone();
        }
        let _w = self.write.lock();
        let current = shard.load_full();
        if let Some(s) = current.find(hash, |s| r.matches(&s.key)) {
            return s.clone();
        }
        let slot = Arc::new(make());
        let mut next = SlotMap::clone(&current);
        next.insert_unique(hash, slot.clone(), |s| self.hash(&s.key.as_ref()));
        shard.store(Arc::new(next));
        slot
    }

    fn all(&self) -> Vec<Arc<Slot>> {
        self.shards.iter().flat_map(|s| s.load().iter().cloned().collect::<Vec<_>>()).collect()
    }

    fn remove(&self, slots: &[Arc<Slot>]) {
        let mut by_shard: HashMap<usize, Vec<(u64, &Arc<Slot>)>> = HashMap::new();
        for s in slots {
            let hash = self.hash(&s.key.as_ref());
            by_shard.entry((hash >> 58) as usize % SHARDS).or_default().push((hash, s));
        }
        let _w = self.write.lock();
        for (i, gone) in by_shard {
            let mut next = SlotMap::clone(&self.shards[i].load_full());
            for (hash, s) in gone {
                if let Ok(e) = next.find_entry(hash, |x| Arc::ptr_eq(x, s)) {
                    e.remove();
                }
            }
            self.shards[i].store(Arc::new(next));
        }
    }
}

struct Inner {
    config: AgentConfig,
    clock: Arc<dyn Clock>,
    client: RateLimiterClient<AuthChannel>,
    slots: Slots,
    breaker: Breaker,
    /// Failure policies learned from the owner's grants, by route.
    routes: Mutex<HashMap<Box<str>, FailurePolicy>>,
    /// Emergency ceilings of fail-open routes, by route.
    ceilings: EmergencyCeilings,
    wake: Arc<tokio::sync::Notify>,
    cancel: CancellationToken,
    stats: [AtomicU64; 4],
    /// The ring as the owner endpoint last described it (ring routing only).
    ring: Mutex<Option<Arc<Ring>>>,
    /// Clients of the ring's members, by address.
    members: Mutex<HashMap<Arc<str>, RateLimiterClient<AuthChannel>>>,
    /// Wakes the topology task (a redirect was seen).
    stale: Arc<tokio::sync::Notify>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

const SLOW: usize = 0;
const FALLBACK: usize = 1;
const CALLS: usize = 2;
const FAILED: usize = 3;

/// An embedded rate-limit agent; cheap to clone.
///
/// Dropping every clone stops its background task without returning its leases
/// (like a crash: the owner writes them off at their end); call
/// [`Agent::shutdown`] to give them back first.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent").field("id", &self.inner.config.agent_id).finish_non_exhaustive()
    }
}

fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn duration_nanos(d: Option<&prost_types::Duration>) -> Nanos {
    d.map_or(0, |d| {
        u64::try_from(d.seconds)
            .unwrap_or(0)
            .saturating_mul(NANOS_PER_SEC)
            .saturating_add(u64::try_from(d.nanos).unwrap_or(0))
    })
}

fn reason(r: pb::Reason) -> Option<Reason> {
    Some(match r {
        pb::Reason::Unspecified => return None,
        pb::Reason::GlobalCeiling => Reason::GlobalCeiling,
        pb::Reason::RouteLimit => Reason::RouteLimit,
        pb::Reason::TenantLimit => Reason::TenantLimit,
        pb::Reason::TenantRouteLimit => Reason::TenantRouteLimit,
        pb::Reason::KeyLimit => Reason::KeyLimit,
        pb::Reason::EmergencyCeiling => Reason::EmergencyCeiling,
        pb::Reason::LimiterUnavailable => Reason::LimiterUnavailable,
        pb::Reason::UnknownTenant => Reason::UnknownTenant,
    })
}

fn scope(s: pb::Scope) -> Option<Scope> {
    Some(match s {
        pb::Scope::Unspecified => return None,
        pb::Scope::Global => Scope::Global,
        pb::Scope::Route => Scope::Route,
        pb::Scope::Tenant => Scope::Tenant,
        pb::Scope::TenantRoute => Scope::TenantRoute,
        pb::Scope::Key => Scope::Key,
    })
}

/// The agent's outcome for an owner's decision.
fn from_owner(d: &pb::ShouldAllowResponse) -> Outcome {
    Outcome {
        allowed: d.allowed,
        reason: reason(d.reason()),
        scope: scope(d.scope()),
        remaining: d.remaining,
        retry_after: duration_nanos(d.retry_after.as_ref()),
        limit: d.limit.as_ref().map(|l| LimitInfo {
            name: l.name.clone(),
            quota: l.quota,
            window: duration_nanos(l.window.as_ref()),
        }),
        source: Source::Owner,
    }
}

fn failure_policy(p: &pb::FailurePolicy) -> FailurePolicy {
    let period = duration_nanos(p.emergency_period.as_ref());
    match Rate::try_new(p.emergency_amount, period) {
        Ok(rate) if p.fail_open => FailurePolicy::FailOpen { emergency_ceiling: rate },
        _ => FailurePolicy::FailClosed,
    }
}

impl Agent {
    /// An agent for `config` on the production clock. Connects lazily: the owner
    /// may be down at start (requests then follow their failure policy).
    ///
    /// # Errors
    ///
    /// An invalid owner endpoint.
    pub fn new(config: AgentConfig) -> Result<Self, AgentError> {
        Self::with_clock(config, Arc::new(FastClock::default()))
    }

    /// Like [`Agent::new`] with a given clock. Must be called within a tokio runtime.
    ///
    /// # Errors
    ///
    /// An invalid owner endpoint.
    pub fn with_clock(config: AgentConfig, clock: Arc<dyn Clock>) -> Result<Self, AgentError> {
        let timeout = config.rpc_timeout;
        let channel = config
            .security
            .connect_lazy(&config.owner, |e| e.connect_timeout(timeout).tcp_nodelay(true))
            .map_err(|e| AgentError::Endpoint(format!("{}: {e}", config.owner)))?;
        let client = RateLimiterClient::new(channel);
        let inner = Arc::new(Inner {
            breaker: Breaker::new(
                u64::from(config.breaker_threshold),
                nanos(config.probe_interval),
            ),
            config,
            clock,
            client,
            slots: Slots::default(),
            routes: Mutex::default(),
            ceilings: EmergencyCeilings::default(),
            wake: Arc::new(tokio::sync::Notify::new()),
            cancel: CancellationToken::new(),
            stats: Default::default(),
            ring: Mutex::default(),
            members: Mutex::default(),
            stale: Arc::new(tokio::sync::Notify::new()),
        });
        tokio::spawn(renew_loop(Arc::downgrade(&inner), inner.wake.clone(), inner.cancel.clone()));
        if inner.config.route_by_ring {
            tokio::spawn(topology_loop(
                Arc::downgrade(&inner),
                inner.stale.clone(),
                inner.cancel.clone(),
            ));
        }
        Ok(Self { inner })
    }

    /// What the agent did so far.
    pub fn stats(&self) -> AgentStats {
        let s = |i: usize| self.inner.stats[i].load(Ordering::Relaxed);
        let hits: u64 = self.inner.slots.all().iter().map(|slot| slot.balance.hits()).sum();
        AgentStats {
            local: hits,
            slow: s(SLOW),
            fallback: s(FALLBACK),
            owner_calls: s(CALLS),
            failed_calls: s(FAILED),
        }
    }

    /// Whether the owner is considered unreachable (routes follow their policy).
    pub fn in_fallback(&self) -> bool {
        self.inner.breaker.is_open()
    }

    /// The fast path: a decision from the local balance, or `None` when the owner is
    /// needed. Atomics only: no lock, no allocation, no await.
    #[inline]
    pub fn decide_local(&self, req: &AgentRequest<'_>) -> Option<Outcome> {
        self.spend_local(req).map(Outcome::local)
    }

    /// The fast path at its leanest: spends `req.cost` from the local balance and
    /// returns the units left, or `None` when the owner is needed.
    #[inline]
    pub fn spend_local(&self, req: &AgentRequest<'_>) -> Option<u64> {
        let r = SlotRef { tenant: req.tenant, route: req.route, key: req.key.unwrap_or("") };
        let spend = self
            .inner
            .slots
            .with(&r, |slot| slot.balance.try_spend(self.inner.clock.now(), req.cost))?;
        match spend {
            Spend::Hit { remaining, renew } => {
                if renew {
                    self.inner.wake.notify_one();
                }
                Some(remaining)
            }
            Spend::Miss => None,
        }
    }

    /// Decides a request: locally when the balance allows, else through the owner
    /// (within the RPC timeout), else by the route's failure policy.
    ///
    /// # Errors
    ///
    /// A request that can never succeed (zero cost, empty names, a cost above a
    /// limit's capacity).
    pub async fn decide(&self, req: &AgentRequest<'_>) -> Result<Outcome, AgentError> {
        if req.cost == 0 {
            return Err(AgentError::Invalid("cost must be at least 1".to_owned()));
        }
        if req.tenant.is_empty() || req.route.is_empty() {
            return Err(AgentError::Invalid("tenant and route must not be empty".to_owned()));
        }
        if let Some(o) = self.decide_local(req) {
            return Ok(o);
        }
        let slot = self.slot(req);
        self.inner.slow(&slot, req.cost).await
    }

    fn slot(&self, req: &AgentRequest<'_>) -> Arc<Slot> {
        let r = SlotRef { tenant: req.tenant, route: req.route, key: req.key.unwrap_or("") };
        self.inner.slots.get_or_insert(&r, || {
            let slot = Slot {
                key: SlotKey::new(req.tenant, req.route, r.key),
                balance: Balance::default(),
                lease: Arc::default(),
            };
            slot.balance.touch(self.inner.clock.now());
            slot
        })
    }

    /// Gives every held balance back to the owner (a stopping gateway).
    pub async fn shutdown(&self) {
        self.inner.cancel.cancel();
        let slots = self.inner.slots.all();
        let mut items = Vec::new();
        let mut guards = Vec::new();
        for slot in &slots {
            let mut g = slot.lease.clone().lock_owned().await;
            if g.lease_id != 0 {
                let unspent = slot.balance.clear();
                items.push(self.inner.item(slot, g.lease_id, unspent, 0, 0, 0));
                g.lease_id = 0;
            }
            guards.push(g);
        }
        if !items.is_empty() {
            let _ = self.inner.call(items).await;
        }
    }
}

impl Inner {
    fn item(
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
        }
    }

    /// One call to the owner, with the RPC timeout; counts failures on the breaker.
    /// With ring routing, one call per owner (at once), each key to its tenant's.
    async fn call(&self, items: Vec<pb::LeaseItem>) -> Result<Vec<pb::LeaseGrant>, tonic::Status> {
        self.stats[CALLS].fetch_add(1, Ordering::Relaxed);
        let ring = self.ring.lock().clone();
        let result = match ring {
            Some(ring) => self.call_by_ring(&ring, items).await,
            // Epoch 0: everything goes to one node, which forwards each item to its
            // tenant's owner.
            None => self.send(self.client.clone(), items, 0).await,
        };
        let healthy = match &result {
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
        result
    }

    /// One lease call to one node, within the RPC timeout.
    async fn send(
        &self,
        mut client: RateLimiterClient<AuthChannel>,
        items: Vec<pb::LeaseItem>,
        epoch: u64,
    ) -> Result<Vec<pb::LeaseGrant>, tonic::Status> {
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
    fn member(&self, address: &Arc<str>) -> Result<RateLimiterClient<AuthChannel>, tonic::Status> {
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
    async fn call_by_ring(
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
    async fn refresh_ring(&self) {
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

    /// Units to ask for: two renewal intervals of demand, at least `cost`.
    fn want(&self, demand_per_sec: u64, cost: u64) -> u64 {
        let per_interval = u128::from(demand_per_sec)
            * u128::from(nanos(self.config.renew_interval))
            / u128::from(NANOS_PER_SEC);
        u64::try_from(2 * per_interval).unwrap_or(u64::MAX).max(cost).max(1)
    }

    /// Installs a grant; `consume` units of it go to the request that waited for it.
    fn install(
        &self,
        slot: &Slot,
        st: &mut LeaseState,
        g: &pb::LeaseGrant,
        sent_at: Nanos,
        consume: u64,
    ) {
        if let Some(p) = &g.on_failure {
            self.routes.lock().insert(slot.key.route().into(), failure_policy(p));
        }
        st.last_renew = sent_at;
        st.installed = 0;
        if g.mode() == pb::LeaseMode::Direct {
            st.mode = Mode::Direct;
            st.lease_id = 0;
            slot.balance.clear();
            return;
        }
        st.mode = Mode::Leased;
        st.lease_id = g.lease_id;
        if g.units == 0 {
            slot.balance.clear();
            return;
        }
        let hold = duration_nanos(g.hold.as_ref());
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let margin = (hold as f64 * self.config.deadline_margin) as u64;
        st.sent_at = sent_at;
        st.hold = hold;
        let deadline = sent_at + hold.saturating_sub(margin.max(1));
        st.installed = g.units - consume;
        slot.balance.install(g.units - consume, deadline, (g.units / 4).max(1));
    }

    fn fallback(&self, route: &str, cost: u64) -> Outcome {
        self.stats[FALLBACK].fetch_add(1, Ordering::Relaxed);
        let policy = self
            .routes
            .lock()
            .get(route)
            .copied()
            .or_else(|| self.config.routes.get(route).copied())
            .unwrap_or(self.config.default_failure);
        match self.ceilings.decide(route, policy, cost, self.clock.now()) {
            Decision::Allowed { remaining, .. } => {
                Outcome { remaining, source: Source::Fallback, ..Outcome::local(remaining) }
            }
            Decision::Rejected { reason, retry_after, .. } => {
                Outcome::rejected(reason, retry_after, Source::Fallback)
            }
        }
    }

    /// The slow path: one owner call for this key (others wait for it, then retry
    /// locally), or the failure policy.
    async fn slow(&self, slot: &Arc<Slot>, cost: u64) -> Result<Outcome, AgentError> {
        let mut st = slot.lease.lock().await;
        let now = self.clock.now();
        slot.balance.touch(now);
        if let Spend::Hit { remaining, .. } = slot.balance.try_spend(now, cost) {
            return Ok(Outcome::local(remaining));
        }
        self.stats[SLOW].fetch_add(1, Ordering::Relaxed);
        if !self.breaker.allow(now) {
            return Ok(self.fallback(slot.key.route(), cost));
        }
        let unspent = slot.balance.take();
        // The waiting request is demand too.
        let spent = st.installed.saturating_sub(unspent);
        let demand = st.demand(now, spent + cost);
        let want = if st.mode == Mode::Direct { 0 } else { self.want(demand, cost) };
        let item = self.item(slot, st.lease_id, unspent, want, cost, demand);
        st.lease_id = 0;
        match self.call(vec![item]).await {
            Ok(grants) => {
                // An answer without the grant asked for is the owner's fault: fall back.
                let Some(g) = grants.first() else {
                    return Ok(self.fallback(slot.key.route(), cost));
                };
                if g.mode() == pb::LeaseMode::Direct {
                    self.install(slot, &mut st, g, now, 0);
                    return Ok(g.decision.as_ref().map_or_else(
                        || Outcome::rejected(Reason::LimiterUnavailable, 0, Source::Owner),
                        from_owner,
                    ));
                }
                if g.units >= cost && g.units > 0 {
                    self.install(slot, &mut st, g, now, cost);
                    Ok(Outcome { source: Source::Owner, ..Outcome::local(g.units - cost) })
                } else {
                    self.install(slot, &mut st, g, now, 0);
                    Ok(g.decision.as_ref().map_or_else(
                        || Outcome::rejected(Reason::LimiterUnavailable, 0, Source::Owner),
                        from_owner,
                    ))
                }
            }
            Err(s) if s.code() == tonic::Code::InvalidArgument => {
                Err(AgentError::Invalid(s.message().to_owned()))
            }
            Err(_) => Ok(self.fallback(slot.key.route(), cost)),
        }
    }
}

/// The background renewer: one call in flight to the owner at a time, carrying
/// every key that is due (low on units, half way through its lease, or idle).
async fn renew_loop(inner: Weak<Inner>, wake: Arc<tokio::sync::Notify>, cancel: CancellationToken) {
    let mut jitter: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next_due: Option<Nanos> = None;
    loop {
        let Some((interval, now)) =
            inner.upgrade().map(|i| (nanos(i.config.renew_interval), i.clock.now()))
        else {
            return;
        };
        // xorshift: ±10% jitter without a random-number dependency.
        jitter ^= jitter << 13;
        jitter ^= jitter >> 7;
        jitter ^= jitter << 17;
        let mut wait = interval - interval / 10 + jitter % (interval / 5).max(1);
        // Short leases (a sliding log's, a grant near a window's end) are renewed half
        // way through, before they lapse with units in them.
        if let Some(due) = next_due {
            wait = wait.min(due.saturating_sub(now).max(1_000_000));
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(Duration::from_nanos(wait)) => {}
            () = wake.notified() => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        next_due = renew_due(&inner).await;
    }
}

/// Runs futures concurrently and collects their outputs in order.
async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, o) in futures.iter_mut().zip(out.iter_mut()) {
            if o.is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *o = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    out.into_iter().map(|o| o.expect("every future finished")).collect()
}

/// Keeps the ring current (ring routing): every `topology_interval`, and at once
/// after a redirect.
async fn topology_loop(
    inner: Weak<Inner>,
    stale: Arc<tokio::sync::Notify>,
    cancel: CancellationToken,
) {
    loop {
        let Some(every) = inner.upgrade().map(|i| i.config.topology_interval) else { return };
        if let Some(i) = inner.upgrade() {
            i.refresh_ring().await;
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(every) => {}
            () = stale.notified() => {}
        }
    }
}

/// Renews (or returns) every due key in one call; returns when the next key falls due.
async fn renew_due(inner: &Inner) -> Option<Nanos> {
    let now = inner.clock.now();
    if !inner.breaker.allow(now) {
        return None;
    }
    let mut next_due: Option<Nanos> = None;
    let idle_after = nanos(inner.config.idle_after);
    let slots = inner.slots.all();
    let mut batch = Vec::new();
    let mut forgotten = Vec::new();
    for slot in &slots {
        let Ok(mut st) = slot.lease.clone().try_lock_owned() else { continue };
        if st.lease_id == 0 {
            // Long idle and holding nothing: forget the key (bounded memory).
            if now.saturating_sub(slot.balance.last_used()) > FORGET_AFTER_IDLE * idle_after
                && slot.balance.units() == 0
            {
                forgotten.push(slot.clone());
            }
            continue;
        }
        let idle = now.saturating_sub(slot.balance.last_used()) > idle_after;
        let half_way = now.saturating_sub(st.sent_at) > st.hold / 2;
        let expired = now >= slot.balance.deadline();
        if !(idle || half_way || expired || slot.balance.renew_wanted()) {
            let due = st.sent_at + st.hold / 2;
            next_due = Some(next_due.map_or(due, |d| d.min(due)));
            continue;
        }
        let unspent = slot.balance.take();
        let spent = st.installed.saturating_sub(unspent);
        let demand = st.demand(now, spent);
        let want = if idle { 0 } else { inner.want(demand, 1) };
        let item =
            inner.item(slot, st.lease_id, if expired { 0 } else { unspent }, want, 0, demand);
        st.lease_id = 0;
        batch.push((slot.clone(), st, item));
        if batch.len() >= 100 {
            break;
        }
    }
    if !forgotten.is_empty() {
        inner.slots.remove(&forgotten);
    }
    if batch.is_empty() {
        return next_due;
    }
    let items = batch.iter().map(|(_, _, i)| i.clone()).collect();
    if let Ok(grants) = inner.call(items).await {
        for ((slot, mut st, _), g) in batch.into_iter().zip(&grants) {
            inner.install(&slot, &mut st, g, now, 0);
            if st.lease_id != 0 {
                let due = st.sent_at + st.hold / 2;
                next_due = Some(next_due.map_or(due, |d| d.min(due)));
            }
        }
    }
    next_due
}
