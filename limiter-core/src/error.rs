//! Errors for requests that can never succeed. A denial is a [`crate::Decision`],
//! never one of these.

use crate::decision::Scope;

/// A request that is malformed or can never be admitted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A required name is empty.
    #[error("{field} must not be empty")]
    EmptyName {
        /// `tenant`, `route` or `key`.
        field: &'static str,
    },
    /// A name is longer than allowed.
    #[error("{field} is {len} bytes long, more than the maximum of {max}")]
    NameTooLong {
        /// `tenant`, `route` or `key`.
        field: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The configured maximum.
        max: usize,
    },
    /// A name holds a control character.
    #[error("{field} must not contain control characters")]
    ControlCharacter {
        /// `tenant`, `route` or `key`.
        field: &'static str,
    },
    /// A charge of zero units; checking without charging is an explicit dry run.
    #[error("cost must be at least 1 (ask for a dry run to check without charging)")]
    ZeroCost,
    /// A cost above what a level can ever admit.
    #[error(
        "cost {cost} can never be admitted: the {scope} limit allows at most {capacity} at once"
    )]
    CostAboveLimit {
        /// The request's cost.
        cost: u64,
        /// The level whose capacity it exceeds.
        scope: Scope,
        /// That level's capacity.
        capacity: u64,
    },
}

impl RequestError {
    /// The request field at fault (`tenant`, `route`, `key`, `cost`).
    pub fn field(&self) -> &'static str {
        match self {
            Self::EmptyName { field }
            | Self::NameTooLong { field, .. }
            | Self::ControlCharacter { field } => field,
            Self::ZeroCost | Self::CostAboveLimit { .. } => "cost",
        }
    }
}
