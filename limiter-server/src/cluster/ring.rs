//! The ring lives in limiter-core, so that agents compute the same owners.

pub use limiter_core::ring::*;
