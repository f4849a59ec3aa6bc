//! The settings of the Redis store (`store.redis`), as the store uses them.

use std::time::Duration;

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
