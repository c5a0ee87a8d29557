//! A vCPU's interrupt controller as saved: plain data, whichever kind holds
//! its local APIC.

use kvm_bindings::kvm_lapic_state;

use crate::apic::ApicState;

/// A vCPU's interrupt controller, as saved.
#[derive(Debug)]
pub enum ChipState {
    /// KVM's in-kernel LAPIC: its register page.
    Kernel(Box<kvm_lapic_state>),
    /// This VMM's APIC: its registers and the vectors pending on it.
    User {
        /// The registers and the armed timer.
        apic: ApicState,
        /// Interrupts posted to the vCPU and not yet injected (IRR).
        irr: [u64; 4],
    },
}
