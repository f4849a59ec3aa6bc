//! limiter-core: the rate-limit algorithms, the policy model and its validation,
//! hierarchy evaluation, and decisions with stable reasons.
//!
//! No I/O, no async runtime, no wall clock: time is an argument (integer
//! nanoseconds from a [`clock::Clock`]), so every behaviour is reproducible in tests.
//!
//! The path of one request: [`policy::Policy::resolve`] turns `(tenant, route, key,
//! cost)` into a [`policy::Chain`] of limits (global, route, tenant, tenant x route,
//! key); [`Limiter::decide`] checks every level and charges all or none; the result is
//! a [`Decision`] with a stable [`Reason`].

pub mod algorithm;
pub mod calendar;
pub mod clock;
pub mod decision;
pub mod error;
pub mod failure;
pub mod headers;
pub mod hierarchy;
pub mod holder;
pub mod key;
pub mod lease;
pub mod limit;
pub mod policy;
pub mod rate;
pub mod ring;
pub mod share;
pub mod table;
pub mod text;

pub use decision::{Binding, Decision, Reason, Scope};
pub use error::RequestError;
pub use hierarchy::{Grant, LevelView, Limiter, Verdict};
pub use limit::{AlgorithmKind, Limit, LimitState};
