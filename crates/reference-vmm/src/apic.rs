//! A local APIC emulated in the VMM: there is no in-kernel irqchip, so every
//! x2APIC MSR access exits to userspace (KVM's `INVAL` reason),
//! IA32_TSC_DEADLINE and IA32_APIC_BASE through the MSR filter, and an
//! access to the xAPIC page at 0xFEE00000 (no memory there) as MMIO.
//!
//! It resets in xAPIC mode, as hardware does: the registers are then the
//! MMIO page's 32-bit words (ID in bits 31:24, the ICR in two halves, the
//! destination in the high one's bits 31:24) and x2APIC MSRs #GP. Setting
//! IA32_APIC_BASE's EXTD bit switches to x2APIC mode, where the MSRs work and
//! the page is not decoded. The other transitions (disabling the APIC, back
//! to xAPIC) are not supported and #GP.
//!
//! The model is plain data owned by its vCPU's thread: only that vCPU reads
//! and writes its registers. Interrupts posted by other threads (IPIs, a
//! timer thread) arrive as IRR bits in [`crate::irq`]; the vCPU thread moves
//! the highest deliverable one into service here when it injects it.
//!
//! What it does, with the SDM's rules: ID (read-only, the vCPU index), version,
//! TPR and PPR, EOI (clears the highest in-service vector), SVR (software
//! enable; disabled at reset), ISR/TMR/IRR reads, ESR (write, then read),
//! ICR (fixed IPIs: physical destination, self, all, all-excluding-self), the
//! self-IPI register, the LVT entries, and the timer through
//! [`lapic_timer::LapicTimer`] (one-shot, periodic, TSC-deadline). Accesses the
//! architecture forbids (writing a read-only register, reading EOI, an unknown
//! x2APIC MSR) are errors the VMM turns into #GP; an IPI with an illegal
//! vector (0-15) is not sent and sets the ESR, as hardware does.

use lapic_timer::{GuestTime, LapicTimer, LapicTimerState, TimerRegister};

/// IA32_APIC_BASE.
pub const MSR_APIC_BASE: u32 = 0x1B;
/// Guest physical address of the xAPIC register page.
pub const XAPIC_BASE: u64 = 0xFEE0_0000;
/// Size of the xAPIC register page.
pub const XAPIC_SIZE: u64 = 0x1000;
/// IA32_TSC_DEADLINE.
pub const MSR_TSC_DEADLINE: u32 = 0x6E0;
/// First x2APIC MSR.
pub const X2APIC_FIRST: u32 = 0x800;
/// Last x2APIC MSR.
pub const X2APIC_LAST: u32 = 0x8FF;

const ID: u32 = 0x802;
const VERSION: u32 = 0x803;
const TPR: u32 = 0x808;
const PPR: u32 = 0x80A;
const EOI: u32 = 0x80B;
const LDR: u32 = 0x80D;
const SVR: u32 = 0x80F;
const ISR: u32 = 0x810;
const TMR: u32 = 0x818;
const IRR: u32 = 0x820;
const ESR: u32 = 0x828;
const ICR: u32 = 0x830;
const LVT_FIRST: u32 = 0x832;
const LVT_LAST: u32 = 0x837;
const SELF_IPI: u32 = 0x83F;

/// Version register: version 0x14, 6 LVT entries (max LVT index 5).
const VERSION_VALUE: u64 = 0x14 | 5 << 16;
/// SVR's APIC software-enable bit.
const SVR_ENABLED: u32 = 1 << 8;
/// Value of SVR at reset: spurious vector 0xFF, disabled.
const SVR_RESET: u32 = 0xFF;
/// IA32_APIC_BASE's global-enable bit.
const APIC_BASE_EN: u64 = 1 << 11;
/// IA32_APIC_BASE's x2APIC-mode bit.
const APIC_BASE_EXTD: u64 = 1 << 10;
/// IA32_APIC_BASE's bootstrap-processor bit: vCPU 0's, as KVM resets it.
const APIC_BASE_BSP: u64 = 1 << 8;
/// The SVR bits a write keeps: the spurious vector, software enable and
/// focus checking (KVM's; no directed EOI, which the version does not offer).
const SVR_WRITABLE: u32 = 0x3FF;
/// The LVT bits a write keeps, as KVM keeps them (`apic_lvt_mask`): vector,
/// delivery status and mask for all; delivery mode for Thermal and PMC;
/// also polarity, remote IRR and trigger mode for LINT0 and LINT1.
const LVT_WRITABLE: [u32; 5] = [0x117FF, 0x117FF, 0x1F7FF, 0x1F7FF, 0x110FF];
/// xAPIC DFR: the flat model.
const DFR_FLAT: u32 = 0xFFFF_FFFF;
/// ESR bit: an IPI with an illegal vector was sent.
pub const ESR_SEND_ILLEGAL_VECTOR: u32 = 1 << 5;
/// ESR bit: an illegal vector was received (the self-IPI register).
pub const ESR_RECEIVE_ILLEGAL_VECTOR: u32 = 1 << 6;
/// ESR bit: an access to a register that does not exist (xAPIC).
pub const ESR_ILLEGAL_REGISTER: u32 = 1 << 7;
/// LVT mask bit.
const LVT_MASKED: u32 = 1 << 16;
/// MAXPHYADDR's architectural limit, a new APIC's until told its CPU's
/// ([`LocalApic::with_phys_bits`]).
pub const MAX_PHYS_BITS: u8 = 52;
/// LINT0 of vCPU 0 at reset: ExtINT, unmasked, as KVM resets it
/// (`KVM_X86_QUIRK_LINT0_REENABLED`; there is no PIC behind it here).
const LINT0_BSP_RESET: u32 = 0x700;
/// xAPIC registers with no x2APIC MSR of the same layout.
const XAPIC_ID: u64 = 0x20;
const XAPIC_LDR: u64 = 0xD0;
const XAPIC_DFR: u64 = 0xE0;
const XAPIC_ICR_LOW: u64 = 0x300;
const XAPIC_ICR_HIGH: u64 = 0x310;

/// Whom an IPI goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Destination {
    /// One vCPU, by x2APIC ID (the vCPU index here); may not exist.
    Physical(u32),
    /// The sender itself.
    SelfOnly,
    /// Every vCPU, the sender included.
    All,
    /// Every vCPU but the sender.
    AllExcludingSelf,
}

impl Destination {
    /// Whether an IPI to here from vCPU `from` reaches vCPU `to`, whose APIC
    /// is in x2APIC mode or not. A physical ID of all ones is a broadcast in
    /// the receiver's mode (8 bits wide in xAPIC mode), as KVM judges it: an
    /// xAPIC sender's 0xFF misses a receiver in x2APIC mode.
    pub fn reaches(self, from: usize, to: usize, to_x2apic: bool) -> bool {
        match self {
            Self::Physical(id) => {
                let broadcast = if to_x2apic { u32::MAX } else { 0xFF };
                id == broadcast || usize::try_from(id) == Ok(to)
            }
            Self::SelfOnly => from == to,
            Self::All => true,
            Self::AllExcludingSelf => from != to,
        }
    }
}

/// What a register write asks of the VMM beyond the register itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Nothing.
    None,
    /// Send fixed interrupt `vector` to `to`.
    Ipi {
        /// The vector (16-255).
        vector: u8,
        /// Whom to.
        to: Destination,
    },
    /// An in-service vector ended: another may be deliverable now.
    Eoi,
    /// The timer's registers changed: re-arm its host timer.
    TimerChanged,
}

/// An access the architecture does not allow: the guest gets #GP.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApicFault {
    /// An MSR this APIC does not have.
    #[error("MSR {0:#x} is not an x2APIC register")]
    NoSuchRegister(u32),
    /// A write to a read-only register.
    #[error("MSR {0:#x} is read-only")]
    ReadOnly(u32),
    /// A read of a write-only register.
    #[error("MSR {0:#x} is write-only")]
    WriteOnly(u32),
    /// An x2APIC MSR in xAPIC mode, or the xAPIC page in x2APIC mode.
    #[error("register {0:#x} is not reachable in this APIC mode")]
    WrongMode(u32),
    /// A non-zero write to EOI, or reserved ICR bits.
    #[error("reserved bits set in a write of {value:#x} to MSR {msr:#x}")]
    Reserved {
        /// The MSR.
        msr: u32,
        /// The value written.
        value: u64,
    },
}

/// One vCPU's local APIC registers.
#[derive(Clone, Debug)]
pub struct LocalApic {
    id: u32,
    /// The vCPU's MAXPHYADDR: IA32_APIC_BASE's bits from it up are reserved.
    phys_bits: u8,
    x2apic: bool,
    tpr: u8,
    svr: u32,
    isr: [u64; 4],
    esr: u32,
    /// ESR bits collected since the last ESR write.
    esr_pending: u32,
    icr: u64,
    /// xAPIC ICR bits 63:32, as written (the destination in bits 31:24).
    icr_high: u32,
    /// LVT Thermal, PMC, LINT0, LINT1, Error (the timer's lives in `timer`).
    lvt: [u32; 5],
    timer: LapicTimer,
}

/// This VMM's local APIC's registers as plain data: what a
/// [`ChipState::User`](crate::ChipState::User) saves and restores.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ApicState {
    /// x2APIC mode (IA32_APIC_BASE.EXTD).
    pub x2apic: bool,
    /// TPR.
    pub tpr: u8,
    /// SVR.
    pub svr: u32,
    /// ISR, vectors 0-255.
    pub isr: [u64; 4],
    /// ESR, as last latched.
    pub esr: u32,
    /// ESR bits collected since the last ESR write.
    pub esr_pending: u32,
    /// ICR (x2APIC layout; the xAPIC low half in bits 31:0).
    pub icr: u64,
    /// xAPIC ICR bits 63:32.
    pub icr_high: u32,
    /// LVT Thermal, PMC, LINT0, LINT1, Error.
    pub lvt: [u32; 5],
    /// The timer's registers and time remaining.
    pub timer: LapicTimerState,
}

impl ApicState {
    /// Whether the saved APIC was software-enabled.
    pub fn enabled(&self) -> bool {
        self.svr & SVR_ENABLED != 0
    }
}

impl LocalApic {
    /// The APIC of vCPU `id`, in its reset state, with a timer on `time`.
    pub fn new(id: u32, time: GuestTime) -> Self {
        Self {
            id,
            phys_bits: MAX_PHYS_BITS,
            x2apic: false,
            tpr: 0,
            svr: SVR_RESET,
            isr: [0; 4],
            esr: 0,
            esr_pending: 0,
            icr: 0,
            icr_high: 0,
            lvt: [
                LVT_MASKED,
                LVT_MASKED,
                if id == 0 { LINT0_BSP_RESET } else { LVT_MASKED },
                LVT_MASKED,
                LVT_MASKED,
            ],
            timer: LapicTimer::new(time),
        }
    }

    /// The same APIC with another floor on its periodic timer's period
    /// (ns; KVM's 200 µs by default, see [`LapicTimer::with_min_period_ns`]).
    pub fn with_min_timer_period_ns(mut self, ns: u64) -> Self {
        self.timer = self.timer.with_min_period_ns(ns);
        self
    }

    /// The same APIC on a CPU with `bits` physical-address bits (CPUID
    /// 0x8000_0008 EAX\[7:0\], at most [`MAX_PHYS_BITS`]): a write of
    /// IA32_APIC_BASE with a bit from there up is a #GP.
    pub fn with_phys_bits(mut self, bits: u8) -> Self {
        self.phys_bits = bits.min(MAX_PHYS_BITS);
        self
    }

    /// The timer, for the VMM to expire and arm.
    pub fn timer(&mut self) -> &mut LapicTimer {
        &mut self.timer
    }

    /// The registers as plain data at host time `now_ns` (the timer's as
    /// time remaining), for a snapshot or a migration.
    pub fn save(&self, now_ns: u64) -> ApicState {
        ApicState {
            x2apic: self.x2apic,
            tpr: self.tpr,
            svr: self.svr,
            isr: self.isr,
            esr: self.esr,
            esr_pending: self.esr_pending,
            icr: self.icr,
            icr_high: self.icr_high,
            lvt: self.lvt,
            timer: self.timer.save(now_ns),
        }
    }

    /// Takes on a saved state at host time `now_ns`. The ID stays this
    /// APIC's; the timer masks its values as a write would.
    pub fn restore(&mut self, state: &ApicState, now_ns: u64) {
        self.x2apic = state.x2apic;
        self.tpr = state.tpr;
        self.svr = state.svr;
        self.isr = state.isr;
        self.esr = state.esr;
        self.esr_pending = state.esr_pending;
        self.icr = state.icr;
        self.icr_high = state.icr_high;
        self.lvt = state.lvt;
        self.timer.restore(&state.timer, now_ns);
    }

    /// Whether the guest has software-enabled the APIC.
    pub fn enabled(&self) -> bool {
        self.svr & SVR_ENABLED != 0
    }

    /// The processor priority: the higher of TPR and the in-service class.
    pub fn ppr(&self) -> u8 {
        let isrv = highest(&self.isr).unwrap_or(0);
        if self.tpr >> 4 >= isrv >> 4 {
            self.tpr
        } else {
            isrv & 0xF0
        }
    }

    /// The vector to inject now, if any: the highest pending in `irr` whose
    /// priority class is above the processor priority's.
    pub fn deliverable(&self, irr: &[u64; 4]) -> Option<u8> {
        let v = highest(irr)?;
        (self.enabled() && v >> 4 > self.ppr() >> 4).then_some(v)
    }

    /// `vector` was injected: it is in service until its EOI.
    pub fn start_service(&mut self, vector: u8) {
        self.isr[usize::from(vector / 64)] |= 1 << (vector % 64);
    }

    /// Whether the APIC is in x2APIC mode (else xAPIC).
    pub fn x2apic(&self) -> bool {
        self.x2apic
    }

    fn apic_base(&self) -> u64 {
        let extd = if self.x2apic { APIC_BASE_EXTD } else { 0 };
        let bsp = if self.id == 0 { APIC_BASE_BSP } else { 0 };
        XAPIC_BASE | APIC_BASE_EN | extd | bsp
    }

    /// x2APIC MSRs exist only in x2APIC mode.
    fn check_msr_mode(&self, msr: u32) -> Result<(), ApicFault> {
        match (X2APIC_FIRST..=X2APIC_LAST).contains(&msr) && !self.x2apic {
            true => Err(ApicFault::WrongMode(msr)),
            false => Ok(()),
        }
    }

    /// Reads MSR `msr`; `irr` is the vCPU's pending set, `now_ns` host time.
    pub fn read(&self, msr: u32, irr: &[u64; 4], now_ns: u64) -> Result<u64, ApicFault> {
        self.check_msr_mode(msr)?;
        self.read_register(msr, irr, now_ns)
    }

    fn read_register(&self, msr: u32, irr: &[u64; 4], now_ns: u64) -> Result<u64, ApicFault> {
        Ok(match msr {
            MSR_APIC_BASE => self.apic_base(),
            ID => u64::from(self.id),
            VERSION => VERSION_VALUE,
            TPR => u64::from(self.tpr),
            PPR => u64::from(self.ppr()),
            LDR => u64::from((self.id >> 4) << 16 | 1 << (self.id & 0xF)),
            SVR => u64::from(self.svr),
            ISR..=0x817 => word32(&self.isr, msr - ISR),
            TMR..=0x81F => 0,
            IRR..=0x827 => word32(irr, msr - IRR),
            ESR => u64::from(self.esr),
            ICR => self.icr,
            MSR_TSC_DEADLINE | LVT_FIRST..=LVT_LAST | 0x838 | 0x839 | 0x83E => {
                self.read_lvt_or_timer(msr, now_ns)?
            }
            EOI | SELF_IPI => return Err(ApicFault::WriteOnly(msr)),
            other => return Err(ApicFault::NoSuchRegister(other)),
        })
    }

    fn read_lvt_or_timer(&self, msr: u32, now_ns: u64) -> Result<u64, ApicFault> {
        match self.timer.read_msr(msr, now_ns) {
            Ok(value) => Ok(value),
            Err(_) => self.lvt_index(msr).map(|i| u64::from(self.lvt[i])),
        }
    }

    fn lvt_index(&self, msr: u32) -> Result<usize, ApicFault> {
        match msr {
            0x833..=LVT_LAST => Ok((msr - 0x833) as usize),
            other => Err(ApicFault::NoSuchRegister(other)),
        }
    }

    /// Writes `value` to MSR `msr` at host time `now_ns`. Bits 63:32 of an
    /// x2APIC register other than the ICR are reserved (KVM's
    /// `kvm_lapic_msr_write`).
    pub fn write(&mut self, msr: u32, value: u64, now_ns: u64) -> Result<Action, ApicFault> {
        self.check_msr_mode(msr)?;
        let x2apic_register = (X2APIC_FIRST..=X2APIC_LAST).contains(&msr);
        if x2apic_register && msr != ICR && value >> 32 != 0 {
            return Err(ApicFault::Reserved { msr, value });
        }
        self.write_register(msr, value, now_ns)
    }

    /// IA32_APIC_BASE: the base stays 0xFEE00000 (relocation is ignored);
    /// xAPIC may switch to x2APIC; any other change of EN or EXTD #GPs.
    fn write_apic_base(&mut self, value: u64) -> Result<Action, ApicFault> {
        // Bits 7:0 and 9, and those past MAXPHYADDR (KVM's check).
        let reserved = 0x2FF | !0 << self.phys_bits;
        if value & reserved != 0 {
            return Err(ApicFault::Reserved {
                msr: MSR_APIC_BASE,
                value,
            });
        }
        match (value & APIC_BASE_EN != 0, value & APIC_BASE_EXTD != 0) {
            (true, extd) if extd == self.x2apic => Ok(Action::None),
            (true, true) => {
                self.x2apic = true;
                Ok(Action::None)
            }
            _ => Err(ApicFault::Reserved {
                msr: MSR_APIC_BASE,
                value,
            }),
        }
    }

    fn write_register(&mut self, msr: u32, value: u64, now_ns: u64) -> Result<Action, ApicFault> {
        let low = value as u32;
        match msr {
            MSR_APIC_BASE => return self.write_apic_base(value),
            TPR => self.tpr = low as u8,
            SVR => return Ok(self.write_svr(low, now_ns)),
            ESR if self.x2apic && value != 0 => return Err(ApicFault::Reserved { msr, value }),
            ESR => self.esr = std::mem::take(&mut self.esr_pending),
            EOI if value != 0 => return Err(ApicFault::Reserved { msr, value }),
            EOI => return Ok(self.eoi()),
            ICR => return self.write_icr(value),
            SELF_IPI if value > 0xFF => return Err(ApicFault::Reserved { msr, value }),
            SELF_IPI => return Ok(self.ipi(low as u8, Destination::SelfOnly)),
            0x833..=LVT_LAST => {
                let i = (msr - 0x833) as usize;
                self.lvt[i] = (low | self.lvt_forced_mask()) & LVT_WRITABLE[i];
            }
            LVT_FIRST => {
                let value = u64::from(low | self.lvt_forced_mask());
                self.timer
                    .write_msr(msr, value, now_ns)
                    .map_err(|_| ApicFault::Reserved { msr, value })?;
                return Ok(Action::TimerChanged);
            }
            MSR_TSC_DEADLINE | 0x838 | 0x83E => {
                self.timer
                    .write_msr(msr, value, now_ns)
                    .map_err(|_| ApicFault::Reserved { msr, value })?;
                return Ok(Action::TimerChanged);
            }
            ID | VERSION | PPR | LDR | 0x839 | ISR..=0x827 => return Err(ApicFault::ReadOnly(msr)),
            other => return Err(ApicFault::NoSuchRegister(other)),
        }
        Ok(Action::None)
    }

    /// The mask bit an LVT write gets whatever it says: set while the APIC
    /// is software-disabled (KVM's rule).
    fn lvt_forced_mask(&self) -> u32 {
        if self.enabled() { 0 } else { LVT_MASKED }
    }

    /// SVR: a software disable masks every LVT entry, the timer's too.
    fn write_svr(&mut self, value: u32, now_ns: u64) -> Action {
        self.svr = value & SVR_WRITABLE;
        if self.enabled() {
            return Action::None;
        }
        self.lvt.iter_mut().for_each(|lvt| *lvt |= LVT_MASKED);
        let timer = u64::from(self.timer.read(TimerRegister::LvtTimer, now_ns) | LVT_MASKED);
        // Only the mask bit changes: the timer keeps its mode and count.
        let _ = self.timer.write_msr(LVT_FIRST, timer, now_ns);
        Action::TimerChanged
    }

    /// Reads the xAPIC register at `offset` in the MMIO page (a 32-bit
    /// access). A register that does not exist reads 0 and sets the ESR's
    /// illegal-register bit, as hardware does; in x2APIC mode the page is
    /// not decoded ([`ApicFault::WrongMode`]).
    pub fn mmio_read(
        &mut self,
        offset: u64,
        irr: &[u64; 4],
        now_ns: u64,
    ) -> Result<u32, ApicFault> {
        let msr = self.xapic_register(offset)?;
        if offset % 16 != 0 {
            return Ok(self.illegal_register());
        }
        let value = match offset {
            XAPIC_ID => self.id << 24,
            XAPIC_LDR => 0,
            XAPIC_DFR => DFR_FLAT,
            XAPIC_ICR_LOW => self.icr as u32,
            XAPIC_ICR_HIGH => self.icr_high,
            _ => match self.read_register(msr, irr, now_ns) {
                Ok(value) => value as u32,
                Err(_) => self.illegal_register(),
            },
        };
        Ok(value)
    }

    /// Writes the xAPIC register at `offset` in the MMIO page. A write to
    /// a register that is read-only or does not exist is dropped and sets the
    /// ESR's illegal-register bit; the ICR's low half sends, to the
    /// destination in the high half's bits 31:24.
    pub fn mmio_write(
        &mut self,
        offset: u64,
        value: u32,
        now_ns: u64,
    ) -> Result<Action, ApicFault> {
        let msr = self.xapic_register(offset)?;
        if offset % 16 != 0 {
            self.illegal_register();
            return Ok(Action::None);
        }
        let action = match offset {
            XAPIC_LDR | XAPIC_DFR => Ok(Action::None), // flat model, no logical IDs
            XAPIC_ICR_HIGH => {
                self.icr_high = value & 0xFF00_0000; // the destination alone
                Ok(Action::None)
            }
            XAPIC_ICR_LOW => {
                let sent = self.write_icr(u64::from(self.icr_high >> 24) << 32 | u64::from(value));
                // The register keeps the low half: the destination is the
                // high half's (what x2APIC mode reads later, as KVM's).
                self.icr &= 0xFFFF_FFFF;
                sent
            }
            _ if msr == EOI => Ok(self.eoi()), // xAPIC ignores the value written
            _ if msr == SELF_IPI => Err(ApicFault::NoSuchRegister(msr)),
            _ => self.write_register(msr, u64::from(value), now_ns),
        };
        Ok(action.unwrap_or_else(|_| {
            self.illegal_register();
            Action::None
        }))
    }

    /// An MMIO read of `data.len()` bytes (1 to 8) at `offset` in the xAPIC
    /// page, with KVM's rules: a read within one register's 32 bits returns
    /// those bytes of it; one that spans past them reads 0 and is noted as an
    /// illegal-register access; in x2APIC mode the page is not decoded and
    /// reads all ones (KVM's `KVM_X86_QUIRK_LAPIC_MMIO_HOLE`).
    pub fn mmio_read_bytes(&mut self, offset: u64, data: &mut [u8], irr: &[u64; 4], now_ns: u64) {
        let within = (offset & 0xF) as usize;
        let value = match self.mmio_read(offset & !0xF, irr, now_ns) {
            Err(_) => return data.fill(0xFF),
            Ok(_) if within + data.len() > 4 => self.illegal_register(),
            Ok(value) => value,
        };
        let bytes = value.to_le_bytes();
        data.fill(0);
        for (d, b) in data.iter_mut().zip(bytes.iter().skip(within)) {
            *d = *b;
        }
    }

    /// An MMIO write of `data` at `offset` in the xAPIC page. Registers are
    /// written with aligned 32-bit stores only (SDM 11.4.1): any other write
    /// is dropped, as KVM drops it, and noted as an illegal-register access;
    /// in x2APIC mode the page is not decoded and the write is ignored.
    pub fn mmio_write_bytes(&mut self, offset: u64, data: &[u8], now_ns: u64) -> Action {
        if self.x2apic {
            return Action::None;
        }
        match <[u8; 4]>::try_from(data) {
            Ok(word) if offset % 16 == 0 => self
                .mmio_write(offset, u32::from_le_bytes(word), now_ns)
                .unwrap_or(Action::None),
            _ => {
                self.illegal_register();
                Action::None
            }
        }
    }

    /// The x2APIC MSR with the layout of the xAPIC register at `offset`.
    fn xapic_register(&self, offset: u64) -> Result<u32, ApicFault> {
        let msr = X2APIC_FIRST + (offset / 16) as u32;
        if self.x2apic {
            return Err(ApicFault::WrongMode(msr));
        }
        Ok(msr)
    }

    /// Notes an access to a register that does not exist; reads as 0.
    fn illegal_register(&mut self) -> u32 {
        self.esr_pending |= ESR_ILLEGAL_REGISTER;
        0
    }

    fn eoi(&mut self) -> Action {
        if let Some(v) = highest(&self.isr) {
            self.isr[usize::from(v / 64)] &= !(1 << (v % 64));
        }
        Action::Eoi
    }

    /// ICR: fixed delivery mode only (others are ignored, as a VMM without
    /// INIT/SIPI support does), with the destination shorthand or a
    /// physical destination in bits 63:32.
    /// The ICR, as KVM takes it: in x2APIC mode reserved bits are a #GP;
    /// in xAPIC mode they are kept. The busy bit is dropped in either.
    fn write_icr(&mut self, value: u64) -> Result<Action, ApicFault> {
        const DELIVERY_MODE: u64 = 0x700;
        const BUSY: u64 = 1 << 12;
        const X2APIC_RESERVED: u64 = 0xFFF3_2000; // bits 13, 16, 17, 20-31
        if self.x2apic && value & X2APIC_RESERVED != 0 {
            return Err(ApicFault::Reserved { msr: ICR, value });
        }
        let value = value & !BUSY;
        self.icr = value;
        if value & DELIVERY_MODE != 0 {
            return Ok(Action::None);
        }
        let to = match (value >> 18) & 3 {
            0 => Destination::Physical((value >> 32) as u32),
            1 => Destination::SelfOnly,
            2 => Destination::All,
            _ => Destination::AllExcludingSelf,
        };
        Ok(self.ipi(value as u8, to))
    }

    fn ipi(&mut self, vector: u8, to: Destination) -> Action {
        // A software-disabled APIC accepts none, its own included (the
        // VMM skips other vCPUs that are disabled).
        let to = match to {
            Destination::All if !self.enabled() => Destination::AllExcludingSelf,
            to => to,
        };
        let to_itself = to == Destination::SelfOnly || to == Destination::Physical(self.id);
        if to_itself && !self.enabled() {
            return Action::None;
        }
        if vector < 16 {
            self.esr_pending |= if to == Destination::SelfOnly {
                ESR_RECEIVE_ILLEGAL_VECTOR
            } else {
                ESR_SEND_ILLEGAL_VECTOR
            };
            return Action::None;
        }
        Action::Ipi { vector, to }
    }
}

/// The highest set bit of a 256-bit vector set.
pub fn highest(bits: &[u64; 4]) -> Option<u8> {
    (0..4)
        .rev()
        .find(|&w| bits[w] != 0)
        .map(|w| (w * 64 + 63 - bits[w].leading_zeros() as usize) as u8)
}

/// 32 bits of a 256-bit set, as the x2APIC ISR/TMR/IRR registers show them.
fn word32(bits: &[u64; 4], index: u32) -> u64 {
    let (word, shift) = ((index / 2) as usize, (index % 2) * 32);
    (bits[word] >> shift) & 0xFFFF_FFFF
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guest TSC of 1 GHz from host time 0.
    const TIME: GuestTime = GuestTime {
        tsc_khz: 1_000_000,
        ns: 0,
        tsc_at_ns: 0,
    };

    /// vCPU 3's APIC at reset: xAPIC mode, software-disabled.
    fn xapic() -> LocalApic {
        LocalApic::new(3, TIME)
    }

    /// vCPU 3's APIC switched to x2APIC mode and software-enabled.
    fn apic() -> LocalApic {
        let mut a = xapic();
        let x2apic = XAPIC_BASE | APIC_BASE_EN | APIC_BASE_EXTD;
        assert_eq!(a.write(MSR_APIC_BASE, x2apic, 0), Ok(Action::None));
        a.write(SVR, 0x1FF, 0).unwrap();
        a
    }

    fn irr(vectors: &[u8]) -> [u64; 4] {
        let mut bits = [0; 4];
        for &v in vectors {
            bits[usize::from(v / 64)] |= 1 << (v % 64);
        }
        bits
    }

    #[test]
    fn the_highest_pending_vector_above_the_priority_is_delivered() {
        let mut a = apic();
        assert_eq!(a.deliverable(&irr(&[0x31, 0x52, 0x40])), Some(0x52));
        a.write(TPR, 0x50, 0).unwrap();
        assert_eq!(a.deliverable(&irr(&[0x52])), None, "same class as TPR");
        assert_eq!(a.deliverable(&irr(&[0x61])), Some(0x61));
        a.write(TPR, 0, 0).unwrap();
        a.start_service(0x61);
        assert_eq!(a.ppr(), 0x60);
        assert_eq!(
            a.deliverable(&irr(&[0x65])),
            None,
            "in-service class blocks"
        );
        assert_eq!(
            a.deliverable(&irr(&[0x70])),
            Some(0x70),
            "a higher class nests"
        );
        assert_eq!(a.write(EOI, 0, 0), Ok(Action::Eoi));
        assert_eq!(a.deliverable(&irr(&[0x65])), Some(0x65));
        assert_eq!(
            a.read(ISR + 1, &[0; 4], 0),
            Ok(0),
            "EOI cleared vector 0x61"
        );
    }

    #[test]
    fn a_disabled_apic_delivers_nothing() {
        let mut a = apic();
        a.write(SVR, 0xFF, 0).unwrap();
        assert!(!a.enabled());
        assert_eq!(a.deliverable(&irr(&[0x80])), None);
    }

    #[test]
    fn icr_sends_fixed_ipis_by_destination_and_shorthand() {
        let mut a = apic();
        let to = |a: &mut LocalApic, v| match a.write(ICR, v, 0).unwrap() {
            Action::Ipi { vector, to } => Some((vector, to)),
            _ => None,
        };
        assert_eq!(
            to(&mut a, 7 << 32 | 0x40),
            Some((0x40, Destination::Physical(7)))
        );
        assert_eq!(
            to(&mut a, 1 << 18 | 0x41),
            Some((0x41, Destination::SelfOnly))
        );
        assert_eq!(to(&mut a, 2 << 18 | 0x42), Some((0x42, Destination::All)));
        assert_eq!(
            to(&mut a, 3 << 18 | 0x43),
            Some((0x43, Destination::AllExcludingSelf))
        );
        assert_eq!(to(&mut a, 0x500 | 0x44), None, "INIT is not emulated");
        assert_eq!(a.read(ICR, &[0; 4], 0), Ok(0x500 | 0x44));
        assert_eq!(
            a.write(SELF_IPI, 0x45, 0),
            Ok(Action::Ipi {
                vector: 0x45,
                to: Destination::SelfOnly
            })
        );
    }

    #[test]
    fn a_broadcast_id_is_judged_in_the_receivers_mode() {
        let (xapic, x2apic) = (false, true);
        let broadcast8 = Destination::Physical(0xFF);
        let broadcast32 = Destination::Physical(u32::MAX);
        assert!(broadcast8.reaches(0, 3, xapic) && !broadcast8.reaches(0, 3, x2apic));
        assert!(broadcast32.reaches(0, 3, x2apic) && !broadcast32.reaches(0, 3, xapic));
        assert!(Destination::Physical(3).reaches(0, 3, xapic));
        assert!(!Destination::Physical(3).reaches(3, 2, x2apic));
        assert!(Destination::SelfOnly.reaches(2, 2, xapic));
        assert!(!Destination::AllExcludingSelf.reaches(2, 2, xapic));
        assert!(Destination::All.reaches(2, 2, x2apic));
    }

    /// `vcpus` vCPUs with their APICs software-enabled, all in x2APIC mode
    /// or all in xAPIC mode, and the VM's delivery ([`crate::irq`]) told so,
    /// as each vCPU's thread tells it after a register write.
    fn vm(vcpus: u32, x2apic: bool) -> (Vec<LocalApic>, crate::irq::Interrupts) {
        let policy = Box::new(vcpu_sched::NoBoost);
        let irqs = crate::irq::Interrupts::new(vcpus as usize, policy, Default::default());
        let apics = (0..vcpus)
            .map(|id| {
                let mut a = LocalApic::new(id, TIME);
                if x2apic {
                    let base = XAPIC_BASE | APIC_BASE_EN | APIC_BASE_EXTD;
                    assert_eq!(a.write(MSR_APIC_BASE, base, 0), Ok(Action::None));
                    a.write(SVR, 0x1FF, 0).unwrap();
                } else {
                    a.mmio_write(0xF0, 0x1FF, 0).unwrap();
                }
                irqs.set_apic_state(id as usize, a.enabled(), a.x2apic());
                a
            })
            .collect();
        (apics, irqs)
    }

    /// The vCPUs that the IPI `action` from vCPU `from` makes pending, as
    /// the VMM delivers it (`Interrupts::ipi`); their IRRs are cleared.
    fn receivers(
        irqs: &crate::irq::Interrupts,
        vcpus: usize,
        from: usize,
        action: Action,
    ) -> Vec<usize> {
        let Action::Ipi { vector, to } = action else {
            panic!("{action:?} sends no IPI");
        };
        irqs.ipi(from, vector, to);
        let got = |v: usize| irqs.pending(v)[usize::from(vector / 64)] & 1 << (vector % 64) != 0;
        let reached: Vec<usize> = (0..vcpus).filter(|&v| got(v)).collect();
        for &v in &reached {
            irqs.take(v, vector);
        }
        reached
    }

    /// An x2APIC physical destination is the ICR's whole bits 63:32: an ID
    /// of 256 or more names no vCPU of a small VM (it must not wrap to
    /// `id % 256`), and all ones alone is the broadcast (SDM 10.12.9).
    #[test]
    fn an_x2apic_physical_destination_is_32_bits_and_only_all_ones_broadcasts() {
        const VCPUS: u32 = 4;
        let (mut apics, irqs) = vm(VCPUS, true);
        let mut send = |dest: u32| {
            let action = apics[0].write(ICR, u64::from(dest) << 32 | 0x40, 0);
            receivers(&irqs, VCPUS as usize, 0, action.unwrap())
        };
        for n in 0..VCPUS {
            assert_eq!(send(n), [n as usize], "x2APIC ID {n} is vCPU {n}");
        }
        let none: [usize; 0] = [];
        let beyond_8_bits = (0..VCPUS).flat_map(|n| [0x100 + n, 0x1_0000 + n, 0xFFFF_FF00 + n]);
        for dest in beyond_8_bits.chain([0x1FF, 0xFFFF_FFFE, 0xFF, 0xFE]) {
            assert_eq!(
                send(dest),
                none,
                "x2APIC ID {dest:#x} names no vCPU of {VCPUS} (none has ID {:#x})",
                dest & 0xFF
            );
        }
        assert_eq!(send(u32::MAX), [0, 1, 2, 3], "0xFFFFFFFF: the broadcast");
        let dropped = irqs.stats.dropped.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(dropped, 16, "each IPI that named no vCPU counts as dropped");
    }

    /// In xAPIC mode the destination is 8 bits (ICR bits 63:56) and 0xFF is
    /// the broadcast: what the x2APIC test above rules out for x2APIC IDs
    /// holds here.
    #[test]
    fn an_xapic_physical_destination_is_8_bits_and_0xff_broadcasts() {
        const VCPUS: u32 = 4;
        let (mut apics, irqs) = vm(VCPUS, false);
        let mut send = |high: u32| {
            assert_eq!(
                apics[0].mmio_write(XAPIC_ICR_HIGH, high, 0),
                Ok(Action::None)
            );
            let action = apics[0].mmio_write(XAPIC_ICR_LOW, 0x40, 0);
            receivers(&irqs, VCPUS as usize, 0, action.unwrap())
        };
        for n in 0..VCPUS {
            assert_eq!(send(n << 24), [n as usize], "xAPIC ID {n} is vCPU {n}");
        }
        assert_eq!(send(0xFF << 24), [0, 1, 2, 3], "0xFF: xAPIC's broadcast");
        assert_eq!(send(0xFE << 24), [0usize; 0], "no vCPU has ID 0xFE");
        assert_eq!(
            send(1 << 24 | 0xFF_FFFF),
            [1],
            "bits 55:32 are no part of it"
        );
    }

    #[test]
    fn icr_reserved_bits_fault_in_x2apic_mode_and_are_kept_in_xapic_mode() {
        let busy = 1 << 12;
        let mut a = apic();
        for reserved in [1 << 13, 1 << 16, 1 << 17, 1 << 20, 1 << 31] {
            assert!(a.write(ICR, reserved | 0x40, 0).is_err(), "{reserved:#x}");
        }
        assert!(matches!(
            a.write(ICR, busy | 0x40, 0),
            Ok(Action::Ipi { .. })
        ));
        assert_eq!(a.read(ICR, &[0; 4], 0), Ok(0x40), "the busy bit dropped");
        let mut x = xapic();
        x.write(SVR, 0x1FF, 0).unwrap_err(); // an MSR in xAPIC mode
        x.mmio_write(0xF0, 0x1FF, 0).unwrap();
        let low = 0x2100_0000 | 1 << 18 | busy as u32 | 0x5F;
        assert_eq!(
            x.mmio_write(XAPIC_ICR_LOW, low, 0),
            Ok(Action::Ipi {
                vector: 0x5F,
                to: Destination::SelfOnly
            }),
            "sent, as KVM sends it"
        );
        assert_eq!(
            x.mmio_read(XAPIC_ICR_LOW, &[0; 4], 0),
            Ok(low & !(busy as u32))
        );
    }

    #[test]
    fn absurd_values_get_the_architectural_answer() {
        let mut a = apic();
        assert_eq!(
            a.write(ICR, 1 << 32 | 0x05, 0),
            Ok(Action::None),
            "illegal vector: not sent"
        );
        a.write(ESR, 0, 0).unwrap();
        assert_eq!(
            a.read(ESR, &[0; 4], 0),
            Ok(u64::from(ESR_SEND_ILLEGAL_VECTOR))
        );
        assert_eq!(
            a.write(ICR, 1 << 13 | 0x40, 0),
            Err(ApicFault::Reserved {
                msr: ICR,
                value: 1 << 13 | 0x40
            })
        );
        assert_eq!(
            a.write(EOI, 1, 0),
            Err(ApicFault::Reserved { msr: EOI, value: 1 })
        );
        assert_eq!(a.write(ID, 9, 0), Err(ApicFault::ReadOnly(ID)));
        assert_eq!(a.read(EOI, &[0; 4], 0), Err(ApicFault::WriteOnly(EOI)));
        assert_eq!(
            a.read(0x8FF, &[0; 4], 0),
            Err(ApicFault::NoSuchRegister(0x8FF))
        );
        assert_eq!(a.write(MSR_TSC_DEADLINE, 1, 10), Ok(Action::TimerChanged));
        assert!(
            a.timer().expire(10).is_none(),
            "the LVT timer is masked at reset"
        );
        let wide = 1 << 32 | 0x30;
        assert_eq!(
            a.write(LVT_FIRST, wide, 0),
            Err(ApicFault::Reserved {
                msr: LVT_FIRST,
                value: wide
            }),
            "timer registers are 32 bits"
        );
    }

    #[test]
    fn registers_read_back() {
        let a = apic();
        assert_eq!(a.read(ID, &[0; 4], 0), Ok(3));
        assert_eq!(a.read(VERSION, &[0; 4], 0), Ok(VERSION_VALUE));
        assert_eq!(a.read(IRR + 2, &irr(&[64]), 0), Ok(1));
        assert_eq!(a.read(LDR, &[0; 4], 0), Ok(1 << 3));
        assert_eq!(
            a.read(MSR_APIC_BASE, &[0; 4], 0),
            Ok(0xFEE0_0000 | APIC_BASE_EN | APIC_BASE_EXTD)
        );
        assert_eq!(highest(&irr(&[0, 255])), Some(255));
        assert_eq!(highest(&[0; 4]), None);
    }

    #[test]
    fn apic_base_bits_past_maxphyaddr_are_reserved() {
        let en = XAPIC_BASE | APIC_BASE_EN;
        let mut a = xapic().with_phys_bits(48);
        assert!(a.write(MSR_APIC_BASE, en | 1 << 48, 0).is_err());
        assert!(a.write(MSR_APIC_BASE, en | 1 << 60, 0).is_err());
        assert_eq!(a.write(MSR_APIC_BASE, en | 1 << 47, 0), Ok(Action::None));
        let mut wide = xapic().with_phys_bits(64);
        assert!(
            wide.write(MSR_APIC_BASE, en | 1 << 52, 0).is_err(),
            "never past the architecture's 52"
        );
        assert_eq!(wide.write(MSR_APIC_BASE, en | 1 << 51, 0), Ok(Action::None));
    }

    #[test]
    fn xapic_mode_until_extd_and_only_that_switch() {
        let mut a = xapic();
        assert!(!a.x2apic());
        assert_eq!(
            a.read(MSR_APIC_BASE, &[0; 4], 0),
            Ok(0xFEE0_0000 | APIC_BASE_EN)
        );
        assert_eq!(
            a.read(ID, &[0; 4], 0),
            Err(ApicFault::WrongMode(ID)),
            "x2APIC MSRs #GP"
        );
        assert!(a.write(SVR, 0x1FF, 0).is_err());
        let en = XAPIC_BASE | APIC_BASE_EN;
        assert_eq!(a.write(MSR_APIC_BASE, en, 0), Ok(Action::None), "no change");
        assert!(
            a.write(MSR_APIC_BASE, XAPIC_BASE, 0).is_err(),
            "disabling is not supported"
        );
        assert!(
            a.write(MSR_APIC_BASE, XAPIC_BASE | APIC_BASE_EXTD, 0)
                .is_err(),
            "EXTD without EN"
        );
        assert_eq!(
            a.write(MSR_APIC_BASE, en | APIC_BASE_EXTD, 0),
            Ok(Action::None)
        );
        assert!(a.x2apic());
        assert!(
            a.write(MSR_APIC_BASE, en, 0).is_err(),
            "no way back to xAPIC"
        );
        assert_eq!(
            a.mmio_read(XAPIC_ID, &[0; 4], 0),
            Err(ApicFault::WrongMode(ID))
        );
    }

    #[test]
    fn byte_and_quadword_accesses_to_the_xapic_page_get_kvms_answer() {
        let mut a = xapic();
        let none = [0; 4];
        let read = |a: &mut LocalApic, offset, len| {
            let mut data = vec![0x55; len];
            a.mmio_read_bytes(offset, &mut data, &none, 0);
            data
        };
        assert_eq!(read(&mut a, XAPIC_ID + 3, 1), [3], "the ID's top byte");
        assert_eq!(read(&mut a, 0x30, 2), [0x14, 0], "the version's low half");
        assert_eq!(read(&mut a, 0x32, 2), [5, 0], "the version's high half");
        assert_eq!(read(&mut a, 0x30, 4), (VERSION_VALUE as u32).to_le_bytes());
        assert_eq!(a.mmio_read(0x280, &none, 0), Ok(0), "no error yet");
        assert_eq!(read(&mut a, 0x30, 8), [0; 8], "spans past the register");
        assert_eq!(read(&mut a, 0x33, 2), [0; 2], "spans past the register");
        a.mmio_write(0x280, 0, 0).unwrap();
        assert_eq!(a.mmio_read(0x280, &none, 0), Ok(ESR_ILLEGAL_REGISTER));
        assert_eq!(a.mmio_write_bytes(0x80, &[0x80], 0), Action::None);
        assert_eq!(
            a.mmio_write_bytes(0x80, &[0x80, 0, 0, 0, 0, 0, 0, 0], 0),
            Action::None
        );
        assert_eq!(a.mmio_write_bytes(0x84, &[0x80, 0, 0, 0], 0), Action::None);
        assert_eq!(
            read(&mut a, 0x80, 4),
            [0; 4],
            "TPR: only aligned dwords write"
        );
        assert_eq!(a.mmio_write_bytes(0x80, &[0x40, 0, 0, 0], 0), Action::None);
        assert_eq!(read(&mut a, 0x80, 1), [0x40]);
        assert_eq!(a.mmio_write_bytes(0xB0, &[0; 4], 0), Action::Eoi);
        a.write_apic_base(XAPIC_BASE | APIC_BASE_EN | APIC_BASE_EXTD)
            .unwrap();
        assert_eq!(read(&mut a, 0x80, 2), [0xFF; 2], "x2APIC mode: a hole");
        assert_eq!(a.mmio_write_bytes(0x80, &[0; 4], 0), Action::None);
        assert_eq!(a.read(TPR, &none, 0), Ok(0x40), "the write was ignored");
    }

    #[test]
    fn the_xapic_page_has_the_same_registers_in_its_own_layout() {
        let mut a = xapic();
        let none = [0; 4];
        assert_eq!(a.mmio_read(XAPIC_ID, &none, 0), Ok(3 << 24));
        assert_eq!(a.mmio_read(0x30, &none, 0), Ok(VERSION_VALUE as u32));
        assert_eq!(a.mmio_read(XAPIC_DFR, &none, 0), Ok(DFR_FLAT));
        assert_eq!(a.mmio_write(0xF0, 0x1FF, 0), Ok(Action::None), "SVR");
        assert!(a.enabled());
        assert_eq!(a.mmio_write(0x80, 0x20, 0), Ok(Action::None), "TPR");
        assert_eq!(a.mmio_read(0xA0, &none, 0), Ok(0x20), "PPR follows");
        // The ICR: destination in the high half, sent by the low half.
        assert_eq!(a.mmio_write(XAPIC_ICR_HIGH, 1 << 24, 0), Ok(Action::None));
        assert_eq!(
            a.mmio_write(XAPIC_ICR_LOW, 0x41, 0),
            Ok(Action::Ipi {
                vector: 0x41,
                to: Destination::Physical(1)
            })
        );
        assert_eq!(a.mmio_read(XAPIC_ICR_LOW, &none, 0), Ok(0x41));
        assert_eq!(a.mmio_read(XAPIC_ICR_HIGH, &none, 0), Ok(1 << 24));
        assert_eq!(
            a.mmio_write(XAPIC_ICR_LOW, 0x4_0042, 0),
            Ok(Action::Ipi {
                vector: 0x42,
                to: Destination::SelfOnly
            })
        );
        // In service, then EOI (whatever is written), and the IRR as pages.
        a.start_service(0x42);
        assert_eq!(a.mmio_read(0x120, &none, 0), Ok(1 << 2), "ISR word 2");
        assert_eq!(a.mmio_write(0xB0, 7, 0), Ok(Action::Eoi));
        assert_eq!(a.mmio_read(0x120, &none, 0), Ok(0));
        assert_eq!(a.mmio_read(0x220, &irr(&[64]), 0), Ok(1), "IRR word 2");
        // The timer's registers are the same model's.
        assert_eq!(a.mmio_write(0x320, 0x4_0050, 0), Ok(Action::TimerChanged));
        assert_eq!(a.mmio_read(0x320, &none, 0), Ok(0x4_0050));
    }

    #[test]
    fn what_the_xapic_page_does_not_have_is_dropped_and_noted_in_the_esr() {
        let mut a = xapic();
        let none = [0; 4];
        assert_eq!(
            a.mmio_write(XAPIC_ID, 7 << 24, 0),
            Ok(Action::None),
            "read-only"
        );
        assert_eq!(a.mmio_read(XAPIC_ID, &none, 0), Ok(3 << 24));
        assert_eq!(a.mmio_read(0x3F0, &none, 0), Ok(0), "no self-IPI register");
        assert_eq!(a.mmio_write(0x3F0, 0x41, 0), Ok(Action::None));
        assert_eq!(a.mmio_read(0x24, &none, 0), Ok(0), "misaligned");
        assert_eq!(a.mmio_read(0xFF0, &none, 0), Ok(0), "beyond the registers");
        assert_eq!(a.mmio_read(0xB0, &none, 0), Ok(0), "EOI is write-only");
        assert_eq!(
            a.mmio_write(0x280, 0, 0),
            Ok(Action::None),
            "ESR write latches"
        );
        assert_eq!(a.mmio_read(0x280, &none, 0), Ok(ESR_ILLEGAL_REGISTER));
    }

    #[test]
    fn register_writes_keep_the_bits_kvm_keeps() {
        let mut a = apic();
        // SVR: vector, enable and focus; no directed EOI.
        a.write(SVR, 0x1FFF, 0).unwrap();
        assert_eq!(a.read(SVR, &[0; 4], 0), Ok(0x3FF));
        // LINT0 keeps its trigger bits, the error LVT only vector, mask and
        // bit 12.
        a.write(0x835, 0xFFFF_FFFF, 0).unwrap();
        assert_eq!(a.read(0x835, &[0; 4], 0), Ok(0x1F7FF));
        a.write(0x837, 0xFFFF_FFFF, 0).unwrap();
        assert_eq!(a.read(0x837, &[0; 4], 0), Ok(0x110FF));
        // Bits 63:32 are reserved but in the ICR.
        assert!(a.write(TPR, 1 << 32, 0).is_err());
        // The ESR takes only 0 in x2APIC mode, SELF IPI only a vector.
        assert!(a.write(ESR, 1, 0).is_err());
        assert!(a.write(SELF_IPI, 0x140, 0).is_err());
        // vCPU 0 is the bootstrap processor, and its LINT0 is ExtINT.
        let bsp = LocalApic::new(0, TIME);
        assert_eq!(
            bsp.read_register(MSR_APIC_BASE, &[0; 4], 0),
            Ok(0xFEE0_0900)
        );
        assert_eq!(bsp.lvt[2], LINT0_BSP_RESET);
    }

    #[test]
    fn a_software_disable_masks_every_lvt_and_refuses_its_own_ipis() {
        let mut a = apic();
        a.write(0x833, 0x40, 0).unwrap();
        a.write(LVT_FIRST, 0x41, 0).unwrap();
        a.write(SVR, 0xFF, 0).unwrap();
        assert_eq!(a.read(0x833, &[0; 4], 0), Ok(0x10040));
        assert_eq!(a.read(LVT_FIRST, &[0; 4], 0), Ok(0x10041));
        // While disabled, an LVT written unmasked stays masked.
        a.write(0x834, 0x42, 0).unwrap();
        assert_eq!(a.read(0x834, &[0; 4], 0), Ok(0x10042));
        assert_eq!(a.write(SELF_IPI, 0x50, 0), Ok(Action::None), "not sent");
        assert_eq!(
            a.write(ICR, 2 << 18 | 0x51, 0),
            Ok(Action::Ipi {
                vector: 0x51,
                to: Destination::AllExcludingSelf
            }),
            "the others' copies go, its own does not"
        );
        a.write(SVR, 0x1FF, 0).unwrap();
        assert!(matches!(
            a.write(SELF_IPI, 0x50, 0),
            Ok(Action::Ipi { vector: 0x50, .. })
        ));
    }
}
