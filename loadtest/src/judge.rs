//! Per-window judgement of a run's admissions by the independent reference
//! (`limiter-reference`): for every level a request was charged against (each key of
//! its chain), could the admitted requests have been admitted by the level's
//! algorithm at instants they may have been decided at? The units that no placement
//! admits are the overshoot, per level and per second, at zero tolerance.
//!
//! Two parts are judged apart, never added together:
//! - the exact part: every admission not made by a gateway's failure policy, against
//!   the policy's levels. Decided by a server alone, a request was charged between
//!   its send and its answer; from a lease or a slice (`DESIGN.md`), a token bucket's
//!   units were paid at the grant, up to a lease TTL earlier, fixed-window and
//!   sliding-counter grants fall in the window of the spend, and a sliding-log grant
//!   is logged at the end of its hold (at most a fortieth of the window later);
//! - the fail-open part: each gateway's failure-policy admissions on a route against
//!   that route's emergency ceiling (a token bucket of one period's amount, per
//!   gateway), the bound the design allows while an owner is out of reach.

use std::collections::HashMap;

use limiter_core::policy::{FailurePolicy, Policy};
use limiter_reference::Spec;
use limiter_reference::judge::{Spend, Verdict, judge};
use serde::Serialize;

use crate::model::{chain_of, levels_of};
use crate::record::{Kind, Record, Source};
use crate::target::Names;

const SEC: u64 = 1_000_000_000;

/// One part's verdict over all its levels.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PartVerdict {
    /// Levels judged.
    pub levels: usize,
    /// Admitted units judged.
    pub units: u64,
    /// Units no placement admits.
    pub overshoot: u64,
    /// The level with the most overshoot and its units.
    pub worst: Option<(String, u64)>,
    /// Overshoot per second of the run (second, units), all levels together.
    pub by_second: Vec<(u64, u64)>,
}

impl PartVerdict {
    fn add(&mut self, name: String, v: &Verdict, start_unix: u64) {
        self.levels += 1;
        self.units += v.units;
        self.overshoot += v.overshoot;
        if v.overshoot > 0 && self.worst.as_ref().is_none_or(|w| w.1 < v.overshoot) {
            self.worst = Some((name, v.overshoot));
        }
        for &(w, u) in &v.by_window {
            let sec = w.saturating_sub(start_unix) / SEC;
            match self.by_second.iter_mut().find(|e| e.0 == sec) {
                Some(e) => e.1 += u,
                None => self.by_second.push((sec, u)),
            }
        }
        self.by_second.sort_unstable();
    }

    /// One line: the figures behind a verdict.
    pub fn describe(&self) -> String {
        let worst =
            self.worst.as_ref().map_or(String::new(), |(k, u)| format!("; most on {k}: {u}"));
        format!(
            "{} units over of {} admitted on {} levels{worst}; per second (s, units): {:?}",
            self.overshoot, self.units, self.levels, self.by_second
        )
    }
}

/// Both parts of a run's judgement.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Judgement {
    /// Lease TTL the placements allowed for (0: every decision a server's own).
    pub hold_ns: u64,
    /// Admissions against the policy's levels.
    pub exact: PartVerdict,
    /// Failure-policy admissions against the emergency ceilings.
    pub fail_open: PartVerdict,
}

/// When `r`, admitted, may have been charged on a level with `spec` (absolute times).
fn placement(spec: Spec, r: &Record, start_unix: u64, hold: u64) -> Spend {
    let sent = start_unix + r.sent;
    let answered = start_unix + r.at + r.latency;
    let (from, to) =
        if hold == 0 { (sent, answered) } else { spec.leased_span(sent, answered, hold) };
    Spend { from, to: to.max(from), cost: r.cost }
}

/// Judges `records` (times from the run's start, `start_unix` on the servers' time
/// line). `hold`: the lease TTL when leases or slices may have decided (0 when every
/// decision was an exact server's own).
pub fn judge_run(
    policy: &Policy,
    names: &Names,
    records: &[Record],
    envoy_keys: bool,
    start_unix: u64,
    hold: u64,
) -> Judgement {
    let mut exact: HashMap<String, (Spec, Vec<Spend>)> = HashMap::new();
    let mut open: HashMap<(u16, u16), (Spec, Vec<Spend>)> = HashMap::new();
    for r in records.iter().filter(|r| r.kind == Kind::Admitted) {
        if r.source == Source::Fallback {
            let route = policy.route(&names.routes[usize::from(r.route)]);
            if let FailurePolicy::FailOpen { emergency_ceiling: c } = route.on_limiter_failure {
                let (amount, period) = (c.amount().get(), c.period().get());
                let spec = Spec::TokenBucket { amount, period, burst: amount };
                let e = open.entry((r.gateway, r.route)).or_insert_with(|| (spec, Vec::new()));
                e.1.push(placement(spec, r, start_unix, 0));
            }
            continue;
        }
        let mut envoy_key = None;
        let Some(chain) = chain_of(policy, names, r, envoy_keys, &mut envoy_key) else { continue };
        for (key, spec) in levels_of(&chain) {
            let e = exact.entry(key).or_insert_with(|| (spec, Vec::new()));
            e.1.push(placement(spec, r, start_unix, hold));
        }
    }
    let mut j = Judgement { hold_ns: hold, ..Judgement::default() };
    let mut keys: Vec<_> = exact.into_iter().collect();
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    for (key, (spec, spends)) in keys {
        j.exact.add(key, &judge(spec, &spends, SEC), start_unix);
    }
    let mut gws: Vec<_> = open.into_iter().collect();
    gws.sort_by_key(|e| e.0);
    for ((g, route), (spec, spends)) in gws {
        let name = format!("gateway{g} {}", names.routes[usize::from(route)]);
        j.fail_open.add(name, &judge(spec, &spends, SEC), start_unix);
    }
    j
}
