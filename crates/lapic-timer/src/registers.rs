//! The local APIC timer registers and their encodings (Intel SDM vol. 3, 11.5.4).

/// xAPIC offset of the LVT Timer register.
pub const LVT_TIMER: u32 = 0x320;
/// xAPIC offset of the Initial Count register.
pub const INITIAL_COUNT: u32 = 0x380;
/// xAPIC offset of the Current Count register (read-only).
pub const CURRENT_COUNT: u32 = 0x390;
/// xAPIC offset of the Divide Configuration register.
pub const DIVIDE_CONFIG: u32 = 0x3e0;
/// The IA32_TSC_DEADLINE MSR.
pub const MSR_TSC_DEADLINE: u32 = 0x6e0;
/// First x2APIC MSR; register at xAPIC offset `o` is MSR `X2APIC_MSR_BASE + (o >> 4)`.
pub const X2APIC_MSR_BASE: u32 = 0x800;

/// The x2APIC MSR of the register at xAPIC `offset`.
pub const fn x2apic_msr(offset: u32) -> u32 {
    X2APIC_MSR_BASE + (offset >> 4)
}

/// LVT Timer bit 16: the timer counts but does not interrupt.
pub const LVT_MASKED: u32 = 1 << 16;
const MODE_SHIFT: u32 = 17;
/// The LVT Timer bits a write can set: vector, mask, mode. (Bit 12, delivery
/// status, is read-only; the rest are reserved.)
pub const LVT_WRITABLE: u32 = 0xff | LVT_MASKED | (0b11 << MODE_SHIFT);
/// The Divide Configuration bits that count: 0, 1 and 3.
pub const DIVIDE_WRITABLE: u32 = 0b1011;

/// A timer register, as an xAPIC offset or an x2APIC MSR names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TimerRegister {
    /// LVT Timer (0x320, MSR 0x832).
    LvtTimer,
    /// Initial Count (0x380, MSR 0x838).
    InitialCount,
    /// Current Count (0x390, MSR 0x839), read-only.
    CurrentCount,
    /// Divide Configuration (0x3E0, MSR 0x83E).
    DivideConfig,
}

impl TimerRegister {
    /// Every timer register.
    pub const ALL: [TimerRegister; 4] = [
        Self::LvtTimer,
        Self::InitialCount,
        Self::CurrentCount,
        Self::DivideConfig,
    ];

    /// The register at xAPIC `offset`, if it is a timer register.
    pub fn from_offset(offset: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|r| r.offset() == offset)
    }

    /// The register behind x2APIC MSR `msr`, if it is a timer register.
    pub fn from_x2apic_msr(msr: u32) -> Option<Self> {
        Self::ALL
            .into_iter()
            .find(|r| x2apic_msr(r.offset()) == msr)
    }

    /// Its xAPIC offset.
    pub const fn offset(self) -> u32 {
        match self {
            Self::LvtTimer => LVT_TIMER,
            Self::InitialCount => INITIAL_COUNT,
            Self::CurrentCount => CURRENT_COUNT,
            Self::DivideConfig => DIVIDE_CONFIG,
        }
    }
}

/// The timer mode, LVT Timer bits 17-18.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TimerMode {
    /// 00: count down once from Initial Count.
    OneShot,
    /// 01: count down from Initial Count, reload, repeat.
    Periodic,
    /// 10: fire when the TSC reaches IA32_TSC_DEADLINE.
    TscDeadline,
    /// 11: reserved by the SDM; a guest can still write it.
    Reserved,
}

/// The LVT Timer register, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LvtTimer {
    /// Interrupt vector.
    pub vector: u8,
    /// Whether the interrupt is masked.
    pub masked: bool,
    /// Timer mode.
    pub mode: TimerMode,
}

impl LvtTimer {
    /// Decodes a raw register value; any 32-bit value decodes.
    pub fn from_raw(raw: u32) -> Self {
        let mode = match (raw >> MODE_SHIFT) & 0b11 {
            0b00 => TimerMode::OneShot,
            0b01 => TimerMode::Periodic,
            0b10 => TimerMode::TscDeadline,
            _ => TimerMode::Reserved,
        };
        Self {
            vector: raw as u8,
            masked: raw & LVT_MASKED != 0,
            mode,
        }
    }
}

/// The divisor that the Divide Configuration register `raw` selects.
///
/// Bits 0, 1 and 3 form a 3-bit value `v`: `0b111` divides by 1, any other by
/// `2^(v+1)`. Other bits are ignored.
pub fn divisor(raw: u32) -> u32 {
    let v = (raw & 0b11) | ((raw >> 1) & 0b100);
    if v == 0b111 { 1 } else { 2 << v }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divide_configuration_follows_the_sdm_table() {
        // (register value, divisor) from SDM Figure 11-10.
        let table = [
            (0b0000, 2),
            (0b0001, 4),
            (0b0010, 8),
            (0b0011, 16),
            (0b1000, 32),
            (0b1001, 64),
            (0b1010, 128),
            (0b1011, 1),
        ];
        for (raw, div) in table {
            assert_eq!(divisor(raw), div, "{raw:#06b}");
            assert_eq!(divisor(raw | 0xffff_fff4), div, "reserved bits are ignored");
        }
    }

    #[test]
    fn lvt_timer_decodes_vector_mask_and_every_mode() {
        assert_eq!(
            LvtTimer::from_raw(0x20),
            LvtTimer {
                vector: 0x20,
                masked: false,
                mode: TimerMode::OneShot
            }
        );
        assert_eq!(LvtTimer::from_raw(0x3_00ff).mode, TimerMode::Periodic);
        assert_eq!(LvtTimer::from_raw(0x4_0000).mode, TimerMode::TscDeadline);
        assert_eq!(LvtTimer::from_raw(0x6_0000).mode, TimerMode::Reserved);
        assert!(LvtTimer::from_raw(0x1_0000).masked);
    }

    #[test]
    fn registers_map_both_ways() {
        for r in TimerRegister::ALL {
            assert_eq!(TimerRegister::from_offset(r.offset()), Some(r));
            assert_eq!(
                TimerRegister::from_x2apic_msr(x2apic_msr(r.offset())),
                Some(r)
            );
        }
        assert_eq!(TimerRegister::from_offset(0x300), None);
        assert_eq!(TimerRegister::from_x2apic_msr(MSR_TSC_DEADLINE), None);
    }

    #[test]
    fn x2apic_msrs_are_offset_over_16() {
        assert_eq!(x2apic_msr(LVT_TIMER), 0x832);
        assert_eq!(x2apic_msr(INITIAL_COUNT), 0x838);
        assert_eq!(x2apic_msr(CURRENT_COUNT), 0x839);
        assert_eq!(x2apic_msr(DIVIDE_CONFIG), 0x83e);
    }
}
