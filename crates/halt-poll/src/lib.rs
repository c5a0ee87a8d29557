//! Adaptive poll-before-block for halted vCPUs and other VMM waits.
//!
//! When a vCPU halts, the thread that runs it has two ways to wait for the next
//! interrupt: block (cheap in CPU, but the wake-up pays a context switch and a
//! scheduler round trip) or poll (the wake-up is seen within nanoseconds, but the
//! CPU burns while nothing happens). KVM polls for an adaptive window before
//! blocking (`halt_poll_ns`, grown and shrunk after every halt); the guest's
//! cpuidle-haltpoll governor and QEMU's AioContext do the same with their own
//! rules. This crate carries that mechanism for a userspace VMM, whose vCPU
//! threads see `KVM_EXIT_HLT` themselves when there is no in-kernel irqchip.
//!
//! # Shape
//! - [`PollPolicy`]: *what* to do. It gives the current poll window and learns
//!   from each halt's [`HaltOutcome`]. The reference policies are presets named
//!   after what they reproduce.
//! - A poller generic over the policy, a wake source and a clock: *how* to poll
//!   and block (planned; see the README's status).
//!
//! # Example
//! ```
//! use std::time::Duration;
//! use halt_poll::{Fixed, HaltOutcome, PollPolicy};
//!
//! let mut policy = Fixed(Duration::from_micros(50));
//! // A halt that was woken 20 µs in, while still polling.
//! policy.learn(&HaltOutcome::woken_while_polling(Duration::from_micros(20)));
//! assert_eq!(policy.window(), Duration::from_micros(50));
//! ```

#![deny(missing_docs)]

pub mod policy;

pub use policy::{Fixed, HaltOutcome, Never, PollPolicy};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
