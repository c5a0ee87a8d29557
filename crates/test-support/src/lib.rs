//! Scaffolding shared by the workspace's examples, benchmarks and tests, so
//! that each crate's measurements run the same "other tenants". Not published:
//! the reference VMM depends on it, and the published crates' examples include
//! `hogs.rs`, `results.rs`, `summary.rs`, `affinity.rs` and
//! `criterion_medians.rs` through links in their `examples/support/`,
//! `tests/support/` or `benches/support/`, and halt-poll's and
//! lapic-timer's simulators (`sim/`) include `traces.rs`, so that they ship
//! with each of them.

#![deny(missing_docs)]

pub mod affinity;
pub mod certs;
pub mod criterion_medians;
pub mod hogs;
pub mod hosts;
pub mod kvm;
pub mod proxy;
pub mod results;
pub mod summary;
pub mod traces;

pub use hogs::Hogs;

#[cfg(test)]
mod tests;
