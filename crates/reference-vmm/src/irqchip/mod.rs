//! Where a vCPU's local APIC lives, as the run loop drives it: the one
//! interrupt-controller abstraction of this VMM (crosvm's `IrqChip`, per
//! vCPU). [`UserIrqChip`] is this VMM's own, with the crates on its paths;
//! [`KernelIrqChip`] is KVM's in-kernel LAPIC, the baseline.

mod host_timer;
mod kernel;
pub(crate) mod state;
mod timer_wake;
mod user;

pub use kernel::{KernelIrqChip, TunerThread, set_window};
pub use state::ChipState;
pub use user::UserIrqChip;

use std::sync::Arc;

use kvm_ioctls::VcpuFd;

use crate::error::Error;
use crate::exit::ApicExits;
use crate::shared::VmShared;

/// One vCPU's interrupt controller: its local APIC's exits ([`ApicExits`])
/// and the loop's hooks around `KVM_RUN`. The run loop calls
/// [`entering_guest`](IrqChip::entering_guest), [`prepare_entry`](IrqChip::prepare_entry),
/// `KVM_RUN`, [`left_guest`](IrqChip::left_guest), then the exit's hook, and
/// [`finish`](IrqChip::finish) when the vCPU is done.
pub trait IrqChip: Sized {
    /// Where the vCPU's APIC exits go.
    type Apic: ApicExits;
    /// Sets up the vCPU's side on its own thread, before its first entry.
    fn start(fd: &VcpuFd, index: u32, shared: &Arc<VmShared>) -> Result<Self, Error>;
    /// The vCPU's local APIC, for its exits.
    fn apic(&mut self) -> &mut Self::Apic;
    /// Publishes that the vCPU is about to enter the guest, before any look
    /// for work (see [`crate::irq`]).
    fn entering_guest(&mut self);
    /// Before `KVM_RUN`: fires what is due, injects the highest deliverable
    /// interrupt or asks for an interrupt window.
    fn prepare_entry(&mut self, fd: &mut VcpuFd) -> Result<(), Error>;
    /// After `KVM_RUN` returned, whatever it returned.
    fn left_guest(&mut self);
    /// `hlt` with interrupts enabled: waits until the vCPU has work (`true`)
    /// or the VMM asks it to stop or pause (`false`: it is still halted).
    fn halt(&mut self) -> bool;
    /// The controller's state, for a migration (the vCPU is out of `KVM_RUN`).
    fn save(&mut self, fd: &VcpuFd) -> Result<ChipState, Error>;
    /// Takes on a migrated state, before the vCPU's first entry.
    fn restore(&mut self, state: &ChipState) -> Result<(), Error>;
    /// The vCPU's run ended: adds what the chip measured to the VM's
    /// statistics.
    fn finish(&mut self) -> Result<(), Error>;
}
