//! The owner's book of open leases and the agents it has seen lately.

use std::collections::HashMap;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};

use limiter_core::clock::{NANOS_PER_SEC, Nanos};
use limiter_core::lease::{LeaseBook, LeaseRecord};
use limiter_proto::limiter::v1 as pb;
use parking_lot::Mutex;

use crate::metrics as m;

/// A chain's identity in the book: tenant, route, key.
type ChainKey = (Box<str>, Box<str>, Option<Box<str>>);

/// Agents count as active this long after their last call.
const ACTIVE_FOR: Nanos = 2 * NANOS_PER_SEC;

/// The owner's lease state.
#[derive(Debug)]
pub struct Leases {
    pub(super) book: Mutex<LeaseBook<ChainKey>>,
    agents: Mutex<HashMap<u64, Nanos>>,
}

impl Default for Leases {
    fn default() -> Self {
        // Ids start at a random point, so leases that move between nodes keep ids
        // no other node has issued.
        let first = std::hash::RandomState::new().hash_one(0u64) >> 2;
        Self { book: Mutex::new(LeaseBook::starting_at(first)), agents: Mutex::default() }
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

    pub(super) fn active_agents(&self, agent: u64, now: Nanos) -> u64 {
        let mut agents = self.agents.lock();
        agents.insert(agent, now);
        if agents.len() > 1_024 {
            agents.retain(|_, seen| now.saturating_sub(*seen) < ACTIVE_FOR);
        }
        agents.values().filter(|seen| now.saturating_sub(**seen) < ACTIVE_FOR).count() as u64
    }
}

impl crate::cluster::LeaseBook for Leases {
    fn take_moving(&self, moving: &dyn Fn(&str) -> bool) -> Vec<pb::LeaseState> {
        Self::take_moving(self, moving)
    }

    fn adopt(&self, leases: &[pb::LeaseState]) -> u64 {
        Self::adopt(self, leases)
    }
}
