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
    heap: Mutex<BinaryHeap<Due>>,
    wanted: Mutex<Vec<Arc<Slot>>>,
}

impl Schedule {
    /// `slot` is next due at `at` (any earlier time it had no longer counts).
    pub(super) fn at(&self, slot: &Arc<Slot>, at: Nanos) {
        let at = at.max(1);
        slot.due.store(at, Ordering::Relaxed);
        self.heap.lock().push(Due { at, slot: slot.clone() });
    }

    /// `slot` ran low: renewed in the next round.
    pub(super) fn want(&self, slot: &Arc<Slot>) {
        self.wanted.lock().push(slot.clone());
    }

    /// When the earliest entry falls due, if any (it may be stale).
    pub(super) fn next(&self) -> Option<Nanos> {
        self.heap.lock().peek().map(|d| d.at)
    }

    /// The keys that ran low and those due by `by`, at most `max` of the latter, each
    /// once; their due times are cleared.
    pub(super) fn take_due(&self, by: Nanos, max: usize) -> Vec<Arc<Slot>> {
        let mut out = std::mem::take(&mut *self.wanted.lock());
        let mut heap = self.heap.lock();
        let mut taken = 0;
        while taken < max {
            match heap.peek() {
                Some(d) if d.at <= by => {}
                _ => break,
            }
            let d = heap.pop().expect("peeked");
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
