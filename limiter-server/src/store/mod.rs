//! Where counters live: in this process's memory (the default: limiter-core's sharded
//! table) or in Redis ([`redis`]), shared by several servers. Every call is async so
//! both sit behind the same calls; only Redis can fail, and its failures come back
//! as [`ServerError::Unavailable`] for the owner to apply each route's failure policy.

mod batches;
pub mod redis;

use std::sync::Arc;

use limiter_core::algorithm::Algorithm;
use limiter_core::clock::{Clock, Nanos};
use limiter_core::lease::{Ask, Shares, goes_direct, grant_size};
use limiter_core::policy::{Chain, LimitRule, Policy, Request};
use limiter_core::table::{StateTable, TableStats};
use limiter_core::{Grant, Limiter, Verdict};

use self::batches::Batches;
use self::redis::RedisStore;
use crate::error::ServerError;

/// Every limit rule of `policy`, with where it is written (`tenants.acme.per_key`).
pub fn policy_rules(policy: &Policy) -> Vec<(String, &LimitRule)> {
    let mut rules: Vec<(String, &LimitRule)> = Vec::new();
    if let Some(g) = &policy.global {
        rules.push(("global.ceiling".to_owned(), g));
    }
    for (name, r) in &policy.routes {
        if let Some(l) = &r.limit {
            rules.push((format!("routes.{name}.limit"), l));
        }
    }
    let tenants = policy.tenants.iter().map(|(n, t)| (n.as_ref(), t));
    for (name, t) in tenants.chain(policy.default_tenant.as_ref().map(|t| ("default", t))) {
        for l in t.limit.iter() {
            rules.push((format!("tenants.{name}.limit"), l));
        }
        for (route, r) in &t.routes {
            rules.push((format!("tenants.{name}.routes.{route}"), &r.rule));
        }
        for l in t.per_key.iter() {
            rules.push((format!("tenants.{name}.per_key"), l));
        }
    }
    rules
}

/// Refuses a policy whose sliding logs could hold more than `max` entries per key
/// (`limits.max_log_entries`).
///
/// # Errors
///
/// Every such rule, by where it is written.
pub fn check_log_sizes(policy: &Policy, max: u64) -> Result<(), String> {
    let errors: Vec<String> = policy_rules(policy)
        .into_iter()
        .filter_map(|(at, rule)| match &*rule.limit {
            limiter_core::Limit::SlidingLog(l) if l.limit().get() > max => Some(format!(
                "{at}: a sliding log of limit {} holds up to that many entries per key, above limits.max_log_entries ({max})",
                l.limit()
            )),
            _ => None,
        })
        .collect();
    if errors.is_empty() { Ok(()) } else { Err(errors.join("\n")) }
}

/// When and for how long a decision's units were charged: what a refund of them must
/// name (a decision: its instant and no hold; units taken from a batch: the batch's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Charged {
    /// The charge's instant.
    pub at: Nanos,
    /// The hold of the grant they came from (0 for a decision).
    pub hold: Nanos,
}

/// Which leased batches go back to Redis.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Returning {
    /// Those past their end or idle (the periodic sweep).
    Due,
    /// Every one (shutdown).
    All,
}

/// What a lease renewal hands back and asks for, carried out by the store in one step.
#[derive(Debug, Clone, Copy)]
pub struct Renewal {
    /// What the previous lease left unspent, refunded first.
    pub back: Option<Returned>,
    /// What the new grant is sized from.
    pub ask: Ask,
    /// Who else asks for the chain (a node's slice: nobody, never direct).
    pub shares: Shares,
    /// Units the grant leaves in the chain's tightest level (the memory store's; a
    /// rate holder's new assignment leaves what the next keeps need), and how many
    /// of them it may take all the same: its own keep, handed back in the same call
    /// (a rise's).
    pub keep_back: (u64, u64),
}

impl Renewal {
    /// What to grant from `remaining` by the grant rule; `None` in direct mode.
    pub(crate) fn size(&self, chain: &Chain<'_>, remaining: u64) -> Option<u64> {
        if self.direct(chain) {
            return None;
        }
        let (back, own) = self.keep_back;
        let spare = remaining.saturating_sub(back).max(own.min(remaining));
        Some(grant_size(&self.ask, spare, &self.shares))
    }

    /// Whether `chain`'s budget is too small to split among its active holders
    /// ([`goes_direct`]): the owner decides each waiting request itself.
    pub(crate) fn direct(&self, chain: &Chain<'_>) -> bool {
        goes_direct(capacity(chain), self.ask.cost, self.shares.active)
    }

    /// Whether a grant of `units` can be held: at least one, and the waiting request.
    pub(crate) fn covers(&self, units: u64) -> bool {
        units > 0 && units >= self.ask.cost
    }
}

/// Units of an earlier grant given back.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Returned {
    /// Units not spent.
    pub units: u64,
    /// When the grant was made.
    pub granted_at: Nanos,
    /// How long it could be spent.
    pub hold: Nanos,
}

/// What a renewal got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leased {
    /// Units to hold: at least one, and at least the waiting request's cost.
    Granted(Grant),
    /// Less than one request's cost is left for each active holder (direct mode):
    /// the owner decides each waiting request itself.
    Direct,
    /// The grant could not cover the waiting request: it is decided as a request.
    Short,
}

/// The tightest capacity over a chain's levels.
pub(crate) fn capacity(chain: &Chain<'_>) -> u64 {
    chain.levels().map(|l| l.rule.limit.capacity()).min().unwrap_or(u64::MAX)
}

/// A store of counters.
#[derive(Debug)]
pub enum Store {
    /// In this process's memory.
    Memory(Limiter),
    /// In Redis, with the batches this server leased from it.
    Redis(Box<RedisBacked>),
}

/// The Redis store and this server's batches.
pub struct RedisBacked {
    store: RedisStore,
    batches: Batches,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for RedisBacked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBacked").field("store", &self.store).finish_non_exhaustive()
    }
}

impl RedisBacked {
    /// The store.
    pub fn store(&self) -> &RedisStore {
        &self.store
    }
}

impl Store {
    /// A memory store holding at most about `max_keys` counters; `replicated`: it
    /// tracks which counters change, for replicas on other nodes.
    pub fn memory(max_keys: usize, keys_per_tenant: u32, replicated: bool) -> Self {
        let mut table = StateTable::with_capacity(max_keys).with_keys_per_tenant(keys_per_tenant);
        if replicated {
            table = table.with_changes();
        }
        Self::Memory(Limiter::with_table(table))
    }

    /// Whether `chain` may be decided: its new key-scope counters are within their
    /// tenant's cap (memory store; Redis bounds its memory itself). A refusal is
    /// counted.
    ///
    /// # Errors
    ///
    /// `RESOURCE_EXHAUSTED`, naming the tenant and the setting.
    pub fn admits(&self, chain: &Chain<'_>) -> Result<(), ServerError> {
        let Self::Memory(l) = self else { return Ok(()) };
        // The common case, no tenant at its cap, builds no keys.
        if !l.table().some_tenant_at_cap() {
            return Ok(());
        }
        l.table().admits(&chain.keys()).map_err(|e| {
            metrics::counter!(crate::metrics::LIMIT_REFUSALS, "limit" => "keys_per_tenant")
                .increment(1);
            tracing::debug!(tenant = %e.tenant, cap = e.cap, "new key refused");
            ServerError::Exhausted(format!(
                "{e} (limits.max_keys_per_tenant); new keys are refused until some go idle"
            ))
        })
    }

    /// A Redis store.
    pub fn redis(store: RedisStore, clock: Arc<dyn Clock>) -> Self {
        Self::Redis(Box::new(RedisBacked { store, batches: Batches::default(), clock }))
    }

    /// The memory store's limiter (`None` for Redis).
    pub fn limiter(&self) -> Option<&Limiter> {
        match self {
            Self::Memory(l) => Some(l),
            Self::Redis(_) => None,
        }
    }

    /// Whether `policy` can run on this store.
    ///
    /// # Errors
    ///
    /// Every limit the store cannot run exactly.
    pub fn check_policy(&self, policy: &Policy) -> Result<(), String> {
        match self {
            Self::Memory(_) => Ok(()),
            Self::Redis(_) => redis::check_policy(policy),
        }
    }

    /// Checks and charges `req`'s chain, all levels or none.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached (never for memory).
    pub async fn decide(
        &self,
        req: &Request<'_>,
        chain: &Chain<'_>,
        now: Nanos,
    ) -> Result<(Verdict, Charged), ServerError> {
        match self {
            Self::Memory(l) => Ok((l.decide(chain, now), Charged { at: now, hold: 0 })),
            Self::Redis(r) => {
                if let Some(verdict) = limiter_core::hierarchy::without_counters(chain) {
                    return Ok((verdict, Charged { at: now, hold: 0 }));
                }
                // Permits are held, not spent: a batch of them would stay taken.
                let batched = r.store.settings().batches
                    && !chain.dry_run
                    && !chain.route.lease.exact
                    && chain.cost > 0
                    && !chain.levels().any(|l| l.rule.limit.is_concurrency());
                if batched {
                    r.batches.decide(&r.store, req, chain, now, || r.clock.now()).await
                } else {
                    r.store.decide(chain, now).await
                }
            }
        }
    }

    /// Charges `units` to every level without checking (usage reported afterwards).
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn charge(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        match self {
            Self::Memory(l) => l.charge(chain, now, units),
            Self::Redis(r) => r.store.charge(chain, now, units).await?,
        }
        Ok(())
    }

    /// Gives back `units` charged at `granted_at` on every level.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn refund(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        granted_at: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        self.refund_grant(chain, now, granted_at, 0, units).await
    }

    /// Grants up to `max` units from every level, spendable for at most `hold`.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        max: u64,
        hold: Nanos,
    ) -> Result<Grant, ServerError> {
        match self {
            Self::Memory(l) => Ok(l.grant(chain, now, max, hold)),
            Self::Redis(r) => r.store.grant(chain, now, max, hold).await,
        }
    }

    /// One lease renewal: the previous lease's unspent units back, then a grant sized
    /// by the grant rule ([`limiter_core::lease::grant_size`]) from what is left. One
    /// script call on Redis.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn lease(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        renewal: &Renewal,
    ) -> Result<Leased, ServerError> {
        let l = match self {
            Self::Redis(r) => return r.store.lease(chain, now, renewal).await,
            Self::Memory(l) => l,
        };
        if let Some(b) = renewal.back {
            l.refund_grant(chain, now, b.granted_at, b.hold, b.units);
        }
        let Some(size) = renewal.size(chain, l.remaining(chain, now)) else {
            return Ok(Leased::Direct);
        };
        let g = l.grant(chain, now, size, renewal.ask.hold);
        if !renewal.covers(g.units) {
            l.refund_grant(chain, now, g.granted_at, g.hold, g.units);
            return Ok(Leased::Short);
        }
        Ok(Leased::Granted(g))
    }

    /// Gives back `units` of a grant made at `granted_at` for `hold`.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn refund_grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        granted_at: Nanos,
        hold: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        match self {
            Self::Memory(l) => l.refund_grant(chain, now, granted_at, hold, units),
            Self::Redis(r) => r.store.refund_grant(chain, now, granted_at, hold, units).await?,
        }
        Ok(())
    }

    /// Moves `units` permits charged at `at` to `now` on every level of `chain` (its
    /// concurrency levels: a renewal), in one step: the level never counts them
    /// neither time. Returns the new stamp (a refund names it).
    ///
    /// # Errors
    ///
    /// When the store cannot be reached (the permits stay where they were).
    pub async fn move_permits(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        at: Nanos,
        units: u64,
    ) -> Result<Nanos, ServerError> {
        match self {
            Self::Memory(l) => {
                // Charged first: in between the level counts both (a request may be
                // refused), never neither (one admitted past the limit).
                l.charge(chain, now, units);
                l.refund(chain, now, at, units);
                Ok(now)
            }
            // One script: the old entry back, the new one charged (refunding first
            // there keeps the log from merging a full log's newest entry).
            Self::Redis(r) => {
                let g = r.store.grant_raw(chain, now, units, 0, units, (units, at, 0)).await?;
                if g.units < units {
                    r.store.charge(chain, now, units - g.units).await?;
                }
                Ok(g.granted_at)
            }
        }
    }

    /// Units left at the tightest level of a chain.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn remaining(&self, chain: &Chain<'_>, now: Nanos) -> Result<u64, ServerError> {
        match self {
            Self::Memory(l) => Ok(l.remaining(chain, now)),
            Self::Redis(r) => r.store.remaining(chain, now).await,
        }
    }

    /// Every level's units left and time to a full allowance, charging nothing and
    /// creating no counter (the usage view).
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn inspect(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
    ) -> Result<Vec<(u64, Nanos)>, ServerError> {
        match self {
            Self::Memory(l) => Ok(l
                .inspect(chain, now)
                .into_iter()
                .map(|v| (v.remaining, v.reset_after))
                .collect()),
            Self::Redis(r) => r.store.inspect(chain, now).await,
        }
    }

    /// Gives back the units of the batches `which` names. Nothing to do for memory.
    pub async fn return_batches(&self, policy: &Policy, now: Nanos, which: Returning) {
        if let Self::Redis(r) = self {
            let all = which == Returning::All;
            r.batches.flush(&r.store, policy, now, r.clock.now(), all).await;
        }
    }

    /// Drops idle counters; returns how many (Redis expires its own).
    pub fn sweep(&self, now: Nanos) -> usize {
        match self {
            Self::Memory(l) => l.table().sweep_idle(now),
            Self::Redis(_) => 0,
        }
    }

    /// Counter statistics (for Redis: the batches this server holds).
    pub fn stats(&self) -> TableStats {
        match self {
            Self::Memory(l) => l.table().stats(),
            Self::Redis(r) => TableStats { keys: r.batches.len() as u64, ..TableStats::default() },
        }
    }

    /// The most counters held (0: not bounded here).
    pub fn max_keys(&self) -> usize {
        match self {
            Self::Memory(l) => l.table().max_keys(),
            Self::Redis(_) => 0,
        }
    }
}
