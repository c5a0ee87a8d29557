//! A thin VMM on real KVM that runs small guest programs, and the place where the
//! vm-latency crates meet on a real vCPU exit path.
//!
//! # What it does
//! [`Vm::new`] creates a KVM VM with [vm-memory](vm_memory) guest memory, builds
//! 4-level page tables, a GDT, and each vCPU's IDT and TSS in guest memory, and
//! starts each vCPU directly in 64-bit mode at CPL3. [`Vm::run`] runs a built-in
//! [guest program](test_guests::GuestProgram) on every vCPU, one thread each, with a 16550 serial
//! console from vm-superio and a [ucall](test_guests::ucall) channel through which the guest
//! reports values, failed assertions and completion, the way KVM selftests do.
//!
//! Guest hot code runs at CPL3 because this machine's KVM (PVM) emulates CPL0 code
//! one instruction at a time; CPL0 runs only short exception stubs. Anything the
//! guest does wrong ends the run with an [`Error::Guest`] that names the vCPU, what
//! it did and its registers; guest input never panics the VMM.
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
pub mod devices;
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
pub mod migration;
mod policies;
pub mod presets;
mod report;
mod shared;
mod stop;
mod vcpu;
mod vm;

pub use error::{ConfigError, Error, RegisterDump};
pub use exit::{MAX_REPORTS, VcpuError};
pub use fault::GuestFault;
pub use guest_abi::MAX_LEAD;
pub use kick::KickError;
pub use memory::VmMemory;
pub use policies::{FamilyPolicies, Irqchip, KvmHaltPoll, Policies, TimerPlacement, WakeSource};
pub use report::{RunReport, VcpuSummary, VmStats};
pub use stop::{DEFAULT_TIMEOUT, StopHandle, StopReason};
pub use vm::{Boot, Controller, RunControl, Vm, VmConfig};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
