//! One key's local pool of permits: the hot path of a concurrency level, atomics only.
//!
//! The pool holds blocks of permits the owner issued to this agent (each a permit of
//! several units, counted in use at the owner for as long as it is held). Its
//! `state` packs the units held (the capacity, high half) and the units lent to
//! requests (in use, low half) in one word, so that a request takes a permit with one
//! CAS and gives it back with one subtraction, and the capacity can only shrink
//! below what is in use when a block is lost (then nothing is lent until enough
//! comes back). `deadline` is when the earliest block stops being ours (agent clock,
//! less a margin): past it nothing is lent, whatever the capacity says.
//!
//! So the permits in use here never exceed the units the owner counts as held for
//! this agent, and the sum over agents never exceeds the limit.

use limiter_core::clock::Nanos;
use std::sync::atomic::{AtomicU64, Ordering};

const LOW: u64 = u32::MAX as u64;

/// The atomic part of a key's permit pool.
#[derive(Debug, Default)]
pub struct PermitPool {
    /// Capacity (units of the blocks held) in the high 32 bits, units in use in the
    /// low 32.
    state: AtomicU64,
    /// Permits may be lent until then (0: no block held).
    deadline: AtomicU64,
    /// The most units in use at once since the last [`PermitPool::take_peak`].
    peak: AtomicU64,
}

impl PermitPool {
    /// Lends `units` permits if a block is still ours at `now` and enough are free.
    #[inline]
    pub fn acquire(&self, now: Nanos, units: u64) -> bool {
        if now >= self.deadline.load(Ordering::Acquire) {
            return false;
        }
        let mut s = self.state.load(Ordering::Acquire);
        let used = loop {
            let (cap, used) = (s >> 32, s & LOW);
            if used + units > cap {
                return false;
            }
            // AcqRel: a lender must not lend what a shrinking renewer just took away.
            match self.state.compare_exchange_weak(
                s,
                s + units,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break used + units,
                Err(now_s) => s = now_s,
            }
        };
        if used > self.peak.load(Ordering::Relaxed) {
            self.peak.fetch_max(used, Ordering::Relaxed);
        }
        true
    }

    /// Returns `units` lent by [`PermitPool::acquire`].
    #[inline]
    pub fn release(&self, units: u64) {
        self.state.fetch_sub(units, Ordering::AcqRel);
    }

    /// Adds a block of `units` the owner issued, ours until `ends`.
    pub fn add(&self, units: u64, ends: Nanos) {
        let units = units.min(LOW);
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let cap = ((s >> 32) + units).min(LOW);
            match self.state.compare_exchange_weak(
                s,
                (cap << 32) | (s & LOW),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => break,
                Err(now_s) => s = now_s,
            }
        }
        // The earliest end counts: a block added to a pool that has none sets it.
        let d = self.deadline.load(Ordering::Acquire);
        if d == 0 || ends < d {
            self.deadline.store(ends, Ordering::Release);
        }
    }

    /// Takes a block of `units` out of the capacity if what is in use still fits in
    /// the rest (the block can then go back to the owner); false otherwise.
    pub fn shrink(&self, units: u64) -> bool {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let (cap, used) = (s >> 32, s & LOW);
            if cap < units || used > cap - units {
                return false;
            }
            match self.state.compare_exchange_weak(
                s,
                ((cap - units) << 32) | used,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(now_s) => s = now_s,
            }
        }
    }

    /// Takes a lost block of `units` out of the capacity, whatever is in use (what
    /// runs on beyond it is no longer counted at the owner; nothing more is lent
    /// until it comes back).
    pub fn lose(&self, units: u64) {
        let mut s = self.state.load(Ordering::Acquire);
        loop {
            let cap = (s >> 32).saturating_sub(units);
            match self.state.compare_exchange_weak(
                s,
                (cap << 32) | (s & LOW),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(now_s) => s = now_s,
            }
        }
    }

    /// Sets when the earliest block held stops being ours (0: none held).
    pub fn set_deadline(&self, deadline: Nanos) {
        self.deadline.store(deadline, Ordering::Release);
    }

    /// When the earliest block held stops being ours (0: none held).
    pub fn deadline(&self) -> Nanos {
        self.deadline.load(Ordering::Acquire)
    }

    /// Units held (the blocks') and units in use.
    pub fn units(&self) -> (u64, u64) {
        let s = self.state.load(Ordering::Acquire);
        (s >> 32, s & LOW)
    }

    /// The most units in use at once since the last call; starts the next count from
    /// what is in use now.
    pub fn take_peak(&self) -> u64 {
        let used = self.units().1;
        self.peak.swap(used, Ordering::Relaxed).max(used)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::AtomicBool;

    #[test]
    fn lends_what_its_blocks_hold_until_their_end() {
        let p = PermitPool::default();
        assert!(!p.acquire(0, 1), "nothing held");
        p.add(2, 100);
        assert!(p.acquire(10, 1));
        assert!(p.acquire(10, 1));
        assert!(!p.acquire(10, 1), "two of two in use");
        p.release(1);
        assert!(p.acquire(10, 1));
        assert!(!p.acquire(100, 1), "past the block's end");
        assert_eq!(p.units(), (2, 2));
        assert_eq!(p.take_peak(), 2);
    }

    #[test]
    fn shrinks_only_what_is_not_in_use_and_loses_whatever() {
        let p = PermitPool::default();
        p.add(3, 100);
        p.add(2, 50);
        assert_eq!(p.deadline(), 50, "the earliest block's end");
        assert!(p.acquire(0, 4));
        assert!(!p.shrink(2), "4 in use do not fit in 3");
        p.release(2);
        assert!(p.shrink(2));
        assert_eq!(p.units(), (3, 2));
        p.lose(3);
        assert_eq!(p.units(), (0, 2), "in use beyond the capacity");
        p.add(3, 100);
        assert!(p.acquire(0, 1));
        assert!(!p.acquire(0, 1), "the two still running count against the new block");
    }

    /// Threads lend and return while another adds and shrinks blocks: no snapshot of
    /// the pool has more in use than held, the units lent (counted apart) never
    /// exceed the most ever held, and every unit comes back.
    #[test]
    fn concurrent_lending_never_exceeds_the_capacity() {
        for _ in 0..10 {
            let p = Arc::new(PermitPool::default());
            p.add(8, u64::MAX);
            let stop = AtomicBool::new(false);
            let in_use = AtomicU64::new(0);
            let worst = AtomicU64::new(0);
            let most_cap = AtomicU64::new(8);
            std::thread::scope(|s| {
                s.spawn(|| {
                    for i in 0..2_000u64 {
                        if i % 2 == 0 {
                            p.add(4, u64::MAX);
                            most_cap.fetch_max(p.units().0, Ordering::Relaxed);
                        } else {
                            while !p.shrink(4) {
                                std::hint::spin_loop();
                            }
                        }
                    }
                    stop.store(true, Ordering::Relaxed);
                });
                for t in 0..3u64 {
                    let (p, stop, in_use, worst) = (&p, &stop, &in_use, &worst);
                    s.spawn(move || {
                        let mut i = t;
                        while !stop.load(Ordering::Relaxed) {
                            let units = 1 + i % 3;
                            i += 1;
                            if p.acquire(0, units) {
                                let now = in_use.fetch_add(units, Ordering::SeqCst) + units;
                                worst.fetch_max(now, Ordering::SeqCst);
                                let (cap, used) = p.units();
                                assert!(used <= cap, "{used} in use with {cap} held");
                                in_use.fetch_sub(units, Ordering::SeqCst);
                                p.release(units);
                            }
                        }
                    });
                }
            });
            assert!(
                worst.load(Ordering::SeqCst) <= most_cap.load(Ordering::SeqCst),
                "lent {} with at most {} held",
                worst.load(Ordering::SeqCst),
                most_cap.load(Ordering::SeqCst)
            );
            assert_eq!(p.units(), (8, 0), "every lent unit came back");
        }
    }
}
