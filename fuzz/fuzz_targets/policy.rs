//! The policy parser and validator: any text is a policy or a list of errors, never a
//! panic; a valid policy resolves any request to a chain or an error, and decides it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use limiter_core::hierarchy::Limiter;
use limiter_core::policy::{NameBounds, Request};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(policy) = limiter_core::policy::from_yaml(text, "fuzz.yaml") else { return };
    let limiter = Limiter::new(1_000);
    for (tenant, route, key) in [("t", "/a", None), ("x", "/b", Some("k")), ("", "", Some(""))] {
        let req = Request { tenant, route, key, cost: Some(1), dry_run: false };
        if let Ok(chain) = policy.resolve(&req, &NameBounds::default()) {
            let _ = limiter.decide(&chain, 1_000_000_000);
            let _ = limiter.grant(&chain, 1_000_000_000, 10, 1_000_000_000);
        }
    }
});
