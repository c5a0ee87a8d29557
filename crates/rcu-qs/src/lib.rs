//! QSBR read-copy-update whose readers are vCPU threads, with guest mode as an
//! extended quiescent state.
//!
//! A VMM reads some tables on every vCPU exit (the device bus, the memory map,
//! interrupt routing) and changes them rarely. With quiescent-state-based RCU the
//! readers take no lock and do no atomic read-modify-write at all: each reader
//! thread only announces, now and then, that it holds no reference (a quiescent
//! state), and a writer reclaims an old version once every reader has done so.
//! KVM treats time in guest mode as an *extended* quiescent state and notes one on
//! every guest exit; this crate does the same for a VMM's own data: a vCPU thread
//! is offline while inside `KVM_RUN`, so a writer never waits for a guest.
//!
//! # Shape
//! - [`QsReporter`]: the per-thread reporting side, so a VMM's run loop can be
//!   generic over it, with the no-op [`NoQs`].
//! - The `Domain`, `Reader`, `synchronize()`, deferred reclamation and `RcuCell`
//!   are planned; see the README's status.
//!
//! # Example
//! ```
//! use rcu_qs::{NoQs, QsReporter};
//!
//! fn run_loop(qs: &impl QsReporter) {
//!     qs.offline(); // entering the guest: an extended quiescent state
//!     // vcpu.run()
//!     qs.online(); // back in the VMM: may read RCU-protected tables again
//! }
//! run_loop(&NoQs);
//! ```

#![deny(missing_docs)]

pub mod reporter;

pub use reporter::{NoQs, QsReporter};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
