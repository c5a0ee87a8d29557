//! Atomics from std or, under `--cfg loom`, from loom, so the run-state
//! handshake and the booster's boost/restore protocol are model-checked with
//! the code that runs (`tests/loom.rs`).

#[cfg(loom)]
pub(crate) use loom::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicU64, Ordering, fence};
#[cfg(not(loom))]
pub(crate) use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU8, AtomicU64, Ordering, fence};
