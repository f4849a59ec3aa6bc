//! The owner's book of leases: which batches of units are out, with whom, until when.
//!
//! Leases are pre-paid: the units of a grant are debited from every level of its chain
//! when it is made ([`crate::Limiter::grant`]), so the book never has to charge
//! anything; it decides what may come back. A holder that returns unspent units before
//! the lease's end gets them refunded exactly (the caller restores the levels); a lease
//! that reaches its end is written off as spent, whatever its holder did with it:
//! under-admission, never overshoot. A lease settles once; a duplicate or late return
//! refunds nothing.

use std::collections::HashMap;

use crate::clock::Nanos;

/// One lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRecord<K> {
    /// Who holds it (an agent).
    pub holder: u64,
    /// What it was granted for (the caller's chain key).
    pub key: K,
    /// Units granted.
    pub units: u64,
    /// When it was granted (owner clock).
    pub granted_at: Nanos,
    /// How long it may be spent; the owner writes it off at `granted_at + hold`.
    pub hold: Nanos,
}

impl<K> LeaseRecord<K> {
    /// When the owner writes it off.
    pub fn expires_at(&self) -> Nanos {
        self.granted_at.saturating_add(self.hold)
    }
}

/// How a return was settled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled<K> {
    /// No such open lease (never granted, already settled, or written off).
    Unknown,
    /// The lease had reached its end: written off, nothing refunded.
    Expired(LeaseRecord<K>),
    /// Closed; `refund` units (at most the unspent ones) go back to the levels.
    Closed {
        /// The lease.
        record: LeaseRecord<K>,
        /// Units to restore.
        refund: u64,
    },
}

/// Totals kept by the book.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseTotals {
    /// Units granted.
    pub granted: u64,
    /// Units refunded by returns.
    pub returned: u64,
    /// Units reported spent.
    pub spent: u64,
    /// Units written off by expiry (holder gone or silent).
    pub written_off: u64,
    /// Units out now.
    pub outstanding: u64,
    /// Leases open now.
    pub open: u64,
}

/// The open leases of one owner.
#[derive(Debug)]
pub struct LeaseBook<K> {
    next_id: u64,
    open: HashMap<u64, LeaseRecord<K>>,
    totals: LeaseTotals,
}

impl<K> Default for LeaseBook<K> {
    fn default() -> Self {
        Self { next_id: 1, open: HashMap::new(), totals: LeaseTotals::default() }
    }
}

impl<K> LeaseBook<K> {
    /// An empty book whose ids start at `first` (nodes draw it at random, so ids
    /// from different owners do not collide when leases move between them).
    pub fn starting_at(first: u64) -> Self {
        Self { next_id: first.max(1), open: HashMap::new(), totals: LeaseTotals::default() }
    }
}

impl<K: Clone> LeaseBook<K> {
    /// Records a grant (already debited) and returns its id.
    pub fn open(&mut self, record: LeaseRecord<K>) -> u64 {
        let id = self.next_id;
        self.next_id = self.next_id.checked_add(1).unwrap_or(1);
        self.totals.granted += record.units;
        self.totals.outstanding += record.units;
        self.totals.open += 1;
        self.open.insert(id, record);
        id
    }

    /// Settles lease `id` of `holder` at `now`, with `unspent` units handed back.
    pub fn settle(&mut self, id: u64, holder: u64, now: Nanos, unspent: u64) -> Settled<K> {
        match self.open.get(&id) {
            Some(r) if r.holder == holder => {}
            _ => return Settled::Unknown,
        }
        let record = self.open.remove(&id).expect("checked above");
        self.totals.outstanding -= record.units;
        self.totals.open -= 1;
        if now >= record.expires_at() {
            self.totals.written_off += record.units;
            return Settled::Expired(record);
        }
        let refund = unspent.min(record.units);
        self.totals.returned += refund;
        self.totals.spent += record.units - refund;
        Settled::Closed { record, refund }
    }

    /// Writes off every lease that has reached its end; returns them.
    pub fn expire(&mut self, now: Nanos) -> Vec<(u64, LeaseRecord<K>)> {
        let ids: Vec<u64> =
            self.open.iter().filter(|(_, r)| now >= r.expires_at()).map(|(id, _)| *id).collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let r = self.open.remove(&id).expect("listed above");
            self.totals.outstanding -= r.units;
            self.totals.open -= 1;
            self.totals.written_off += r.units;
            out.push((id, r));
        }
        out
    }

    /// The open lease `id`.
    pub fn get(&self, id: u64) -> Option<&LeaseRecord<K>> {
        self.open.get(&id)
    }

    /// Units of leases still spendable at `now` (open and not yet at their end).
    pub fn live_units(&self, now: Nanos) -> u64 {
        self.open.values().filter(|r| now < r.expires_at()).map(|r| r.units).sum()
    }

    /// The book's totals.
    pub fn totals(&self) -> LeaseTotals {
        self.totals
    }

    /// Removes and returns the open leases whose key `take` accepts (their owner
    /// hands them to another node): they leave the book neither spent nor returned.
    pub fn take_where(&mut self, take: impl Fn(&K) -> bool) -> Vec<(u64, LeaseRecord<K>)> {
        let ids: Vec<u64> =
            self.open.iter().filter(|(_, r)| take(&r.key)).map(|(id, _)| *id).collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            let r = self.open.remove(&id).expect("listed above");
            self.totals.outstanding -= r.units;
            self.totals.open -= 1;
            out.push((id, r));
        }
        out
    }

    /// Copies of the open leases whose key `pick` accepts (a replica's full copy).
    pub fn open_where(&self, pick: impl Fn(&K) -> bool) -> Vec<(u64, LeaseRecord<K>)> {
        self.open.iter().filter(|(_, r)| pick(&r.key)).map(|(id, r)| (*id, r.clone())).collect()
    }

    /// Takes over lease `id` granted by another node (a handoff): its holder settles
    /// it here. An id already open here is kept (false).
    pub fn adopt(&mut self, id: u64, record: LeaseRecord<K>) -> bool {
        if id == 0 || self.open.contains_key(&id) {
            return false;
        }
        self.totals.outstanding += record.units;
        self.totals.open += 1;
        self.open.insert(id, record);
        true
    }
}

/// What a grant is sized from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    /// Units the holder asked for.
    pub want: u64,
    /// The request waiting for the grant (it must fit; 0: none).
    pub cost: u64,
    /// The holder's demand, units per second.
    pub demand_per_sec: u64,
    /// How long the grant may be spent.
    pub hold: Nanos,
    /// The route's `max_batch` (no cap for a node's slice).
    pub most: u64,
    /// The smallest grant the holder can use: less is not granted (0: any).
    pub least: u64,
}

impl Ask {
    /// The part of the grant rule that does not depend on what is left: what the
    /// holder asked for (at least 1, at most `most`), no more than it can spend in
    /// the hold at its demand.
    pub fn cap(&self) -> u64 {
        let by_time = u128::from(self.demand_per_sec) * u128::from(self.hold)
            / u128::from(crate::clock::NANOS_PER_SEC)
            + 1;
        self.want.clamp(1, self.most.max(1)).min(u64::try_from(by_time).unwrap_or(u64::MAX))
    }
}

/// Who else wants units of a chain: what its owner divides near the limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Shares {
    /// Holders with open leases or recent asks on the chain, this one included
    /// (0: a node's slice, which never goes direct).
    pub active: u64,
    /// What the other active holders last asked for, in total.
    pub others: u64,
    /// A random draw (any `u64`): the fraction of a proportional share is granted
    /// with its probability, so a small holder's share is paid on average instead of
    /// being rounded to nothing on every grant.
    pub dice: u64,
    /// The holders' reported demand (units a second): this holder's, and every active
    /// holder's in all (this one's included). When both are known, the proportional
    /// share follows them rather than the asks: an ask is a whole number of units
    /// (a holder at 3.6 units a round asks 3, a tenth less than its part), a demand
    /// is not rounded to the round. 0: unknown, the asks decide.
    pub demand: (u64, u64),
    /// The holder pays for a rate it hands on (the RLQS service), and what it asks
    /// for is spent at that rate: no cap at half of what is left (which would hold a
    /// lone holder to half its limit's rate); the proportional part still applies.
    pub whole: bool,
}

impl Shares {
    /// The others' asks as a divider that weighs by asks must see them for a holder
    /// asking `mine` to be given its part by demand: where every holder's demand is
    /// known, `mine x (all - my demand) / my demand` (rounded to the nearest unit),
    /// so that `mine / (mine + others)` is its part of the demand; else what the
    /// others asked. (The Redis store's `lua/chain.lua` divides by the asks: given
    /// the others' asks as they are, a holder asking a whole batch took nearly all
    /// of what was left beside one asking for its demand, whatever the demands.
    /// Where what is left covers its ask and these, the script grants the whole
    /// ask, within half of what is left: a holder asking less than its part of the
    /// demand gets it sooner than [`share`] would give it, one asking more later.)
    ///
    /// # Examples
    ///
    /// ```
    /// use limiter_core::lease::Shares;
    /// // Asking 16 at a demand of 80 a second, of 280 in all: the others weigh 40.
    /// let s = Shares { active: 2, others: 1_000, dice: 0, demand: (80, 280), whole: false };
    /// assert_eq!(s.others_by_demand(16), 40);
    /// let unknown = Shares { demand: (0, 0), ..s };
    /// assert_eq!(unknown.others_by_demand(16), 1_000);
    /// ```
    pub fn others_by_demand(&self, mine: u64) -> u64 {
        match self.demand {
            (d, all) if d > 0 && all >= d => {
                let others = u128::from(mine) * u128::from(all - d);
                let scaled = (others + u128::from(d) / 2) / u128::from(d);
                u64::try_from(scaled).unwrap_or(u64::MAX)
            }
            _ => self.others,
        }
    }
}

/// The share of what is left one grant may take, for a holder asking `mine` (its cap,
/// [`Ask::cap`]): everything asked while what is left covers every active holder's
/// ask, else a part in proportion to what each asked (Doorman's proportional share),
/// and never more than half of what is left, so no more than half the remaining
/// budget can be stranded by one grant. Where every active holder reported its
/// demand ([`Shares::demand`]), the part follows the demands instead of the asks.
/// The Redis store's `lease` script (`lua/chain.lua`) applies the same rule with the
/// asks, given the others' asks weighed by demand ([`Shares::others_by_demand`]):
/// the same part where what is left is short of them.
///
/// # Examples
///
/// ```
/// use limiter_core::lease::{Shares, share};
/// // 100 left, this holder asks 30, the others 270 in all: a tenth (30 * 100 / 300).
/// let crowd = Shares { active: 10, others: 270, dice: 0, demand: (0, 0), whole: false };
/// assert_eq!(share(100, 30, &crowd), 10);
/// // Plenty left: what was asked, within half of it.
/// assert_eq!(share(1_000, 30, &crowd), 30);
/// ```
pub fn share(remaining: u64, mine: u64, shares: &Shares) -> u64 {
    let total = mine.saturating_add(shares.others);
    let fair = if total <= remaining {
        mine
    } else {
        // In proportion to demand where every holder's is known, else to the asks.
        let (part_of, whole_of) = match shares.demand {
            (d, all) if d > 0 && all >= d => (d, all),
            _ => (mine, total),
        };
        let exact = u128::from(remaining) * u128::from(part_of);
        let whole = exact / u128::from(whole_of.max(1));
        let part = exact % u128::from(whole_of.max(1));
        // The fraction, paid with its probability (the dice's high 32 bits, as the
        // Redis script reads it).
        let draw = (u128::from(shares.dice >> 32) * u128::from(whole_of.max(1))) >> 32;
        u64::try_from(whole + u128::from(draw < part)).unwrap_or(u64::MAX).min(mine)
    };
    if shares.whole { fair.min(remaining) } else { fair.min(remaining / 2) }
}

/// Budgets too small to split: when a chain's tightest capacity is less than two
/// requests' cost for each active holder, the owner decides each waiting request
/// itself (direct mode) instead of granting (a grant would strand units at a gateway
/// whose next request may come too late to use them). `active` 0 (a node's slice)
/// never goes direct.
pub fn goes_direct(capacity: u64, cost: u64, active: u64) -> bool {
    active > 0 && capacity < cost.max(1).saturating_mul(active).saturating_mul(2)
}

/// The grant rule: [`Ask::cap`] within the [`share`] of what is left, and never less
/// than the waiting request's cost (when it fits).
pub fn grant_size(ask: &Ask, remaining: u64, shares: &Shares) -> u64 {
    let units = share(remaining, ask.cap(), shares).max(ask.cost);
    if units < ask.least { 0 } else { units }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(units: u64, at: Nanos) -> LeaseRecord<&'static str> {
        LeaseRecord { holder: 7, key: "k", units, granted_at: at, hold: 100 }
    }

    #[test]
    fn leases_move_between_books_and_settle_where_they_arrive() {
        let mut old = LeaseBook::starting_at(1_000);
        let mut new = LeaseBook::starting_at(5_000);
        let a = old.open(rec(10, 0));
        let b = old.open(LeaseRecord { key: "other", ..rec(3, 0) });
        let moved = old.take_where(|k| *k == "k");
        assert_eq!(moved.len(), 1);
        assert_eq!(old.totals().outstanding, 3);
        for (id, r) in moved {
            assert!(new.adopt(id, r));
        }
        assert!(!new.adopt(a, rec(1, 0)), "an id already open is kept");
        assert_ne!(a, b);
        assert!(matches!(new.settle(a, 7, 50, 4), Settled::Closed { refund: 4, .. }));
        assert_eq!(old.settle(a, 7, 50, 4), Settled::Unknown);
    }

    #[test]
    fn returns_refund_once_and_expiry_writes_off() {
        let mut b = LeaseBook::default();
        let a = b.open(rec(10, 0));
        let c = b.open(rec(5, 0));
        assert_eq!(b.settle(a, 8, 50, 4), Settled::Unknown, "another holder");
        assert!(matches!(b.settle(a, 7, 50, 40), Settled::Closed { refund: 10, .. }));
        assert_eq!(b.settle(a, 7, 60, 4), Settled::Unknown, "settled once");
        assert!(matches!(b.settle(c, 7, 100, 5), Settled::Expired(_)));
        let t = b.totals();
        assert_eq!(
            (t.granted, t.returned, t.written_off, t.outstanding, t.open),
            (15, 10, 5, 0, 0)
        );
        b.open(rec(3, 200));
        assert_eq!(b.expire(299).len(), 0);
        assert_eq!(b.expire(300).len(), 1);
        assert_eq!(b.totals().written_off, 8);
    }
}

#[cfg(test)]
mod grant_rule {
    use super::*;
    use crate::clock::NANOS_PER_SEC;

    const SEC: Nanos = NANOS_PER_SEC;

    fn ask() -> Ask {
        Ask { want: 100, cost: 1, demand_per_sec: 1_000, hold: SEC, most: 500, least: 0 }
    }

    /// Plenty left for one holder.
    fn size(a: &Ask) -> u64 {
        grant_size(a, 10_000, &Shares { active: 1, ..Shares::default() })
    }

    #[test]
    fn a_grant_is_what_was_asked_within_the_batch_cap() {
        assert_eq!(size(&ask()), 100);
        assert_eq!(size(&Ask { want: 10_000, ..ask() }), 500, "max_batch");
        assert_eq!(size(&Ask { want: 0, ..ask() }), 1, "at least one unit");
    }

    #[test]
    fn a_grant_is_no_more_than_the_holder_can_spend_in_its_hold() {
        // 10 units a second for 2 s: 21 (the +1 keeps a slow key from getting 0).
        assert_eq!(size(&Ask { demand_per_sec: 10, hold: 2 * SEC, ..ask() }), 21);
        assert_eq!(size(&Ask { demand_per_sec: 0, ..ask() }), 1);
    }

    #[test]
    fn near_the_limit_shares_follow_what_each_holder_asked() {
        let busy = Ask { want: 10_000, most: u64::MAX, demand_per_sec: 1_000_000, ..ask() };
        let alone = Shares { active: 1, ..Shares::default() };
        // Half of what is left while it covers every ask.
        assert_eq!(grant_size(&busy, 4_000, &alone), 2_000);
        assert_eq!(
            grant_size(&ask(), 4_000, &Shares { active: 3, others: 200, ..Shares::default() }),
            100
        );
        // Not enough for every ask: in proportion to them (1 of 1 + 4 asked).
        let small = Ask { want: 100, ..busy };
        let crowd = Shares { active: 5, others: 400, ..Shares::default() };
        assert_eq!(grant_size(&small, 400, &crowd), 80);
        // Never below the waiting request's cost, even when that is all there is.
        assert_eq!(grant_size(&Ask { cost: 3, ..ask() }, 3, &crowd), 3);
        assert_eq!(
            grant_size(&Ask { cost: 0, ..ask() }, 1, &alone),
            0,
            "half of one unit is nothing"
        );
        // Less than the least the holder can use is nothing; the least or more is
        // granted as the rule sizes it.
        let rate = Shares { active: 0, whole: true, ..Shares::default() };
        let least = Ask { cost: 0, least: 3, ..ask() };
        assert_eq!(grant_size(&least, 2, &rate), 0);
        assert_eq!(grant_size(&least, 3, &rate), 3);
        assert_eq!(grant_size(&least, 50, &rate), 50);
    }

    #[test]
    fn a_fraction_of_a_share_is_paid_with_its_probability() {
        // 10 left, a holder asking 1 of 30 in all: a third of a unit per grant.
        let mut paid = 0;
        for i in 0..3_000u64 {
            let dice = i.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            paid += share(10, 1, &Shares { active: 10, others: 29, dice, ..Shares::default() });
        }
        assert!((900..=1_100).contains(&paid), "{paid} of 1000 expected");
        assert_eq!(
            share(10, 1, &Shares { active: 2, others: 29, dice: u64::MAX, ..Shares::default() }),
            0,
            "a third"
        );
        assert_eq!(share(10, 1, &Shares { active: 2, others: 29, ..Shares::default() }), 1);
        // Demand known: 100 left among asks of 3 and 192 (demands 7 and 393 a
        // second) is divided by demand: 1.75 units, 1 or 2 by the dice, not the 1.54
        // the asks say; never more than the ask.
        let by_demand =
            |dice| Shares { active: 2, others: 192, dice, demand: (7, 400), whole: false };
        assert_eq!(share(100, 3, &by_demand(u64::MAX)), 1);
        assert_eq!(share(100, 3, &by_demand(0)), 2);
        let paid: u64 = (0..1_000u64).map(|i| share(100, 3, &by_demand(i << 54))).sum();
        assert!((1_700..=1_800).contains(&paid), "{paid}");
        let big = Shares { active: 2, others: 192, dice: 0, demand: (300, 400), whole: false };
        assert_eq!(share(100, 3, &big), 3, "at most the ask");
    }

    #[test]
    fn a_rate_holder_may_take_all_that_is_left_but_not_more_than_its_part() {
        let alone = Shares { active: 0, whole: true, ..Shares::default() };
        assert_eq!(share(100, 80, &alone), 80, "no cap at half of what is left");
        assert_eq!(share(100, 500, &alone), 100, "never more than is left");
        assert_eq!(share(100, 80, &Shares { whole: false, ..alone }), 50);
        // Near the limit, its part of what is left still follows demand.
        let crowd = Shares { others: 300, demand: (1, 4), ..alone };
        assert_eq!(share(100, 80, &crowd), 25);
    }

    #[test]
    fn direct_mode_below_two_requests_per_active_holder() {
        assert!(goes_direct(19, 1, 10));
        assert!(!goes_direct(20, 1, 10));
        assert!(goes_direct(11, 3, 2), "cost 3 for each of 2 holders");
        assert!(goes_direct(1, 0, 1), "a renewal with nothing waiting counts one unit");
        assert!(!goes_direct(0, 5, 0), "a node's slice never goes direct");
    }
}
