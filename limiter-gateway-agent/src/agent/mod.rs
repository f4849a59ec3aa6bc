//! The agent: local decisions from leased balances, a slow path to the owner, a
//! background renewer, and the failure policy when the owner cannot be reached.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use limiter_core::clock::{Clock, Nanos};
use limiter_core::failure::{Breaker, EmergencyCeilings};
use limiter_core::policy::FailurePolicy;
use limiter_core::ring::Ring;
use limiter_proto::connect::AuthChannel;
use limiter_proto::limiter::v1::rate_limiter_client::RateLimiterClient;
use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;

use crate::config::AgentConfig;
use crate::error::AgentError;

mod answer;
mod clock;
mod owner;
mod permits;
mod renew;
mod schedule;
mod slots;
mod wire;

pub use self::answer::{
    AgentRequest, AgentStats, LimitInfo, Outcome, Permit, REFUSAL_CAP_SHARE, Source,
};
use self::clock::AgentClock;
pub use self::clock::{COUNTER_TOLERANCE_PPM, FastClock};
pub use self::permits::{HandlePermit, LocalPermit, PermitHandle};
use self::renew::*;
use self::schedule::{Schedule, When};
use self::slots::*;
use self::wire::*;

struct Inner {
    config: AgentConfig,
    clock: AgentClock,
    client: RateLimiterClient<AuthChannel>,
    slots: Slots,
    breaker: Breaker,
    /// Failure policies learned from the owner's grants, by route.
    routes: Mutex<HashMap<Box<str>, FailurePolicy>>,
    /// Emergency ceilings of fail-open routes, by route.
    ceilings: EmergencyCeilings,
    /// When each key is next due for the renewer.
    schedule: Schedule,
    /// The owner calls' latency (an average, nanoseconds).
    rtt: AtomicU64,
    /// The demand of a tenant's keys here (an average over its renewals, units per
    /// second): what a new key of the tenant asks for first.
    tenants: Mutex<HashMap<Box<str>, u64>>,
    cancel: CancellationToken,
    stats: [AtomicU64; 6],
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
/// Requests refused from a refusal the owner gave (no call).
const REFUSED: usize = 4;
/// Items carried by owner calls.
const ITEMS: usize = 5;

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

impl Agent {
    /// An agent for `config` on the production clock. Connects lazily: the owner
    /// may be down at start (requests then follow their failure policy).
    ///
    /// # Errors
    ///
    /// An invalid owner endpoint.
    pub fn new(config: AgentConfig) -> Result<Self, AgentError> {
        Self::start(config, AgentClock::Fast(FastClock::default()))
    }

    /// Like [`Agent::new`] with a given clock. Must be called within a tokio runtime.
    ///
    /// # Errors
    ///
    /// An invalid owner endpoint.
    pub fn with_clock(config: AgentConfig, clock: Arc<dyn Clock>) -> Result<Self, AgentError> {
        Self::start(config, AgentClock::Given(clock))
    }

    fn start(config: AgentConfig, clock: AgentClock) -> Result<Self, AgentError> {
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
            schedule: Schedule::default(),
            rtt: AtomicU64::new(0),
            tenants: Mutex::default(),
            routes: Mutex::default(),
            ceilings: EmergencyCeilings::default(),
            cancel: CancellationToken::new(),
            stats: Default::default(),
            ring: Mutex::default(),
            members: Mutex::default(),
            stale: Arc::new(tokio::sync::Notify::new()),
        });
        tokio::spawn(renew_loop(Arc::downgrade(&inner), inner.cancel.clone()));
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
        let hits = self.inner.slots.hits();
        AgentStats {
            local: hits,
            slow: s(SLOW),
            fallback: s(FALLBACK),
            owner_calls: s(CALLS),
            owner_items: s(ITEMS),
            failed_calls: s(FAILED),
            refused_locally: s(REFUSED),
        }
    }

    /// Whether the owner is considered unreachable (routes follow their policy).
    pub fn in_fallback(&self) -> bool {
        self.inner.breaker.is_open()
    }

    /// The fast path: a decision from the local balance, or `None` when the owner is
    /// needed. No allocation, no await: a read lock on one shard of the key map and
    /// atomics on the key's balance.
    /// A key whose chain has a concurrency level takes its permit from the key's
    /// local pool too (the outcome holds it: release it when the request ends).
    #[inline]
    pub fn decide_local(&self, req: &AgentRequest<'_>) -> Option<Outcome> {
        self.decide_slot(req, |slot, now| {
            if !slot.balance.needs_permit() {
                return self.inner.spend(slot, now, req.cost).map(Outcome::local);
            }
            let only = slot.pool.get()?.mode()?;
            let (permit, remaining) = self.inner.take_local(slot, now, req.cost, only)?;
            Some(Outcome::local(remaining).with_local(permit, now))
        })
    }

    /// `f` on the request's key's slot, if it has one, with the time now: a `Some`
    /// is a local decision, counted.
    #[inline]
    fn decide_slot<T>(
        &self,
        req: &AgentRequest<'_>,
        f: impl FnOnce(&Arc<Slot>, Nanos) -> Option<T>,
    ) -> Option<T> {
        let r = SlotRef { tenant: req.tenant, route: req.route, key: req.key.unwrap_or("") };
        let now = self.inner.clock.now();
        self.inner.slots.decide(&r, |slot| f(slot, now))
    }

    /// The fast path at its leanest: spends `req.cost` from the local balance and
    /// returns the units left, or `None` when the owner is needed (always for a key
    /// whose chain has a concurrency level: its requests need a permit, which
    /// [`Self::decide_local`] and [`Self::acquire_local`] take).
    #[inline]
    pub fn spend_local(&self, req: &AgentRequest<'_>) -> Option<u64> {
        self.decide_slot(req, |slot, now| {
            if slot.balance.needs_permit() {
                return None;
            }
            self.inner.spend(slot, now, req.cost)
        })
    }

    /// The local decision of a key whose chain has a concurrency level: its permit
    /// from the key's pool (and units from its balance when the chain has other
    /// levels), or `None` when the owner is needed or the key holds no pool. No
    /// allocation: the permit goes back when released or dropped.
    #[inline]
    pub fn acquire_local(&self, req: &AgentRequest<'_>) -> Option<LocalPermit> {
        self.decide_slot(req, |slot, now| {
            let only = slot.pool.get()?.mode()?;
            self.inner.take_local(slot, now, req.cost, only).map(|(p, _)| p)
        })
    }

    /// A handle on the pool of `req`'s key (see [`PermitHandle`]), once the key has
    /// one: `None` for a key not seen yet or whose chain has no concurrency level.
    pub fn permit_handle(&self, req: &AgentRequest<'_>) -> Option<PermitHandle> {
        let r = SlotRef { tenant: req.tenant, route: req.route, key: req.key.unwrap_or("") };
        self.inner.slots.with(&r, |slot| {
            slot.pool.get()?.mode()?;
            Some(PermitHandle { agent: self.clone(), slot: slot.clone() })
        })?
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
        if slot.pool.get().is_some_and(|p| p.mode().is_some()) {
            return self.inner.pooled(&slot, req.cost).await;
        }
        let o = self.inner.slow(&slot, req.cost).await?;
        // The key's first answer said its chain has a concurrency level: its permit
        // too (a refused permit leaves the units it was granted spent).
        if o.allowed && o.permit.is_none() && o.source != Source::Fallback {
            return self.inner.with_permit(&slot, o, req.cost).await;
        }
        Ok(o)
    }

    /// Returns `permit`'s units to its owner (the request it guarded ended); false
    /// when the owner no longer held it (expired, released already). A release that
    /// cannot be delivered leaves the permit to expire at its TTL: under-admission for
    /// at most that long, never more in flight than the limit.
    ///
    /// # Errors
    ///
    /// The owner unreachable or refusing the call.
    pub async fn release(&self, permit: &Permit) -> Result<bool, AgentError> {
        if let Some(local) = &permit.local {
            return Ok(local.release());
        }
        let req = limiter_proto::limiter::v1::ReleaseRequest {
            tenant: permit.tenant.clone(),
            route: permit.route.clone(),
            key: permit.key.clone(),
            permit: permit.id.clone(),
            turn: 0,
        };
        let mut client = self.inner.client.clone();
        Ok(self.within_timeout(client.release(req)).await?.released)
    }

    /// Extends `permit` by its TTL from now (a request running longer than it), and
    /// returns the time left.
    ///
    /// # Errors
    ///
    /// The owner unreachable, or the permit no longer held (it expired: the request
    /// runs uncounted from then).
    pub async fn renew(&self, permit: &Permit) -> Result<Nanos, AgentError> {
        if let Some(local) = &permit.local {
            // The pool's blocks are renewed while permits are in use.
            return match local.expires_in(self.inner.clock.now()) {
                0 => Err(AgentError::Owner("the pool's permits lapsed".to_owned())),
                left => Ok(left),
            };
        }
        let req = limiter_proto::limiter::v1::RenewRequest {
            tenant: permit.tenant.clone(),
            route: permit.route.clone(),
            key: permit.key.clone(),
            permit: permit.id.clone(),
        };
        let mut client = self.inner.client.clone();
        let answer = self.within_timeout(client.renew(req)).await?;
        Ok(duration_nanos(answer.expires_in.as_ref()))
    }

    /// A permit call's answer within the RPC timeout.
    async fn within_timeout<T>(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, AgentError> {
        match tokio::time::timeout(self.inner.config.rpc_timeout, call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(s)) => Err(AgentError::Owner(s.message().to_owned())),
            Err(_) => Err(AgentError::Owner("owner did not answer in time".to_owned())),
        }
    }

    fn slot(&self, req: &AgentRequest<'_>) -> Arc<Slot> {
        let r = SlotRef { tenant: req.tenant, route: req.route, key: req.key.unwrap_or("") };
        self.inner
            .slots
            .get_or_insert(&r, || Slot::new(req.tenant, req.route, r.key, self.inner.clock.now()))
    }

    /// Inserts `n` keys of `tenant` and `route` (`key-00000000`, ...) that hold
    /// nothing, as keys do once their leases went back and before they are forgotten,
    /// each in the renewer's schedule; returns the bytes of their names. For measuring
    /// what idle keys cost (`benches/idle_keys.rs`), not for serving.
    #[doc(hidden)]
    pub fn preload_idle_keys(&self, tenant: &str, route: &str, n: usize) -> usize {
        let now = self.inner.clock.now();
        let mut bytes = 0;
        let slots: Vec<Arc<Slot>> = (0..n)
            .map(|i| {
                let key = format!("key-{i:08}");
                bytes += tenant.len() + route.len() + key.len();
                Arc::new(Slot::new(tenant, route, &key, now))
            })
            .collect();
        let idle = LeaseState::default();
        for slot in &slots {
            self.inner.schedule.at(slot, self.inner.next_due(slot, &idle, now));
        }
        self.inner.slots.extend(slots);
        bytes
    }

    /// Keys held, and how many of them carry the state of their slow path (a key
    /// idle and holding nothing sheds it). For tests and benches.
    #[doc(hidden)]
    pub fn key_counts(&self) -> (usize, usize) {
        self.inner.slots.counts()
    }

    /// Gives every held balance back to the owner (a stopping gateway).
    pub async fn shutdown(&self) {
        self.inner.cancel.cancel();
        let slots = self.inner.slots.all();
        let mut items = Vec::new();
        let mut guards = Vec::new();
        for slot in &slots {
            self.inner.give_back_blocks(slot).await;
            let mut g = self.inner.slots.lease(slot).await;
            items.extend(self.inner.give_back(slot, &mut g));
            guards.push(g);
        }
        if !items.is_empty() {
            let _ = self.inner.call(items).await;
        }
    }
}
