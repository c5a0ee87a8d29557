//! Adaptive poll-before-block for halted vCPUs and other VMM waits.
//!
//! When a vCPU halts, the thread that runs it can block (cheap in CPU, but the
//! wake-up pays a futex wake and a scheduler round trip: tens of microseconds on
//! a virtualized host) or poll (the wake-up is seen in nanoseconds, but the CPU
//! burns meanwhile). KVM polls for an adaptive window before blocking; the guest's
//! cpuidle-haltpoll governor and QEMU's AioContext do the same with their own
//! rules. A userspace VMM without an in-kernel irqchip sees `KVM_EXIT_HLT` on its
//! vCPU threads and needs the same mechanism itself.
//!
//! # Pieces
//! - [`PollPolicy`]: *what* to do. A [`PollPlan`] (optional sleep, then a poll
//!   window) before each halt, and [`learn`](PollPolicy::learn) from each
//!   [`HaltOutcome`]. Reference presets reproduce their sources exactly:
//!   [`KvmGrowShrink`], [`GuestHaltpoll`], [`AioPoll`], [`Fixed`], [`Never`].
//!   [`Predictive`] is this crate's own: it learns the distribution of wake
//!   times, predicts from the previous halt, may sleep before polling (hybrid
//!   polling), and backs off when polling costs another thread its CPU.
//! - [`HaltPoller`]: *how*. Generic over the policy (one per event source), a
//!   [`WakeSource`] ([`FutexWake`], [`EventFdWake`]), a [`Clock`] and
//!   [`HaltEvents`] ([`HaltStats`] counts with KVM's stat names).
//! - [`kvm`] (feature `kvm`, on by default): KVM's own halt polling for VMMs
//!   with the in-kernel irqchip: `KVM_CAP_HALT_POLL` and vCPU binary stats.
//!
//! # Example: a vCPU thread halts until another thread delivers an interrupt
//! ```
//! use std::sync::Arc;
//! use halt_poll::{FutexWake, HaltPoller, Predictive, WokenDuring};
//!
//! let wake = Arc::new(FutexWake::new());
//! let mut poller = HaltPoller::new(wake.clone(), Predictive::default());
//!
//! // Another thread delivers an interrupt (source 0) to the halted vCPU.
//! let sender = std::thread::spawn(move || wake.wake(0));
//! let halt = poller.halt(); // KVM_EXIT_HLT: poll or block until woken
//! sender.join().unwrap();
//! assert_eq!(halt.fired, 1);
//! assert!(matches!(halt.outcome.woken, WokenDuring::Poll | WokenDuring::Block));
//! ```

#![deny(missing_docs)]

pub mod clock;
mod contention;
pub mod events;
#[cfg(any(test, feature = "fuzzing"))]
pub mod invariants;
#[cfg(feature = "kvm")]
pub mod kvm;
pub mod policy;
pub mod poller;
pub mod predictive;
pub mod presets;
/// The simulator (`sim/`, not part of the library) for the unit tests and
/// the fuzz target's invariants, naming this crate as its other users do.
#[cfg(any(test, feature = "fuzzing"))]
#[path = "../sim/mod.rs"]
mod sim;
#[cfg(any(test, feature = "fuzzing"))]
extern crate self as halt_poll;
pub mod stats;
pub mod timer_slack;
pub mod wake;

pub use clock::{Clock, FakeClock, MonotonicClock};
pub use events::{HaltEvents, NoEvents};
pub use policy::{Fixed, HaltOutcome, Never, PollPlan, PollPolicy, WokenDuring};
pub use poller::{Halt, HaltPoller};
pub use predictive::{Predictive, PredictiveConfig};
pub use presets::{AioPoll, GuestHaltpoll, KvmGrowShrink};
pub use stats::{HaltStats, LogHistogram};
pub use timer_slack::set_timer_slack;
pub use wake::{EventFdWake, FutexWake, MAX_SOURCES, SourceSet, WakeSource};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
