//! The renewer's schedule: keys ordered by when they next fall due (a binary heap),
//! and the keys whose balance fell below its low-water mark since the last round. A
//! round with nothing due looks at the heap's top and returns; an idle key costs one
//! entry, looked at when its idleness is due to be checked.
//!
//! Most keys may be renewed early (their lead covers it): a round takes every key due
//! before the next round, so that keys due at scattered instants share one call and
//! rounds come no more often than every half `renew_interval`. A key whose renewal
//! must not come early (a grant that ends with a window, renewed once the next window
//! has begun; a hold shorter than a round; a level's refusal) is taken only once its
//! time has come; a hold-back's lapse is asked about at its own time or by a round
//! that comes up to [`NEAR`] before it.

use std::cmp::Ordering as Order;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use limiter_core::clock::Nanos;
use parking_lot::Mutex;

use super::slots::Slot;

/// One entry: `slot` is due at a time, perhaps exactly (stale when the slot has been
/// given another time since). 16 bytes: the time and the flags share a word.
struct Due {
    /// The time shifted left by two; bit 0 set when the key gets a round at its own
    /// time, bit 1 when a round that comes anyway may take it up to [`NEAR`] before
    /// (what the slot's `due` holds while this entry counts).
    packed: u64,
    slot: Arc<Slot>,
}

impl Due {
    fn at(&self) -> Nanos {
        self.packed >> 2
    }

    fn exact(&self) -> bool {
        self.packed & 1 == 1
    }

    fn near(&self) -> bool {
        self.packed & 2 == 2
    }
}

/// How long before its time a round that comes anyway takes a key due
/// [`When::near`] it. A holder held back past its share near the limit (the
/// owner's `held_back`) is asked about again as the hold-back lapses; the owner
/// judges a share with a fiftieth of slack, about 29 ms of the holder's rate (its
/// decayed total is about 1.44 s of it), so an ask up to this early is granted as
/// one at the lapse would be, and the lapses of a gateway's keys held back at
/// scattered instants share rounds. A level's refusal (a root ceiling's slice, a
/// window) is not asked about early: it would be refused again.
pub(super) const NEAR: Nanos = 25_000_000;

/// When a key falls due next, and how early it may be taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct When {
    pub(super) at: Nanos,
    pub(super) exact: bool,
    pub(super) near: bool,
}

impl When {
    /// Due at `at`, or up to half a round before.
    pub(super) fn by(at: Nanos) -> Self {
        Self { at, exact: false, near: false }
    }

    /// Due at `at`, not before.
    pub(super) fn at(at: Nanos) -> Self {
        Self { at, exact: true, near: false }
    }

    /// Due at `at`, with a round of its own then; a round that comes up to [`NEAR`]
    /// before takes it.
    pub(super) fn near(at: Nanos) -> Self {
        Self { at, exact: true, near: true }
    }
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.packed == other.packed
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Order> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    // The earliest first (`BinaryHeap` is a max-heap).
    fn cmp(&self, other: &Self) -> Order {
        other.packed.cmp(&self.packed)
    }
}

#[derive(Default)]
pub(super) struct Schedule {
    heap: Mutex<Heap>,
    wanted: Mutex<Vec<Arc<Slot>>>,
    /// When the renewer's next round is planned (`Nanos::MAX` while a round runs):
    /// a key due before it wakes the renewer.
    planned: AtomicU64,
    sooner: Arc<tokio::sync::Notify>,
}

/// The heap, and the size past which its stale entries are dropped.
#[derive(Default)]
struct Heap {
    entries: BinaryHeap<Due>,
    compact_at: usize,
}

/// Entries held beyond twice the live ones before stale entries are dropped (a key
/// given a new time gets a new entry, so a key asked about on every request would
/// otherwise leave one behind per request until its old times come).
const SLACK: usize = 1_024;

impl Schedule {
    /// `slot` is next due `when` (any earlier time it had no longer counts).
    pub(super) fn at(&self, slot: &Arc<Slot>, when: When) {
        let packed = (when.at.clamp(1, Nanos::MAX >> 2) << 2)
            | u64::from(when.exact)
            | (u64::from(when.near) << 1);
        slot.due.store(packed, Ordering::Relaxed);
        let mut heap = self.heap.lock();
        heap.entries.push(Due { packed, slot: slot.clone() });
        if heap.entries.len() > heap.compact_at {
            heap.entries.retain(|d| d.slot.due.load(Ordering::Relaxed) == d.packed);
            heap.compact_at = 2 * heap.entries.len() + SLACK;
        }
        drop(heap);
        if when.at < self.planned.load(Ordering::Relaxed) {
            self.sooner.notify_one();
        }
    }

    /// The renewer's next round is planned for `at` (`Nanos::MAX`: a round is running,
    /// and what falls due meanwhile is looked at once it ends). Returns what wakes the
    /// renewer when a key falls due before then.
    pub(super) fn plan(&self, at: Nanos) -> Arc<tokio::sync::Notify> {
        self.planned.store(at, Ordering::Relaxed);
        self.sooner.clone()
    }

    /// `slot` ran low: renewed in the next round.
    pub(super) fn want(&self, slot: &Arc<Slot>) {
        self.wanted.lock().push(slot.clone());
    }

    /// When the next round is to come, after one at `now` that took what was due
    /// within `early` of it: at the earliest key's time less `early` (it may come
    /// early), but not before `now + early`; at an exact key's own time. `None`: no
    /// key is scheduled.
    pub(super) fn next(&self, now: Nanos, early: Nanos) -> Option<Nanos> {
        self.heap
            .lock()
            .entries
            .peek()
            .map(|d| if d.exact() { d.at() } else { d.at().saturating_sub(early).max(now + early) })
    }

    /// The keys that ran low and those due by `now + early` (an exact key: by `now`;
    /// one due near its time: by `now + NEAR`),
    /// at most `max` of the latter, each once; their due times are cleared.
    pub(super) fn take_due(&self, now: Nanos, early: Nanos, max: usize) -> Vec<Arc<Slot>> {
        let mut out = std::mem::take(&mut *self.wanted.lock());
        let mut heap = self.heap.lock();
        let mut taken = 0;
        let mut not_yet = Vec::new();
        while taken < max {
            match heap.entries.peek() {
                Some(d) if d.at() <= now + early.max(NEAR) => {}
                _ => break,
            }
            let d = heap.entries.pop().expect("peeked");
            if d.slot.due.load(Ordering::Relaxed) != d.packed {
                continue;
            }
            // The latest time of the entries this round takes.
            let by = match (d.exact(), d.near()) {
                (false, _) => now + early,
                (true, true) => now + NEAR,
                (true, false) => now,
            };
            if d.at() > by {
                not_yet.push(d);
                continue;
            }
            d.slot.due.store(0, Ordering::Relaxed);
            out.push(d.slot);
            taken += 1;
        }
        heap.entries.extend(not_yet);
        drop(heap);
        out.sort_unstable_by_key(|s| Arc::as_ptr(s) as usize);
        out.dedup_by(|a, b| Arc::ptr_eq(a, b));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use limiter_core::clock::Nanos;

    fn slot() -> Arc<Slot> {
        Arc::new(Slot::new("t", "/r", "k", 1))
    }

    #[test]
    fn a_key_rescheduled_on_every_request_does_not_grow_the_heap() {
        let s = Schedule::default();
        let keys: Vec<_> = (0..10).map(|_| slot()).collect();
        for i in 0..100_000u64 {
            let k = &keys[(i % 10) as usize];
            s.at(k, When::by(1_000_000 + i));
        }
        let held = s.heap.lock().entries.len();
        assert!(held <= 2 * 10 + SLACK + 1, "{held} entries for 10 keys");
        // Each key once, at its last time.
        let due = s.take_due(Nanos::MAX / 2, 0, usize::MAX);
        assert_eq!(due.len(), 10);
        assert!(s.next(0, 0).is_none());
    }

    #[test]
    fn keys_come_due_in_order_and_stale_times_are_skipped() {
        let s = Schedule::default();
        let (a, b) = (slot(), slot());
        s.at(&a, When::by(30));
        s.at(&b, When::by(20));
        s.at(&a, When::by(10));
        let first = s.take_due(15, 0, usize::MAX);
        assert!(first.len() == 1 && Arc::ptr_eq(&first[0], &a));
        assert!(s.take_due(25, 0, usize::MAX).iter().all(|x| Arc::ptr_eq(x, &b)));
        assert!(s.take_due(100, 0, usize::MAX).is_empty(), "a's time 30 was stale");
    }

    #[test]
    fn keys_due_soon_share_a_round_and_exact_keys_wait_for_their_time() {
        let s = Schedule::default();
        let (a, b, c, d) = (slot(), slot(), slot(), slot());
        s.at(&a, When::by(100));
        s.at(&b, When::by(140));
        s.at(&c, When::at(120));
        s.at(&d, When::by(300));
        // A round at 100 that may renew 50 early takes a and b, not c (exact) nor d.
        let round = s.take_due(100, 50, usize::MAX);
        assert_eq!(round.len(), 2);
        assert!(
            round.iter().any(|x| Arc::ptr_eq(x, &a)) && round.iter().any(|x| Arc::ptr_eq(x, &b))
        );
        assert_eq!(s.next(100, 50), Some(120), "the exact key at its own time");
        assert!(s.take_due(120, 50, usize::MAX).iter().all(|x| Arc::ptr_eq(x, &c)));
        // d may come 50 early (at 250), and rounds are at least 50 apart.
        assert_eq!(s.next(120, 50), Some(250));
        assert_eq!(s.take_due(250, 50, usize::MAX).len(), 1);
        assert!(s.next(250, 50).is_none());
    }

    #[test]
    fn a_lapse_rides_a_round_that_comes_near_its_time_and_has_its_own_round_otherwise() {
        let s = Schedule::default();
        let (a, b, c) = (slot(), slot(), slot());
        s.at(&a, When::near(100 * NEAR));
        s.at(&b, When::near(100 * NEAR + NEAR / 2));
        s.at(&c, When::near(102 * NEAR));
        // Its own round at its time: the other lapse due within NEAR rides it.
        assert_eq!(s.next(0, 0), Some(100 * NEAR));
        assert!(s.take_due(99 * NEAR - 1, NEAR, usize::MAX).is_empty(), "too early for both");
        let round = s.take_due(100 * NEAR, 0, usize::MAX);
        assert_eq!(round.len(), 2);
        assert!(round.iter().all(|x| Arc::ptr_eq(x, &a) || Arc::ptr_eq(x, &b)));
        // A lapse further than NEAR away keeps its own time.
        assert_eq!(s.next(100 * NEAR, 0), Some(102 * NEAR));
        assert!(s.take_due(101 * NEAR - 1, NEAR / 2, usize::MAX).is_empty());
        assert_eq!(s.take_due(101 * NEAR, 0, usize::MAX).len(), 1, "a round NEAR before");
    }
}
