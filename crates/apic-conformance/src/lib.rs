//! The differential runner: the guest kit's `apic-script` sequences
//! ([`test_guests::apic_script`]) on this VMM's local APIC and on KVM's
//! (`--irqchip kernel`, the implementation Linux guests run on), compared
//! operation by operation. KVM is the oracle: every difference is a bug
//! in the VMM, or one of [`DELIBERATE`]'s. The README says what it compares
//! and how; `reference-vmm conformance` runs it.

#![deny(missing_docs)]

use std::fmt;
use std::time::Duration;

use lapic_timer::{GuestTime, LapicTimer, TimerRegister};
use test_guests::apic_script::{self, Kind, Mode, Op, Outcome, Record};
use test_guests::layout::apic_script as script_addr;
use test_guests::x86::apic::{MSR_APIC_BASE, MSR_TSC_DEADLINE};
use vm_memory::{Bytes, GuestAddress};

use reference_vmm::{Error, Irqchip, Vm, VmConfig};

pub mod fuzz_corpus;

/// vCPUs per VM: one seed each, so a VM runs this many seeds at once.
pub const SEEDS_PER_VM: u32 = 8;
/// Random operations per sequence, unless told otherwise.
pub const DEFAULT_OPS: u64 = 48;

/// Where this VMM's APIC answers otherwise than KVM's on purpose: an
/// operation of `kind` on one of `registers` (MSRs, or xAPIC page offsets),
/// whichever mode its sequence started in, is compared on the `compared`
/// bits of what it read only (0: not at all, its fault included), for the
/// reason given.
#[derive(Clone, Copy, Debug)]
pub struct Deliberate {
    /// What it does.
    pub kind: Kind,
    /// The MSRs or page offsets.
    pub registers: &'static [u32],
    /// The bits still compared (0: none).
    pub compared: u64,
    /// Why the answers differ.
    pub why: &'static str,
}

/// LVT mask bit.
const LVT_MASKED: u32 = 1 << 16;

/// The LVT registers' x2APIC MSRs (timer to error) and xAPIC offsets.
const LVT_MSRS: &[u32] = &[0x832, 0x833, 0x834, 0x835, 0x836, 0x837];
const LVT_OFFSETS: &[u32] = &[0x320, 0x330, 0x340, 0x350, 0x360, 0x370];
/// The xAPIC page's offsets that hold no register KVM reads (reserved,
/// EOI and the CMCI LVT, which this VMM's CPUID does not offer).
const RESERVED_OFFSETS: &[u32] = &[
    0x000, 0x010, 0x040, 0x050, 0x060, 0x070, 0x0B0, 0x0C0, 0x290, 0x2A0, 0x2B0, 0x2C0, 0x2D0,
    0x2E0, 0x2F0, 0x3A0, 0x3B0, 0x3C0, 0x3D0, 0x3F0,
];

/// The deliberate differences (the README's table lists them too).
pub const DELIBERATE: &[Deliberate] = &[
    Deliberate {
        kind: Kind::ReadMsr,
        registers: &[0x828],
        compared: 0,
        why: "ESR: KVM never records an APIC error; this VMM records illegal vectors and registers, as the SDM says",
    },
    Deliberate {
        kind: Kind::ReadPage,
        registers: &[0x280],
        compared: 0,
        why: "ESR, as above",
    },
    Deliberate {
        kind: Kind::ReadMsr,
        registers: &[0x820],
        compared: 0xFFFF_0000,
        why: "IRR vectors 0-15: KVM accepts an IPI of an illegal vector; the SDM, and this VMM, send none",
    },
    Deliberate {
        kind: Kind::ReadPage,
        registers: &[0x200],
        compared: 0xFFFF_0000,
        why: "IRR vectors 0-15, as above",
    },
    Deliberate {
        kind: Kind::ReadMsr,
        registers: LVT_MSRS,
        compared: !0x1000,
        why: "LVT bit 12: KVM keeps the delivery-status bit a guest writes; the SDM makes it read-only, and it reads 0 here",
    },
    Deliberate {
        kind: Kind::ReadPage,
        registers: LVT_OFFSETS,
        compared: !0x1000,
        why: "LVT bit 12, as above",
    },
    Deliberate {
        kind: Kind::WriteMsr,
        registers: &[0x80B],
        compared: 0,
        why: "EOI: a non-zero write is a #GP in the SDM and here; KVM takes it as an EOI",
    },
    Deliberate {
        kind: Kind::ReadPage,
        registers: &[0x020, 0x0D0, 0x0E0],
        compared: 0,
        why: "ID, LDR, DFR: KVM's xAPIC lets a guest write them; here the ID is the vCPU's index and destinations are physical only (no logical mode)",
    },
    Deliberate {
        kind: Kind::ReadPage,
        registers: RESERVED_OFFSETS,
        compared: 0,
        why: "reserved offsets: KVM leaves such a read's data as it found it; they read 0 here",
    },
];

impl Deliberate {
    /// Whether `ours` and `kvm`, the same operation, differ beyond what
    /// [`DELIBERATE`] allows.
    fn differ(ours: &Record, kvm: &Record) -> bool {
        let op = ours.op;
        let deliberate = DELIBERATE
            .iter()
            .find(|d| d.kind == op.kind && d.registers.contains(&op.register));
        match (deliberate, ours.outcome, kvm.outcome) {
            (Some(d), Outcome::Done(a), Outcome::Done(b)) => a & d.compared != b & d.compared,
            (Some(d), ..) if d.compared == 0 => false,
            _ => ours.differs(kvm),
        }
    }
}

/// Where a sequence came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    /// [`apic_script::generate`]'s, from a seed, in a mode, run beside
    /// the seeds from `first` on (one per vCPU, since the sequences send
    /// each other IPIs): `--first-seed first --seeds vcpus` runs it again.
    Seed {
        /// The seed.
        seed: u64,
        /// How it reached the APIC first.
        mode: Mode,
        /// The VM's first seed (vCPU 0's).
        first: u64,
        /// The VM's vCPUs, one seed each.
        vcpus: u32,
    },
    /// A fuzz input's ([`fuzz_corpus::script`]).
    FuzzInput,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Seed {
                seed,
                mode,
                first,
                vcpus,
            } => {
                let last = first + u64::from(*vcpus) - 1;
                write!(f, "seed {seed} ({mode:?}, beside seeds {first}-{last})")
            }
            Self::FuzzInput => f.write_str("the fuzz input"),
        }
    }
}

/// The first operation whose record differs between the two APICs.
#[derive(Clone, Debug)]
pub struct Difference {
    /// Where the sequence came from.
    pub origin: Origin,
    /// This VMM's records up to and including the one that differs.
    pub ours: Vec<Record>,
    /// What KVM's APIC did at that operation.
    pub kvm: Record,
}

impl fmt::Display for Difference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some((last, before)) = self.ours.split_last() else {
            return Ok(());
        };
        writeln!(f, "{}: operation {} differs", self.origin, before.len())?;
        for (i, r) in before.iter().enumerate() {
            writeln!(f, "  {i:3}  {:<40} {}", r.op.to_string(), r.outcome)?;
        }
        write!(
            f,
            "  {:3}  {:<40} this VMM: {}, KVM: {}",
            before.len(),
            last.op.to_string(),
            last.outcome,
            self.kvm.outcome
        )
    }
}

/// Runs seeds `first..first + count` in `mode`, `ops` random operations
/// each, on both APICs; returns the first difference, if any.
///
/// # Errors
/// A VM could not be made or run (no `/dev/kvm`, a guest fault).
pub fn compare(
    first: u64,
    count: u64,
    mode: Mode,
    ops: usize,
) -> Result<Option<Difference>, Error> {
    let mut found = None;
    each_difference(first, count, mode, ops, |d| {
        found = Some(d);
        false
    })?;
    Ok(found)
}

/// Each seed's first difference, for all of `first..first + count`: what
/// a summary of every kind of difference needs.
///
/// # Errors
/// As [`compare`].
pub fn differences(
    first: u64,
    count: u64,
    mode: Mode,
    ops: usize,
) -> Result<Vec<Difference>, Error> {
    let mut found = Vec::new();
    each_difference(first, count, mode, ops, |d| {
        found.push(d);
        true
    })?;
    Ok(found)
}

/// Hands each seed's first difference to `found` while it returns true.
fn each_difference(
    first: u64,
    count: u64,
    mode: Mode,
    ops: usize,
    mut found: impl FnMut(Difference) -> bool,
) -> Result<(), Error> {
    let end = first.saturating_add(count);
    let mut seed = first;
    while seed < end {
        let seeds: Vec<u64> = (seed..end).take(SEEDS_PER_VM as usize).collect();
        let vcpus = seeds.len() as u32;
        let scripts = scripts(seed, vcpus, mode, ops);
        let ours = records(Irqchip::User, &scripts)?;
        let kvm = records(Irqchip::Kernel, &scripts)?;
        for ((&seed, ours), kvm) in seeds.iter().zip(ours).zip(kvm) {
            let origin = Origin::Seed {
                seed,
                mode,
                first: seeds[0],
                vcpus,
            };
            if let Some(d) = first_difference(origin, ours, &kvm) {
                if !found(d) {
                    return Ok(());
                }
            }
        }
        seed += seeds.len() as u64;
    }
    Ok(())
}

/// The sequences of one VM: seeds `first..first + vcpus`, one per vCPU,
/// `ops` random operations each.
pub fn scripts(first: u64, vcpus: u32, mode: Mode, ops: usize) -> Vec<Vec<Op>> {
    (0..vcpus)
        .map(|v| apic_script::generate(first + u64::from(v), mode, v, vcpus, ops))
        .collect()
}

/// The first of `ours` that differs from `kvm`'s, outside [`DELIBERATE`].
fn first_difference(origin: Origin, mut ours: Vec<Record>, kvm: &[Record]) -> Option<Difference> {
    let at = ours
        .iter()
        .zip(kvm)
        .position(|(a, b)| Deliberate::differ(a, b))?;
    ours.truncate(at + 1);
    Some(Difference {
        origin,
        ours,
        kvm: kvm[at],
    })
}

/// The differences grouped by the operation that differed (its kind and
/// register), most frequent first, each with how many seeds and the
/// shortest example.
pub fn summary(found: &[Difference]) -> String {
    let mut groups: Vec<(String, usize, &Difference)> = Vec::new();
    for d in found {
        let Some(last) = d.ours.last() else { continue };
        let mode = match d.origin {
            Origin::Seed { mode, .. } => format!("{mode:?}"),
            Origin::FuzzInput => "fuzz".into(),
        };
        let key = format!("{mode} {:?} {:#x}", last.op.kind, last.op.register);
        match groups.iter_mut().find(|(k, ..)| *k == key) {
            Some((_, n, example)) => {
                *n += 1;
                if d.ours.len() < example.ours.len() {
                    *example = d;
                }
            }
            None => groups.push((key, 1, d)),
        }
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.1));
    groups
        .iter()
        .map(|(key, n, example)| format!("{key}: {n} seed(s), e.g.\n{example}\n"))
        .collect()
}

/// lapic-timer's model alone against KVM: replays the timer-register
/// operations of KVM's `records` (one sequence, in `mode` at its start) on a
/// bare [`LapicTimer`], as a VMM's APIC would hand them over (LVT writes
/// masked while the APIC is software-disabled, the page only in xAPIC
/// mode), and returns the index of the first read the model answers
/// otherwise, or the first write it refuses where KVM took it (or the
/// reverse), with the model's record.
pub fn timer_model_difference(mode: Mode, records: &[Record]) -> Option<(usize, Record)> {
    let mut replay = TimerReplay {
        timer: LapicTimer::new(GuestTime {
            tsc_khz: 1_000_000,
            ns: 0,
            tsc_at_ns: 0,
        }),
        x2apic: mode == Mode::X2apic,
        enabled: false,
        now_ns: 0,
    };
    records.iter().enumerate().find_map(|(i, kvm)| {
        let ours = replay.apply(kvm)?;
        Deliberate::differ(&ours, kvm).then_some((i, ours))
    })
}

/// The timer model and what of the APIC around it the replay tracks.
struct TimerReplay {
    timer: LapicTimer,
    x2apic: bool,
    /// SVR's software enable.
    enabled: bool,
    /// The model's time: it moves only at a delay, by at least as many ns
    /// as the delay's TSC ticks took (no TSC here runs faster than 1 GHz),
    /// so a count the guest waited out has run out for the model too.
    now_ns: u64,
}

impl TimerReplay {
    /// Applies `kvm`'s operation; returns the model's record where the
    /// operation reached a timer register.
    fn apply(&mut self, kvm: &Record) -> Option<Record> {
        let op = kvm.op;
        let took = matches!(kvm.outcome, Outcome::Done(_));
        match (op.kind, op.register) {
            (Kind::Delay, _) => {
                self.now_ns = self.now_ns.saturating_add(op.value);
                let _ = self.timer.expire(self.now_ns);
                None
            }
            (Kind::WriteMsrAfterTsc, MSR_TSC_DEADLINE) => {
                let deadline = self.now_ns.saturating_add(op.value);
                let _ = self.timer.write_msr(op.register, deadline, self.now_ns);
                None
            }
            (Kind::WriteMsr | Kind::OrMsr, MSR_APIC_BASE) if took => {
                self.x2apic |= op.value & 1 << 10 != 0;
                None
            }
            (Kind::WriteMsr, 0x80F) | (Kind::WritePage, 0x0F0) if took && self.reaches(op) => {
                self.set_enabled(op.value & 0x100 != 0);
                None
            }
            (kind, register) if self.reaches(op) => {
                let reg = timer_register(kind, register)?;
                Some(Record {
                    op,
                    outcome: self.access(op, reg),
                })
            }
            _ => None,
        }
    }

    /// Whether `op` reaches the APIC in the mode the sequence is in now.
    fn reaches(&self, op: Op) -> bool {
        match op.kind {
            Kind::ReadPage | Kind::WritePage => !self.x2apic,
            _ => self.x2apic || op.register == MSR_TSC_DEADLINE,
        }
    }

    /// A software disable masks the timer's LVT entry.
    fn set_enabled(&mut self, enabled: bool) {
        self.enabled = enabled;
        if !enabled {
            let lvt = self.timer.read(TimerRegister::LvtTimer, self.now_ns) | LVT_MASKED;
            let _ = self.timer.write(TimerRegister::LvtTimer, lvt, self.now_ns);
        }
    }

    /// The model's answer to `op` on `reg` at the model's time (a count
    /// reads as armed or not, as the runner compares).
    fn access(&mut self, op: Op, reg: Option<TimerRegister>) -> Outcome {
        let now = self.now_ns;
        let masked = |v: u64| match (reg, self.enabled) {
            (Some(TimerRegister::LvtTimer), false) => v | u64::from(LVT_MASKED),
            _ => v,
        };
        let result = match (op.kind, reg) {
            (Kind::ReadMsr, _) => self.timer.read_msr(op.register, now),
            (Kind::ReadPage, Some(reg)) => Ok(u64::from(self.timer.read(reg, now))),
            (Kind::WriteMsr, _) => self
                .timer
                .write_msr(op.register, masked(op.value), now)
                .map(|()| 0),
            (Kind::WritePage, Some(reg)) => {
                // The page drops a write the register refuses.
                let _ = self.timer.write(reg, masked(op.value) as u32, now);
                Ok(0)
            }
            _ => return Outcome::NotRun,
        };
        result.map_or(Outcome::Faulted, Outcome::Done)
    }
}

/// The timer register `kind` reaches at `register`: `Some(None)` for
/// IA32_TSC_DEADLINE, `None` for a register that is not the timer's.
fn timer_register(kind: Kind, register: u32) -> Option<Option<TimerRegister>> {
    match kind {
        Kind::ReadMsr | Kind::WriteMsr if register == MSR_TSC_DEADLINE => Some(None),
        Kind::ReadMsr | Kind::WriteMsr => TimerRegister::from_x2apic_msr(register).map(Some),
        Kind::ReadPage | Kind::WritePage => TimerRegister::from_offset(register).map(Some),
        _ => None,
    }
}

/// Runs `scripts` (one per vCPU) on `irqchip`'s APIC and reads back what
/// each vCPU recorded.
///
/// # Errors
/// The VM could not be made, or the run failed.
pub fn records(irqchip: Irqchip, scripts: &[Vec<Op>]) -> Result<Vec<Vec<Record>>, Error> {
    let longest = scripts.iter().map(Vec::len).max().unwrap_or(0);
    let mut config = VmConfig {
        vcpus: scripts.len() as u32,
        irqchip,
        timeout: Some(Duration::from_secs(60)),
        ..VmConfig::default()
    };
    config.params[0] = longest as u64;
    let vm = Vm::new(&config)?;
    let memory = vm.memory();
    for (v, script) in (0..).zip(scripts) {
        // Shorter scripts end in no-op delays, so each vCPU runs `longest`.
        let pad = Op {
            kind: Kind::Delay,
            register: 0,
            value: 0,
        };
        let bytes: Vec<u8> = script
            .iter()
            .chain(std::iter::repeat_n(&pad, longest - script.len()))
            .flat_map(|op| op.to_bytes())
            .collect();
        memory
            .write_slice(&bytes, GuestAddress(script_addr(v)))
            .map_err(|source| Error::WriteMemory {
                what: "apic-script operations",
                source,
            })?;
    }
    let program = test_guests::find("apic-script").expect("a built-in program");
    vm.run(program, Box::new(std::io::sink()))?;
    (0..)
        .zip(scripts)
        .map(|(v, script)| {
            let mut area = vec![0; script.len() * apic_script::OP_SIZE];
            memory
                .read_slice(&mut area, GuestAddress(script_addr(v)))
                .map_err(|source| Error::ReadMemory {
                    what: "apic-script records",
                    source,
                })?;
            Ok(Record::read_all(script, &area))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(register: u32, outcome: Outcome) -> Record {
        let op = Op {
            kind: Kind::ReadMsr,
            register,
            value: 0,
        };
        Record { op, outcome }
    }

    #[test]
    fn the_timer_model_replays_kvms_timer_operations_and_compares_its_reads() {
        let op = |kind, register, value| Op {
            kind,
            register,
            value,
        };
        let done = |op, v| Record {
            op,
            outcome: Outcome::Done(v),
        };
        let mut kvm = vec![
            done(op(Kind::WriteMsr, 0x80F, 0x1FF), 0),
            done(op(Kind::WriteMsr, 0x832, 0x30), 0),
            done(op(Kind::ReadMsr, 0x832, 0), 0x30),
            done(op(Kind::WriteMsr, 0x838, 1 << 31), 0),
            done(op(Kind::ReadMsr, 0x839, 0), 12345), // counting: compared loosely
            done(op(Kind::WriteMsr, 0x80F, 0xFF), 0), // a software disable
            done(op(Kind::ReadMsr, 0x832, 0), 0x10030), // masks the timer
        ];
        assert_eq!(timer_model_difference(Mode::X2apic, &kvm), None);
        // An xAPIC sequence does not reach the MSRs: nothing compared.
        assert_eq!(timer_model_difference(Mode::Xapic, &kvm), None);
        kvm[6] = done(op(Kind::ReadMsr, 0x832, 0), 0x30);
        let (i, model) = timer_model_difference(Mode::X2apic, &kvm).unwrap();
        assert_eq!((i, model.outcome), (6, Outcome::Done(0x10030)));
        // A count the guest waited out has run out for the model too.
        let waited = [
            done(op(Kind::WriteMsr, 0x80F, 0x1FF), 0),
            done(op(Kind::WriteMsr, 0x838, 1000), 0),
            done(op(Kind::Delay, 0, 30_000_000), 0),
            done(op(Kind::ReadMsr, 0x839, 0), 0),
        ];
        assert_eq!(timer_model_difference(Mode::X2apic, &waited), None);
        // A write the model refuses (bits 63:32) that KVM took.
        kvm.truncate(2);
        kvm.push(done(op(Kind::WriteMsr, 0x838, 1 << 40), 0));
        let (i, model) = timer_model_difference(Mode::X2apic, &kvm).unwrap();
        assert_eq!((i, model.outcome), (2, Outcome::Faulted));
    }

    #[test]
    fn the_summary_groups_differences_by_operation_most_frequent_first() {
        let difference = |seed, register, before| Difference {
            origin: Origin::Seed {
                seed,
                mode: Mode::X2apic,
                first: 0,
                vcpus: 8,
            },
            ours: [record(0x802, Outcome::Done(0))]
                .repeat(before)
                .into_iter()
                .chain([record(register, Outcome::Done(1))])
                .collect(),
            kvm: record(register, Outcome::Faulted),
        };
        let found = [
            difference(1, 0x803, 5),
            difference(2, 0x80F, 1),
            difference(3, 0x803, 2),
        ];
        let text = summary(&found);
        let first = text.find("X2apic ReadMsr 0x803: 2 seed(s)").unwrap();
        let second = text.find("X2apic ReadMsr 0x80f: 1 seed(s)").unwrap();
        assert!(first < second, "{text}");
        assert!(
            text.contains("seed 3 (X2apic, beside seeds 0-7): operation 2 differs"),
            "the shortest example: {text}"
        );
        assert!(!text.contains("seed 1 (X2apic"), "{text}");
        assert_eq!(summary(&[]), "");
    }

    #[test]
    fn conformance_md_lists_every_deliberate_difference() {
        let doc = include_str!("../README.md");
        for d in DELIBERATE {
            assert!(doc.contains(d.why), "the README lacks: {}", d.why);
        }
    }

    #[test]
    fn the_first_difference_comes_with_the_operations_before_it() {
        let ours = vec![
            record(0x802, Outcome::Done(0)),
            record(0x803, Outcome::Done(0x50014)),
            record(0x804, Outcome::Done(0)),
        ];
        let kvm = [
            record(0x802, Outcome::Done(0)),
            record(0x803, Outcome::Done(0x50014)),
            record(0x804, Outcome::Faulted),
        ];
        let origin = Origin::Seed {
            seed: 1,
            mode: Mode::X2apic,
            first: 0,
            vcpus: 2,
        };
        assert!(first_difference(origin, ours.clone(), &ours).is_none());
        let d = first_difference(origin, ours, &kvm).unwrap();
        assert_eq!(d.ours.len(), 3);
        let text = d.to_string();
        assert!(
            text.starts_with("seed 1 (X2apic, beside seeds 0-1): operation 2 differs"),
            "{text}"
        );
        assert!(text.contains("rdmsr 0x803"), "{text}");
        assert!(text.ends_with("this VMM: 0x0, KVM: #GP"), "{text}");
    }
}
