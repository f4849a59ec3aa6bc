//! One key's local lease: the hot path, atomics only.
//!
//! `balance` holds the units of the current grant not yet spent; `deadline` (agent
//! clock) is when the grant stops being spendable. Spending is a CAS loop on
//! `balance`; a renewal takes the balance out at once (`set_aside`, or `take` for a
//! give-back) before asking the owner, so a unit is either spent locally or handed
//! back, never both. What `set_aside` keeps (a flight's worth) moves to `spare`: units
//! already settled as spent with the owner, spent first while the renewal is out.
//!
//! Checked by an exhaustive stress test below rather than a `loom` model: this crate
//! depends on tokio, which cannot be built under `--cfg loom` as a dependency.

use limiter_core::clock::Nanos;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The outcome of a local spend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spend {
    /// Spent; this many units are left locally.
    Hit {
        /// Units left in the local balance.
        remaining: u64,
        /// The balance fell below the low-water mark: time to renew.
        renew: bool,
    },
    /// Not enough units, or the grant has ended: ask the owner.
    Miss,
}

/// The atomic part of a key's lease: 40 bytes in this order. Not aligned to a cache
/// line: the padding cost 40 bytes a key (a slot of 256 bytes against 216), and the
/// lease-hit bench cannot tell the aligned from the unaligned one. Local decisions
/// are counted by the caller (in the key's shard of the map, whose line a hit has
/// just locked), not here.
#[derive(Debug, Default)]
#[repr(C)]
pub struct Balance {
    balance: AtomicU64,
    deadline: AtomicU64,
    /// Units of a grant already settled with its owner (counted spent there), kept to
    /// serve requests while its renewal is out; spent first, until `spare_deadline`.
    spare: AtomicU64,
    spare_deadline: AtomicU64,
    /// When a spend or a request last touched the key, in ticks of `2^TICK_SHIFT`
    /// nanoseconds (about a millisecond), wrapping (every 52 days: a key is forgotten
    /// long before it could be idle that long): an idleness hint.
    last_used: AtomicU32,
    /// The low-water mark (`LOW_WATER` bits, `Mark`) and two flags: a renewal was
    /// asked for since the grant was installed (`RENEW_WANTED`), and the key's chain
    /// has a concurrency level held in a local pool, so that its requests need a
    /// permit too (`PERMITS`, kept here, on the line the hot path reads anyway).
    word: AtomicU32,
}

/// `Balance::word`'s flag: a renewal was asked for since the grant was installed.
const RENEW_WANTED: u32 = 1 << 30;
/// `Balance::word`'s flag: the key's requests need a permit too.
const PERMITS: u32 = 1 << 31;
/// `Balance::word`'s low-water mark.
const LOW_WATER: u32 = RENEW_WANTED - 1;

/// `Balance::last_used`'s tick: 2^20 ns, about a millisecond.
const TICK_SHIFT: u32 = 20;

/// A low-water mark in 30 bits: a 25-bit mantissa and a 5-bit shift, rounded down
/// (exact below 2^25 units; above, within 2^-24 of it, 6 parts in 100 million: a mark asks for a
/// renewal, its last digits do not matter).
struct Mark;

impl Mark {
    const MANTISSA: u32 = 25;

    fn encode(units: u64) -> u32 {
        let bits = u64::BITS - units.leading_zeros();
        let shift = bits.saturating_sub(Self::MANTISSA).min(31);
        let mantissa = (units >> shift).min((1 << Self::MANTISSA) - 1);
        // Under 2^25 and 32: exact casts.
        #[allow(clippy::cast_possible_truncation)]
        let word = (shift << Self::MANTISSA) | mantissa as u32;
        word
    }

    #[inline]
    fn decode(word: u32) -> u64 {
        let word = word & LOW_WATER;
        u64::from(word & ((1 << Self::MANTISSA) - 1)) << (word >> Self::MANTISSA)
    }
}

/// `now` in `Balance::last_used`'s ticks (the low 32 bits: it wraps).
#[inline]
fn tick(now: Nanos) -> u32 {
    // Wrapping on purpose: ages are told by wrapping differences.
    #[allow(clippy::cast_possible_truncation)]
    let t = (now >> TICK_SHIFT) as u32;
    t
}

impl Balance {
    /// A balance holding nothing, last used at `now`.
    pub fn new(now: Nanos) -> Self {
        let b = Self::default();
        b.last_used.store(tick(now), Ordering::Relaxed);
        b
    }

    /// Spends `cost` if the grant is still spendable at `now` and holds enough.
    #[inline]
    pub fn try_spend(&self, now: Nanos, cost: u64) -> Spend {
        // Acquire pairs with `install`'s Release stores: a balance read here belongs to
        // a grant whose deadline is at least the one read below (deadlines only grow
        // while a grant is installed, and a renewal empties the balance first).
        if self.spare.load(Ordering::Relaxed) >= cost
            && let Some(left) = self.try_spare(now, cost)
        {
            self.count(now);
            let remaining = left + self.balance.load(Ordering::Relaxed);
            return Spend::Hit { remaining, renew: false };
        }
        if now >= self.deadline.load(Ordering::Acquire) {
            return Spend::Miss;
        }
        let mut b = self.balance.load(Ordering::Acquire);
        loop {
            if b < cost {
                return Spend::Miss;
            }
            // AcqRel: the decrement must not be reordered with another spender's, and
            // a concurrent `take` must see it (or this CAS fails).
            match self.balance.compare_exchange_weak(
                b,
                b - cost,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now_b) => b = now_b,
            }
        }
        self.count(now);
        let remaining = b - cost;
        let renew = remaining < Mark::decode(self.word.load(Ordering::Relaxed))
            && self.word.fetch_or(RENEW_WANTED, Ordering::Relaxed) & RENEW_WANTED == 0;
        Spend::Hit { remaining, renew }
    }

    /// Whether the key's requests need a permit of its pool too.
    #[inline]
    pub fn needs_permit(&self) -> bool {
        self.word.load(Ordering::Relaxed) & PERMITS != 0
    }

    /// Says whether the key's requests need a permit of its pool too.
    pub fn set_needs_permit(&self, on: bool) {
        if on {
            self.word.fetch_or(PERMITS, Ordering::Relaxed);
        } else {
            self.word.fetch_and(!PERMITS, Ordering::Relaxed);
        }
    }

    /// Records a local decision that spent nothing here (a permit was all it took).
    #[inline]
    pub fn hit(&self, now: Nanos) {
        self.count(now);
    }

    #[inline]
    fn count(&self, now: Nanos) {
        // Relaxed, and a plain store: an idleness hint, on the cache line the CAS
        // already owns.
        self.last_used.store(tick(now), Ordering::Relaxed);
    }

    /// Spends `cost` from the spare units, if they are still spendable and enough:
    /// the spare units left.
    #[inline]
    fn try_spare(&self, now: Nanos, cost: u64) -> Option<u64> {
        // Acquire pairs with `set_aside`'s Release store: spare units read here come
        // with the deadline stored before them.
        let mut b = self.spare.load(Ordering::Acquire);
        if now >= self.spare_deadline.load(Ordering::Acquire) {
            return None;
        }
        loop {
            if b < cost {
                return None;
            }
            match self.spare.compare_exchange_weak(b, b - cost, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Some(b - cost),
                Err(now_b) => b = now_b,
            }
        }
    }

    /// Before a top-up renewal at `now`: takes the unspent units out for the owner
    /// (the renewal settles the grant with them), all but `keep`, which stay
    /// spendable as spare units until the grant's deadline while the renewal is out.
    /// Spare units of an earlier renewal still spendable join them, under the earlier
    /// of the two deadlines. Returns the units taken.
    pub fn set_aside(&self, now: Nanos, keep: u64) -> u64 {
        let units = self.balance.swap(0, Ordering::AcqRel);
        let kept = keep.min(units);
        let old = self.spare.swap(0, Ordering::AcqRel);
        let old_deadline = self.spare_deadline.load(Ordering::Acquire);
        let deadline = self.deadline.load(Ordering::Acquire);
        let (spare, until) = if old > 0 && now < old_deadline {
            (old + kept, old_deadline.min(deadline))
        } else {
            (kept, deadline)
        };
        self.spare_deadline.store(until, Ordering::Release);
        self.spare.store(spare, Ordering::Release);
        units - kept
    }

    /// Takes every unspent unit (for a renewal or a return); nothing can be spent
    /// from them afterwards.
    pub fn take(&self) -> u64 {
        self.balance.swap(0, Ordering::AcqRel)
    }

    /// Installs a new grant of `units`, spendable until `deadline`.
    pub fn install(&self, units: u64, deadline: Nanos, low_water: u64) {
        // The mark, the renewal not asked for, the permit flag as it was.
        let _ = self.word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
            Some((w & PERMITS) | Mark::encode(low_water))
        });
        // Deadline first: a spender that sees the new balance sees this deadline too.
        self.deadline.store(deadline, Ordering::Release);
        self.balance.store(units, Ordering::Release);
    }

    /// Ends the grant (direct mode, or nothing granted); spare units stay.
    pub fn clear(&self) -> u64 {
        self.deadline.store(0, Ordering::Release);
        self.take()
    }

    /// Drops the spare units (the key gives everything back).
    pub fn drop_spare(&self) {
        self.spare.store(0, Ordering::Release);
    }

    /// How long before `now` a spend or a request last touched this key (to the tick
    /// below: up to a millisecond more than it was).
    pub fn idle_for(&self, now: Nanos) -> Nanos {
        let ticks = tick(now).wrapping_sub(self.last_used.load(Ordering::Relaxed));
        // A touch after `now` (another thread's clock read later) is no idleness.
        if ticks > u32::MAX / 2 {
            return 0;
        }
        (u64::from(ticks) << TICK_SHIFT) + (now & ((1 << TICK_SHIFT) - 1))
    }

    /// When a spend or a request last touched this key, as seen at `now` (to the
    /// tick below).
    pub fn last_used(&self, now: Nanos) -> Nanos {
        now.saturating_sub(self.idle_for(now))
    }

    /// Records a use that did not spend locally (the slow path): never moves the
    /// mark back (a spend's later clock read may have stored a later tick).
    pub fn touch(&self, now: Nanos) {
        let t = tick(now);
        let _ = self.last_used.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |old| {
            (t.wrapping_sub(old) < u32::MAX / 2).then_some(t)
        });
    }

    /// Units now held (the grant's and the spare ones).
    pub fn units(&self) -> u64 {
        self.balance.load(Ordering::Acquire) + self.spare.load(Ordering::Acquire)
    }

    /// When the grant stops being spendable.
    pub fn deadline(&self) -> Nanos {
        self.deadline.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn spends_until_empty_or_expired() {
        let b = Balance::default();
        assert_eq!(b.try_spend(0, 1), Spend::Miss, "nothing installed");
        b.install(5, 100, 2);
        assert_eq!(b.try_spend(10, 3), Spend::Hit { remaining: 2, renew: false });
        assert_eq!(b.try_spend(10, 1), Spend::Hit { remaining: 1, renew: true });
        assert_eq!(b.try_spend(10, 1), Spend::Hit { remaining: 0, renew: false }, "asked once");
        assert_eq!(b.try_spend(10, 1), Spend::Miss);
        b.install(5, 100, 0);
        assert_eq!(b.try_spend(100, 1), Spend::Miss, "past the deadline");
        assert_eq!(b.take(), 5);
    }

    #[test]
    fn the_permit_flag_outlives_grants_and_the_mark_its_grant() {
        let b = Balance::default();
        b.set_needs_permit(true);
        b.install(10, 100, 5);
        assert!(b.needs_permit());
        assert_eq!(b.try_spend(1, 6), Spend::Hit { remaining: 4, renew: true });
        b.install(10, 100, u64::MAX);
        assert!(b.needs_permit(), "a grant keeps the flag");
        assert_eq!(b.try_spend(1, 1), Spend::Hit { remaining: 9, renew: true }, "asked anew");
        assert_eq!(b.try_spend(1, 1), Spend::Hit { remaining: 8, renew: false });
        b.set_needs_permit(false);
        assert!(!b.needs_permit());
        assert_eq!(std::mem::size_of::<Balance>(), 40);
    }

    /// Marks are exact below 2^25 units and rounded down within 2^-24 above; the
    /// largest saturate.
    #[test]
    fn low_water_marks_keep_their_size() {
        for units in [0, 1, 2, 1000, (1 << 25) - 1] {
            assert_eq!(Mark::decode(Mark::encode(units)), units);
        }
        for units in [1 << 25, (1 << 25) + 1, 123_456_789_012, 1 << 50, u64::MAX >> 8] {
            let back = Mark::decode(Mark::encode(units));
            assert!(back <= units && units - back <= units >> 24, "{units}: {back}");
        }
        assert!(Mark::decode(Mark::encode(u64::MAX)) >= 1 << 55);
        assert_eq!(Mark::encode(u64::MAX) & !LOW_WATER, 0, "the flags stay clear");
    }

    /// Idleness is told to the tick across the counter's wrap, and a touch never
    /// moves the last use back.
    #[test]
    fn idleness_is_told_across_the_ticks_wrap() {
        let tick = 1u64 << TICK_SHIFT;
        let start = (u64::from(u32::MAX) - 2) * tick;
        let b = Balance::new(start);
        assert_eq!(b.idle_for(start), 0);
        assert_eq!(b.idle_for(start + 10 * tick), 10 * tick);
        b.install(5, u64::MAX, 0);
        assert!(matches!(b.try_spend(start + 5 * tick, 1), Spend::Hit { .. }));
        assert_eq!(b.idle_for(start + 10 * tick), 5 * tick, "a spend past the wrap");
        b.touch(start + 4 * tick);
        assert_eq!(b.last_used(start + 10 * tick), start + 5 * tick, "not moved back");
        assert_eq!(b.idle_for(start), 0, "a use after the clock read");
    }

    #[test]
    fn spare_units_serve_first_until_their_deadline() {
        let b = Balance::default();
        b.install(10, 100, 0);
        assert_eq!(b.set_aside(10, 3), 7, "all but the spare go back");
        assert_eq!(b.try_spend(10, 2), Spend::Hit { remaining: 1, renew: false });
        b.install(5, 200, 0);
        assert_eq!(b.try_spend(10, 1), Spend::Hit { remaining: 5, renew: false }, "spare first");
        assert_eq!(b.try_spend(10, 1), Spend::Hit { remaining: 4, renew: false });
        assert_eq!(b.set_aside(10, 2), 2);
        assert_eq!(b.units(), 2);
        assert_eq!(b.try_spend(200, 1), Spend::Miss, "spare past its deadline, nothing else");
    }

    /// Many threads spend while another repeatedly takes the balance and installs a
    /// new grant: every unit is spent at most once (spent + taken == installed).
    #[test]
    fn concurrent_spends_never_exceed_the_balance() {
        for round in 0..20 {
            let b = Arc::new(Balance::default());
            b.install(1_000, u64::MAX, 0);
            let installed = Arc::new(AtomicU64::new(1_000));
            let taken = Arc::new(AtomicU64::new(0));
            let spent: u64 = std::thread::scope(|s| {
                let renewer = s.spawn(|| {
                    for _ in 0..200 {
                        taken.fetch_add(b.take(), Ordering::Relaxed);
                        installed.fetch_add(50, Ordering::Relaxed);
                        b.install(50, u64::MAX, 0);
                    }
                });
                let spenders: Vec<_> = (0..4)
                    .map(|t| {
                        let b = &b;
                        s.spawn(move || {
                            let mut mine = 0;
                            for i in 0..20_000u64 {
                                let cost = 1 + (i + t + round) % 3;
                                if let Spend::Hit { .. } = b.try_spend(1, cost) {
                                    mine += cost;
                                }
                            }
                            mine
                        })
                    })
                    .collect();
                renewer.join().unwrap();
                spenders.into_iter().map(|h| h.join().unwrap()).sum()
            });
            let left = b.take();
            assert_eq!(
                spent + taken.load(Ordering::Relaxed) + left,
                installed.load(Ordering::Relaxed),
                "round {round}: a unit was spent twice or lost"
            );
        }
    }
}
