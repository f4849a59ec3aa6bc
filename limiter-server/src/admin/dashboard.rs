//! The built-in status page: `/dashboard` (one self-contained HTML page, no external
//! assets) and the JSON it refreshes from, `/dashboard/data`.
//!
//! `/dashboard/data` answers:
//!
//! ```text
//! { "now": unix seconds, "ready": bool,
//!   "policy": { "version", "loaded_at", "reloads_ok", "reloads_failed", "last_error" },
//!   "totals": { "allowed", "rejected", "shadow_rejected" },
//!   "by_reason": { REASON: rejections }, "by_route": { route: rejections },
//!   "history": [ { "t", "allowed", "rejected", "shadow_rejected", "by_reason": {..} } ],
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

/// Decision totals at one instant, from the exported counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    t
}

/// The once-a-second history of decision totals.
#[derive(Debug, Default)]
pub(crate) struct History {
    samples: Mutex<VecDeque<(u64, Totals)>>,
}

impl History {
    /// Takes one sample at `now` (Unix seconds).
    pub(crate) fn sample(&self, now: u64) {
        let handle = m::handle();
        handle.run_upkeep();
        let text = handle.render();
        let t = totals(&text);
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
                json!({
                    "t": t,
                    "allowed": b.allowed.saturating_sub(a.allowed),
                    "rejected": b.rejected.saturating_sub(a.rejected),
                    "shadow_rejected": b.shadow_rejected.saturating_sub(a.shadow_rejected),
                    "by_reason": by_reason,
                })
            })
            .collect()
    }
}

fn hitters(v: &[Hitter]) -> Value {
    v.iter().map(|h| json!({ "item": h.item, "count": h.count, "error": h.error })).collect()
}

/// The dashboard's data.
pub(crate) fn data(owner: &Owner, history: &History, members: &[String]) -> Value {
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
    json!({
        "now": owner.clock().now() / NANOS_PER_SEC,
        "ready": owner.is_ready(),
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
    let series = |name: &'static str| {
        text.lines()
            .filter(move |l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter_map(|l| {
                let (labels, v) = l.rsplit_once(' ')?;
                Some((labels, v.parse::<f64>().ok()?))
            })
    };
    let lag = series(m::REPLICATION_LAG).map(|(_, v)| v).fold(0.0, f64::max);
    let queued: f64 = series(m::REPLICATION_QUEUE).map(|(_, v)| v).sum();
    let resets: BTreeMap<&str, f64> = series(m::STATE_RESETS)
        .filter_map(|(labels, v)| {
            let reason = labels.split("reason=\"").nth(1)?.split('"').next()?;
            Some((reason, v))
        })
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
}
