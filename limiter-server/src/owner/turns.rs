//! Turns at a concurrency level: callers refused a permit wait in line, so that the
//! permits that come back go to the caller that has waited longest, not to whichever
//! asks first after they come back.
//!
//! Without a line, a freed permit goes to the first ask that reaches the owner. Agents
//! that retry on the same cadence fall into step (their answers leave together, so
//! their next asks do too), and the same one wins every race while another is refused
//! every time. With a line, a refused caller that says it will wait (`turn` set in its
//! request) is given a turn; asking again with the turn keeps its place. An ask that
//! waits in line is admitted only if the level can hold its cost on top of the units
//! every live waiter ahead of it asked for (a new one is behind them all). Callers
//! that do not wait in line (no `turn`: clients that predate it, an agent's direct
//! decisions) are decided as before, on what is free: held behind the line, they
//! would never be served while it is never empty.
//!
//! A waiter that does not ask again within [`STALE`] has left the line: the units it
//! held in reserve are free again. A turn nobody issued is a new place at the back,
//! never a better one. Each level's line holds at most [`MAX_LINE`] waiters and the
//! owner at most [`MAX_LINES`] lines: past either, a refused caller is not given a
//! turn (it is served as before lines existed), and nothing else is dropped.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;

use limiter_core::Scope;
use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::policy::{Chain, Level};
use parking_lot::Mutex;

/// A waiter that has not asked again for this long has left the line.
pub(crate) const STALE: Nanos = NANOS_PER_SEC / 5;

/// Waiters in one level's line at most.
pub(crate) const MAX_LINE: usize = 64;

/// Levels with a line at once at most.
pub(crate) const MAX_LINES: usize = 16_384;

/// The owner's lines, one per concurrency level with waiters.
#[derive(Debug, Default)]
pub(crate) struct Turns {
    key: std::hash::RandomState,
    lines: Mutex<Lines>,
}

#[derive(Debug, Default)]
struct Lines {
    by_level: HashMap<u64, VecDeque<Waiter>>,
    serial: u64,
}

#[derive(Debug, Clone, Copy)]
struct Waiter {
    turn: u64,
    units: u64,
    seen: Nanos,
}

/// Drops the waiters that left `line` by `now`; whether any is left.
fn prune(line: &mut VecDeque<Waiter>, now: Nanos) -> bool {
    line.retain(|w| now.saturating_sub(w.seen) < STALE);
    !line.is_empty()
}

impl Turns {
    fn level(&self, l: &Level<'_>) -> u64 {
        super::permits::level_hash(&self.key, l)
    }

    /// For each concurrency level of `chain` with a line, the units its live waiters
    /// ahead of `turn` wait for (all of them when `turn` is not in its line). Empty,
    /// and nothing allocated, when no level has a line.
    pub(crate) fn ahead(&self, chain: &Chain<'_>, turn: u64, now: Nanos) -> Vec<(Scope, u64)> {
        let mut lines = self.lines.lock();
        if lines.by_level.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        for l in chain.levels().filter(|l| l.rule.limit.is_concurrency()) {
            let h = self.level(&l);
            let Some(line) = lines.by_level.get_mut(&h) else { continue };
            if !prune(line, now) {
                lines.by_level.remove(&h);
                continue;
            }
            let units = line
                .iter()
                .take_while(|w| w.turn != turn)
                .fold(0u64, |s, w| s.saturating_add(w.units));
            if units > 0 {
                out.push((l.scope, units));
            }
        }
        out
    }

    /// Puts the caller holding `turn` (0: none yet) in the line of `chain`'s level at
    /// `scope`, waiting for `units`, seen at `now`: its place kept if it has one, the
    /// back of the line otherwise. Returns its turn; 0 when it was not given one (a
    /// full line, or too many lines).
    pub(crate) fn wait(
        &self,
        chain: &Chain<'_>,
        scope: Scope,
        turn: u64,
        units: u64,
        now: Nanos,
    ) -> u64 {
        let Some(level) =
            chain.levels().find(|l| l.scope == scope && l.rule.limit.is_concurrency())
        else {
            return 0;
        };
        let h = self.level(&level);
        let mut lines = self.lines.lock();
        if lines.by_level.len() >= MAX_LINES && !lines.by_level.contains_key(&h) {
            lines.by_level.retain(|_, line| prune(line, now));
            if lines.by_level.len() >= MAX_LINES {
                return 0;
            }
        }
        lines.serial += 1;
        let fresh = self.key.hash_one((h, lines.serial)).max(1);
        let line = lines.by_level.entry(h).or_default();
        prune(line, now);
        if turn != 0
            && let Some(w) = line.iter_mut().find(|w| w.turn == turn)
        {
            w.seen = now;
            w.units = units;
            return turn;
        }
        if line.len() >= MAX_LINE {
            return 0;
        }
        line.push_back(Waiter { turn: fresh, units, seen: now });
        fresh
    }

    /// The caller holding `turn` was admitted: out of every line of `chain`.
    pub(crate) fn served(&self, chain: &Chain<'_>, turn: u64) {
        let mut lines = self.lines.lock();
        if lines.by_level.is_empty() {
            return;
        }
        for l in chain.levels().filter(|l| l.rule.limit.is_concurrency()) {
            let h = self.level(&l);
            if let Some(line) = lines.by_level.get_mut(&h) {
                line.retain(|w| w.turn != turn);
                if line.is_empty() {
                    lines.by_level.remove(&h);
                }
            }
        }
    }

    /// Waiters in every line (the live and those not yet pruned).
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.lines.lock().by_level.values().map(VecDeque::len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use limiter_core::policy::{Request, from_yaml};

    const MS: Nanos = 1_000_000;

    fn policy() -> limiter_core::policy::Policy {
        from_yaml(
            "version: 1\ntenants:\n  acme:\n    routes:\n      /a: { algorithm: concurrency, limit: 2, permit_ttl: 5s }\n      /b: { algorithm: concurrency, limit: 2, permit_ttl: 5s }\n",
            "p.yaml",
        )
        .unwrap()
    }

    #[test]
    fn waiters_are_served_in_the_order_they_came_and_leave_when_quiet() {
        let p = policy();
        let names = Default::default();
        let a = p.resolve(&Request::new("acme", "/a"), &names).unwrap();
        let b = p.resolve(&Request::new("acme", "/b"), &names).unwrap();
        let s = Scope::TenantRoute;
        let t = Turns::default();
        assert!(t.ahead(&a, 0, 0).is_empty(), "no line yet");
        let first = t.wait(&a, s, 0, 1, 0);
        let second = t.wait(&a, s, 0, 2, MS);
        assert!(first != 0 && second != 0 && first != second);
        // The first has nobody ahead; the second has the first's unit; a newcomer,
        // or a turn nobody issued, has both.
        assert!(t.ahead(&a, first, 2 * MS).is_empty());
        assert_eq!(t.ahead(&a, second, 2 * MS), vec![(s, 1)]);
        assert_eq!(t.ahead(&a, 0, 2 * MS), vec![(s, 3)]);
        assert_eq!(t.ahead(&a, 12_345, 2 * MS), vec![(s, 3)]);
        // Another level's line is its own.
        assert!(t.ahead(&b, 0, 2 * MS).is_empty());
        // Asking again keeps the place; being served leaves the line.
        assert_eq!(t.wait(&a, s, second, 1, 3 * MS), second);
        t.served(&a, first);
        assert!(t.ahead(&a, second, 3 * MS).is_empty());
        assert_eq!(t.ahead(&a, 0, 3 * MS), vec![(s, 1)]);
        // Quiet for STALE: gone, and its reserve with it.
        assert!(t.ahead(&a, 0, 3 * MS + STALE).is_empty());
        assert_eq!(t.waiting(), 0);
    }

    #[test]
    fn a_line_is_bounded_and_a_full_one_gives_no_turn() {
        let p = policy();
        let a = p.resolve(&Request::new("acme", "/a"), &Default::default()).unwrap();
        let t = Turns::default();
        for i in 0..MAX_LINE as u64 {
            assert_ne!(t.wait(&a, Scope::TenantRoute, 0, 1, i), 0);
        }
        assert_eq!(t.wait(&a, Scope::TenantRoute, 0, 1, MAX_LINE as u64), 0);
        assert_eq!(t.waiting(), MAX_LINE);
        // A scope with no concurrency level is no line.
        assert_eq!(t.wait(&a, Scope::Tenant, 0, 1, 0), 0);
    }
}
