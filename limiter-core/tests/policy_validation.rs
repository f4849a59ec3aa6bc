//! Policy validation: every mistake is reported with file, line and field, all at
//! once; the shipped example loads and uses every algorithm and every level.

use limiter_core::policy::{NameBounds, PolicyError, Request, UnknownTenants, from_yaml};
use limiter_core::{AlgorithmKind, Limiter, Scope};

/// Loads `text`, expecting failure, and returns its errors.
fn errors(text: &str) -> Vec<PolicyError> {
    match from_yaml(text, "policies.yaml") {
        Ok(_) => panic!("accepted:\n{text}"),
        Err(e) => e.0,
    }
}

/// Asserts exactly one error, at `line`, on `field`, whose message contains `needle`.
#[track_caller]
fn one(text: &str, line: u64, field: &str, needle: &str) {
    let errs = errors(text);
    assert_eq!(errs.len(), 1, "{errs:#?}");
    let e = &errs[0];
    assert_eq!(e.file, "policies.yaml");
    assert_eq!((e.pos.line, e.field.as_str()), (line, field), "{e}");
    assert!(e.message.contains(needle), "`{}` lacks `{needle}`", e.message);
    let shown = e.to_string();
    assert!(shown.starts_with(&format!("policies.yaml:{line}:")), "{shown}");
    assert!(shown.contains(field), "{shown}");
}

const HEAD: &str = "version: 1\ntenants:\n  acme:\n";

#[test]
fn unknown_field() {
    one(
        &format!("{HEAD}    limt: {{ algorithm: token_bucket, rate: 1/s }}\n"),
        4,
        "tenants.acme.limt",
        "unknown field `limt`",
    );
}

#[test]
fn unknown_field_inside_a_limit() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: token_bucket, rate: 1/s, brust: 5 }}\n"),
        4,
        "tenants.acme.limit.brust",
        "unknown field",
    );
}

#[test]
fn zero_rate() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: token_bucket, rate: 0/s }}\n"),
        4,
        "tenants.acme.limit.rate",
        "greater than zero",
    );
}

#[test]
fn negative_limit() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: fixed_window, limit: -5, window: 1s }}\n"),
        4,
        "tenants.acme.limit.limit",
        "greater than zero",
    );
}

#[test]
fn zero_burst() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: token_bucket, rate: 5/s, burst: 0 }}\n"),
        4,
        "tenants.acme.limit.burst",
        "greater than zero",
    );
}

#[test]
fn malformed_duration() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: sliding_log, limit: 5, window: 10 parsecs }}\n"),
        4,
        "tenants.acme.limit.window",
        "duration",
    );
}

#[test]
fn duration_without_a_unit() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: sliding_log, limit: 5, window: 10 }}\n"),
        4,
        "tenants.acme.limit.window",
        "needs a unit",
    );
}

#[test]
fn zero_window() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: fixed_window, limit: 5, window: 0s }}\n"),
        4,
        "tenants.acme.limit.window",
        "greater than zero",
    );
}

#[test]
fn malformed_rate() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: token_bucket, rate: 100 per second }}\n"),
        4,
        "tenants.acme.limit.rate",
        "rate like",
    );
}

#[test]
fn unknown_algorithm() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: leaky_bucket, rate: 1/s }}\n"),
        4,
        "tenants.acme.limit.algorithm",
        "unknown algorithm `leaky_bucket`",
    );
}

#[test]
fn missing_algorithm() {
    one(
        &format!("{HEAD}    limit: {{ limit: 5, window: 1s }}\n"),
        4,
        "tenants.acme.limit.algorithm",
        "missing required field",
    );
}

#[test]
fn field_of_another_algorithm() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: token_bucket, rate: 5/s, window: 1s }}\n"),
        4,
        "tenants.acme.limit.window",
        "does not apply to token_bucket",
    );
}

#[test]
fn duplicate_route() {
    let text = "version: 1\nroutes:\n  /a: { cost: 1 }\n  /b: { cost: 2 }\n  /a: { cost: 3 }\n";
    one(text, 5, "routes./a", "duplicate name `/a` (first defined at line 3)");
}

#[test]
fn duplicate_tenant() {
    let text = "version: 1\ntenants:\n  a: {}\n  a: {}\n";
    one(text, 4, "tenants.a", "duplicate name");
}

#[test]
fn cost_above_the_limit_it_is_charged_against() {
    let text = "version: 1
routes:
  /export:
    cost: 50
tenants:
  acme:
    limit: { algorithm: fixed_window, limit: 10, window: 1m }
";
    one(
        text,
        4,
        "routes./export.cost",
        "cost 50 can never be admitted: the tenant limit of tenant `acme` holds at most 10",
    );
}

#[test]
fn tenant_route_cost_above_its_own_limit() {
    let text = format!(
        "{HEAD}    routes:\n      /x: {{ algorithm: fixed_window, limit: 10, window: 1m, cost: 11 }}\n"
    );
    one(&text, 5, "tenants.acme.routes./x.cost", "holds at most 10");
}

#[test]
fn zero_cost() {
    one("version: 1\nroutes:\n  /a: { cost: 0 }\n", 3, "routes./a.cost", "greater than zero");
}

#[test]
fn wrong_type() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: fixed_window, limit: lots, window: 1s }}\n"),
        4,
        "tenants.acme.limit.limit",
        "expected a positive integer, found a string",
    );
}

#[test]
fn fail_open_without_an_emergency_ceiling() {
    one(
        "version: 1\nroutes:\n  /a:\n    on_limiter_failure: { mode: fail_open }\n",
        4,
        "routes./a.on_limiter_failure.emergency_ceiling",
        "needs an `emergency_ceiling`",
    );
}

#[test]
fn unknown_failure_mode() {
    one(
        "version: 1\non_limiter_failure: { mode: fail_sideways }\n",
        2,
        "on_limiter_failure.mode",
        "expected `fail_open` or `fail_closed`",
    );
}

#[test]
fn unsupported_version() {
    one("version: 2\n", 1, "version", "unsupported policy version 2");
}

#[test]
fn missing_version() {
    let errs = errors("tenants: {}\n");
    assert_eq!(errs[0].field, "version");
}

#[test]
fn use_default_without_a_default_tenant() {
    one(
        "version: 1\nunknown_tenants: use_default\ntenants:\n  a: {}\n",
        2,
        "unknown_tenants",
        "needs a tenant named `default`",
    );
}

#[test]
fn sliding_log_limit_bounded_for_memory() {
    one(
        &format!("{HEAD}    limit: {{ algorithm: sliding_log, limit: 10000000, window: 1s }}\n"),
        4,
        "tenants.acme.limit.limit",
        "at most 100000",
    );
}

#[test]
fn invalid_yaml_names_the_line() {
    let errs = errors("version: 1\ntenants:\n  acme: { limit: [1, 2\n");
    assert_eq!(errs.len(), 1);
    assert!(errs[0].message.starts_with("invalid YAML"), "{}", errs[0]);
    assert!(errs[0].pos.line >= 3, "{}", errs[0]);
}

#[test]
fn every_mistake_is_reported_at_once_in_file_order() {
    let text = "version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 0/s }
routes:
  /a: { cost: 0, colour: blue }
tenants:
  acme:
    limit: { algorithm: leaky_bucket }
    per_key: { algorithm: sliding_log, limit: 5, window: 5 minutes }
";
    let errs = errors(text);
    let got: Vec<(u64, &str)> = errs.iter().map(|e| (e.pos.line, e.field.as_str())).collect();
    assert_eq!(
        got,
        vec![
            (3, "global.ceiling.rate"),
            (5, "routes./a.cost"),
            (5, "routes./a.colour"),
            (8, "tenants.acme.limit.algorithm"),
            (9, "tenants.acme.per_key.window"),
        ],
        "{errs:#?}"
    );
}

#[test]
fn the_shipped_example_loads_and_uses_every_algorithm_and_level() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies.yaml");
    let text = std::fs::read_to_string(path).unwrap();
    let p = from_yaml(&text, "examples/policies.yaml").unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(p.unknown_tenants, UnknownTenants::UseDefault);
    let mut kinds = Vec::new();
    let mut scopes = Vec::new();
    let limiter = Limiter::new(1_000);
    for (tenant, route) in [
        ("acme", "/search"),
        ("acme", "/export"),
        ("acme", "/payments"),
        ("globex", "/payments"),
        ("someone", "/search"),
    ] {
        let chain =
            p.resolve(&Request::new(tenant, route).with_key("k"), &NameBounds::default()).unwrap();
        for l in chain.levels() {
            kinds.push(l.rule.limit.kind());
            scopes.push(l.scope);
        }
        assert!(limiter.decide(&chain, 0).admitted(), "{tenant} {route}");
    }
    for k in AlgorithmKind::ALL {
        assert!(kinds.contains(&k), "{} unused", k.as_str());
    }
    for s in Scope::ALL {
        assert!(scopes.contains(&s), "{s} unused");
    }
}

#[test]
fn calendar_window_mistakes_name_their_field() {
    let fw = "algorithm: fixed_window, limit: 10";
    one(
        &format!("{HEAD}    limit: {{ {fw}, window: 1mo }}\n"),
        4,
        "tenants.acme.limit.window",
        "add `align: calendar`",
    );
    one(
        &format!(
            "{HEAD}    limit: {{ {fw}, window: 1d, align: calendar, timezone: Mars/Olympus }}\n"
        ),
        4,
        "tenants.acme.limit.timezone",
        "unknown timezone",
    );
    one(
        &format!("{HEAD}    limit: {{ {fw}, window: 1h, align: calendar }}\n"),
        4,
        "tenants.acme.limit.window",
        "expected a calendar window",
    );
    one(
        &format!("{HEAD}    limit: {{ {fw}, window: 13mo, align: calendar }}\n"),
        4,
        "tenants.acme.limit.window",
        "1 to 12 mo units",
    );
    one(
        &format!("{HEAD}    limit: {{ {fw}, window: 1d, align: calendar, week_start: sunday }}\n"),
        4,
        "tenants.acme.limit.week_start",
        "applies to weekly windows",
    );
    one(
        &format!("{HEAD}    limit: {{ {fw}, window: 1d, timezone: UTC }}\n"),
        4,
        "tenants.acme.limit.timezone",
        "needs `align: calendar`",
    );
    one(
        &format!(
            "{HEAD}    limit: {{ algorithm: sliding_log, limit: 5, window: 1d, align: calendar }}\n"
        ),
        4,
        "tenants.acme.limit.align",
        "does not apply to sliding_log",
    );
    // Accepted: a weekly window from Sunday, a quarter, a day in a 30-minute zone;
    // `7d` without `align` stays a fixed duration.
    for window in [
        "1w, align: calendar, week_start: sunday",
        "3mo, align: calendar, timezone: Australia/Adelaide",
        "1y, align: calendar",
        "7d",
    ] {
        from_yaml(&format!("{HEAD}    limit: {{ {fw}, window: {window} }}\n"), "p.yaml").unwrap();
    }
}

#[test]
fn budget_lists_are_checked() {
    let fw = "{ algorithm: fixed_window, limit: 10, window: 1m }";
    one(&format!("{HEAD}    limit: []\n"), 4, "tenants.acme.limit", "1 to 4 limits, found 0");
    one(
        &format!("{HEAD}    limit: [{fw}, {fw}, {fw}, {fw}, {fw}]\n"),
        4,
        "tenants.acme.limit",
        "1 to 4 limits, found 5",
    );
    one(
        &format!(
            "{HEAD}    per_key:\n      - {{ name: a, algorithm: token_bucket, rate: 1/s }}\n      - {{ name: a, algorithm: token_bucket, rate: 9/s }}\n"
        ),
        6,
        "tenants.acme.per_key[1].name",
        "duplicate budget name `a`",
    );
    one(
        &format!(
            "{HEAD}    limit:\n      - {fw}\n      - {{ algorithm: fixed_window, limit: 0, window: 1m }}\n"
        ),
        6,
        "tenants.acme.limit[1].limit",
        "greater than zero",
    );
    let p = from_yaml(
        &format!("{HEAD}    limit: [{fw}, {{ algorithm: token_bucket, rate: 5/s }}]\n"),
        "p.yaml",
    )
    .unwrap();
    let names: Vec<&str> = p.tenants["acme"].limit.iter().map(|r| &*r.name).collect();
    assert_eq!(names, ["tenant_1", "tenant_2"]);
}

#[test]
fn concurrency_limits_take_a_limit_and_a_permit_ttl() {
    let p = from_yaml(
        &format!("{HEAD}    limit: {{ algorithm: concurrency, limit: 3, permit_ttl: 30s }}\n"),
        "policies.yaml",
    )
    .unwrap();
    let chain = p.resolve(&Request::new("acme", "/r"), &NameBounds::default()).unwrap();
    let limiter = Limiter::new(100);
    for _ in 0..3 {
        assert!(limiter.decide(&chain, 0).admitted());
    }
    assert!(!limiter.decide(&chain, 29_000_000_000).admitted(), "held until the TTL");
    assert!(limiter.decide(&chain, 32_000_000_000).admitted(), "reclaimed after it");
    one(
        &format!("{HEAD}    limit: {{ algorithm: concurrency, limit: 3 }}\n"),
        4,
        "tenants.acme.limit.permit_ttl",
        "missing required field",
    );
    one(
        &format!("{HEAD}    limit: {{ algorithm: concurrency, limit: 3, permit_ttl: 100ms }}\n"),
        4,
        "tenants.acme.limit.permit_ttl",
        "a permit lives 1s to 1d",
    );
    one(
        &format!(
            "{HEAD}    limit: {{ algorithm: concurrency, limit: 3, permit_ttl: 5s, window: 1s }}\n"
        ),
        4,
        "tenants.acme.limit.window",
        "does not apply to concurrency",
    );
    one(
        &format!(
            "{HEAD}    limit: {{ algorithm: fixed_window, limit: 3, window: 1s, permit_ttl: 5s }}\n"
        ),
        4,
        "tenants.acme.limit.permit_ttl",
        "does not apply to fixed_window",
    );
    one(
        &format!("{HEAD}    limit: {{ algorithm: concurrency, limit: 0, permit_ttl: 5s }}\n"),
        4,
        "tenants.acme.limit.limit",
        "",
    );
}
