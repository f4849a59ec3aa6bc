//! The golden table: cases every implementation of the algorithms must pass, the
//! core's (`limiter-core`) and the Redis scripts' (`lua/`, replayed by the server's
//! tests against a real `redis-server`).
//!
//! Times are microseconds after `BASE`, a realistic Unix time aligned to the hour (so
//! window starts are easy to see, and the scripts meet numbers near 2^51). Expected
//! durations are microseconds: an implementation counting nanoseconds passes when its
//! answer rounded up to the microsecond matches (a ceiling of a ceiling is the
//! ceiling, so nanosecond and microsecond arithmetic agree exactly on such inputs).

#![allow(dead_code)] // each test binary uses its own part

use limiter_core::Scope;

/// 2027-01-15T08:00:00Z in microseconds.
pub(crate) const BASE: u64 = 1_800_000_000_000_000;

/// What a step does.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    /// Check and charge (`dry_run`: check only) the chain of `key` (`""`: no key).
    Decide { key: &'static str, cost: u64, dry_run: bool },
    /// Charge without checking (usage reported after the fact).
    Charge { units: u64 },
    /// Give back units of a decision or grant made at `granted_at` (after `BASE`),
    /// spendable for `hold` (0 for a decision).
    Refund { granted_at: u64, hold: u64, units: u64 },
    /// Grant up to `max` units spendable for at most `hold`.
    Grant { max: u64, hold: u64 },
    /// Units left at the tightest level.
    Remaining,
}

/// What a step must answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expect {
    /// Admitted: left at the tightest level, and when it is full again.
    Allowed { remaining: u64, reset_after: u64 },
    /// Refused by the outermost failing level, with the longest wait.
    Rejected { scope: Scope, retry_after: u64 },
    /// A grant of `units` for `hold`.
    Granted { units: u64, hold: u64 },
    /// Units left.
    Remaining(u64),
    /// Nothing to check (charges and refunds).
    Done,
}

/// One step: at `at` microseconds after `BASE`, do `op`, expect `expect`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Step {
    pub at: u64,
    pub op: Op,
    pub expect: Expect,
}

/// A case: a policy (tenant `t`, route `/r`) and its steps.
#[derive(Debug)]
pub(crate) struct Case {
    pub name: &'static str,
    pub policy: &'static str,
    pub steps: &'static [Step],
}

const fn decide(at: u64, cost: u64, expect: Expect) -> Step {
    Step { at, op: Op::Decide { key: "", cost, dry_run: false }, expect }
}

const fn allowed(remaining: u64, reset_after: u64) -> Expect {
    Expect::Allowed { remaining, reset_after }
}

const fn rejected(scope: Scope, retry_after: u64) -> Expect {
    Expect::Rejected { scope, retry_after }
}

const MS: u64 = 1_000;
const S: u64 = 1_000_000;
const H: u64 = 3_600 * S;
const D: u64 = 24 * H;

/// Every case.
pub(crate) const CASES: &[Case] = &[
    Case {
        name: "token bucket: 3/s refills a token every 333,333.33 us, exactly",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: token_bucket, rate: 3/s, burst: 3 }\n",
        steps: &[
            decide(0, 1, allowed(2, 333_334)),
            decide(0, 2, allowed(0, S)),
            decide(0, 1, rejected(Scope::Tenant, 333_334)),
            decide(333_333, 1, rejected(Scope::Tenant, 1)),
            decide(333_334, 1, allowed(0, S)),
            Step {
                at: 333_334,
                op: Op::Refund { granted_at: 0, hold: 0, units: 1 },
                expect: Expect::Done,
            },
            Step { at: 333_334, op: Op::Remaining, expect: Expect::Remaining(1) },
            // Usage reported past the limit is a debt to wait out.
            Step { at: 333_334, op: Op::Charge { units: 10 }, expect: Expect::Done },
            decide(333_334, 1, rejected(Scope::Tenant, 3_333_333)),
            Step { at: 10 * S, op: Op::Remaining, expect: Expect::Remaining(3) },
            Step {
                at: 10 * S,
                op: Op::Grant { max: 5, hold: 2 * S },
                expect: Expect::Granted { units: 3, hold: 2 * S },
            },
            Step {
                at: 10 * S + 100 * MS,
                op: Op::Refund { granted_at: 10 * S, hold: 2 * S, units: 2 },
                expect: Expect::Done,
            },
            Step { at: 10 * S + 100 * MS, op: Op::Remaining, expect: Expect::Remaining(2) },
        ],
    },
    Case {
        name: "token bucket: a slow rate with a large burst (1000/h, burst 500)",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: token_bucket, rate: 1000/h, burst: 500 }\n",
        steps: &[
            decide(0, 500, allowed(0, 1_800 * S)),
            decide(1, 1, rejected(Scope::Tenant, 3_600 * MS - 1)),
            decide(3_600 * MS, 1, allowed(0, 1_800 * S)),
            // 900 s later 896.4 s have refilled: 249 tokens, not 250.
            decide(900 * S, 250, rejected(Scope::Tenant, 3_600 * MS)),
            decide(900 * S, 249, allowed(0, 1_800 * S)),
        ],
    },
    Case {
        name: "fixed window: 5 per second, windows aligned on the epoch",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: fixed_window, limit: 5, window: 1s }\n",
        steps: &[
            decide(100 * MS, 3, allowed(2, 900 * MS)),
            decide(100 * MS, 3, rejected(Scope::Tenant, 900 * MS)),
            Step {
                at: 200 * MS,
                op: Op::Decide { key: "", cost: 2, dry_run: true },
                expect: allowed(2, 800 * MS),
            },
            decide(200 * MS, 2, allowed(0, 800 * MS)),
            Step {
                at: 300 * MS,
                op: Op::Decide { key: "", cost: 1, dry_run: true },
                expect: rejected(Scope::Tenant, 700 * MS),
            },
            decide(S, 5, allowed(0, S)),
            Step {
                at: S + 10 * MS,
                op: Op::Refund { granted_at: S, hold: 0, units: 2 },
                expect: Expect::Done,
            },
            // A refund of a past window changes nothing.
            Step {
                at: S + 10 * MS,
                op: Op::Refund { granted_at: 100 * MS, hold: 0, units: 2 },
                expect: Expect::Done,
            },
            Step { at: S + 10 * MS, op: Op::Remaining, expect: Expect::Remaining(2) },
            // A grant's hold ends with its window.
            Step {
                at: S + 500 * MS,
                op: Op::Grant { max: 10, hold: 2 * S },
                expect: Expect::Granted { units: 2, hold: 500 * MS },
            },
            decide(S + 600 * MS, 1, rejected(Scope::Tenant, 400 * MS)),
            decide(2 * S, 1, allowed(4, S)),
        ],
    },
    Case {
        name: "sliding log: 3 in any second, grants stamped at the end of their hold",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: sliding_log, limit: 3, window: 1s }\n",
        steps: &[
            decide(0, 1, allowed(2, S)),
            decide(200 * MS, 2, allowed(0, S)),
            decide(500 * MS, 1, rejected(Scope::Tenant, 500 * MS)),
            // The unit logged at 0 leaves the interval at 1 s exactly.
            decide(S, 1, allowed(0, S)),
            decide(S, 2, rejected(Scope::Tenant, 200 * MS)),
            // At 1.25 s the two units of 0.2 s are gone: two left.
            Step {
                at: S + 250 * MS,
                op: Op::Grant { max: 5, hold: S },
                expect: Expect::Granted { units: 2, hold: 25 * MS },
            },
            Step {
                at: S + 260 * MS,
                op: Op::Refund { granted_at: S + 250 * MS, hold: 25 * MS, units: 1 },
                expect: Expect::Done,
            },
            Step { at: S + 260 * MS, op: Op::Remaining, expect: Expect::Remaining(1) },
            decide(S + 260 * MS, 2, rejected(Scope::Tenant, 740 * MS)),
            decide(S + 260 * MS, 1, allowed(0, S + 15 * MS)),
            Step { at: 10 * S, op: Op::Remaining, expect: Expect::Remaining(3) },
        ],
    },
    Case {
        name: "sliding log: a full log merges new charges into its newest entry",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: sliding_log, limit: 2, window: 1s }\n",
        steps: &[
            decide(0, 1, allowed(1, S)),
            Step { at: 100 * MS, op: Op::Charge { units: 1 }, expect: Expect::Done },
            // Two entries (the limit): a third charge joins the newest, at the later stamp.
            Step { at: 300 * MS, op: Op::Charge { units: 2 }, expect: Expect::Done },
            decide(400 * MS, 1, rejected(Scope::Tenant, 900 * MS)),
            decide(S, 1, rejected(Scope::Tenant, 300 * MS)),
            decide(1_300 * MS, 2, allowed(0, S)),
        ],
    },
    Case {
        name: "sliding counter: the previous window weighs by the part still inside",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: sliding_counter, limit: 10, window: 1s }\n",
        steps: &[
            decide(0, 6, allowed(4, 2 * S)),
            // 1.25 s: 6 x 0.75 = 4.5 still weighs, as 5: five left.
            decide(S + 250 * MS, 5, allowed(0, 1_750 * MS)),
            // Room for one more once 6 x (1 - e) <= 4: at e = 1/3 of the window.
            decide(S + 250 * MS, 1, rejected(Scope::Tenant, 83_334)),
            decide(S + 333_334, 1, allowed(0, 1_666_666)),
            Step {
                at: S + 400 * MS,
                op: Op::Refund { granted_at: S + 250 * MS, hold: 0, units: 5 },
                expect: Expect::Done,
            },
            Step {
                at: S + 400 * MS,
                op: Op::Refund { granted_at: 0, hold: 0, units: 2 },
                expect: Expect::Done,
            },
            // prev 4 x 0.6 = 2.4 -> 3; curr 1: six left.
            Step { at: S + 400 * MS, op: Op::Remaining, expect: Expect::Remaining(6) },
            Step {
                at: S + 500 * MS,
                op: Op::Grant { max: 100, hold: 2 * S },
                expect: Expect::Granted { units: 7, hold: 500 * MS },
            },
            decide(4 * S, 10, allowed(0, 2 * S)),
        ],
    },
    Case {
        name: "sliding counter: products past 2^53 stay exact (a million a day)",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: sliding_counter, limit: 1000000, window: 1d }\n",
        steps: &[
            // BASE is 08:00: the day's window began 8 h before.
            decide(0, 999_999, allowed(1, 2 * 86_400 * S - 8 * 3_600 * S)),
            // 01:00 on the next day: 999,999 x 23/24 = 958,332.04 -> 958,333.
            Step { at: 17 * 3_600 * S, op: Op::Remaining, expect: Expect::Remaining(41_667) },
            decide(17 * 3_600 * S, 41_667, allowed(0, 2 * 86_400 * S - 3_600 * S)),
            // Once 999,999 x (1 - e) <= 958,332: e = 3,600,032,401 us into the day.
            decide(17 * 3_600 * S, 1, rejected(Scope::Tenant, 32_401)),
            // 09:00 on the next day: 999,999 x 15/24 = 624,999.4 -> 625,000 still weigh.
            Step { at: 25 * 3_600 * S, op: Op::Remaining, expect: Expect::Remaining(333_333) },
        ],
    },
    Case {
        name: "hierarchy: every level of another algorithm, all or nothing",
        policy: "version: 1
global:
  ceiling: { algorithm: token_bucket, rate: 100/s, burst: 100 }
routes:
  /r:
    limit: { algorithm: fixed_window, limit: 50, window: 1s }
tenants:
  t:
    limit: { algorithm: sliding_log, limit: 20, window: 1s }
    routes:
      /r: { algorithm: sliding_counter, limit: 10, window: 1s }
    per_key: { algorithm: fixed_window, limit: 4, window: 1s }
",
        steps: &[
            Step {
                at: 0,
                op: Op::Decide { key: "k1", cost: 3, dry_run: false },
                expect: allowed(1, S),
            },
            // The key level refuses: nothing is charged anywhere.
            Step {
                at: 0,
                op: Op::Decide { key: "k1", cost: 2, dry_run: false },
                expect: rejected(Scope::Key, S),
            },
            Step {
                at: 0,
                op: Op::Decide { key: "k2", cost: 4, dry_run: false },
                expect: allowed(0, S),
            },
            // 7 of 10 at tenant x route: room for 4 once 7 x (1 - e) <= 6 in the next
            // window, e = 1/7 of it.
            Step {
                at: 0,
                op: Op::Decide { key: "k3", cost: 4, dry_run: false },
                expect: rejected(Scope::TenantRoute, 1_142_858),
            },
            Step {
                at: 0,
                op: Op::Decide { key: "k3", cost: 3, dry_run: false },
                expect: allowed(0, 2 * S),
            },
            // Tenant x route is full; the key level too: the outermost names the scope,
            // the longest wait is the answer.
            Step {
                at: 0,
                op: Op::Decide { key: "k2", cost: 1, dry_run: false },
                expect: rejected(Scope::TenantRoute, 1_100 * MS),
            },
            Step { at: 0, op: Op::Remaining, expect: Expect::Remaining(0) },
        ],
    },
    Case {
        name: "fixed window: a calendar day in Europe/Berlin is 23 hours in spring, 25 in autumn",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: fixed_window, limit: 3, window: 1d, align: calendar, timezone: Europe/Berlin }\n",
        steps: &[
            // 2027-03-28T12:00Z: the day began at 23:00Z the evening before, ends 22:00Z.
            decide(6_235_200 * S, 3, allowed(0, 10 * H)),
            decide(6_235_200 * S, 1, rejected(Scope::Tenant, 10 * H)),
            // 2027-03-28T22:00Z: local midnight, a new day of 24 hours.
            decide(6_271_200 * S, 1, allowed(2, 24 * H)),
            // 2027-10-31T00:00Z: the autumn day began 22:00Z the evening before and ends at
            // 23:00Z: 25 hours, 23 of them still to come.
            decide(24_940_800 * S, 1, allowed(2, 23 * H)),
            Step {
                at: 24_940_800 * S,
                op: Op::Grant { max: 9, hold: 48 * H },
                expect: Expect::Granted { units: 2, hold: 23 * H },
            },
        ],
    },
    Case {
        name: "fixed window: a calendar month ends at local midnight in America/New_York",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: fixed_window, limit: 2, window: 1mo, align: calendar, timezone: America/New_York }\n",
        steps: &[
            // 2027-02-01T04:59:59Z is the last second of January in New York.
            decide(1_457_999 * S, 2, allowed(0, S)),
            decide(1_457_999 * S, 1, rejected(Scope::Tenant, S)),
            // February: 28 days.
            decide(1_458_000 * S, 1, allowed(1, 28 * D)),
        ],
    },
    Case {
        name: "sliding counter: a calendar month in UTC at the end of February in a leap year",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: sliding_counter, limit: 29, window: 1mo, align: calendar }\n",
        steps: &[
            // 2028-02-01T00:00Z: full until the end of March (29 + 31 days).
            decide(32_976_000 * S, 29, allowed(0, 60 * D)),
            // 2028-02-29T23:59:59Z: in March the 29 units of February weigh
            // min(29, 31 - e) / 29 of themselves: one unit fits once e = 3 days.
            decide(35_481_599 * S, 1, rejected(Scope::Tenant, 3 * D + S)),
            decide(35_740_800 * S, 1, allowed(0, 58 * D)),
            decide(35_740_800 * S, 1, rejected(Scope::Tenant, D)),
        ],
    },
    Case {
        name: "sliding counter: a 25-hour calendar day weighs after it by its real length",
        policy: "version: 1\ntenants:\n  t:\n    limit: { algorithm: sliding_counter, limit: 10, window: 1d, align: calendar, timezone: Europe/Berlin }\n",
        steps: &[
            // 2027-10-31T10:00Z, in the 25-hour day (22:00Z to 23:00Z the next evening).
            decide(24_976_800 * S, 10, allowed(0, 37 * H)),
            // 2027-11-01T05:00Z, 6 h into a 24-hour day: 10 x 18 / 25 = 7.2 still count.
            decide(25_045_200 * S, 2, allowed(0, 42 * H)),
            // One more fits when 10 x (24 h - e) <= 7 x 25 h: at e = 6.5 h.
            decide(25_045_200 * S, 1, rejected(Scope::Tenant, 30 * 60 * S)),
            Step {
                at: 25_045_200 * S + 30 * 60 * S,
                op: Op::Remaining,
                expect: Expect::Remaining(1),
            },
        ],
    },
    Case {
        name: "budgets: two limits on one tenant, each its own counter, the tightest reported",
        policy: "version: 1\ntenants:\n  t:\n    limit:\n      - { algorithm: fixed_window, limit: 5, window: 1s }\n      - { algorithm: fixed_window, limit: 8, window: 10s }\n",
        steps: &[
            decide(0, 4, allowed(1, S)),
            // A new second: the 10-second budget binds, 9 s from its end.
            decide(S, 4, allowed(0, 9 * S)),
            decide(2 * S, 1, rejected(Scope::Tenant, 8 * S)),
            Step { at: 2 * S, op: Op::Remaining, expect: Expect::Remaining(0) },
            decide(10 * S, 5, allowed(0, S)),
        ],
    },
];

/// An answer, from any implementation, durations in nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Got {
    Allowed { remaining: u64, reset_after: u64 },
    Rejected { scope: Scope, retry_after: u64 },
    Granted { units: u64, hold: u64 },
    Remaining(u64),
    Done,
}

/// Nanoseconds rounded up to microseconds.
pub(crate) fn micros(ns: u64) -> u64 {
    ns.div_ceil(1_000)
}

/// Whether `got` is what `step` expects.
///
/// # Errors
///
/// A description of the difference.
pub(crate) fn check(case: &Case, n: usize, step: &Step, got: Got) -> Result<(), String> {
    let got_us = match got {
        Got::Allowed { remaining, reset_after } => {
            Expect::Allowed { remaining, reset_after: micros(reset_after) }
        }
        Got::Rejected { scope, retry_after } => {
            Expect::Rejected { scope, retry_after: micros(retry_after) }
        }
        Got::Granted { units, hold } => Expect::Granted { units, hold: micros(hold) },
        Got::Remaining(r) => Expect::Remaining(r),
        Got::Done => Expect::Done,
    };
    if got_us == step.expect {
        Ok(())
    } else {
        Err(format!(
            "{}: step {n} ({:?} at {} us): expected {:?}, got {got_us:?}",
            case.name, step.op, step.at, step.expect
        ))
    }
}
