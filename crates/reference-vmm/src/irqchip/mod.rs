//! Where a vCPU's local APIC lives, as the run loop drives it: the one
//! interrupt-controller abstraction of this VMM (crosvm's `IrqChip`, per
//! vCPU). [`UserIrqChip`] is this VMM's own, with the crates on its paths;
//! [`KernelIrqChip`] is KVM's in-kernel LAPIC, the baseline.

mod kernel;
mod user;

pub use kernel::KernelIrqChip;
pub use user::UserIrqChip;

use kvm_ioctls::VcpuFd;

use crate::error::Error;
use crate::shared::VmShared;

/// One vCPU's interrupt controller. The run loop calls it in this order:
/// [`entering_guest`](IrqChip::entering_guest), [`prepare_entry`](IrqChip::prepare_entry),
/// `KVM_RUN`, [`left_guest`](IrqChip::left_guest), then the exit's hook.
pub trait IrqChip: Sized {
    /// Sets up the vCPU's side on its own thread, before its first entry.
    fn start(fd: &VcpuFd, index: u32, shared: &std::sync::Arc<VmShared>) -> Result<Self, Error>;
    /// Publishes that the vCPU is about to enter the guest, before any look
    /// for work (see [`crate::irq`]).
    fn entering_guest(&mut self);
    /// Before `KVM_RUN`: fires what is due, injects the highest deliverable
    /// interrupt or asks for an interrupt window.
    fn prepare_entry(&mut self, fd: &mut VcpuFd) -> Result<(), Error>;
    /// After `KVM_RUN` returned, whatever it returned.
    fn left_guest(&mut self);
    /// `hlt` with interrupts enabled: waits until the vCPU has work or the
    /// VMM asks it to stop.
    fn halt(&mut self);
    /// A local APIC MSR read (x2APIC, TSC deadline); `None` is a #GP.
    fn read_msr(&mut self, index: u32) -> Option<u64>;
    /// A local APIC MSR write; `false` is a #GP.
    fn write_msr(&mut self, index: u32, value: u64) -> bool;
    /// An MMIO read the local APIC answers; `false` if `addr` is not its page.
    fn read_apic_mmio(&mut self, addr: u64, data: &mut [u8]) -> bool;
    /// An MMIO write the local APIC takes; `false` if `addr` is not its page.
    fn write_apic_mmio(&mut self, addr: u64, data: &[u8]) -> bool;
    /// The vCPU spins waiting for others (a pause-loop exit).
    fn waiting(&mut self);
    /// The guest asks to yield to vCPU `target`.
    fn yield_to(&mut self, target: usize);
}
