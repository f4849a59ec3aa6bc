//! The policy model: what limits apply to whom, and how a request resolves into the
//! ordered chain of limits it is checked against.
//!
//! Policies are built by [`load`] from YAML (see the README's policy section); the
//! types here are already validated: a `Policy` that exists is a usable one.

pub mod load;
pub mod tree;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::Arc;

use crate::algorithm::Algorithm;
use crate::clock::Nanos;
use crate::decision::Scope;
use crate::error::RequestError;
use crate::key::{LimitKeyRef, MAX_NAME_LEN};
use crate::limit::Limit;
use crate::rate::Rate;
use crate::table::MAX_LEVELS;

pub use load::{PolicyError, PolicyErrors, from_yaml};

/// The maps of a policy: names to settings.
pub type Map<V> = HashMap<Box<str>, V, ahash::RandomState>;

/// A named limit of the policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitRule {
    /// The limit (shared with the state table's slots).
    pub limit: Arc<Limit>,
    /// The name reported in `RateLimit-Policy` headers and the admin port.
    pub name: Arc<str>,
    /// How the level is divided among classes of requests, if it is.
    pub shares: Option<Arc<crate::share::Shares>>,
}

/// The limits of a tenant's or a key's level: usually one; several budgets (tokens
/// per minute and tokens per calendar month, say) are each checked and charged, all
/// or nothing with the rest of the chain, and a refusal names the budget's limit.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Budgets(Vec<LimitRule>);

impl Budgets {
    /// The most budgets one level may carry.
    pub const MAX: usize = 4;

    /// The budgets `rules` (at most [`Self::MAX`]; the policy loader checks).
    pub fn new(rules: Vec<LimitRule>) -> Self {
        debug_assert!(rules.len() <= Self::MAX);
        Self(rules)
    }

    /// One budget.
    pub fn one(rule: LimitRule) -> Self {
        Self(vec![rule])
    }

    /// The budgets, in the policy's order.
    pub fn iter(&self) -> std::slice::Iter<'_, LimitRule> {
        self.0.iter()
    }

    /// Budget `i`.
    pub fn get(&self, i: u8) -> Option<&LimitRule> {
        self.0.get(usize::from(i))
    }

    /// The first budget.
    pub fn first(&self) -> Option<&LimitRule> {
        self.0.first()
    }

    /// True when the level has no limit.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// What a gateway does for a route when the limiter cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Admit up to a local token bucket of this rate (burst: one period's amount),
    /// answering `EMERGENCY_CEILING` past it.
    FailOpen {
        /// The emergency ceiling.
        emergency_ceiling: Rate,
    },
    /// Reject with `LIMITER_UNAVAILABLE`.
    FailClosed,
}

/// How leases are handed out for a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseSettings {
    /// Per-request decisions at the owner (no leased batches) when true.
    pub exact: bool,
    /// How long a grant stays usable.
    pub ttl: Nanos,
    /// The largest batch one grant may hold.
    pub max_batch: NonZeroU64,
}

impl Default for LeaseSettings {
    fn default() -> Self {
        Self { exact: false, ttl: 2_000_000_000, max_batch: NonZeroU64::new(1_000).expect("1000") }
    }
}

/// A route's settings, shared by all tenants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteSpec {
    /// Default cost of one request.
    pub cost: NonZeroU64,
    /// The route's limit across all tenants.
    pub limit: Option<LimitRule>,
    /// Decisions are computed and counted but every request is allowed.
    pub shadow: bool,
    /// What gateways do when the limiter is unreachable.
    pub on_limiter_failure: FailurePolicy,
    /// Lease settings.
    pub lease: LeaseSettings,
}

/// A tenant's limit on one route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TenantRouteSpec {
    /// The limit.
    pub rule: LimitRule,
    /// The cost of one request for this tenant on this route, when it differs.
    pub cost: Option<NonZeroU64>,
}

/// A tenant's limits.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TenantSpec {
    /// Across the tenant's routes (one or several budgets).
    pub limit: Budgets,
    /// Per route.
    pub routes: Map<TenantRouteSpec>,
    /// Per key, on each route (one or several budgets).
    pub per_key: Budgets,
}

/// What happens to tenants the policy does not list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownTenants {
    /// Each unknown tenant gets its own counters with the `default` tenant's limits.
    UseDefault,
    /// Rejected with `UNKNOWN_TENANT`.
    Reject,
}

/// Bounds on request names, from the server's configuration (each at most
/// [`MAX_NAME_LEN`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameBounds {
    /// Longest tenant name, in bytes.
    pub tenant: usize,
    /// Longest route name, in bytes.
    pub route: usize,
    /// Longest key, in bytes.
    pub key: usize,
}

impl Default for NameBounds {
    fn default() -> Self {
        Self { tenant: 128, route: 256, key: 256 }
    }
}

/// A validated policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Policy {
    /// The global ceiling.
    pub global: Option<LimitRule>,
    /// Shadow mode for every route.
    pub shadow: bool,
    /// Failure policy of routes that do not set one.
    pub on_limiter_failure: FailurePolicy,
    /// Lease settings of routes that do not set them.
    pub lease: LeaseSettings,
    /// Routes by name.
    pub routes: Map<RouteSpec>,
    /// Tenants by name.
    pub tenants: Map<TenantSpec>,
    /// The limits of tenants that are not listed.
    pub default_tenant: Option<TenantSpec>,
    /// The rule for unlisted tenants.
    pub unknown_tenants: UnknownTenants,
    /// A settings record for routes the policy does not list.
    unlisted_route: RouteSpec,
}

/// A request as the policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request<'a> {
    /// Tenant name.
    pub tenant: &'a str,
    /// Route name.
    pub route: &'a str,
    /// Key within the tenant (API key, user), if any.
    pub key: Option<&'a str>,
    /// Units to charge; `None` takes the route's default.
    pub cost: Option<u64>,
    /// Check without charging.
    pub dry_run: bool,
}

impl<'a> Request<'a> {
    /// A request of the route's default cost, with no key.
    pub fn new(tenant: &'a str, route: &'a str) -> Self {
        Self { tenant, route, key: None, cost: None, dry_run: false }
    }

    /// With a key.
    pub fn with_key(mut self, key: &'a str) -> Self {
        self.key = Some(key);
        self
    }

    /// With an explicit cost.
    pub fn with_cost(mut self, cost: u64) -> Self {
        self.cost = Some(cost);
        self
    }

    /// As a dry run.
    pub fn with_dry_run(mut self, dry_run: bool) -> Self {
        self.dry_run = dry_run;
        self
    }
}

/// One level of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Level<'a> {
    /// The level's scope.
    pub scope: Scope,
    /// Its limit.
    pub rule: &'a LimitRule,
    /// The counter it is charged against.
    pub key: LimitKeyRef<'a>,
}

/// A request resolved against a policy: the limits it is checked against, outermost
/// first, and how to treat it. Small enough to copy: the names are held once and each
/// level's counter key is made from them when asked for.
#[derive(Debug, Clone, Copy)]
pub struct Chain<'a> {
    tenant: &'a str,
    route_name: &'a str,
    key: &'a str,
    rules: [Option<(Scope, u8, &'a LimitRule)>; MAX_LEVELS],
    len: u8,
    /// Units to charge (zero only for a dry run).
    pub cost: u64,
    /// Check without charging.
    pub dry_run: bool,
    /// Shadow mode (route or global).
    pub shadow: bool,
    /// The tenant is unknown and the policy rejects unknown tenants.
    pub unknown_tenant: bool,
    /// The route's settings (the unlisted-route defaults when it is not listed).
    pub route: &'a RouteSpec,
}

/// The counter keys of a chain's levels, outermost first (what the state table locks).
#[derive(Debug, Clone, Copy)]
pub struct ChainKeys<'a> {
    keys: [LimitKeyRef<'a>; MAX_LEVELS],
    len: usize,
}

impl<'a> std::ops::Deref for ChainKeys<'a> {
    type Target = [LimitKeyRef<'a>];

    fn deref(&self) -> &Self::Target {
        &self.keys[..self.len]
    }
}

impl<'a> Chain<'a> {
    /// The levels, outermost first.
    pub fn levels(&self) -> impl Iterator<Item = Level<'a>> + Clone + '_ {
        self.rules[..usize::from(self.len)].iter().flatten().map(|&(scope, budget, rule)| Level {
            scope,
            rule,
            key: self.key_of(scope).with_budget(budget),
        })
    }

    fn key_of(&self, scope: Scope) -> LimitKeyRef<'a> {
        LimitKeyRef::new(scope, self.tenant, self.route_name, self.key)
    }

    /// How long units granted at `now` may be spent, at most `hold`: cut by the end of
    /// any window level's window (and a sliding log's own cap).
    pub fn grant_hold(&self, now: Nanos, hold: Nanos) -> Nanos {
        self.levels().fold(hold, |h, l| l.rule.limit.grant_hold(now, h))
    }

    /// The same request over only the levels `keep` accepts (in order): the part of a
    /// chain one node decides when other levels are decided elsewhere.
    #[must_use]
    pub fn retain_levels(&self, keep: impl Fn(&Level<'a>) -> bool) -> Self {
        let mut out = Self { rules: [None; MAX_LEVELS], len: 0, ..*self };
        for level in self.levels() {
            if keep(&level) {
                out.push_budget(level.scope, level.key.budget, level.rule);
            }
        }
        out
    }

    /// The chain with one more level at the end: a limit the request brings with it
    /// (Envoy's per-descriptor override), counted at `scope` under `budget` (kept
    /// apart from the policy's budgets, which count from 0 below [`Budgets::MAX`]).
    ///
    /// # Errors
    ///
    /// The request's cost above the limit's capacity (it could never be admitted).
    pub fn with_level(
        mut self,
        scope: Scope,
        budget: u8,
        rule: &'a LimitRule,
    ) -> Result<Self, RequestError> {
        let capacity = rule.limit.capacity();
        if self.cost > capacity {
            return Err(RequestError::CostAboveLimit { cost: self.cost, scope, capacity });
        }
        if self.len() < MAX_LEVELS {
            self.push_budget(scope, budget, rule);
        }
        Ok(self)
    }

    /// The level a decision names: of `scope`, and among a level's budgets the one
    /// whose limit is `limit` (the first of the scope when none is given or matches).
    pub fn level_named(&self, scope: Scope, limit: Option<&Limit>) -> Option<Level<'a>> {
        let mut of_scope = self.levels().filter(|l| l.scope == scope);
        let first = of_scope.clone().next();
        limit.and_then(|limit| of_scope.find(|l| *l.rule.limit == *limit)).or(first)
    }

    /// The request's tenant.
    pub fn tenant(&self) -> &'a str {
        self.tenant
    }

    /// The request's tenant, route and key (none when empty): what a divided level's
    /// classes match.
    pub fn names(&self) -> (&'a str, &'a str, Option<&'a str>) {
        (self.tenant, self.route_name, (!self.key.is_empty()).then_some(self.key))
    }

    /// Number of levels.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// True when no level applies.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The counters of the levels, outermost first.
    pub fn keys(&self) -> ChainKeys<'a> {
        let mut keys = ChainKeys { keys: [LimitKeyRef::GLOBAL; MAX_LEVELS], len: self.len() };
        for (k, l) in keys.keys.iter_mut().zip(self.levels()) {
            *k = l.key;
        }
        keys
    }

    fn push(&mut self, scope: Scope, rule: Option<&'a LimitRule>) {
        if let Some(rule) = rule {
            self.push_budget(scope, 0, rule);
        }
    }

    fn push_all(&mut self, scope: Scope, budgets: &'a Budgets) {
        for (i, rule) in budgets.iter().enumerate() {
            self.push_budget(scope, u8::try_from(i).unwrap_or(u8::MAX), rule);
        }
    }

    fn push_budget(&mut self, scope: Scope, budget: u8, rule: &'a LimitRule) {
        self.rules[usize::from(self.len)] = Some((scope, budget, rule));
        self.len += 1;
    }
}

fn check_name(field: &'static str, name: &str, max: usize) -> Result<(), RequestError> {
    let max = max.min(MAX_NAME_LEN);
    if name.is_empty() {
        return Err(RequestError::EmptyName { field });
    }
    if name.len() > max {
        return Err(RequestError::NameTooLong { field, len: name.len(), max });
    }
    // Control characters are C0, DEL and C1 (U+0080..=U+009F, not ASCII). One
    // comparison a byte, with no early exit so it vectorizes, flags C0, DEL and every
    // byte of a non-ASCII character (`b + 1`, as signed, is at most 0x20 exactly for
    // those); only a flagged name is read again character by character.
    let flagged = name.bytes().fold(false, |f, b| f | (b.wrapping_add(1).cast_signed() <= 0x20));
    if flagged && name.chars().any(char::is_control) {
        return Err(RequestError::ControlCharacter { field });
    }
    Ok(())
}

impl Policy {
    /// The settings of `route` (defaults when the policy does not list it).
    pub fn route(&self, route: &str) -> &RouteSpec {
        self.routes.get(route).unwrap_or(&self.unlisted_route)
    }

    /// The limits of `tenant`, or `None` when it is unknown and rejected.
    pub fn tenant(&self, tenant: &str) -> Option<&TenantSpec> {
        match self.tenants.get(tenant) {
            Some(t) => Some(t),
            None if self.unknown_tenants == UnknownTenants::UseDefault => {
                self.default_tenant.as_ref()
            }
            None => None,
        }
    }

    /// The rule a counter key is charged under, if the policy has one for it: the
    /// global ceiling, a route's limit, or a tenant's (the default's for an unlisted
    /// tenant when the policy admits those) limit, route limit or per-key limit.
    pub fn rule_of(&self, key: &LimitKeyRef<'_>) -> Option<&LimitRule> {
        match key.scope {
            Scope::Tenant => self.tenant(key.tenant)?.limit.get(key.budget),
            Scope::Key => self.tenant(key.tenant)?.per_key.get(key.budget),
            _ if key.budget > 0 => None,
            Scope::Global => self.global.as_ref(),
            Scope::Route => self.routes.get(key.route)?.limit.as_ref(),
            Scope::TenantRoute => Some(&self.tenant(key.tenant)?.routes.get(key.route)?.rule),
        }
    }

    /// The chain of one root level alone, the global ceiling or `route`'s limit across
    /// tenants: what a node leasing a slice of it is charged against. No tenant is
    /// involved (a root level is every tenant's), so the unknown-tenant rule does not
    /// apply; any other scope has no root level and gives an empty chain.
    ///
    /// # Errors
    ///
    /// An empty or oversized route name (a route level), and a cost above the level's
    /// capacity.
    pub fn resolve_root<'a>(
        &'a self,
        scope: Scope,
        route: &'a str,
        cost: u64,
        bounds: &NameBounds,
    ) -> Result<Chain<'a>, RequestError> {
        // A global slice names no route; any route named is still a caller's name,
        // bounded like every other (it is filed with the lease).
        if scope == Scope::Route || !route.is_empty() {
            check_name("route", route, bounds.route)?;
        }
        let rule = match scope {
            Scope::Global => self.global.as_ref(),
            Scope::Route => self.route(route).limit.as_ref(),
            Scope::Tenant | Scope::TenantRoute | Scope::Key => None,
        };
        let spec = self.route(route);
        let mut chain = Chain {
            tenant: "",
            route_name: route,
            key: "",
            rules: [None; MAX_LEVELS],
            len: 0,
            cost: cost.max(1),
            dry_run: false,
            shadow: self.shadow || spec.shadow,
            unknown_tenant: false,
            route: spec,
        };
        chain.push(scope, rule);
        if let Some(rule) = rule
            && chain.cost > rule.limit.capacity()
        {
            return Err(RequestError::CostAboveLimit {
                cost: chain.cost,
                scope,
                capacity: rule.limit.capacity(),
            });
        }
        Ok(chain)
    }

    /// Resolves a request into its chain of limits, outermost first: global ceiling,
    /// route, tenant, tenant x route, key.
    ///
    /// # Errors
    ///
    /// Empty or oversized names, a zero cost outside a dry run, and a cost above the
    /// capacity of any level (which could never be admitted).
    pub fn resolve<'a>(
        &'a self,
        req: &Request<'a>,
        bounds: &NameBounds,
    ) -> Result<Chain<'a>, RequestError> {
        check_name("tenant", req.tenant, bounds.tenant)?;
        check_name("route", req.route, bounds.route)?;
        if let Some(key) = req.key {
            check_name("key", key, bounds.key)?;
        }
        let route = self.route(req.route);
        let tenant = self.tenant(req.tenant);
        let tenant_route = tenant.and_then(|t| t.routes.get(req.route));
        let cost = match req.cost {
            Some(0) if !req.dry_run => return Err(RequestError::ZeroCost),
            Some(c) => c,
            None => tenant_route.and_then(|tr| tr.cost).unwrap_or(route.cost).get(),
        };
        let mut chain = Chain {
            tenant: req.tenant,
            route_name: req.route,
            key: req.key.unwrap_or(""),
            rules: [None; MAX_LEVELS],
            len: 0,
            cost,
            dry_run: req.dry_run,
            shadow: self.shadow || route.shadow,
            unknown_tenant: tenant.is_none(),
            route,
        };
        chain.push(Scope::Global, self.global.as_ref());
        chain.push(Scope::Route, route.limit.as_ref());
        if let Some(tenant) = tenant {
            chain.push_all(Scope::Tenant, &tenant.limit);
            chain.push(Scope::TenantRoute, tenant_route.map(|tr| &tr.rule));
            if req.key.is_some() {
                chain.push_all(Scope::Key, &tenant.per_key);
            }
        }
        if let Some(l) = chain.levels().find(|l| cost > l.rule.limit.capacity()) {
            return Err(RequestError::CostAboveLimit {
                cost,
                scope: l.scope,
                capacity: l.rule.limit.capacity(),
            });
        }
        Ok(chain)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_refused_and_every_other_character_is_not() {
        let refused = |s: &str| check_name("key", s, MAX_NAME_LEN).is_err();
        for c in (0u32..0x20).chain([0x7f]).chain(0x80..0xa0) {
            let c = char::from_u32(c).unwrap();
            assert!(refused(&format!("a{c}b")), "{:#x}", c as u32);
        }
        for ok in ["acme", "/a b~", "\u{a0}", "é", "日本", "🦀", "x\u{10ffff}", "\u{ff}"] {
            assert!(!refused(ok), "{ok:?}");
        }
        assert!(refused(""));
        assert!(refused(&"x".repeat(MAX_NAME_LEN + 1)));
    }

    #[test]
    fn a_root_level_resolves_alone_whatever_the_tenant_rule() {
        let policy = from_yaml(
            "version: 1\nunknown_tenants: reject\n\
             global:\n  ceiling: { algorithm: fixed_window, limit: 100, window: 1s }\n\
             routes:\n  /a:\n    limit: { algorithm: fixed_window, limit: 10, window: 1s }\n\
             tenants:\n  acme:\n    limit: { algorithm: fixed_window, limit: 5, window: 1s }\n",
            "p.yaml",
        )
        .unwrap();
        let b = NameBounds::default();
        let scopes = |c: &Chain<'_>| c.levels().map(|l| l.scope).collect::<Vec<_>>();
        let global = policy.resolve_root(Scope::Global, "", 1, &b).unwrap();
        assert_eq!(scopes(&global), [Scope::Global]);
        assert!(!global.unknown_tenant);
        assert_eq!(global.keys()[0], LimitKeyRef::GLOBAL);
        let route = policy.resolve_root(Scope::Route, "/a", 3, &b).unwrap();
        assert_eq!(scopes(&route), [Scope::Route]);
        assert_eq!((route.cost, route.keys()[0].route, route.keys()[0].tenant), (3, "/a", ""));
        // The same level through a tenant's request has the same counter.
        let via = policy.resolve(&Request::new("acme", "/a"), &b).unwrap();
        assert_eq!(via.keys()[1], route.keys()[0]);
        assert!(scopes(&policy.resolve_root(Scope::Route, "/b", 1, &b).unwrap()).is_empty());
        assert!(scopes(&policy.resolve_root(Scope::Tenant, "/a", 1, &b).unwrap()).is_empty());
        assert_eq!(
            policy.resolve_root(Scope::Route, "", 1, &b).unwrap_err(),
            RequestError::EmptyName { field: "route" }
        );
        let long = "/".repeat(b.route + 1);
        assert!(matches!(
            policy.resolve_root(Scope::Global, &long, 1, &b),
            Err(RequestError::NameTooLong { field: "route", .. })
        ));
        // Every level's counter key names the level's own rule.
        for l in via.levels() {
            assert!(std::ptr::eq(policy.rule_of(&l.key).unwrap(), l.rule), "{:?}", l.scope);
        }
        let unknown = LimitKeyRef::new(Scope::Tenant, "nobody", "", "");
        assert!(policy.rule_of(&unknown).is_none(), "unknown tenants are refused here");
        assert!(matches!(
            policy.resolve_root(Scope::Route, "/a", 11, &b),
            Err(RequestError::CostAboveLimit { cost: 11, scope: Scope::Route, capacity: 10 })
        ));
    }
}
