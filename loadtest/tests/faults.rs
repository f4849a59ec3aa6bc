//! Gateway processes with leases: one killed while it holds leases, one cut off from
//! its owner for a while. The report follows the dead gateway's units and names the
//! routes that failed open or closed.

mod common;

use loadtest::scenario::Scenario;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_cut_off_gateways_are_reported() {
    let policy = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios/tight-policy.yaml");
    let s = Scenario::from_yaml(&format!(
        "
name: faults-check
target: agent
policy: {policy}
servers: {{ nodes: 1 }}
gateways: 4
gateway_processes: true
seed: 2
tenants: {{ count: 12, skew: zipf }}
routes:
  - {{ name: /search, weight: 3, cost: 1 }}
  - {{ name: /export, weight: 1, cost: 4 }}
phases:
  - {{ rate: 800, for: 7s }}
faults:
  - {{ at: 1500ms, kill: gateway1 }}
  - {{ at: 4500ms, cut: gateway2, for: 2s }}
"
    ))
    .unwrap();
    let r = common::run_checked(&s).await;
    let t = &r.totals;
    assert_eq!(t.errors, 0, "every request answered: {t:?}");
    // Offered is the plan (about 5,600); the dead gateway's records stop at the kill:
    // about a quarter of 800/s is missing from 1.5 s on.
    assert!((5_400..5_800).contains(&t.offered), "offered {} of 5,600 planned", t.offered);
    let recorded = t.offered - t.missing;
    assert!((4_000..4_900).contains(&recorded), "{recorded} records of {}", t.offered);
    // Its leases were written off by the owner after their TTL, before the cut.
    let (first, units) = r.written_off_between(1.5, 4.5).expect("units written off after the kill");
    assert!(units > 0.0 && first > 1.5 && first < 4.5, "{first} {units}");
    // Every leased unit is accounted for at the end.
    let last = r.leases.last().unwrap();
    assert!(
        (last.granted - last.spent - last.returned - last.written_off - last.outstanding).abs()
            < 0.5,
        "{last:?}"
    );
    // During the cut the gateway's failure policy decided: /search fails open under
    // its emergency ceiling, /export fails closed.
    let cut = r.faults.iter().find(|f| f.what.contains("cut")).unwrap();
    assert!(cut.fallback.0 > 0 && cut.fallback.1 > 0, "{cut:?}");
    let route = |n: &str| r.routes.iter().find(|x| x.route == n).unwrap().clone();
    assert!(route("/search").failed_open > 0, "{:?}", r.routes);
    assert_eq!(route("/export").failed_open, 0, "{:?}", r.routes);
    assert!(route("/export").failed_closed > 0, "{:?}", r.routes);
    assert!(r.owner_calls_per_1000.is_some());
}
