//! The local-APIC registers the guest programs touch, as x2APIC MSRs and the
//! xAPIC page (Intel SDM vol. 3, 11.12.1.2).

/// IA32_APIC_BASE: the APIC's base address, its enable and x2APIC bits.
pub const MSR_APIC_BASE: u32 = 0x1B;
/// The xAPIC page's default guest physical address.
pub const XAPIC_BASE: u64 = 0xFEE0_0000;
/// IA32_TSC_DEADLINE.
pub const MSR_TSC_DEADLINE: u32 = 0x6E0;
/// x2APIC end of interrupt.
pub const MSR_EOI: u32 = 0x80B;
/// x2APIC spurious-interrupt vector register (bit 8: software enable).
pub const MSR_SVR: u32 = 0x80F;
/// x2APIC error status.
pub const MSR_ESR: u32 = 0x828;
/// x2APIC interrupt command register (one 64-bit MSR).
pub const MSR_ICR: u32 = 0x830;
/// x2APIC LVT timer.
pub const MSR_LVT_TIMER: u32 = 0x832;
/// x2APIC timer initial count.
pub const MSR_TIMER_INITIAL_COUNT: u32 = 0x838;
/// x2APIC timer divide configuration.
pub const MSR_TIMER_DIVIDE: u32 = 0x83E;
