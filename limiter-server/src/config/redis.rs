//! The settings of the Redis store (`store.redis`), as the store uses them.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use super::{comma_list, millis, positive};

/// How calls to a single Redis share connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolKind {
    /// `connections` multiplexed connections (each pipelines many calls at once),
    /// used in turn, reconnecting by themselves (the default: faster, see
    /// BENCHMARKS.md).
    Multiplexed,
    /// A `bb8` pool of up to `connections` connections, each lent to one call at a time.
    Bb8,
}

/// Whose clock decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisClock {
    /// Redis's `TIME` (the default: every server agrees).
    Redis,
    /// The server's clock, passed to the script (replaying fixed times in tests).
    Server,
}

/// How to reach Redis and how to treat it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisSettings {
    /// `redis://[:password@]host:port[/db]`, or `rediss://` for TLS.
    pub url: String,
    /// Cluster seed nodes (URLs like `url`); empty: a single Redis at `url`.
    pub cluster_nodes: Vec<String>,
    /// Connections to a single Redis.
    pub connections: usize,
    /// How calls share them.
    pub pool: PoolKind,
    /// A PEM file of the CA certificates that sign Redis's TLS certificate (`rediss://`),
    /// in place of the system's trust store.
    pub tls_ca_file: Option<std::path::PathBuf>,
    /// Deadline to connect.
    pub connect_timeout: Duration,
    /// Deadline of one call (the script and its reply).
    pub command_timeout: Duration,
    /// Consecutive failures that open the breaker.
    pub breaker_threshold: u64,
    /// While open, one probe call per this interval.
    pub probe_interval: Duration,
    /// Prefix of every key.
    pub key_prefix: String,
    /// Whose clock decides.
    pub clock: RedisClock,
    /// Decide from batches leased from Redis (one call per batch, not per request).
    pub batches: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawRedis {
    pub(super) url: String,
    pub(super) cluster_nodes: String,
    pub(super) connections: i64,
    pub(super) pool: String,
    pub(super) tls_ca_file: String,
    pub(super) connect_timeout_ms: i64,
    pub(super) command_timeout_ms: i64,
    pub(super) breaker_threshold: i64,
    pub(super) probe_interval_ms: i64,
    pub(super) key_prefix: String,
    pub(super) clock: String,
    pub(super) batches: bool,
}

/// The store chosen in `store.kind`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreKind {
    /// In the server's memory (`memory`, the default).
    Memory,
    /// In Redis (`redis`, settings under `store.redis`).
    Redis(RedisSettings),
}

pub(super) fn redis_settings(errors: &mut Vec<String>, r: &RawRedis) -> RedisSettings {
    let url_ok = |u: &str| u.starts_with("redis://") || u.starts_with("rediss://");
    if !url_ok(&r.url) {
        errors.push(format!(
            "store.redis.url: expected redis://[:password@]host:port or rediss:// (TLS), found `{}`",
            r.url
        ));
    }
    let cluster_nodes = comma_list(&r.cluster_nodes);
    for n in cluster_nodes.iter().filter(|n| !url_ok(n)) {
        errors.push(format!("store.redis.cluster_nodes: `{n}` is not a redis:// or rediss:// URL"));
    }
    if r.key_prefix.is_empty() || r.key_prefix.contains(['{', '}']) {
        errors.push("store.redis.key_prefix: must be non-empty, without `{` or `}`".to_owned());
    }
    let clock = match r.clock.as_str() {
        "redis" => RedisClock::Redis,
        "server" => RedisClock::Server,
        other => {
            errors
                .push(format!("store.redis.clock: expected `redis` or `server`, found `{other}`"));
            RedisClock::Redis
        }
    };
    let pool = match r.pool.as_str() {
        "multiplexed" => PoolKind::Multiplexed,
        "bb8" => PoolKind::Bb8,
        other => {
            errors.push(format!(
                "store.redis.pool: expected `multiplexed` or `bb8`, found `{other}`"
            ));
            PoolKind::Multiplexed
        }
    };
    let tls_ca_file = Some(r.tls_ca_file.trim()).filter(|f| !f.is_empty()).map(PathBuf::from);
    if let Some(f) = &tls_ca_file
        && !f.is_file()
    {
        errors.push(format!("store.redis.tls_ca_file: `{}` is not a readable file", f.display()));
    }
    RedisSettings {
        url: r.url.clone(),
        pool,
        tls_ca_file,
        cluster_nodes,
        connections: positive(errors, "store.redis.connections", r.connections, 64),
        connect_timeout: millis(
            errors,
            "store.redis.connect_timeout_ms",
            r.connect_timeout_ms,
            false,
        ),
        command_timeout: millis(
            errors,
            "store.redis.command_timeout_ms",
            r.command_timeout_ms,
            false,
        ),
        breaker_threshold: positive(
            errors,
            "store.redis.breaker_threshold",
            r.breaker_threshold,
            1_000,
        ) as u64,
        probe_interval: millis(errors, "store.redis.probe_interval_ms", r.probe_interval_ms, false),
        key_prefix: r.key_prefix.clone(),
        clock,
        batches: r.batches,
    }
}
