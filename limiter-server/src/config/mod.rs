//! The server's configuration, in two stages: the `config` crate layers defaults, an
//! optional YAML file and `LIMITER__*` environment variables into a raw struct (unknown
//! fields refused); `TryFrom` then checks every value and reports all problems at once.
//!
//! Environment variables name nested fields with `__`: `LIMITER__LISTEN=0.0.0.0:50051`,
//! `LIMITER__STORE__MAX_KEYS=2000000`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use limiter_core::policy::NameBounds;
use serde::Deserialize;

pub mod cluster;
pub mod redis;
pub mod security;
mod typed;

use self::cluster::RawCluster;
pub use self::cluster::{ClusterConfig, Membership, Peer};
use self::redis::RawRedis;
pub use self::redis::StoreKind;

/// Exit status for bad configuration (`EX_CONFIG`... `EX_USAGE` in sysexits: 64).
pub const EXIT_BAD_CONFIG: i32 = 64;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    listen: String,
    admin_listen: String,
    policy_file: Option<String>,
    store: RawStore,
    limits: RawLimits,
    envoy: RawEnvoy,
    rlqs: RawRlqs,
    reload: RawReload,
    shutdown: RawShutdown,
    cluster: RawCluster,
    security: security::RawSecurity,
    dashboard: RawDashboard,
    tracing: RawTracing,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTracing {
    otlp_endpoint: String,
    sample_ratio: f64,
    service_name: String,
    export_timeout_ms: i64,
}

pub use crate::trace::TracingConfig;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDashboard {
    show_keys: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawStore {
    kind: String,
    max_keys: i64,
    sweep_interval_ms: i64,
    redis: RawRedis,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    max_tenant_len: i64,
    max_route_len: i64,
    max_key_len: i64,
    max_batch: i64,
    max_descriptors: i64,
    max_message_bytes: i64,
    max_open_tickets: i64,
    max_held_permits: i64,
    max_concurrent_streams: i64,
    max_keys_per_tenant: i64,
    max_log_entries: i64,
    max_connections: i64,
    max_admin_connections: i64,
    header_timeout_ms: i64,
    idle_timeout_ms: i64,
    admin_idle_timeout_ms: i64,
    keepalive_interval_ms: i64,
    keepalive_timeout_ms: i64,
    max_policy_bytes: i64,
    request_timeout_ms: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEnvoy {
    tenant_from: String,
    tenant_key: String,
    route_key: String,
    default_route: Option<String>,
    descriptor_limits: String,
    descriptor_limit_cap: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRlqs {
    round_ms: i64,
    ttl_s: i64,
    burst_ms: i64,
    slack_ms: i64,
    max_buckets: i64,
    max_total_buckets: i64,
    idle_ms: i64,
    envoys_carry_tokens: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawReload {
    poll_interval_ms: i64,
    settle_ms: i64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawShutdown {
    drain_delay_ms: i64,
    grace_ms: i64,
}

const DEFAULTS: &str = r#"
listen: "127.0.0.1:50051"
admin_listen: "127.0.0.1:9090"
store:
  kind: memory
  max_keys: 1000000
  sweep_interval_ms: 10000
  redis:
    url: "redis://127.0.0.1:6379"
    cluster_nodes: ""
    connections: 2
    pool: multiplexed
    tls_ca_file: ""
    connect_timeout_ms: 500
    command_timeout_ms: 100
    breaker_threshold: 5
    probe_interval_ms: 1000
    key_prefix: lim
    clock: redis
    batches: true
limits:
  max_tenant_len: 128
  max_route_len: 256
  max_key_len: 256
  max_batch: 100
  max_descriptors: 16
  max_message_bytes: 65536
  max_open_tickets: 100000
  max_held_permits: 1000000
  max_concurrent_streams: 256
  max_keys_per_tenant: 100000
  max_log_entries: 100000
  max_connections: 0
  max_admin_connections: 0
  header_timeout_ms: 10000
  idle_timeout_ms: 300000
  admin_idle_timeout_ms: 60000
  keepalive_interval_ms: 30000
  keepalive_timeout_ms: 10000
  max_policy_bytes: 50331648
  request_timeout_ms: 30000
envoy:
  tenant_from: domain
  tenant_key: tenant
  route_key: route
  descriptor_limits: ignore
rlqs:
  round_ms: 250
  ttl_s: 2
  burst_ms: 100
  slack_ms: 100
  max_buckets: 10000
  max_total_buckets: 200000
  idle_ms: 60000
  envoys_carry_tokens: false
dashboard:
  show_keys: false
tracing:
  otlp_endpoint: ""
  sample_ratio: 0.01
  service_name: limiter
  export_timeout_ms: 5000
reload:
  poll_interval_ms: 1000
  settle_ms: 500
shutdown:
  drain_delay_ms: 2000
  grace_ms: 10000
cluster:
  membership: none
  node_id: ""
  advertise: ""
  weight: 1
  peers: ""
  health_interval_ms: 200
  fail_after: 3
  recover_after: 2
  registry_url: "redis://127.0.0.1:6379"
  registry_key: "limiter:members"
  registry_ttl_ms: 3000
  registry_poll_ms: 250
  dns_name: ""
  dns_server: ""
  dns_interval_ms: 2000
  dns_timeout_ms: 1000
  forward_timeout_ms: 1000
  handoff_timeout_ms: 2000
  fence_ms: 0
  slice_ttl_ms: 4000
  insecure_peers: false
  replication: true
  replication_interval_ms: 50
  replication_queue: 100000
  replication_timeout_ms: 500
"#;

/// Where a Envoy request's tenant comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantFrom {
    /// The request's `domain`.
    Domain,
    /// The descriptor entry with this key.
    Entry(String),
}

/// How `ShouldRateLimit` descriptors map onto tenant, route and key.
///
/// - tenant: the request's `domain` (default), or a descriptor entry's value;
/// - route: the value of the entry whose key is `route_key` (default `route`), else
///   `default_route` when set, else the descriptor is refused;
/// - key: every other entry, as `key=value` joined by `|`, in order (none: no key).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyMapping {
    /// Tenant source.
    pub tenant_from: TenantFrom,
    /// The entry key naming the route.
    pub route_key: String,
    /// The route of descriptors without a route entry.
    pub default_route: Option<String>,
    /// What a descriptor's own `limit` (Envoy's per-descriptor override) does.
    pub descriptor_limits: DescriptorLimits,
}

/// What a descriptor's `limit` override does (`envoy.descriptor_limits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DescriptorLimits {
    /// Ignored (the default): only the policy's levels apply.
    Ignore,
    /// Checked as a level of its own, keyed by the descriptor, in addition to the
    /// policy's levels: a fixed window of the override's size and unit (calendar
    /// month and year in UTC), its size capped at `cap` over that unit.
    Apply {
        /// The most an override may grant, as a rate (`envoy.descriptor_limit_cap`).
        cap: limiter_core::rate::Rate,
    },
}

/// Envoy's Rate Limit Quota Service (`rlqs.*`): how assignments are paid for and sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RlqsConfig {
    /// How often each stream pays for its buckets' rates and re-sends their
    /// assignments (`rlqs.round_ms`).
    pub round: Duration,
    /// An assignment's time to live, whole seconds (Envoy reads no fraction), at
    /// least two rounds (`rlqs.ttl_s`).
    pub ttl: Duration,
    /// An assignment's `max_tokens`: its rate over this long, at least 1
    /// (`rlqs.burst_ms`).
    pub burst: Duration,
    /// How much later than sent an Envoy may start an assignment's TTL (delivery):
    /// paid for as well (`rlqs.slack_ms`).
    pub slack: Duration,
    /// Buckets one stream may hold; beyond, a new bucket is denied
    /// (`rlqs.max_buckets`).
    pub max_buckets: usize,
    /// Buckets all of this node's streams may hold together (each costs the server a
    /// few KB); beyond, a new bucket is denied (`rlqs.max_total_buckets`).
    pub max_total_buckets: usize,
    /// A bucket with no requests reported for this long is abandoned
    /// (`rlqs.idle_ms`).
    pub idle: Duration,
    /// Every Envoy on this server is 1.33 or later, which starts a bucket that
    /// replaces a live one with its share of the old one's tokens rather than full:
    /// a change is paid for only the capacity it adds (`rlqs.envoys_carry_tokens`).
    /// An older Envoy would admit up to a new bucket's `max_tokens` beyond the
    /// limits at each change: off by default, logged when on.
    pub envoys_carry_tokens: bool,
}

/// Bounds on what callers may send.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Name lengths.
    pub names: NameBounds,
    /// Requests in one `ShouldAllowBatch`.
    pub max_batch: usize,
    /// Descriptors in one `ShouldRateLimit`.
    pub max_descriptors: usize,
    /// Largest decoded gRPC message.
    pub max_message_bytes: usize,
    /// Tickets of check-now-charge-later requests not yet reported.
    pub max_open_tickets: usize,
    /// Permits of concurrency levels named at once (a full book forgets the one
    /// closest to expiry: it comes back then, not sooner).
    pub max_held_permits: usize,
    /// Calls in progress at once on one HTTP/2 connection (more wait in the client).
    pub max_concurrent_streams: u32,
    /// Key-scope counters one tenant may hold in the memory store; a request for a
    /// new key beyond it is refused `RESOURCE_EXHAUSTED`.
    pub max_keys_per_tenant: u32,
    /// The largest `limit` of a sliding log a policy may set: its entries per key
    /// (16 bytes each).
    pub max_log_entries: u64,
    /// Open gRPC connections at most (0: derived from the open-file limit).
    pub max_connections: usize,
    /// Open admin connections at most (0: derived from the open-file limit).
    pub max_admin_connections: usize,
    /// Time from a connection's accept to its first request, on both ports.
    pub header_timeout: Duration,
    /// Time a gRPC connection may stay open with no call in flight.
    pub idle_timeout: Duration,
    /// Time an admin connection may stay open with no request in flight.
    pub admin_idle_timeout: Duration,
    /// HTTP/2 keep-alive pings on the gRPC port, this often.
    pub keepalive_interval: Duration,
    /// A ping not answered in this long closes the connection.
    pub keepalive_timeout: Duration,
    /// The largest policy file loaded (memory: about 2.3 KB per tenant while loading).
    pub max_policy_bytes: u64,
    /// A gRPC call not answered in this long (a body sent too slowly, say) is ended.
    pub request_timeout: Duration,
}

impl Limits {
    /// The bounds of the gRPC and admin listeners' connections for an open-file limit
    /// of `files` (the caps not set are derived from it).
    pub fn connections(
        &self,
        files: u64,
    ) -> (crate::listener::ConnectionLimits, crate::listener::ConnectionLimits) {
        let (grpc, admin) = crate::listener::default_caps(files);
        let pick = |set: usize, derived: usize| if set == 0 { derived } else { set };
        (
            crate::listener::ConnectionLimits {
                max: pick(self.max_connections, grpc),
                header_timeout: self.header_timeout,
                idle_timeout: self.idle_timeout,
            },
            crate::listener::ConnectionLimits {
                max: pick(self.max_admin_connections, admin),
                header_timeout: self.header_timeout,
                idle_timeout: self.admin_idle_timeout,
            },
        )
    }
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// gRPC listen address.
    pub listen: SocketAddr,
    /// Admin HTTP listen address.
    pub admin_listen: SocketAddr,
    /// The policy file.
    pub policy_file: PathBuf,
    /// Where counters live.
    pub store: StoreKind,
    /// Most counters held in memory.
    pub max_keys: usize,
    /// How often idle counters are swept.
    pub sweep_interval: Duration,
    /// Caller bounds.
    pub limits: Limits,
    /// Envoy descriptor mapping (RLS descriptors and RLQS bucket ids alike).
    pub envoy: EnvoyMapping,
    /// Envoy's Rate Limit Quota Service.
    pub rlqs: RlqsConfig,
    /// Fallback poll of the policy file (file events are the main trigger).
    pub reload_poll: Duration,
    /// How long the policy file must be still before a change is loaded.
    pub reload_settle: Duration,
    /// Whether the status page shows keys as sent (default: a short keyed hash).
    pub show_keys: bool,
    /// After SIGTERM: readiness is false for this long before the listener closes.
    pub drain_delay: Duration,
    /// Then in-flight calls get this long to finish.
    pub grace: Duration,
    /// Several nodes sharing the tenants.
    pub cluster: ClusterConfig,
    /// TLS and authentication of the listeners and of calls to peers.
    pub security: security::SecurityConfig,
    /// OpenTelemetry traces.
    pub tracing: TracingConfig,
}

/// Every problem found in the configuration.
#[derive(Debug, thiserror::Error)]
#[error("invalid server configuration:\n  {}", .0.join("\n  "))]
pub struct ConfigError(pub Vec<String>);

impl ServerConfig {
    /// Defaults, then `file` (YAML) if given, then `LIMITER__*` variables.
    ///
    /// # Errors
    ///
    /// Unreadable or malformed sources, unknown fields, and every invalid value.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with_env(file, std::env::vars())
    }

    /// Defaults with `policy` as the policy file, nothing else read (tests, benches,
    /// embedding).
    ///
    /// # Errors
    ///
    /// None in practice: the defaults are valid.
    pub fn for_policy(policy: &Path) -> Result<Self, ConfigError> {
        Self::load_with_env(
            None,
            [("LIMITER__POLICY_FILE".to_owned(), policy.display().to_string())],
        )
    }

    /// Like [`Self::load`] with an explicit environment (tests).
    ///
    /// # Errors
    ///
    /// As [`Self::load`].
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, ConfigError> {
        let env: config::Map<String, String> =
            env.into_iter().filter(|(k, _)| k.starts_with("LIMITER__")).collect();
        let mut b = config::Config::builder()
            .add_source(config::File::from_str(DEFAULTS, config::FileFormat::Yaml))
            .add_source(config::File::from_str(security::DEFAULTS, config::FileFormat::Yaml));
        if let Some(f) = file {
            b = b.add_source(config::File::from(f).format(config::FileFormat::Yaml));
        }
        b = b.add_source(
            config::Environment::with_prefix("LIMITER")
                .prefix_separator("__")
                .separator("__")
                .try_parsing(true)
                .source(Some(env)),
        );
        let raw: Raw = b
            .build()
            .and_then(config::Config::try_deserialize)
            .map_err(|e| ConfigError(vec![e.to_string()]))?;
        Self::try_from(raw)
    }
}

/// The non-empty, trimmed items of a comma-separated setting.
pub(crate) fn comma_list(text: &str) -> Vec<String> {
    text.split(',').map(str::trim).filter(|n| !n.is_empty()).map(str::to_owned).collect()
}

pub(super) fn positive(errors: &mut Vec<String>, name: &str, v: i64, max: i64) -> usize {
    if v <= 0 || v > max {
        errors.push(format!("{name}: must be between 1 and {max}, found {v}"));
        return 1;
    }
    usize::try_from(v).unwrap_or(1)
}

/// A count where 0 means "derive it".
fn count_or_zero(errors: &mut Vec<String>, name: &str, v: i64) -> usize {
    if v == 0 {
        return 0;
    }
    positive(errors, name, v, 1 << 24)
}

pub(super) fn millis(errors: &mut Vec<String>, name: &str, v: i64, allow_zero: bool) -> Duration {
    if v < 0 || (v == 0 && !allow_zero) {
        errors.push(format!(
            "{name}: must be {} milliseconds, found {v}",
            if allow_zero { "0 or more" } else { "at least 1" }
        ));
        return Duration::from_millis(1);
    }
    Duration::from_millis(u64::try_from(v).unwrap_or(0))
}

#[cfg(test)]
mod tests;
