//! KVM's in-kernel LAPIC (`--irqchip kernel`): interrupts, the LAPIC timer
//! (with `lapic_timer_advance`) and halts (with KVM's halt polling) never
//! leave the kernel, so the vCPU's side in this VMM does nothing. KVM's
//! halt-polling window and binary statistics are set and read per VM
//! (`crate::vm`).

use std::sync::Arc;

use kvm_ioctls::VcpuFd;

use super::IrqChip;
use crate::error::Error;
use crate::shared::VmShared;

/// A vCPU on KVM's LAPIC: no timer thread, no poller, no scheduler hooks.
/// The APIC exits never reach this VMM; if one did, it would be a #GP.
#[derive(Debug)]
pub struct KernelIrqChip;

impl IrqChip for KernelIrqChip {
    fn start(_: &VcpuFd, _: u32, _: &Arc<VmShared>) -> Result<Self, Error> {
        Ok(Self)
    }
    fn entering_guest(&mut self) {}
    fn prepare_entry(&mut self, _: &mut VcpuFd) -> Result<(), Error> {
        Ok(())
    }
    fn left_guest(&mut self) {}
    fn halt(&mut self) {}
    fn read_msr(&mut self, _: u32) -> Option<u64> {
        None
    }
    fn write_msr(&mut self, _: u32, _: u64) -> bool {
        false
    }
    fn read_apic_mmio(&mut self, _: u64, _: &mut [u8]) -> bool {
        false
    }
    fn write_apic_mmio(&mut self, _: u64, _: &[u8]) -> bool {
        false
    }
    fn waiting(&mut self) {}
    fn yield_to(&mut self, _: usize) {}
}
