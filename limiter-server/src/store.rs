//! Where counters live. The memory store (the default) is limiter-core's sharded
//! table in this process; every call is async so that a networked store slots in
//! behind the same calls.

use limiter_core::clock::Nanos;
use limiter_core::policy::Chain;
use limiter_core::table::{StateTable, TableStats};
use limiter_core::{Grant, Limiter, Verdict};

use crate::error::ServerError;

/// A store of counters.
#[derive(Debug)]
pub enum Store {
    /// In this process's memory.
    Memory(Limiter),
}

impl Store {
    /// A memory store holding at most about `max_keys` counters.
    pub fn memory(max_keys: usize) -> Self {
        Self::Memory(Limiter::with_table(StateTable::with_capacity(max_keys)))
    }

    /// Checks and charges a chain, all levels or none.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached (never for memory).
    pub async fn decide(&self, chain: &Chain<'_>, now: Nanos) -> Result<Verdict, ServerError> {
        match self {
            Self::Memory(l) => Ok(l.decide(chain, now)),
        }
    }

    /// Charges `units` to every level without checking (usage reported afterwards).
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn charge(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        match self {
            Self::Memory(l) => l.charge(chain, now, units),
        }
        Ok(())
    }

    /// Gives back `units` charged at `granted_at` on every level.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn refund(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        granted_at: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        match self {
            Self::Memory(l) => l.refund(chain, now, granted_at, units),
        }
        Ok(())
    }

    /// Grants up to `max` units from every level, spendable for at most `hold`.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        max: u64,
        hold: Nanos,
    ) -> Result<Grant, ServerError> {
        match self {
            Self::Memory(l) => Ok(l.grant(chain, now, max, hold)),
        }
    }

    /// Gives back `units` of a grant made at `granted_at` for `hold`.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn refund_grant(
        &self,
        chain: &Chain<'_>,
        now: Nanos,
        granted_at: Nanos,
        hold: Nanos,
        units: u64,
    ) -> Result<(), ServerError> {
        match self {
            Self::Memory(l) => l.refund_grant(chain, now, granted_at, hold, units),
        }
        Ok(())
    }

    /// Units left at the tightest level of a chain.
    ///
    /// # Errors
    ///
    /// When the store cannot be reached.
    pub async fn remaining(&self, chain: &Chain<'_>, now: Nanos) -> Result<u64, ServerError> {
        match self {
            Self::Memory(l) => Ok(l.remaining(chain, now)),
        }
    }

    /// Drops idle counters; returns how many.
    pub fn sweep(&self, now: Nanos) -> usize {
        match self {
            Self::Memory(l) => l.table().sweep_idle(now),
        }
    }

    /// Counter statistics.
    pub fn stats(&self) -> TableStats {
        match self {
            Self::Memory(l) => l.table().stats(),
        }
    }

    /// The most counters held.
    pub fn max_keys(&self) -> usize {
        match self {
            Self::Memory(l) => l.table().max_keys(),
        }
    }
}
