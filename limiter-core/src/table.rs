//! The in-memory table of limit states: sharded, bounded, evicting.
//!
//! Keys are hashed once (`ahash`); the hash picks a shard and files the entry inside
//! it. A decision locks the shards of its levels in ascending order, so two
//! decisions can never deadlock, and holds them only while it computes.
//!
//! Memory is bounded by `max_keys`. Entries whose state is back to a full allowance
//! ("idle") carry no information and are dropped first, losslessly; only when a
//! shard is full of live entries is an eighth of them evicted (counted apart, since
//! forgetting live usage can admit more than the limit): the least used, then the
//! least recently used. A flood of keys seen once thus evicts its own kind before a
//! counter in steady use; each eviction round takes one use off every survivor, so a
//! counter that stops being used ages out within as many rounds as it had uses.
//!
//! Optionally, the counters of the key scope are also capped per tenant
//! ([`StateTable::with_keys_per_tenant`]): one tenant's flood of distinct keys then
//! stops at its own cap ([`StateTable::admits`]) instead of evicting other tenants'
//! counters.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use hashbrown::HashTable;
use hashbrown::hash_table::Entry;
use parking_lot::{Mutex, MutexGuard};

use crate::algorithm::Algorithm;
use crate::clock::Nanos;
use crate::decision::Scope;
use crate::key::{LimitKey, LimitKeyRef};
use crate::limit::{Limit, LimitState};

/// The most levels one decision touches (global, route, tenant, tenant x route, key).
pub const MAX_LEVELS: usize = 4 + 2 * crate::policy::Budgets::MAX;

/// One stored counter: 80 bytes, plus the key's text.
#[derive(Debug, Clone)]
pub struct Slot {
    key: LimitKey,
    /// The limit the state was built for; a reload that changes it resets the state.
    /// Shared with the policy, so thousands of keys of one rule hold one copy.
    pub limit: Arc<Limit>,
    /// When a decision last touched this slot (nanoseconds, the low bits cleared) and,
    /// in those bits, how many decisions touched it, less one per eviction round it
    /// survived (at most [`USES`]), and whether it changed since its changes were
    /// last taken ([`CHANGED`]): one word, so a slot stays 80 bytes.
    touched: u64,
    /// The algorithm state.
    pub state: LimitState,
}

/// The low bits of [`Slot::touched`] that count uses.
const USES: u64 = 31;

/// The bit of [`Slot::touched`] set while the slot has a change not yet taken
/// ([`StateTable::take_changes`]).
const CHANGED: u64 = 32;

/// The low bits of [`Slot::touched`] that are not time.
const LOW: u64 = USES | CHANGED;

impl Slot {
    /// The key this slot counts for.
    pub fn key(&self) -> &LimitKey {
        &self.key
    }

    /// When a decision last touched this slot (to 64 ns).
    pub fn last_seen(&self) -> Nanos {
        self.touched & !LOW
    }

    fn changed(&self) -> bool {
        self.touched & CHANGED != 0
    }

    fn uses(&self) -> u64 {
        self.touched & USES
    }

    fn touch(&mut self, now: Nanos) {
        let uses = (self.uses() + 1).min(USES);
        self.touched = self.last_seen().max(now & !LOW) | (self.touched & CHANGED) | uses;
    }

    /// One use less: a counter that stops being used ages out.
    fn age(&mut self) {
        self.touched -= u64::from(self.uses() > 0);
    }
}

#[repr(align(64))] // one shard per cache line: no false sharing between shard locks
struct Shard(Mutex<HashTable<Slot>>);

/// Counters the table keeps about itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TableStats {
    /// Keys held now.
    pub keys: u64,
    /// Idle entries dropped (lossless).
    pub evicted_idle: u64,
    /// Live entries evicted because the table was full.
    pub evicted_live: u64,
}

/// Key-scope counters by tenant, in one shard of [`TenantKeys`].
type TenantCounts = Mutex<HashMap<Box<str>, u32, ahash::RandomState>>;

/// How many key-scope counters each tenant holds, when they are capped.
struct TenantKeys {
    cap: u32,
    /// Tenants holding `cap` counters or more: while none does, a decision needs no
    /// lock to know it may create counters (the common case, on every decision).
    at_cap: AtomicU64,
    shards: Box<[TenantCounts]>,
    hasher: ahash::RandomState,
}

impl TenantKeys {
    fn new(cap: u32) -> Self {
        let hasher = ahash::RandomState::new();
        let shards = (0..64).map(|_| Mutex::new(HashMap::with_hasher(hasher.clone()))).collect();
        Self { cap, at_cap: AtomicU64::new(0), shards, hasher }
    }

    fn shard(&self, tenant: &str) -> &TenantCounts {
        // 64 shards: the low six bits.
        &self.shards[(self.hasher.hash_one(tenant) as usize) & 63]
    }

    fn count(&self, tenant: &str) -> u32 {
        self.shard(tenant).lock().get(tenant).copied().unwrap_or(0)
    }

    fn add(&self, tenant: &str) {
        let mut map = self.shard(tenant).lock();
        // Looked up before inserting: the common case allocates nothing.
        let n = match map.get_mut(tenant) {
            Some(n) => n,
            None => map.entry(tenant.into()).or_insert(0),
        };
        *n += 1;
        if *n == self.cap {
            self.at_cap.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn remove(&self, tenant: &str) {
        let mut map = self.shard(tenant).lock();
        if let Some(n) = map.get_mut(tenant) {
            if *n == self.cap {
                self.at_cap.fetch_sub(1, Ordering::Relaxed);
            }
            *n -= 1;
            if *n == 0 {
                map.remove(tenant);
            }
        }
    }

    fn clear(&self) {
        for shard in &self.shards {
            shard.lock().clear();
        }
        self.at_cap.store(0, Ordering::Relaxed);
    }
}

/// Sharded map from [`LimitKey`] to state.
pub struct StateTable {
    shards: Box<[Shard]>,
    hasher: ahash::RandomState,
    max_per_shard: usize,
    keys: AtomicU64,
    evicted_idle: AtomicU64,
    evicted_live: AtomicU64,
    tenant_keys: Option<TenantKeys>,
    /// With change tracking: per shard, the hashes of slots changed since their
    /// changes were last taken (locked after the shard's own lock).
    changes: Option<Box<[Mutex<Vec<u64>>]>>,
    /// Numbers the copies taken of states, under their shard's lock: of two copies of
    /// one key, the higher number is the newer state.
    copies: AtomicU64,
}

/// A copy of one slot's state, numbered ([`StateTable::take_changes`]).
pub type Copy = (LimitKey, LimitState, u64);

/// A tenant already holds as many key-scope counters as the table allows it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("tenant `{tenant}` already holds {cap} distinct keys, the most it may")]
pub struct KeysPerTenantExceeded {
    /// The tenant.
    pub tenant: String,
    /// Its cap.
    pub cap: u32,
}

impl std::fmt::Debug for StateTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateTable")
            .field("shards", &self.shards.len())
            .field("stats", &self.stats())
            .finish_non_exhaustive()
    }
}

impl StateTable {
    /// A table holding at most about `max_keys` keys (rounded up to a whole number per
    /// shard) in `shards` shards (rounded up to a power of two, at least one).
    pub fn new(max_keys: usize, shards: usize) -> Self {
        let shards = shards.max(1).next_power_of_two();
        let max_per_shard = max_keys.div_ceil(shards).max(1);
        Self {
            shards: (0..shards).map(|_| Shard(Mutex::new(HashTable::new()))).collect(),
            hasher: ahash::RandomState::new(),
            max_per_shard,
            keys: AtomicU64::new(0),
            evicted_idle: AtomicU64::new(0),
            evicted_live: AtomicU64::new(0),
            tenant_keys: None,
            changes: None,
            copies: AtomicU64::new(1),
        }
    }

    /// Tracks which slots change, for [`Self::take_changes`] (a replica kept up to
    /// date by another node): a decision that writes a slot files its hash once
    /// until its changes are taken.
    #[must_use]
    pub fn with_changes(mut self) -> Self {
        self.changes = Some((0..self.shards.len()).map(|_| Mutex::new(Vec::new())).collect());
        self
    }

    /// The key and state of every slot changed since the last call (nothing without
    /// [`Self::with_changes`]). A slot removed since its change is not listed: its
    /// state was idle, evicted or handed off.
    pub fn take_changes(&self) -> Vec<Copy> {
        let Some(changes) = &self.changes else { return Vec::new() };
        let mut out = Vec::new();
        for (shard, list) in self.shards.iter().zip(changes.iter()) {
            let mut map = shard.0.lock();
            let hashes = std::mem::take(&mut *list.lock());
            for hash in hashes {
                // Any changed slot in the hash's probe sequence will do: each changed
                // slot filed its own hash, and a slot is listed once (its flag cleared).
                while let Some(s) = map.find_mut(hash, Slot::changed) {
                    s.touched &= !CHANGED;
                    out.push((s.key.clone(), s.state.clone(), self.copy_number()));
                }
            }
        }
        out
    }

    /// The next copy number (taken under the copied slot's shard lock).
    fn copy_number(&self) -> u64 {
        self.copies.fetch_add(1, Ordering::Relaxed)
    }

    /// Copies of the states of `keys` that exist, leaving them in place and their
    /// changes still to take.
    pub fn copies_of(&self, keys: &[LimitKeyRef<'_>]) -> Vec<Copy> {
        let mut out = Vec::new();
        for k in keys {
            let hash = k.hash_with(&self.hasher);
            let map = self.shards[self.shard_of(hash)].0.lock();
            if let Some(s) = map.find(hash, |s| k.matches(&s.key)) {
                out.push((s.key.clone(), s.state.clone(), self.copy_number()));
            }
        }
        out
    }

    /// The key and state of every slot whose key `pick` accepts (a replica's full
    /// copy), leaving them in place.
    pub fn snapshot_where(&self, pick: impl Fn(&LimitKey) -> bool) -> Vec<Copy> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let map = shard.0.lock();
            out.extend(
                map.iter()
                    .filter(|s| pick(&s.key))
                    .map(|s| (s.key.clone(), s.state.clone(), self.copy_number())),
            );
        }
        out
    }

    /// Caps the key-scope counters of each tenant at `cap` (see [`Self::admits`]).
    #[must_use]
    pub fn with_keys_per_tenant(mut self, cap: u32) -> Self {
        self.tenant_keys = Some(TenantKeys::new(cap.max(1)));
        self
    }

    /// Whether some tenant is at its key cap (until one is, every key is admitted and
    /// [`Self::admits`] need not be asked).
    pub fn some_tenant_at_cap(&self) -> bool {
        self.tenant_keys.as_ref().is_some_and(|t| t.at_cap.load(Ordering::Relaxed) > 0)
    }

    /// Whether a decision on `keys` may go ahead: each key-scope counter it needs
    /// exists already, or its tenant is below its cap. Checked before deciding; two
    /// new keys of one tenant checked at once may both pass (the cap holds within the
    /// number of concurrent decisions).
    ///
    /// # Errors
    ///
    /// The first new key whose tenant is at its cap.
    pub fn admits(&self, keys: &[LimitKeyRef<'_>]) -> Result<(), KeysPerTenantExceeded> {
        let Some(t) = self.tenant_keys.as_ref().filter(|t| t.at_cap.load(Ordering::Relaxed) > 0)
        else {
            return Ok(());
        };
        for k in keys.iter().filter(|k| k.scope == Scope::Key) {
            if t.count(k.tenant) < t.cap {
                continue;
            }
            let hash = k.hash_with(&self.hasher);
            let exists = self.shards[self.shard_of(hash)]
                .0
                .lock()
                .find(hash, |s| k.matches(&s.key))
                .is_some();
            if !exists {
                return Err(KeysPerTenantExceeded { tenant: k.tenant.to_owned(), cap: t.cap });
            }
        }
        Ok(())
    }

    /// How many key-scope counters `tenant` holds (0 when they are not capped).
    pub fn keys_of(&self, tenant: &str) -> u32 {
        self.tenant_keys.as_ref().map_or(0, |t| t.count(tenant))
    }

    /// Bookkeeping of a slot leaving the table.
    fn forget(&self, s: &Slot) {
        if let Some(t) = &self.tenant_keys
            && s.key.scope() == Scope::Key
        {
            t.remove(s.key.as_ref().tenant);
        }
    }

    /// A table for `max_keys` keys with a shard count suited to the machine.
    pub fn with_capacity(max_keys: usize) -> Self {
        let threads = std::thread::available_parallelism().map_or(4, std::num::NonZero::get);
        Self::new(max_keys, (threads * 16).min(1024))
    }

    /// The table's counters.
    pub fn stats(&self) -> TableStats {
        // Relaxed: these are statistics; no other memory depends on them.
        TableStats {
            keys: self.keys.load(Ordering::Relaxed),
            evicted_idle: self.evicted_idle.load(Ordering::Relaxed),
            evicted_live: self.evicted_live.load(Ordering::Relaxed),
        }
    }

    /// The most keys the table holds.
    pub fn max_keys(&self) -> usize {
        self.max_per_shard * self.shards.len()
    }

    fn shard_of(&self, hash: u64) -> usize {
        // Middle bits: hashbrown uses the low bits for buckets and the top 7 as tags.
        ((hash >> 32) as usize) & (self.shards.len() - 1)
    }

    /// Locks the shards holding `keys` (at most [`MAX_LEVELS`]) for one decision.
    ///
    /// # Panics
    ///
    /// When given more than [`MAX_LEVELS`] keys.
    #[inline]
    pub fn lock<'t, 'k>(&'t self, keys: &'k [LimitKeyRef<'k>]) -> Locked<'t, 'k> {
        assert!(keys.len() <= MAX_LEVELS, "at most {MAX_LEVELS} levels");
        let mut locked = Locked {
            table: self,
            keys,
            hashes: [0; MAX_LEVELS],
            guard_of: [0; MAX_LEVELS],
            guards: [const { None }; MAX_LEVELS],
        };
        let mut order = [(0usize, 0usize); MAX_LEVELS];
        for (i, k) in keys.iter().enumerate() {
            let h = k.hash_with(&self.hasher);
            locked.hashes[i] = h;
            order[i] = (self.shard_of(h), i);
        }
        let order = &mut order[..keys.len()];
        order.sort_unstable();
        let mut last_shard = usize::MAX;
        let mut g = 0;
        for &(shard, i) in order.iter() {
            if shard != last_shard {
                locked.guards[g] = Some(self.shards[shard].0.lock());
                last_shard = shard;
                g += 1;
            }
            locked.guard_of[i] = (g - 1) as u8; // g <= MAX_LEVELS
        }
        locked
    }

    /// Drops every idle entry; returns how many. Run it from a background task.
    pub fn sweep_idle(&self, now: Nanos) -> usize {
        let mut dropped = 0;
        for shard in &self.shards {
            let mut map = shard.0.lock();
            dropped += self.drop_idle(&mut map, now);
        }
        dropped
    }

    /// Removes and returns every entry whose key `take` accepts (a handoff of some
    /// tenants' counters to another node).
    pub fn take_where(&self, take: impl Fn(&LimitKey) -> bool) -> Vec<Slot> {
        let mut out = Vec::new();
        for shard in &self.shards {
            let mut map = shard.0.lock();
            let before = map.len();
            map.retain(|s| {
                if take(&s.key) {
                    self.forget(s);
                    out.push(s.clone());
                    false
                } else {
                    true
                }
            });
            self.keys.fetch_sub((before - map.len()) as u64, Ordering::Relaxed);
        }
        out
    }

    /// Stores `state` for `key` under `limit`, replacing what was there (a handoff
    /// received from another node).
    pub fn put(&self, key: LimitKeyRef<'_>, limit: &Arc<Limit>, state: LimitState, now: Nanos) {
        let keys = [key];
        let mut locked = self.lock(&keys);
        let slot = locked.slot_mut(0, limit, now);
        slot.limit = Arc::clone(limit);
        slot.state = state;
    }

    /// Removes every key; returns how many there were.
    pub fn clear(&self) -> usize {
        let mut n = 0;
        for shard in &self.shards {
            let mut map = shard.0.lock();
            n += map.len();
            map.clear();
        }
        if let Some(t) = &self.tenant_keys {
            t.clear();
        }
        self.keys.fetch_sub(n as u64, Ordering::Relaxed);
        n
    }

    fn drop_idle(&self, map: &mut HashTable<Slot>, now: Nanos) -> usize {
        let before = map.len();
        map.retain(|s| {
            let idle = s.limit.is_idle(&s.state, now);
            if idle {
                self.forget(s);
            }
            !idle
        });
        let dropped = before - map.len();
        self.keys.fetch_sub(dropped as u64, Ordering::Relaxed);
        self.evicted_idle.fetch_add(dropped as u64, Ordering::Relaxed);
        dropped
    }

    /// Makes room in a full shard: idle entries first, then an eighth of the live
    /// ones, the least used and then the least recently used. Permits in use are
    /// never evicted (forgetting them would admit past a concurrency limit): such a
    /// state leaves when its last permit is released or expires.
    fn make_room(&self, map: &mut HashTable<Slot>, now: Nanos) {
        if self.drop_idle(map, now) > 0 {
            return;
        }
        let mut rank: Vec<(u64, Nanos)> = map.iter().map(|s| (s.uses(), s.last_seen())).collect();
        let cut = (rank.len() / 8).max(1);
        let (_, threshold, _) = rank.select_nth_unstable(cut - 1);
        let threshold = *threshold;
        let mut budget = cut;
        map.retain(|s| {
            if budget > 0 && (s.uses(), s.last_seen()) <= threshold && !s.limit.is_concurrency() {
                budget -= 1;
                self.forget(s);
                false
            } else {
                s.age();
                true
            }
        });
        let evicted = (cut - budget) as u64;
        self.keys.fetch_sub(evicted, Ordering::Relaxed);
        self.evicted_live.fetch_add(evicted, Ordering::Relaxed);
    }
}

/// The shards of one decision's keys, locked. Dropping it unlocks them.
pub struct Locked<'t, 'k> {
    table: &'t StateTable,
    keys: &'k [LimitKeyRef<'k>],
    hashes: [u64; MAX_LEVELS],
    guard_of: [u8; MAX_LEVELS],
    guards: [Option<MutexGuard<'t, HashTable<Slot>>>; MAX_LEVELS],
}

impl Locked<'_, '_> {
    /// Number of keys locked.
    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// True when no key is locked.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    fn map(&self, i: usize) -> &HashTable<Slot> {
        self.guards[usize::from(self.guard_of[i])].as_ref().expect("guard locked for every key")
    }

    /// The state of key `i` for `limit`; `None` when the key has no state (or state
    /// for another limit), which reads as a fresh allowance.
    #[inline]
    pub fn get(&self, i: usize, limit: &Limit) -> Option<&LimitState> {
        let key = self.keys[i];
        self.map(i)
            .find(self.hashes[i], |s| key.matches(&s.key))
            .filter(|s| limit.keeps_state_of(&s.limit))
            .map(|s| &s.state)
    }

    /// The state of key `i` for `limit`, like [`Self::get`], marking the key as used at
    /// `now`. A decision that only reads (a refusal, a dry run, an empty grant) still
    /// uses the counter, which must not be the first evicted: a flood of new keys would
    /// otherwise evict an exhausted tenant's counter and give it a fresh allowance.
    #[inline]
    pub fn get_used(&mut self, i: usize, limit: &Limit, now: Nanos) -> Option<&LimitState> {
        let key = self.keys[i];
        let map = self.guards[usize::from(self.guard_of[i])].as_mut().expect("guard locked");
        let s = map.find_mut(self.hashes[i], |s| key.matches(&s.key))?;
        s.touch(now);
        limit.keeps_state_of(&s.limit).then_some(&s.state)
    }

    /// The slot of key `i`, created (or reset, if built for another limit) as needed,
    /// marked as used at `now`.
    #[inline]
    pub fn slot_mut(&mut self, i: usize, limit: &Arc<Limit>, now: Nanos) -> &mut Slot {
        let key = self.keys[i];
        let hash = self.hashes[i];
        let table = self.table;
        let map = self.guards[usize::from(self.guard_of[i])].as_mut().expect("guard locked");
        let rehash = |s: &Slot| s.key.as_ref().hash_with(&table.hasher);
        let slot = match map.entry(hash, |s| key.matches(&s.key), rehash) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => {
                let fresh = Slot {
                    key: key.to_owned_key(),
                    limit: Arc::clone(limit),
                    touched: now & !LOW,
                    state: LimitState::Fresh,
                };
                table.keys.fetch_add(1, Ordering::Relaxed);
                if let Some(t) = &table.tenant_keys
                    && key.scope == Scope::Key
                {
                    t.add(key.tenant);
                }
                let map = v.into_table();
                if map.len() >= table.max_per_shard {
                    table.make_room(map, now);
                }
                map.insert_unique(hash, fresh, rehash).into_mut()
            }
        };
        if *slot.limit != **limit {
            if !limit.keeps_state_of(&slot.limit) {
                slot.state = LimitState::Fresh;
            }
            slot.limit = Arc::clone(limit);
        }
        slot.touch(now);
        if let Some(changes) = &table.changes
            && !slot.changed()
        {
            slot.touched |= CHANGED;
            changes[table.shard_of(hash)].lock().push(hash);
        }
        slot
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algorithm::{FixedWindow, TokenBucket};
    use crate::decision::Scope;
    use std::num::NonZeroU64;

    fn fw(limit: u64) -> Limit {
        Limit::FixedWindow(FixedWindow::new(
            NonZeroU64::new(limit).unwrap(),
            NonZeroU64::new(1_000).unwrap(),
        ))
    }

    #[test]
    fn changes_are_taken_once_each_with_the_newest_state() {
        let t = StateTable::new(10_000, 4).with_changes();
        let limit = Arc::new(fw(100));
        let charge = |name: &str, units: u64| {
            let keys = [LimitKeyRef::new(Scope::Key, "t", "/r", name)];
            let mut l = t.lock(&keys);
            let slot = l.slot_mut(0, &limit, 10);
            limit.charge(&mut slot.state, 10, units);
        };
        for i in 0..500 {
            charge(&format!("k{i}"), 1);
        }
        charge("k7", 4);
        charge("k7", 2);
        let mut taken = t.take_changes();
        assert_eq!(taken.len(), 500);
        taken.sort_by(|a, b| a.0.as_ref().key.cmp(b.0.as_ref().key));
        taken.dedup_by(|a, b| a.0 == b.0);
        assert_eq!(taken.len(), 500, "each changed key once");
        let k7 = taken.iter().find(|(k, ..)| k.as_ref().key == "k7").unwrap();
        assert_eq!(limit.remaining(&k7.1, 10), 93, "its newest state");
        // Nothing changed since: nothing to take; a read is no change.
        assert!(t.take_changes().is_empty());
        let keys = [LimitKeyRef::new(Scope::Key, "t", "/r", "k1")];
        let _ = t.lock(&keys).get_used(0, &limit, 11);
        assert!(t.take_changes().is_empty());
        charge("k3", 1);
        let again = t.take_changes();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].0.as_ref().key, "k3");
        // Copies are numbered: a later copy of a key has the higher number.
        let later = t.copies_of(&[LimitKeyRef::new(Scope::Key, "t", "/r", "k3")]);
        assert!(later[0].2 > again[0].2);
        assert!(t.snapshot_where(|k| k.as_ref().key == "k3")[0].2 > later[0].2);
        // Without tracking, nothing is kept.
        let plain = StateTable::new(100, 1);
        let keys = [LimitKeyRef::new(Scope::Key, "t", "/r", "x")];
        plain.lock(&keys).slot_mut(0, &limit, 1);
        assert!(plain.take_changes().is_empty());
    }

    #[test]
    fn cap_holds_and_idle_keys_go_first() {
        let t = StateTable::new(64, 4);
        let limit = Arc::new(fw(10));
        let names: Vec<String> = (0..1_000).map(|i| format!("k{i}")).collect();
        for (n, name) in names.iter().enumerate() {
            let k = LimitKeyRef::new(Scope::Key, "t", "/r", name);
            let keys = [k];
            let mut l = t.lock(&keys);
            let slot = l.slot_mut(0, &limit, n as u64 % 1_000);
            limit.charge(&mut slot.state, n as u64 % 1_000, 1);
        }
        let s = t.stats();
        assert!(s.keys as usize <= t.max_keys(), "{s:?}");
        assert!(s.evicted_live > 0);
        // A new window: every key is idle again and a sweep drops them all, losslessly.
        let dropped = t.sweep_idle(5_000);
        assert_eq!(dropped as u64, s.keys);
        assert_eq!(t.stats().keys, 0);
    }

    #[test]
    fn a_flood_of_keys_seen_once_evicts_its_own_kind_before_a_counter_in_use() {
        let t = StateTable::new(64, 1);
        // Long windows: nothing is idle, every eviction is of a live counter.
        let limit = Arc::new(Limit::FixedWindow(FixedWindow::new(
            NonZeroU64::new(10).unwrap(),
            NonZeroU64::new(1_000_000).unwrap(),
        )));
        let charge = |name: &str, now: u64| {
            let keys = [LimitKeyRef::new(Scope::Key, "t", "/r", name)];
            let mut l = t.lock(&keys);
            let slot = l.slot_mut(0, &limit, now);
            limit.charge(&mut slot.state, now, 1);
        };
        // A counter in use (40 decisions), then 300 new keys, each seen once, and the
        // counter not touched again: it is the least recently used from the start.
        for n in 0..40 {
            charge("busy", n);
        }
        for n in 0..300 {
            charge(&format!("flood{n}"), 100 + n);
        }
        let keys = [LimitKeyRef::new(Scope::Key, "t", "/r", "busy")];
        let l = t.lock(&keys);
        let state = l.get(0, &limit).expect("the busy counter survived the flood");
        assert_eq!(limit.remaining(state, 500), 0, "and kept its count");
        drop(l);
        assert!(t.stats().evicted_live >= 200, "{:?}", t.stats());
    }

    #[test]
    fn each_tenant_keeps_to_its_key_cap_and_counts_follow_evictions() {
        let t = StateTable::new(10_000, 4).with_keys_per_tenant(3);
        let limit = Arc::new(fw(10));
        let use_key = |tenant: &str, key: &str, now: u64| {
            let keys = [LimitKeyRef::new(Scope::Key, tenant, "/r", key)];
            t.admits(&keys)?;
            let mut l = t.lock(&keys);
            let slot = l.slot_mut(0, &limit, now);
            limit.charge(&mut slot.state, now, 1);
            Ok::<_, KeysPerTenantExceeded>(())
        };
        for k in ["a", "b", "c"] {
            use_key("flood", k, 0).unwrap();
        }
        let e = use_key("flood", "d", 0).unwrap_err();
        assert_eq!(e, KeysPerTenantExceeded { tenant: "flood".into(), cap: 3 });
        assert!(e.to_string().contains("`flood` already holds 3 distinct keys"), "{e}");
        // Known keys go on; other tenants and other scopes are not touched.
        use_key("flood", "a", 1).unwrap();
        use_key("quiet", "a", 1).unwrap();
        let tenant_level = [LimitKeyRef::new(Scope::Tenant, "flood", "", "")];
        assert!(t.admits(&tenant_level).is_ok());
        assert_eq!((t.keys_of("flood"), t.keys_of("quiet")), (3, 1));
        // Idle counters leave and make room.
        t.sweep_idle(5_000);
        assert_eq!((t.keys_of("flood"), t.keys_of("quiet")), (0, 0));
        use_key("flood", "d", 5_000).unwrap();
        // A handoff takes counters away; a clear forgets all.
        let taken = t.take_where(|k| k.as_ref().tenant == "flood");
        assert_eq!((taken.len(), t.keys_of("flood")), (1, 0));
        use_key("flood", "e", 5_000).unwrap();
        t.clear();
        assert_eq!(t.keys_of("flood"), 0);
    }

    #[test]
    fn live_evictions_give_back_a_tenants_key_count() {
        let t = StateTable::new(64, 1).with_keys_per_tenant(1_000);
        let limit = Arc::new(fw(10));
        for n in 0..500u64 {
            let name = format!("k{n}");
            let keys = [LimitKeyRef::new(Scope::Key, "t", "/r", &name)];
            t.admits(&keys).unwrap();
            let mut l = t.lock(&keys);
            let slot = l.slot_mut(0, &limit, n);
            limit.charge(&mut slot.state, n, 1);
        }
        assert!(t.stats().evicted_live > 0);
        assert_eq!(u64::from(t.keys_of("t")), t.stats().keys);
    }

    #[test]
    fn a_changed_limit_resets_the_state() {
        let t = StateTable::new(16, 1);
        let k = LimitKeyRef::new(Scope::Tenant, "a", "", "");
        let a = Arc::new(fw(5));
        let b = Arc::new(Limit::TokenBucket(TokenBucket::new(
            "5/s".parse().unwrap(),
            NonZeroU64::new(5).unwrap(),
        )));
        let keys = [k];
        {
            let mut l = t.lock(&keys);
            let slot = l.slot_mut(0, &a, 0);
            a.charge(&mut slot.state, 0, 5);
            assert!(l.get(0, &a).is_some());
            assert!(l.get(0, &b).is_none());
        }
        let mut l = t.lock(&keys);
        assert_eq!(b.remaining(&l.slot_mut(0, &b, 0).state, 0), 5);
    }

    #[test]
    fn a_window_whose_limit_alone_changed_keeps_its_count() {
        let t = StateTable::new(16, 1);
        let keys = [LimitKeyRef::new(Scope::Tenant, "a", "", "")];
        let (five, ten) = (Arc::new(fw(5)), Arc::new(fw(10)));
        let mut l = t.lock(&keys);
        let slot = l.slot_mut(0, &five, 0);
        five.charge(&mut slot.state, 0, 5);
        // Raised to 10: the 5 counted stay counted (5 left, not 10).
        assert_eq!(ten.remaining(l.get(0, &ten).unwrap(), 0), 5);
        assert_eq!(ten.remaining(&l.slot_mut(0, &ten, 0).state, 0), 5);
        // Back to 5: still nothing left in this window.
        assert_eq!(five.remaining(&l.slot_mut(0, &five, 0).state, 0), 0);
    }

    #[test]
    fn a_slot_is_80_bytes() {
        assert_eq!(size_of::<Slot>(), 80);
    }

    #[test]
    fn locking_many_keys_in_one_shard_does_not_deadlock() {
        let t = StateTable::new(16, 1);
        let keys = [
            LimitKeyRef::GLOBAL,
            LimitKeyRef::new(Scope::Route, "", "/r", ""),
            LimitKeyRef::new(Scope::Tenant, "a", "", ""),
        ];
        let l = t.lock(&keys);
        assert_eq!(l.len(), 3);
    }
}
