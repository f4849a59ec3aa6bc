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

/// A holder counts as active on a chain this long after its last ask for it.
const ACTIVE_FOR: Nanos = 2 * NANOS_PER_SEC;

/// The most chains whose asks are kept (beyond it, stale ones are dropped first and
/// then the table is cleared: shares fall back to "plenty left" rules until the
/// holders ask again), and the most holders counted per chain.
const MAX_CHAINS: usize = 100_000;
const MAX_HOLDERS: usize = 256;

/// A holder's last ask for a chain.
#[derive(Debug, Clone, Copy)]
struct Asked {
    holder: u64,
    cap: u64,
    seen: Nanos,
}

/// The owner's lease state.
#[derive(Debug)]
pub struct Leases {
    pub(super) book: Mutex<LeaseBook<ChainKey>>,
    /// What each active holder last asked for, by chain (a hash of its names).
    asks: Mutex<HashMap<u64, Vec<Asked>>>,
}

impl Default for Leases {
    fn default() -> Self {
        // Ids start at a random point, so leases that move between nodes keep ids
        // no other node has issued.
        let first = std::hash::RandomState::new().hash_one(0u64) >> 2;
        Self { book: Mutex::new(LeaseBook::starting_at(first)), asks: Mutex::default() }
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
        self.book
            .lock()
            .take_where(|k| moving(&k.0))
            .into_iter()
            .map(|(id, r)| pb::LeaseState {
                id,
                holder: r.holder,
                tenant: r.key.0.to_string(),
                route: r.key.1.to_string(),
                key: r.key.2.map(|k| k.to_string()),
                units: r.units,
                granted_at: r.granted_at,
                hold: r.hold,
            })
            .collect()
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

    /// Records that `holder` asks for `cap` units of `chain` at `now` (0: it gives its
    /// lease back and asks nothing) and returns who else is asking: what the grant rule
    /// divides near the limit.
    pub(super) fn shares(&self, chain: u64, holder: u64, cap: u64, now: Nanos) -> Shares {
        let fresh = |a: &Asked| now.saturating_sub(a.seen) < ACTIVE_FOR;
        let mut asks = self.asks.lock();
        if asks.len() >= MAX_CHAINS && !asks.contains_key(&chain) {
            asks.retain(|_, v| {
                v.retain(fresh);
                !v.is_empty()
            });
            if asks.len() >= MAX_CHAINS {
                asks.clear();
            }
        }
        let v = asks.entry(chain).or_default();
        v.retain(|a| fresh(a) && a.holder != holder);
        let others: u64 = v.iter().map(|a| a.cap).fold(0, u64::saturating_add);
        let active = v.len() as u64 + 1;
        if cap > 0 && v.len() < MAX_HOLDERS {
            v.push(Asked { holder, cap, seen: now });
        } else if v.is_empty() {
            asks.remove(&chain);
        }
        // A draw for the share's fraction: the book's ids and the clock, mixed.
        let mut z = now ^ holder.rotate_left(29) ^ chain.rotate_left(7);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        Shares { active, others, dice: z ^ (z >> 31) }
    }

    /// Drops the asks of holders not seen for a while.
    fn forget_stale_asks(&self, now: Nanos) {
        self.asks.lock().retain(|_, v| {
            v.retain(|a| now.saturating_sub(a.seen) < ACTIVE_FOR);
            !v.is_empty()
        });
    }
}

/// A stable id of the chain a lease item names (its names and level).
pub(super) fn chain_id(item: &pb::LeaseItem) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one((
        &item.tenant,
        &item.route,
        &item.key,
        item.level,
    ))
}

impl crate::cluster::LeaseBook for Leases {
    fn take_moving(&self, moving: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        Self::take_moving(self, moving)
    }

    fn adopt(&self, leases: &[pb::LeaseState]) -> u64 {
        Self::adopt(self, leases)
    }
}
