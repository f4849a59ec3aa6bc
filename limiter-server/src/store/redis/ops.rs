//! The Redis store's operations: each is one script call per group of a chain's
//! levels (one group on a single Redis; one per hash tag on a Cluster), with what a
//! multi-group call gives back when a later group fails.

use limiter_core::clock::Nanos;
use limiter_core::decision::{Binding, Decision};
use limiter_core::policy::Chain;
use limiter_core::{Grant, Verdict};

use super::{Decided, Granted, MICRO, RedisStore, ns, op_args, us};
use crate::error::{ServerError, StoreError};
use crate::metrics as m;
use crate::store::{Charged, Leased, Renewal};

impl RedisStore {
    async fn decide_group(
        &self,
        chain: &Chain<'_>,
        group: (usize, usize),
        now: Nanos,
        dry_run: bool,
    ) -> Result<Decided, ServerError> {
        let r = self
            .call("decide", chain, group, now, op_args(&[chain.cost, u64::from(dry_run)]))
            .await?;
        let get = |i: usize| r.get(i).copied().unwrap_or(0);
        let d = Decided {
            admitted: get(0) == 1,
            level: usize::try_from(get(1)).unwrap_or(usize::MAX),
            value: u64::try_from(get(2)).unwrap_or(0),
            reset: ns(get(3)),
            at: ns(get(4)),
        };
        // A level of this call (or none, for an admission); anything else is not a
        // reply of this script: refused, never trusted.
        if r.len() != 5 || d.level > group.1 || (!d.admitted && d.level == 0) {
            metrics::counter!(m::STORE_ERRORS, "kind" => "error").increment(1);
            tracing::debug!(reply = ?r, "malformed decide reply");
            return Err(StoreError::Malformed("decide").into());
        }
        Ok(d)
    }

    /// Checks and charges a chain, all levels or none.
    ///
    /// # Errors
    ///
    /// Redis unreachable, slow or refusing (the breaker counts it).
    pub async fn decide(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
    ) -> Result<(Verdict, Charged), ServerError> {
        let mut at = Charged { at: now, hold: 0 };
        if let Some(verdict) = limiter_core::hierarchy::without_counters(chain) {
            return Ok((verdict, at));
        }
        let groups = self.groups(chain);
        let mut tightest: Option<(usize, u64, Nanos)> = None;
        let mut charged: Vec<((usize, usize), Nanos)> = Vec::new();
        let mut permit_stamped = false;
        for &group in &groups {
            let d = match self.decide_group(chain, group, now, chain.dry_run).await {
                Ok(d) => d,
                Err(e) => {
                    self.give_back(chain, now, &charged).await;
                    return Err(e);
                }
            };
            let level = group.0 + d.level.saturating_sub(1);
            if !d.admitted {
                self.give_back(chain, now, &charged).await;
                // The outermost refusing level is this group's (the earlier ones
                // admitted); the wait is the longest over every refusing level, so the
                // later groups are asked too, without charging.
                let mut wait = d.value;
                for &later in groups.iter().filter(|g| g.0 > group.0) {
                    if let Ok(l) = self.decide_group(chain, later, now, true).await
                        && !l.admitted
                    {
                        wait = wait.max(l.value);
                    }
                }
                let Some(l) = chain.levels().nth(level) else {
                    return Err(ServerError::Unavailable("redis named no level".into()));
                };
                let decision = Decision::Rejected {
                    reason: l.scope.reason(),
                    scope: l.scope,
                    limit: Some(*l.rule.limit),
                    retry_after: wait.saturating_mul(MICRO),
                };
                return Ok((Verdict { decision, shadow: chain.shadow }, at));
            }
            // The stamp a refund names: the first group's, or, when a later group
            // holds the chain's first concurrency level, that group's (a permit's
            // release names its entry; Redis Cluster's groups read TIME apart).
            let holds_permits =
                chain.levels().skip(group.0).take(group.1).any(|l| l.rule.limit.is_concurrency());
            if charged.is_empty() || (holds_permits && !permit_stamped) {
                at.at = d.at;
                permit_stamped |= holds_permits;
            }
            if !chain.dry_run {
                charged.push((group, d.at));
            }
            if d.level > 0 && tightest.is_none_or(|(_, r, _)| d.value < r) {
                tightest = Some((level, d.value, d.reset));
            }
        }
        let decision = match tightest {
            None => Decision::Allowed { remaining: u64::MAX, reset_after: 0, binding: None },
            Some((i, remaining, reset_after)) => {
                let Some(l) = chain.levels().nth(i) else {
                    return Err(ServerError::Unavailable("redis named no level".into()));
                };
                Decision::Allowed {
                    remaining,
                    reset_after,
                    binding: Some(Binding { scope: l.scope, limit: *l.rule.limit }),
                }
            }
        };
        Ok((Verdict { decision, shadow: chain.shadow }, at))
    }

    /// Refunds what earlier groups of a Cluster decision were charged (best effort:
    /// a failure here under-admits, never over-admits).
    async fn give_back(&self, chain: &Chain<'_>, now: Nanos, charged: &[((usize, usize), Nanos)]) {
        for &(group, at) in charged {
            let _ = self.call("refund", chain, group, now, op_args(&[chain.cost, us(at)])).await;
        }
    }

    /// Charges `units` to every level without checking.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn charge(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        if units == 0 || chain.unknown_tenant {
            return Ok(());
        }
        for group in self.groups(chain) {
            self.call("charge", chain, group, now, op_args(&[units])).await?;
        }
        Ok(())
    }

    /// Gives back `units` of a grant (or decision: `hold` 0) made at `granted_at`.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn refund_grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        granted_at: Nanos,
        hold: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        if units == 0 || chain.unknown_tenant {
            return Ok(());
        }
        for group in self.groups(chain) {
            self.call("refund", chain, group, now, op_args(&[units, us(granted_at), us(hold)]))
                .await?;
        }
        Ok(())
    }

    /// Grants up to `max` units (all levels or none), after returning `back` (units,
    /// granted at, hold) of an earlier grant. With `need > 0`: nothing unless every
    /// level has `need`, and at most half of what is left.
    pub(crate) async fn grant_raw(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        max: u64,
        hold: Nanos,
        need: u64,
        back: (u64, Nanos, Nanos),
    ) -> Result<Granted, ServerError> {
        if chain.unknown_tenant || max == 0 {
            self.refund_grant(chain, now, back.1, back.2, back.0).await?;
            return Ok(Granted { units: 0, granted_at: now, hold, ..Granted::default() });
        }
        let groups = self.groups(chain);
        let mut done: Vec<((usize, usize), Granted)> = Vec::with_capacity(groups.len());
        let mut units = max;
        let mut result = Granted { units: 0, granted_at: now, hold, ..Granted::default() };
        result.left = u64::MAX;
        for &group in &groups {
            let r = self
                .call(
                    "grant",
                    chain,
                    group,
                    now,
                    op_args(&[units, us(hold), need, back.0, us(back.1), us(back.2)]),
                )
                .await;
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    for (g, got) in &done {
                        let _ = self
                            .call(
                                "refund",
                                chain,
                                *g,
                                now,
                                op_args(&[got.units, us(got.granted_at), us(got.hold)]),
                            )
                            .await;
                    }
                    return Err(e);
                }
            };
            let get = |i: usize| r.get(i).copied().unwrap_or(0);
            let g = Granted {
                units: u64::try_from(get(0)).unwrap_or(0),
                granted_at: ns(get(1)),
                hold: ns(get(2)),
                binding: usize::try_from(get(3)).unwrap_or(0),
                left: u64::try_from(get(4)).unwrap_or(0),
                tight: usize::try_from(get(5)).unwrap_or(0),
                reset: ns(get(6)),
                failed: usize::try_from(get(7)).unwrap_or(0),
                wait: ns(get(8)),
            };
            if g.failed > 0 && result.failed == 0 {
                (result.failed, result.wait) = (group.0 + g.failed, g.wait);
            }
            if g.tight > 0 && g.left < result.left {
                (result.left, result.tight, result.reset) = (g.left, group.0 + g.tight, g.reset);
            }
            // Each group is asked for what the earlier ones granted: a group that
            // grants less names the new binding level.
            if g.binding > 0 {
                result.binding = group.0 + g.binding;
            }
            units = units.min(g.units);
            result.granted_at = g.granted_at;
            result.hold = result.hold.min(g.hold);
            done.push((group, g));
            if units == 0 {
                break;
            }
        }
        // Earlier groups may have granted more than later ones could: give back the
        // difference (and everything, when some group had nothing).
        for (g, got) in &done {
            if got.units > units {
                let _ = self
                    .call(
                        "refund",
                        chain,
                        *g,
                        now,
                        op_args(&[got.units - units, us(got.granted_at), us(got.hold)]),
                    )
                    .await;
            }
        }
        result.units = units;
        if groups.len() > 1 {
            // Several clocks may have stamped the groups: the earliest stamp and the
            // shortest hold bound every group's grant.
            result.granted_at = done.iter().map(|(_, g)| g.granted_at).min().unwrap_or(now);
        }
        Ok(result)
    }

    /// Grants up to `max` units from every level, spendable for at most `hold`.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        max: u64,
        hold: Nanos,
    ) -> Result<Grant, ServerError> {
        let g = self.grant_raw(chain, now, max, hold, 0, (0, 0, 0)).await?;
        let binding =
            (g.binding > 0).then(|| chain.levels().nth(g.binding - 1)).flatten().map(|l| l.scope);
        Ok(Grant { units: g.units, granted_at: g.granted_at, hold: g.hold, binding })
    }

    /// One lease renewal in one script call on a single Redis (the `lease` op: the
    /// old lease's unspent units back, then a grant sized by the grant rule); on a
    /// Cluster whose chain spans several hash tags, the same steps call by call.
    ///
    /// # Errors
    ///
    /// Redis unreachable, or a reply that is not the script's.
    pub async fn lease(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        renewal: &Renewal,
    ) -> Result<Leased, ServerError> {
        let back = renewal.back.unwrap_or_default();
        let groups = self.groups(chain);
        let &[group] = groups.as_slice() else {
            self.refund_grant(chain, now, back.granted_at, back.hold, back.units).await?;
            let Some(size) = renewal.size(chain, self.remaining(chain, now).await?) else {
                return Ok(Leased::Direct);
            };
            let g = self.grant(chain, now, size, renewal.ask.hold).await?;
            if !renewal.covers(g.units) {
                self.refund_grant(chain, now, g.granted_at, g.hold, g.units).await?;
                return Ok(Leased::Short);
            }
            return Ok(Leased::Granted(g));
        };
        let ask = &renewal.ask;
        let args = [
            ask.cap(),
            us(ask.hold),
            ask.cost,
            back.units,
            us(back.granted_at),
            us(back.hold),
            renewal.shares.active,
            // The script divides by the asks: the others' weighed by demand.
            renewal.shares.others_by_demand(ask.cap()),
            renewal.shares.dice >> 32,
            ask.least,
        ];
        let r = self.call("lease", chain, group, now, args).await?;
        let &[granted, units, at, hold, binding] = r.as_slice() else {
            tracing::debug!(reply = ?r, "malformed lease reply");
            return Err(StoreError::Malformed("lease").into());
        };
        match granted {
            1 => {}
            2 => return Ok(Leased::Direct),
            0 => return Ok(Leased::Short),
            _ => {
                tracing::debug!(reply = ?r, "malformed lease reply");
                return Err(StoreError::Malformed("lease").into());
            }
        }
        let units = u64::try_from(units).unwrap_or(0);
        let binding = usize::try_from(binding).ok().and_then(|b| b.checked_sub(1));
        if !renewal.covers(units) || binding.is_some_and(|b| b >= chain.len()) {
            tracing::debug!(reply = ?r, "malformed lease reply");
            return Err(StoreError::Malformed("lease").into());
        }
        Ok(Leased::Granted(Grant {
            units,
            granted_at: ns(at),
            hold: ns(hold),
            binding: binding.and_then(|b| chain.levels().nth(b)).map(|l| l.scope),
        }))
    }

    /// Units left at the tightest level.
    ///
    /// # Errors
    ///
    /// Redis unreachable.
    pub async fn remaining(&self, chain: &Chain<'_>, now: Nanos) -> Result<u64, ServerError> {
        if chain.is_empty() {
            return Ok(u64::MAX);
        }
        let mut least = u64::MAX;
        for group in self.groups(chain) {
            let r = self.call("remaining", chain, group, now, op_args(&[])).await?;
            least = least.min(u64::try_from(r.first().copied().unwrap_or(0)).unwrap_or(0));
        }
        Ok(least)
    }

    /// Every level's units left and time to a full allowance, reading only (the
    /// script saves nothing, so no key is created or refreshed).
    ///
    /// # Errors
    ///
    /// When Redis cannot be reached.
    pub async fn inspect(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
    ) -> Result<Vec<(u64, Nanos)>, ServerError> {
        let mut out = Vec::with_capacity(chain.len());
        for group in self.groups(chain) {
            let r = self.call("inspect", chain, group, now, op_args(&[])).await?;
            for pair in r.chunks_exact(2).take(group.1) {
                out.push((u64::try_from(pair[0]).unwrap_or(0), ns(pair[1])));
            }
        }
        Ok(out)
    }
}
