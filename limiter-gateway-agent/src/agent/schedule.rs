//! The renewer's schedule: keys ordered by when they next fall due (a binary heap),
//! and the keys whose balance fell below its low-water mark since the last round. A
//! round with nothing due looks at the heap's top and returns; an idle key costs one
//! entry, looked at when its idleness is due to be checked.

use std::cmp::Ordering as Order;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use limiter_core::clock::Nanos;
use parking_lot::Mutex;

use super::slots::Slot;

/// One entry: `slot` is due at `at` (stale when the slot has been given another time
/// since).
struct Due {
    at: Nanos,
    slot: Arc<Slot>,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
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
        other.at.cmp(&self.at)
    }
}

#[derive(Default)]
pub(super) struct Schedule {
    heap: Mutex<Heap>,
    wanted: Mutex<Vec<Arc<Slot>>>,
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
    /// `slot` is next due at `at` (any earlier time it had no longer counts).
    pub(super) fn at(&self, slot: &Arc<Slot>, at: Nanos) {
        let at = at.max(1);
        slot.due.store(at, Ordering::Relaxed);
        let mut heap = self.heap.lock();
        heap.entries.push(Due { at, slot: slot.clone() });
        if heap.entries.len() > heap.compact_at {
            heap.entries.retain(|d| d.slot.due.load(Ordering::Relaxed) == d.at);
            heap.compact_at = 2 * heap.entries.len() + SLACK;
        }
    }

    /// `slot` ran low: renewed in the next round.
    pub(super) fn want(&self, slot: &Arc<Slot>) {
        self.wanted.lock().push(slot.clone());
    }

    /// When the earliest entry falls due, if any (it may be stale).
    pub(super) fn next(&self) -> Option<Nanos> {
        self.heap.lock().entries.peek().map(|d| d.at)
    }

    /// The keys that ran low and those due by `by`, at most `max` of the latter, each
    /// once; their due times are cleared.
    pub(super) fn take_due(&self, by: Nanos, max: usize) -> Vec<Arc<Slot>> {
        let mut out = std::mem::take(&mut *self.wanted.lock());
        let mut heap = self.heap.lock();
        let mut taken = 0;
        while taken < max {
            match heap.entries.peek() {
                Some(d) if d.at <= by => {}
                _ => break,
            }
            let d = heap.entries.pop().expect("peeked");
            if d.slot.due.load(Ordering::Relaxed) == d.at {
                d.slot.due.store(0, Ordering::Relaxed);
                out.push(d.slot);
                taken += 1;
            }
        }
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
            s.at(k, 1_000_000 + i);
        }
        let held = s.heap.lock().entries.len();
        assert!(held <= 2 * 10 + SLACK + 1, "{held} entries for 10 keys");
        // Each key once, at its last time.
        let due = s.take_due(Nanos::MAX, usize::MAX);
        assert_eq!(due.len(), 10);
        assert!(s.next().is_none());
    }

    #[test]
    fn keys_come_due_in_order_and_stale_times_are_skipped() {
        let s = Schedule::default();
        let (a, b) = (slot(), slot());
        s.at(&a, 30);
        s.at(&b, 20);
        s.at(&a, 10);
        let first = s.take_due(15, usize::MAX);
        assert!(first.len() == 1 && Arc::ptr_eq(&first[0], &a));
        assert!(s.take_due(25, usize::MAX).iter().all(|x| Arc::ptr_eq(x, &b)));
        assert!(s.take_due(100, usize::MAX).is_empty(), "a's time 30 was stale");
    }
}
