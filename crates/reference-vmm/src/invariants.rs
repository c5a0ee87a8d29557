//! Drives each place where guest input lands with arbitrary input, and panics
//! if an invariant breaks: the local APIC's registers, ucall decoding, the
//! exit handler, the learners that read guest memory
//! (`guest_abi`). The fuzz targets (`fuzz/`) feed them random bytes;
//! `cargo test` replays the committed corpus (`fuzz-corpus/<target>/`).
//! The local APIC also runs alone through an apic-script sequence
//! ([`apic_answers`]): apic-conformance compares its answers for the
//! `local_apic` corpus with KVM's.

use std::sync::Arc;

use kvm_ioctls::VcpuExit;
use lapic_timer::GuestTime;
use vm_memory::{Bytes, GuestAddress};

use crate::apic::{self, Action, LocalApic, XAPIC_BASE};
use crate::devices::{IoBus, POST_PORT, PostCode, SerialConsole};
use crate::exit::{Devices, ExitError, MAX_REPORTS, NoApic, handle_exit};
use crate::fault::GuestFault;
use crate::guest_abi::{DeliveryPath, GuestPoll, MAX_LEAD, TimerLead};
use crate::memory::VmMemory;
use test_guests::abi::SERIAL_PORT;
use test_guests::apic_script::{Kind, Op, Outcome, Record};
use test_guests::ucall::{self, MAX_STRING_LEN, UCALL_PORT, Ucall};
use test_guests::x86::apic::{MSR_APIC_BASE, MSR_TSC_DEADLINE};

/// A guest TSC of 1 GHz that equals host ns.
const TIME: GuestTime = GuestTime {
    tsc_khz: 1_000_000,
    ns: 0,
    tsc_at_ns: 0,
};

/// Bytes per operation of a fuzz input.
const FUZZ_OP: usize = 10;
/// One operation of a fuzz input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FuzzOp {
    /// What it does (modulo 8).
    pub kind: u8,
    /// The register (an MSR by [`fuzz_msr`], or part of a page offset), or
    /// an access's size.
    pub arg: u8,
    /// The value, little-endian, zero past the input's end.
    pub value: u64,
}

/// The operations of a fuzz input, 10 bytes each.
pub fn fuzz_ops(input: &[u8]) -> impl Iterator<Item = FuzzOp> + '_ {
    input.chunks(FUZZ_OP).map(|op| FuzzOp {
        kind: op[0] % 8,
        arg: op.get(1).copied().unwrap_or(0),
        value: (0..8).fold(0, |v, k| {
            v | u64::from(op.get(2 + k).copied().unwrap_or(0)) << (8 * k)
        }),
    })
}

/// The MSR of a fuzz operation's argument: the x2APIC range and past it,
/// IA32_APIC_BASE (0xFF) or IA32_TSC_DEADLINE (0xFE).
pub fn fuzz_msr(arg: u8) -> u32 {
    match arg {
        0xFF => MSR_APIC_BASE,
        0xFE => MSR_TSC_DEADLINE,
        n => 0x800 + u32::from(n),
    }
}

/// The page offset a fuzz page write reaches.
pub fn fuzz_write_offset(op: FuzzOp) -> u64 {
    u64::from(op.arg) << 4 | op.value >> 60
}

/// What this VMM's local APIC (vCPU 0 of one with
/// `phys_bits` of physical address, at time 0 on a 1 GHz TSC) reads back
/// for `script`, handling each write's IPI as the VMM does: its own
/// pending set gains the vector when the IPI reaches it.
pub fn apic_answers(script: &[Op], phys_bits: u8) -> Vec<Record> {
    let time = GuestTime {
        tsc_khz: 1_000_000,
        ns: 0,
        tsc_at_ns: 0,
    };
    let mut apic = LocalApic::new(0, time).with_phys_bits(phys_bits);
    let mut irr = [0u64; 4];
    let post = |apic: &LocalApic, action, irr: &mut [u64; 4]| {
        if let Action::Ipi { vector, to } = action {
            if to.reaches(0, 0, apic.x2apic()) && apic.enabled() {
                irr[usize::from(vector / 64)] |= 1 << (vector % 64);
            }
        }
    };
    let outcome = |result: Result<u64, _>| result.map_or(Outcome::Faulted, Outcome::Done);
    script
        .iter()
        .map(|&op| {
            let outcome = match op.kind {
                Kind::ReadMsr => outcome(apic.read(op.register, &irr, 0)),
                Kind::WriteMsr => match apic.write(op.register, op.value, 0) {
                    Ok(action) => {
                        post(&apic, action, &mut irr);
                        Outcome::Done(0)
                    }
                    Err(_) => Outcome::Faulted,
                },
                Kind::ReadPage => {
                    let mut word = [0; 4];
                    apic.mmio_read_bytes(op.register.into(), &mut word, &irr, 0);
                    Outcome::Done(u32::from_le_bytes(word).into())
                }
                Kind::WritePage => {
                    let word = (op.value as u32).to_le_bytes();
                    let action = apic.mmio_write_bytes(op.register.into(), &word, 0);
                    post(&apic, action, &mut irr);
                    Outcome::Done(0)
                }
                Kind::OrMsr | Kind::Delay | Kind::Barrier | Kind::WriteMsrAfterTsc => {
                    Outcome::NotRun
                }
            };
            Record { op, outcome }
        })
        .collect()
}

/// Local APIC: arbitrary x2APIC MSR and xAPIC page accesses of any size,
/// pending vectors, injections and time steps. Checks: the processor
/// priority is at least the TPR's class and the in-service class; only a
/// vector above it is deliverable, and only from the pending set; the mode
/// only goes xAPIC → x2APIC; the ID reads back in either mode; the ESR holds
/// only architectural bits; every IPI sent has a legal vector; an EOI ends
/// the highest vector in service.
pub fn local_apic(data: &[u8]) {
    const ID: u32 = 5;
    let mut apic = LocalApic::new(ID, TIME);
    let mut now = 0u64;
    let mut irr = [0u64; 4];
    let mut in_service: Vec<u8> = Vec::new();
    for op in fuzz_ops(data) {
        let (arg, value) = (op.arg, op.value);
        let x2apic = apic.x2apic();
        let action = match op.kind {
            0 => apic.write(fuzz_msr(arg), value, now).ok(),
            1 => {
                let _ = apic.read(fuzz_msr(arg), &irr, now);
                None
            }
            2 => {
                let mut bytes = vec![0; 1 + usize::from(arg % 8)];
                apic.mmio_read_bytes(value & 0xFFF, &mut bytes, &irr, now);
                None
            }
            3 => {
                let bytes = value.to_le_bytes();
                let offset = fuzz_write_offset(op);
                Some(apic.mmio_write_bytes(offset, &bytes[..1 + usize::from(arg % 8)], now))
            }
            4 => {
                irr[usize::from(arg % 4)] |= value;
                None
            }
            5 => {
                if let Some(v) = apic.deliverable(&irr) {
                    irr[usize::from(v / 64)] &= !(1 << (v % 64));
                    apic.start_service(v);
                    in_service.push(v);
                }
                None
            }
            6 => {
                now = now.saturating_add(value >> 40);
                let _ = apic.timer().expire(now);
                None
            }
            _ => {
                irr = [0; 4];
                None
            }
        };
        check_apic(&mut apic, x2apic, action, &mut in_service, &irr, now);
    }
}

fn check_apic(
    apic: &mut LocalApic,
    was_x2apic: bool,
    action: Option<Action>,
    in_service: &mut Vec<u8>,
    irr: &[u64; 4],
    now: u64,
) {
    assert!(!was_x2apic || apic.x2apic(), "left x2APIC mode");
    match action {
        Some(Action::Ipi { vector, .. }) => assert!(vector >= 16, "IPI with vector {vector}"),
        Some(Action::Eoi) => {
            if let Some(top) = in_service.iter().copied().max() {
                in_service.retain(|&v| v != top);
            }
        }
        _ => {}
    }
    let ppr = apic.ppr();
    let isr_class = in_service.iter().max().map_or(0, |v| v & 0xF0);
    assert!(
        ppr & 0xF0 >= isr_class,
        "PPR {ppr:#x} below ISR {isr_class:#x}"
    );
    if let Some(v) = apic.deliverable(irr) {
        assert!(
            apic.enabled() && v >> 4 > ppr >> 4,
            "{v:#x} over PPR {ppr:#x}"
        );
        assert!(
            irr[usize::from(v / 64)] & 1 << (v % 64) != 0,
            "{v:#x} not pending"
        );
    }
    let (id, tpr, esr) = if apic.x2apic() {
        let read = |msr| apic.read(msr, irr, now).unwrap();
        (read(0x802), read(0x808), read(0x828))
    } else {
        let mut read = |offset| u64::from(apic.mmio_read(offset, irr, now).unwrap());
        (read(0x20) >> 24, read(0x80), read(0x280))
    };
    assert!(
        u64::from(ppr) >= tpr & 0xF0,
        "PPR {ppr:#x} below TPR {tpr:#x}"
    );
    assert_eq!(id, 5, "the APIC ID");
    let known = apic::ESR_SEND_ILLEGAL_VECTOR
        | apic::ESR_RECEIVE_ILLEGAL_VECTOR
        | apic::ESR_ILLEGAL_REGISTER;
    assert_eq!(esr & !u64::from(known), 0, "ESR {esr:#x}");
}

/// Guest memory for the ucall and exit checks: `data` copied in at 0.
fn memory_with(data: &[u8]) -> VmMemory {
    let mem =
        VmMemory::from_ranges(&[(GuestAddress(0), 0x1_0000)]).expect("64 KiB of anonymous memory");
    mem.write_slice(&data[..data.len().min(0x1_0000)], GuestAddress(0))
        .expect("fits");
    mem
}

/// Ucall decoding: the first bytes are the `out`'s data (1-8 bytes), the
/// rest is guest memory. Checks: a decoded string is what the guest has in
/// memory at its address, NUL-terminated within [`MAX_STRING_LEN`] bytes.
pub fn ucall(data: &[u8]) {
    let width = 1 + usize::from(data.first().copied().unwrap_or(0) % 8);
    let out = data.get(1..1 + width).unwrap_or(&[]);
    let mem = memory_with(data.get(9..).unwrap_or(&[]));
    let Ok(call) = ucall::decode(&mem, out) else {
        return;
    };
    assert_eq!(out.len(), 4, "only a 4-byte out decodes");
    let frame: ucall::UcallFrame = mem
        .read_obj(GuestAddress(u64::from(u32::from_le_bytes(
            out.try_into().unwrap(),
        ))))
        .unwrap();
    let text = match call {
        Ucall::Report { name, .. } => name,
        Ucall::AssertFailed { message, .. } => message,
        Ucall::Done | Ucall::Exception { .. } => return,
    };
    assert!(text.len() <= MAX_STRING_LEN);
    let mut in_memory = vec![0; text.len() + 1];
    mem.read_slice(&mut in_memory, GuestAddress(frame.args[0]))
        .unwrap();
    assert_eq!(&in_memory[..text.len()], text.as_bytes());
    assert_eq!(in_memory[text.len()], 0);
}

/// The exit handler with synthetic exits: port I/O of any width to any port
/// (the console, the POST code, ucalls, nothing), MMIO, halts and the exits
/// that end a run, each op repeatable, in a vCPU with devices only. Checks:
/// nothing panics; a guest never
/// keeps more than [`MAX_REPORTS`] reports; an exit at a port with no device
/// is the guest's fault; the devices here never fail.
pub fn exits(data: &[u8]) {
    let mut bus = IoBus::new();
    let console = SerialConsole::new(Box::new(std::io::sink()));
    bus.insert(SERIAL_PORT, 8, Arc::new(console)).unwrap();
    bus.insert(POST_PORT, 1, Arc::new(PostCode::default()))
        .unwrap();
    let (ops, memory) = data.split_at(data.len().min(256));
    let mem = memory_with(memory);
    let mut reports = Vec::new();
    for op in ops.chunks(8) {
        let port = match op[0] % 4 {
            0 => SERIAL_PORT + u16::from(op.get(1).copied().unwrap_or(0) % 8),
            1 => POST_PORT,
            2 => UCALL_PORT,
            _ => u16::from_le_bytes([op.get(1).copied().unwrap_or(0), op[0]]),
        };
        let mut bytes = op.get(2..).unwrap_or(&[]).to_vec();
        bytes.truncate(1 << (op[0] >> 2 & 3)); // 1, 2, 4 or 8 bytes
        let repeat = 1 + usize::from(op[0] >> 4) * 100;
        for _ in 0..repeat {
            let exit = synthetic_exit(op[0] >> 6, port, &mut bytes);
            let mut ctx = Devices {
                bus: &bus,
                memory: &mem,
                reports: &mut reports,
                apic: NoApic,
            };
            let flow = handle_exit(exit, &mut ctx);
            assert!(reports.len() <= MAX_REPORTS);
            match flow {
                Err(ExitError::Device { port, source }) => {
                    panic!("device at {port:#x} failed: {source}")
                }
                Err(ExitError::Guest(GuestFault::UnknownPort { port: p, .. })) => {
                    assert!(bus.find(p).is_none(), "port {p:#x} has a device")
                }
                Err(_) | Ok(_) => {}
            }
        }
    }
}

fn synthetic_exit(kind: u8, port: u16, bytes: &mut [u8]) -> VcpuExit<'_> {
    match kind {
        0 => VcpuExit::IoOut(port, bytes),
        1 => VcpuExit::IoIn(port, bytes),
        2 => VcpuExit::MmioWrite(XAPIC_BASE + u64::from(port), bytes),
        _ => match port % 5 {
            0 => VcpuExit::Hlt,
            1 => VcpuExit::Shutdown,
            2 => VcpuExit::FailEntry(u64::from(port), 0),
            3 => VcpuExit::Intr,
            _ => VcpuExit::MmioRead(u64::from(port), bytes),
        },
    }
}

/// Where the learners' guest memory is.
const MAILBOX: u64 = 0x1000;
const RECORD: u64 = 0x2000;

/// The learners that read guest memory: the guest-poll mailbox ring and the
/// interrupt record, filled with anything between the VMM's looks, with timer
/// firings and injections between. Checks: the delivery lead never passes
/// [`MAX_LEAD`]; the window published in the mailbox is the policy's (at
/// most 1 s).
pub fn learners(data: &[u8]) {
    let mem = memory_with(&[]);
    let mut poll = GuestPoll::new(
        Box::new(halt_poll::KvmGrowShrink::new()),
        MAILBOX,
        TIME.tsc_khz,
    );
    let mut lead = TimerLead::new(TIME, RECORD);
    for FuzzOp { kind, arg, value } in fuzz_ops(data) {
        match kind % 4 {
            // The guest's words: the mailbox past the window the VMM
            // publishes (the count, the ring), and the interrupt record.
            0 => {
                let at = if kind & 4 == 0 { MAILBOX + 8 } else { RECORD };
                let _ = mem.write_obj(value, GuestAddress(at + u64::from(arg % 32) * 8));
            }
            1 => lead.fired(arg, value >> 8, value >> 16),
            2 => lead.injected(arg, &mem),
            _ => {
                poll.learn(&mem);
                let window: u64 = mem.read_obj(GuestAddress(MAILBOX)).unwrap();
                assert!(window <= TIME.tsc_khz * 1000, "window {window} ticks");
            }
        }
        if let Some(l) = lead.learn(&mem, &DeliveryPath::default()) {
            assert!(l <= MAX_LEAD, "lead {l:?}");
        }
        assert!(lead.current() <= MAX_LEAD);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays every input committed under `fuzz-corpus/<target>/`.
    fn replay(target: &str, run: fn(&[u8])) {
        let dir = format!("{}/fuzz-corpus/{target}", env!("CARGO_MANIFEST_DIR"));
        let mut inputs = 0;
        for entry in std::fs::read_dir(&dir).expect("the corpus is committed") {
            run(&std::fs::read(entry.unwrap().path()).unwrap());
            inputs += 1;
        }
        assert!(inputs >= 8, "{dir} has only {inputs} inputs");
    }

    #[test]
    fn replays_the_local_apic_corpus() {
        replay("local_apic", local_apic);
    }

    #[test]
    fn replays_the_ucall_corpus() {
        replay("ucall", ucall);
    }

    #[test]
    fn replays_the_exits_corpus() {
        replay("exits", exits);
    }

    #[test]
    fn replays_the_learners_corpus() {
        replay("learners", learners);
    }
}
