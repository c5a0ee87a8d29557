//! QSBR read-copy-update whose readers are vCPU threads, with guest mode as an
//! extended quiescent state.
//!
//! A VMM reads some tables on every vCPU exit (the device bus, the memory map,
//! interrupt routing) and changes them rarely. With quiescent-state-based RCU
//! (liburcu's `urcu-qsbr`) the readers take no lock and do no atomic
//! read-modify-write at all: a reader thread only announces, now and then, that it
//! holds no reference (a *quiescent state*), and a writer frees an old version
//! once every reader has done so (a *grace period*).
//!
//! KVM treats time in guest mode as an *extended* quiescent state and notes one on
//! every guest exit. This crate does the same for a VMM's own data: a vCPU thread
//! goes [`offline`](Reader::offline) around `KVM_RUN`, so a writer never waits for a
//! guest however long it runs, and comes back [`online`](Reader::online) to handle
//! the exit.
//!
//! # Pieces
//! - [`Domain`]: the grace-period counter and the registry of readers;
//!   [`Domain::synchronize`] waits for a grace period; [`Domain::defer`],
//!   [`Domain::call`] and [`Domain::barrier`] reclaim on the domain's own thread.
//! - [`Reader`]: one thread's registration: [`quiescent`](Reader::quiescent),
//!   [`offline`](Reader::offline), [`online`](Reader::online),
//!   [`offline_guard`](Reader::offline_guard).
//! - [`RcuCell`]: a value read through a reader with no lock and replaced whole.
//! - [`QsReporter`]: the reporting side as a trait, with the no-op [`NoQs`].
//! - [`RcuEvents`]: metrics, with the zero-sized no-op [`NoEvents`] and the
//!   ready-made [`RcuCounters`].
//!
//! # Example: a vCPU loop reading the device bus
//! ```
//! use rcu_qs::{Domain, RcuCell};
//!
//! let domain = Domain::new();
//! let bus = RcuCell::new(&domain, vec![("serial", 0x3f8u16)]);
//! std::thread::scope(|s| {
//!     s.spawn(|| {
//!         let mut reader = domain.register_reader();
//!         for _exit in 0..3 {
//!             // Offline while in the guest: a writer never waits for KVM_RUN.
//!             reader.offline_while(|| { /* vcpu.run() */ });
//!             // Handling the exit: a lock-free lookup.
//!             let devices = bus.read(&reader);
//!             assert!(devices.iter().any(|(name, _)| *name == "serial"));
//!         }
//!     });
//!     // Hot-plug a device: readers see the old or the new bus, never a torn one;
//!     // the old one is freed once no reader can see it.
//!     bus.store(vec![("serial", 0x3f8), ("rtc", 0x70)]);
//! });
//! domain.barrier().unwrap();
//! assert_eq!(domain.pending_reclaim_bytes(), 0);
//! ```

#![deny(missing_docs)]

mod cell;
mod domain;
mod error;
mod events;
mod grace_period;
#[cfg(all(not(loom), any(test, feature = "fuzzing")))]
pub mod model;
mod reader;
#[cfg(not(loom))]
mod reclaim;
mod reporter;
mod sync;

pub use cell::RcuCell;
pub use domain::{DEFAULT_MAX_PENDING_BYTES, DEFAULT_SPIN, Domain, DomainBuilder};
pub use error::{RcuError, Rejected};
pub use events::{GracePeriod, NoEvents, RcuCounters, RcuEvents};
pub use reader::{OfflineGuard, Reader};
pub use reporter::{NoQs, QsReporter};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
