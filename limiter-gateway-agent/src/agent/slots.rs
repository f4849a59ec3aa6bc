//! The slot map: one slot per (tenant, route, key), each with its local balance and its lease state, in shards that readers load without a lock.

use crate::slot::Balance;
use arc_swap::ArcSwap;
use limiter_core::clock::Nanos;
use limiter_core::holder::{Demand, Refusal};

use super::Outcome;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// A key's names in one allocation: `tenant`, `route` and `key` back to back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct SlotKey {
    pub(super) text: Box<str>,
    pub(super) tenant_len: u32,
    pub(super) route_len: u32,
}

impl SlotKey {
    pub(super) fn new(tenant: &str, route: &str, key: &str) -> Self {
        let text = [tenant, route, key].concat().into_boxed_str();
        let len = |s: &str| u32::try_from(s.len()).unwrap_or(u32::MAX);
        Self { text, tenant_len: len(tenant), route_len: len(route) }
    }

    pub(super) fn parts(&self) -> (&str, &str, &str) {
        let t = self.tenant_len as usize;
        let r = t + self.route_len as usize;
        (&self.text[..t], &self.text[t..r], &self.text[r..])
    }

    pub(super) fn route(&self) -> &str {
        self.parts().1
    }
}

/// The borrowed form a request looks a slot up with (no allocation).
#[derive(Hash)]
pub(super) struct SlotRef<'a> {
    pub(super) tenant: &'a str,
    pub(super) route: &'a str,
    pub(super) key: &'a str,
}

impl SlotRef<'_> {
    pub(super) fn matches(&self, k: &SlotKey) -> bool {
        k.tenant_len as usize == self.tenant.len()
            && k.route_len as usize == self.route.len()
            && k.text.len() == self.tenant.len() + self.route.len() + self.key.len()
            && k.parts() == (self.tenant, self.route, self.key)
    }
}

impl SlotKey {
    pub(super) fn as_ref(&self) -> SlotRef<'_> {
        let (tenant, route, key) = self.parts();
        SlotRef { tenant, route, key }
    }
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) enum Mode {
    #[default]
    Unknown,
    Leased,
    Direct,
}

/// The slow-path side of a key's lease (behind an async mutex: one owner call per
/// key at a time; the balance keeps serving while a renewal is in flight).
#[derive(Debug, Default)]
pub(super) struct LeaseState {
    /// The lease whose units the balance holds (0: none).
    pub(super) lease_id: u64,
    /// Units in the balance when they were last counted (spent since = this - now).
    pub(super) counted: u64,
    pub(super) sent_at: Nanos,
    pub(super) hold: Nanos,
    pub(super) mode: Mode,
    /// The key's demand (the holder's estimate, `limiter_core::holder`): units spent,
    /// and units refused here while the key was rationed.
    pub(super) demand: Demand,
    /// The owner's last refusal of a request of this key, or the limit that cut its
    /// last grant: it answers like requests here (once the balance is spent) until
    /// it lapses (`limiter_core::holder::Refusal`).
    pub(super) denied: Option<Box<Refusal<Outcome>>>,
    /// The current grant ends with a window: renewed once the next has begun.
    pub(super) window_end: bool,
}

/// A key idle this many times `idle_after`, holding nothing, is forgotten.
pub(super) const FORGET_AFTER_IDLE: u64 = 30;

impl LeaseState {
    /// Counts what was spent from the balance since it was last counted (`units` are
    /// left now) into the demand estimate, with `more` units wanted besides, and
    /// returns the estimate as of `now`.
    pub(super) fn demand(&mut self, now: Nanos, units: u64, more: u64) -> u64 {
        self.demand.spend(self.counted.saturating_sub(units) + more);
        self.counted = units;
        self.demand.update(now)
    }
}

#[derive(Debug)]
pub(super) struct Slot {
    pub(super) balance: Balance,
    pub(super) key: SlotKey,
    /// When the renewer is to look at the key next (the entry of the schedule that
    /// counts; 0: none).
    pub(super) due: AtomicU64,
    pub(super) lease: tokio::sync::Mutex<LeaseState>,
}

impl Slot {
    /// A key seen at `now` for the first time: nothing held, nothing known.
    pub(super) fn new(tenant: &str, route: &str, key: &str, now: Nanos) -> Self {
        let slot = Self {
            key: SlotKey::new(tenant, route, key),
            balance: Balance::default(),
            due: AtomicU64::new(0),
            lease: tokio::sync::Mutex::default(),
        };
        slot.balance.touch(now);
        slot
    }
}

pub(super) type SlotMap = hashbrown::HashTable<Arc<Slot>>;

/// Shards of the key map: a read is a lock-free load of one shard's map; a new key
/// copies one shard (copy-on-write), a sixty-fourth of the keys.
pub(super) const SHARDS: usize = 64;

pub(super) struct Slots {
    pub(super) shards: Box<[ArcSwap<SlotMap>]>,
    pub(super) hasher: hashbrown::DefaultHashBuilder,
    pub(super) write: Mutex<()>,
}

impl Default for Slots {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| ArcSwap::default()).collect(),
            hasher: hashbrown::DefaultHashBuilder::default(),
            write: Mutex::new(()),
        }
    }
}

impl Slots {
    #[inline]
    pub(super) fn hash(&self, r: &SlotRef<'_>) -> u64 {
        use std::hash::BuildHasher;
        self.hasher.hash_one(r)
    }

    /// The shard of a hash: its high bits (each map probes with the low ones).
    #[inline]
    pub(super) fn shard(&self, hash: u64) -> &ArcSwap<SlotMap> {
        &self.shards[(hash >> 58) as usize % SHARDS]
    }

    /// Applies `f` to the key's slot, if there is one.
    #[inline]
    pub(super) fn with<T>(&self, r: &SlotRef<'_>, f: impl FnOnce(&Arc<Slot>) -> T) -> Option<T> {
        let hash = self.hash(r);
        self.shard(hash).load().find(hash, |s| r.matches(&s.key)).map(f)
    }

    pub(super) fn get_or_insert(&self, r: &SlotRef<'_>, make: impl FnOnce() -> Slot) -> Arc<Slot> {
        let hash = self.hash(r);
        let shard = self.shard(hash);
        if let Some(s) = shard.load().find(hash, |s| r.matches(&s.key)) {
            return s.clone();
        }
        let _w = self.write.lock();
        let current = shard.load_full();
        if let Some(s) = current.find(hash, |s| r.matches(&s.key)) {
            return s.clone();
        }
        let slot = Arc::new(make());
        let mut next = SlotMap::clone(&current);
        next.insert_unique(hash, slot.clone(), |s| self.hash(&s.key.as_ref()));
        shard.store(Arc::new(next));
        slot
    }

    /// Inserts many new slots at once (one copy of each shard they fall in); a key
    /// already held keeps its slot.
    pub(super) fn extend(&self, new: Vec<Arc<Slot>>) {
        let mut by_shard: Vec<Vec<(u64, Arc<Slot>)>> = (0..SHARDS).map(|_| Vec::new()).collect();
        for s in new {
            let hash = self.hash(&s.key.as_ref());
            by_shard[(hash >> 58) as usize % SHARDS].push((hash, s));
        }
        let _w = self.write.lock();
        for (i, add) in by_shard.into_iter().enumerate() {
            if add.is_empty() {
                continue;
            }
            let mut next = SlotMap::clone(&self.shards[i].load_full());
            next.reserve(add.len(), |s| self.hash(&s.key.as_ref()));
            for (hash, s) in add {
                if next.find(hash, |x| x.key == s.key).is_none() {
                    next.insert_unique(hash, s, |x| self.hash(&x.key.as_ref()));
                }
            }
            self.shards[i].store(Arc::new(next));
        }
    }

    pub(super) fn all(&self) -> Vec<Arc<Slot>> {
        self.shards.iter().flat_map(|s| s.load().iter().cloned().collect::<Vec<_>>()).collect()
    }

    pub(super) fn remove(&self, slots: &[Arc<Slot>]) {
        let mut by_shard: HashMap<usize, Vec<(u64, &Arc<Slot>)>> = HashMap::new();
        for s in slots {
            let hash = self.hash(&s.key.as_ref());
            by_shard.entry((hash >> 58) as usize % SHARDS).or_default().push((hash, s));
        }
        let _w = self.write.lock();
        for (i, gone) in by_shard {
            let mut next = SlotMap::clone(&self.shards[i].load_full());
            for (hash, s) in gone {
                if let Ok(e) = next.find_entry(hash, |x| Arc::ptr_eq(x, s)) {
                    e.remove();
                }
            }
            self.shards[i].store(Arc::new(next));
        }
    }
}
