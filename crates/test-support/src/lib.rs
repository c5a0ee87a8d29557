//! Scaffolding shared by the workspace's examples, benchmarks and tests, so
//! that each crate's measurements run the same "other tenants". Not published:
//! the crates take it as a dev-dependency only.

#![deny(missing_docs)]

pub mod hogs;

pub use hogs::Hogs;
