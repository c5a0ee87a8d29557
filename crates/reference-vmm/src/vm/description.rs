//! What a VM is, as plain data ([`VmDescription`]): all a migration's
//! destination or a snapshot's restore needs to create the VM again.

use crate::cpu_features::CpuFeatures;
use crate::policies::Irqchip;
use test_guests::layout::PARAMS;

/// Everything the destination needs to create the VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmDescription {
    /// The guest program's name (see [`test_guests::programs::find`]).
    pub program: String,
    /// vCPUs.
    pub vcpus: u32,
    /// Guest memory, MiB.
    pub mem_mib: u64,
    /// The program's parameters.
    pub params: [u64; PARAMS],
    /// Where the local APICs live (the vCPUs' interrupt-controller state
    /// is for that kind).
    pub irqchip: Irqchip,
    /// The floor on a periodic LAPIC timer's period, ns.
    pub min_timer_period_ns: u64,
    /// The guest's TSC frequency, kHz.
    pub tsc_khz: u32,
    /// The CPU features the guest was given: a destination that lacks one
    /// refuses the guest, naming it, before the source lets go.
    pub cpu_features: CpuFeatures,
    /// The MSRs each vCPU's state carries (those the source's KVM lists): a
    /// destination whose KVM lacks one refuses the guest, naming it.
    pub msrs: Vec<u32>,
}
