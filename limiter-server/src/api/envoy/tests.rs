use super::*;

#[test]
fn limits_map_onto_envoy_units() {
    assert_eq!(envoy_limit(100, NANOS_PER_SEC), (100, Unit::Second));
    assert_eq!(envoy_limit(600, 60 * NANOS_PER_SEC), (600, Unit::Minute));
    // 100 per 10 s: 10 per second.
    assert_eq!(envoy_limit(100, 10 * NANOS_PER_SEC), (10, Unit::Second));
    // 1 per 10 s: 6 per minute.
    assert_eq!(envoy_limit(1, 10 * NANOS_PER_SEC), (6, Unit::Minute));
}

#[test]
fn values_become_names_that_are_never_refused() {
    assert_eq!(name_from("acme", 128), "acme");
    assert_eq!(name_from("a\tb", 128), "a%09b");
    // A C1 control character is written byte by byte.
    assert_eq!(name_from("x\u{85}y", 128), "x%C2%85y");
    assert_eq!(name_from("", 128), EMPTY_VALUE);
    // Too long: a fixed-length digest, the same for the same value, another for
    // another value.
    let long = "u".repeat(300);
    let d = name_from(&long, 256);
    assert!(d.starts_with("sha256:") && d.len() == 7 + DIGEST_HEX, "{d}");
    assert_eq!(d, name_from(&long, 256));
    assert_ne!(d, name_from(&"v".repeat(300), 256));
    // A bound below the digest's length cuts the digest, never passes it.
    assert_eq!(name_from(&long, 16).len(), 16);
    // Escaping can make a name too long: then it is digested too.
    assert!(name_from(&"\t".repeat(100), 256).starts_with("sha256:"));
}
