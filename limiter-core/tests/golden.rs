//! limiter-core against the golden table (`golden/cases.rs`), which the Redis scripts
//! also pass (limiter-server's `redis_golden` test).

mod golden {
    pub(crate) mod cases;
}

use golden::cases::{BASE, CASES, Got, Op, check};
use limiter_core::policy::{NameBounds, Request, from_yaml};
use limiter_core::{Decision, Limiter};

#[test]
fn the_core_passes_every_golden_case() {
    let mut failures = Vec::new();
    for case in CASES {
        let policy = from_yaml(case.policy, "golden.yaml").unwrap();
        let limiter = Limiter::new(10_000);
        let names = NameBounds::default();
        for (n, step) in case.steps.iter().enumerate() {
            let now = (BASE + step.at) * 1_000;
            let key = match step.op {
                Op::Decide { key, .. } if !key.is_empty() => Some(key),
                _ => None,
            };
            let (cost, dry_run) = match step.op {
                Op::Decide { cost, dry_run, .. } => (cost, dry_run),
                _ => (1, true),
            };
            let req = Request { tenant: "t", route: "/r", key, cost: Some(cost), dry_run };
            let chain = policy.resolve(&req, &names).unwrap();
            let got = match step.op {
                Op::Decide { .. } => match limiter.decide(&chain, now).decision {
                    Decision::Allowed { remaining, reset_after, .. } => {
                        Got::Allowed { remaining, reset_after }
                    }
                    Decision::Rejected { scope, retry_after, .. } => {
                        Got::Rejected { scope, retry_after }
                    }
                },
                Op::Charge { units } => {
                    limiter.charge(&chain, now, units);
                    Got::Done
                }
                Op::Refund { granted_at, hold, units } => {
                    limiter.refund_grant(
                        &chain,
                        now,
                        (BASE + granted_at) * 1_000,
                        hold * 1_000,
                        units,
                    );
                    Got::Done
                }
                Op::Grant { max, hold } => {
                    let g = limiter.grant(&chain, now, max, hold * 1_000);
                    Got::Granted { units: g.units, hold: g.hold }
                }
                Op::Remaining => Got::Remaining(limiter.remaining(&chain, now)),
            };
            if let Err(e) = check(case, n, step, got) {
                failures.push(e);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
