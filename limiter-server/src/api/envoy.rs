//! Envoy's rate limit service (v3), `ShouldRateLimit`, on the same port as ours.
//!
//! Mapping (configurable, see [`EnvoyMapping`]): the tenant is the request's `domain`
//! (or a descriptor entry); the route is the value of the `route` entry (or a default
//! route); every other entry, `key=value` joined by `|` in order, is the key. Each
//! descriptor is one request of our API; its cost is its own `hits_addend` when set
//! (an explicit 0 checks without charging), else the request's `hits_addend` with 0
//! read as 1 (proto3 cannot tell unset from 0).
//!
//! The descriptors of one call are one HTTP request: if any is over its limit the
//! answer is `OVER_LIMIT` and none is charged. A failure of ours is a gRPC error
//! (`UNAVAILABLE`), never `UNKNOWN`, which Envoy would read as OK: Envoy's
//! `failure_mode_deny` then decides.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::num::NonZeroU64;
use std::sync::Arc;

use limiter_core::algorithm::{Algorithm as _, FixedWindow, Window};
use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::policy::LimitRule;
use limiter_core::policy::{NameBounds, Request};
use limiter_core::rate::Rate;
use limiter_core::{Decision, Limit, Scope, headers};
use limiter_core::{RequestError, Verdict};
use limiter_proto::envoy::config::core::v3::HeaderValue;
use limiter_proto::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use limiter_proto::envoy::service::ratelimit::v3 as rls;
use limiter_proto::envoy::r#type::v3::RateLimitUnit as EnvoyUnit;
use rls::rate_limit_response::{Code, DescriptorStatus, RateLimit, rate_limit::Unit};
use rls::rate_limit_service_server::RateLimitService;
use tonic::{Response, Status};
use tracing::Instrument as _;

use crate::config::{DescriptorLimits, EnvoyMapping, TenantFrom};
use crate::convert::duration;
use crate::error::ServerError;
use crate::metrics::Api;
use crate::owner::{Charge, Extra, Outcome, Owner, Reach, Report};

/// `envoy.service.ratelimit.v3.RateLimitService` over an [`Owner`].
#[derive(Debug, Clone)]
pub struct EnvoyService {
    owner: Arc<Owner>,
    mapping: Arc<EnvoyMapping>,
    overrides: Arc<OverrideRules>,
}

impl EnvoyService {
    /// The service over `owner` with a descriptor mapping.
    pub fn new(owner: Arc<Owner>, mapping: EnvoyMapping) -> Self {
        Self { owner, mapping: Arc::new(mapping), overrides: Arc::default() }
    }

    /// Each descriptor's own limit as a rule, when the mapping applies them.
    fn override_rules(&self, mapped: &[Mapped<'_>]) -> Vec<Option<(u8, Arc<LimitRule>)>> {
        mapped
            .iter()
            .map(|m| {
                let (requests, unit) = m.limit?;
                let DescriptorLimits::Apply { cap } = self.mapping.descriptor_limits else {
                    count_override("ignored");
                    return None;
                };
                let Some((unit, n, window, capped)) = override_limit(requests, unit, cap) else {
                    count_override("invalid");
                    return None;
                };
                count_override(if capped { "capped" } else { "applied" });
                Some((override_budget(unit), self.overrides.rule(n, unit, window)))
            })
            .collect()
    }
}

fn count_override(result: &'static str) {
    metrics::counter!(crate::metrics::ENVOY_DESCRIPTOR_LIMITS, "result" => result).increment(1);
}

fn extras(rules: &[Option<(u8, Arc<LimitRule>)>]) -> Vec<Option<Extra<'_>>> {
    rules
        .iter()
        .map(|r| {
            r.as_ref().map(|(budget, rule)| Extra { scope: Scope::Key, budget: *budget, rule })
        })
        .collect()
}

/// One descriptor, mapped.
struct Mapped<'a> {
    tenant: Cow<'a, str>,
    route: Cow<'a, str>,
    key: Option<String>,
    cost: u64,
    dry_run: bool,
    /// The descriptor's own limit: requests per unit, and Envoy's unit.
    limit: Option<(u32, i32)>,
}

/// How many hex digits of a value's SHA-256 stand for a value too long for a name.
const DIGEST_HEX: usize = 32;

/// What an empty descriptor value is named (a name of ours is never empty).
const EMPTY_VALUE: &str = "%empty";

/// A descriptor value (a header a client chose) as a name of ours, never refused:
/// control characters (HTTP allows TAB and obs-text in header values) are written
/// `%XX`, byte by byte; an empty value is [`EMPTY_VALUE`]; a name still longer than
/// `max` bytes becomes `sha256:` and the first [`DIGEST_HEX`] hex digits of its
/// SHA-256, so the limit still applies to it, as one fixed-length key per value.
pub(crate) fn name_from(value: &str, max: usize) -> Cow<'_, str> {
    if value.is_empty() {
        return Cow::Borrowed(EMPTY_VALUE);
    }
    let mut name = Cow::Borrowed(value);
    if value.chars().any(char::is_control) {
        let mut out = String::with_capacity(value.len() + 8);
        for c in value.chars() {
            if c.is_control() {
                let mut buf = [0; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    let _ = write!(out, "%{b:02X}");
                }
            } else {
                out.push(c);
            }
        }
        name = Cow::Owned(out);
    }
    if name.len() > max {
        let digest = ring::digest::digest(&ring::digest::SHA256, name.as_bytes());
        let mut out = String::from("sha256:");
        for b in &digest.as_ref()[..DIGEST_HEX / 2] {
            let _ = write!(out, "{b:02x}");
        }
        out.truncate(max.max(1));
        name = Cow::Owned(out);
    }
    name
}

fn map<'a>(
    m: &'a EnvoyMapping,
    bounds: &NameBounds,
    domain: &'a str,
    index: usize,
    d: &'a RateLimitDescriptor,
    request_hits: u32,
) -> Result<Mapped<'a>, ServerError> {
    let field = "descriptors";
    if d.entries.is_empty() {
        return Err(ServerError::invalid(field, format!("[{index}] has no entries")));
    }
    let entry = |name: &str| d.entries.iter().find(|e| e.key == name).map(|e| e.value.as_str());
    let (tenant, tenant_key) = match &m.tenant_from {
        TenantFrom::Domain => {
            if domain.is_empty() {
                return Err(ServerError::invalid("domain", "must not be empty"));
            }
            (domain, None)
        }
        TenantFrom::Entry(k) => match entry(k) {
            Some(t) => (t, Some(k.as_str())),
            None => {
                return Err(ServerError::invalid(
                    field,
                    format!("[{index}] has no `{k}` entry (the tenant)"),
                ));
            }
        },
    };
    let route = match (entry(&m.route_key), &m.default_route) {
        (Some(r), _) => r,
        (None, Some(r)) => r.as_str(),
        (None, None) => {
            return Err(ServerError::invalid(
                field,
                format!(
                    "[{index}] has no `{}` entry (the route) and no default route is configured",
                    m.route_key
                ),
            ));
        }
    };
    let mut key = String::new();
    for e in &d.entries {
        if e.key == m.route_key || Some(e.key.as_str()) == tenant_key {
            continue;
        }
        if !key.is_empty() {
            key.push('|');
        }
        let _ = write!(key, "{}={}", e.key, e.value);
    }
    let key = (!key.is_empty()).then(|| {
        let renamed = match name_from(&key, bounds.key) {
            Cow::Owned(k) => Some(k),
            Cow::Borrowed(_) => None,
        };
        renamed.unwrap_or(key)
    });
    let (cost, dry_run) = match d.hits_addend {
        Some(0) => (0, true),
        Some(h) => (h, false),
        None => (u64::from(request_hits.max(1)), false),
    };
    Ok(Mapped {
        tenant: name_from(tenant, bounds.tenant),
        route: name_from(route, bounds.route),
        key,
        cost,
        dry_run,
        limit: d.limit.as_ref().map(|l| (l.requests_per_unit, l.unit)),
    })
}

/// The budget index of a descriptor's own limit: one counter per unit, kept apart from
/// the policy's budgets at the key level, so that a descriptor whose override changes
/// size keeps its count (a window's count holds under any limit) and one whose unit
/// changes finds its own unit's count again.
fn override_budget(unit: EnvoyUnit) -> u8 {
    u8::try_from(limiter_core::policy::Budgets::MAX).unwrap_or(4) + unit as u8
}

/// A descriptor's own limit as a fixed window: its unit (second to day aligned on the
/// epoch, month and year calendar-aligned in UTC, as Envoy's own service counts them),
/// its size capped at `cap` over that unit. `None`: no override, an unknown unit, or
/// zero requests (Envoy's config validation refuses both), counted as ignored.
fn override_limit(requests: u32, unit: i32, cap: Rate) -> Option<(EnvoyUnit, u64, Window, bool)> {
    use limiter_core::calendar::{Calendar, CalendarUnit, WeekStart};
    let unit = EnvoyUnit::try_from(unit).ok()?;
    let n = u64::from(requests);
    let fixed = |secs: u64| Window::Fixed(NonZeroU64::new(secs * NANOS_PER_SEC).expect("positive"));
    let calendar = |u| Calendar::try_new(u, 1, "UTC", WeekStart::Monday).ok().map(Window::Calendar);
    let window = match unit {
        EnvoyUnit::Unknown => return None,
        EnvoyUnit::Second => fixed(1),
        EnvoyUnit::Minute => fixed(60),
        EnvoyUnit::Hour => fixed(3_600),
        EnvoyUnit::Day => fixed(86_400),
        EnvoyUnit::Month => calendar(CalendarUnit::Month)?,
        EnvoyUnit::Year => calendar(CalendarUnit::Year)?,
    };
    if n == 0 {
        return None;
    }
    // The cap over the unit's typical length (a month as 30 days).
    let most = u128::from(cap.amount().get()) * u128::from(window.nominal())
        / u128::from(cap.period().get());
    let most = u64::try_from(most).unwrap_or(u64::MAX).max(1);
    Some((unit, n.min(most), window, n > most))
}

/// Descriptor overrides as limit rules, made once per size and unit (a bounded set:
/// past [`OVERRIDE_RULES`] distinct ones it starts afresh; a rule is only a limit,
/// counters do not live here).
#[derive(Debug, Default)]
struct OverrideRules(parking_lot::Mutex<HashMap<(u64, EnvoyUnit), Arc<LimitRule>>>);

/// The most override rules kept at once.
const OVERRIDE_RULES: usize = 4_096;

impl OverrideRules {
    fn rule(&self, n: u64, unit: EnvoyUnit, window: Window) -> Arc<LimitRule> {
        let mut rules = self.0.lock();
        if let Some(r) = rules.get(&(n, unit)) {
            return Arc::clone(r);
        }
        if rules.len() >= OVERRIDE_RULES {
            rules.clear();
        }
        let limit = Limit::FixedWindow(FixedWindow::with_window(
            NonZeroU64::new(n).expect("checked positive"),
            window,
        ));
        let rule = Arc::new(LimitRule {
            limit: Arc::new(limit),
            name: Arc::from(OVERRIDE_NAME),
            shares: None,
        });
        rules.insert((n, unit), Arc::clone(&rule));
        rule
    }
}

/// The name of a descriptor's own limit in headers and statuses.
const OVERRIDE_NAME: &str = "override";

/// Envoy's unit and amount closest to `quota` per `window`: exact when the window is
/// one unit, else the rate scaled to the smallest unit that gives at least one.
fn envoy_limit(quota: u64, window: Nanos) -> (u32, Unit) {
    const UNITS: [(Nanos, Unit); 5] = [
        (NANOS_PER_SEC, Unit::Second),
        (60 * NANOS_PER_SEC, Unit::Minute),
        (3_600 * NANOS_PER_SEC, Unit::Hour),
        (86_400 * NANOS_PER_SEC, Unit::Day),
        (7 * 86_400 * NANOS_PER_SEC, Unit::Week),
    ];
    let clamp = |v: u128| u32::try_from(v).unwrap_or(u32::MAX);
    if let Some((_, unit)) = UNITS.iter().find(|(n, _)| *n == window) {
        return (clamp(quota.into()), *unit);
    }
    for (n, unit) in UNITS {
        let per = u128::from(quota) * u128::from(n) / u128::from(window.max(1));
        if per >= 1 {
            return (clamp(per), unit);
        }
    }
    (1, Unit::Week)
}

/// What one descriptor reports: its limit, remaining units and wait.
fn status(o: &Outcome) -> (DescriptorStatus, Option<(String, Limit, u64, Nanos)>) {
    let name = o.limit_name.as_deref().unwrap_or("limit").to_owned();
    let (code, limit, remaining, wait) = match o.verdict.decision {
        Decision::Allowed { remaining, reset_after, binding } => {
            (Code::Ok, binding.map(|b| b.limit), remaining, reset_after)
        }
        Decision::Rejected { limit, retry_after, .. } => {
            let code = if o.verdict.shadow { Code::Ok } else { Code::OverLimit };
            (code, limit, 0, retry_after)
        }
    };
    let current_limit = limit.map(|l| {
        let (quota, window) = l.quota_at(o.charged_at.at);
        let (requests_per_unit, unit) = envoy_limit(quota, window);
        RateLimit { name: name.clone(), requests_per_unit, unit: unit.into() }
    });
    let st = DescriptorStatus {
        code: code.into(),
        current_limit,
        limit_remaining: u32::try_from(remaining).unwrap_or(u32::MAX),
        duration_until_reset: Some(duration(wait)),
        quota: None,
    };
    (st, limit.map(|l| (name, l, remaining, wait)))
}

fn header(key: &str, value: String) -> HeaderValue {
    HeaderValue { key: key.to_owned(), value, raw_value: Vec::new() }
}

/// The answer to a decided call, with the IETF `RateLimit` / `RateLimit-Policy` fields,
/// `Retry-After` and our reason when over limit. In a rejected call the `RateLimit`
/// items of rejected descriptors come first, with `r=0`; a passing descriptor's item
/// shows what is really left (nothing was charged).
fn answer(outcomes: &[Outcome], detail: Option<&str>) -> rls::RateLimitResponse {
    let mut statuses = Vec::with_capacity(outcomes.len());
    // (policy item, limit item, over) per distinct limit.
    let mut items: Vec<(String, String, bool)> = Vec::new();
    let mut retry: Option<Nanos> = None;
    let mut reason = None;
    for o in outcomes {
        let (st, limit) = status(o);
        let over = st.code == i32::from(Code::OverLimit);
        statuses.push(st);
        if let Some((name, l, remaining, wait)) = limit {
            let (q, w) = l.quota_at(o.charged_at.at);
            let policy = headers::policy_item(&name, q, w);
            let item = headers::limit_item(&name, remaining, wait);
            match items.iter_mut().find(|(p, _, _)| *p == policy) {
                None => items.push((policy, item, over)),
                Some(existing) if over && !existing.2 => *existing = (policy, item, over),
                Some(_) => {}
            }
            if over {
                retry = Some(retry.unwrap_or(0).max(wait));
            }
        }
        if over && reason.is_none() {
            reason = o.verdict.decision.reason();
        }
    }
    let over = statuses.iter().any(|s| s.code == i32::from(Code::OverLimit));
    // Rejected limits first: a client reading the first item sees why.
    items.sort_by_key(|(_, _, o)| !*o);
    let mut fields = Vec::with_capacity(if over { 5 } else { 2 });
    if let [_] = items.as_slice()
        && let Some((policy, item, _)) = items.pop()
    {
        // One limit (the common call): its items are the fields, with no joining.
        fields.push(header("RateLimit-Policy", policy));
        fields.push(header("RateLimit", item));
    } else if !items.is_empty() {
        let join = |pick: fn(&(String, String, bool)) -> &str| {
            items.iter().map(pick).collect::<Vec<_>>().join(", ")
        };
        fields.push(header("RateLimit-Policy", join(|i| &i.0)));
        fields.push(header("RateLimit", join(|i| &i.1)));
    }
    if over {
        fields.push(header("Retry-After", headers::retry_after(retry.unwrap_or(0))));
        if let Some(r) = reason {
            fields.push(header(headers::REASON_HEADER, r.as_str().to_owned()));
        }
        if let Some(d) = detail {
            fields.push(header(DETAIL_HEADER, d.to_owned()));
        }
    }
    rls::RateLimitResponse {
        overall_code: if over { Code::OverLimit } else { Code::Ok }.into(),
        statuses,
        response_headers_to_add: fields,
        ..Default::default()
    }
}

/// Why a descriptor that can never be admitted was refused, in words.
pub const DETAIL_HEADER: &str = "x-ratelimit-detail";

/// A descriptor that can never be decided as sent, answered as over its limit.
struct Refused {
    index: usize,
    outcome: Outcome,
    detail: String,
}

/// The over-limit answer for request `i` of `core`, when deciding it failed in a way
/// its caller chose (a cost above a level's capacity, a new key beyond the tenant's
/// cap); `None` for any other error.
fn refused(
    owner: &Owner,
    core: &[Request<'_>],
    extra: &[Option<Extra<'_>>],
    i: usize,
    e: &ServerError,
) -> Option<Refused> {
    let req = core.get(i)?;
    let active = owner.policies().current();
    let probe = Request { cost: Some(1), dry_run: true, ..*req };
    let mut chain = active.policy.resolve(&probe, &owner.limits().names).ok()?;
    if let Some(Some(x)) = extra.get(i) {
        chain = chain.with_level(x.scope, x.budget, x.rule).ok()?;
    }
    let (scope, capacity, detail) = match e {
        ServerError::Request(RequestError::CostAboveLimit { scope, capacity, .. }) => {
            (*scope, Some(*capacity), limiter_core::text::shorten(&e.to_string()).into_owned())
        }
        ServerError::Exhausted(why) => {
            (Scope::Key, None, limiter_core::text::shorten_message(why).into_owned())
        }
        _ => return None,
    };
    // Among a level's budgets, the one whose capacity the cost exceeded.
    let level = chain
        .levels()
        .find(|l| l.scope == scope && capacity.is_none_or(|c| l.rule.limit.capacity() == c))?;
    let limit = *level.rule.limit;
    let now = owner.clock().now();
    let decision = Decision::Rejected {
        reason: scope.reason(),
        scope,
        limit: Some(limit),
        // It will not fit later either; a client is told to wait a whole window.
        retry_after: limit.quota_at(now).1,
    };
    Some(Refused {
        index: i,
        outcome: Outcome::refused(
            Verdict { decision, shadow: chain.shadow },
            level.rule.name.clone(),
            active.version,
            now,
        ),
        detail,
    })
}

#[tonic::async_trait]
impl RateLimitService for EnvoyService {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<rls::RateLimitRequest>,
    ) -> Result<Response<rls::RateLimitResponse>, Status> {
        let hop = crate::cluster::peers::checked_hop(&request, self.owner.shared().is_some())?;
        let req = request.into_inner();
        let refuse = |e: ServerError| -> Status {
            crate::metrics::count_invalid(Api::Envoy, e.field());
            e.into()
        };
        let max = self.owner.limits().max_descriptors;
        let names = &self.owner.limits().names;
        if req.descriptors.is_empty() {
            return Err(refuse(ServerError::invalid(
                "descriptors",
                "at least one descriptor is required",
            )));
        }
        if req.descriptors.len() > max {
            return Err(refuse(ServerError::TooLarge {
                what: "descriptors",
                got: req.descriptors.len(),
                max,
            }));
        }
        let mapped = req
            .descriptors
            .iter()
            .enumerate()
            .map(|(i, d)| map(&self.mapping, names, &req.domain, i, d, req.hits_addend))
            .collect::<Result<Vec<_>, _>>()
            .map_err(refuse)?;
        let core: Vec<Request<'_>> = mapped
            .iter()
            .map(|m| Request {
                tenant: &m.tenant,
                route: &m.route,
                key: m.key.as_deref(),
                cost: Some(m.cost),
                dry_run: m.dry_run,
            })
            .collect();
        let span = crate::trace::span!(
            "decide",
            api = "envoy",
            tenant = %crate::trace::short(core.first().map_or("", |r| r.tenant)),
            route = %crate::trace::short(core.first().map_or("", |r| r.route)),
            descriptors = core.len(),
        );
        async {
            // One HTTP request: all its descriptors are decided together, by the owner of
            // the first one's tenant (with `tenant_from: domain`, the only tenant).
            let mut unreachable = false;
            // Not empty: checked above.
            let first_tenant = core.first().map_or("", |r| r.tenant);
            if let Some(cluster) = self.owner.cluster() {
                match crate::api::routing::target(cluster, first_tenant, hop).await {
                    Some(Err(owner)) => return Err(crate::cluster::peers::moved(&owner.address)),
                    Some(Ok(owner)) => {
                        let call = |peer: crate::cluster::peers::Peer, hop| {
                            let req = req.clone();
                            async move { peer.should_rate_limit(req, hop).await }
                        };
                        match crate::api::routing::forward_once(cluster, &owner, first_tenant, call)
                            .await
                        {
                            Ok(Some(answer)) => return Ok(Response::new(answer)),
                            Ok(None) => {}
                            // No owner answered: the routes' failure policies decide here.
                            Err(_) => unreachable = true,
                        }
                    }
                    None => {}
                }
            }
            let rules = self.override_rules(&mapped);
            self.decide(&core, &extras(&rules), unreachable).await.map(Response::new)
        }
        .instrument(span)
        .await
    }
}

impl EnvoyService {
    /// Decides the descriptors of one call. A descriptor whose cost can never fit, or
    /// whose key the tenant has no room for, is answered `OVER_LIMIT` with its reason
    /// (an error would be a free pass: Envoy fails open by default); the others are
    /// then checked without a charge, so the answer shows what is left for them.
    async fn decide(
        &self,
        core: &[Request<'_>],
        extra: &[Option<Extra<'_>>],
        unreachable: bool,
    ) -> Result<rls::RateLimitResponse, Status> {
        let reach = Reach::of(unreachable);
        let first = self
            .owner
            .decide_with_extra(Api::Envoy, core, extra, Charge::AllOrNothing, Report::Now, reach)
            .await;
        let (i, e) = match first {
            Ok(outcomes) => return Ok(answer(&outcomes, None)),
            Err(failed) => failed,
        };
        let mut refusals = Vec::new();
        let mut failure = Some((i, e));
        // Each pass turns at most one more descriptor into a refusal.
        for _ in 0..core.len() {
            let Some((i, e)) = failure.take() else { break };
            let Some(r) = refused(&self.owner, core, extra, i, &e) else {
                return Err(crate::error::element_status(Api::Envoy, "descriptors", i, e));
            };
            crate::metrics::count_invalid(Api::Envoy, e.field());
            refusals.push(r);
            let rest: Vec<(usize, Request<'_>)> = core
                .iter()
                .enumerate()
                .filter(|(j, _)| refusals.iter().all(|r| r.index != *j))
                .map(|(j, r)| {
                    (j, Request { dry_run: true, cost: Some(r.cost.unwrap_or(1).max(1)), ..*r })
                })
                .collect();
            let checks: Vec<Request<'_>> = rest.iter().map(|(_, r)| *r).collect();
            let check_extra: Vec<Option<Extra<'_>>> =
                rest.iter().map(|(j, _)| extra.get(*j).copied().flatten()).collect();
            match self
                .owner
                .decide_with_extra(
                    Api::Envoy,
                    &checks,
                    &check_extra,
                    Charge::Each,
                    Report::Now,
                    reach,
                )
                .await
            {
                Ok(outcomes) => {
                    let mut all: Vec<(usize, Outcome)> =
                        rest.iter().map(|(j, _)| *j).zip(outcomes).collect();
                    let detail = refusals.first().map(|r| r.detail.clone());
                    all.extend(refusals.into_iter().map(|r| (r.index, r.outcome)));
                    all.sort_by_key(|(j, _)| *j);
                    let outcomes: Vec<Outcome> = all.into_iter().map(|(_, o)| o).collect();
                    return Ok(answer(&outcomes, detail.as_deref()));
                }
                Err((k, e)) => failure = Some((rest.get(k).map_or(k, |(j, _)| *j), e)),
            }
        }
        Err(Status::internal("descriptors: could not be decided"))
    }
}

#[cfg(test)]
mod tests;
