//! The operations of `apic-script`, the conformance guest: a runner writes
//! a sequence of local-APIC operations for each vCPU into guest memory
//! ([`crate::layout::apic_script`]), the guest runs them at CPL0 with
//! interrupts off and leaves beside each what it read back and whether it
//! faulted, and the runner compares those records between two APICs (this
//! VMM's and KVM's) run on the same sequence.
//!
//! [`generate`] draws a sequence from a seed: the mode's set-up, then reads
//! and writes of every register (reserved ones, read-only ones, reserved
//! bits), half the writes read back at once, self-IPIs, IA32_APIC_BASE
//! writes (the switch to x2APIC, the refused transitions, never a disable)
//! and the timer running out, then the highest task priority, so that
//! nothing the sequence left pending is taken once interrupts are on
//! again. IPIs to the other vCPUs (by ID, to one that does not exist, by
//! broadcast, by shorthand) are sent only in exchanges between two
//! barriers that every vCPU of the VM passes, so what a vCPU reads depends
//! on the operations alone, never on when another vCPU ran. It never
//! delivers an NMI, SMI or INIT. The timer's current count runs in real
//! time: [`Record::differs`] compares it as zero or not.

use crate::layout::APIC_SCRIPT_SHIFT;
use crate::x86::apic::{MSR_APIC_BASE, MSR_TSC_DEADLINE, XAPIC_BASE};

/// Bytes per operation in guest memory: kind (the guest writes a status in
/// bits 63:32), register, value, what it read.
pub const OP_SIZE: usize = 32;
/// Most operations a vCPU's area holds.
pub const MAX_OPS: u64 = (1 << APIC_SCRIPT_SHIFT) / OP_SIZE as u64;
/// Status of an operation the guest ran.
pub const STATUS_DONE: u32 = 1;
/// Status of an operation whose `rdmsr` or `wrmsr` raised #GP.
pub const STATUS_FAULTED: u32 = 2;

/// IA32_APIC_BASE's global enable.
const APIC_BASE_ENABLE: u64 = 1 << 11;
/// IA32_APIC_BASE's x2APIC mode.
const APIC_BASE_EXTD: u64 = 1 << 10;
/// IA32_APIC_BASE's bootstrap-processor bit (vCPU 0's).
const APIC_BASE_BSP: u64 = 1 << 8;

/// What an operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    /// `rdmsr` of the register.
    ReadMsr = 1,
    /// `wrmsr` of the value.
    WriteMsr = 2,
    /// `rdmsr`, then `wrmsr` of what it read OR the value.
    OrMsr = 3,
    /// A 32-bit read at this offset of the xAPIC page.
    ReadPage = 4,
    /// A 32-bit write of the value at this offset of the xAPIC page.
    WritePage = 5,
    /// Spin for the value's TSC ticks.
    Delay = 6,
    /// Count itself in and wait until the value's count of vCPUs have
    /// (every vCPU's `n`-th barrier waits for `n` times the vCPUs).
    Barrier = 7,
    /// `wrmsr` of the TSC now plus the value (a TSC deadline that
    /// expires during the run).
    WriteMsrAfterTsc = 8,
}

/// One operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// What it does.
    pub kind: Kind,
    /// The MSR, or the offset in the xAPIC page.
    pub register: u32,
    /// What it writes (or ORs in, or the delay).
    pub value: u64,
}

impl Op {
    /// Its bytes in guest memory, before the guest runs it.
    pub fn to_bytes(self) -> [u8; OP_SIZE] {
        let mut bytes = [0; OP_SIZE];
        bytes[..8].copy_from_slice(&(self.kind as u64).to_le_bytes());
        bytes[8..16].copy_from_slice(&u64::from(self.register).to_le_bytes());
        bytes[16..24].copy_from_slice(&self.value.to_le_bytes());
        bytes
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (r, v) = (self.register, self.value);
        match self.kind {
            Kind::ReadMsr => write!(f, "rdmsr {r:#x}"),
            Kind::WriteMsr => write!(f, "wrmsr {r:#x} = {v:#x}"),
            Kind::OrMsr => write!(f, "wrmsr {r:#x} |= {v:#x}"),
            Kind::ReadPage => write!(f, "read page +{r:#05x}"),
            Kind::WritePage => write!(f, "write page +{r:#05x} = {v:#x}"),
            Kind::Delay => write!(f, "delay {v} TSC ticks"),
            Kind::Barrier => write!(f, "barrier: wait for {v} arrivals"),
            Kind::WriteMsrAfterTsc => write!(f, "wrmsr {r:#x} = TSC + {v}"),
        }
    }
}

/// What an operation did, as the guest recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It ran; a read (or an OR's read) got this.
    Done(u64),
    /// Its `rdmsr` or `wrmsr` raised #GP.
    Faulted,
    /// The guest did not run it (its run ended first), or left a status it
    /// has no meaning for.
    NotRun,
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Done(v) => write!(f, "{v:#x}"),
            Self::Faulted => f.write_str("#GP"),
            Self::NotRun => f.write_str("not run"),
        }
    }
}

/// An operation and what it did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// The operation.
    pub op: Op,
    /// What it did.
    pub outcome: Outcome,
}

impl Record {
    /// Reads `ops`' records from the bytes of a vCPU's area after the run.
    pub fn read_all(ops: &[Op], area: &[u8]) -> Vec<Record> {
        let word = |bytes: &[u8], at: usize| {
            bytes
                .get(at..at + 8)
                .map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap_or_default()))
        };
        ops.iter()
            .enumerate()
            .map(|(i, &op)| {
                let at = i * OP_SIZE;
                let outcome = match (word(area, at) >> 32) as u32 {
                    STATUS_DONE => Outcome::Done(word(area, at + 24)),
                    STATUS_FAULTED => Outcome::Faulted,
                    _ => Outcome::NotRun,
                };
                Record { op, outcome }
            })
            .collect()
    }

    /// Whether `other`, the same operation on another APIC, did otherwise:
    /// exactly, but for the timer's current count, which only has to be
    /// zero on both or on neither (it runs down in real time).
    pub fn differs(&self, other: &Record) -> bool {
        match (self.outcome, other.outcome) {
            (Outcome::Done(a), Outcome::Done(b)) if reads_current_count(self.op) => {
                (a == 0) != (b == 0)
            }
            (a, b) => self.op != other.op || a != b,
        }
    }
}

/// Whether `op` reads the timer's current count (x2APIC MSR 0x839, xAPIC
/// offset 0x390).
fn reads_current_count(op: Op) -> bool {
    matches!(
        (op.kind, op.register),
        (Kind::ReadMsr, 0x839) | (Kind::ReadPage, 0x390)
    )
}

/// How a sequence reaches the local APIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// x2APIC MSRs.
    X2apic,
    /// The xAPIC page.
    Xapic,
}

/// A small, fast generator (xorshift64*): sequences must be the same for a
/// seed everywhere, so no external crate's stream that may change.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number in `0..n`.
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len() as u64) as usize]
    }

    /// True one time in `n`.
    fn one_in(&mut self, n: u64) -> bool {
        self.below(n) == 0
    }

    /// `value`, one time in four with one more random bit of the low 32
    /// set (often a reserved one).
    fn with_reserved(&mut self, value: u64) -> u64 {
        match self.one_in(4) {
            true => value | 1 << self.below(32),
            false => value,
        }
    }
}

/// The local-APIC registers by xAPIC offset (the x2APIC MSR is 0x800 +
/// offset / 16), with which ones a sequence writes.
const LVT_CMCI: u32 = 0x2F0;
const LVT_TIMER: u32 = 0x320;
const LVTS: [u32; 7] = [LVT_CMCI, LVT_TIMER, 0x330, 0x340, 0x350, 0x360, 0x370];
const ID: u32 = 0x020;
const TPR: u32 = 0x080;
const EOI: u32 = 0x0B0;
const LDR: u32 = 0x0D0;
const DFR: u32 = 0x0E0;
const SVR: u32 = 0x0F0;
const ESR: u32 = 0x280;
const ICR: u32 = 0x300;
const ICR_HIGH: u32 = 0x310;
const TIMER_INITIAL: u32 = 0x380;
const TIMER_CURRENT: u32 = 0x390;
const IRR: u32 = 0x200;
/// Most operations in a timer expiry ([`Access::expire_tsc_deadline`]).
const EXPIRY_OPS: usize = 9;
/// Exchanges of IPIs between the vCPUs in a sequence.
const EXCHANGES: usize = 3;
/// Most operations an exchange takes: two barriers and three IPIs of two
/// operations each (xAPIC: the destination, then the send).
const EXCHANGE_OPS: usize = 8;
const TIMER_DIVIDE: u32 = 0x3E0;
const SELF_IPI: u32 = 0x3F0;

/// The x2APIC MSR of xAPIC offset `offset`.
const fn msr(offset: u32) -> u32 {
    0x800 + offset / 16
}

/// `len` random operations for vCPU `vcpu` of `vcpus` (whose APIC IDs are
/// their indices) in `mode`, after the mode's set-up and before the task
/// priority that holds back whatever is pending, with three
/// exchanges of IPIs among the vCPUs spread between them: the same seed,
/// place and count give the same sequence everywhere. `len` is capped so
/// that the whole sequence fits a vCPU's area ([`MAX_OPS`]). Every vCPU of
/// a VM must run a sequence made for the same `vcpus`: the barriers wait
/// for all of them.
pub fn generate(seed: u64, mode: Mode, vcpu: u32, vcpus: u32, len: usize) -> Vec<Op> {
    let mut rng = Rng::new(seed);
    let access = Access { mode, vcpu, vcpus };
    let mut ops = access.set_up();
    let len = len.min(MAX_OPS as usize - ops.len() - 2 - EXCHANGES * EXCHANGE_OPS);
    let segments = EXCHANGES + 1;
    for segment in 0..segments {
        if segment > 0 {
            ops.extend(access.exchange(&mut rng, segment as u64));
        }
        let mine = len / segments
            + if segment == EXCHANGES {
                len % segments
            } else {
                0
            };
        access.random_ops(&mut rng, &mut ops, mine);
    }
    // The highest task priority: nothing left pending is taken once
    // interrupts are on again (a software disable would not hold them).
    // Through both the MSR and the page, since the sequence may have
    // switched to x2APIC mode.
    ops.push(access.write(TPR, 0xFF));
    if mode == Mode::Xapic {
        ops.push(
            Access {
                mode: Mode::X2apic,
                ..access
            }
            .write(TPR, 0xFF),
        );
    }
    ops
}

/// How a sequence's operations reach the registers, and from where.
#[derive(Clone, Copy)]
struct Access {
    mode: Mode,
    vcpu: u32,
    vcpus: u32,
}

impl Access {
    /// `len` random operations onto `ops`: half the writes read back at
    /// once, one time in 25 a timer expiry.
    fn random_ops(&self, rng: &mut Rng, ops: &mut Vec<Op>, len: usize) {
        let end = ops.len() + len;
        while ops.len() < end {
            if rng.one_in(25) && ops.len() + EXPIRY_OPS <= end {
                match rng.one_in(3) {
                    true => ops.extend(self.expire_tsc_deadline(rng)),
                    false => ops.extend(self.expire_timer(rng)),
                }
                continue;
            }
            let op = self.random(rng);
            ops.push(op);
            // Half the writes are read back at once: what a write kept.
            if ops.len() < end && rng.one_in(2) {
                ops.extend(self.read_back(op));
            }
        }
    }

    /// The `n`-th exchange: a barrier, up to three IPIs to any vCPU
    /// (fixed, physical, edge-triggered, any vector), another barrier. No
    /// vCPU reads its IRR while another may still send to it.
    fn exchange(&self, rng: &mut Rng, n: u64) -> Vec<Op> {
        let barrier = |k: u64| Op {
            kind: Kind::Barrier,
            register: 0,
            value: k * u64::from(self.vcpus),
        };
        let mut ops = vec![barrier(2 * n - 1)];
        for _ in 0..rng.below(4) {
            ops.extend(self.ipi_to_any(rng));
        }
        ops.push(barrier(2 * n));
        ops
    }

    /// A fixed IPI of any vector: to every vCPU, to every other, by
    /// broadcast ID, to an ID no vCPU has, or to one vCPU (maybe itself).
    fn ipi_to_any(&self, rng: &mut Rng) -> Vec<Op> {
        let vector = rng.below(0x100);
        let broadcast = match self.mode {
            Mode::X2apic => 0xFFFF_FFFF,
            Mode::Xapic => 0xFF,
        };
        let vcpus = u64::from(self.vcpus);
        let (shorthand, to) = match rng.below(5) {
            0 => (2 << 18, 0),
            1 => (3 << 18, 0),
            2 => (0, broadcast),
            3 => (0, vcpus + rng.below(4)),
            _ => (0, rng.below(vcpus)),
        };
        match self.mode {
            Mode::X2apic => vec![self.write(ICR, to << 32 | shorthand | vector)],
            Mode::Xapic => vec![
                self.write(ICR_HIGH, to << 24),
                self.write(ICR, shorthand | vector),
            ],
        }
    }

    /// The mode's set-up: the APIC enabled (in x2APIC mode), software
    /// enabled with spurious vector 0xFF, each step read back.
    fn set_up(&self) -> Vec<Op> {
        let base = |kind, value| Op {
            kind,
            register: MSR_APIC_BASE,
            value,
        };
        let mut ops = vec![base(Kind::ReadMsr, 0)];
        if self.mode == Mode::X2apic {
            ops.push(base(Kind::OrMsr, APIC_BASE_ENABLE | APIC_BASE_EXTD));
        }
        ops.extend([self.write(SVR, 0x1FF), self.read(SVR)]);
        ops
    }

    /// A TSC deadline expiring: the APIC software-enabled and the LVT in
    /// TSC-deadline mode (a vector of 48 or more, masked one time in four),
    /// both through the MSR and the page, whichever mode the sequence is in
    /// by now; a deadline 0 to 200 000 TSC ticks from now, a delay of 30 M
    /// ticks, then the IRR's word of the vector and the deadline (0 once it
    /// fired), and a zero deadline. A masked deadline is not read back after
    /// it passed: KVM's stays set (it clears it when it injects the
    /// interrupt), where the SDM's timer disarms itself, as lapic-timer's
    /// does.
    fn expire_tsc_deadline(&self, rng: &mut Rng) -> Vec<Op> {
        let vector = 0x30 + rng.below(0xD0);
        let masked = if rng.one_in(4) { 1 << 16 } else { 0 };
        let deadline = |kind, value| Op {
            kind,
            register: MSR_TSC_DEADLINE,
            value,
        };
        let both = |offset, value| {
            [Mode::X2apic, Mode::Xapic].map(|mode| Access { mode, ..*self }.write(offset, value))
        };
        let mut ops = Vec::from(both(SVR, 0x1FF));
        ops.extend(both(LVT_TIMER, masked | 2 << 17 | vector));
        ops.extend([
            deadline(Kind::WriteMsrAfterTsc, rng.below(200_000)),
            Op {
                kind: Kind::Delay,
                register: 0,
                value: 30_000_000,
            },
            self.read(IRR + (vector / 32) as u32 * 16),
            match masked {
                0 => deadline(Kind::ReadMsr, 0),
                _ => self.read(LVT_TIMER),
            },
            deadline(Kind::WriteMsr, 0),
        ]);
        ops
    }

    /// The timer expiring: a divide, an LVT entry (one-shot or periodic, a
    /// vector of 48 or more, masked one time in four), a count of 1 000 to
    /// 20 000 bus cycles (at most 2.6 ms at KVM's 1 ns and the largest
    /// divide), a delay of 30 M TSC ticks (10 ms or more), then the IRR's
    /// word of the vector and the current count, and a zero count, which
    /// stops it: after it, nothing depends on when it fired.
    fn expire_timer(&self, rng: &mut Rng) -> [Op; 7] {
        let vector = 0x30 + rng.below(0xD0);
        let mode = rng.below(2) << 17;
        let masked = if rng.one_in(4) { 1 << 16 } else { 0 };
        let irr_word = IRR + (vector / 32) as u32 * 16;
        [
            self.write(TIMER_DIVIDE, rng.below(16) & 0b1011),
            self.write(LVT_TIMER, masked | mode | vector),
            self.write(TIMER_INITIAL, 1000 + rng.below(19_000)),
            Op {
                kind: Kind::Delay,
                register: 0,
                value: 30_000_000,
            },
            self.read(irr_word),
            self.read(TIMER_CURRENT),
            self.write(TIMER_INITIAL, 0),
        ]
    }

    /// A read of the register `op` wrote, if it wrote one.
    fn read_back(&self, op: Op) -> Option<Op> {
        let kind = match op.kind {
            Kind::WriteMsr | Kind::OrMsr => Kind::ReadMsr,
            Kind::WritePage => Kind::ReadPage,
            _ => return None,
        };
        Some(Op {
            kind,
            register: op.register,
            value: 0,
        })
    }

    fn read(&self, offset: u32) -> Op {
        match self.mode {
            Mode::X2apic => Op {
                kind: Kind::ReadMsr,
                register: msr(offset),
                value: 0,
            },
            Mode::Xapic => Op {
                kind: Kind::ReadPage,
                register: offset,
                value: 0,
            },
        }
    }

    fn write(&self, offset: u32, value: u64) -> Op {
        match self.mode {
            Mode::X2apic => Op {
                kind: Kind::WriteMsr,
                register: msr(offset),
                value,
            },
            Mode::Xapic => Op {
                kind: Kind::WritePage,
                register: offset,
                value: value & 0xFFFF_FFFF,
            },
        }
    }

    /// One random operation.
    fn random(&self, rng: &mut Rng) -> Op {
        match rng.below(20) {
            0..=6 => self.read(rng.below(0x40) as u32 * 16),
            7..=8 => self.write_anything(rng),
            9..=10 => self.write_lvt(rng),
            11 => {
                let tpr = rng.below(0x100);
                self.write(TPR, rng.with_reserved(tpr))
            }
            12 => self.write(ESR, if rng.one_in(4) { rng.next() } else { 0 }),
            13 => self.write(EOI, if rng.one_in(4) { rng.next() } else { 0 }),
            14..=15 => self.self_ipi(rng),
            16 => self.write_timer(rng),
            17 => self.write_svr_or_logical(rng),
            18 if rng.one_in(4) => self.write_apic_base(rng),
            18 => self.other_msr(rng),
            _ => Op {
                kind: Kind::Delay,
                register: 0,
                value: rng.below(10_000),
            },
        }
    }

    /// A write of IA32_APIC_BASE: the mode it is in (no change), x2APIC
    /// from xAPIC (after which the page reads all ones and takes no
    /// writes), or one the architecture refuses (x2APIC back to xAPIC,
    /// x2APIC without the enable, a reserved bit). Never a disable: this
    /// VMM's APIC does not support one.
    fn write_apic_base(&self, rng: &mut Rng) -> Op {
        let bsp = if self.vcpu == 0 { APIC_BASE_BSP } else { 0 };
        let base = XAPIC_BASE | bsp;
        let now = match self.mode {
            Mode::X2apic => APIC_BASE_ENABLE | APIC_BASE_EXTD,
            Mode::Xapic => APIC_BASE_ENABLE,
        };
        let value = match rng.below(4) {
            0 => now,
            1 => APIC_BASE_ENABLE | APIC_BASE_EXTD,
            2 => now ^ APIC_BASE_EXTD, // the other mode
            _ if rng.one_in(2) => APIC_BASE_EXTD,
            _ => now | 1 << rng.pick(&[0, 3, 7, 9]),
        };
        Op {
            kind: Kind::WriteMsr,
            register: MSR_APIC_BASE,
            value: base | value,
        }
    }

    /// A random value to a random register, except those that would send
    /// an IPI or arm the timer, and the ID (KVM's xAPIC takes a new one,
    /// which IPIs by ID then follow; this VMM's keeps the vCPU's index):
    /// read-only and reserved ones included.
    fn write_anything(&self, rng: &mut Rng) -> Op {
        let offset = loop {
            let offset = rng.below(0x40) as u32 * 16;
            if ![ID, ICR, ICR_HIGH, SELF_IPI, TIMER_INITIAL].contains(&offset)
                && !LVTS.contains(&offset)
            {
                break offset;
            }
        };
        self.write(offset, rng.next() & 0xFFFF_FFFF)
    }

    /// An LVT entry: a random vector, mask, trigger, timer mode and reserved
    /// bits, but always fixed delivery (an NMI or INIT to itself would end
    /// the guest), and never timer mode 11 (reserved; KVM's current count
    /// then runs on from the last count armed, which nothing specifies).
    fn write_lvt(&self, rng: &mut Rng) -> Op {
        const DELIVERY_MODE: u64 = 0x700;
        const RESERVED_TIMER_MODE: u64 = 0x6_0000;
        let value = rng.next() & 0x7_FFFF;
        let mut value = rng.with_reserved(value) & !DELIVERY_MODE;
        if value & RESERVED_TIMER_MODE == RESERVED_TIMER_MODE {
            value &= !(1 << 17); // TSC-deadline instead
        }
        self.write(rng.pick(&LVTS), value & 0xFFFF_FFFF)
    }

    /// A self-IPI: through the ICR (self shorthand, or its own APIC ID) or
    /// the x2APIC SELF IPI register, of any vector (0-15 are illegal),
    /// edge-triggered (a level-triggered fixed IPI has no use but INIT's
    /// de-assert, and this VMM has no level-triggered interrupts).
    fn self_ipi(&self, rng: &mut Rng) -> Op {
        let vector = rng.below(0x100);
        let level = rng.below(2) << 14;
        match (self.mode, rng.below(3)) {
            (Mode::X2apic, 0) => self.write(SELF_IPI, vector),
            (Mode::X2apic, 1) => self.write(ICR, u64::from(self.vcpu) << 32 | level | vector),
            (Mode::Xapic, 1) => Op {
                kind: Kind::WritePage,
                register: ICR_HIGH,
                value: u64::from(self.vcpu) << 24,
            },
            _ => self.write(ICR, 1 << 18 | level | vector),
        }
    }

    /// The timer: its divide configuration, a count or a TSC deadline far
    /// beyond the run (or 0, which disarms it).
    fn write_timer(&self, rng: &mut Rng) -> Op {
        let far = 1 << 40 | rng.next() >> 30;
        match rng.below(3) {
            0 => {
                let divide = rng.below(16);
                self.write(TIMER_DIVIDE, rng.with_reserved(divide))
            }
            1 => self.write(
                TIMER_INITIAL,
                if rng.one_in(3) {
                    0
                } else {
                    far & 0xFFFF_FFFF | 1 << 31
                },
            ),
            _ => Op {
                kind: Kind::WriteMsr,
                register: MSR_TSC_DEADLINE,
                value: if rng.one_in(3) { 0 } else { far << 20 },
            },
        }
    }

    /// The spurious-interrupt vector register, or the logical destination
    /// registers (read-only in x2APIC mode).
    fn write_svr_or_logical(&self, rng: &mut Rng) -> Op {
        match rng.below(3) {
            0 => {
                // Bit 12 too: EOI-broadcast suppression, which KVM's
                // version register may or may not offer.
                let svr = 0x100 | rng.below(0x2000);
                self.write(SVR, rng.with_reserved(svr))
            }
            1 => self.write(LDR, rng.next() & 0xFF00_0000),
            _ => self.write(DFR, rng.pick(&[0xFFFF_FFFF, 0x0FFF_FFFF])),
        }
    }

    /// An MSR outside the APIC's registers: the APIC base read back, or an
    /// x2APIC MSR in the wrong mode, or past the x2APIC range.
    fn other_msr(&self, rng: &mut Rng) -> Op {
        let register = match rng.below(3) {
            0 => MSR_APIC_BASE,
            1 => 0x800 + rng.below(0x40) as u32,
            _ => 0x840 + rng.below(0xC0) as u32,
        };
        Op {
            kind: Kind::ReadMsr,
            register,
            value: 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_sequence_and_seeds_differ() {
        let a = generate(7, Mode::X2apic, 0, 4, 64);
        assert_eq!(a, generate(7, Mode::X2apic, 0, 4, 64));
        assert_ne!(a, generate(8, Mode::X2apic, 0, 4, 64));
        let exchanges = a.iter().filter(|op| op.kind == Kind::Barrier).count();
        assert_eq!(exchanges, 2 * EXCHANGES);
        let ipis = a.len() - (64 + 5 + 2 * EXCHANGES);
        assert!(
            ipis <= 3 * EXCHANGES,
            "set-up, the operations, the priority"
        );
    }

    #[test]
    fn every_vcpus_barriers_wait_for_all_and_ipis_stay_between_them() {
        for seed in 0..200 {
            for mode in [Mode::X2apic, Mode::Xapic] {
                let ops = generate(seed, mode, 1, 3, 100);
                let barriers: Vec<u64> = ops
                    .iter()
                    .filter(|op| op.kind == Kind::Barrier)
                    .map(|op| op.value)
                    .collect();
                assert_eq!(barriers, [3, 6, 9, 12, 15, 18]);
                let mut inside = false;
                for op in &ops {
                    match op.kind {
                        Kind::Barrier => inside = !inside,
                        _ if inside => assert!(
                            matches!(op.kind, Kind::WriteMsr | Kind::WritePage),
                            "only sends in an exchange: {op}"
                        ),
                        _ => {}
                    }
                }
            }
        }
    }

    #[test]
    fn sequences_never_raise_what_would_end_the_guest() {
        for seed in 0..500 {
            for mode in [Mode::X2apic, Mode::Xapic] {
                let ops = generate(seed, mode, 3, 4, 200);
                let mut exchange = false;
                for (i, &op) in ops.iter().enumerate() {
                    exchange ^= op.kind == Kind::Barrier;
                    let write = matches!(op.kind, Kind::WriteMsr | Kind::WritePage);
                    let offset = match op.kind {
                        Kind::WriteMsr if (0x800..0x840).contains(&op.register) => {
                            (op.register - 0x800) * 16
                        }
                        Kind::WritePage => op.register,
                        _ => continue,
                    };
                    if !write {
                        continue;
                    }
                    if LVTS.contains(&offset) {
                        assert_eq!(op.value & 0x700, 0, "fixed delivery: {op}");
                        assert_ne!(op.value & 0x6_0000, 0x6_0000, "no reserved mode: {op}");
                    }
                    if offset == ICR {
                        let to_self = op.value & 0xC_0000 == 0x4_0000;
                        let to_own_id = op.value & 0xC_0000 == 0 && op.value >> 32 == 3;
                        assert!(exchange || to_self || to_own_id, "{op}");
                        assert_eq!(op.value & 0x700, 0, "fixed delivery: {op}");
                        assert_eq!(op.value & 0x8000, 0, "edge-triggered: {op}");
                    }
                    if offset == TIMER_INITIAL && op.value != 0 && op.value < 1 << 31 {
                        // A count that expires: waited for, then stopped.
                        assert_eq!(ops[i + 1].kind, Kind::Delay, "{op}");
                        assert_eq!(ops[i + 4].register, op.register, "{op}");
                        assert_eq!(ops[i + 4].value, 0, "{op}");
                    }
                }
            }
        }
    }

    #[test]
    fn records_read_back_status_and_value_and_compare_the_count_loosely() {
        let ops = [
            Op {
                kind: Kind::ReadMsr,
                register: 0x839,
                value: 0,
            },
            Op {
                kind: Kind::WriteMsr,
                register: 0x802,
                value: 1,
            },
            Op {
                kind: Kind::ReadMsr,
                register: 0x803,
                value: 0,
            },
        ];
        let mut area = vec![0u8; 3 * OP_SIZE];
        for (i, op) in ops.iter().enumerate() {
            area[i * OP_SIZE..][..OP_SIZE].copy_from_slice(&op.to_bytes());
        }
        area[4..8].copy_from_slice(&STATUS_DONE.to_le_bytes());
        area[24..32].copy_from_slice(&500u64.to_le_bytes());
        area[OP_SIZE + 4..OP_SIZE + 8].copy_from_slice(&STATUS_FAULTED.to_le_bytes());
        let records = Record::read_all(&ops, &area);
        assert_eq!(records[0].outcome, Outcome::Done(500));
        assert_eq!(records[1].outcome, Outcome::Faulted);
        assert_eq!(records[2].outcome, Outcome::NotRun, "the run ended first");
        let other = |outcome| Record {
            op: ops[0],
            outcome,
        };
        assert!(
            !records[0].differs(&other(Outcome::Done(7))),
            "both counting"
        );
        assert!(records[0].differs(&other(Outcome::Done(0))), "one expired");
        assert!(records[1].differs(&Record {
            op: ops[1],
            outcome: Outcome::Done(0)
        }));
    }
}
