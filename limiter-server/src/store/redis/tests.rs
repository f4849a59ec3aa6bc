use limiter_core::policy::from_yaml;

use super::*;

#[test]
fn the_example_policy_fits_and_limits_out_of_range_are_named() {
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/policies.yaml"))
            .unwrap();
    check_policy(&from_yaml(&text, "policies.yaml").unwrap()).unwrap();
    let policy = from_yaml(
        "version: 1\ntenants:\n  big:\n    limit: { algorithm: token_bucket, rate: 7/s, burst: 1000000000000 }\n  ok:\n    limit: { algorithm: sliding_counter, limit: 1000000, window: 1d }\n",
        "p.yaml",
    )
    .unwrap();
    let e = check_policy(&policy).unwrap_err();
    assert!(e.starts_with("tenants.big.limit: token bucket"), "{e}");
    assert!(!e.contains("tenants.ok"), "{e}");
}

#[test]
fn keys_are_length_prefixed_and_tagged_by_tenant() {
    let k = |scope, t, r, key| {
        let (tag, name) = tag(&LimitKeyRef::new(scope, t, r, key));
        format!("{}.{name}", tag as char)
    };
    assert_eq!(k(Scope::Key, "acme", "/r", "k"), "t.acme");
    assert_eq!(k(Scope::TenantRoute, "acme", "/r", ""), "t.acme");
    assert_eq!(k(Scope::Route, "acme", "/r", ""), "r./r");
    assert_eq!(k(Scope::Global, "acme", "/r", ""), "g.");
    assert_eq!(gcd(7_000, 1_000_000_000), 1_000);
}
