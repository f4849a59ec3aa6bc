//! The hierarchy: all-or-nothing charging, the outermost failing scope, the longest
//! retry, unknown tenants, shadow mode, dry runs, and request errors.

use limiter_core::clock::NANOS_PER_SEC;
use limiter_core::policy::{NameBounds, Policy, Request, from_yaml};
use limiter_core::{Decision, Limiter, Reason, RequestError, Scope};
use proptest::prelude::*;

const POLICY: &str = r"
version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100/s, burst: 100 }
routes:
  /r:
    limit: { algorithm: fixed_window, limit: 50, window: 1s }
  /shadowed:
    shadow: true
tenants:
  t:
    limit: { algorithm: sliding_log, limit: 20, window: 1s }
    routes:
      /r: { algorithm: sliding_counter, limit: 10, window: 1s }
    per_key: { algorithm: token_bucket, rate: 5/s, burst: 5 }
";

fn policy(text: &str) -> Policy {
    from_yaml(text, "test.yaml").unwrap()
}

fn decide(l: &Limiter, p: &Policy, req: Request<'_>, now: u64) -> Decision {
    let chain = p.resolve(&req, &NameBounds::default()).unwrap();
    l.decide(&chain, now).decision
}

/// Policy text with the limit of `scope` set to capacity `cap` (others roomy).
fn tight(scope: Scope, cap: u64) -> String {
    let lim = |s: Scope, roomy: u64| if s == scope { cap } else { roomy };
    format!(
        "version: 1
global: {{ ceiling: {{ algorithm: fixed_window, limit: {}, window: 10s }} }}
routes: {{ /r: {{ limit: {{ algorithm: sliding_log, limit: {}, window: 10s }} }} }}
tenants:
  t:
    limit: {{ algorithm: token_bucket, rate: {}/10s }}
    routes: {{ /r: {{ algorithm: sliding_counter, limit: {}, window: 10s }} }}
    per_key: {{ algorithm: fixed_window, limit: {}, window: 10s }}
",
        lim(Scope::Global, 1000),
        lim(Scope::Route, 1000),
        lim(Scope::Tenant, 1000),
        lim(Scope::TenantRoute, 1000),
        lim(Scope::Key, 1000),
    )
}

#[test]
fn a_rejection_at_any_level_charges_no_level() {
    for scope in Scope::ALL {
        let p = policy(&tight(scope, 3));
        let l = Limiter::new(1_000);
        let req = Request::new("t", "/r").with_key("k");
        for _ in 0..3 {
            assert!(decide(&l, &p, req, 0).is_allowed());
        }
        let chain = p.resolve(&req, &NameBounds::default()).unwrap();
        let before = l.inspect(&chain, 0);
        assert_eq!(before.len(), 5);
        match decide(&l, &p, req, 0) {
            Decision::Rejected { reason, scope: s, .. } => {
                assert_eq!(s, scope);
                assert_eq!(reason, scope.reason());
            }
            d @ Decision::Allowed { .. } => panic!("{scope}: {d:?}"),
        }
        assert_eq!(l.inspect(&chain, 0), before, "{scope}: a rejection changed state");
    }
}

#[test]
fn scope_is_the_outermost_failure_and_retry_the_longest_wait() {
    let p = policy(POLICY);
    let l = Limiter::new(1_000);
    // The tenant x route level (10/s sliding counter) fails first.
    for _ in 0..10 {
        assert!(decide(&l, &p, Request::new("t", "/r"), 0).is_allowed());
    }
    // Exhaust the tenant level (20 per second, sliding log) on another route.
    for _ in 0..10 {
        assert!(decide(&l, &p, Request::new("t", "/other"), 0).is_allowed());
    }
    match decide(&l, &p, Request::new("t", "/r"), 500_000_000) {
        Decision::Rejected { reason, scope, retry_after, limit } => {
            assert_eq!(scope, Scope::Tenant, "outermost failing level");
            assert_eq!(reason, Reason::TenantLimit);
            assert!(limit.is_some());
            // Tenant (sliding log) frees at 1 s; tenant x route (sliding counter with
            // 10 in the previous window) needs 10*(1-e) <= 9, e >= 0.1 s into the next
            // window: 1.1 s. The longer wait, 0.6 s from now, wins.
            assert_eq!(retry_after, 600_000_000);
        }
        d @ Decision::Allowed { .. } => panic!("{d:?}"),
    }
    assert!(decide(&l, &p, Request::new("t", "/r"), 1_100_000_000 - 1).reason().is_some());
    assert!(decide(&l, &p, Request::new("t", "/r"), 1_100_000_000).is_allowed());
}

#[test]
fn allowed_reports_the_tightest_level() {
    let p = policy(POLICY);
    let l = Limiter::new(1_000);
    match decide(&l, &p, Request::new("t", "/r").with_key("k").with_cost(2), 0) {
        Decision::Allowed { remaining, binding, reset_after } => {
            assert_eq!(remaining, 3, "the key bucket holds 5");
            assert_eq!(binding.unwrap().scope, Scope::Key);
            // Two tokens at 5/s refill in 400 ms.
            assert_eq!(reset_after, 400_000_000);
        }
        d @ Decision::Rejected { .. } => panic!("{d:?}"),
    }
}

#[test]
fn unknown_tenants_follow_the_explicit_rule() {
    let reject = policy(
        "version: 1\ntenants:\n  a:\n    limit: { algorithm: fixed_window, limit: 1, window: 1s }\n",
    );
    let l = Limiter::new(100);
    assert_eq!(
        decide(&l, &reject, Request::new("b", "/r"), 0).reason(),
        Some(Reason::UnknownTenant)
    );

    let dflt = policy(
        "version: 1\ntenants:\n  default:\n    limit: { algorithm: fixed_window, limit: 1, window: 1s }\n",
    );
    // Each unknown tenant gets its own counter under the default limits.
    assert!(decide(&l, &dflt, Request::new("x", "/r"), 0).is_allowed());
    assert!(decide(&l, &dflt, Request::new("y", "/r"), 0).is_allowed());
    assert_eq!(decide(&l, &dflt, Request::new("x", "/r"), 0).reason(), Some(Reason::TenantLimit));
}

#[test]
fn shadow_mode_admits_but_reports_the_rejection_and_charges_nothing_extra() {
    let p = policy(
        "version: 1\nroutes: { /s: { shadow: true } }\ntenants:\n  t:\n    limit: { algorithm: fixed_window, limit: 1, window: 1s }\n",
    );
    let l = Limiter::new(100);
    let chain = p.resolve(&Request::new("t", "/s"), &NameBounds::default()).unwrap();
    assert!(l.decide(&chain, 0).admitted());
    let v = l.decide(&chain, 0);
    assert!(v.admitted() && v.shadow);
    assert_eq!(v.decision.reason(), Some(Reason::TenantLimit));
    // Another route is enforced, and sees the one unit the shadowed route charged.
    assert_eq!(decide(&l, &p, Request::new("t", "/x"), 0).reason(), Some(Reason::TenantLimit));
}

#[test]
fn dry_runs_check_without_charging() {
    let p = policy(POLICY);
    let l = Limiter::new(100);
    for _ in 0..20 {
        assert!(
            decide(&l, &p, Request::new("t", "/r").with_cost(5).with_dry_run(true), 0).is_allowed()
        );
    }
    // Cost 0 in a dry run is a plain look at the remaining units.
    match decide(&l, &p, Request::new("t", "/r").with_cost(0).with_dry_run(true), 0) {
        Decision::Allowed { remaining, .. } => assert_eq!(remaining, 10),
        d @ Decision::Rejected { .. } => panic!("{d:?}"),
    }
}

#[test]
fn requests_that_can_never_succeed_are_errors() {
    let p = policy(POLICY);
    let b = NameBounds { tenant: 8, route: 8, key: 8 };
    let e = |r: Request<'_>| p.resolve(&r, &b).unwrap_err();
    assert_eq!(e(Request::new("", "/r")), RequestError::EmptyName { field: "tenant" });
    assert_eq!(e(Request::new("t", "")), RequestError::EmptyName { field: "route" });
    assert_eq!(
        e(Request::new("tenant-too-long", "/r")),
        RequestError::NameTooLong { field: "tenant", len: 15, max: 8 }
    );
    assert_eq!(
        e(Request::new("t", "/r").with_key("k\n")),
        RequestError::ControlCharacter { field: "key" }
    );
    assert_eq!(e(Request::new("t", "/r").with_cost(0)), RequestError::ZeroCost);
    assert_eq!(
        e(Request::new("t", "/r").with_cost(11)),
        RequestError::CostAboveLimit { cost: 11, scope: Scope::TenantRoute, capacity: 10 }
    );
    assert_eq!(e(Request::new("t", "/r").with_cost(11)).field(), "cost");
}

#[test]
fn reconcile_charges_or_refunds_the_difference() {
    let p = policy(POLICY);
    let l = Limiter::new(100);
    let chain = p.resolve(&Request::new("t", "/r").with_cost(4), &NameBounds::default()).unwrap();
    assert!(l.decide(&chain, 0).admitted());
    let remaining =
        |l: &Limiter| l.inspect(&chain, 0).iter().map(|v| v.remaining).collect::<Vec<_>>();
    assert_eq!(remaining(&l), vec![96, 46, 16, 6]);
    // Actual 1: three units come back on every level.
    l.reconcile(&chain, 0, 0, 4, 1);
    assert_eq!(remaining(&l), vec![99, 49, 19, 9]);
    // Actual 25 on a later estimate of 4: 21 more, past the tenant x route limit: a debt.
    assert!(l.decide(&chain, 0).admitted());
    l.reconcile(&chain, 0, 0, 4, 25);
    assert_eq!(remaining(&l), vec![74, 24, 0, 0]);
    assert!(!l.decide(&chain, NANOS_PER_SEC / 2).admitted());
}

#[test]
fn grants_take_the_same_units_from_every_level() {
    let p = policy(POLICY);
    let l = Limiter::new(100);
    let chain = p.resolve(&Request::new("t", "/r").with_key("k"), &NameBounds::default()).unwrap();
    let g = l.grant(&chain, 0, 100, 0);
    assert_eq!((g.units, g.binding), (5, Some(Scope::Key)));
    let left: Vec<u64> = l.inspect(&chain, 0).iter().map(|v| v.remaining).collect();
    assert_eq!(left, vec![95, 45, 15, 5, 0]);
    l.refund(&chain, 0, g.granted_at, 5);
    let left: Vec<u64> = l.inspect(&chain, 0).iter().map(|v| v.remaining).collect();
    assert_eq!(left, vec![100, 50, 20, 10, 5]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Any mix of requests: a rejection changes no level; an admission charges every
    /// level by exactly its cost.
    #[test]
    fn all_or_nothing_over_random_traffic(
        reqs in prop::collection::vec((0usize..2, 0usize..3, 0usize..3, 1u64..5, 0u64..50_000_000), 1..150)
    ) {
        let p = policy(POLICY);
        let l = Limiter::new(1_000);
        let tenants = ["t", "u"];
        let routes = ["/r", "/x", "/shadowed"];
        let keys = ["a", "b", "c"];
        let mut now = 0;
        for (t, r, k, cost, dt) in reqs {
            now += dt;
            let req = Request::new(tenants[t], routes[r]).with_key(keys[k]).with_cost(cost);
            let Ok(chain) = p.resolve(&req, &NameBounds::default()) else { continue };
            let before = l.inspect(&chain, now);
            let v = l.decide(&chain, now);
            let after = l.inspect(&chain, now);
            if v.decision.is_allowed() {
                for (b, a) in before.iter().zip(&after) {
                    prop_assert_eq!(a.remaining, b.remaining - cost);
                }
            } else {
                prop_assert_eq!(before, after);
            }
        }
    }
}

/// A full table evicts the least recently used counters. A tenant that is exhausted
/// and keeps being refused is in use: a flood of new tenants must not evict its
/// counter, which would give it a fresh allowance.
#[test]
fn a_refused_tenant_is_not_evicted_by_a_flood_of_new_ones() {
    let p = policy(
        "
version: 1
unknown_tenants: use_default
routes: { /r: {} }
tenants:
  hot:
    limit: { algorithm: fixed_window, limit: 3, window: 1h }
  default:
    limit: { algorithm: fixed_window, limit: 5, window: 1h }
",
    );
    let l = Limiter::new(256);
    let hour = 3_600 * NANOS_PER_SEC;
    let mut admitted = 0;
    let names: Vec<String> = (0..20_000).map(|i| format!("flood-{i}")).collect();
    for (i, name) in names.iter().enumerate() {
        let now = hour + i as u64 * 1_000;
        assert!(decide(&l, &p, Request::new(name, "/r"), now).is_allowed());
        if i % 4 == 0 {
            admitted += u64::from(decide(&l, &p, Request::new("hot", "/r"), now).is_allowed());
        }
    }
    assert!(l.table().stats().evicted_live > 10_000);
    assert_eq!(admitted, 3, "the hot tenant's counter was evicted and reset");
}

/// Several budgets on one level: each is its own counter, all are charged or none,
/// and a refusal names the budget that refused.
#[test]
fn budgets_on_one_level_are_each_charged_and_a_refusal_names_its_budget() {
    let p = policy(
        "version: 1
tenants:
  t:
    limit:
      - { name: per_minute, algorithm: fixed_window, limit: 10, window: 1m }
      - { name: per_day, algorithm: fixed_window, limit: 25, window: 1d, align: calendar }
    per_key:
      - { algorithm: token_bucket, rate: 100/s, burst: 100 }
      - { algorithm: sliding_log, limit: 7, window: 10s }
",
    );
    let l = Limiter::new(1_000);
    let t0 = 1_800_000_000 * NANOS_PER_SEC; // 2027-01-15T08:00Z
    let names = NameBounds::default();
    let chain = p.resolve(&Request::new("t", "/r").with_key("k").with_cost(1), &names).unwrap();
    let budgets: Vec<(Scope, u8, &str)> =
        chain.levels().map(|l| (l.scope, l.key.budget, &*l.rule.name)).collect();
    assert_eq!(
        budgets,
        [
            (Scope::Tenant, 0, "per_minute"),
            (Scope::Tenant, 1, "per_day"),
            (Scope::Key, 0, "key_1"),
            (Scope::Key, 1, "key_2"),
        ]
    );
    // The key's log (7 in 10 s) refuses first; nothing is charged on the others then.
    let ask =
        |key, cost, at| decide(&l, &p, Request::new("t", "/r").with_key(key).with_cost(cost), at);
    assert!(ask("k", 7, t0).is_allowed());
    let refused = ask("k", 1, t0);
    assert!(matches!(refused, Decision::Rejected { scope: Scope::Key, .. }), "{refused:?}");
    let chain = p.resolve(&Request::new("t", "/r").with_key("k"), &names).unwrap();
    let Decision::Rejected { scope, limit, .. } = refused else { unreachable!() };
    assert_eq!(&*chain.level_named(scope, limit.as_ref()).unwrap().rule.name, "key_2");
    // The minute's 10 (3 left) then the day's 25 across minutes.
    assert!(ask("k2", 3, t0).is_allowed());
    let minute = ask("k3", 1, t0);
    let Decision::Rejected { scope, limit, .. } = minute else { panic!("{minute:?}") };
    assert_eq!(
        (scope, &*chain.level_named(scope, limit.as_ref()).unwrap().rule.name),
        (Scope::Tenant, "per_minute")
    );
    let later = t0 + 60 * NANOS_PER_SEC;
    assert!(ask("k4", 7, later).is_allowed());
    assert!(ask("k5", 3, later).is_allowed());
    let day = ask("k6", 7, later + 60 * NANOS_PER_SEC);
    let Decision::Rejected { scope, limit, .. } = day else { panic!("{day:?}") };
    // 10 + 10 of the day's 25: 5 left, so 7 is refused by the day alone.
    assert_eq!(
        (scope, &*chain.level_named(scope, limit.as_ref()).unwrap().rule.name),
        (Scope::Tenant, "per_day")
    );
    assert!(ask("k6", 5, later + 60 * NANOS_PER_SEC).is_allowed());
}

/// Callers read the clock before they reach a key, so a decision may land after a
/// later one: one read just before a window's start, arriving after the window has
/// filled, is refused, and the window stays full (it used to start afresh).
#[test]
fn a_decision_landing_late_across_a_window_start_starts_nothing_afresh() {
    for algorithm in ["fixed_window", "sliding_counter"] {
        let p = policy(&format!(
            "version: 1\ntenants:\n  t:\n    routes:\n      /r: {{ algorithm: {algorithm}, limit: 10, window: 1s }}\n"
        ));
        let l = Limiter::new(1_000);
        let second = NANOS_PER_SEC;
        // The first window is empty: the second one's full limit is admitted.
        for i in 0..10 {
            assert!(decide(&l, &p, Request::new("t", "/r"), second + i).is_allowed());
        }
        // Read at the last nanosecond of the first window, decided after those.
        assert!(
            !decide(&l, &p, Request::new("t", "/r"), second - 1).is_allowed(),
            "{algorithm}: the late decision sees the full window"
        );
        let later: usize = (0..10)
            .filter(|i| {
                decide(&l, &p, Request::new("t", "/r"), second + second / 2 + i).is_allowed()
            })
            .count();
        assert_eq!(later, 0, "{algorithm}: the window kept its count");
    }
}
