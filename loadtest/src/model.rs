//! The ideal allowance: the same requests decided one by one, in the order they were
//! sent, by the independent reference (`limiter-reference`, which shares no code with
//! limiter-core) over the chain of levels the policy gives each request. What the
//! system admitted is compared with it per tenant.

use std::path::Path;

use anyhow::Context as _;
use limiter_core::Limit;
use limiter_core::algorithm::Window;
use limiter_core::calendar::Calendar;
use limiter_core::clock::{Clock as _, MonotonicClock};
use limiter_core::policy::{Chain, NameBounds, Policy, Request};
use limiter_reference::{Chains, Spec, Starts};

use crate::record::{Kind, Record};
use crate::target::Names;

/// Reads a policy file as the server would.
///
/// # Errors
///
/// When it cannot be read or is not a valid policy.
pub fn load_policy(path: &Path) -> anyhow::Result<Policy> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    limiter_core::policy::from_yaml(&text, &path.display().to_string())
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// A level's limit as the reference's spec; `None` for a concurrency limit (its
/// permits are held for a request's life, which the records do not carry: such a
/// level is judged by its own tests, not by this replay).
pub fn spec_of(limit: &Limit) -> Option<Spec> {
    Some(match limit {
        Limit::TokenBucket(b) => Spec::TokenBucket {
            amount: b.rate().amount().get(),
            period: b.rate().period().get(),
            burst: b.burst().get(),
        },
        Limit::FixedWindow(w) => match w.window() {
            Window::Fixed(window) => {
                Spec::FixedWindow { limit: w.limit().get(), window: window.get() }
            }
            Window::Calendar(c) => {
                Spec::CalendarWindow { limit: w.limit().get(), starts: calendar_starts(c) }
            }
        },
        Limit::SlidingLog(w) => {
            Spec::SlidingLog { limit: w.limit().get(), window: w.window().get() }
        }
        Limit::SlidingCounter(w) => match w.window() {
            Window::Fixed(window) => {
                Spec::SlidingCounter { limit: w.limit().get(), window: window.get() }
            }
            Window::Calendar(c) => {
                Spec::CalendarCounter { limit: w.limit().get(), starts: calendar_starts(c) }
            }
        },
        Limit::Concurrency(_) => return None,
    })
}

/// A calendar rule's window starts from two years before this process started to
/// two years after (a load test runs minutes), made once per rule.
fn calendar_starts(c: Calendar) -> Starts {
    static TABLES: parking_lot::Mutex<Vec<(Calendar, Starts)>> =
        parking_lot::Mutex::new(Vec::new());
    let mut tables = TABLES.lock();
    if let Some((_, s)) = tables.iter().find(|(k, _)| *k == c) {
        return *s;
    }
    const YEAR: u64 = 366 * 86_400 * 1_000_000_000;
    let now = MonotonicClock::new().now();
    let mut t = now - 2 * YEAR;
    let mut starts = vec![c.span(t).start];
    while t < now + 2 * YEAR {
        t = c.span(t).end();
        starts.push(t);
    }
    let s = Starts::leak(starts);
    tables.push((c, s));
    s
}

/// A chain's levels as `(key, spec)` pairs for the reference.
pub fn levels_of(chain: &Chain<'_>) -> Vec<(String, Spec)> {
    chain.levels().filter_map(|l| Some((l.key.to_string(), spec_of(&l.rule.limit)?))).collect()
}

/// The chain the policy gives record `r` (`None`: the request is refused outright).
pub fn chain_of<'p>(
    policy: &'p Policy,
    names: &'p Names,
    r: &Record,
    envoy_keys: bool,
    envoy_key: &'p mut Option<String>,
) -> Option<Chain<'p>> {
    let key = if envoy_keys {
        *envoy_key = names.envoy_key(r.key);
        envoy_key.as_deref()
    } else {
        names.key(r.key)
    };
    let req = Request {
        tenant: &names.tenants[r.tenant as usize],
        route: &names.routes[usize::from(r.route)],
        key,
        cost: Some(r.cost),
        dry_run: false,
    };
    policy.resolve(&req, &NameBounds::default()).ok()
}

/// What the model and the system did for one tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TenantTally {
    /// Units the model admits of the requests that were sent.
    pub ideal: u64,
    /// Units the system admitted.
    pub admitted: u64,
    /// Units of requests that got no answer (neither admitted nor rejected).
    pub errored: u64,
}

impl TenantTally {
    /// Units admitted beyond the ideal allowance.
    pub fn overshoot(&self) -> u64 {
        self.admitted.saturating_sub(self.ideal)
    }

    /// Units the ideal allowance admits that the system rejected: what it falls short,
    /// not counting requests that failed (those were not rejections).
    pub fn false_rejections(&self) -> u64 {
        self.ideal.saturating_sub(self.admitted + self.errored)
    }
}

/// Decisions of the exact model, one per record (unsent records: `false`).
///
/// `envoy_keys` names keys as the server derives them from Envoy descriptors;
/// `start_unix` is the run's start on the servers' time line (windows are aligned
/// on it).
pub fn decide_all(
    policy: &Policy,
    names: &Names,
    records: &[Record],
    envoy_keys: bool,
    start_unix: u64,
) -> Vec<bool> {
    let mut reference = Chains::new();
    let mut order: Vec<usize> = (0..records.len()).collect();
    order.sort_by_key(|&i| (records[i].sent, records[i].gateway, i));
    let mut out = vec![false; records.len()];
    for i in order {
        let r = &records[i];
        if r.kind == Kind::Unsent {
            continue;
        }
        let mut envoy_key = None;
        // The model's clock is the send time; a server sees a request a little later,
        // the same for every request, so the order and the gaps are what matter.
        out[i] = chain_of(policy, names, r, envoy_keys, &mut envoy_key)
            .is_some_and(|chain| reference.decide(&levels_of(&chain), start_unix + r.sent, r.cost));
    }
    out
}

/// Per-tenant tallies of `records` (indexed by tenant), given the model's decisions.
pub fn tally(records: &[Record], ideal: &[bool], tenants: usize) -> Vec<TenantTally> {
    let mut t = vec![TenantTally::default(); tenants];
    for (r, &ok) in records.iter().zip(ideal) {
        let e = &mut t[r.tenant as usize];
        if ok {
            e.ideal += r.cost;
        }
        match r.kind {
            Kind::Admitted => e.admitted += r.cost,
            Kind::Error => e.errored += r.cost,
            Kind::Rejected | Kind::Unsent => {}
        }
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Source;
    use crate::workload::NO_KEY;

    fn rec(t: u64, tenant: u32, cost: u64, kind: Kind) -> Record {
        Record {
            gateway: 0,
            at: t,
            sent: t,
            latency: 0,
            tenant,
            route: 0,
            key: NO_KEY,
            cost,
            kind,
            label: 0,
            source: Source::Remote,
        }
    }

    /// A hand-computed case. Tenant `a`: a token bucket of 10/s with a burst of 10.
    /// Tenant `b`: a fixed window of 5 per second.
    ///
    /// - `a` sends 12 requests of 1 at t = 0: the model admits the first 10. At
    ///   t = 0.5 s five more: 5 units have come back, all 5 admitted. Ideal: 15 units.
    ///   The system admitted all 17: overshoot 2, no false rejection.
    /// - `b` sends 4 of cost 2 at t = 0.1 s: the model admits 2 (4 units); the third
    ///   needs 2 of the 1 left. At t = 1.2 s, a new window: 2 more (4 units). Ideal
    ///   8 units. The system admitted 2 then 1: 6 units, false rejections 2.
    /// - A request that was never sent is not the model's to decide.
    #[test]
    fn accuracy_matches_a_hand_computed_case() {
        let policy = limiter_core::policy::from_yaml(
            r"
version: 1
routes:
  /r: { cost: 1 }
tenants:
  a:
    limit: { algorithm: token_bucket, rate: 10/s, burst: 10 }
  b:
    limit: { algorithm: fixed_window, limit: 5, window: 1s }
",
            "hand.yaml",
        )
        .unwrap();
        let names = Names {
            tenants: vec!["a".into(), "b".into()],
            routes: vec!["/r".into()],
            keys: vec![],
        };
        let ms = 1_000_000u64;
        // Window-aligned times: fixed windows start at multiples of their length.
        let base = 1_000_000_000_000u64;
        let mut records = Vec::new();
        for _ in 0..12 {
            records.push(rec(base, 0, 1, Kind::Admitted));
        }
        for _ in 0..5 {
            records.push(rec(base + 500 * ms, 0, 1, Kind::Admitted));
        }
        for (i, kind) in
            [Kind::Admitted, Kind::Admitted, Kind::Rejected, Kind::Rejected].into_iter().enumerate()
        {
            records.push(rec(base + 100 * ms + i as u64, 1, 2, kind));
        }
        for (i, kind) in
            [Kind::Admitted, Kind::Rejected, Kind::Rejected, Kind::Rejected].into_iter().enumerate()
        {
            records.push(rec(base + 1_200 * ms + i as u64, 1, 2, kind));
        }
        records.push(rec(base + 1_300 * ms, 1, 2, Kind::Unsent));

        let ideal = decide_all(&policy, &names, &records, false, 0);
        // a: 10 of the 12 at t = 0, then all 5 at t = 0.5 s.
        assert_eq!(ideal[..12].iter().filter(|&&x| x).count(), 10);
        assert!(ideal[12..17].iter().all(|&x| x));
        // b: the first two of each window.
        assert_eq!(&ideal[17..25], &[true, true, false, false, true, true, false, false]);
        assert!(!ideal[25]);

        let t = tally(&records, &ideal, 2);
        assert_eq!(t[0], TenantTally { ideal: 15, admitted: 17, errored: 0 });
        assert_eq!((t[0].overshoot(), t[0].false_rejections()), (2, 0));
        assert_eq!(t[1], TenantTally { ideal: 8, admitted: 6, errored: 0 });
        assert_eq!((t[1].overshoot(), t[1].false_rejections()), (0, 2));
    }
}
