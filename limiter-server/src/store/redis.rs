//! The Redis store: counters in Redis (or a Redis Cluster), checked and charged by the
//! Lua scripts in `lua/`, so several stateless servers can share one set of limits.
//!
//! - One script (lib, the four algorithms and the chain driver, joined) decides a
//!   whole chain in one atomic call, run with `EVALSHA` and loaded again on
//!   `NOSCRIPT`. Time is Redis's own (`TIME`), never a server's.
//! - Keys: `<prefix>:{<tag>}:<scope>:<names>:<limit>`. The hash tag is the tenant for
//!   the tenant, tenant x route and key levels, so all of a tenant's own counters live
//!   in one Cluster slot; the global ceiling and route-wide limits have tags of their
//!   own. On a Cluster a chain is decided group by group (global, route, tenant), a
//!   later group's rejection giving back what the earlier ones were charged; no script
//!   ever touches two slots. Names are length-prefixed, so no two requests share a key
//!   by accident; the limit's parameters are part of the key, so a reload that
//!   changes a limit starts it afresh (the old counters expire on their own).
//! - Every call has a deadline; a circuit breaker opens after consecutive failures
//!   and lets one probe through per interval; while it is open, calls fail at once
//!   and the owner applies each route's failure policy.
//! - Limits must fit the scripts' exact integer range (Lua numbers are doubles):
//!   [`check_policy`] refuses, at load and on reload, any limit that does not.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};

use limiter_core::clock::Nanos;
use limiter_core::decision::{Binding, Decision};
use limiter_core::failure::Breaker;
use limiter_core::key::LimitKeyRef;
use limiter_core::policy::{Chain, Level, Policy};
use limiter_core::{Grant, Limit, Scope, Verdict};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use limiter_core::lease::{goes_direct, grant_size};

use super::{Charged, Leased, Renewal};
use crate::error::{ServerError, StoreError};
use crate::metrics as m;

/// The script Redis runs: the helpers, the four algorithms, then the driver.
pub const SCRIPT: &str = concat!(
    include_str!("../../../lua/lib.lua"),
    include_str!("../../../lua/token_bucket.lua"),
    include_str!("../../../lua/fixed_window.lua"),
    include_str!("../../../lua/sliding_log.lua"),
    include_str!("../../../lua/sliding_counter.lua"),
    include_str!("../../../lua/chain.lua"),
);

/// The largest quantity a script may hold exactly (with headroom below 2^53).
const EXACT: u64 = 1 << 50;
const MICRO: u64 = 1_000;

pub use crate::config::redis::{PoolKind, RedisClock, RedisSettings};

enum Conn {
    Single(Vec<ConnectionManager>),
    Pool(bb8::Pool<redis::Client>),
    Cluster(Box<(OnceCell<ClusterConnection>, redis::cluster::ClusterClient)>),
}

/// Counters in Redis.
pub struct RedisStore {
    settings: RedisSettings,
    conn: Conn,
    next: AtomicUsize,
    script: redis::Script,
    breaker: Breaker,
    clock: std::sync::Arc<dyn limiter_core::clock::Clock>,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore").field("settings", &self.settings).finish_non_exhaustive()
    }
}

/// One level's script parameters: kind and three numbers.
fn params(limit: &Limit) -> Result<(&'static str, [u64; 3]), String> {
    let window = |limit: u64, window: u64| {
        if !window.is_multiple_of(MICRO) {
            return Err(format!(
                "window of {window} ns is not a whole number of microseconds (the Redis store counts time in microseconds)"
            ));
        }
        if limit > EXACT || window / MICRO > EXACT {
            return Err("limit or window too large for the Redis store's exact arithmetic (2^50)"
                .to_owned());
        }
        Ok([limit, window / MICRO, 0])
    };
    match limit {
        Limit::TokenBucket(b) => {
            // One microsecond is `amount * 1000` scaled units, one token `period_ns`.
            let (mut a, mut p) =
                (b.rate().amount().get().saturating_mul(MICRO), b.rate().period().get());
            let g = gcd(a, p);
            (a, p) = (a / g, p / g);
            let burst = b.burst().get();
            if a > EXACT || u128::from(burst) * u128::from(p) > u128::from(EXACT) {
                return Err(format!(
                    "token bucket {}/{} ns with burst {burst} is too fine for the Redis store's exact arithmetic (burst x period must stay below 2^50 after reduction)",
                    b.rate().amount(),
                    b.rate().period()
                ));
            }
            Ok(("tb", [a, p, burst]))
        }
        Limit::FixedWindow(w) => Ok(("fw", window(w.limit().get(), w.window().get())?)),
        Limit::SlidingLog(w) => Ok(("sl", window(w.limit().get(), w.window().get())?)),
        Limit::SlidingCounter(w) => Ok(("sc", window(w.limit().get(), w.window().get())?)),
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}

/// Every limit of `policy` the Redis store cannot run exactly, named.
///
/// # Errors
///
/// One line per limit out of range.
pub fn check_policy(policy: &Policy) -> Result<(), String> {
    let rules = super::policy_rules(policy);
    let errors: Vec<String> = rules
        .into_iter()
        .filter_map(|(at, rule)| params(&rule.limit).err().map(|e| format!("{at}: {e}")))
        .collect();
    if errors.is_empty() { Ok(()) } else { Err(errors.join("\n")) }
}

/// A level's hash tag: what decides its Cluster slot.
fn tag<'a>(key: &LimitKeyRef<'a>) -> (u8, &'a str) {
    match key.scope {
        Scope::Global => (b'g', ""),
        Scope::Route => (b'r', key.route),
        Scope::Tenant | Scope::TenantRoute | Scope::Key => (b't', key.tenant),
    }
}

fn scope_code(s: Scope) -> &'static str {
    match s {
        Scope::Global => "g",
        Scope::Route => "r",
        Scope::Tenant => "t",
        Scope::TenantRoute => "tr",
        Scope::Key => "k",
    }
}

/// The reply of a `decide` call.
struct Decided {
    admitted: bool,
    level: usize,
    value: u64,
    reset: u64,
    at: Nanos,
}

/// The reply of a `grant` call.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Granted {
    pub units: u64,
    pub granted_at: Nanos,
    pub hold: Nanos,
    pub binding: usize,
    /// After the grant: units left at the tightest level, that level, its reset.
    pub left: u64,
    pub tight: usize,
    pub reset: Nanos,
    /// When `need` did not fit: the outermost refusing level (0: none) and the wait.
    pub failed: usize,
    pub wait: Nanos,
}

fn us(n: Nanos) -> u64 {
    n / MICRO
}

fn ns(v: i64) -> Nanos {
    u64::try_from(v).unwrap_or(0).saturating_mul(MICRO)
}

impl RedisStore {
    /// A store over Redis; connects lazily (a server starts while Redis is down and
    /// follows its failure policies until Redis answers).
    ///
    /// # Errors
    ///
    /// A malformed URL.
    pub fn new(
        settings: RedisSettings,
        clock: std::sync::Arc<dyn limiter_core::clock::Clock>,
    ) -> Result<Self, String> {
        // TLS (`rediss://`) runs on rustls with the `ring` provider; installed once for
        // the process (a second install, or one by an embedding program, is fine).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let certs = match &settings.tls_ca_file {
            Some(path) => Some(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(std::fs::read(path).map_err(|e| {
                    format!("store.redis.tls_ca_file: cannot read {}: {e}", path.display())
                })?),
            }),
            None => None,
        };
        let open = |url: &str| {
            match &certs {
                Some(c) => redis::Client::build_with_tls(url, c.clone()),
                None => redis::Client::open(url),
            }
            .map_err(|e| format!("store.redis.url: {e}"))
        };
        let conn = if settings.cluster_nodes.is_empty() && settings.pool == PoolKind::Bb8 {
            let client = open(&settings.url)?;
            let pool = bb8::Pool::builder()
                .max_size(u32::try_from(settings.connections.max(1)).unwrap_or(64))
                .connection_timeout(settings.connect_timeout)
                .test_on_check_out(false)
                .build_unchecked(client);
            Conn::Pool(pool)
        } else if settings.cluster_nodes.is_empty() {
            let client = open(&settings.url)?;
            let config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(settings.connect_timeout))
                .set_response_timeout(Some(settings.command_timeout))
                .set_number_of_retries(1)
                .set_max_delay(settings.probe_interval);
            let managers = (0..settings.connections.max(1))
                .map(|_| ConnectionManager::new_lazy_with_config(client.clone(), config.clone()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("store.redis.url: {e}"))?;
            Conn::Single(managers)
        } else {
            let mut builder =
                redis::cluster::ClusterClient::builder(settings.cluster_nodes.clone());
            if let Some(c) = certs {
                builder = builder.certs(c);
            }
            let client = builder
                .connection_timeout(settings.connect_timeout)
                .response_timeout(settings.command_timeout)
                .retries(1)
                .build()
                .map_err(|e| format!("store.redis.cluster_nodes: {e}"))?;
            Conn::Cluster(Box::new((OnceCell::new(), client)))
        };
        let breaker = Breaker::new(
            settings.breaker_threshold,
            u64::try_from(settings.probe_interval.as_nanos()).unwrap_or(u64::MAX),
        );
        Ok(Self {
            settings,
            conn,
            next: AtomicUsize::new(0),
            script: redis::Script::new(SCRIPT),
            breaker,
            clock,
        })
    }

    /// The settings.
    pub fn settings(&self) -> &RedisSettings {
        &self.settings
    }

    fn is_cluster(&self) -> bool {
        matches!(self.conn, Conn::Cluster(..))
    }

    fn key_of(
        &self,
        level: &Level<'_>,
        out: &mut Vec<String>,
    ) -> Result<(&'static str, [u64; 3]), ServerError> {
        let (kind, p) = params(&level.rule.limit).map_err(|e| ServerError::invalid("policy", e))?;
        let (t, name) = tag(&level.key);
        let k = level.key;
        let mut key = String::with_capacity(64 + k.tenant.len() + k.route.len() + k.key.len());
        let _ = write!(
            key,
            "{}:{{{}.{name}}}:{}",
            self.settings.key_prefix,
            t as char,
            scope_code(k.scope)
        );
        for part in [k.tenant, k.route, k.key] {
            let _ = write!(key, ":{}.{part}", part.len());
        }
        let _ = write!(key, ":{kind}.{}.{}.{}", p[0], p[1], p[2]);
        let log = (kind == "sl").then(|| format!("{key}:log"));
        // A sliding log's hash first, then its log.
        out.push(key);
        out.extend(log);
        Ok((kind, p))
    }

    /// The groups of a chain's levels that one script call may decide together: the
    /// whole chain on a single Redis; one group per hash tag on a Cluster. Each group
    /// is its first level's index and its length.
    fn groups(&self, chain: &Chain<'_>) -> Vec<(usize, usize)> {
        let keys = chain.keys();
        if !self.is_cluster() {
            return vec![(0, keys.len())];
        }
        let mut groups: Vec<(usize, usize)> = Vec::new();
        for (i, k) in keys.iter().enumerate() {
            match groups.last_mut() {
                Some((start, len)) if tag(&keys[*start]) == tag(k) => *len += 1,
                _ => groups.push((i, 1)),
            }
        }
        groups
    }

    async fn invoke(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Vec<i64>, StoreError> {
        match &self.conn {
            Conn::Single(managers) => {
                // Relaxed: only spreads calls over the connections.
                let i = self.next.fetch_add(1, Ordering::Relaxed) % managers.len().max(1);
                let mut c = managers.get(i).ok_or(StoreError::Malformed("connection"))?.clone();
                inv.invoke_async(&mut c).await.map_err(StoreError::Redis)
            }
            Conn::Pool(pool) => {
                let mut c = pool.get().await.map_err(StoreError::Pool)?;
                inv.invoke_async(&mut *c).await.map_err(StoreError::Redis)
            }
            Conn::Cluster(cluster) => {
                let (cell, client) = &**cluster;
                let c = cell
                    .get_or_try_init(|| client.get_async_connection())
                    .await
                    .map_err(StoreError::Redis)?;
                inv.invoke_async(&mut c.clone()).await.map_err(StoreError::Redis)
            }
        }
    }

    /// One script call on the levels `group` of `chain`.
    async fn call(
        &self,
        op: &'static str,
        chain: &Chain<'_>,
        group: (usize, usize),
        now: Nanos,
        args: [u64; 7],
    ) -> Result<Vec<i64>, ServerError> {
        let started = self.clock.now();
        if !self.breaker.allow(started) {
            metrics::counter!(m::STORE_ERRORS, "kind" => "breaker_open").increment(1);
            return Err(StoreError::BreakerOpen.into());
        }
        let mut keys = Vec::with_capacity(group.1 + 1);
        let mut levels = Vec::with_capacity(group.1);
        for level in chain.levels().skip(group.0).take(group.1) {
            levels.push(self.key_of(&level, &mut keys)?);
        }
        let mut inv = self.script.prepare_invoke();
        for k in &keys {
            inv.key(k);
        }
        let time = match self.settings.clock {
            RedisClock::Redis => -1,
            RedisClock::Server => i64::try_from(us(now)).unwrap_or(i64::MAX),
        };
        inv.arg(op).arg(time);
        for a in args {
            inv.arg(a);
        }
        for (kind, p) in levels {
            inv.arg(kind).arg(p[0]).arg(p[1]).arg(p[2]);
        }
        let result = tokio::time::timeout(self.settings.command_timeout, self.invoke(&inv)).await;
        metrics::counter!(m::STORE_CALLS, "op" => op).increment(1);
        let error = match result {
            Ok(Ok(v)) => {
                if self.breaker.success() {
                    tracing::info!("redis answers again: the breaker is closed");
                    metrics::gauge!(m::STORE_BREAKER_OPEN).set(0.0);
                }
                return Ok(v);
            }
            Ok(Err(e)) => {
                metrics::counter!(m::STORE_ERRORS, "kind" => "error").increment(1);
                e
            }
            Err(_) => {
                metrics::counter!(m::STORE_ERRORS, "kind" => "timeout").increment(1);
                StoreError::Timeout(self.settings.command_timeout)
            }
        };
        if self.breaker.failure(self.clock.now()) {
            tracing::warn!(%error, "redis unreachable: the breaker is open, routes follow their failure policy");
            metrics::gauge!(m::STORE_BREAKER_OPEN).set(1.0);
        } else {
            tracing::debug!(%error, "redis call failed");
        }
        Err(error.into())
    }

    async fn decide_group(
        &self,
        chain: &Chain<'_>,
        group: (usize, usize),
        now: Nanos,
        dry_run: bool,
    ) -> Result<Decided, ServerError> {
        let r = self
            .call("decide", chain, group, now, [chain.cost, u64::from(dry_run), 0, 0, 0, 0, 0])
            .await?;
        let get = |i: usize| r.get(i).copied().unwrap_or(0);
        let d = Decided {
            admitted: get(0) == 1,
            level: usize::try_from(get(1)).unwrap_or(usize::MAX),
            value: u64::try_from(get(2)).unwrap_or(0),
            reset: ns(get(3)),
            at: ns(get(4)),
        };
        // A level of this call (or none, for an admission); anything else is not a
        // reply of this script: refused, never trusted.
        if r.len() != 5 || d.level > group.1 || (!d.admitted && d.level == 0) {
            metrics::counter!(m::STORE_ERRORS, "kind" => "error").increment(1);
            tracing::debug!(reply = ?r, "malformed decide reply");
            return Err(StoreError::Malformed("decide").into());
        }
        Ok(d)
    }

    /// Checks and charges a chain, all levels or none.
    ///
    /// # Errors
    ///
    /// Redis unreachable, slow or refusing (the breaker counts it).
    pub async fn decide(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
    ) -> Result<(Verdict, Charged), ServerError> {
        let mut at = Charged { at: now, hold: 0 };
        if let Some(verdict) = limiter_core::hierarchy::without_counters(chain) {
            return Ok((verdict, at));
        }
        let groups = self.groups(chain);
        let mut tightest: Option<(usize, u64, Nanos)> = None;
        let mut charged: Vec<((usize, usize), Nanos)> = Vec::new();
        for &group in &groups {
            let d = match self.decide_group(chain, group, now, chain.dry_run).await {
                Ok(d) => d,
                Err(e) => {
                    self.give_back(chain, now, &charged).await;
                    return Err(e);
                }
            };
            let level = group.0 + d.level.saturating_sub(1);
            if !d.admitted {
                self.give_back(chain, now, &charged).await;
                // The outermost refusing level is this group's (the earlier ones
                // admitted); the wait is the longest over every refusing level, so the
                // later groups are asked too, without charging.
                let mut wait = d.value;
                for &later in groups.iter().filter(|g| g.0 > group.0) {
                    if let Ok(l) = self.decide_group(chain, later, now, true).await
                        && !l.admitted
                    {
                        wait = wait.max(l.value);
                    }
                }
                let Some(l) = chain.levels().nth(level) else {
                    return Err(ServerError::Unavailable("redis named no level".into()));
                };
                let decision = Decision::Rejected {
                    reason: l.scope.reason(),
                    scope: l.scope,
                    limit: Some(*l.rule.limit),
                    retry_after: wait.saturating_mul(MICRO),
                };
                return Ok((Verdict { decision, shadow: chain.shadow }, at));
            }
            if charged.is_empty() {
                at.at = d.at;
            }
            if !chain.dry_run {
                charged.push((group, d.at));
            }
            if d.level > 0 && tightest.is_none_or(|(_, r, _)| d.value < r) {
                tightest = Some((level, d.value, d.reset));
            }
        }
        let decision = match tightest {
            None => Decision::Allowed { remaining: u64::MAX, reset_after: 0, binding: None },
            Some((i, remaining, reset_after)) => {
                let Some(l) = chain.levels().nth(i) else {
                    return Err(ServerError::Unavailable("redis named no level".into()));
                };
                Decision::Allowed {
                    remaining,
                    reset_after,
                    binding: Some(Binding { scope: l.scope, limit: *l.rule.limit }),
                }
            }
        };
        Ok((Verdict { decision, shadow: chain.shadow }, at))
    }

    /// Refunds what earlier groups of a Cluster decision were charged (best effort:
    /// a failure here under-admits, never over-admits).
    async fn give_back(&self, chain: &Chain<'_>, now: Nanos, charged: &[((usize, usize), Nanos)]) {
        for &(group, at) in charged {
            let _ =
                self.call("refund", chain, group, now, [chain.cost, us(at), 0, 0, 0, 0, 0]).await;
        }
    }

    /// Charges `units` to every level without checking.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn charge(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        if units == 0 || chain.unknown_tenant {
            return Ok(());
        }
        for group in self.groups(chain) {
            self.call("charge", chain, group, now, [units, 0, 0, 0, 0, 0, 0]).await?;
        }
        Ok(())
    }

    /// Gives back `units` of a grant (or decision: `hold` 0) made at `granted_at`.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn refund_grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        granted_at: Nanos,
        hold: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        if units == 0 || chain.unknown_tenant {
            return Ok(());
        }
        for group in self.groups(chain) {
            self.call("refund", chain, group, now, [units, us(granted_at), us(hold), 0, 0, 0, 0])
                .await?;
        }
        Ok(())
    }

    /// Grants up to `max` units (all levels or none), after returning `back` (units,
    /// granted at, hold) of an earlier grant. With `need > 0`: nothing unless every
    /// level has `need`, and at most half of what is left.
    pub(crate) async fn grant_raw(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        max: u64,
        hold: Nanos,
        need: u64,
        back: (u64, Nanos, Nanos),
    ) -> Result<Granted, ServerError> {
        if chain.unknown_tenant || max == 0 {
            self.refund_grant(chain, now, back.1, back.2, back.0).await?;
            return Ok(Granted { units: 0, granted_at: now, hold, ..Granted::default() });
        }
        let groups = self.groups(chain);
        let mut done: Vec<((usize, usize), Granted)> = Vec::with_capacity(groups.len());
        let mut units = max;
        let mut result = Granted { units: 0, granted_at: now, hold, ..Granted::default() };
        result.left = u64::MAX;
        for &group in &groups {
            let r = self
                .call(
                    "grant",
                    chain,
                    group,
                    now,
                    [units, us(hold), need, back.0, us(back.1), us(back.2), 0],
                )
                .await;
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    for (g, got) in &done {
                        let _ = self
                            .call(
                                "refund",
                                chain,
                                *g,
                                now,
                                [got.units, us(got.granted_at), us(got.hold), 0, 0, 0, 0],
                            )
                            .await;
                    }
                    return Err(e);
                }
            };
            let get = |i: usize| r.get(i).copied().unwrap_or(0);
            let g = Granted {
                units: u64::try_from(get(0)).unwrap_or(0),
                granted_at: ns(get(1)),
                hold: ns(get(2)),
                binding: usize::try_from(get(3)).unwrap_or(0),
                left: u64::try_from(get(4)).unwrap_or(0),
                tight: usize::try_from(get(5)).unwrap_or(0),
                reset: ns(get(6)),
                failed: usize::try_from(get(7)).unwrap_or(0),
                wait: ns(get(8)),
            };
            if g.failed > 0 && result.failed == 0 {
                (result.failed, result.wait) = (group.0 + g.failed, g.wait);
            }
            if g.tight > 0 && g.left < result.left {
                (result.left, result.tight, result.reset) = (g.left, group.0 + g.tight, g.reset);
            }
            // Each group is asked for what the earlier ones granted: a group that
            // grants less names the new binding level.
            if g.binding > 0 {
                result.binding = group.0 + g.binding;
            }
            units = units.min(g.units);
            result.granted_at = g.granted_at;
            result.hold = result.hold.min(g.hold);
            done.push((group, g));
            if units == 0 {
                break;
            }
        }
        // Earlier groups may have granted more than later ones could: give back the
        // difference (and everything, when some group had nothing).
        for (g, got) in &done {
            if got.units > units {
                let _ = self
                    .call(
                        "refund",
                        chain,
                        *g,
                        now,
                        [got.units - units, us(got.granted_at), us(got.hold), 0, 0, 0, 0],
                    )
                    .await;
            }
        }
        result.units = units;
        if groups.len() > 1 {
            // Several clocks may have stamped the groups: the earliest stamp and the
            // shortest hold bound every group's grant.
            result.granted_at = done.iter().map(|(_, g)| g.granted_at).min().unwrap_or(now);
        }
        Ok(result)
    }

    /// Grants up to `max` units from every level, spendable for at most `hold`.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        max: u64,
        hold: Nanos,
    ) -> Result<Grant, ServerError> {
        let g = self.grant_raw(chain, now, max, hold, 0, (0, 0, 0)).await?;
        let binding =
            (g.binding > 0).then(|| chain.levels().nth(g.binding - 1)).flatten().map(|l| l.scope);
        Ok(Grant { units: g.units, granted_at: g.granted_at, hold: g.hold, binding })
    }

    /// One lease renewal in one script call on a single Redis (the `lease` op: the
    /// old lease's unspent units back, then a grant sized by the grant rule); on a
    /// Cluster whose chain spans several hash tags, the same steps call by call.
    ///
    /// # Errors
    ///
    /// Redis unreachable, or a reply that is not the script's.
    pub async fn lease(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        renewal: &Renewal,
    ) -> Result<Leased, ServerError> {
        let back = renewal.back.unwrap_or_default();
        let groups = self.groups(chain);
        let &[group] = groups.as_slice() else {
            self.refund_grant(chain, now, back.granted_at, back.hold, back.units).await?;
            let remaining = self.remaining(chain, now).await?;
            let capacity = super::capacity(chain);
            if goes_direct(remaining, renewal.ask.cost, renewal.active) {
                return Ok(Leased::Direct);
            }
            let size = grant_size(&renewal.ask, remaining, capacity, renewal.active);
            let g = self.grant(chain, now, size, renewal.ask.hold).await?;
            if g.units == 0 || g.units < renewal.ask.cost {
                self.refund_grant(chain, now, g.granted_at, g.hold, g.units).await?;
                return Ok(Leased::Short);
            }
            return Ok(Leased::Granted(g));
        };
        let ask = &renewal.ask;
        let args = [
            ask.cap(),
            us(ask.hold),
            ask.cost,
            back.units,
            us(back.granted_at),
            us(back.hold),
            renewal.active,
        ];
        let r = self.call("lease", chain, group, now, args).await?;
        let &[granted, units, at, hold, binding] = r.as_slice() else {
            tracing::debug!(reply = ?r, "malformed lease reply");
            return Err(StoreError::Malformed("lease").into());
        };
        match granted {
            1 => {}
            2 => return Ok(Leased::Direct),
            0 => return Ok(Leased::Short),
            _ => {
                tracing::debug!(reply = ?r, "malformed lease reply");
                return Err(StoreError::Malformed("lease").into());
            }
        }
        let units = u64::try_from(units).unwrap_or(0);
        let binding = usize::try_from(binding).ok().and_then(|b| b.checked_sub(1));
        if units == 0 || units < ask.cost || binding.is_some_and(|b| b >= chain.len()) {
            tracing::debug!(reply = ?r, "malformed lease reply");
            return Err(StoreError::Malformed("lease").into());
        }
        Ok(Leased::Granted(Grant {
            units,
            granted_at: ns(at),
            hold: ns(hold),
            binding: binding.and_then(|b| chain.levels().nth(b)).map(|l| l.scope),
        }))
    }

    /// Units left at the tightest level.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn remaining(&self, chain: &Chain<'_>, now: Nanos) -> Result<u64, ServerError> {
        if chain.is_empty() {
            return Ok(u64::MAX);
        }
        let mut least = u64::MAX;
        for group in self.groups(chain) {
            let r = self.call("remaining", chain, group, now, [0; 7]).await?;
            least = least.min(u64::try_from(r.first().copied().unwrap_or(0)).unwrap_or(0));
        }
        Ok(least)
    }
}

#[cfg(test)]
mod tests {
    use limiter_core::policy::from_yaml;

    use super::*;

    #[test]
    fn the_example_policy_fits_and_limits_out_of_range_are_named() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../examples/policies.yaml"
        ))
        .unwrap();
        check_policy(&from_yaml(&text, "policies.yaml").unwrap()).unwrap();
        let policy = from_yaml(
            "version: 1\ntenants:\n  big:\n    limit: { algorithm: token_bucket, rate: 7/s, burst: 1000000000000 }\n  ok:\n    limit: { algorithm: sliding_counter, limit: 1000000, window: 1d }\n",
            "p.yaml",
        )
        .unwrap();
        let e = check_policy(&policy).unwrap_err();
        assert!(e.starts_with("tenants.big.limit: token bucket"), "{e}");
        assert!(!e.contains("tenants.ok"), "{e}");
    }

    #[test]
    fn keys_are_length_prefixed_and_tagged_by_tenant() {
        let k = |scope, t, r, key| {
            let (tag, name) = tag(&LimitKeyRef::new(scope, t, r, key));
            format!("{}.{name}", tag as char)
        };
        assert_eq!(k(Scope::Key, "acme", "/r", "k"), "t.acme");
        assert_eq!(k(Scope::TenantRoute, "acme", "/r", ""), "t.acme");
        assert_eq!(k(Scope::Route, "acme", "/r", ""), "r./r");
        assert_eq!(k(Scope::Global, "acme", "/r", ""), "g.");
        assert_eq!(gcd(7_000, 1_000_000_000), 1_000);
    }
}
