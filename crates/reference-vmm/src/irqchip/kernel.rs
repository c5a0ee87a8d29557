//! KVM's in-kernel LAPIC (`--irqchip kernel`): interrupts, the LAPIC timer
//! (with `lapic_timer_advance`) and halts (with KVM's halt polling) never
//! leave the kernel, so the vCPU's side in this VMM has no APIC at all. KVM's
//! halt-polling window and binary statistics are set and read per VM
//! (`crate::vm`).

use std::sync::Arc;

use kvm_ioctls::VcpuFd;

use super::IrqChip;
use crate::error::Error;
use crate::exit::NoApic;
use crate::shared::VmShared;

/// A vCPU on KVM's LAPIC: no timer thread, no poller, no scheduler hooks;
/// the APIC exits never reach this VMM (if one did, it would be a #GP).
pub type KernelIrqChip = NoApic;

impl IrqChip for NoApic {
    fn start(_: &VcpuFd, _: u32, _: &Arc<VmShared>) -> Result<Self, Error> {
        Ok(Self)
    }
    fn entering_guest(&mut self) {}
    fn prepare_entry(&mut self, _: &mut VcpuFd) -> Result<(), Error> {
        Ok(())
    }
    fn left_guest(&mut self) {}
    fn halt(&mut self) {}
}
