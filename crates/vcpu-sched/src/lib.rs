//! vCPU run state, boosting the vCPU an interrupt was just delivered to, and
//! directed-yield candidates.
//!
//! On an overcommitted host a vCPU that was just sent an interrupt is often not
//! running: its host thread waits behind others on the run queue, and the sender
//! waits for its answer. KVM marks such a vCPU `ready` so directed yield picks it.
//! A userspace VMM knows who it just sent an interrupt to, and can act on that
//! vCPU's host thread. This crate carries the per-vCPU run state that such
//! decisions need, shared between threads without locks.
//!
//! # Shape
//! - [`SharedRunState`]: one vCPU's [`RunState`], a cache-padded atomic updated by
//!   its thread around `KVM_RUN` and read by whoever delivers an interrupt.
//! - Boost policies, thread control, directed-yield candidate selection and
//!   placement helpers are planned; see the README's status.
//!
//! # Example
//! ```
//! use vcpu_sched::{RunState, SharedRunState};
//!
//! let state = SharedRunState::new();
//! state.set(RunState::InGuest);
//! // Another thread, about to deliver an interrupt, sees where the vCPU is.
//! assert_eq!(state.get(), RunState::InGuest);
//! ```

#![deny(missing_docs)]

pub mod state;

pub use state::{RunState, SharedRunState};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
