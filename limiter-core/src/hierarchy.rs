//! Hierarchical evaluation: a request is checked against every level of its chain
//! and charged all-or-nothing.
//!
//! Every level must admit; if any rejects, no level is charged. The reported scope is
//! the outermost failing level and `retry_after` the longest wait over the failing
//! levels. The shards of all levels are locked together (in a fixed order) so the
//! check and the charge are one atomic step.

use crate::algorithm::{Algorithm, Check};
use crate::clock::Nanos;
use crate::decision::{Binding, Decision, Reason, Scope};
use crate::limit::LimitState;
use crate::policy::{Chain, Level};
use crate::table::StateTable;

/// A decision and whether shadow mode turns a rejection into an admission.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// What the limits say.
    pub decision: Decision,
    /// Shadow mode: the caller admits the request whatever the decision says.
    pub shadow: bool,
}

impl Verdict {
    /// Whether the request goes through (allowed, or rejected in shadow mode).
    pub fn admitted(&self) -> bool {
        self.shadow || self.decision.is_allowed()
    }
}

/// What a batch grant took from every level of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Units granted (0 when some level has none left).
    pub units: u64,
    /// When they were charged (needed to return them).
    pub granted_at: Nanos,
    /// How long they may be spent (at most what was asked for).
    pub hold: Nanos,
    /// The level that limited the grant, if any did.
    pub binding: Option<Scope>,
}

/// One level's state as seen by [`Limiter::inspect`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LevelView {
    /// The level.
    pub scope: Scope,
    /// Units that would be admitted now.
    pub remaining: u64,
    /// Nanoseconds until the level is back to its full allowance.
    pub reset_after: Nanos,
    /// The stored state (`None`: never charged, or evicted while idle).
    pub state: Option<LimitState>,
}

/// The verdict of a chain no counter decides (any store gives it without looking):
/// an unknown tenant the policy rejects, or no level at all. `None` when counters decide.
pub fn without_counters(chain: &Chain<'_>) -> Option<Verdict> {
    let decision = if chain.unknown_tenant {
        Decision::Rejected {
            reason: Reason::UnknownTenant,
            scope: Scope::Tenant,
            limit: None,
            retry_after: 0,
        }
    } else if chain.is_empty() {
        Decision::Allowed { remaining: u64::MAX, reset_after: 0, binding: None }
    } else {
        return None;
    };
    Some(Verdict { decision, shadow: chain.shadow })
}

/// Evaluates chains against a table of states.
///
/// # Examples
///
/// ```
/// use limiter_core::{Limiter, policy::{from_yaml, Request, NameBounds}};
/// let policy = from_yaml(
///     "version: 1\ntenants:\n  acme:\n    limit: { algorithm: fixed_window, limit: 2, window: 1s }\n",
///     "p.yaml",
/// ).unwrap();
/// let limiter = Limiter::new(10_000);
/// let chain = policy.resolve(&Request::new("acme", "/search"), &NameBounds::default()).unwrap();
/// assert!(limiter.decide(&chain, 0).admitted());
/// assert!(limiter.decide(&chain, 0).admitted());
/// assert!(!limiter.decide(&chain, 0).admitted());
/// ```
#[derive(Debug)]
pub struct Limiter {
    table: StateTable,
}

impl Limiter {
    /// A limiter holding at most about `max_keys` counters.
    pub fn new(max_keys: usize) -> Self {
        Self { table: StateTable::with_capacity(max_keys) }
    }

    /// A limiter over a given table.
    pub fn with_table(table: StateTable) -> Self {
        Self { table }
    }

    /// The table of states.
    pub fn table(&self) -> &StateTable {
        &self.table
    }

    /// Checks a request against every level and charges all of them, or none.
    pub fn decide(&self, chain: &Chain<'_>, now: Nanos) -> Verdict {
        without_counters(chain).unwrap_or_else(|| Verdict {
            decision: self.decide_levels(chain, now),
            shadow: chain.shadow,
        })
    }

    fn decide_levels(&self, chain: &Chain<'_>, now: Nanos) -> Decision {
        let keys = chain.keys();
        let mut locked = self.table.lock(&keys);
        let cost = chain.cost;
        let charging = !chain.dry_run && cost > 0;
        if charging && let (1, Some(level)) = (chain.len(), chain.levels().next()) {
            // One level, the common case: checked and charged in one lookup. A fresh
            // counter always admits (a chain's cost fits every level's capacity), so
            // the counter this creates is one an admission would create anyway.
            let limit = &level.rule.limit;
            let slot = locked.slot_mut(0, limit, now);
            return match limit.try_acquire(&mut slot.state, now, cost) {
                Check::Admit { remaining } => Decision::Allowed {
                    remaining,
                    reset_after: limit.reset_after(&slot.state, now),
                    binding: Some(Binding { scope: level.scope, limit: **limit }),
                },
                Check::Deny { retry_after } => Decision::Rejected {
                    reason: level.scope.reason(),
                    scope: level.scope,
                    limit: Some(**limit),
                    retry_after,
                },
            };
        }
        let fresh = LimitState::Fresh;
        // The tightest admitting level (a level's budgets each count apart): (level,
        // remaining after, its reset after as
        // read now: right for a dry run, replaced after a charge).
        let mut tightest: Option<(Level<'_>, u64, Nanos)> = None;
        let mut failed: Option<(Level<'_>, Nanos)> = None;
        for (i, level) in chain.levels().enumerate() {
            let limit = &level.rule.limit;
            let state = locked.get_used(i, limit, now).unwrap_or(&fresh);
            match limit.check(state, now, cost) {
                Check::Admit { remaining } => {
                    // A dry run charges nothing, so nothing is taken off what is left.
                    let remaining = if chain.dry_run { remaining + cost } else { remaining };
                    if tightest.is_none_or(|(_, r, _)| remaining < r) {
                        tightest = Some((level, remaining, limit.reset_after(state, now)));
                    }
                }
                Check::Deny { retry_after } => {
                    // Outermost failing level names the scope; the longest wait wins.
                    failed = Some(match failed {
                        None => (level, retry_after),
                        Some((first, wait)) => (first, wait.max(retry_after)),
                    });
                }
            }
        }
        if let Some((level, retry_after)) = failed {
            return Decision::Rejected {
                reason: level.scope.reason(),
                scope: level.scope,
                limit: Some(*level.rule.limit),
                retry_after,
            };
        }
        let Some((binding, remaining, mut reset_after)) = tightest else {
            return Decision::Allowed { remaining: u64::MAX, reset_after: 0, binding: None };
        };
        if charging {
            for (i, level) in chain.levels().enumerate() {
                let limit = &level.rule.limit;
                let slot = locked.slot_mut(i, limit, now);
                limit.charge(&mut slot.state, now, cost);
                if level.key == binding.key {
                    reset_after = limit.reset_after(&slot.state, now);
                }
            }
        }
        let limit = *binding.rule.limit;
        Decision::Allowed {
            remaining,
            reset_after,
            binding: Some(Binding { scope: binding.scope, limit }),
        }
    }

    /// Units left at the tightest level (`u64::MAX` when no level applies).
    pub fn remaining(&self, chain: &Chain<'_>, now: Nanos) -> u64 {
        let keys = chain.keys();
        let locked = self.table.lock(&keys);
        let fresh = LimitState::Fresh;
        chain
            .levels()
            .enumerate()
            .map(|(i, l)| {
                l.rule.limit.remaining(locked.get(i, &l.rule.limit).unwrap_or(&fresh), now)
            })
            .min()
            .unwrap_or(u64::MAX)
    }

    /// Every level's state, without charging anything (diagnostics, tests).
    pub fn inspect(&self, chain: &Chain<'_>, now: Nanos) -> Vec<LevelView> {
        let keys = chain.keys();
        let locked = self.table.lock(&keys);
        let fresh = LimitState::Fresh;
        chain
            .levels()
            .enumerate()
            .map(|(i, level)| {
                let limit = &level.rule.limit;
                let state = locked.get(i, limit);
                let s = state.unwrap_or(&fresh);
                LevelView {
                    scope: level.scope,
                    remaining: limit.remaining(s, now),
                    reset_after: limit.reset_after(s, now),
                    state: state.cloned(),
                }
            })
            .collect()
    }

    /// Grants up to `max` units from every level at once: the most that every level
    /// can give, debited from all of them (the primitive leases are made of). The
    /// units may be spent until `now + grant.hold`, where `hold` is at most the one
    /// asked for and ends with the window of any window level.
    pub fn grant(&self, chain: &Chain<'_>, now: Nanos, max: u64, hold: Nanos) -> Grant {
        let keys = chain.keys();
        let mut locked = self.table.lock(&keys);
        let fresh = LimitState::Fresh;
        let mut units = max;
        let mut binding = None;
        let hold = chain.grant_hold(now, hold);
        for (i, level) in chain.levels().enumerate() {
            let limit = &level.rule.limit;
            let r = limit.remaining(locked.get_used(i, limit, now).unwrap_or(&fresh), now);
            if r < units {
                units = r;
                binding = Some(level.scope);
            }
        }
        if units > 0 && !chain.unknown_tenant {
            for (i, level) in chain.levels().enumerate() {
                let limit = &level.rule.limit;
                let slot = locked.slot_mut(i, limit, now);
                limit.charge_at(&mut slot.state, now, limit.grant_stamp(now, hold), units);
            }
        } else {
            units = 0;
        }
        Grant { units, granted_at: now, hold, binding }
    }

    /// Gives back `units` of a grant (made at `granted_at`, spendable for `hold`) that
    /// were not spent, restoring every level exactly as far as they still count.
    pub fn refund_grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        granted_at: Nanos,
        hold: Nanos,
        units: u64,
    ) {
        if units == 0 || chain.unknown_tenant {
            return;
        }
        let keys = chain.keys();
        let mut locked = self.table.lock(&keys);
        for (i, level) in chain.levels().enumerate() {
            let limit = &level.rule.limit;
            if locked.get(i, limit).is_some() {
                let slot = locked.slot_mut(i, limit, now);
                limit.refund(&mut slot.state, now, limit.grant_stamp(granted_at, hold), units);
            }
        }
    }

    /// Charges `units` to every level without checking: usage reported after the
    /// fact (beyond an estimate) is recorded even past the limit, as a debt.
    pub fn charge(&self, chain: &Chain<'_>, now: Nanos, units: u64) {
        if units == 0 || chain.unknown_tenant {
            return;
        }
        let keys = chain.keys();
        let mut locked = self.table.lock(&keys);
        for (i, level) in chain.levels().enumerate() {
            let limit = &level.rule.limit;
            let slot = locked.slot_mut(i, limit, now);
            limit.charge(&mut slot.state, now, units);
        }
    }

    /// Returns `units` charged at `granted_at` by a decision to every level (an
    /// estimate that was too high).
    pub fn refund(&self, chain: &Chain<'_>, now: Nanos, granted_at: Nanos, units: u64) {
        self.refund_grant(chain, now, granted_at, 0, units);
    }

    /// Settles a request admitted on an estimate once its actual cost is known: the
    /// difference is charged (even past the limit) or refunded on every level.
    pub fn reconcile(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        admitted_at: Nanos,
        estimated: u64,
        actual: u64,
    ) {
        if actual > estimated {
            self.charge(chain, now, actual - estimated);
        } else {
            self.refund(chain, now, admitted_at, estimated - actual);
        }
    }
}
