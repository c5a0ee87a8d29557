//! A LAPIC timer model whose host timer fires early by an auto-tuned advance and
//! spins to the exact deadline.
//!
//! A guest's local APIC timer (one-shot, periodic or TSC-deadline) is emulated
//! with a host timer, and host timers wake late: tens of microseconds on a busy
//! host (21-34 µs for a timerfd on this project's machines). KVM arms its
//! hrtimer early by `lapic_timer_advance_ns` and busy-waits the rest just before
//! entering the guest, so the interrupt lands on the deadline and never before
//! it. This crate carries that mechanism for a VMM that emulates the local APIC
//! in userspace, with an advance learned from the host timer's own lateness.
//!
//! # Pieces
//! - [`LapicTimer`]: the register-accurate model (LVT Timer, Initial/Current
//!   Count, Divide Configuration, IA32_TSC_DEADLINE), by xAPIC offset
//!   ([`TimerRegister`]) or MSR ([`LapicTimer::write_msr`]), with plain-data
//!   save/restore ([`LapicTimerState`]).
//! - [`GuestTime`] maps the guest TSC onto host time; [`Clock`] with
//!   [`MonotonicClock`], [`TscClock`] and [`FakeClock`].
//! - [`AdvancePolicy`]: [`NoAdvance`], [`Fixed`], [`KvmAdaptive`] (the kernel's
//!   exact rule) and this crate's [`Percentile`]; [`DeliveryLead`] learns the
//!   path from delivery to the guest's handler.
//! - [`TimerThread`]: a timerfd armed `advance + lead` early, an expiry path
//!   that spins to the target ([`SpinAt`]), a [`TimerSink`], and [`TimerEvents`]
//!   metrics ([`TimerStats`]).
//! - [`SignalTimer`]: the same deadlines with no timer thread: a POSIX timer
//!   signals the receiving thread itself (in a VMM, the vCPU thread, out of
//!   `KVM_RUN`), from the timer interrupt, as KVM's hrtimer kicks its vCPU.
//!
//! # Example: the guest arms a TSC deadline; the VMM fires it on time
//! ```
//! use std::sync::mpsc;
//! use lapic_timer::{
//!     Clock, Expiry, GuestTime, LapicTimer, MonotonicClock, NoEvents, Percentile, SpinAt,
//!     TimerRegister, TimerSink, TimerThread, TscClock,
//! };
//!
//! struct Inject(mpsc::Sender<Expiry>); // in a VMM: set IRR, kick the vCPU
//! impl TimerSink for Inject {
//!     fn expired(&self, e: Expiry) { self.0.send(e).unwrap() }
//! }
//!
//! let clock = TscClock::shared();
//! let mut lapic = LapicTimer::new(GuestTime::from_host(&clock, 0));
//! let now = MonotonicClock.now_ns();
//! lapic.write(TimerRegister::LvtTimer, 0x4_00ec, now).unwrap(); // TSC-deadline, vector 0xec
//! let guest_now = lapic.guest_time().tsc_at(now);
//! lapic.write_tsc_deadline(guest_now + clock.tsc_khz()); // 1 ms from now
//!
//! let (tx, rx) = mpsc::channel();
//! let timer = TimerThread::start(Percentile::default(), Inject(tx), NoEvents, SpinAt::TimerThread).unwrap();
//! timer.arm(lapic.next_expiry_ns().unwrap(), 0xec).unwrap();
//! let expiry = rx.recv().unwrap();
//! assert!(MonotonicClock.now_ns() >= expiry.target_ns, "never before the deadline");
//! let fired = lapic.expire(MonotonicClock.now_ns()).unwrap();
//! assert_eq!((fired.vector, fired.deliver), (0xec, true));
//! ```

#![deny(missing_docs)]

pub mod advance;
pub mod backend;
pub mod clock;
pub mod events;
#[cfg(any(test, feature = "fuzzing"))]
pub mod invariants;
pub mod lead;
pub mod model;
pub mod registers;
pub mod signal;
/// The simulator (`sim/`, not part of the library), for its own unit
/// tests, naming this crate as its other users do.
#[cfg(test)]
#[path = "../sim/mod.rs"]
mod sim;
pub mod spin_budget;
#[cfg(test)]
extern crate self as lapic_timer;
pub mod time;

pub use advance::{
    AdvancePolicy, Fixed, KvmAdaptive, NoAdvance, Percentile, PercentileConfig, Wakeup,
};
pub use backend::{Expiry, NoSink, SpinAt, TimerPlacement, TimerSink, TimerThread};
pub use clock::{Clock, FakeClock, MonotonicClock};
pub use events::{NoEvents, Spin, TimerEvents, TimerStats};
pub use lead::DeliveryLead;
pub use model::{Fired, KVM_MIN_TIMER_PERIOD_NS, LapicTimer, LapicTimerState, TimerError};
pub use registers::{LvtTimer, TimerMode, TimerRegister};
pub use signal::SignalTimer;
pub use spin_budget::{DEFAULT_SPIN_SHARE, SPIN_BURST};
pub use time::{GuestTime, ThreadCpuClock, TscClock};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
