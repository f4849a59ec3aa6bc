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
use tracing::Instrument as _;

use limiter_core::algorithm::Window;
use limiter_core::calendar::Calendar;
use limiter_core::clock::Nanos;
use limiter_core::failure::Breaker;
use limiter_core::key::LimitKeyRef;
use limiter_core::policy::load::SLIDING_LOG_MAX_LIMIT as MAX_LOG;
use limiter_core::policy::{Chain, Level, Policy};
use limiter_core::{Limit, Scope};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use tokio::sync::OnceCell;

use crate::error::{ServerError, StoreError};
use crate::metrics as m;

mod ops;

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

/// One level's script parameters: kind and three numbers, and for a calendar window
/// its rule (whose window starts are passed with each call).
#[derive(Debug, Clone, Copy)]
struct Params {
    kind: &'static str,
    p: [u64; 3],
    calendar: Option<Calendar>,
}

fn params(limit: &Limit) -> Result<Params, String> {
    let window = |kind: &'static str, limit: u64, window: Window| match window {
        Window::Calendar(c) => {
            if limit > EXACT {
                return Err(
                    "limit too large for the Redis store's exact arithmetic (2^50)".to_owned()
                );
            }
            let kind = if kind == "fw" { "cw" } else { "cc" };
            Ok(Params { kind, p: [limit, 0, 0], calendar: Some(c) })
        }
        Window::Fixed(w) => {
            let window = w.get();
            if !window.is_multiple_of(MICRO) {
                return Err(format!(
                    "window of {window} ns is not a whole number of microseconds (the Redis store counts time in microseconds)"
                ));
            }
            if limit > EXACT || window / MICRO > EXACT {
                return Err(
                    "limit or window too large for the Redis store's exact arithmetic (2^50)"
                        .to_owned(),
                );
            }
            Ok(Params { kind, p: [limit, window / MICRO, 0], calendar: None })
        }
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
            Ok(Params { kind: "tb", p: [a, p, burst], calendar: None })
        }
        Limit::FixedWindow(w) => window("fw", w.limit().get(), w.window()),
        Limit::SlidingLog(w) => window("sl", w.limit().get(), Window::Fixed(w.window())),
        Limit::SlidingCounter(w) => window("sc", w.limit().get(), w.window()),
        // Permits in use are the units charged within the last TTL that were not
        // released: a sliding log over the TTL, a release a refund of its entry.
        Limit::Concurrency(c) if c.limit().get() > MAX_LOG => Err(format!(
            "concurrency limit {} is above {MAX_LOG}: the Redis store keeps one \
             entry per permit charged",
            c.limit()
        )),
        Limit::Concurrency(c) => window("sl", c.limit().get(), Window::Fixed(c.permit_ttl())),
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

    fn key_of(&self, level: &Level<'_>, out: &mut Vec<String>) -> Result<Params, ServerError> {
        let params = params(&level.rule.limit).map_err(|e| ServerError::invalid("policy", e))?;
        let Params { kind, p, calendar } = params;
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
        if k.budget > 0 {
            let _ = write!(key, ":b{}", k.budget);
        }
        // A window algorithm's key names its windows, not its limit: a count per window
        // means the same under any limit, so a changed limit keeps it (as the memory
        // store does). A calendar rule's starts move with time, so are not named.
        match (calendar, kind) {
            (Some(c), _) => {
                let _ = write!(
                    key,
                    ":{kind}.{}{}.{}.{}",
                    c.count(),
                    c.unit().suffix(),
                    c.zone_name(),
                    c.week_start().as_str()
                );
            }
            (None, "fw" | "sc") => {
                let _ = write!(key, ":{kind}.{}", p[1]);
            }
            (None, _) => {
                let _ = write!(key, ":{kind}.{}.{}.{}", p[0], p[1], p[2]);
            }
        }
        let log = (kind == "sl").then(|| format!("{key}:log"));
        // A sliding log's hash first, then its log.
        out.push(key);
        out.extend(log);
        Ok(params)
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
        let span = crate::trace::span!("store", db.system = "redis", otel.kind = "client");
        self.invoke_on(inv).instrument(span).await
    }

    async fn invoke_on(&self, inv: &redis::ScriptInvocation<'_>) -> Result<Vec<i64>, StoreError> {
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

    /// One script call on the levels `group` of `chain`, with the op's arguments
    /// (`ARGV[3..]` before the levels: see [`op_args`]).
    async fn call(
        &self,
        op: &'static str,
        chain: &Chain<'_>,
        group: (usize, usize),
        now: Nanos,
        args: [u64; OP_ARGS],
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
        for Params { kind, p, calendar } in levels {
            match calendar {
                Some(c) => {
                    inv.arg(kind).arg(p[0]);
                    for start in c.starts_around(now) {
                        inv.arg(us(start));
                    }
                }
                None => {
                    inv.arg(kind).arg(p[0]).arg(p[1]).arg(p[2]);
                }
            }
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
}

/// How many arguments every op of the chain script takes before the levels
/// (`ARGV[3..12]` of `lua/chain.lua`; an op reads the ones it needs).
const OP_ARGS: usize = 10;

/// An op's arguments, `head` then zeros: the script reads the levels from a fixed
/// place, so every call passes all [`OP_ARGS`].
fn op_args(head: &[u64]) -> [u64; OP_ARGS] {
    let mut args = [0; OP_ARGS];
    args[..head.len()].copy_from_slice(head);
    args
}

#[cfg(test)]
mod tests;
