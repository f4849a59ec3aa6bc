//! Atomics of the hot path, swapped for loom's under `cfg(loom)` so the lease
//! counters can be model-checked.

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicU64, Ordering};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
