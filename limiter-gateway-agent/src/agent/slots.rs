//! The slot map: one slot per (tenant, route, key), each with its local balance and its lease state, in shards behind reader-writer locks.

use crate::slot::Balance;
use limiter_core::clock::Nanos;
use limiter_core::holder::{Demand, Refusal};

use super::Outcome;
use parking_lot::RwLock;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

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
    /// The last grant was less than asked (the owner divides near the limit).
    pub(super) cut: bool,
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
    /// The permits of the chain's concurrency levels held here (once the owner said
    /// the chain has some).
    pub(super) pool: std::sync::OnceLock<Box<super::permits::Pool>>,
}

impl Slot {
    /// A key seen at `now` for the first time: nothing held, nothing known.
    pub(super) fn new(tenant: &str, route: &str, key: &str, now: Nanos) -> Self {
        let slot = Self {
            key: SlotKey::new(tenant, route, key),
            balance: Balance::default(),
            due: AtomicU64::new(0),
            lease: tokio::sync::Mutex::default(),
            pool: std::sync::OnceLock::new(),
        };
        slot.balance.touch(now);
        slot
    }
}

pub(super) type SlotMap = hashbrown::HashTable<Arc<Slot>>;

/// Shards of the key map, each behind a reader-writer lock on its own cache lines: a
/// lookup takes one shard's read lock (two uncontended atomic operations); a new key
/// is inserted in place under the shard's write lock.
pub(super) const SHARDS: usize = 128;

/// One shard, alone on its cache lines (two: adjacent-line prefetch pairs them), so
/// lookups in different shards do not bounce one line between cores.
#[repr(align(128))]
#[derive(Default)]
struct Shard(RwLock<SlotMap>);

pub(super) struct Slots {
    shards: Box<[Shard]>,
    hasher: hashbrown::DefaultHashBuilder,
    /// Local decisions of keys forgotten so far (their slots are gone).
    forgotten_hits: AtomicU64,
}

impl Default for Slots {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            hasher: hashbrown::DefaultHashBuilder::default(),
            forgotten_hits: AtomicU64::new(0),
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
    fn shard(&self, hash: u64) -> &RwLock<SlotMap> {
        &self.shards[(hash >> 57) as usize % SHARDS].0
    }

    /// Applies `f` to the key's slot, if there is one (under its shard's read lock:
    /// `f` must not touch the map).
    #[inline]
    pub(super) fn with<T>(&self, r: &SlotRef<'_>, f: impl FnOnce(&Arc<Slot>) -> T) -> Option<T> {
        let hash = self.hash(r);
        self.shard(hash).read().find(hash, |s| r.matches(&s.key)).map(f)
    }

    pub(super) fn get_or_insert(&self, r: &SlotRef<'_>, make: impl FnOnce() -> Slot) -> Arc<Slot> {
        let hash = self.hash(r);
        let shard = self.shard(hash);
        if let Some(s) = shard.read().find(hash, |s| r.matches(&s.key)) {
            return s.clone();
        }
        let mut map = shard.write();
        if let Some(s) = map.find(hash, |s| r.matches(&s.key)) {
            return s.clone();
        }
        let slot = Arc::new(make());
        map.insert_unique(hash, slot.clone(), |s| self.hash(&s.key.as_ref()));
        slot
    }

    /// Inserts many new slots at once; a key already held keeps its slot.
    pub(super) fn extend(&self, new: Vec<Arc<Slot>>) {
        for s in new {
            let hash = self.hash(&s.key.as_ref());
            let mut map = self.shard(hash).write();
            if map.find(hash, |x| x.key == s.key).is_none() {
                map.insert_unique(hash, s, |x| self.hash(&x.key.as_ref()));
            }
        }
    }

    pub(super) fn all(&self) -> Vec<Arc<Slot>> {
        self.shards.iter().flat_map(|s| s.0.read().iter().cloned().collect::<Vec<_>>()).collect()
    }

    /// Local decisions made so far, the forgotten keys' included.
    pub(super) fn hits(&self) -> u64 {
        let held: u64 = self
            .shards
            .iter()
            .map(|s| s.0.read().iter().map(|x| x.balance.hits()).sum::<u64>())
            .sum();
        held + self.forgotten_hits.load(Ordering::Relaxed)
    }

    /// Forgets `slots`; a shard they leave mostly empty is shrunk (only the shards
    /// they were in are locked).
    pub(super) fn remove(&self, slots: &[Arc<Slot>]) {
        for s in slots {
            let hash = self.hash(&s.key.as_ref());
            let mut map = self.shard(hash).write();
            if let Ok(e) = map.find_entry(hash, |x| Arc::ptr_eq(x, s)) {
                e.remove();
                self.forgotten_hits.fetch_add(s.balance.hits(), Ordering::Relaxed);
            }
            if map.capacity() > 64 && map.len() < map.capacity() / 4 {
                map.shrink_to_fit(|x| self.hash(&x.key.as_ref()));
            }
        }
    }
}
