//! Stage two of loading a policy: the node tree into a validated [`Policy`],
//! collecting every mistake (with file, line, column and field) before returning.

use std::collections::HashMap;
use std::fmt;
use std::num::NonZeroU64;
use std::sync::Arc;

use super::tree::{self, Key, Node, Pos, Value};
use super::{
    Budgets, FailurePolicy, LeaseSettings, LimitRule, Map, Policy, RouteSpec, TenantRouteSpec,
    TenantSpec, UnknownTenants,
};
use crate::algorithm::{
    Algorithm, Concurrency, FixedWindow, SlidingCounter, SlidingLog, TokenBucket, Window,
};
use crate::calendar::{Calendar, CalendarError, CalendarUnit, WeekStart};
use crate::clock::Nanos;
use crate::limit::{AlgorithmKind, Limit};
use crate::rate::{self, DurationText, MAX_AMOUNT, Rate, RateError};
use crate::share;

/// The policy schema version this build reads.
pub const SCHEMA_VERSION: i128 = 1;

/// The largest `limit` of a sliding log: its state holds up to one entry per unit,
/// so this bounds its memory per key (16 bytes an entry, 1.6 MB at most).
pub const SLIDING_LOG_MAX_LIMIT: u64 = 100_000;

/// The largest `limit` of a concurrency level: permits are named one by one in the
/// owner's book (about 100 bytes each), so this bounds a level's book.
pub const CONCURRENCY_MAX_LIMIT: u64 = 1_000_000;

/// The shortest `permit_ttl`: a holder renews within it, and a renewal is a call.
pub const PERMIT_TTL_MIN: Nanos = 1_000_000_000;

/// The longest `permit_ttl`: what a crashed holder's permits cost at most.
pub const PERMIT_TTL_MAX: Nanos = 24 * 3_600_000_000_000;

/// The name of the tenant whose limits apply to unlisted tenants.
pub const DEFAULT_TENANT: &str = "default";

/// One mistake in a policy file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyError {
    /// The file's name as given to the loader.
    pub file: String,
    /// Where the mistake is.
    pub pos: Pos,
    /// The dotted path of the field at fault (`tenants.acme.limit.rate`).
    pub field: String,
    /// What is wrong.
    pub message: String,
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: ", self.file, self.pos)?;
        if !self.field.is_empty() {
            write!(f, "{}: ", self.field)?;
        }
        f.write_str(&self.message)
    }
}

/// Every mistake found in a policy file, in the order of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicyErrors(pub Vec<PolicyError>);

/// The most mistakes a message lists; the rest are counted.
pub const MAX_LISTED_ERRORS: usize = 100;

impl fmt::Display for PolicyErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0.len();
        write!(f, "{n} mistake{} in the policy", if n == 1 { "" } else { "s" })?;
        for e in self.0.iter().take(MAX_LISTED_ERRORS) {
            write!(f, "\n  {e}")?;
        }
        if n > MAX_LISTED_ERRORS {
            write!(f, "\n  ... and {} more", n - MAX_LISTED_ERRORS)?;
        }
        Ok(())
    }
}

/// A dotted field path with every name in it cut to a quotable length.
fn shorten_field(field: &str) -> String {
    if field.len() <= crate::text::QUOTE_MAX {
        return field.to_owned();
    }
    field.split('.').map(crate::text::shorten).collect::<Vec<_>>().join(".")
}

impl std::error::Error for PolicyErrors {}

/// Parses and validates a policy. `file` names the source in every message.
///
/// # Errors
///
/// Every mistake found, each with its line, column and field.
///
/// # Examples
///
/// ```
/// let p = limiter_core::policy::from_yaml(
///     "version: 1\ntenants:\n  acme:\n    limit: { algorithm: token_bucket, rate: 10/s }\n",
///     "inline.yaml",
/// ).unwrap();
/// assert!(p.tenants.contains_key("acme"));
/// let e = limiter_core::policy::from_yaml("version: 1\ntenants: { acme: { limt: 1 } }\n", "p.yaml")
///     .unwrap_err();
/// assert!(e.to_string().contains("p.yaml:2:"));
/// ```
pub fn from_yaml(text: &str, file: &str) -> Result<Policy, PolicyErrors> {
    let root = tree::parse(text).map_err(|e| {
        PolicyErrors(vec![PolicyError {
            file: file.to_owned(),
            pos: e.pos,
            field: String::new(),
            message: crate::text::shorten_message(&format!("invalid YAML: {}", e.message))
                .into_owned(),
        }])
    })?;
    let mut cx = Cx { file, errors: Vec::new(), tenant_names: listed_tenants(&root) };
    let policy = cx.policy(&root);
    cx.errors.sort_by_key(|e| (e.pos.line, e.pos.column));
    match policy {
        Some(p) if cx.errors.is_empty() => Ok(p),
        _ => Err(PolicyErrors(cx.errors)),
    }
}

struct Cx<'f> {
    file: &'f str,
    errors: Vec<PolicyError>,
    /// The listed tenants, when unlisted ones are rejected (a share class naming
    /// another matches nothing); `None` when unlisted tenants are served.
    tenant_names: Option<Vec<String>>,
}

/// The level a `shares` block divides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ShareLevel {
    Global,
    Route,
    Tenant,
}

/// The fields of one mapping, checked against the names allowed there.
struct Fields<'n> {
    entries: Vec<(&'n Key, &'n Node)>,
    pos: Pos,
}

impl<'n> Fields<'n> {
    fn get(&self, name: &str) -> Option<&'n Node> {
        self.entries.iter().find(|(k, _)| k.text == name).map(|(_, v)| *v)
    }
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() { field.to_owned() } else { format!("{path}.{field}") }
}

/// The tenants a policy lists, when it rejects unlisted ones (read before validation:
/// a share class is checked against them).
fn listed_tenants(root: &Node) -> Option<Vec<String>> {
    let Value::Map(top) = &root.value else { return None };
    let get = |name: &str| top.iter().find(|(k, _)| k.text == name).map(|(_, v)| v);
    let names: Vec<String> = match get("tenants").map(|n| &n.value) {
        Some(Value::Map(m)) => m.iter().map(|(k, _)| k.text.clone()).collect(),
        _ => Vec::new(),
    };
    let rejects = match get("unknown_tenants").map(|n| &n.value) {
        Some(Value::Str(s)) => s == "reject",
        _ => !names.iter().any(|n| n == DEFAULT_TENANT),
    };
    rejects.then_some(names)
}

impl Cx<'_> {
    fn err(&mut self, pos: Pos, field: &str, message: impl Into<String>) {
        let message = message.into();
        self.errors.push(PolicyError {
            file: self.file.to_owned(),
            pos,
            field: shorten_field(field),
            message: crate::text::shorten_message(&message).into_owned(),
        });
    }

    /// The entries of a mapping (absent: `None` without error for `Null`), with
    /// duplicate keys reported.
    fn entries<'n>(&mut self, node: &'n Node, path: &str) -> Option<Vec<(&'n Key, &'n Node)>> {
        let entries = match &node.value {
            Value::Map(m) => m,
            Value::Null => return Some(Vec::new()),
            other => {
                self.err(node.pos, path, format!("expected a mapping, found {}", other.kind()));
                return None;
            }
        };
        let mut seen: HashMap<&str, Pos> = HashMap::new();
        let mut out = Vec::with_capacity(entries.len());
        for (k, v) in entries {
            if let Some(first) = seen.get(k.text.as_str()) {
                self.err(
                    k.pos,
                    &join(path, &k.text),
                    format!("duplicate name `{}` (first defined at line {})", k.text, first.line),
                );
                continue;
            }
            seen.insert(&k.text, k.pos);
            out.push((k, v));
        }
        Some(out)
    }

    /// A mapping whose keys must be among `allowed`.
    fn fields<'n>(&mut self, node: &'n Node, path: &str, allowed: &[&str]) -> Option<Fields<'n>> {
        let entries = self.entries(node, path)?;
        for (k, _) in &entries {
            if !allowed.contains(&k.text.as_str()) {
                self.err(
                    k.pos,
                    &join(path, &k.text),
                    format!("unknown field `{}`; expected one of: {}", k.text, allowed.join(", ")),
                );
            }
        }
        Some(Fields { entries, pos: node.pos })
    }

    fn require<'n>(&mut self, f: &Fields<'n>, path: &str, name: &str) -> Option<&'n Node> {
        let node = f.get(name);
        if node.is_none() {
            self.err(f.pos, &join(path, name), format!("missing required field `{name}`"));
        }
        node
    }

    fn string<'n>(&mut self, node: &'n Node, path: &str) -> Option<&'n str> {
        match &node.value {
            Value::Str(s) => Some(s),
            other => {
                self.err(node.pos, path, format!("expected a string, found {}", other.kind()));
                None
            }
        }
    }

    fn boolean(&mut self, node: &Node, path: &str) -> Option<bool> {
        match node.value {
            Value::Bool(b) => Some(b),
            ref other => {
                self.err(node.pos, path, format!("expected true or false, found {}", other.kind()));
                None
            }
        }
    }

    /// A positive integer no larger than `max`.
    fn positive(&mut self, node: &Node, path: &str, max: u64) -> Option<NonZeroU64> {
        match node.value {
            Value::Int(i) if i <= 0 => {
                self.err(node.pos, path, format!("must be greater than zero, found {i}"));
                None
            }
            Value::Int(i) if i > i128::from(max) => {
                self.err(node.pos, path, format!("must be at most {max}, found {i}"));
                None
            }
            Value::Int(i) => NonZeroU64::new(u64::try_from(i).ok()?),
            ref other => {
                self.err(
                    node.pos,
                    path,
                    format!("expected a positive integer, found {}", other.kind()),
                );
                None
            }
        }
    }

    fn rate(&mut self, node: &Node, path: &str) -> Option<Rate> {
        let text = match &node.value {
            Value::Str(s) => s.as_str(),
            other => {
                self.err(
                    node.pos,
                    path,
                    format!("expected a rate like `100/s`, found {}", other.kind()),
                );
                return None;
            }
        };
        match text.parse::<Rate>() {
            Ok(r) => Some(r),
            Err(e) => {
                let msg = match e {
                    RateError::Zero => "must be greater than zero".to_owned(),
                    e => format!("{e}, found `{text}`"),
                };
                self.err(node.pos, path, msg);
                None
            }
        }
    }

    fn duration(&mut self, node: &Node, path: &str) -> Option<u64> {
        let text = match &node.value {
            Value::Str(s) => s.as_str(),
            Value::Int(i) => {
                self.err(node.pos, path, format!("a duration needs a unit, like `{i}s`"));
                return None;
            }
            other => {
                self.err(
                    node.pos,
                    path,
                    format!("expected a duration like `10s`, found {}", other.kind()),
                );
                return None;
            }
        };
        match rate::parse_duration(text) {
            Ok(d) => Some(d),
            Err(e) => {
                self.err(node.pos, path, format!("{e}, found `{text}`"));
                None
            }
        }
    }

    fn policy(&mut self, root: &Node) -> Option<Policy> {
        const TOP: &[&str] = &[
            "version",
            "global",
            "shadow",
            "unknown_tenants",
            "on_limiter_failure",
            "lease",
            "routes",
            "tenants",
        ];
        let top = self.fields(root, "", TOP)?;
        if let Some(v) = self.require(&top, "", "version") {
            match v.value {
                Value::Int(SCHEMA_VERSION) => {}
                ref other => self.err(
                    v.pos,
                    "version",
                    format!(
                        "unsupported policy version {}; this build reads version {SCHEMA_VERSION}",
                        match other {
                            Value::Int(i) => i.to_string(),
                            o => o.kind().to_owned(),
                        }
                    ),
                ),
            }
        }
        let shadow = top.get("shadow").and_then(|n| self.boolean(n, "shadow")).unwrap_or(false);
        let global = top.get("global").and_then(|n| {
            let f = self.fields(n, "global", &["ceiling", "shares"])?;
            let c = self.require(&f, "global", "ceiling")?;
            let rule = self.limit_rule(c, "global.ceiling", "global", &[]).0?;
            Some(self.with_shares(rule, f.get("shares"), "global.shares", ShareLevel::Global))
        });
        let on_limiter_failure = match top.get("on_limiter_failure") {
            Some(n) => self.failure_policy(n, "on_limiter_failure"),
            None => Some(FailurePolicy::FailClosed),
        };
        let lease = match top.get("lease") {
            Some(n) => self.lease(n, "lease", LeaseSettings::default()),
            None => Some(LeaseSettings::default()),
        };
        let on_limiter_failure = on_limiter_failure.unwrap_or(FailurePolicy::FailClosed);
        let lease = lease.unwrap_or_default();

        let mut routes = Map::default();
        if let Some(n) = top.get("routes") {
            for (k, v) in self.entries(n, "routes").unwrap_or_default() {
                let path = join("routes", &k.text);
                self.name(k, &path);
                if let Some(r) = self.route(v, &path, on_limiter_failure, lease) {
                    routes.insert(k.text.clone().into_boxed_str(), r);
                }
            }
        }
        let mut tenants = Map::default();
        let mut default_tenant = None;
        if let Some(n) = top.get("tenants") {
            for (k, v) in self.entries(n, "tenants").unwrap_or_default() {
                let path = join("tenants", &k.text);
                self.name(k, &path);
                if let Some(t) = self.tenant(v, &path, k.text == DEFAULT_TENANT) {
                    if k.text == DEFAULT_TENANT {
                        default_tenant = Some(t);
                    } else {
                        tenants.insert(k.text.clone().into_boxed_str(), t);
                    }
                }
            }
        }
        let unknown_tenants = match top.get("unknown_tenants") {
            None if default_tenant.is_some() => UnknownTenants::UseDefault,
            None => UnknownTenants::Reject,
            Some(n) => match self.string(n, "unknown_tenants") {
                Some("reject") => UnknownTenants::Reject,
                Some("use_default") => {
                    let listed = top.get("tenants").is_some_and(|t| {
                        matches!(&t.value, Value::Map(m) if m.iter().any(|(k, _)| k.text == DEFAULT_TENANT))
                    });
                    if !listed {
                        self.err(
                            n.pos,
                            "unknown_tenants",
                            "`use_default` needs a tenant named `default` under `tenants` \
                             (without one, every request of an unlisted tenant is rejected)",
                        );
                    }
                    UnknownTenants::UseDefault
                }
                Some(other) => {
                    self.err(
                        n.pos,
                        "unknown_tenants",
                        format!("expected `use_default` or `reject`, found `{other}`"),
                    );
                    UnknownTenants::Reject
                }
                None => UnknownTenants::Reject,
            },
        };
        let listed_any =
            top.get("tenants").is_some_and(|t| matches!(&t.value, Value::Map(m) if !m.is_empty()));
        // Judged on a policy otherwise valid: a mistake elsewhere is the news.
        if !listed_any && unknown_tenants == UnknownTenants::Reject && self.errors.is_empty() {
            let pos = top
                .get("tenants")
                .or_else(|| top.get("unknown_tenants"))
                .map_or(root.pos, |n| n.pos);
            self.err(
                pos,
                "tenants",
                "no tenant is listed and unknown tenants are rejected: every request would be \
                 refused with UNKNOWN_TENANT (list a tenant, or a `default` one)",
            );
        }
        let unlisted_route = RouteSpec {
            cost: NonZeroU64::MIN,
            limit: None,
            shadow: false,
            on_limiter_failure,
            lease,
        };
        let policy = Policy {
            global,
            shadow,
            on_limiter_failure,
            lease,
            routes,
            tenants,
            default_tenant,
            unknown_tenants,
            unlisted_route,
        };
        self.check_costs(&policy, root);
        Some(policy)
    }

    fn name(&mut self, key: &Key, path: &str) {
        if key.text.is_empty() {
            self.err(key.pos, path, "a name must not be empty");
        } else if key.text.len() > 256 {
            self.err(key.pos, path, "a name must be at most 256 bytes");
        } else if key.text.chars().any(char::is_control) {
            self.err(key.pos, path, "a name must not contain control characters");
        }
    }

    fn route(
        &mut self,
        node: &Node,
        path: &str,
        failure: FailurePolicy,
        lease: LeaseSettings,
    ) -> Option<RouteSpec> {
        let f = self.fields(
            node,
            path,
            &["cost", "limit", "shares", "shadow", "on_limiter_failure", "lease"],
        )?;
        let cost = match f.get("cost") {
            Some(n) => self.positive(n, &join(path, "cost"), MAX_AMOUNT),
            None => Some(NonZeroU64::MIN),
        };
        let limit =
            f.get("limit").map(|n| self.limit_rule(n, &join(path, "limit"), "route", &[]).0);
        let limit = match (limit, f.get("shares")) {
            (Some(Some(rule)), shares) => {
                Some(Some(self.with_shares(rule, shares, &join(path, "shares"), ShareLevel::Route)))
            }
            (None, Some(n)) => {
                self.err(
                    n.pos,
                    &join(path, "shares"),
                    "shares divide a limit: give the route a `limit`",
                );
                None
            }
            (limit, _) => limit,
        };
        let shadow = f.get("shadow").map(|n| self.boolean(n, &join(path, "shadow")));
        let on_limiter_failure = match f.get("on_limiter_failure") {
            Some(n) => self.failure_policy(n, &join(path, "on_limiter_failure")),
            None => Some(failure),
        };
        let lease = match f.get("lease") {
            Some(n) => self.lease(n, &join(path, "lease"), lease),
            None => Some(lease),
        };
        Some(RouteSpec {
            cost: cost?,
            limit: limit.flatten(),
            shadow: shadow.unwrap_or(Some(false))?,
            on_limiter_failure: on_limiter_failure?,
            lease: lease?,
        })
    }

    fn tenant(&mut self, node: &Node, path: &str, default: bool) -> Option<TenantSpec> {
        let f = self.fields(node, path, &["limit", "shares", "routes", "per_key"])?;
        let mut limit = f
            .get("limit")
            .map(|n| self.budgets(n, &join(path, "limit"), "tenant"))
            .unwrap_or_default();
        if let Some(n) = f.get("shares") {
            let spath = join(path, "shares");
            if default {
                self.err(
                    n.pos,
                    &spath,
                    "the `default` tenant's limits are every unlisted tenant's, each with its own \
                     counters: shares are given to listed tenants only",
                );
            } else if limit.iter().count() != 1 {
                self.err(
                    n.pos,
                    &spath,
                    "shares divide one limit: give the tenant a single `limit`",
                );
            } else if let Some(rule) = limit.first().cloned() {
                limit = Budgets::one(self.with_shares(rule, Some(n), &spath, ShareLevel::Tenant));
            }
        }
        let per_key = f
            .get("per_key")
            .map(|n| self.budgets(n, &join(path, "per_key"), "key"))
            .unwrap_or_default();
        let mut routes = Map::default();
        if let Some(n) = f.get("routes") {
            let rpath = join(path, "routes");
            for (k, v) in self.entries(n, &rpath).unwrap_or_default() {
                let p = join(&rpath, &k.text);
                self.name(k, &p);
                let (rule, extra) = self.limit_rule(v, &p, "tenant_route", &["cost"]);
                // Outer `None`: the cost was given and is wrong (already reported).
                let cost = match extra.as_ref().and_then(|e| e.get("cost")) {
                    Some(c) => self.positive(c, &join(&p, "cost"), MAX_AMOUNT).map(Some),
                    None => Some(None),
                };
                if let (Some(rule), Some(cost)) = (rule, cost) {
                    routes.insert(k.text.clone().into_boxed_str(), TenantRouteSpec { rule, cost });
                }
            }
        }
        Some(TenantSpec { limit, routes, per_key })
    }

    /// `rule` with the classes `node` divides it into (when given).
    fn with_shares(
        &mut self,
        mut rule: LimitRule,
        node: Option<&Node>,
        path: &str,
        level: ShareLevel,
    ) -> LimitRule {
        let Some(node) = node else { return rule };
        if rule.limit.is_concurrency() {
            self.err(
                node.pos,
                path,
                "shares divide a rate or a window's units; a concurrency level's permits \
                 are not divided (give classes their own concurrency levels)",
            );
            return rule;
        }
        const CLASS: &[&str] = &[
            "tenants",
            "routes",
            "keys",
            "reserved",
            "weight",
            "max_borrow",
            "priority",
            "min_share",
        ];
        let Some(entries) = self.entries(node, path) else { return rule };
        if entries.is_empty() {
            self.err(node.pos, path, "expected at least one class");
            return rule;
        }
        if entries.len() >= share::MAX_CLASSES {
            self.err(
                node.pos,
                path,
                format!("at most {} classes divide one level", share::MAX_CLASSES - 1),
            );
            return rule;
        }
        let quota = rule.limit.quota().0;
        let mut classes = Vec::with_capacity(entries.len());
        let mut catch_all: Option<Pos> = None;
        let mut ok = true;
        for (k, v) in entries {
            let cpath = join(path, &k.text);
            let name = &k.text;
            if name.is_empty()
                || name.len() > 64
                || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                self.err(
                    k.pos,
                    &cpath,
                    "a class name is 1 to 64 letters, digits, `_` or `-` (it is a metric label)",
                );
                ok = false;
            }
            let Some(f) = self.fields(v, &cpath, CLASS) else {
                ok = false;
                continue;
            };
            let mut patterns = |cx: &mut Self, field: &str| -> Vec<share::Pattern> {
                let Some(n) = f.get(field) else { return Vec::new() };
                let fpath = join(&cpath, field);
                let Value::Seq(items) = &n.value else {
                    cx.err(n.pos, &fpath, "expected a list of names (`abc*` for a prefix)");
                    ok = false;
                    return Vec::new();
                };
                if items.is_empty() {
                    cx.err(
                        n.pos,
                        &fpath,
                        "an empty list matches nothing; leave it out to match any",
                    );
                    ok = false;
                }
                items
                    .iter()
                    .filter_map(|i| {
                        let t = cx.string(i, &fpath)?;
                        if t.is_empty() || t.len() > 256 || t.chars().any(char::is_control) {
                            cx.err(
                                i.pos,
                                &fpath,
                                "a name is 1 to 256 bytes, no control characters",
                            );
                            return None;
                        }
                        Some(share::Pattern::new(t))
                    })
                    .collect()
            };
            let tenants = patterns(self, "tenants");
            let routes = patterns(self, "routes");
            let keys = patterns(self, "keys");
            let (own, field) = match level {
                ShareLevel::Tenant => (!tenants.is_empty(), "tenants"),
                ShareLevel::Route => (!routes.is_empty(), "routes"),
                ShareLevel::Global => (false, ""),
            };
            if own {
                self.err(
                    f.get(field).map_or(f.pos, |n| n.pos),
                    &join(&cpath, field),
                    format!(
                        "this level is one {}'s: every request it sees has the same",
                        &field[..field.len() - 1]
                    ),
                );
                ok = false;
            }
            if let (Some(names), Some(n)) = (&self.tenant_names, f.get("tenants")) {
                let stray: Vec<&str> = tenants
                    .iter()
                    .filter_map(share::Pattern::exact)
                    .filter(|t| !names.iter().any(|n| n == t))
                    .collect();
                if !stray.is_empty() && stray.len() == tenants.len() {
                    self.err(
                        n.pos,
                        &join(&cpath, "tenants"),
                        format!(
                            "matches nothing: `{}` is not a listed tenant and unlisted tenants \
                             are rejected",
                            stray[0]
                        ),
                    );
                    ok = false;
                }
            }
            let mut amount = |cx: &mut Self, field: &str| -> u64 {
                f.get(field).map_or(0, |n| {
                    cx.share_amount(n, &join(&cpath, field), quota).unwrap_or_else(|| {
                        ok = false;
                        0
                    })
                })
            };
            let reserved = amount(self, "reserved");
            let min_share = amount(self, "min_share");
            let max_borrow = f.get("max_borrow").map(|n| {
                self.share_amount(n, &join(&cpath, "max_borrow"), quota).unwrap_or_else(|| {
                    ok = false;
                    0
                })
            });
            let weight = match f.get("weight") {
                Some(n) => self.positive(n, &join(&cpath, "weight"), 1_000).unwrap_or_else(|| {
                    ok = false;
                    NonZeroU64::MIN
                }),
                None => NonZeroU64::MIN,
            };
            let priority = match f.get("priority") {
                Some(n) => match n.value {
                    Value::Int(p @ 0..=100) => u8::try_from(p).unwrap_or(0),
                    _ => {
                        self.err(
                            n.pos,
                            &join(&cpath, "priority"),
                            "expected an integer from 0 to 100",
                        );
                        ok = false;
                        0
                    }
                },
                None => 0,
            };
            let class = share::ShareClass {
                name: name.as_str().into(),
                tenants,
                routes,
                keys,
                reserved,
                weight,
                max_borrow,
                priority,
                min_share,
            };
            if class.is_catch_all() {
                if let Some(first) = catch_all {
                    self.err(
                        k.pos,
                        &cpath,
                        format!(
                            "a second class matching every request (the first at line {}); \
                             give it `tenants`, `routes` or `keys`",
                            first.line
                        ),
                    );
                    ok = false;
                }
                catch_all = Some(k.pos);
            }
            classes.push(class);
        }
        if catch_all.is_none() && classes.iter().any(|c| &*c.name == share::OTHER) {
            self.err(
                node.pos,
                path,
                format!(
                    "`{}` names the class of requests no other class matches; with no class \
                     matching every request, rename this one",
                    share::OTHER
                ),
            );
            ok = false;
        }
        let pct = |ppm: u64| format!("{}%", ppm as f64 / 10_000.0);
        let reserved: u64 = classes.iter().map(|c| c.reserved).sum();
        let floors: u64 = classes.iter().map(|c| c.reserved.max(c.min_share)).sum();
        if reserved > share::PPM {
            self.err(
                node.pos,
                path,
                format!("reservations add up to {}, more than the level", pct(reserved)),
            );
            ok = false;
        } else if floors > share::PPM {
            self.err(
                node.pos,
                path,
                format!(
                    "reservations and minimum shares add up to {}, more than the level",
                    pct(floors)
                ),
            );
            ok = false;
        }
        if ok {
            rule.shares = Some(Arc::new(share::Shares::new(classes)));
        }
        rule
    }

    /// A share of a level: `N%` (up to four decimals) or a number of units of the
    /// level's limit (its burst for a token bucket), at most the whole level; in ppm.
    fn share_amount(&mut self, node: &Node, path: &str, quota: u64) -> Option<u64> {
        let whole = || format!("at most the whole level ({quota} units, 100%)");
        match &node.value {
            Value::Int(i) if *i < 0 => {
                self.err(node.pos, path, format!("must not be negative, found {i}"));
                None
            }
            Value::Int(i) if *i > i128::from(quota) => {
                self.err(node.pos, path, format!("found {i}: {}", whole()));
                None
            }
            Value::Int(i) => {
                u64::try_from(i.unsigned_abs() * u128::from(share::PPM) / u128::from(quota.max(1)))
                    .ok()
            }
            Value::Str(t) if t.ends_with('%') => {
                let num = &t[..t.len() - 1];
                let (int, frac) = num.split_once('.').unwrap_or((num, ""));
                let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
                if !digits(int)
                    || (!frac.is_empty() && !digits(frac))
                    || frac.len() > 4
                    || int.len() > 3
                {
                    self.err(
                        node.pos,
                        path,
                        format!(
                            "expected a percentage like `30%` or `12.5%`, found `{}`",
                            crate::text::shorten(t)
                        ),
                    );
                    return None;
                }
                let frac4 = format!("{frac:0<4}");
                let ppm = int.parse::<u64>().ok()? * 10_000 + frac4.parse::<u64>().ok()?;
                if ppm > share::PPM {
                    self.err(node.pos, path, format!("found `{t}`: {}", whole()));
                    return None;
                }
                Some(ppm)
            }
            other => {
                self.err(
                    node.pos,
                    path,
                    format!(
                        "expected a percentage like `30%` or a number of units, found {}",
                        other.kind()
                    ),
                );
                None
            }
        }
    }

    /// A level's limit, or a list of budgets (each a limit, named apart: by default
    /// `NAME_1`, `NAME_2`, ...).
    fn budgets(&mut self, node: &Node, path: &str, default_name: &str) -> Budgets {
        let Value::Seq(items) = &node.value else {
            return self
                .limit_rule(node, path, default_name, &[])
                .0
                .map(Budgets::one)
                .unwrap_or_default();
        };
        if items.is_empty() || items.len() > Budgets::MAX {
            self.err(
                node.pos,
                path,
                format!(
                    "a list of budgets holds 1 to {} limits, found {}",
                    Budgets::MAX,
                    items.len()
                ),
            );
            return Budgets::default();
        }
        let mut rules: Vec<LimitRule> = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let ipath = format!("{path}[{i}]");
            let name = format!("{default_name}_{}", i + 1);
            if let Some(rule) = self.limit_rule(item, &ipath, &name, &[]).0 {
                if rules.iter().any(|r| r.name == rule.name) {
                    self.err(
                        item.pos,
                        &join(&ipath, "name"),
                        format!("duplicate budget name `{}`", rule.name),
                    );
                }
                rules.push(rule);
            }
        }
        Budgets::new(rules)
    }

    /// A limit: `{ algorithm, rate, burst }` or `{ algorithm, limit, window }`, plus an
    /// optional `name` and the caller's `extra` fields (returned for it to read).
    fn limit_rule<'n>(
        &mut self,
        node: &'n Node,
        path: &str,
        default_name: &str,
        extra: &[&str],
    ) -> (Option<LimitRule>, Option<Fields<'n>>) {
        const COMMON: &[&str] = &[
            "algorithm",
            "name",
            "rate",
            "burst",
            "limit",
            "window",
            "align",
            "timezone",
            "week_start",
            "permit_ttl",
        ];
        let allowed: Vec<&str> = COMMON.iter().chain(extra).copied().collect();
        let Some(f) = self.fields(node, path, &allowed) else { return (None, None) };
        let name = match f.get("name") {
            Some(n) => self.string(n, &join(path, "name")).map(str::to_owned),
            None => Some(default_name.to_owned()),
        };
        let Some(alg_node) = self.require(&f, path, "algorithm") else { return (None, Some(f)) };
        let apath = join(path, "algorithm");
        let Some(alg) = self.string(alg_node, &apath) else { return (None, Some(f)) };
        let kind = AlgorithmKind::ALL.into_iter().find(|k| k.as_str() == alg);
        let Some(kind) = kind else {
            let names: Vec<&str> = AlgorithmKind::ALL.iter().map(|k| k.as_str()).collect();
            self.err(
                alg_node.pos,
                &apath,
                format!("unknown algorithm `{alg}`; expected one of: {}", names.join(", ")),
            );
            return (None, Some(f));
        };
        let (wanted, unwanted): (&[&str], &[&str]) = match kind {
            AlgorithmKind::TokenBucket => {
                (&["rate"], &["limit", "window", "align", "timezone", "week_start", "permit_ttl"])
            }
            AlgorithmKind::SlidingLog => (
                &["limit", "window"],
                &["rate", "burst", "align", "timezone", "week_start", "permit_ttl"],
            ),
            AlgorithmKind::Concurrency => (
                &["limit", "permit_ttl"],
                &["rate", "burst", "window", "align", "timezone", "week_start"],
            ),
            _ => (&["limit", "window"], &["rate", "burst", "permit_ttl"]),
        };
        for name in unwanted {
            if let Some((k, _)) = f.entries.iter().find(|(k, _)| k.text == *name) {
                self.err(
                    k.pos,
                    &join(path, name),
                    format!(
                        "`{name}` does not apply to {}; it takes {}",
                        kind.as_str(),
                        match kind {
                            AlgorithmKind::TokenBucket => "`rate` and optionally `burst`",
                            AlgorithmKind::SlidingLog => "`limit` and a fixed `window`",
                            AlgorithmKind::Concurrency =>
                                "`limit` (permits in use at once) and `permit_ttl`",
                            _ => "`limit` and `window` (`align: calendar` for calendar windows)",
                        }
                    ),
                );
            }
        }
        let mut present = true;
        for name in wanted {
            present &= self.require(&f, path, name).is_some();
        }
        if !present {
            return (None, Some(f));
        }
        let limit = match kind {
            AlgorithmKind::TokenBucket => {
                let rate = self.rate(f.get("rate").expect("required"), &join(path, "rate"));
                let burst = match f.get("burst") {
                    Some(b) => self.positive(b, &join(path, "burst"), MAX_AMOUNT),
                    // One period's worth: `100/s` holds 100.
                    None => rate.map(|r| r.amount()),
                };
                rate.zip(burst).map(|(r, b)| Limit::TokenBucket(TokenBucket::new(r, b)))
            }
            AlgorithmKind::Concurrency => {
                let limit = self.positive(
                    f.get("limit").expect("required"),
                    &join(path, "limit"),
                    CONCURRENCY_MAX_LIMIT,
                );
                let tpath = join(path, "permit_ttl");
                let node = f.get("permit_ttl").expect("required");
                let ttl = self.duration(node, &tpath).and_then(|t| {
                    if (PERMIT_TTL_MIN..=PERMIT_TTL_MAX).contains(&t) {
                        NonZeroU64::new(t)
                    } else {
                        self.err(
                            node.pos,
                            &tpath,
                            format!(
                                "a permit lives {} to {}: long enough for the calls it \
                                 guards to renew it, short enough that a crashed holder's \
                                 permits come back soon",
                                DurationText(PERMIT_TTL_MIN),
                                DurationText(PERMIT_TTL_MAX)
                            ),
                        );
                        None
                    }
                });
                limit.zip(ttl).map(|(l, t)| Limit::Concurrency(Concurrency::new(l, t)))
            }
            _ => {
                let max = if kind == AlgorithmKind::SlidingLog {
                    SLIDING_LOG_MAX_LIMIT
                } else {
                    MAX_AMOUNT
                };
                let limit =
                    self.positive(f.get("limit").expect("required"), &join(path, "limit"), max);
                let window = self.window(&f, path, kind);
                limit.zip(window).map(|(l, w)| match (kind, w) {
                    (AlgorithmKind::FixedWindow, w) => {
                        Limit::FixedWindow(FixedWindow::with_window(l, w))
                    }
                    (AlgorithmKind::SlidingLog, Window::Fixed(w)) => {
                        Limit::SlidingLog(SlidingLog::new(l, w))
                    }
                    (_, w) => Limit::SlidingCounter(SlidingCounter::with_window(l, w)),
                })
            }
        };
        let rule = limit.zip(name).map(|(limit, name)| LimitRule {
            limit: Arc::new(limit),
            name: name.into(),
            shares: None,
        });
        (rule, Some(f))
    }

    /// A window algorithm's `window`, with `align` (`epoch`, the default, or
    /// `calendar`), `timezone` (an IANA name, UTC by default) and `week_start`.
    fn window(&mut self, f: &Fields<'_>, path: &str, kind: AlgorithmKind) -> Option<Window> {
        let node = f.get("window").expect("required");
        let wpath = join(path, "window");
        let calendar = match f.get("align") {
            None => false,
            Some(a) => match self.string(a, &join(path, "align"))? {
                "epoch" => false,
                "calendar" => true,
                other => {
                    self.err(
                        a.pos,
                        &join(path, "align"),
                        format!("expected `epoch` or `calendar`, found `{other}`"),
                    );
                    return None;
                }
            },
        };
        if !calendar {
            for name in ["timezone", "week_start"] {
                if let Some((k, _)) = f.entries.iter().find(|(k, _)| k.text == name) {
                    self.err(k.pos, &join(path, name), format!("`{name}` needs `align: calendar`"));
                }
            }
            if let Value::Str(text) = &node.value
                && let Some((_, unit)) = CalendarUnit::parse(text)
                && !matches!(unit, CalendarUnit::Day)
            {
                let msg = match kind {
                    AlgorithmKind::SlidingLog => format!(
                        "`{text}` is a calendar window, which a sliding log cannot have; \
                         use a fixed duration like `7d`"
                    ),
                    _ => format!(
                        "`{text}` is a calendar window: add `align: calendar` (and a \
                         `timezone`, UTC by default), or use a fixed duration like `7d`"
                    ),
                };
                self.err(node.pos, &wpath, msg);
                return None;
            }
            return self.duration(node, &wpath).and_then(NonZeroU64::new).map(Window::Fixed);
        }
        let Value::Str(text) = &node.value else {
            self.err(node.pos, &wpath, "expected a calendar window like `1d`, `1w`, `1mo` or `1y`");
            return None;
        };
        let Some((count, unit)) = CalendarUnit::parse(text) else {
            self.err(
                node.pos,
                &wpath,
                format!(
                    "expected a calendar window like `1d`, `1w`, `1mo` or `1y`, found `{text}`"
                ),
            );
            return None;
        };
        let zone = match f.get("timezone") {
            Some(z) => self.string(z, &join(path, "timezone"))?,
            None => "UTC",
        };
        let week_start = match f.get("week_start") {
            None => WeekStart::Monday,
            Some(w) => {
                let wspath = join(path, "week_start");
                let text = self.string(w, &wspath)?;
                let Some(day) = WeekStart::ALL.into_iter().find(|d| d.as_str() == text) else {
                    self.err(
                        w.pos,
                        &wspath,
                        format!("expected a day like `monday`, found `{text}`"),
                    );
                    return None;
                };
                if unit != CalendarUnit::Week {
                    self.err(w.pos, &wspath, "`week_start` applies to weekly windows (`1w`)");
                }
                day
            }
        };
        match Calendar::try_new(unit, count, zone, week_start) {
            Ok(c) => Some(Window::Calendar(c)),
            Err(e) => {
                let (pos, field) = match (&e, f.get("timezone")) {
                    (CalendarError::UnknownTimezone, Some(z)) => (z.pos, join(path, "timezone")),
                    _ => (node.pos, wpath),
                };
                let msg = match e {
                    CalendarError::UnknownTimezone => format!("{e}, found `{zone}`"),
                    e => format!("{e}, found `{text}`"),
                };
                self.err(pos, &field, msg);
                None
            }
        }
    }

    fn failure_policy(&mut self, node: &Node, path: &str) -> Option<FailurePolicy> {
        let f = self.fields(node, path, &["mode", "emergency_ceiling"])?;
        let mode_node = self.require(&f, path, "mode")?;
        let mpath = join(path, "mode");
        let ceiling = f.get("emergency_ceiling");
        match self.string(mode_node, &mpath)? {
            "fail_open" => match ceiling {
                Some(c) => {
                    let rate = self.rate(c, &join(path, "emergency_ceiling"))?;
                    Some(FailurePolicy::FailOpen { emergency_ceiling: rate })
                }
                None => {
                    self.err(
                        f.pos,
                        &join(path, "emergency_ceiling"),
                        "`fail_open` needs an `emergency_ceiling` rate (like `200/s`)",
                    );
                    None
                }
            },
            "fail_closed" => {
                if let Some(c) = ceiling {
                    self.err(
                        c.pos,
                        &join(path, "emergency_ceiling"),
                        "`emergency_ceiling` applies only to `fail_open`",
                    );
                }
                Some(FailurePolicy::FailClosed)
            }
            other => {
                self.err(
                    mode_node.pos,
                    &mpath,
                    format!("expected `fail_open` or `fail_closed`, found `{other}`"),
                );
                None
            }
        }
    }

    fn lease(&mut self, node: &Node, path: &str, base: LeaseSettings) -> Option<LeaseSettings> {
        let f = self.fields(node, path, &["mode", "ttl", "max_batch"])?;
        let mut out = base;
        let mut ok = true;
        if let Some(m) = f.get("mode") {
            match self.string(m, &join(path, "mode")) {
                Some("leased") => out.exact = false,
                Some("exact") => out.exact = true,
                Some(other) => {
                    self.err(
                        m.pos,
                        &join(path, "mode"),
                        format!("expected `leased` or `exact`, found `{other}`"),
                    );
                    ok = false;
                }
                None => ok = false,
            }
        }
        if let Some(t) = f.get("ttl") {
            match self.duration(t, &join(path, "ttl")) {
                Some(d) if d > 60_000_000_000 => {
                    self.err(
                        t.pos,
                        &join(path, "ttl"),
                        "must be at most 60s: leases lease tokens, not a rate",
                    );
                    ok = false;
                }
                Some(d) => out.ttl = d,
                None => ok = false,
            }
        }
        if let Some(b) = f.get("max_batch") {
            match self.positive(b, &join(path, "max_batch"), MAX_AMOUNT) {
                Some(b) => out.max_batch = b,
                None => ok = false,
            }
        }
        ok.then_some(out)
    }

    /// A cost above the capacity of a limit it is charged against could never be
    /// admitted: reported at the cost.
    fn check_costs(&mut self, p: &Policy, root: &Node) {
        let global = p.global.as_ref();
        let mut problems = Vec::new();
        for (rname, r) in &p.routes {
            let path = format!("routes.{rname}.cost");
            for (scope, rule) in [("global ceiling", global), ("route limit", r.limit.as_ref())] {
                if let Some(rule) = rule
                    && r.cost.get() > rule.limit.capacity()
                {
                    let scope = scope.to_owned();
                    problems.push((path.clone(), r.cost.get(), scope, rule.limit.capacity()));
                }
            }
        }
        let tenants = p.tenants.iter().map(|(n, t)| (n.as_ref(), t));
        for (tname, t) in tenants.chain(p.default_tenant.iter().map(|t| (DEFAULT_TENANT, t))) {
            // Every route this tenant may be charged on: the policy's and its own.
            let mut names: Vec<&str> = p.routes.keys().map(AsRef::as_ref).collect();
            names.extend(t.routes.keys().map(AsRef::as_ref).filter(|n| !p.routes.contains_key(*n)));
            for rname in names {
                let route = p.route(rname);
                let tr = t.routes.get(rname);
                let cost = tr.and_then(|tr| tr.cost).unwrap_or(route.cost).get();
                let path = if tr.and_then(|tr| tr.cost).is_some() {
                    format!("tenants.{tname}.routes.{rname}.cost")
                } else if p.routes.contains_key(rname) {
                    format!("routes.{rname}.cost")
                } else {
                    format!("tenants.{tname}.routes.{rname}")
                };
                // The global and route levels were checked above, once per route.
                let levels = t
                    .limit
                    .iter()
                    .map(|r| ("tenant limit", r))
                    .chain(tr.map(|tr| ("tenant route limit", &tr.rule)))
                    .chain(t.per_key.iter().map(|r| ("per-key limit", r)));
                for (scope, rule) in levels {
                    if cost > rule.limit.capacity() {
                        let scope = format!("{scope} of tenant `{tname}`");
                        problems.push((path.clone(), cost, scope, rule.limit.capacity()));
                    }
                }
            }
        }
        problems.sort();
        problems.dedup();
        for (path, cost, scope, cap) in problems {
            let pos = find_pos(root, &path);
            self.err(
                pos,
                &path,
                format!("cost {cost} can never be admitted: the {scope} holds at most {cap}"),
            );
        }
    }
}

/// The position of the node at a dotted path (its longest existing prefix).
fn find_pos(root: &Node, path: &str) -> Pos {
    let mut node = root;
    let mut rest = path;
    'outer: while !rest.is_empty() {
        let Value::Map(m) = &node.value else { break };
        // Names may contain dots: try the longest matching key first.
        let mut best: Option<(&Node, usize)> = None;
        for (k, v) in m {
            let matches = rest == k.text || rest.starts_with(&format!("{}.", k.text));
            if matches && best.is_none_or(|(_, l)| k.text.len() > l) {
                best = Some((v, k.text.len()));
            }
        }
        match best {
            Some((v, l)) => {
                node = v;
                rest = rest.get(l + 1..).unwrap_or("");
            }
            None => break 'outer,
        }
    }
    node.pos
}
