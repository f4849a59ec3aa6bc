//! Permits of concurrency levels: the book that names each permit held, so that a
//! release is paid once and a renewal moves the right permits.
//!
//! The counters (the concurrency levels' states) count permits by expiry and reclaim
//! them on their own; this book only names them. A permit it no longer names (released,
//! expired, forgotten when the book was full, or issued by a node that has since lost
//! the tenant) releases nothing: its units come back when they expire, never sooner.
//! So a lost or duplicated release, or a forged one, can never free a permit that is
//! still held.

use std::collections::{BTreeSet, HashMap};
use std::hash::BuildHasher;

use limiter_core::algorithm::Concurrency;
use limiter_core::clock::Nanos;
use limiter_core::policy::{Chain, Request};
use limiter_core::{Limit, Scope};
use parking_lot::Mutex;

use crate::error::ServerError;

/// A permit as callers see it: `p1.<id>` (hex).
const PREFIX: &str = "p1.";

/// One permit named in the book.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Held {
    /// A keyed hash of the tenant, route and key it was issued for.
    names: u64,
    /// When its permits were charged (or last renewed): what a refund names.
    pub(crate) charged_at: Nanos,
    /// Permits it holds on each concurrency level (the request's cost).
    pub(crate) units: u64,
    /// When the first of its levels reclaims it.
    pub(crate) expires_at: Nanos,
}

/// What a release or renewal found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Found {
    /// Named and live: taken out of the book (release) or to be moved (renewal).
    Open(OpenPermit),
    /// Not named any more: released already, expired, or forgotten.
    Gone,
}

/// A live permit taken from the book.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OpenPermit {
    pub(crate) id: u64,
    pub(crate) charged_at: Nanos,
    pub(crate) units: u64,
}

/// The book of permits held at this owner.
#[derive(Debug)]
pub(crate) struct Permits {
    key: std::hash::RandomState,
    book: Mutex<Book>,
    max: usize,
    /// When each concurrency level (a keyed hash of its counter key) last refused a
    /// request: its blocks' holders are told at renewal.
    refused: Mutex<HashMap<u64, Nanos>>,
}

/// Levels remembered as contended at once (beyond it, the oldest half is dropped: a
/// holder is then told a little less often, nothing else).
const MAX_CONTENDED: usize = 65_536;

/// The named permits, indexed by expiry (so that pruning and forgetting cost what
/// they remove) and counted by names (so that the usage view reads a count): no call
/// a client makes scans the book.
#[derive(Debug, Default)]
struct Book {
    held: HashMap<u64, Held>,
    by_expiry: BTreeSet<(Nanos, u64)>,
    /// Permits and units named per keyed hash of tenant, route and key.
    by_names: HashMap<u64, (u64, u64)>,
    /// Units named in all.
    units: u64,
    serial: u64,
    /// Permits dropped from a full book (they come back at expiry).
    forgotten: u64,
}

impl Book {
    fn insert(&mut self, id: u64, h: Held) {
        if let Some(old) = self.held.insert(id, h) {
            self.unindex(id, &old);
        }
        self.by_expiry.insert((h.expires_at, id));
        let n = self.by_names.entry(h.names).or_default();
        *n = (n.0 + 1, n.1.saturating_add(h.units));
        self.units = self.units.saturating_add(h.units);
    }

    fn remove(&mut self, id: u64) -> Option<Held> {
        let h = self.held.remove(&id)?;
        self.unindex(id, &h);
        Some(h)
    }

    fn unindex(&mut self, id: u64, h: &Held) {
        self.by_expiry.remove(&(h.expires_at, id));
        if let Some(n) = self.by_names.get_mut(&h.names) {
            *n = (n.0 - 1, n.1.saturating_sub(h.units));
            if n.0 == 0 {
                self.by_names.remove(&h.names);
            }
        }
        self.units = self.units.saturating_sub(h.units);
    }

    /// Drops the permits expired by `now`; returns how many.
    fn prune(&mut self, now: Nanos) -> usize {
        let mut n = 0;
        while let Some(&(expires_at, id)) = self.by_expiry.first() {
            if expires_at > now {
                break;
            }
            self.remove(id);
            n += 1;
        }
        n
    }
}

/// The concurrency levels of `chain`, alone: what a release or renewal moves.
pub(crate) fn concurrency_levels<'a>(chain: &Chain<'a>) -> Chain<'a> {
    chain.retain_levels(|l| l.rule.limit.is_concurrency())
}

/// When a permit charged at `at` on `chain`'s concurrency levels stops being named:
/// a sixteenth of the shortest level's TTL before that level can reclaim it (the
/// memory store reclaims it between its TTL and a sixteenth more, Redis at its TTL on
/// Redis's clock), so that a renewal or release the book accepts always finds the
/// permit still counted, with room for the skew between this server's clock and
/// Redis's. `None` when the chain has no concurrency level.
pub(crate) fn expiry(chain: &Chain<'_>, at: Nanos) -> Option<Nanos> {
    chain
        .levels()
        .filter_map(|l| match *l.rule.limit {
            Limit::Concurrency(c) => Some(named_until(&c, at)),
            _ => None,
        })
        .min()
}

fn named_until(c: &Concurrency, at: Nanos) -> Nanos {
    let ttl = c.permit_ttl().get();
    at.saturating_add(ttl - ttl / 16)
}

/// The outermost concurrency level of `chain`, if it has one.
/// A level's counter key hashed under `key` (a key drawn at start): what the owner's
/// per-level books (refusals, lines) are keyed by.
pub(crate) fn level_hash(key: &std::hash::RandomState, l: &limiter_core::policy::Level<'_>) -> u64 {
    let k = &l.key;
    key.hash_one((k.scope as u8, k.tenant, k.route, k.key, k.budget))
}

pub(crate) fn first_level(chain: &Chain<'_>) -> Option<Scope> {
    chain.levels().find(|l| l.rule.limit.is_concurrency()).map(|l| l.scope)
}

/// Refuses concurrency levels this server cannot hold permits for: in a cluster, one
/// on a level every node shares (the global ceiling, a route's limit: nodes share
/// those through slices of tokens, which cannot hold a permit); one on the global
/// ceiling or on Envoy's default route (`envoy_route`), which Envoy's requests always
/// reach and cannot release (`ShouldRateLimit` has no release call).
///
/// # Errors
///
/// One line per such level, by where it is written.
pub fn check_policy(
    policy: &limiter_core::policy::Policy,
    clustered: bool,
    envoy_route: Option<&str>,
) -> Result<(), String> {
    const ENVOY: &str = "Envoy's ShouldRateLimit reaches it and cannot release a permit \
                         (every such request would be refused); put the limit on a route \
                         your services call through the native API";
    let mut errors = Vec::new();
    let concurrent =
        |r: Option<&limiter_core::policy::LimitRule>| r.is_some_and(|r| r.limit.is_concurrency());
    if concurrent(policy.global.as_ref()) {
        errors.push(format!("global.ceiling: a concurrency level here: {ENVOY}"));
    }
    for (name, route) in &policy.routes {
        if clustered && concurrent(route.limit.as_ref()) {
            errors.push(format!(
                "routes.{name}.limit: a concurrency level on a route's limit is shared by \
                 every node of a cluster through slices of tokens, which cannot hold \
                 permits; put it on the tenants (tenants.<t>.routes.{name})"
            ));
        }
    }
    if let Some(route) = envoy_route {
        let tenants = policy.tenants.iter().map(|(n, t)| (n.as_ref(), t));
        let on_route = policy.routes.get(route).is_some_and(|r| concurrent(r.limit.as_ref()));
        if on_route {
            errors.push(format!(
                "routes.{route}.limit: `{route}` is Envoy's default route \
                 (envoy.default_route): {ENVOY}"
            ));
        }
        for (name, t) in tenants.chain(policy.default_tenant.as_ref().map(|t| ("default", t))) {
            if concurrent(t.routes.get(route).map(|r| &r.rule)) {
                errors.push(format!(
                    "tenants.{name}.routes.{route}: `{route}` is Envoy's default route \
                     (envoy.default_route): {ENVOY}"
                ));
            }
        }
    }
    if errors.is_empty() { Ok(()) } else { Err(errors.join("\n")) }
}

impl Permits {
    /// A book naming at most `max` permits at once.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            key: std::hash::RandomState::new(),
            book: Mutex::default(),
            max: max.max(1),
            refused: Mutex::default(),
        }
    }

    fn level(&self, l: &limiter_core::policy::Level<'_>) -> u64 {
        level_hash(&self.key, l)
    }

    /// Notes that `chain`'s concurrency level at `scope` refused a request at `now`.
    pub(crate) fn refused(&self, chain: &Chain<'_>, scope: Scope, now: Nanos) {
        let Some(level) =
            chain.levels().find(|l| l.scope == scope && l.rule.limit.is_concurrency())
        else {
            return;
        };
        let h = self.level(&level);
        let mut refused = self.refused.lock();
        if refused.len() >= MAX_CONTENDED && !refused.contains_key(&h) {
            let mut times: Vec<Nanos> = refused.values().copied().collect();
            let (_, median, _) = times.select_nth_unstable(refused.len() / 2);
            let median = *median;
            refused.retain(|_, at| *at > median);
        }
        refused.insert(h, now);
    }

    /// Whether one of `chain`'s concurrency levels refused a request within the last
    /// half of its TTL (since a block renewed at half its TTL was last renewed).
    pub(crate) fn contended(&self, chain: &Chain<'_>, now: Nanos) -> bool {
        let refused = self.refused.lock();
        chain.levels().filter(|l| l.rule.limit.is_concurrency()).any(|l| {
            let half_ttl = l.rule.limit.quota().1 / 2;
            refused.get(&self.level(&l)).is_some_and(|&at| now.saturating_sub(at) <= half_ttl)
        })
    }

    fn names(&self, req: &Request<'_>) -> u64 {
        self.key.hash_one((req.tenant, req.route, req.key.unwrap_or("")))
    }

    /// Names `units` permits charged at `at` for `req`, first reclaimed at
    /// `expires_at`, and returns the permit. A full book forgets the permit closest to
    /// its expiry first (its units come back then; it can no longer be released early).
    pub(crate) fn issue(
        &self,
        req: &Request<'_>,
        at: Nanos,
        units: u64,
        expires_at: Nanos,
    ) -> String {
        let names = self.names(req);
        let mut book = self.book.lock();
        if book.held.len() >= self.max {
            book.prune(at);
        }
        if book.held.len() >= self.max
            && let Some(&(_, soonest)) = book.by_expiry.first()
        {
            book.remove(soonest);
            book.forgotten += 1;
            metrics::counter!(crate::metrics::PERMITS, "event" => "forgotten").increment(1);
        }
        book.serial += 1;
        let mut id = self.key.hash_one((names, at, book.serial));
        while book.held.contains_key(&id) {
            id = id.wrapping_add(1);
        }
        book.insert(id, Held { names, charged_at: at, units, expires_at });
        metrics::counter!(crate::metrics::PERMITS, "event" => "acquired").increment(1);
        format!("{PREFIX}{id:x}")
    }

    /// The id of a permit's text.
    ///
    /// # Errors
    ///
    /// Text that is not a permit.
    pub(crate) fn parse(text: &str) -> Result<u64, ServerError> {
        text.strip_prefix(PREFIX)
            .filter(|h| !h.is_empty() && h.len() <= 16)
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or_else(|| ServerError::invalid("permit", "not a permit (expected `p1.<hex>`)"))
    }

    /// Takes permit `id` of `req` out of the book when it is live at `now`.
    ///
    /// # Errors
    ///
    /// A permit named for another tenant, route or key (nothing changes).
    pub(crate) fn take(
        &self,
        req: &Request<'_>,
        id: u64,
        now: Nanos,
    ) -> Result<Found, ServerError> {
        let names = self.names(req);
        let mut book = self.book.lock();
        let Some(held) = book.held.get(&id).copied() else { return Ok(Found::Gone) };
        if held.names != names {
            return Err(ServerError::invalid(
                "permit",
                "not a permit issued for this tenant, route and key",
            ));
        }
        book.remove(id);
        if held.expires_at <= now {
            return Ok(Found::Gone);
        }
        Ok(Found::Open(OpenPermit { id, charged_at: held.charged_at, units: held.units }))
    }

    /// Names a renewed permit again under its id, charged at `at`.
    pub(crate) fn reopen(&self, req: &Request<'_>, p: OpenPermit, at: Nanos, expires_at: Nanos) {
        let names = self.names(req);
        self.book.lock().insert(p.id, Held { names, charged_at: at, units: p.units, expires_at });
    }

    /// Permits named and live at `now`, and their units.
    pub(crate) fn live(&self, now: Nanos) -> (u64, u64) {
        let mut book = self.book.lock();
        book.prune(now);
        (book.held.len() as u64, book.units)
    }

    /// Live permits of `req`'s tenant, route and key at `now`, and their units.
    pub(crate) fn live_for(&self, req: &Request<'_>, now: Nanos) -> (u64, u64) {
        let names = self.names(req);
        let mut book = self.book.lock();
        book.prune(now);
        book.by_names.get(&names).copied().unwrap_or_default()
    }

    /// Drops permits expired by `now` from the book (their units are back already).
    pub(crate) fn sweep(&self, now: Nanos) -> usize {
        self.book.lock().prune(now)
    }

    /// Permits dropped from a full book so far.
    #[cfg(test)]
    pub(crate) fn forgotten(&self) -> u64 {
        self.book.lock().forgotten
    }
}

#[cfg(test)]
mod model;

#[cfg(test)]
mod tests {
    use super::*;

    fn req<'a>(tenant: &'a str) -> Request<'a> {
        Request::new(tenant, "/export")
    }

    #[test]
    fn a_permit_is_taken_once_and_only_by_its_own_names() {
        let p = Permits::new(10);
        let text = p.issue(&req("acme"), 100, 2, 1_000);
        let id = Permits::parse(&text).unwrap();
        assert!(p.take(&req("other"), id, 200).is_err(), "another tenant's release");
        assert_eq!(
            p.take(&req("acme"), id, 200).unwrap(),
            Found::Open(OpenPermit { id, charged_at: 100, units: 2 })
        );
        assert_eq!(p.take(&req("acme"), id, 200).unwrap(), Found::Gone, "released twice");
        let late = Permits::parse(&p.issue(&req("acme"), 100, 1, 1_000)).unwrap();
        assert_eq!(p.take(&req("acme"), late, 1_000).unwrap(), Found::Gone, "expired");
    }

    #[test]
    fn concurrency_levels_that_cannot_hold_permits_are_refused_by_where_they_are_written() {
        let policy = limiter_core::policy::from_yaml(
            "version: 1\nglobal:\n  ceiling: { algorithm: concurrency, limit: 9, permit_ttl: 5s }\nroutes:\n  /a:\n    limit: { algorithm: concurrency, limit: 9, permit_ttl: 5s }\ntenants:\n  acme:\n    routes:\n      /envoy: { algorithm: concurrency, limit: 2, permit_ttl: 5s }\n      /b: { algorithm: concurrency, limit: 2, permit_ttl: 5s }\n",
            "p.yaml",
        )
        .unwrap();
        let alone = check_policy(&policy, false, None).unwrap_err();
        assert_eq!(alone.lines().count(), 1, "{alone}");
        assert!(alone.starts_with("global.ceiling:"), "{alone}");
        let all = check_policy(&policy, true, Some("/envoy")).unwrap_err();
        let lines: Vec<&str> = all.lines().collect();
        assert_eq!(lines.len(), 3, "{all}");
        assert!(lines[1].starts_with("routes./a.limit:"), "{all}");
        assert!(lines[2].starts_with("tenants.acme.routes./envoy:"), "{all}");
        assert!(!all.contains("/b"), "a tenant's route level is fine: {all}");
        let fine = limiter_core::policy::from_yaml(
            "version: 1\ntenants:\n  acme:\n    routes:\n      /b: { algorithm: concurrency, limit: 2, permit_ttl: 5s }\n",
            "p.yaml",
        )
        .unwrap();
        check_policy(&fine, true, Some("/envoy")).unwrap();
    }

    #[test]
    fn malformed_permits_are_refused() {
        for bad in ["", "p1.", "p2.ff", "p1.xyz", "p1.11111111111111111", "ticket"] {
            assert!(Permits::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Permits::parse("p1.ff").unwrap(), 255);
    }

    #[test]
    fn a_full_book_forgets_the_permit_closest_to_expiry() {
        let p = Permits::new(2);
        let a = Permits::parse(&p.issue(&req("a"), 0, 1, 500)).unwrap();
        let b = Permits::parse(&p.issue(&req("b"), 0, 1, 900)).unwrap();
        let c = Permits::parse(&p.issue(&req("c"), 10, 1, 800)).unwrap();
        assert_eq!(p.forgotten(), 1);
        assert_eq!(p.take(&req("a"), a, 20).unwrap(), Found::Gone);
        assert!(matches!(p.take(&req("b"), b, 20).unwrap(), Found::Open(_)));
        assert!(matches!(p.take(&req("c"), c, 20).unwrap(), Found::Open(_)));
        // Expired permits make room before a live one is forgotten.
        let p = Permits::new(1);
        p.issue(&req("a"), 0, 1, 10);
        p.issue(&req("b"), 20, 1, 30);
        assert_eq!(p.forgotten(), 0);
        assert_eq!(p.live(20), (1, 1));
    }
}
