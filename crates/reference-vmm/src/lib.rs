//! A thin VMM on real KVM, written to be read and copied: where the
//! vm-latency crates go on a real vCPU exit path.
//!
//! # What it does
//! [`Vm::new`] creates a KVM VM with [vm-memory](vm_memory) guest memory and
//! the guest kit's boot structures ([`test_guests`]), and starts each vCPU
//! in 64-bit mode at CPL3. [`Vm::run`] runs a kit program on every vCPU, one
//! thread each, with a 16550 console from vm-superio and the kit's ucall
//! channel, through which the guest reports values, failed assertions and
//! completion. Anything the guest does wrong ends the run with an
//! [`Error::Guest`] naming the vCPU, what it did and its registers; guest
//! input never panics the VMM.
//!
//! # Where each crate goes
//! The mechanisms are values in [`VmConfig`]: its [`Policies`] (each hook
//! defaults to the family's own policy, [`FamilyPolicies`]) and plain
//! choices of place.
//!
//! | crate | the hook | where it acts |
//! |---|---|---|
//! | halt-poll | [`Policies::halt_poll`], [`Policies::guest_poll`]; [`VmConfig::kvm_halt_poll`] | a poller per vCPU and wake source on every `hlt` exit; KVM's own window on its LAPIC |
//! | lapic-timer | [`Policies::timer_advance`], [`VmConfig::timer_placement`] | each vCPU's host timer fires early by the advance and the vCPU spins to the deadline before entry |
//! | vcpu-sched | [`Policies::boost`] | run state around `KVM_RUN`; delivery boosts its target; pause and yield exits pick a candidate |
//! | rcu-qs | [`Policies::bus`], [`VmConfig::extended_qs`] | the device bus read on port exits; vCPU threads offline in the guest |
//! | dirty-log | [`Vm::dirty_slots`], [`duty_cycle`] | a migration (the `migration` crate) harvests dirty pages while the vCPUs run, and throttles them |
//!
//! `examples/minimal.rs` runs all five with a policy of its own.
//!
//! # Example
//! ```
//! use reference_vmm::{Vm, VmConfig};
//!
//! # if std::env::var_os("VM_LATENCY_ALLOW_NO_KVM").is_some() && kvm_ioctls::Kvm::new().is_err() { return; }
//! let config = VmConfig { vcpus: 2, ..VmConfig::default() };
//! let vm = Vm::new(&config).unwrap();
//! let report = vm.run(test_guests::find("hello").unwrap(), Box::new(std::io::sink())).unwrap();
//! assert_eq!(report.value(1, "apic_id"), Some(1));
//! ```

#![deny(missing_docs)]
// The VMM is a program, not a published library: its types hold trait objects
// and threads whose Debug output would say nothing, so the workspace-wide
// Debug requirement, which is for the five published crates, does not apply.
#![allow(missing_debug_implementations)]

mod apic;
pub mod cpu_features;
pub mod devices;
pub mod duty_cycle;
mod error;
mod exit;
mod fault;
mod guest_abi;
#[cfg(any(test, feature = "fuzzing"))]
pub mod invariants;
mod irq;
mod irqchip;
mod kick;
mod memory;
pub mod names;
mod policies;
mod report;
mod shared;
mod stop;
mod vcpu;
mod vm;

pub use apic::ApicState;
pub use cpu_features::CpuFeatures;
pub use error::{ConfigError, Error, RegisterDump};
pub use exit::{MAX_REPORTS, VcpuError};
pub use fault::GuestFault;
pub use guest_abi::MAX_LEAD;
pub use irqchip::ChipState;
pub use kick::KickError;
pub use memory::VmMemory;
pub use names::ChoiceError;
pub use policies::{
    CpuShare, FamilyPolicies, Irqchip, KvmHaltPoll, Policies, TimerPlacement, WakeSource,
};
pub use report::{RunReport, VcpuSummary, VmStats};
pub use stop::{DEFAULT_TIMEOUT, StopHandle, StopReason};
pub use vcpu::{StateSupport, VcpuState};
pub use vm::{Boot, Controller, PauseError, RunControl, Vm, VmConfig, VmDescription};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
