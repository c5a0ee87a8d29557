//! KVM's in-kernel LAPIC (`--irqchip kernel`): interrupts, the LAPIC timer
//! (with `lapic_timer_advance`) and halts (with KVM's halt polling) never
//! leave the kernel, so the vCPU's side in this VMM has no APIC: only KVM's
//! halt-polling window (set per VM, `KVM_CAP_HALT_POLL`, by [`set_window`])
//! and the vCPU's binary statistics, which say what KVM's polling did.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use halt_poll::kvm::{BinaryStats, KvmHaltStats, set_vm_halt_poll};
use kvm_ioctls::{VcpuFd, VmFd};

use super::IrqChip;
use crate::error::Error;
use crate::exit::NoApic;
use crate::shared::VmShared;

/// Sets the VM's halt-polling window, where a choice asks for one (`None`
/// leaves the module's `halt_poll_ns`).
pub fn set_window(vm: &VmFd, window: Option<Duration>) -> Result<(), Error> {
    match window {
        Some(window) => Ok(set_vm_halt_poll(vm, window)?),
        None => Ok(()),
    }
}

/// A vCPU on KVM's LAPIC: no timer thread, no poller, no scheduler hooks;
/// the APIC exits never reach this VMM (if one did, it would be a #GP).
pub struct KernelIrqChip {
    stats: BinaryStats,
    shared: Arc<VmShared>,
    apic: NoApic,
}

impl IrqChip for KernelIrqChip {
    type Apic = NoApic;

    fn start(fd: &VcpuFd, _: u32, shared: &Arc<VmShared>) -> Result<Self, Error> {
        Ok(Self {
            stats: BinaryStats::for_vcpu(fd)?,
            shared: shared.clone(),
            apic: NoApic,
        })
    }
    fn apic(&mut self) -> &mut NoApic {
        &mut self.apic
    }
    fn entering_guest(&mut self) {}
    fn prepare_entry(&mut self, _: &mut VcpuFd) -> Result<(), Error> {
        Ok(())
    }
    fn left_guest(&mut self) {}
    fn halt(&mut self) {}

    /// Adds what KVM's halt polling did for this vCPU to the VM's halt
    /// statistics, which keep the same names.
    fn finish(&mut self) -> Result<(), Error> {
        let kvm = KvmHaltStats::read(&self.stats)?;
        let h = &self.shared.halt_stats;
        h.halt_poll_success_ns
            .fetch_add(kvm.halt_poll_success_ns, Relaxed);
        h.halt_poll_fail_ns
            .fetch_add(kvm.halt_poll_fail_ns, Relaxed);
        h.halt_wait_ns.fetch_add(kvm.halt_wait_ns, Relaxed);
        h.halt_successful_poll
            .fetch_add(kvm.halt_successful_poll, Relaxed);
        h.halt_attempted_poll
            .fetch_add(kvm.halt_attempted_poll, Relaxed);
        Ok(())
    }
}
