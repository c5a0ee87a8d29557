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
//! - [`scheduler`]: the [`Scheduler`], one per VM: the vCPUs' states, the
//!   booster, the policy, KVM's last-boosted index and the guest view, with one
//!   method per vCPU event (entering and leaving the guest, an interrupt
//!   delivered, waiting, idle polling, halted and woken).
//! - [`state`]: [`VcpuState`], one vCPU's [`RunState`] and KVM's
//!   directed-yield flags (`ready`, `preempted`, `in_spin_loop`,
//!   `dy_eligible`), cache-padded atomics updated by its thread around
//!   `KVM_RUN` and by whoever delivers an interrupt.
//! - [`directed_yield`]: [`on_spin`], candidate selection equal to
//!   `kvm_vcpu_on_spin` (with the fix that records the index boosted), over a
//!   [`GuestView`].
//! - [`policy`]: the [`BoostPolicy`] hooks (delivery, wait, idle spin, run),
//!   the [`Ctx`] a policy acts through, and the presets [`NoBoost`],
//!   [`KvmReady`] (KVM's "Boost vCPUs that are delivering interrupts"), [`FifoOnDelivery`] and this crate's
//!   [`DirectedYield`]; [`pv_yield_to`] for a guest's "yield to vCPU n".
//! - [`boost`]: the [`Booster`], which boosts through a [`ThreadControl`] and
//!   undoes every boost when the vCPU runs, and at the latest after
//!   [`BoostBudget::max_boost`] from a revoker thread above every boost, even
//!   if the boosted thread never returns; never beyond a budget per period.
//! - [`clock`]: the booster's time, real or fake ([`FakeClock`]) for tests.
//! - [`thread`]: [`FifoBoost`] over `sched_setattr` (restoring each thread's
//!   own attributes), pinning and affinity helpers.
//! - [`probe`] and [`host_load`]: what a userspace VMM can see of the host
//!   scheduler: whether a thread is preempted, whether other tenants compete.
//! - [`events`]: [`SchedEvents`] with the no-op [`NoEvents`], and
//!   [`SchedStats`] with KVM's stat names.
//!
//! # Example
//! ```
//! use std::sync::Arc;
//! use vcpu_sched::thread::current_tid;
//! use vcpu_sched::{Booster, DirectedYield, FifoBoost, NoGuestView, SchedStats, Scheduler};
//!
//! let stats = Arc::new(SchedStats::default());
//! let booster = Booster::with_events(2, FifoBoost::default(), stats);
//! let sched = Scheduler::new(2, DirectedYield::new(), booster, NoGuestView);
//! sched.booster().register(1, current_tid()); // each vCPU thread registers itself
//! sched.delivered(1); // an IPI to vCPU 1
//! assert!(sched.state(1).is_ready());
//! sched.waiting(0); // vCPU 0 waits on it: a yield, or a boost of vCPU 1
//! sched.entering_guest(1);
//! sched.left_guest(1); // vCPU 1 ran: a boost, if any, is undone
//! assert!(!sched.booster().is_boosted(1) && !sched.state(1).is_ready());
//! println!("{} boosts", sched.events().boosts.load(std::sync::atomic::Ordering::Relaxed));
//! ```

#![deny(missing_docs)]

pub mod boost;
pub mod clock;
pub mod directed_yield;
pub mod events;
pub mod guest_request;
pub mod host_load;
#[cfg(any(test, feature = "fuzzing"))]
pub mod invariants;
pub mod irq_route;
pub mod policy;
pub mod probe;
pub mod scheduler;
pub mod state;
mod sync;
pub mod thread;

pub use boost::{BoostBudget, Booster};
pub use clock::{Clock, FakeClock, MonotonicClock};
pub use directed_yield::{GuestView, NoGuestView, YieldResult, on_spin};
pub use events::{NoEvents, SchedEvents, SchedStats};
pub use guest_request::{
    BoostRequest, GuestBoosts, RequestLimits, RequestOutcome, RequestWatcher, RequestWords,
};
pub use host_load::{Crowding, LoadSource, RunnableThreads};
pub use irq_route::{GsiRoute, IrqTargets, MsiMessage, NoTarget};
pub use policy::{
    Boost, BoostPolicy, Ctx, DirectedYield, FifoOnDelivery, KvmReady, NoBoost, boost_ready,
    pv_yield_to,
};
pub use probe::{PreemptionProbe, ThreadProbe, ThreadSeen};
pub use scheduler::{Delivery, Scheduler};
pub use state::{RunState, VcpuState};
pub use thread::{FifoBoost, SchedAttr, ThreadControl, Tid};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
