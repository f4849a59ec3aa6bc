//! The slot map: one slot per (tenant, route, key), each with its local balance and its lease state, in shards behind reader-writer locks.

use crate::slot::Balance;
use limiter_core::clock::Nanos;
use limiter_core::holder::{Demand, Refusal};

use super::Outcome;
use parking_lot::RwLock;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A key's names, `tenant`, `route` and `key` back to back: in the slot itself when
/// they come to at most `INLINE` bytes (32 bytes with their lengths, as many as the
/// pointer, length and allocation of a boxed string), else in an allocation of their
/// own.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum SlotKey {
    Inline { tenant_len: u8, route_len: u8, len: u8, bytes: [u8; INLINE] },
    Boxed { tenant_len: u32, route_len: u32, text: Box<str> },
}

/// The most bytes of names a slot holds in place.
const INLINE: usize = 28;

impl SlotKey {
    pub(super) fn new(tenant: &str, route: &str, key: &str) -> Self {
        let len = tenant.len() + route.len() + key.len();
        if len <= INLINE {
            let mut bytes = [0; INLINE];
            let mut at = 0;
            for part in [tenant, route, key] {
                bytes[at..at + part.len()].copy_from_slice(part.as_bytes());
                at += part.len();
            }
            // Each under 29: the casts are exact.
            #[allow(clippy::cast_possible_truncation)]
            return Self::Inline {
                tenant_len: tenant.len() as u8,
                route_len: route.len() as u8,
                len: len as u8,
                bytes,
            };
        }
        let text = [tenant, route, key].concat().into_boxed_str();
        let len = |s: &str| u32::try_from(s.len()).unwrap_or(u32::MAX);
        Self::Boxed { text, tenant_len: len(tenant), route_len: len(route) }
    }

    /// Where the tenant's and the route's names end, and the names' bytes.
    #[inline(always)]
    fn raw(&self) -> (usize, usize, &[u8]) {
        match self {
            Self::Inline { tenant_len, route_len, len, bytes } => {
                let t = usize::from(*tenant_len);
                (t, t + usize::from(*route_len), &bytes[..usize::from(*len)])
            }
            Self::Boxed { tenant_len, route_len, text } => {
                let t = *tenant_len as usize;
                (t, t + *route_len as usize, text.as_bytes())
            }
        }
    }

    pub(super) fn parts(&self) -> (&str, &str, &str) {
        let (t, r, text) = self.raw();
        (part(&text[..t]), part(&text[t..r]), part(&text[r..]))
    }

    pub(super) fn route(&self) -> &str {
        self.parts().1
    }
}

/// A part of a key's names (each was a whole `str`: never invalid).
fn part(b: &[u8]) -> &str {
    std::str::from_utf8(b).unwrap_or_default()
}

/// The borrowed form a request looks a slot up with (no allocation).
pub(super) struct SlotRef<'a> {
    pub(super) tenant: &'a str,
    pub(super) route: &'a str,
    pub(super) key: &'a str,
}

impl Hash for SlotRef<'_> {
    /// The three parts' bytes and where the first two end, in one word (what a
    /// terminator after each part would tell apart, in one write instead of three).
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write(self.tenant.as_bytes());
        state.write(self.route.as_bytes());
        state.write(self.key.as_bytes());
        state.write_u64(((self.tenant.len() as u64) << 32) ^ self.route.len() as u64);
    }
}

impl SlotRef<'_> {
    /// Whether `k` names this key: the three lengths, then the bytes of each part
    /// (short parts compared in a few word loads, without a call to `memcmp`).
    #[inline(always)]
    pub(super) fn matches(&self, k: &SlotKey) -> bool {
        let (t, r) = (self.tenant.len(), self.route.len());
        let (kt, kr, text) = k.raw();
        kt == t
            && kr == t + r
            && text.len() == t + r + self.key.len()
            && same(&text[..t], self.tenant.as_bytes())
            && same(&text[t..t + r], self.route.as_bytes())
            && same(&text[t + r..], self.key.as_bytes())
    }
}

/// Whether two byte strings of the same length are equal. Up to 16 bytes: two loads
/// of each (overlapping when shorter than twice the load), compared as integers.
#[inline(always)]
fn same(a: &[u8], b: &[u8]) -> bool {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len();
    if n > 16 || n != b.len() {
        return a == b;
    }
    if n >= 8 {
        let w =
            |s: &[u8], at: usize| u64::from_ne_bytes(s[at..at + 8].try_into().unwrap_or([0; 8]));
        return w(a, 0) == w(b, 0) && w(a, n - 8) == w(b, n - 8);
    }
    if n >= 4 {
        let w =
            |s: &[u8], at: usize| u32::from_ne_bytes(s[at..at + 4].try_into().unwrap_or([0; 4]));
        return w(a, 0) == w(b, 0) && w(a, n - 4) == w(b, n - 4);
    }
    // 0 to 3 bytes: the first, the middle and the last are all of them.
    n == 0 || (a[0] == b[0] && a[n / 2] == b[n / 2] && a[n - 1] == b[n - 1])
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
    /// The last answer held the key back for the others' shares (`denied` lapses
    /// when they have had them): asked about again by a round that comes a little
    /// before then, where a level's refusal waits for its own time.
    pub(super) held_back: bool,
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
    /// When the renewer is to look at the key next (the schedule's entry that counts,
    /// its time and flag packed; 0: none).
    pub(super) due: AtomicU64,
    /// The permits of the chain's concurrency levels held here (once the owner said
    /// the chain has some): one pointer, 8 bytes (a `OnceLock` takes 16).
    pub(super) pool: once_cell::race::OnceBox<super::permits::Pool>,
}

impl Slot {
    /// A key seen at `now` for the first time: nothing held, nothing known.
    pub(super) fn new(tenant: &str, route: &str, key: &str, now: Nanos) -> Self {
        Self {
            key: SlotKey::new(tenant, route, key),
            balance: Balance::new(now),
            due: AtomicU64::new(0),
            pool: once_cell::race::OnceBox::new(),
        }
    }

    /// Local decisions taken through a permit handle (counted in the key's pool).
    fn handle_hits(&self) -> u64 {
        self.pool.get().map_or(0, |p| p.handle_hits.load(Ordering::Relaxed))
    }
}

/// A key's slow-path state behind its async lock (held across the owner call).
pub(super) type LeaseCell = tokio::sync::Mutex<LeaseState>;

/// A key's slow-path state, locked.
pub(super) type LeaseGuard = tokio::sync::OwnedMutexGuard<LeaseState>;

pub(super) type SlotMap = hashbrown::HashTable<Arc<Slot>>;

/// The slow-path states of a shard's keys that have one, by slot: beside the map
/// rather than in each slot (16 bytes a key that idle keys, most of them, do not use).
type CellMap = hashbrown::HashTable<(Arc<Slot>, Arc<LeaseCell>)>;

/// A slot's place in its shard's `CellMap`: its address, mixed (an entry holds the
/// slot, so the address is not reused while the entry is there).
#[inline]
fn cell_hash(slot: &Arc<Slot>) -> u64 {
    let h = (Arc::as_ptr(slot) as usize as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    h ^ (h >> 29)
}

/// Shards of the key map, each behind a reader-writer lock on its own cache lines: a
/// lookup takes one shard's read lock (two uncontended atomic operations); a new key
/// is inserted in place under the shard's write lock.
pub(super) const SHARDS: usize = 128;

/// One shard, alone on its cache lines (two: adjacent-line prefetch pairs them), so
/// lookups in different shards do not bounce one line between cores.
#[repr(align(128))]
#[derive(Default)]
struct Shard {
    map: RwLock<SlotMap>,
    /// The slow-path states of the shard's keys that have one (locked after `map`
    /// when both are).
    cells: parking_lot::Mutex<CellMap>,
    /// Local decisions of the shard's keys, forgotten ones included: counted here,
    /// on the line the lookup's read lock has just written, rather than in each
    /// key's slot (8 bytes a key).
    hits: AtomicU64,
}

pub(super) struct Slots {
    shards: Box<[Shard]>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl Default for Slots {
    fn default() -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::default()).collect(),
            hasher: hashbrown::DefaultHashBuilder::default(),
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
        &self.shards[Self::shard_of(hash)].map
    }

    #[inline]
    fn shard_of(hash: u64) -> usize {
        (hash >> 57) as usize % SHARDS
    }

    /// Applies `f` to the key's slot, if there is one (under its shard's read lock:
    /// `f` must not touch the map).
    #[inline]
    pub(super) fn with<T>(&self, r: &SlotRef<'_>, f: impl FnOnce(&Arc<Slot>) -> T) -> Option<T> {
        let hash = self.hash(r);
        self.shard(hash).read().find(hash, |s| r.matches(&s.key)).map(f)
    }

    /// Applies `f` to the key's slot, if there is one, as [`Self::with`]: a `Some` is
    /// a local decision, counted.
    #[inline]
    pub(super) fn decide<T>(
        &self,
        r: &SlotRef<'_>,
        f: impl FnOnce(&Arc<Slot>) -> Option<T>,
    ) -> Option<T> {
        let hash = self.hash(r);
        let shard = &self.shards[Self::shard_of(hash)];
        let map = shard.map.read();
        let out = f(map.find(hash, |s| r.matches(&s.key))?);
        if out.is_some() {
            shard.hits.fetch_add(1, Ordering::Relaxed);
        }
        out
    }

    /// Counts a local decision of `slot`'s key (made without a lookup).
    pub(super) fn count(&self, slot: &Slot) {
        let hash = self.hash(&slot.key.as_ref());
        self.shards[Self::shard_of(hash)].hits.fetch_add(1, Ordering::Relaxed);
    }

    /// The key's slow-path state, made if it has none. A slot no longer in the map
    /// (forgotten while a request held it) gets a state of its own, kept by none.
    fn cell(&self, slot: &Arc<Slot>) -> Arc<LeaseCell> {
        let hash = self.hash(&slot.key.as_ref());
        let shard = &self.shards[Self::shard_of(hash)];
        let map = shard.map.read();
        let at = cell_hash(slot);
        let mut cells = shard.cells.lock();
        if let Some((_, c)) = cells.find(at, |(s, _)| Arc::ptr_eq(s, slot)) {
            return c.clone();
        }
        let cell = Arc::<LeaseCell>::default();
        if map.find(hash, |s| Arc::ptr_eq(s, slot)).is_some() {
            cells.insert_unique(at, (slot.clone(), cell.clone()), |(s, _)| cell_hash(s));
        }
        cell
    }

    /// The key's slow-path state, once no one else holds it (one owner call per key
    /// at a time).
    pub(super) async fn lease(&self, slot: &Arc<Slot>) -> LeaseGuard {
        self.cell(slot).lock_owned().await
    }

    /// The key's slow-path state, if no one else holds it.
    pub(super) fn try_lease(&self, slot: &Arc<Slot>) -> Option<LeaseGuard> {
        self.cell(slot).try_lock_owned().ok()
    }

    /// Drops the key's slow-path state if `idle` says it holds nothing worth keeping
    /// and no one else has it (a request about to use it has a reference, and the
    /// state stays).
    pub(super) fn shed(&self, slot: &Arc<Slot>, idle: impl FnOnce(&LeaseState) -> bool) {
        let shard = &self.shards[Self::shard_of(self.hash(&slot.key.as_ref()))];
        let mut cells = shard.cells.lock();
        if let Ok(e) = cells.find_entry(cell_hash(slot), |(s, _)| Arc::ptr_eq(s, slot)) {
            let c = &e.get().1;
            if Arc::strong_count(c) == 1 && c.try_lock().is_ok_and(|st| idle(&st)) {
                e.remove();
            }
        }
        if cells.capacity() > 64 && cells.len() < cells.capacity() / 4 {
            cells.shrink_to_fit(|(s, _)| cell_hash(s));
        }
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
        self.shards.iter().flat_map(|s| s.map.read().iter().cloned().collect::<Vec<_>>()).collect()
    }

    /// Keys held, and how many of them carry a slow-path state.
    pub(super) fn counts(&self) -> (usize, usize) {
        self.shards.iter().fold((0, 0), |(n, with), s| {
            let map = s.map.read();
            (n + map.len(), with + s.cells.lock().len())
        })
    }

    /// Local decisions made so far, the forgotten keys' included.
    pub(super) fn hits(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                let handles: u64 = s.map.read().iter().map(|x| x.handle_hits()).sum();
                s.hits.load(Ordering::Relaxed) + handles
            })
            .sum()
    }

    /// Forgets `slots` (and their slow-path states); a shard they leave mostly empty
    /// is shrunk (only the shards they were in are locked).
    pub(super) fn remove(&self, slots: &[Arc<Slot>]) {
        for s in slots {
            let hash = self.hash(&s.key.as_ref());
            let shard = &self.shards[Self::shard_of(hash)];
            let mut map = shard.map.write();
            if let Ok(e) = map.find_entry(hash, |x| Arc::ptr_eq(x, s)) {
                e.remove();
                shard.hits.fetch_add(s.handle_hits(), Ordering::Relaxed);
            }
            if let Ok(e) = shard.cells.lock().find_entry(cell_hash(s), |(x, _)| Arc::ptr_eq(x, s)) {
                e.remove();
            }
            if map.capacity() > 64 && map.len() < map.capacity() / 4 {
                map.shrink_to_fit(|x| self.hash(&x.key.as_ref()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that differ in one byte anywhere (any part, any length up to past the
    /// word loads), or only in where one part ends, never match.
    #[test]
    fn a_key_matches_only_itself() {
        for n in 0..40 {
            let key: String = (0..n).map(|i| char::from(b'a' + (i % 26) as u8)).collect();
            let k = SlotKey::new("tenant", "/route", &key);
            let same = SlotRef { tenant: "tenant", route: "/route", key: &key };
            assert!(same.matches(&k), "{n}");
            for at in 0..n {
                let mut other = key.clone().into_bytes();
                other[at] = b'Z';
                let other = String::from_utf8(other).unwrap();
                let r = SlotRef { tenant: "tenant", route: "/route", key: &other };
                assert!(!r.matches(&k), "{n} at {at}");
                let t = SlotKey::new(&other, "/route", "k");
                let r = SlotRef { tenant: &key, route: "/route", key: "k" };
                assert!(!r.matches(&t), "tenant {n} at {at}");
            }
        }
        let k = SlotKey::new("ab", "c", "d");
        assert!(!SlotRef { tenant: "a", route: "bc", key: "d" }.matches(&k));
        assert!(!SlotRef { tenant: "ab", route: "", key: "cd" }.matches(&k));
    }

    /// Names of up to 28 bytes are kept in place, longer ones boxed; both give
    /// their parts back, and a slot is 88 bytes either way.
    #[test]
    fn short_names_are_kept_in_place_and_long_ones_boxed() {
        for (t, r, k) in
            [("", "/r", ""), ("tenant", "/route", "key-000000000000"), ("é", "/ü", "ß")]
        {
            let key = SlotKey::new(t, r, k);
            assert!(matches!(key, SlotKey::Inline { .. }), "{t}{r}{k}");
            assert_eq!(key.parts(), (t, r, k));
            assert!(SlotRef { tenant: t, route: r, key: k }.matches(&key));
        }
        let long = SlotKey::new("tenant", "/route", "key-00000000000000");
        assert!(matches!(long, SlotKey::Boxed { .. }));
        assert_eq!(long.parts(), ("tenant", "/route", "key-00000000000000"));
        assert_ne!(long, SlotKey::new("tenant", "/route", "key-00000000000001"));
        assert_eq!(std::mem::size_of::<SlotKey>(), 32);
        assert_eq!(std::mem::size_of::<Slot>(), 88);
    }
}
