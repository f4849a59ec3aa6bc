//! The same limit decided in-process by our core, `governor` and the `limitador`
//! crate: a per-key limit over 1,000 keys, roomy enough that every decision admits,
//! one thread, the wall time per decision.

use std::collections::HashMap;
use std::hint::black_box;
use std::num::NonZeroU32;

use limiter_core::hierarchy::Limiter;
use limiter_core::policy::{NameBounds, Request};
use serde::Serialize;
use tokio::time::Instant;

/// Nanoseconds per decision of each library.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PeerTimes {
    /// Decisions per measurement.
    pub decisions: u64,
    /// limiter-core: policy resolution of tenant, route and key, then the decision.
    pub ours_ns: f64,
    /// `governor`'s keyed limiter (GCRA, `DashMap`).
    pub governor_ns: f64,
    /// `limitador`'s in-memory limiter (fixed window, its own expression context).
    pub limitador_ns: f64,
}

const KEYS: usize = 1_000;

#[allow(clippy::cast_precision_loss)]
fn per_call(start: Instant, n: u64) -> f64 {
    start.elapsed().as_nanos() as f64 / n as f64
}

/// Measures each library on `n` decisions, three rounds, the best round of each.
///
/// # Panics
///
/// When a library refuses the limit (it does not).
pub fn measure(n: u64) -> PeerTimes {
    let keys: Vec<String> = (0..KEYS).map(|i| format!("key-{i}")).collect();

    let policy = limiter_core::policy::from_yaml(
        "version: 1\nroutes:\n  /r: { cost: 1 }\ntenants:\n  t:\n    per_key: { algorithm: fixed_window, limit: 1000000000, window: 60s }\n",
        "peers.yaml",
    )
    .expect("a valid policy");
    let bounds = NameBounds::default();
    let ours = Limiter::new(1_000_000);
    let clock = limiter_core::clock::MonotonicClock::new();

    let gov = governor::RateLimiter::keyed(governor::Quota::per_minute(
        NonZeroU32::new(1_000_000_000).expect("nonzero"),
    ));

    let lim = limitador::RateLimiter::new(10_000);
    let ns = limitador::limit::Namespace::from("ns");
    let expr = limitador::limit::Expression::parse("key").expect("an expression");
    assert!(lim.add_limit(limitador::limit::Limit::new("ns", 1_000_000_000, 60, [], [expr])));

    let mut best = PeerTimes {
        decisions: n,
        ours_ns: f64::MAX,
        governor_ns: f64::MAX,
        limitador_ns: f64::MAX,
    };
    for _ in 0..3 {
        let t = Instant::now();
        for i in 0..n {
            let key = &keys[usize::try_from(i).unwrap_or(0) % KEYS];
            let req =
                Request { tenant: "t", route: "/r", key: Some(key), cost: Some(1), dry_run: false };
            let chain = policy.resolve(&req, &bounds).expect("resolves");
            let now = limiter_core::clock::Clock::now(&clock);
            assert!(ours.decide(&chain, now).admitted());
        }
        best.ours_ns = best.ours_ns.min(per_call(t, n));

        let t = Instant::now();
        for i in 0..n {
            let key = &keys[usize::try_from(i).unwrap_or(0) % KEYS];
            assert!(gov.check_key(key).is_ok());
        }
        best.governor_ns = best.governor_ns.min(per_call(t, n));

        let t = Instant::now();
        for i in 0..n {
            let key = &keys[usize::try_from(i).unwrap_or(0) % KEYS];
            let ctx: limitador::limit::Context<'_> =
                HashMap::from([("key".to_owned(), key.clone())]).into();
            let r = lim.check_rate_limited_and_update(&ns, &ctx, 1).expect("in memory");
            assert!(!black_box(r).limited);
        }
        best.limitador_ns = best.limitador_ns.min(per_call(t, n));
    }
    best
}
