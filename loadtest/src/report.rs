//! What a run found: rates per second, latency percentiles, accuracy against the exact
//! model, outcomes per route, lease fates and faults; as a table, JSON and Markdown.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use hdrhistogram::Histogram;
use limiter_core::Reason;
use serde::Serialize;

use crate::judge::Judgement;
use crate::model::{self, TenantTally};
use crate::procs::metric;
use crate::record::{Kind, LABELS, Record, Source, reason_label};
use crate::run::Live;
use crate::scenario::{Action, Fault, FaultTarget, Scenario};
use crate::target::Names;

/// A fault as it happened.
#[derive(Debug, Clone)]
pub struct FaultEvent {
    /// The fault.
    pub fault: Fault,
    /// When it was done, nanoseconds from the start.
    pub at_ns: u64,
    /// Whether it could be done.
    pub done: bool,
}

/// Lease units by fate, summed over the running nodes, at a time of the run.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct LeaseSample {
    /// Seconds from the start.
    pub t: f64,
    /// Units granted to agents so far.
    pub granted: f64,
    /// Units agents gave back.
    pub returned: f64,
    /// Units agents spent.
    pub spent: f64,
    /// Units of leases that expired with their holder silent.
    pub written_off: f64,
    /// Units out with agents now.
    pub outstanding: f64,
}

impl LeaseSample {
    /// Adds one node's `/metrics`.
    pub fn add(&mut self, body: &str) {
        let m = "limiter_lease_units_total";
        self.granted += metric(body, m, &["fate=\"granted\""]);
        self.returned += metric(body, m, &["fate=\"returned\""]);
        self.spent += metric(body, m, &["fate=\"spent\""]);
        self.written_off += metric(body, m, &["fate=\"written_off\""]);
        self.outstanding += metric(body, "limiter_lease_outstanding_units", &[]);
    }
}

/// Lease totals over every life of every node: a node's counters restart at zero
/// when it does, so each life's last reading is banked when the next one starts (and
/// a node is read just before a fault kills it).
#[derive(Debug, Clone, Default)]
pub struct LeaseLedger {
    nodes: BTreeMap<std::net::SocketAddr, (LeaseSample, LeaseSample)>,
}

impl LeaseLedger {
    /// Notes a reading of the node at `admin`.
    pub fn note(&mut self, admin: std::net::SocketAddr, body: &str) {
        let mut now = LeaseSample::default();
        now.add(body);
        let (banked, last) = self.nodes.entry(admin).or_default();
        if now.granted < last.granted {
            // A new life: the last one's totals are final.
            banked.granted += last.granted;
            banked.returned += last.returned;
            banked.spent += last.spent;
            banked.written_off += last.written_off;
            banked.outstanding += last.outstanding;
        }
        *last = now;
    }

    /// The totals over all lives (`outstanding`: what was out at each life's end).
    pub fn total(&self) -> LeaseSample {
        let mut t = LeaseSample::default();
        for (banked, last) in self.nodes.values() {
            for s in [banked, last] {
                t.granted += s.granted;
                t.returned += s.returned;
                t.spent += s.spent;
                t.written_off += s.written_off;
                t.outstanding += s.outstanding;
            }
        }
        t
    }
}

/// Decisions the servers counted (their `limiter_decisions_total`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ServerCounts {
    /// Allowed.
    pub allowed: f64,
    /// Rejected (enforced or in shadow mode).
    pub rejected: f64,
}

impl ServerCounts {
    /// Adds one node's `/metrics`.
    pub fn add(&mut self, body: &str) {
        let m = "limiter_decisions_total";
        self.allowed += metric(body, m, &["decision=\"allowed\""]);
        self.rejected += metric(body, m, &["decision=\"rejected\""]);
        self.rejected += metric(body, m, &["decision=\"shadow_rejected\""]);
    }
}

/// How long a run warms up before its agents' locality is measured (issue #19's
/// figures: decided locally, owner calls per 1000 decisions, service time after it).
pub const WARM_UP: u64 = 2 * SEC;

/// The agents' owner calls, counted at the end of the warm-up and at the end.
#[derive(Debug, Clone, Copy, Default)]
pub struct OwnerCalls {
    /// The warm-up's length, nanoseconds.
    pub warm_up: u64,
    /// Calls and items when it ended.
    pub at_warm_up: crate::target::Calls,
    /// Calls and items at the end of the run.
    pub at_end: crate::target::Calls,
}

/// An agent run's locality after its warm-up.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Locality {
    /// Decisions (admissions and refusals) after the warm-up.
    pub decisions: u64,
    /// Of them, decided at the agent without waiting on an owner (a lease hit or a
    /// refusal kept from the owner's answer), as a share.
    pub local_share: f64,
    /// Owner calls per 1000 of those decisions.
    pub calls_per_1000: f64,
    /// Items (keys) carried by those calls per 1000 decisions.
    pub items_per_1000: f64,
    /// Service time of those decisions.
    pub service: Latency,
}

/// What a run learns besides the records.
#[derive(Debug, Clone, Default)]
pub struct Extras {
    /// The routes offered whose policy fails open.
    pub fail_open_routes: Vec<String>,
    /// Agent calls to owners.
    pub owner_calls: Option<OwnerCalls>,
    /// Faults done.
    pub events: Vec<FaultEvent>,
    /// Lease fates over time.
    pub samples: Vec<LeaseSample>,
    /// The servers' own counts at the end.
    pub server: ServerCounts,
    /// Server nodes that died on their own.
    pub crashed: Vec<String>,
    /// The longest lease the policy gives on the routes offered, in seconds.
    pub lease_ttl_s: f64,
    /// The reference's per-window judgement of the admissions.
    pub judgement: Judgement,
    /// Planned arrivals per gateway.
    pub planned: Vec<u64>,
    /// Gateways a fault killed.
    pub killed_gateways: Vec<u16>,
    /// Lease totals over every node's lives.
    pub ledger: LeaseSample,
}

/// A property a chaos run must keep, and whether it did.
#[derive(Debug, Clone, Serialize)]
pub struct Invariant {
    /// What must hold.
    pub name: String,
    /// Whether it held.
    pub holds: bool,
    /// The figures behind the verdict.
    pub detail: String,
}

/// Totals of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Totals {
    /// Planned arrivals (the plan's count, not the records').
    pub offered: u64,
    /// Planned arrivals with no record: the rest of a killed gateway's plan, or
    /// records lost (of a gateway still running: a bug).
    pub missing: u64,
    /// Sent.
    pub sent: u64,
    /// Not sent: the gateway had its maximum in flight.
    pub unsent: u64,
    /// Sent later than `late_after` after their arrival.
    pub late: u64,
    /// Admitted.
    pub admitted: u64,
    /// Rejected.
    pub rejected: u64,
    /// No answer.
    pub errors: u64,
    /// Rejections by reason.
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// Errors by kind.
    pub errors_by_kind: BTreeMap<String, u64>,
    /// Admissions by who decided (`remote`, `local`, `owner`, `fallback`).
    pub admitted_by_source: BTreeMap<String, u64>,
}

/// One second of the run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Second {
    /// Seconds from the start.
    pub t: u64,
    /// Planned arrivals.
    pub offered: u64,
    /// Sent.
    pub sent: u64,
    /// Admitted.
    pub admitted: u64,
    /// Rejected.
    pub rejected: u64,
    /// Rejections by reason.
    pub rejected_by_reason: BTreeMap<String, u64>,
    /// No answer.
    pub errors: u64,
    /// Sent late or not at all.
    pub late: u64,
    /// Units admitted.
    pub admitted_units: u64,
    /// Units the exact model admits.
    pub ideal_units: u64,
}

/// Latency percentiles, in microseconds, from the planned arrival to the answer.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Latency {
    /// Answers measured.
    pub count: u64,
    /// Median.
    pub p50: f64,
    /// 90th.
    pub p90: f64,
    /// 99th.
    pub p99: f64,
    /// 99.9th.
    pub p999: f64,
    /// Maximum.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

/// Accuracy against the exact model.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Accuracy {
    /// Units the model admits of what was sent.
    pub ideal_units: u64,
    /// Units admitted.
    pub admitted_units: u64,
    /// Units admitted beyond each tenant's ideal allowance, summed.
    pub overshoot_units: u64,
    /// Units of each tenant's ideal allowance rejected, summed.
    pub false_rejected_units: u64,
    /// `overshoot_units / ideal_units`.
    pub overshoot_ratio: f64,
    /// `false_rejected_units / ideal_units`.
    pub false_rejection_ratio: f64,
    /// Every tenant, the furthest from its allowance first.
    pub tenants: Vec<TenantAccuracy>,
}

/// One tenant's accuracy.
#[derive(Debug, Clone, Serialize)]
pub struct TenantAccuracy {
    /// Its name.
    pub tenant: String,
    /// Its tallies.
    #[serde(flatten)]
    pub tally: TenantTally,
    /// Overshoot, units.
    pub overshoot: u64,
    /// False rejections, units.
    pub false_rejections: u64,
}

/// What each route did when its owner was out of reach (agents).
#[derive(Debug, Clone, Default, Serialize)]
pub struct RouteOutcome {
    /// The route.
    pub route: String,
    /// Admitted.
    pub admitted: u64,
    /// Rejected.
    pub rejected: u64,
    /// Admitted by the failure policy (failed open, under the emergency ceiling).
    pub failed_open: u64,
    /// Rejected by a fail-open policy's emergency ceiling.
    pub over_emergency_ceiling: u64,
    /// Rejected by the failure policy: the route fails closed (`limiter_unavailable`).
    pub failed_closed: u64,
}

/// A fault and what traffic did meanwhile.
#[derive(Debug, Clone, Serialize)]
pub struct FaultReport {
    /// What was done, when.
    pub what: String,
    /// Whether it could be done.
    pub done: bool,
    /// The interval judged, seconds from the start.
    pub window: (f64, f64),
    /// Units admitted in it.
    pub admitted_units: u64,
    /// Units the exact model admits in it.
    pub ideal_units: u64,
    /// Units admitted beyond each tenant's ideal replay in it, summed: how far the run
    /// strayed from a fault-free replay, not a limit check (a tenant refused during
    /// a fault has budget left for later).
    pub overshoot_units: u64,
    /// Units over a limit in the seconds it touches, as the reference judged them
    /// (exact part and fail-open part): the limit check.
    pub judged_over_units: u64,
    /// Units of allowance rejected in it, summed.
    pub false_rejected_units: u64,
    /// Requests decided by the failure policy in it (of the faulted gateway, for a
    /// gateway fault): admitted, rejected.
    pub fallback: (u64, u64),
}

/// The report of a run.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// The scenario's name.
    pub scenario: String,
    /// The API called.
    pub target: String,
    /// Simulated gateways.
    pub gateways: usize,
    /// Planned length, seconds.
    pub duration_s: f64,
    /// This machine's cores.
    pub cores: usize,
    /// Totals.
    pub totals: Totals,
    /// Response time of answered requests: from the planned arrival to the answer
    /// (what a caller waited, delays in sending included).
    pub latency: Latency,
    /// Service time of answered requests: from the send to the answer (what the
    /// transport and the server took; the timer's lateness in sending left out).
    pub service: Latency,
    /// Accuracy.
    pub accuracy: Accuracy,
    /// Agent calls to owners per 1000 decisions (the whole run).
    pub owner_calls_per_1000: Option<f64>,
    /// Agents' locality after the warm-up.
    pub locality: Option<Locality>,
    /// Per second.
    pub per_second: Vec<Second>,
    /// Per route.
    pub routes: Vec<RouteOutcome>,
    /// Faults.
    pub faults: Vec<FaultReport>,
    /// Lease fates over time (servers the run started).
    pub leases: Vec<LeaseSample>,
    /// What the servers counted.
    pub server: ServerCounts,
    /// Nodes that died on their own.
    pub crashed: Vec<String>,
    /// The reference's per-window judgement of the admissions.
    pub judgement: Judgement,
    /// Chaos runs: the invariants checked.
    pub invariants: Vec<Invariant>,
}

const SEC: u64 = 1_000_000_000;

impl Latency {
    /// Percentiles of a histogram of nanoseconds, in microseconds.
    #[allow(clippy::cast_precision_loss)]
    fn of(h: &Histogram<u64>) -> Self {
        let us = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        Self {
            count: h.len(),
            p50: us(0.5),
            p90: us(0.9),
            p99: us(0.99),
            p999: us(0.999),
            max: h.max() as f64 / 1000.0,
            mean: h.mean() / 1000.0,
        }
    }
}

/// Builds the report of `records`, given the exact model's decisions `ideal`.
#[allow(clippy::cast_precision_loss)]
pub fn build(s: &Scenario, names: &Names, records: &[Record], ideal: &[bool], x: Extras) -> Report {
    let late_after = crate::run::nanos(s.late_after);
    let planned: u64 = x.planned.iter().sum();
    let mut totals = Totals {
        offered: planned.max(records.len() as u64),
        missing: planned.saturating_sub(records.len() as u64),
        ..Default::default()
    };
    // Whole seconds of the plan (a last partial second is a bucket of its own).
    let seconds =
        usize::try_from(crate::run::nanos(s.duration()).div_ceil(SEC)).unwrap_or(0).max(1);
    let mut per_second: Vec<Second> =
        (0..seconds as u64).map(|t| Second { t, ..Default::default() }).collect();
    let new_hist = || Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds");
    let (mut hist, mut service_hist, mut warm_hist) = (new_hist(), new_hist(), new_hist());
    let (mut warm_decisions, mut warm_local) = (0u64, 0u64);
    let mut routes: Vec<RouteOutcome> = names
        .routes
        .iter()
        .map(|r| RouteOutcome { route: r.clone(), ..Default::default() })
        .collect();
    for (r, &ok) in records.iter().zip(ideal) {
        let sec = usize::try_from(r.at / SEC).unwrap_or(usize::MAX).min(seconds - 1);
        let b = &mut per_second[sec];
        b.offered += 1;
        if ok {
            b.ideal_units += r.cost;
        }
        let late = r.kind == Kind::Unsent || r.sent.saturating_sub(r.at) > late_after;
        if late {
            b.late += 1;
        }
        if r.kind == Kind::Unsent {
            totals.unsent += 1;
            continue;
        }
        totals.sent += 1;
        b.sent += 1;
        if late {
            totals.late += 1;
        }
        let ro = &mut routes[usize::from(r.route)];
        match r.kind {
            Kind::Admitted => {
                totals.admitted += 1;
                b.admitted += 1;
                b.admitted_units += r.cost;
                ro.admitted += 1;
                if r.source == Source::Fallback {
                    ro.failed_open += 1;
                }
                *totals.admitted_by_source.entry(source_name(r.source).to_owned()).or_default() +=
                    1;
            }
            Kind::Rejected => {
                totals.rejected += 1;
                b.rejected += 1;
                ro.rejected += 1;
                if r.label == reason_label(Reason::LimiterUnavailable) {
                    ro.failed_closed += 1;
                } else if r.label == reason_label(Reason::EmergencyCeiling) {
                    ro.over_emergency_ceiling += 1;
                }
                let reason = LABELS[usize::from(r.label)];
                *totals.rejected_by_reason.entry(reason.to_owned()).or_default() += 1;
                *b.rejected_by_reason.entry(reason.to_owned()).or_default() += 1;
            }
            Kind::Error => {
                totals.errors += 1;
                b.errors += 1;
                *totals
                    .errors_by_kind
                    .entry(LABELS[usize::from(r.label)].to_owned())
                    .or_default() += 1;
            }
            Kind::Unsent => {}
        }
        if r.kind != Kind::Error {
            let _ = hist.record(r.latency.max(1));
            let took = (r.at + r.latency).saturating_sub(r.sent).max(1);
            let _ = service_hist.record(took);
            if r.at >= WARM_UP && matches!(r.kind, Kind::Admitted | Kind::Rejected) {
                let _ = warm_hist.record(took);
                warm_decisions += 1;
                warm_local += u64::from(r.source == Source::Local);
            }
        }
    }
    let latency = Latency::of(&hist);
    let service = Latency::of(&service_hist);

    let tallies = model::tally(records, ideal, names.tenants.len());
    let accuracy = accuracy(&tallies, names);

    let run_len = s.duration();
    let mut events: Vec<&FaultEvent> = x.events.iter().collect();
    events.sort_by_key(|e| e.fault.at);
    let faults = events
        .into_iter()
        .map(|e| {
            let (from, mut to) = e.fault.window(run_len);
            // A killed node is down until it is restarted.
            if let Action::Kill(t) = &e.fault.action {
                let back = s.faults.iter().filter(|f| f.at > from);
                if let Some(r) =
                    back.filter(|f| f.action == Action::Restart(t.clone())).map(|f| f.at).min()
                {
                    to = to.min(r);
                }
            }
            let (a, b) = (crate::run::nanos(from), crate::run::nanos(to));
            let inside: Vec<bool> = records.iter().map(|r| r.at >= a && r.at < b).collect();
            let sub: Vec<Record> =
                records.iter().zip(&inside).filter(|(_, i)| **i).map(|(r, _)| *r).collect();
            let sub_ideal: Vec<bool> =
                ideal.iter().zip(&inside).filter(|(_, i)| **i).map(|(o, _)| *o).collect();
            let t = model::tally(&sub, &sub_ideal, names.tenants.len());
            // The failure policy's decisions of the gateway a fault is about, or of all.
            let only = match &e.fault.action {
                Action::Kill(t) | Action::Cut(t, _) => {
                    match crate::scenario::target_of(t, &s.servers, s.gateways, s.gateway_processes)
                    {
                        Ok(FaultTarget::Gateway(g)) => u16::try_from(g).ok(),
                        _ => None,
                    }
                }
                Action::Restart(_) | Action::StopRedis(_) => None,
            };
            let fb = |k: Kind| {
                sub.iter()
                    .filter(|r| only.is_none_or(|g| r.gateway == g))
                    .filter(|r| r.kind == k && r.source == Source::Fallback)
                    .count() as u64
            };
            FaultReport {
                what: e.fault.describe(),
                done: e.done,
                window: (from.as_secs_f64(), to.as_secs_f64()),
                admitted_units: t.iter().map(|x| x.admitted).sum(),
                ideal_units: t.iter().map(|x| x.ideal).sum(),
                overshoot_units: t.iter().map(TenantTally::overshoot).sum(),
                judged_over_units: [&x.judgement.exact, &x.judgement.fail_open]
                    .iter()
                    .flat_map(|p| &p.by_second)
                    .filter(|&&(sec, _)| {
                        (sec + 1) as f64 > from.as_secs_f64() && (sec as f64) < to.as_secs_f64()
                    })
                    .map(|&(_, u)| u)
                    .sum(),
                false_rejected_units: t.iter().map(TenantTally::false_rejections).sum(),
                fallback: (fb(Kind::Admitted), fb(Kind::Rejected)),
            }
        })
        .collect();
    let decisions = totals.admitted + totals.rejected;
    let invariants =
        if s.chaos { invariants(s, records, &totals, &routes, &service, &x) } else { Vec::new() };
    Report {
        scenario: s.name.clone(),
        target: s.target.name().to_owned(),
        gateways: s.gateways,
        duration_s: run_len.as_secs_f64(),
        cores: std::thread::available_parallelism().map_or(1, std::num::NonZero::get),
        owner_calls_per_1000: x.owner_calls.map(|c| {
            if decisions == 0 { 0.0 } else { c.at_end.calls as f64 * 1000.0 / decisions as f64 }
        }),
        locality: x.owner_calls.map(|c| {
            let per_1000 = |n: u64| {
                if warm_decisions == 0 { 0.0 } else { n as f64 * 1000.0 / warm_decisions as f64 }
            };
            Locality {
                decisions: warm_decisions,
                local_share: if warm_decisions == 0 {
                    0.0
                } else {
                    warm_local as f64 / warm_decisions as f64
                },
                calls_per_1000: per_1000(c.at_end.calls.saturating_sub(c.at_warm_up.calls)),
                items_per_1000: per_1000(c.at_end.items.saturating_sub(c.at_warm_up.items)),
                service: Latency::of(&warm_hist),
            }
        }),
        totals,
        latency,
        service,
        accuracy,
        per_second,
        routes,
        faults,
        leases: x.samples,
        server: x.server,
        crashed: x.crashed,
        judgement: x.judgement,
        invariants,
    }
}

/// The invariants of a chaos run (README, "Load tests": what they mean).
#[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn invariants(
    s: &Scenario,
    records: &[Record],
    totals: &Totals,
    routes: &[RouteOutcome],
    service: &Latency,
    x: &Extras,
) -> Vec<Invariant> {
    let mut out = Vec::new();
    let deadline_us = s.timeout.as_secs_f64() * 1e6;
    out.push(Invariant {
        name: "every request sent and answered within its deadline".to_owned(),
        holds: totals.errors == 0 && totals.unsent == 0 && service.max <= deadline_us,
        detail: format!(
            "{} sent, {} unsent, {} errors, slowest answer {:.1} ms (deadline {:.0} ms)",
            totals.sent,
            totals.unsent,
            totals.errors,
            service.max / 1000.0,
            deadline_us / 1000.0
        ),
    });
    out.push(Invariant {
        name: "no process crashed or panicked".to_owned(),
        holds: x.crashed.is_empty(),
        detail: if x.crashed.is_empty() { "none".to_owned() } else { x.crashed.join("; ") },
    });
    // Every planned arrival of a gateway that was not killed has its record.
    let mut recorded = vec![0u64; x.planned.len()];
    for r in records {
        if let Some(n) = recorded.get_mut(usize::from(r.gateway)) {
            *n += 1;
        }
    }
    let short: Vec<String> = x
        .planned
        .iter()
        .zip(&recorded)
        .enumerate()
        .filter(|(g, (p, r))| p != r && !x.killed_gateways.contains(&(*g as u16)))
        .map(|(g, (p, r))| format!("gateway{g}: {r} records of {p} planned"))
        .collect();
    out.push(Invariant {
        name: "every planned arrival of a gateway still running has its record".to_owned(),
        holds: short.is_empty(),
        detail: if short.is_empty() {
            format!(
                "{} planned, {} with no record (killed gateways)",
                totals.offered, totals.missing
            )
        } else {
            short.join("; ")
        },
    });
    let j = &x.judgement;
    out.push(Invariant {
        name: "exact part: no level over its limit in any window (the reference, zero tolerance)"
            .to_owned(),
        holds: j.exact.overshoot == 0 && j.exact.levels > 0,
        detail: j.exact.describe(),
    });
    out.push(Invariant {
        name: "fail-open part: each gateway within each route's emergency ceiling".to_owned(),
        holds: j.fail_open.overshoot == 0,
        detail: j.fail_open.describe(),
    });
    // A fail-open route never answers "the limiter is unavailable": its failure policy
    // admits under the emergency ceiling or refuses by it.
    let closed: Vec<String> = routes
        .iter()
        .filter(|r| x.fail_open_routes.contains(&r.route) && r.failed_closed > 0)
        .map(|r| format!("{}: {} answered limiter_unavailable", r.route, r.failed_closed))
        .collect();
    out.push(Invariant {
        name: "fail-open routes never fail closed".to_owned(),
        holds: closed.is_empty(),
        detail: if closed.is_empty() {
            format!("{} fail-open routes, 0 limiter_unavailable answers", x.fail_open_routes.len())
        } else {
            closed.join("; ")
        },
    });
    // Leases end to end: what the gateways spent from leases (their own records, kept
    // when a gateway is killed) against what the owners booked over all their lives.
    let spent_locally: u64 = records
        .iter()
        .filter(|r| r.kind == Kind::Admitted && matches!(r.source, Source::Local | Source::Granted))
        .map(|r| r.cost)
        .sum();
    let l = &x.ledger;
    let covered = l.spent + l.written_off + l.outstanding;
    let out_now = x.samples.last().map_or(f64::NAN, |s| s.outstanding);
    out.push(Invariant {
        name: "leases reconciled: owners booked as spent no more than gateways spent, gateways \
               spent no more than owners granted and did not get back, none out once healthy"
            .to_owned(),
        holds: l.spent <= spent_locally as f64 + 0.5
            && spent_locally as f64 <= covered + 0.5
            && (l.granted - l.returned - covered).abs() < 0.5
            && out_now < 0.5,
        detail: format!(
            "gateways spent {spent_locally} from leases; owners granted {:.0}, got back {:.0}, \
             booked spent {:.0}, wrote off {:.0}, out at their ends {:.0} (over every life of \
             every node); out now {out_now:.0}",
            l.granted, l.returned, l.spent, l.written_off, l.outstanding
        ),
    });
    out
}

#[allow(clippy::cast_precision_loss)]
fn accuracy(tallies: &[TenantTally], names: &Names) -> Accuracy {
    let ideal_units: u64 = tallies.iter().map(|t| t.ideal).sum();
    let overshoot_units: u64 = tallies.iter().map(TenantTally::overshoot).sum();
    let false_rejected_units: u64 = tallies.iter().map(TenantTally::false_rejections).sum();
    let mut tenants: Vec<TenantAccuracy> = tallies
        .iter()
        .enumerate()
        .map(|(i, t)| TenantAccuracy {
            tenant: names.tenants[i].clone(),
            tally: *t,
            overshoot: t.overshoot(),
            false_rejections: t.false_rejections(),
        })
        .collect();
    tenants.sort_by_key(|t| std::cmp::Reverse(t.overshoot + t.false_rejections));
    let ratio = |x: u64| if ideal_units == 0 { 0.0 } else { x as f64 / ideal_units as f64 };
    Accuracy {
        ideal_units,
        admitted_units: tallies.iter().map(|t| t.admitted).sum(),
        overshoot_units,
        false_rejected_units,
        overshoot_ratio: ratio(overshoot_units),
        false_rejection_ratio: ratio(false_rejected_units),
        tenants,
    }
}

fn source_name(s: Source) -> &'static str {
    match s {
        Source::Remote => "remote",
        Source::Local => "local",
        Source::Owner => "owner",
        Source::Granted => "granted",
        Source::Fallback => "fallback",
    }
}

impl Report {
    /// The report as Markdown (also what the terminal shows).
    #[allow(clippy::cast_precision_loss)]
    pub fn markdown(&self) -> String {
        let t = &self.totals;
        let secs = self.duration_s.max(1e-9);
        let mut m = String::new();
        let _ = writeln!(
            m,
            "## {} ({} target, {} gateways, {:.0} s, {} cores)\n",
            self.scenario, self.target, self.gateways, self.duration_s, self.cores
        );
        let _ = writeln!(
            m,
            "| planned | no record | sent | unsent | late | admitted | rejected | errors |"
        );
        let _ = writeln!(m, "| --- | --- | --- | --- | --- | --- | --- | --- |");
        let _ = writeln!(
            m,
            "| {} ({:.0}/s) | {} | {} | {} | {} | {} ({:.0}/s) | {} | {} |\n",
            t.offered,
            t.offered as f64 / secs,
            t.missing,
            t.sent,
            t.unsent,
            t.late,
            t.admitted,
            t.admitted as f64 / secs,
            t.rejected,
            t.errors
        );
        for (what, l) in [
            ("Response time (µs, from planned arrival to answer", &self.latency),
            ("Service time (µs, from send to answer", &self.service),
        ] {
            let _ = writeln!(
                m,
                "{what}, {} answers): p50 {:.0}, p90 {:.0}, p99 {:.0}, p99.9 {:.0}, max {:.0}\n",
                l.count, l.p50, l.p90, l.p99, l.p999, l.max
            );
        }
        if !t.rejected_by_reason.is_empty() {
            let _ = writeln!(m, "Rejected by reason: {}\n", kv(&t.rejected_by_reason));
        }
        if !t.errors_by_kind.is_empty() {
            let _ = writeln!(m, "Errors: {}\n", kv(&t.errors_by_kind));
        }
        if !t.admitted_by_source.is_empty() {
            let _ = writeln!(m, "Admitted by source: {}\n", kv(&t.admitted_by_source));
        }
        let j = &self.judgement;
        let _ = writeln!(
            m,
            "Judged per window by the reference ({}): exact part {}; fail-open part {}\n",
            if j.hold_ns == 0 {
                "each admission placed between its send and its answer".to_owned()
            } else {
                format!("leases and slices of up to {:.1} s allowed for", j.hold_ns as f64 / 1e9)
            },
            j.exact.describe(),
            j.fail_open.describe()
        );
        let a = &self.accuracy;
        let _ = writeln!(
            m,
            "Against a fault-free replay by the reference: ideal {} units, admitted {}, overshoot {} ({:.2}%), false rejections {} ({:.2}%)\n",
            a.ideal_units,
            a.admitted_units,
            a.overshoot_units,
            a.overshoot_ratio * 100.0,
            a.false_rejected_units,
            a.false_rejection_ratio * 100.0
        );
        let off: Vec<String> = a
            .tenants
            .iter()
            .take_while(|t| t.overshoot + t.false_rejections > 0)
            .take(5)
            .map(|t| {
                format!(
                    "{} +{} / -{} of {}",
                    t.tenant, t.overshoot, t.false_rejections, t.tally.ideal
                )
            })
            .collect();
        if !off.is_empty() {
            let _ = writeln!(
                m,
                "Furthest from their allowance (units over / under, of the ideal): {}\n",
                off.join(", ")
            );
        }
        if let Some(c) = self.owner_calls_per_1000 {
            let _ = writeln!(m, "Owner calls per 1000 decisions: {c:.1}\n");
        }
        if let Some(l) = &self.locality {
            let _ = writeln!(
                m,
                "After the {} s warm-up: {} decisions, {:.2}% decided at the agent, {:.1} owner calls and {:.1} items per 1000 decisions, service time p50 {:.0} µs, p99 {:.0} µs, p99.9 {:.0} µs\n",
                WARM_UP / SEC,
                l.decisions,
                l.local_share * 100.0,
                l.calls_per_1000,
                l.items_per_1000,
                l.service.p50,
                l.service.p99,
                l.service.p999
            );
        }
        m.push_str(&self.routes_table());
        m.push_str(&self.faults_table());
        if let (Some(first), Some(last)) = (self.leases.first(), self.leases.last())
            && last.granted > 0.0
        {
            let _ = writeln!(
                m,
                "Lease units on the servers: granted {:.0}, spent {:.0}, returned {:.0}, written off {:.0}, still out {:.0} (from {:.1} s to {:.1} s)\n",
                last.granted - first.granted,
                last.spent - first.spent,
                last.returned - first.returned,
                last.written_off - first.written_off,
                last.outstanding,
                first.t,
                last.t
            );
        }
        for c in &self.crashed {
            let _ = writeln!(m, "**{c}**\n");
        }
        if !self.invariants.is_empty() {
            let _ = writeln!(m, "| invariant | holds | figures |\n| --- | --- | --- |");
            for i in &self.invariants {
                let _ = writeln!(
                    m,
                    "| {} | {} | {} |",
                    i.name,
                    if i.holds { "yes" } else { "**NO**" },
                    i.detail
                );
            }
            m.push('\n');
        }
        m
    }

    /// Per route, what the failure policy decided, as Markdown (empty when it decided
    /// nothing).
    pub fn routes_table(&self) -> String {
        let mut m = String::new();
        if self
            .routes
            .iter()
            .any(|r| r.failed_open + r.over_emergency_ceiling + r.failed_closed > 0)
        {
            let _ = writeln!(
                m,
                "| route | admitted | rejected | failed open: admitted | failed open: over the emergency ceiling | failed closed |\n| --- | --- | --- | --- | --- | --- |"
            );
            for r in &self.routes {
                let _ = writeln!(
                    m,
                    "| {} | {} | {} | {} | {} | {} |",
                    r.route,
                    r.admitted,
                    r.rejected,
                    r.failed_open,
                    r.over_emergency_ceiling,
                    r.failed_closed
                );
            }
            m.push('\n');
        }
        m
    }

    /// Per fault, accuracy and failure-policy decisions in its interval, as Markdown
    /// (empty without faults).
    pub fn faults_table(&self) -> String {
        let mut m = String::new();
        if !self.faults.is_empty() {
            let _ = writeln!(
                m,
                "| fault | window (s) | admitted units | ideal units | over the ideal replay | under it | over a limit (judged) | fallback admitted / rejected |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
            );
            for f in &self.faults {
                let _ = writeln!(
                    m,
                    "| {}{} | {:.1}-{:.1} | {} | {} | {} | {} | {} | {} / {} |",
                    f.what,
                    if f.done { "" } else { " (not done)" },
                    f.window.0,
                    f.window.1,
                    f.admitted_units,
                    f.ideal_units,
                    f.overshoot_units,
                    f.false_rejected_units,
                    f.judged_over_units,
                    f.fallback.0,
                    f.fallback.1
                );
            }
            m.push('\n');
        }
        m
    }

    /// Lease units written off between `from` and `to` seconds: when the first were
    /// seen, and how many in all.
    pub fn written_off_between(&self, from: f64, to: f64) -> Option<(f64, f64)> {
        let base = self.leases.iter().rev().find(|s| s.t <= from)?.written_off;
        let first = self.leases.iter().find(|s| s.t > from && s.t <= to && s.written_off > base)?;
        let last = self.leases.iter().rev().find(|s| s.t <= to)?;
        Some((first.t, last.written_off - base))
    }
}

fn kv(m: &BTreeMap<String, u64>) -> String {
    m.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
}

/// A progress bar with live rates, drawn only on a terminal.
pub fn progress_bar(total: u64, live: Arc<Live>) -> indicatif::ProgressBar {
    use std::io::IsTerminal as _;
    let bar = if std::io::stderr().is_terminal() {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {elapsed} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let b = bar.clone();
    tokio::spawn(async move {
        let mut last = (0u64, 0u64);
        let mut tick = tokio::time::interval(Duration::from_millis(500));
        loop {
            tick.tick().await;
            if b.is_finished() {
                break;
            }
            let done = live.done.load(Ordering::Relaxed);
            let adm = live.admitted.load(Ordering::Relaxed);
            b.set_position(done);
            b.set_message(format!(
                "{}/s answered, {}/s admitted, {} rejected, {} errors, {} late",
                (done - last.0) * 2,
                (adm - last.1) * 2,
                live.rejected.load(Ordering::Relaxed),
                live.errors.load(Ordering::Relaxed),
                live.late.load(Ordering::Relaxed)
            ));
            last = (done, adm);
        }
    });
    bar
}
