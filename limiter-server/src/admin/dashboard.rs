//! The built-in status page: `/dashboard` (one self-contained HTML page, no external
//! assets) and the JSON it refreshes from, `/dashboard/data`.
//!
//! `/dashboard/data` answers:
//!
//! ```text
//! { "now": unix seconds, "ready": bool,
//!   "server": { "version", "started_at", "uptime_seconds" },
//!   "latency": { "window_seconds", "count", "p50", "p90", "p99", "p999" } (seconds, null
//!     without decisions in the window),
//!   "invalid": { "total", "by_field": { field: calls } },
//!   "store": { "keys", "max_keys", "evicted_idle", "evicted_live" },
//!   "policy": { "version", "loaded_at", "reloads_ok", "reloads_failed", "last_error" },
//!   "totals": { "allowed", "rejected", "shadow_rejected" },
//!   "by_reason": { REASON: rejections }, "by_route": { route: rejections },
//!   "history": [ { "t", "allowed", "rejected", "shadow_rejected", "invalid", "p50", "p99",
//!     "by_reason": {..} } ],
//!   "routes": [ { "name", "on_limiter_failure", "shadow", "lease" } ],
//!   "leases": { "outstanding", "open", "granted", "returned", "spent", "written_off" },
//!   "ring": { "epoch", "members" },
//!   "replication": { "on", "held", "lag_seconds", "queued", "resets": { REASON: n } },
//!   "top_tenants": { "by_rejections": [..], "by_admitted_cost": [..] },
//!   "top_keys": { "by_rejections": [..], "by_admitted_cost": [..] } }
//! ```
//!
//! Decision figures come from the same counters `/metrics` exports (sampled once a
//! second into a ten-minute history), so the page and Prometheus agree.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use limiter_core::clock::NANOS_PER_SEC;
use limiter_core::policy::FailurePolicy;
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::metrics::{self as m};
use crate::owner::Owner;
use crate::owner::heavy::Hitter;

/// Seconds of history kept.
const HISTORY: usize = 600;

/// The window the page's latency percentiles are taken over, in samples (seconds).
const LATENCY_WINDOW: usize = 60;

/// The samples of metric `name` in Prometheus text: (labels, value).
fn series<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines()
        .filter(move |l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .filter_map(|l| {
            let (labels, v) = l.rsplit_once(' ')?;
            Some((labels, v.trim().parse::<f64>().ok()?))
        })
}

/// The value of label `name` in a sample's `{..}` part.
fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    labels.split(&format!("{name}=\"")).nth(1)?.split('"').next()
}

/// A counter's value as a whole number.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // counter values
fn whole(v: f64) -> u64 {
    v as u64
}

/// The decision-latency histogram: cumulative counts by upper bound (seconds),
/// summed over the APIs, ascending, `+Inf` last.
fn latency_buckets(text: &str) -> Vec<(f64, u64)> {
    let name = format!("{}_bucket", m::DECISION_SECONDS);
    let mut by_bound: BTreeMap<u64, (f64, u64)> = BTreeMap::new();
    for (labels, v) in series(text, &name) {
        let Some(le) = label(labels, "le") else { continue };
        let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::INFINITY) };
        // Bounds are positive, so their bit patterns order as they do.
        let e = by_bound.entry(bound.to_bits()).or_insert((bound, 0));
        e.1 += whole(v);
    }
    by_bound.into_values().collect()
}

/// The `q` quantile of the decisions between two readings of the histogram,
/// interpolated within its bucket as Prometheus's `histogram_quantile` does; `None`
/// without decisions in between.
#[allow(clippy::cast_precision_loss)] // counts far below 2^52
fn quantile(before: &[(f64, u64)], after: &[(f64, u64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, u64)> = after
        .iter()
        .map(|(b, n)| {
            let was = before.iter().find(|(x, _)| x == b).map_or(0, |(_, c)| *c);
            (*b, n.saturating_sub(was))
        })
        .collect();
    let total = delta.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = (0.0, 0u64);
    for (bound, cum) in &delta {
        if *cum as f64 >= rank {
            if bound.is_infinite() {
                return Some(lower.0); // beyond the last bound: its value, as Prometheus
            }
            let inside = (*cum - lower.1) as f64;
            let frac = if inside > 0.0 { (rank - lower.1 as f64) / inside } else { 1.0 };
            return Some(lower.0 + (bound - lower.0) * frac.clamp(0.0, 1.0));
        }
        lower = (*bound, *cum);
    }
    None
}

/// Decision totals at one instant, from the exported counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Totals {
    /// Allowed.
    pub allowed: u64,
    /// Rejected.
    pub rejected: u64,
    /// Rejected in shadow mode (allowed through).
    pub shadow_rejected: u64,
    /// Rejections (enforced and shadow) by reason.
    pub by_reason: BTreeMap<String, u64>,
    /// Rejections (enforced and shadow) by route label.
    pub by_route: BTreeMap<String, u64>,
    /// Calls refused as invalid, by field.
    pub invalid: BTreeMap<String, u64>,
    /// The latency histogram (see [`latency_buckets`]).
    pub latency: Vec<(f64, u64)>,
}

/// Reads `limiter_decisions_total` series out of the Prometheus text format.
pub(crate) fn totals(text: &str) -> Totals {
    let mut t = Totals::default();
    let prefix = format!("{}{{", m::DECISIONS);
    for line in text.lines().filter(|l| l.starts_with(&prefix)) {
        let Some((labels, value)) = line[prefix.len()..].rsplit_once("} ") else { continue };
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // counter values
        let v = v as u64;
        let label = |name: &str| {
            labels
                .split(',')
                .filter_map(|kv| kv.split_once('='))
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.trim_matches('"').to_owned())
                .unwrap_or_default()
        };
        match label("decision").as_str() {
            "allowed" => t.allowed += v,
            d => {
                if d == "shadow_rejected" {
                    t.shadow_rejected += v;
                } else {
                    t.rejected += v;
                }
                *t.by_reason.entry(label("reason")).or_default() += v;
                *t.by_route.entry(label("route")).or_default() += v;
            }
        }
    }
    for (labels, v) in series(text, m::INVALID_REQUESTS) {
        let field = self::label(labels, "field").unwrap_or("other").to_owned();
        *t.invalid.entry(field).or_default() += whole(v);
    }
    t.latency = latency_buckets(text);
    t
}

/// The once-a-second history of decision totals.
#[derive(Debug, Default)]
pub(crate) struct History {
    samples: Mutex<VecDeque<(u64, Totals)>>,
    /// When the server started (Unix seconds): the first sample's time.
    started_at: std::sync::atomic::AtomicU64,
}

impl History {
    /// When the server started serving (Unix seconds; 0 before the first sample).
    fn started_at(&self) -> u64 {
        self.started_at.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Takes one sample at `now` (Unix seconds).
    pub(crate) fn sample(&self, now: u64) {
        let handle = m::handle();
        handle.run_upkeep();
        let text = handle.render();
        let t = totals(&text);
        let _ = self.started_at.compare_exchange(
            0,
            now,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
        let mut s = self.samples.lock();
        s.push_back((now, t));
        while s.len() > HISTORY + 1 {
            s.pop_front();
        }
    }

    fn rates(&self) -> Vec<Value> {
        let s = self.samples.lock();
        s.iter()
            .zip(s.iter().skip(1))
            .map(|((_, a), (t, b))| {
                let by_reason: BTreeMap<&String, u64> = b
                    .by_reason
                    .iter()
                    .map(|(k, v)| (k, v.saturating_sub(*a.by_reason.get(k).unwrap_or(&0))))
                    .collect();
                let invalid = |x: &Totals| x.invalid.values().sum::<u64>();
                json!({
                    "t": t,
                    "allowed": b.allowed.saturating_sub(a.allowed),
                    "rejected": b.rejected.saturating_sub(a.rejected),
                    "shadow_rejected": b.shadow_rejected.saturating_sub(a.shadow_rejected),
                    "invalid": invalid(b).saturating_sub(invalid(a)),
                    "p50": quantile(&a.latency, &b.latency, 0.5),
                    "p99": quantile(&a.latency, &b.latency, 0.99),
                    "by_reason": by_reason,
                })
            })
            .collect()
    }

    /// Latency percentiles over the last [`LATENCY_WINDOW`] seconds, up to `now`'s
    /// histogram.
    fn latency(&self, now: &[(f64, u64)]) -> Value {
        let s = self.samples.lock();
        let before =
            s.iter().rev().nth(LATENCY_WINDOW).or(s.front()).map(|(_, t)| t.latency.clone());
        let before = before.unwrap_or_default();
        let count = now.last().map_or(0, |l| l.1).saturating_sub(before.last().map_or(0, |l| l.1));
        json!({
            "window_seconds": LATENCY_WINDOW,
            "count": count,
            "p50": quantile(&before, now, 0.5),
            "p90": quantile(&before, now, 0.9),
            "p99": quantile(&before, now, 0.99),
            "p999": quantile(&before, now, 0.999),
        })
    }
}

fn hitters(v: &[Hitter]) -> Value {
    v.iter().map(|h| json!({ "item": h.item, "count": h.count, "error": h.error })).collect()
}

/// The dashboard's data.
pub(crate) fn data(owner: &Owner, history: &History, members: &[String]) -> Value {
    owner.sweep_stats();
    let handle = m::handle();
    handle.run_upkeep();
    let text = handle.render();
    let t = totals(&text);
    let active = owner.policies().current();
    let status = owner.policies().status();
    let leases = owner.leases().totals();
    let mut routes: Vec<Value> = active
        .policy
        .routes
        .iter()
        .map(|(name, r)| {
            let failure = match r.on_limiter_failure {
                FailurePolicy::FailOpen { emergency_ceiling } => {
                    format!("fail_open ({emergency_ceiling})")
                }
                FailurePolicy::FailClosed => "fail_closed".to_owned(),
            };
            json!({
                "name": name.as_ref(),
                "on_limiter_failure": failure,
                "shadow": r.shadow || active.policy.shadow,
                "lease": if r.lease.exact { "exact" } else { "leased" },
            })
        })
        .collect();
    routes.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
    let (tr, ta) = owner.heavy().tenants(10);
    let (kr, ka) = owner.heavy().keys(10);
    let now = owner.clock().now() / NANOS_PER_SEC;
    let gauge = |name: &str| series(&text, name).map(|(_, v)| v).sum::<f64>();
    let evicted = |kind: &str| {
        whole(
            series(&text, m::STORE_EVICTIONS)
                .filter(|(l, _)| label(l, "kind") == Some(kind))
                .map(|(_, v)| v)
                .sum(),
        )
    };
    json!({
        "now": now,
        "ready": owner.is_ready(),
        "server": {
            "version": env!("CARGO_PKG_VERSION"),
            "started_at": history.started_at(),
            "uptime_seconds": now.saturating_sub(history.started_at()),
        },
        "latency": history.latency(&t.latency),
        "invalid": { "total": t.invalid.values().sum::<u64>(), "by_field": t.invalid },
        "store": {
            "keys": whole(gauge(m::STORE_KEYS)),
            "max_keys": whole(gauge(m::STORE_MAX_KEYS)),
            "evicted_idle": evicted("idle"),
            "evicted_live": evicted("live"),
            "permits_held": whole(gauge(m::PERMITS_HELD)),
        },
        "policy": {
            "version": active.version,
            "loaded_at": active.loaded_at / NANOS_PER_SEC,
            "reloads_ok": status.reloads,
            "reloads_failed": status.failures,
            "last_error": status.last_error,
            "last_failure_at": status.last_failure_at.map(|t| t / NANOS_PER_SEC),
        },
        "totals": { "allowed": t.allowed, "rejected": t.rejected, "shadow_rejected": t.shadow_rejected },
        "by_reason": t.by_reason,
        "by_route": t.by_route,
        "history": history.rates(),
        "routes": routes,
        "leases": {
            "outstanding": leases.outstanding, "open": leases.open, "granted": leases.granted,
            "returned": leases.returned, "spent": leases.spent, "written_off": leases.written_off,
        },
        "ring": ring(owner, members),
        "replication": replication(owner, &text),
        "top_tenants": { "by_rejections": hitters(&tr), "by_admitted_cost": hitters(&ta) },
        "top_keys": { "by_rejections": hitters(&kr), "by_admitted_cost": hitters(&ka) },
    })
}

/// The ring as the status page shows it: the cluster's members (`id (address)`) and
/// epoch, or this node alone.
fn ring(owner: &Owner, alone: &[String]) -> Value {
    match owner.cluster().filter(|c| !c.is_single()) {
        Some(c) => {
            let ring = c.ring();
            let members: Vec<String> =
                ring.members().iter().map(|m| format!("{} ({})", m.id, m.address)).collect();
            json!({ "epoch": ring.epoch, "members": members })
        }
        None => json!({ "epoch": 0, "members": alone }),
    }
}

/// Replication as the status page shows it: whether on, counters held for other
/// nodes, the worst replica lag and the changes queued (from the exported gauges),
/// and the counters begun afresh by reason.
fn replication(owner: &Owner, text: &str) -> Value {
    let lag = series(text, m::REPLICATION_LAG).map(|(_, v)| v).fold(0.0, f64::max);
    let queued: f64 = series(text, m::REPLICATION_QUEUE).map(|(_, v)| v).sum();
    let resets: BTreeMap<&str, f64> = series(text, m::STATE_RESETS)
        .filter_map(|(labels, v)| Some((label(labels, "reason")?, v)))
        .collect();
    let cluster = owner.cluster().filter(|c| !c.is_single());
    json!({
        "on": cluster.is_some_and(|c| c.replication().is_on()),
        "held": cluster.map_or(0, |c| c.replication().held()),
        "lag_seconds": lag,
        "queued": queued,
        "resets": resets,
    })
}

/// Samples the history once a second until `cancel` fires.
pub(crate) async fn sample_loop(
    owner: Arc<Owner>,
    history: Arc<History>,
    cancel: tokio_util::sync::CancellationToken,
) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            _ = tick.tick() => history.sample(owner.clock().now() / NANOS_PER_SEC),
        }
    }
}

/// The page: fetches `/dashboard/data` every two seconds and draws it.
pub(crate) const PAGE: &str = include_str!("dashboard.html");

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_read_the_exported_series() {
        let text = r#"# HELP x
limiter_decisions_total{api="native",route="/a",decision="allowed",reason="none",scope="none"} 5
limiter_decisions_total{api="envoy",route="/a",decision="rejected",reason="TENANT_LIMIT",scope="tenant"} 2
limiter_decisions_total{api="native",route="other",decision="shadow_rejected",reason="KEY_LIMIT",scope="key"} 1
limiter_decision_duration_seconds_count{api="native"} 8
"#;
        let t = totals(text);
        assert_eq!((t.allowed, t.rejected, t.shadow_rejected), (5, 2, 1));
        assert_eq!(t.by_reason["TENANT_LIMIT"], 2);
        assert_eq!(t.by_route["other"], 1);
    }

    #[test]
    fn percentiles_come_from_the_histogram_between_two_readings() {
        let read = |counts: [u64; 4]| {
            let text: String = ["0.00001", "0.0001", "0.001", "+Inf"]
                .iter()
                .zip(counts)
                .map(|(le, n)| {
                    format!("limiter_decision_duration_seconds_bucket{{api=\"native\",le=\"{le}\"}} {n}\n")
                })
                .collect();
            latency_buckets(&text)
        };
        let before = read([10, 10, 10, 10]);
        // 100 more: 50 under 10 µs, 40 from 10 to 100 µs, 10 from 100 µs to 1 ms.
        let after = read([60, 100, 110, 110]);
        let close = |a: Option<f64>, b: f64| a.is_some_and(|a| (a - b).abs() < 1e-12);
        assert!(
            close(quantile(&before, &after, 0.5), 0.00001),
            "{:?}",
            quantile(&before, &after, 0.5)
        );
        assert!(close(quantile(&before, &after, 0.7), 0.00001 + 0.00009 * 0.5));
        assert!(close(quantile(&before, &after, 0.99), 0.0001 + 0.0009 * 0.9));
        assert_eq!(quantile(&after, &after, 0.5), None, "no decisions in between");
        // Beyond the last finite bound: that bound.
        let slow = read([60, 100, 110, 210]);
        assert!(close(quantile(&after, &slow, 0.99), 0.001));
    }
}
