//! KVM's answers for the `local_apic` fuzz target's corpus: each input's
//! register accesses become an `apic-script` sequence ([`script`]), run
//! once on KVM's LAPIC ([`record`]; `reference-vmm conformance
//! --record-fuzz-corpus`) and committed beside the corpus as
//! [`EXPECTATIONS`]. Replaying an input then checks this VMM's local APIC
//! against what KVM read back ([`check`]), where the fuzz target alone
//! checks only invariants.
//!
//! An input is 10-byte operations: a kind, an argument and a value (see
//! reference-vmm's `invariants::local_apic`, feature `fuzzing`). Kinds 0-3 (MSR write and read, page
//! read and write) reach the registers; the others (pending vectors,
//! injection, time) have no guest counterpart and are left out. The
//! sequence is tamed as the conformance generator's are: fixed delivery
//! only (an NMI, SMI or INIT to itself would end the guest), physical
//! destinations (this VMM has no logical mode), edge-triggered IPIs, timer
//! counts and deadlines far beyond the run, the APIC never disabled nor
//! moved.

use std::collections::HashMap;
use std::fmt::Write as _;

use test_guests::apic_script::{Kind, MAX_OPS, Op, Outcome, Record};
use test_guests::x86::apic::{MSR_APIC_BASE, MSR_TSC_DEADLINE, XAPIC_BASE};
use test_guests::x86::boot::phys_bits;

use super::{Difference, Origin, first_difference, records};
use reference_vmm::invariants::{apic_answers, fuzz_msr, fuzz_ops, fuzz_write_offset};
use reference_vmm::{Error, Irqchip};

/// The committed answers, relative to reference-vmm's directory (beside
/// its fuzz target's corpus): a line
/// `maxphyaddr N` (the recording vCPU's), then a line per corpus input, its
/// file name and one outcome per operation of its [`script`] (hex value,
/// `gp` for a #GP, `-` not run); `#` starts a comment.
pub const EXPECTATIONS: &str = "fuzz-corpus/local_apic.kvm";

/// IA32_APIC_BASE's global enable and bootstrap-processor bits (vCPU 0's).
const APIC_BASE_KEPT: u64 = XAPIC_BASE | 1 << 11 | 1 << 8;
/// IA32_APIC_BASE's address bits (12-51).
const APIC_BASE_ADDRESS: u64 = 0x000F_FFFF_FFFF_F000;
/// xAPIC offsets the taming looks at.
const LVTS: [u32; 7] = [0x2F0, 0x320, 0x330, 0x340, 0x350, 0x360, 0x370];
const ICR: u32 = 0x300;
const TIMER_INITIAL: u32 = 0x380;
const TPR: u32 = 0x080;

/// `input`'s register accesses as a sequence for vCPU 0, tamed, ending
/// with the highest task priority in both modes (as the generator's do).
/// Page accesses are 32-bit ones, the guest's only kind; reads are of a
/// register's offset (16-aligned, below 0x400), since KVM leaves the data
/// of any other read as it found it.
pub fn script(input: &[u8]) -> Vec<Op> {
    let op = |kind, register, value| Op {
        kind,
        register,
        value,
    };
    let mut ops: Vec<Op> = fuzz_ops(input)
        .filter_map(|f| match f.kind {
            0 => Some(op(Kind::WriteMsr, fuzz_msr(f.arg), f.value)),
            1 => Some(op(Kind::ReadMsr, fuzz_msr(f.arg), 0)),
            2 => Some(op(Kind::ReadPage, (f.value & 0x3F0) as u32, 0)),
            3 => Some(op(
                Kind::WritePage,
                (fuzz_write_offset(f) & 0xFFC) as u32,
                f.value & 0xFFFF_FFFF,
            )),
            _ => None,
        })
        .map(tame)
        .take(MAX_OPS as usize - 2)
        .collect();
    ops.push(op(Kind::WritePage, TPR, 0xFF));
    ops.push(op(Kind::WriteMsr, 0x800 + TPR / 16, 0xFF));
    ops
}

/// `op` without what would end the guest, reach another mode or outlive
/// the run.
fn tame(op: Op) -> Op {
    let offset = match (op.kind, op.register) {
        (Kind::WriteMsr, MSR_APIC_BASE) => {
            let value = op.value & !APIC_BASE_ADDRESS | APIC_BASE_KEPT;
            return Op { value, ..op };
        }
        (Kind::WriteMsr, MSR_TSC_DEADLINE) => {
            return Op {
                value: far(op.value, 62),
                ..op
            };
        }
        (Kind::WriteMsr, 0x800..0x840) => (op.register - 0x800) * 16,
        (Kind::WritePage, offset) => offset,
        _ => return op,
    };
    let value = match offset {
        // Fixed delivery; timer mode 11 (reserved) becomes TSC-deadline.
        _ if LVTS.contains(&offset) => match op.value & !0x700 {
            v if v & 0x6_0000 == 0x6_0000 => v & !(1 << 17),
            v => v,
        },
        // Fixed delivery, physical destination, edge-triggered.
        ICR => op.value & !0x8F00,
        TIMER_INITIAL => far(op.value, 31),
        _ => op.value,
    };
    Op { value, ..op }
}

/// `value` with bit `bit` set, unless it is 0 (which disarms the timer).
fn far(value: u64, bit: u32) -> u64 {
    match value {
        0 => 0,
        v => v | 1 << bit,
    }
}

/// The first operation of `input`'s [`script`] where this VMM's local APIC
/// (`invariants::apic_answers`) answers otherwise than KVM's recorded
/// `answers`, outside
/// [`super::DELIBERATE`]; a record of another length is a difference at its
/// end.
pub fn check(input: &[u8], kvm: &[Outcome], phys_bits: u8) -> Option<Difference> {
    let ours = apic_answers(&script(input), phys_bits);
    let kvm: Vec<Record> = ours
        .iter()
        .zip(kvm.iter().chain(std::iter::repeat(&Outcome::NotRun)))
        .map(|(r, &outcome)| Record { op: r.op, outcome })
        .collect();
    first_difference(Origin::FuzzInput, ours, &kvm)
}

/// Runs each of `inputs` (a name and its bytes) on KVM's LAPIC, one VM of
/// one vCPU each, and returns the [`EXPECTATIONS`] file's text, sorted by
/// name.
///
/// # Errors
/// A VM could not be made or run.
pub fn record(inputs: &[(String, Vec<u8>)]) -> Result<String, Error> {
    let mut sorted: Vec<&(String, Vec<u8>)> = inputs.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let kvm = kvm_ioctls::Kvm::new().map_err(Error::OpenKvm)?;
    let cpuid = kvm
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(|source| Error::Kvm {
            op: "KVM_GET_SUPPORTED_CPUID",
            source,
        })?;
    let mut text = format!(
        "# KVM's LAPIC's answers for fuzz-corpus/local_apic (reference-vmm conformance --record-fuzz-corpus)\n\
         maxphyaddr {}\n",
        phys_bits(&cpuid)
    );
    for (name, input) in sorted {
        let kvm = records(Irqchip::Kernel, &[script(input)])?;
        let _ = write!(text, "{name}");
        for r in kvm.iter().flatten() {
            let _ = match r.outcome {
                Outcome::Done(v) => write!(text, " {v:x}"),
                Outcome::Faulted => write!(text, " gp"),
                Outcome::NotRun => write!(text, " -"),
            };
        }
        text.push('\n');
    }
    Ok(text)
}

/// An [`EXPECTATIONS`] file: KVM's answers and the vCPU they came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Answers {
    /// The recording vCPU's MAXPHYADDR.
    pub phys_bits: u8,
    /// Each input's outcomes, by its file name.
    pub by_input: HashMap<String, Vec<Outcome>>,
}

/// The answers in an [`EXPECTATIONS`] file's text.
///
/// # Errors
/// A line's outcome is not hex, `gp` or `-`, or `maxphyaddr` is missing or
/// not a number (the line number and the word).
pub fn parse(text: &str) -> Result<Answers, String> {
    let mut answers = Answers::default();
    for (n, line) in text.lines().enumerate() {
        let mut words = line.split_whitespace();
        let Some(name) = words.next().filter(|w| !w.starts_with('#')) else {
            continue;
        };
        if name == "maxphyaddr" {
            let bits = words.next().and_then(|w| w.parse().ok());
            answers.phys_bits = bits.ok_or(format!("line {}: maxphyaddr needs a number", n + 1))?;
            continue;
        }
        let outcomes = words
            .map(|w| match w {
                "gp" => Ok(Outcome::Faulted),
                "-" => Ok(Outcome::NotRun),
                hex => u64::from_str_radix(hex, 16)
                    .map(Outcome::Done)
                    .map_err(|_| format!("line {}: {w:?} is no outcome", n + 1)),
            })
            .collect::<Result<Vec<_>, _>>()?;
        answers.by_input.insert(name.to_string(), outcomes);
    }
    match answers.phys_bits {
        0 => Err("no maxphyaddr line".into()),
        _ => Ok(answers),
    }
}

/// The first of KVM's `fresh` records of a script that is not the
/// committed `kvm` outcome (the timer's current count compared as running
/// or not), with that outcome; a record of another length differs at the
/// shorter's end.
pub fn first_change(fresh: &[Record], kvm: &[Outcome]) -> Option<(Record, Outcome)> {
    let committed = kvm
        .iter()
        .copied()
        .chain(std::iter::repeat(Outcome::NotRun));
    let changed = fresh.iter().zip(committed).find(|(r, outcome)| {
        r.differs(&Record {
            op: r.op,
            outcome: *outcome,
        })
    });
    match changed {
        Some((&r, outcome)) => Some((r, outcome)),
        None if kvm.len() > fresh.len() => Some((
            Record {
                op: fresh.last()?.op,
                outcome: Outcome::NotRun,
            },
            kvm[fresh.len()],
        )),
        None => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answers_file_reads_back_and_bad_lines_are_named() {
        let answers = parse("# a comment\nmaxphyaddr 46\nabc 0 1f gp -\n\n").unwrap();
        assert_eq!(answers.phys_bits, 46);
        let outcomes = &answers.by_input["abc"];
        assert_eq!(
            outcomes[..],
            [
                Outcome::Done(0),
                Outcome::Done(0x1F),
                Outcome::Faulted,
                Outcome::NotRun
            ]
        );
        assert!(parse("abc 0\n").unwrap_err().contains("no maxphyaddr"));
        assert!(parse("maxphyaddr x\n").unwrap_err().contains("line 1"));
        assert!(
            parse("maxphyaddr 46\nabc zz\n")
                .unwrap_err()
                .contains("line 2")
        );
    }

    #[test]
    fn a_changed_answer_is_found_where_it_changed() {
        let ops = script(&[1, 3, 0, 0, 0, 0, 0, 0, 0, 0]); // rdmsr 0x803, then the TPRs
        let fresh: Vec<Record> = ops
            .iter()
            .map(|&op| Record {
                op,
                outcome: Outcome::Done(0),
            })
            .collect();
        let same: Vec<Outcome> = fresh.iter().map(|r| r.outcome).collect();
        assert_eq!(first_change(&fresh, &same), None);
        let mut other = same.clone();
        other[1] = Outcome::Faulted;
        let (record, then) = first_change(&fresh, &other).unwrap();
        assert_eq!((record.op, then), (ops[1], Outcome::Faulted));
        let mut longer = same.clone();
        longer.push(Outcome::Done(7));
        assert_eq!(first_change(&fresh, &longer).unwrap().1, Outcome::Done(7));
        // The VMM's model against a made-up answer: the read differs.
        let input = [1u8, 3, 0, 0, 0, 0, 0, 0, 0, 0];
        assert!(check(&input, &same, 48).is_some(), "a #GP read back as 0");
        let modelled: Vec<Outcome> = apic_answers(&script(&input), 48)
            .iter()
            .map(|r| r.outcome)
            .collect();
        assert!(check(&input, &modelled, 48).is_none());
    }
}
