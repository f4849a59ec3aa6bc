//! The owner's book of open leases and the agents it has seen lately.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::lease::{LeaseBook, LeaseRecord, Shares};
use limiter_proto::limiter::v1 as pb;
use parking_lot::Mutex;

use crate::metrics as m;

/// A chain's identity in the book: tenant, route, key.
type ChainKey = (Box<str>, Box<str>, Option<Box<str>>);

/// A holder counts as active on a chain this long after its last ask for it, at
/// most (an agent's ask says when it asks again: see `Owner::active_for`).
pub(super) const ACTIVE_FOR: Nanos = 2 * NANOS_PER_SEC;

/// The most chains whose asks are kept (beyond it, stale ones are dropped first and
/// then the table is cleared: shares fall back to "plenty left" rules until the
/// holders ask again), and the most holders counted per chain.
const MAX_CHAINS: usize = 100_000;
const MAX_HOLDERS: usize = 256;

/// The most a holder's reported demand counts, in units a second per unit of its ask:
/// an honest ask covers at least 50 ms of demand (two spans of a renewal interval of
/// 25 ms or more), so a holder cannot claim a chain's budget by reporting a demand it
/// does not ask for (and a reported `u64::MAX` cannot make the others' parts nothing).
const DEMAND_PER_ASKED: u64 = 20;

/// Demands are kept in thousandths of a unit a second (a rate holder's demand for a
/// key is often under a unit a second).
pub(super) const DEMAND_SCALE: u64 = 1_000;

/// How long a chain counts as near its limit after a grant for it was cut short.
const NEAR_FOR: Nanos = NANOS_PER_SEC;

/// The longest a holder past its share is held back at once. Its agent keeps the
/// refusal and asks again just before it lapses, so a longer wait is fewer owner
/// calls; but the wait is an estimate from decayed totals (a small holder one unit
/// over its share is owed a long one), and a longer cap starves small holders.
/// Measured on 2026-12-04 (BENCHMARKS.md, "accuracy and locality"): 50 ms, about 20
/// owner calls per 1000 decisions in the `loadtest` lease-exactness scenario; 75 ms,
/// 16, but the fairness test's second-smallest agent below half its fair share in a
/// second in one of three runs on a loaded machine; 100 ms, 14-15 and the accuracy
/// test's token buckets at 97.0-97.6% of the reference (its floor is 97%); 250 ms,
/// 13-14 and a small agent 9-12% under its share.
const HELD_BACK_MOST: Nanos = NANOS_PER_SEC / 20;

/// The half-life of the units granted per holder that fair shares compare.
const GRANTED_HALF_LIFE: Nanos = NANOS_PER_SEC;

/// A holder's last ask for a chain, and what it was granted lately.
#[derive(Debug, Clone, Copy)]
struct Asked {
    holder: u64,
    cap: u64,
    /// Its reported demand, thousandths of a unit a second (0: not reported).
    demand: u64,
    seen: Nanos,
    /// When it stops counting as active unless it asks again.
    until: Nanos,
    /// Units granted less those given back, decayed by half every `GRANTED_HALF_LIFE`
    /// since `at`.
    granted: f64,
    at: Nanos,
}

impl Asked {
    fn granted_at(&self, now: Nanos) -> f64 {
        #[allow(clippy::cast_precision_loss)] // a ratio of nanoseconds
        let halves = now.saturating_sub(self.at) as f64 / GRANTED_HALF_LIFE as f64;
        self.granted * 0.5f64.powf(halves)
    }
}

/// The active holders of one chain, and when a grant for it was last cut short.
#[derive(Debug, Default)]
struct ChainAsks {
    holders: Vec<Asked>,
    cut_at: Option<Nanos>,
    /// What its rate holders' rounds left in the chain's tightest level.
    low: Option<LowWater>,
}

/// The least a chain's tightest level held after a rate holder's grant, over two
/// spans of its holders' rounds: the current span's and the previous one's.
#[derive(Debug, Clone, Copy)]
struct LowWater {
    from: Nanos,
    span: Nanos,
    now: u64,
    before: Option<u64>,
}

impl LowWater {
    fn record(&mut self, left: u64, span: Nanos, now: Nanos) {
        if now < self.from {
            *self = Self { from: now, span, now: left, before: None };
        } else if now.saturating_sub(self.from) >= span {
            let next = now.saturating_sub(self.from) < span.saturating_mul(2);
            *self = Self { from: now, span, now: left, before: next.then_some(self.now) };
        } else {
            (self.now, self.span) = (self.now.min(left), span);
        }
    }

    /// The stock, once a whole span (a whole round of every holder) is on record
    /// and the record is no older than a span.
    fn stock(&self, now: Nanos) -> Option<u64> {
        let fresh = now >= self.from && now.saturating_sub(self.from) < self.span;
        self.before.filter(|_| fresh).map(|b| b.min(self.now))
    }
}

/// The owner's lease state.
#[derive(Debug)]
pub struct Leases {
    pub(super) book: Mutex<LeaseBook<ChainKey>>,
    /// What each active holder last asked for, by chain (a hash of its names).
    asks: Mutex<HashMap<u64, ChainAsks>>,
    /// Keys the chains' hashes with this process's own random key, so that callers
    /// cannot choose names whose asks collide with another chain's.
    chains: std::hash::RandomState,
    /// With replication: leases opened or settled since the replicator last took
    /// them, with their ring names.
    changes: Mutex<Changes>,
}

/// Leases changed since the replicator last took them.
#[derive(Debug, Default)]
struct Changes {
    tracking: bool,
    ids: Vec<(u64, Box<str>)>,
    /// More changed than [`MAX_CHANGES`]: the replicas need a full copy.
    overflowed: bool,
}

/// The most lease changes kept between two replication rounds.
const MAX_CHANGES: usize = 200_000;

impl Default for Leases {
    fn default() -> Self {
        // Ids start at a random point, so leases that move between nodes keep ids
        // no other node has issued.
        let first = std::hash::RandomState::new().hash_one(0u64) >> 2;
        Self {
            book: Mutex::new(LeaseBook::starting_at(first)),
            asks: Mutex::default(),
            chains: std::hash::RandomState::new(),
            changes: Mutex::default(),
        }
    }
}

/// A stable 64-bit id for an agent's name.
pub(super) fn holder(agent: &str) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(agent)
}

impl Leases {
    /// Writes off leases that reached their end; publishes the book's totals.
    #[allow(clippy::cast_precision_loss)] // gauge values
    pub fn expire(&self, now: Nanos) {
        let mut book = self.book.lock();
        let gone = book.expire(now);
        let t = book.totals();
        drop(book);
        self.forget_stale_asks(now);
        if !gone.is_empty() {
            tracing::debug!(leases = gone.len(), "leases written off at their end");
        }
        metrics::gauge!(m::LEASES_OUTSTANDING).set(t.outstanding as f64);
        metrics::gauge!(m::LEASES_OPEN).set(t.open as f64);
        metrics::counter!(m::LEASE_UNITS, "fate" => "granted").absolute(t.granted);
        metrics::counter!(m::LEASE_UNITS, "fate" => "returned").absolute(t.returned);
        metrics::counter!(m::LEASE_UNITS, "fate" => "spent").absolute(t.spent);
        metrics::counter!(m::LEASE_UNITS, "fate" => "written_off").absolute(t.written_off);
    }

    /// The book's totals.
    pub fn totals(&self) -> limiter_core::lease::LeaseTotals {
        self.book.lock().totals()
    }

    /// Removes the open leases whose ring name (tenant, or a root key's name)
    /// `moving` accepts, as handoff messages with that name.
    pub fn take_moving(&self, moving: impl Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        self.book.lock().take_where(|k| moving(&k.0)).into_iter().map(wire).collect()
    }

    /// Notes that lease `id` (of ring name `name`) was opened or settled, for the
    /// replicas.
    pub(super) fn changed(&self, id: u64, name: &str) {
        let mut c = self.changes.lock();
        if !c.tracking {
            return;
        }
        if c.ids.len() < MAX_CHANGES {
            c.ids.push((id, name.into()));
        } else {
            c.overflowed = true;
        }
    }

    /// The leases changed since the last call: those open now, and those settled (by
    /// id, with their ring names). The first call starts the tracking.
    pub fn take_changes(&self) -> crate::cluster::LeaseChanges {
        let (ids, overflowed) = {
            let mut c = self.changes.lock();
            c.tracking = true;
            (std::mem::take(&mut c.ids), std::mem::take(&mut c.overflowed))
        };
        let book = self.book.lock();
        let mut out = crate::cluster::LeaseChanges { overflowed, ..Default::default() };
        for (id, name) in ids {
            match book.get(id) {
                Some(r) => out.open.push(wire((id, r.clone()))),
                None => out.closed.push((id, name)),
            }
        }
        out
    }

    /// The open leases whose ring name `pick` accepts, left open.
    pub fn open_where(&self, pick: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        self.book.lock().open_where(|k| pick(&k.0)).into_iter().map(wire).collect()
    }

    /// Takes over leases another node granted; returns how many.
    pub fn adopt(&self, leases: &[pb::LeaseState]) -> u64 {
        let mut book = self.book.lock();
        let mut n = 0;
        for l in leases {
            let key = (
                l.tenant.as_str().into(),
                l.route.as_str().into(),
                l.key.as_deref().map(Into::into),
            );
            let record = LeaseRecord {
                holder: l.holder,
                key,
                units: l.units,
                granted_at: l.granted_at,
                hold: l.hold,
            };
            n += u64::from(book.adopt(l.id, record));
        }
        n
    }

    /// The id of the chain a lease item names (its names and level) in the asks.
    pub(super) fn chain_id(&self, item: &pb::LeaseItem) -> u64 {
        self.chains.hash_one((&item.tenant, &item.route, &item.key, item.level))
    }

    /// Records that `holder` asks for `cap` units of `chain` at `now` (0: it gives its
    /// lease back and asks nothing), at a demand of `demand` thousandths of a unit a
    /// second ([`DEMAND_SCALE`]), counting as active for `active_for` unless it asks
    /// again (at most [`ACTIVE_FOR`]), and returns who else is asking: what the grant
    /// rule divides near the limit.
    pub(super) fn shares(
        &self,
        chain: u64,
        holder: u64,
        (cap, demand): (u64, u64),
        active_for: Nanos,
        now: Nanos,
    ) -> Shares {
        let until = now.saturating_add(active_for.min(ACTIVE_FOR));
        let fresh = |a: &Asked| now < a.until;
        let mut asks = self.asks.lock();
        if asks.len() >= MAX_CHAINS && !asks.contains_key(&chain) {
            asks.retain(|_, e| {
                e.holders.retain(fresh);
                !e.holders.is_empty()
            });
            if asks.len() >= MAX_CHAINS {
                asks.clear();
            }
        }
        let e = asks.entry(chain).or_default();
        e.holders.retain(fresh);
        let others: u64 = e
            .holders
            .iter()
            .filter(|a| a.holder != holder)
            .map(|a| a.cap)
            .fold(0, u64::saturating_add);
        let demand = demand.min(cap.saturating_mul(DEMAND_PER_ASKED * DEMAND_SCALE));
        // The others' demand, if every one of them reported it.
        let others_demand = e
            .holders
            .iter()
            .filter(|a| a.holder != holder)
            .try_fold(0u64, |sum, a| (a.demand > 0).then(|| sum.saturating_add(a.demand)));
        let mine = e.holders.iter().position(|a| a.holder == holder);
        let active = (e.holders.len() - usize::from(mine.is_some())) as u64 + 1;
        match mine {
            Some(i) if cap > 0 => {
                let a = &mut e.holders[i];
                (a.cap, a.demand, a.seen, a.until) = (cap, demand, now, until);
            }
            Some(i) => {
                e.holders.swap_remove(i);
            }
            None if cap > 0 && e.holders.len() < MAX_HOLDERS => {
                let a = Asked { holder, cap, demand, seen: now, until, granted: 0.0, at: now };
                e.holders.push(a);
            }
            None => {}
        }
        let demand = match others_demand {
            Some(others) if demand > 0 => (demand, others.saturating_add(demand)),
            _ => (0, 0),
        };
        if e.holders.is_empty() {
            asks.remove(&chain);
        }
        // A draw for the share's fraction: the book's ids and the clock, mixed.
        let mut z = now ^ holder.rotate_left(29) ^ chain.rotate_left(7);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Shares { active, others, dice: z ^ (z >> 31), demand, whole: false }
    }

    /// Whether `holder` is past its fair share of `chain` at `now`: near the limit (a
    /// grant was cut short within `NEAR_FOR`), the units granted to it lately and not
    /// given back (decayed) exceed its ask's part of all the asks times all the units
    /// granted.
    /// `Some(wait)`: about when its share has grown by a unit; `None`: it may be
    /// granted.
    pub(super) fn past_share(&self, chain: u64, holder: u64, now: Nanos) -> Option<Nanos> {
        let asks = self.asks.lock();
        let e = asks.get(&chain)?;
        if e.holders.len() < 2 || now.saturating_sub(e.cut_at?) >= NEAR_FOR {
            return None;
        }
        let me = e.holders.iter().find(|a| a.holder == holder)?;
        // Only holders that asked lately compete: near the limit a live holder asks
        // every round, and one gone quiet (dead, or idle) must not keep a share the
        // others are held back for.
        let competing =
            || e.holders.iter().filter(|a| now.saturating_sub(a.seen) < NEAR_FOR && now < a.until);
        if competing().count() < 2 {
            return None;
        }
        // Its part of the competing holders' demand where all reported it, else of
        // their asks (as the grant rule divides).
        let by_demand = competing().all(|a| a.demand > 0) && me.demand > 0;
        #[allow(clippy::cast_precision_loss)] // unit counts and rates, compared
        let weight = |a: &Asked| if by_demand { a.demand as f64 } else { a.cap as f64 };
        let fair = weight(me) / competing().map(weight).sum::<f64>();
        let total: f64 = competing().map(|a| a.granted_at(now)).sum();
        // A fiftieth of its share of slack: holders about at their share are not
        // held back (units kept in the bucket wait for a holder that may come late).
        let over = me.granted_at(now) - fair * total;
        if over <= 0.02 * fair * total {
            return None;
        }
        // Decayed by half a second at a time, the total is about 1.44 s of the rate
        // granted; the holder's share of that rate pays back `over`.
        let rate = fair * total / std::f64::consts::LOG2_E;
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let wait = (over / rate.max(1e-9) * NANOS_PER_SEC as f64) as Nanos;
        Some(wait.clamp(1_000_000, HELD_BACK_MOST))
    }

    /// Counts `units` granted (or charged for a request) to `holder` on `chain`.
    pub(super) fn granted(&self, chain: u64, holder: u64, units: u64, now: Nanos) {
        #[allow(clippy::cast_precision_loss)] // unit counts
        self.add_granted(chain, holder, units as f64, now);
    }

    /// Counts `units` of `holder`'s earlier grant on `chain` given back unspent: what
    /// it is weighed by near the limit is what it took and kept (a top-up hands the
    /// unspent units back and is granted afresh: counting both would weigh a holder
    /// that renews often as if it took its balance again at each renewal).
    pub(super) fn returned(&self, chain: u64, holder: u64, units: u64, now: Nanos) {
        #[allow(clippy::cast_precision_loss)] // unit counts
        self.add_granted(chain, holder, -(units as f64), now);
    }

    /// Adds `units` (fewer when negative, never below none) to what `holder` holds of
    /// `chain`'s grants as of `now`.
    fn add_granted(&self, chain: u64, holder: u64, units: f64, now: Nanos) {
        let mut asks = self.asks.lock();
        if let Some(a) =
            asks.get_mut(&chain).and_then(|e| e.holders.iter_mut().find(|a| a.holder == holder))
        {
            a.granted = (a.granted_at(now) + units).max(0.0);
            a.at = now;
        }
    }

    /// Records what a rate holder's grant on `chain` left in its tightest level at
    /// `now`, the holders' rounds `span` apart.
    pub(super) fn left_after_rates(&self, chain: u64, left: u64, span: Nanos, now: Nanos) {
        if let Some(e) = self.asks.lock().get_mut(&chain) {
            match &mut e.low {
                Some(l) => l.record(left, span, now),
                None => e.low = Some(LowWater { from: now, span, now: left, before: None }),
            }
        }
    }

    /// What the rate holders' rounds of `chain` have lately left unpaid in its
    /// tightest level (the least it held after their grants over the last two
    /// rounds), if known.
    pub(super) fn stock(&self, chain: u64, now: Nanos) -> Option<u64> {
        self.asks.lock().get(&chain)?.low?.stock(now)
    }

    /// A grant for `chain` was cut short at `now`: it is near its limit.
    pub(super) fn cut(&self, chain: u64, now: Nanos) {
        if let Some(e) = self.asks.lock().get_mut(&chain) {
            e.cut_at = Some(now);
        }
    }

    /// Drops the asks of holders not seen for a while.
    fn forget_stale_asks(&self, now: Nanos) {
        self.asks.lock().retain(|_, e| {
            e.holders.retain(|a| now < a.until);
            !e.holders.is_empty()
        });
    }
}

/// A lease as the wire carries it between nodes.
pub(super) fn wire((id, r): (u64, LeaseRecord<ChainKey>)) -> pb::LeaseState {
    pb::LeaseState {
        id,
        holder: r.holder,
        tenant: r.key.0.to_string(),
        route: r.key.1.to_string(),
        key: r.key.2.map(|k| k.to_string()),
        units: r.units,
        granted_at: r.granted_at,
        hold: r.hold,
    }
}

impl crate::cluster::LeaseBook for Leases {
    fn take_moving(&self, moving: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        Self::take_moving(self, moving)
    }

    fn take_changes(&self) -> crate::cluster::LeaseChanges {
        Self::take_changes(self)
    }

    fn open_where(&self, pick: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        Self::open_where(self, pick)
    }

    fn adopt(&self, leases: &[pb::LeaseState]) -> u64 {
        Self::adopt(self, leases)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stock is the least a chain's level held after the rate holders' grants
    /// over a whole span of their rounds and the current one; unknown before a whole
    /// span is on record, and once the record is older than a span.
    #[test]
    fn the_stock_is_what_the_rounds_left_over_the_last_two_spans() {
        let leases = Leases::default();
        let ms = NANOS_PER_SEC / 1_000;
        let (span, t) = (500 * ms, 10 * NANOS_PER_SEC);
        leases.shares(1, 10, (20, 50_000), ACTIVE_FOR, t);
        assert_eq!(leases.stock(1, t), None);
        // A round: the first grant leaves 40, the last 7.
        leases.left_after_rates(1, 40, span, t);
        leases.left_after_rates(1, 7, span, t + ms);
        assert_eq!(leases.stock(1, t + 2 * ms), None, "no whole span on record yet");
        // The next round, a span later: the first grant leaves 30, and the stock is
        // the last round's low until this round's is lower.
        leases.left_after_rates(1, 30, span, t + span);
        assert_eq!(leases.stock(1, t + span + ms), Some(7));
        leases.left_after_rates(1, 3, span, t + span + 2 * ms);
        assert_eq!(leases.stock(1, t + span + 3 * ms), Some(3));
        // Two spans on, the round of `t` is forgotten.
        leases.left_after_rates(1, 12, span, t + 2 * span);
        leases.left_after_rates(1, 9, span, t + 2 * span + ms);
        assert_eq!(leases.stock(1, t + 2 * span + 2 * ms), Some(3));
        leases.left_after_rates(1, 11, span, t + 3 * span + ms);
        assert_eq!(leases.stock(1, t + 3 * span + 2 * ms), Some(9));
        // No round for a span: unknown (a stale low would pay a stock long spent).
        assert_eq!(leases.stock(1, t + 4 * span + ms), None);
        // A gap of two spans starts afresh.
        leases.left_after_rates(1, 50, span, t + 6 * span);
        assert_eq!(leases.stock(1, t + 6 * span + ms), None);
    }

    /// Near the limit the parts follow reported demand, and a demand far beyond a
    /// holder's ask counts only as far as its ask goes.
    #[test]
    fn a_reported_demand_counts_within_what_the_holder_asks() {
        let leases = Leases::default();
        let now = NANOS_PER_SEC;
        // Demands in thousandths of a unit a second.
        leases.shares(1, 10, (3, 7_000), ACTIVE_FOR, now);
        let s = leases.shares(1, 11, (36, 72_000), ACTIVE_FOR, now);
        assert_eq!(s.demand, (72_000, 79_000));
        assert_eq!(s.others, 3);
        let greedy = leases.shares(1, 12, (5, u64::MAX), ACTIVE_FOR, now);
        assert_eq!(greedy.demand, (100_000, 179_000), "at most 20 a second per unit asked");
        let honest = leases.shares(1, 10, (3, 7_000), ACTIVE_FOR, now);
        assert_eq!(honest.demand, (7_000, 179_000));
    }

    /// A holder counts among the active ones for as long as its ask said, at most the
    /// book's two seconds: one silent past that is gone, and the others share alone.
    #[test]
    fn a_holder_silent_past_its_next_ask_no_longer_counts() {
        let leases = Leases::default();
        let now = NANOS_PER_SEC;
        let ms = NANOS_PER_SEC / 1_000;
        leases.shares(1, 10, (20, 50_000), 1_250 * ms, now);
        leases.shares(1, 12, (20, 50_000), 10 * ACTIVE_FOR, now);
        let s = leases.shares(1, 11, (20, 50_000), 1_250 * ms, now + 1_249 * ms);
        assert_eq!((s.active, s.others), (3, 40), "both others within their time");
        let s = leases.shares(1, 11, (20, 50_000), 1_250 * ms, now + 1_250 * ms);
        assert_eq!((s.active, s.others, s.demand), (2, 20, (50_000, 100_000)), "10 gone");
        let s = leases.shares(1, 11, (20, 50_000), 1_250 * ms, now + ACTIVE_FOR);
        assert_eq!((s.active, s.others), (1, 0), "no longer than the book's time");
    }

    /// Near the limit a holder is weighed by what it took and kept: a holder that
    /// renews by handing its unspent units back and being granted afresh is not past
    /// its share for the units it gave back (counted twice, they kept it refused in
    /// the load test while the units sat in the bucket).
    #[test]
    fn units_given_back_do_not_count_against_a_holders_share() {
        let leases = Leases::default();
        let now = NANOS_PER_SEC;
        // Two holders of equal demand, near the limit.
        leases.shares(1, 10, (20, 50_000), ACTIVE_FOR, now);
        leases.shares(1, 11, (20, 50_000), ACTIVE_FOR, now);
        leases.cut(1, now);
        // Each took 30 units; holder 10 renewed twice more, giving back 20 of 30 each
        // time.
        leases.granted(1, 10, 30, now);
        leases.granted(1, 11, 30, now);
        for _ in 0..2 {
            leases.returned(1, 10, 20, now);
            leases.granted(1, 10, 30, now);
        }
        // It keeps 50 against the other's 30: past its share, held back for a while.
        let wait = leases.past_share(1, 10, now).expect("past its share");
        assert!(wait > 0 && wait <= HELD_BACK_MOST, "{wait}");
        assert_eq!(leases.past_share(1, 11, now), None, "the other is within its share");
        // Had it given back all but what the other kept, it would be within its share.
        leases.returned(1, 10, 20, now);
        assert_eq!(leases.past_share(1, 10, now), None);
    }
}
