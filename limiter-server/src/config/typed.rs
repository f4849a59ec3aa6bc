//! Raw settings to typed ones: every section converted and checked, every error
//! collected (a bad file reports all its mistakes at once), then the cross-checks.

use std::net::SocketAddr;
use std::path::PathBuf;

use limiter_core::key::MAX_NAME_LEN;
use limiter_core::policy::NameBounds;

use super::cluster::cluster_config;
use super::redis::redis_settings;
use super::*;

impl TryFrom<Raw> for ServerConfig {
    type Error = ConfigError;

    fn try_from(raw: Raw) -> Result<Self, ConfigError> {
        let mut errors = Vec::new();
        let mut addr = |name: &str, v: &str| match v.parse::<SocketAddr>() {
            Ok(a) => Some(a),
            Err(e) => {
                errors.push(format!("{name}: `{v}` is not an address like 127.0.0.1:50051 ({e})"));
                None
            }
        };
        let listen = addr("listen", &raw.listen);
        let admin_listen = addr("admin_listen", &raw.admin_listen);
        let policy_file = match raw.policy_file {
            Some(p) if !p.trim().is_empty() => PathBuf::from(p),
            _ => {
                errors.push("policy_file: required (the tenant policy YAML)".to_owned());
                PathBuf::new()
            }
        };
        let store = match raw.store.kind.as_str() {
            "memory" => StoreKind::Memory,
            "redis" => StoreKind::Redis(redis_settings(&mut errors, &raw.store.redis)),
            other => {
                errors.push(format!("store.kind: expected `memory` or `redis`, found `{other}`"));
                StoreKind::Memory
            }
        };
        let max_keys = positive(&mut errors, "store.max_keys", raw.store.max_keys, 1 << 40);
        let sweep_interval =
            millis(&mut errors, "store.sweep_interval_ms", raw.store.sweep_interval_ms, false);
        let name_max = i64::try_from(MAX_NAME_LEN).unwrap_or(i64::MAX);
        let l = &raw.limits;
        let limits = Limits {
            names: NameBounds {
                tenant: positive(&mut errors, "limits.max_tenant_len", l.max_tenant_len, name_max),
                route: positive(&mut errors, "limits.max_route_len", l.max_route_len, name_max),
                key: positive(&mut errors, "limits.max_key_len", l.max_key_len, name_max),
            },
            max_batch: positive(&mut errors, "limits.max_batch", l.max_batch, 10_000),
            max_descriptors: positive(
                &mut errors,
                "limits.max_descriptors",
                l.max_descriptors,
                1_000,
            ),
            max_message_bytes: positive(
                &mut errors,
                "limits.max_message_bytes",
                l.max_message_bytes,
                64 << 20,
            ),
            max_open_tickets: positive(
                &mut errors,
                "limits.max_open_tickets",
                l.max_open_tickets,
                100_000_000,
            ),
            max_held_permits: positive(
                &mut errors,
                "limits.max_held_permits",
                l.max_held_permits,
                100_000_000,
            ),
            max_concurrent_streams: u32::try_from(positive(
                &mut errors,
                "limits.max_concurrent_streams",
                l.max_concurrent_streams,
                1 << 20,
            ))
            .unwrap_or(1),
            max_keys_per_tenant: u32::try_from(positive(
                &mut errors,
                "limits.max_keys_per_tenant",
                l.max_keys_per_tenant,
                i64::from(u32::MAX),
            ))
            .unwrap_or(1),
            max_log_entries: positive(
                &mut errors,
                "limits.max_log_entries",
                l.max_log_entries,
                i64::try_from(limiter_core::policy::load::SLIDING_LOG_MAX_LIMIT)
                    .unwrap_or(i64::MAX),
            ) as u64,
            max_connections: count_or_zero(
                &mut errors,
                "limits.max_connections",
                l.max_connections,
            ),
            max_admin_connections: count_or_zero(
                &mut errors,
                "limits.max_admin_connections",
                l.max_admin_connections,
            ),
            header_timeout: millis(
                &mut errors,
                "limits.header_timeout_ms",
                l.header_timeout_ms,
                false,
            ),
            idle_timeout: millis(&mut errors, "limits.idle_timeout_ms", l.idle_timeout_ms, false),
            admin_idle_timeout: millis(
                &mut errors,
                "limits.admin_idle_timeout_ms",
                l.admin_idle_timeout_ms,
                false,
            ),
            keepalive_interval: millis(
                &mut errors,
                "limits.keepalive_interval_ms",
                l.keepalive_interval_ms,
                false,
            ),
            keepalive_timeout: millis(
                &mut errors,
                "limits.keepalive_timeout_ms",
                l.keepalive_timeout_ms,
                false,
            ),
            request_timeout: millis(
                &mut errors,
                "limits.request_timeout_ms",
                l.request_timeout_ms,
                false,
            ),
            max_policy_bytes: positive(
                &mut errors,
                "limits.max_policy_bytes",
                l.max_policy_bytes,
                1 << 40,
            ) as u64,
        };
        let tenant_from = match raw.envoy.tenant_from.as_str() {
            "domain" => TenantFrom::Domain,
            "entry" if !raw.envoy.tenant_key.is_empty() => {
                TenantFrom::Entry(raw.envoy.tenant_key.clone())
            }
            other => {
                errors.push(format!("envoy.tenant_from: expected `domain` or `entry` (with envoy.tenant_key), found `{other}`"));
                TenantFrom::Domain
            }
        };
        if raw.envoy.route_key.is_empty() {
            errors.push("envoy.route_key: must not be empty".to_owned());
        }
        let cap = raw.envoy.descriptor_limit_cap.as_deref().filter(|c| !c.is_empty());
        let descriptor_limits = match (raw.envoy.descriptor_limits.as_str(), cap) {
            ("ignore", _) => DescriptorLimits::Ignore,
            ("apply", Some(cap)) => match cap.parse::<limiter_core::rate::Rate>() {
                Ok(cap) => DescriptorLimits::Apply { cap },
                Err(e) => {
                    errors.push(format!(
                        "envoy.descriptor_limit_cap: {e}, found `{}`",
                        limiter_core::text::shorten(cap)
                    ));
                    DescriptorLimits::Ignore
                }
            },
            ("apply", None) => {
                errors.push(
                    "envoy.descriptor_limit_cap: `descriptor_limits: apply` needs a cap (a rate \
                     like `1000/s`): the most a descriptor's own limit may grant"
                        .to_owned(),
                );
                DescriptorLimits::Ignore
            }
            (other, _) => {
                errors.push(format!(
                    "envoy.descriptor_limits: expected `ignore` or `apply`, found `{}`",
                    limiter_core::text::shorten(other)
                ));
                DescriptorLimits::Ignore
            }
        };
        let rlqs = rlqs_config(&mut errors, &raw.rlqs);
        let reload_poll =
            millis(&mut errors, "reload.poll_interval_ms", raw.reload.poll_interval_ms, false);
        let reload_settle = millis(&mut errors, "reload.settle_ms", raw.reload.settle_ms, true);
        let drain_delay =
            millis(&mut errors, "shutdown.drain_delay_ms", raw.shutdown.drain_delay_ms, true);
        let grace = millis(&mut errors, "shutdown.grace_ms", raw.shutdown.grace_ms, true);
        let cluster = cluster_config(&mut errors, &raw.cluster, &raw.listen);
        let clustered = cluster.membership != Membership::Single;
        let security = security::config(&mut errors, &raw.security, clustered);
        if clustered && security.grpc.auth == security::AuthMode::None && !cluster.insecure_peers {
            errors.push(
                "cluster.membership: a cluster whose gRPC port has `security.grpc.auth: none` \
                 lets any client act as a peer (hand off counters, send forwarded calls); \
                 set security.grpc.auth to `token` or `mtls`, or set \
                 cluster.insecure_peers: true to accept that"
                    .to_owned(),
            );
        }
        let tracing = tracing_config(&mut errors, &raw.tracing);
        if !errors.is_empty() {
            return Err(ConfigError(errors));
        }
        Ok(Self {
            listen: listen.expect("checked"),
            admin_listen: admin_listen.expect("checked"),
            policy_file,
            store,
            max_keys,
            sweep_interval,
            limits,
            envoy: EnvoyMapping {
                tenant_from,
                route_key: raw.envoy.route_key,
                default_route: raw.envoy.default_route.filter(|r| !r.is_empty()),
                descriptor_limits,
            },
            rlqs,
            reload_poll,
            reload_settle,
            show_keys: raw.dashboard.show_keys,
            drain_delay,
            grace,
            cluster,
            security,
            tracing,
        })
    }
}

fn rlqs_config(errors: &mut Vec<String>, r: &super::RawRlqs) -> super::RlqsConfig {
    let round = millis(errors, "rlqs.round_ms", r.round_ms, false);
    let ttl_s = positive(errors, "rlqs.ttl_s", r.ttl_s, 3600) as u64;
    let ttl = Duration::from_secs(ttl_s);
    if ttl < 2 * round {
        errors.push(format!(
            "rlqs.ttl_s: must be at least two rounds (rlqs.round_ms {} ms), found {ttl_s} s: an \
             assignment would expire before its next renewal could arrive",
            round.as_millis()
        ));
    }
    super::RlqsConfig {
        round,
        ttl,
        burst: millis(errors, "rlqs.burst_ms", r.burst_ms, false),
        slack: millis(errors, "rlqs.slack_ms", r.slack_ms, true),
        max_buckets: positive(errors, "rlqs.max_buckets", r.max_buckets, 1 << 20),
        max_total_buckets: positive(errors, "rlqs.max_total_buckets", r.max_total_buckets, 1 << 26),
        idle: millis(errors, "rlqs.idle_ms", r.idle_ms, false),
        envoys_carry_tokens: r.envoys_carry_tokens,
    }
}

fn tracing_config(errors: &mut Vec<String>, t: &super::RawTracing) -> super::TracingConfig {
    let endpoint = t.otlp_endpoint.trim();
    let otlp_endpoint = if endpoint.is_empty() {
        None
    } else {
        let valid = endpoint.strip_prefix("http://").is_some_and(|rest| {
            !rest.is_empty() && rest.len() <= 253 && !rest.contains(char::is_whitespace)
        });
        if !valid {
            errors.push(format!(
                "tracing.otlp_endpoint: expected `http://host:port` of an OTLP/gRPC collector \
                 (a local agent or sidecar), found `{}`",
                endpoint.chars().take(80).collect::<String>()
            ));
        }
        Some(endpoint.to_owned())
    };
    if !(0.0..=1.0).contains(&t.sample_ratio) {
        errors.push(format!("tracing.sample_ratio: must be from 0 to 1, found {}", t.sample_ratio));
    }
    if t.service_name.trim().is_empty() {
        errors.push("tracing.service_name: must not be empty".to_owned());
    }
    super::TracingConfig {
        otlp_endpoint,
        sample_ratio: t.sample_ratio,
        service_name: t.service_name.trim().to_owned(),
        export_timeout: millis(errors, "tracing.export_timeout_ms", t.export_timeout_ms, false),
    }
}
