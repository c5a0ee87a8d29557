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
//! - [`state`]: [`VcpuState`], one vCPU's [`RunState`] and KVM's
//!   directed-yield flags (`ready`, `preempted`, `in_spin_loop`,
//!   `dy_eligible`), cache-padded atomics updated by its thread around
//!   `KVM_RUN` and by whoever delivers an interrupt.
//! - [`directed_yield`]: [`on_spin`], candidate selection equal to
//!   `kvm_vcpu_on_spin` (with the fix that records the index boosted).
//! - [`policy`]: the [`BoostPolicy`] hooks (delivery, wait, idle spin, run)
//!   and the presets [`NoBoost`], [`KvmReady`] (the seed), [`FifoOnDelivery`]
//!   and this crate's [`DirectedYield`]; [`pv_yield_to`] for a guest's
//!   "yield to vCPU n".
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
//! use std::sync::atomic::AtomicUsize;
//! use vcpu_sched::thread::current_tid;
//! use vcpu_sched::{BoostPolicy, Booster, Ctx, DirectedYield, FifoBoost, NoGuestView, VcpuState};
//!
//! let vcpus: Vec<VcpuState> = (0..2).map(|_| VcpuState::new()).collect();
//! let booster = Booster::new(2, FifoBoost::default());
//! booster.register(1, current_tid()); // each vCPU thread registers itself
//! let last_boosted = AtomicUsize::new(0);
//! let ctx = Ctx {
//!     vcpus: &vcpus,
//!     booster: &booster,
//!     last_boosted: &last_boosted,
//!     guest: &NoGuestView,
//! };
//! let policy = DirectedYield::new();
//! policy.on_delivery(&ctx, 1); // an IPI to vCPU 1
//! assert!(vcpus[1].is_ready());
//! policy.on_wait(&ctx, 0); // vCPU 0 waits on it: a yield, or a boost of vCPU 1
//! vcpus[1].entering_guest();
//! policy.on_run(&ctx, 1); // vCPU 1 runs: a boost, if any, is undone
//! assert!(!booster.is_boosted(1) && !vcpus[1].is_ready());
//! ```

#![deny(missing_docs)]

pub mod boost;
pub mod clock;
pub mod directed_yield;
pub mod events;
pub mod host_load;
#[cfg(any(test, feature = "fuzzing"))]
pub mod invariants;
pub mod policy;
pub mod probe;
pub mod state;
mod sync;
pub mod thread;

pub use boost::{BoostBudget, Booster};
pub use clock::{Clock, FakeClock, MonotonicClock};
pub use directed_yield::{GuestView, NoGuestView, YieldResult, on_spin};
pub use events::{NoEvents, SchedEvents, SchedStats};
pub use host_load::{Crowding, LoadSource, RunnableThreads};
pub use policy::{
    Boost, BoostPolicy, Ctx, DirectedYield, FifoOnDelivery, KvmReady, NoBoost, boost_ready,
    pv_yield_to,
};
pub use probe::PreemptionProbe;
pub use state::{RunState, VcpuState};
pub use thread::{FifoBoost, SchedAttr, ThreadControl, Tid};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
