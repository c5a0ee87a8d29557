//! A LAPIC timer model whose host timer fires early by an auto-tuned advance and
//! spins to the exact deadline.
//!
//! A guest's local APIC timer (one-shot, periodic or TSC-deadline) is emulated
//! with a host timer, and host timers wake late: tens of microseconds on a busy
//! host. KVM arms its hrtimer early by `lapic_timer_advance_ns` and busy-waits the
//! rest just before entering the guest, so the interrupt lands on the deadline
//! and never before it. This crate carries that mechanism for a VMM that emulates
//! the local APIC in userspace.
//!
//! # Shape
//! - [`registers`]: the architectural timer registers and their encodings
//!   (SDM vol. 3, 11.5.4).
//! - The timer model, guest-time conversion, advance policies and the deadline
//!   backend are planned; see the README's status.
//!
//! # Example
//! ```
//! use lapic_timer::registers::{LvtTimer, TimerMode, divisor};
//!
//! let lvt = LvtTimer::from_raw(0x0004_00ec); // TSC-deadline mode, vector 0xec
//! assert_eq!(lvt.mode, TimerMode::TscDeadline);
//! assert_eq!(lvt.vector, 0xec);
//! assert!(!lvt.masked);
//! assert_eq!(divisor(0b1011), 1);
//! ```

#![deny(missing_docs)]

pub mod registers;

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
