//! The guest programs: readable assembly in this folder, assembled by rustc
//! into one image that a VMM copies into guest memory.
//!
//! `runtime.s` holds what every program shares: the CPL0 exception stubs (the
//! IDT points at them), the CPL3 → CPL0 service call, and a CPL3 library for
//! the serial console and ucalls. Each program is an entry point in the same image,
//! so programs call the library with ordinary relative `call`s. The image is
//! position-independent: it is built into the binary's read-only data and only
//! ever executed by the guest, at [`crate::layout::IMAGE_ADDR`].
//!
//! Every program starts at CPL3 in 64-bit mode with
//! `rdi` = vCPU index, `rsi` = vCPU count, `rdx` = the vCPU's data block, and its
//! own stack; see [`x86::boot`](crate::x86::boot).

use std::fmt;
use std::time::Duration;

use crate::abi::{
    ACPI_S5, ACPI_SHUTDOWN_PORT, COMPLETION_PORT, DEBUG_EXIT_PORT, GATE_PORT, I8042_COMMAND_PORT,
    I8042_RESET, PAUSE_PORT, PIC_MASTER_DATA, PIC_SLAVE_DATA, POST_PORT, SERIAL_PORT, UCALL_PORT,
    YIELD_PORT,
};
use crate::layout::{
    ACKS_OFFSET, APIC_READY_OFFSET, APIC_SCRIPT_ADDR, APIC_SCRIPT_SHIFT, BOOST_REQUESTS_OFFSET,
    BOOT_TABLE_OFFSET, DEVICE_AREA_ADDR, DEVICE_AREA_SIZE, DIRTY_AREA_ADDR, DONE_COUNT_OFFSET,
    EXCEPTION_STACK_GAP, GUEST_LOCK_OFFSET, IDT_OFFSET, IMAGE_ADDR, IRQ_RECORD_SIZE,
    KERNEL_STACK_TOP_OFFSET, MAILBOX_OFFSET, MAILBOX_RING, MAILBOX_SHIFT, MIGRATIONS_OFFSET,
    PAGE_SIZE, PARAMS_OFFSET, PML4_ADDR, SAMPLES_ADDR, SERIAL_LOCK_OFFSET, SHARED_DATA_ADDR,
    TRAMPOLINE_ADDR, UCALL_TRANSPORT_OFFSET, USER_STACK_TOP_OFFSET, VCPU_AREA_BASE, VCPU_AREA_SIZE,
    VCPU_DATA_OFFSET,
};
use crate::ucall;
use crate::x86::idt::IDT_SIZE;
use crate::x86::{apic, boot, gdt};

/// `ud2` service number (in `eax`) that runs CPUID at CPL0, where KVM answers it.
pub const SYS_CPUID: u32 = 1;
/// `ud2` service number (in `eax`) that triple-faults the vCPU.
pub const SYS_SHUTDOWN: u32 = 2;
/// `ud2` service number: halt unless `*rdi >= rsi` (checked with interrupts off).
pub const SYS_HALT: u32 = 3;
/// `ud2` service number: write MSR `edi` with `rsi`.
pub const SYS_WRMSR: u32 = 4;
/// `ud2` service number: read MSR `edi` into `rax`.
pub const SYS_RDMSR: u32 = 5;
/// `ud2` service number: run `rsi` `apic-script` operations from `rdi`.
pub const SYS_APIC_SCRIPT: u32 = 6;
/// Number of exception vectors the runtime has a stub for.
pub const EXCEPTION_VECTORS: u8 = 32;
/// Distance between two exception stubs in the image.
const EXCEPTION_STUB_SIZE: u64 = 16;

core::arch::global_asm!(
    include_str!("runtime.s"),
    include_str!("hello.s"),
    include_str!("faults.s"),
    include_str!("ipi.s"),
    include_str!("timer.s"),
    include_str!("bounds.s"),
    include_str!("migrate.s"),
    include_str!("locks.s"),
    include_str!("apic.s"),
    include_str!("virtio.s"),
    include_str!("pvh.s"),
    ".globl test_guests_image_end",
    "test_guests_image_end:",
    ".popsection",
    ucall_port = const UCALL_PORT,
    ucall_report = const ucall::CMD_REPORT,
    ucall_assert = const ucall::CMD_ASSERT_FAIL,
    ucall_done = const ucall::CMD_DONE,
    ucall_exception = const ucall::CMD_EXCEPTION,
    serial_port = const SERIAL_PORT,
    serial_lock = const SHARED_DATA_ADDR + SERIAL_LOCK_OFFSET,
    sys_cpuid = const SYS_CPUID,
    sys_shutdown = const SYS_SHUTDOWN,
    sys_halt = const SYS_HALT,
    sys_wrmsr = const SYS_WRMSR,
    sys_rdmsr = const SYS_RDMSR,
    sys_apic_script = const SYS_APIC_SCRIPT,
    apic_script_addr = const APIC_SCRIPT_ADDR,
    apic_script_shift = const APIC_SCRIPT_SHIFT,
    apic_script_ops = const crate::apic_script::MAX_OPS,
    op_rdmsr = const crate::apic_script::Kind::ReadMsr as u32,
    op_wrmsr = const crate::apic_script::Kind::WriteMsr as u32,
    op_msr_or = const crate::apic_script::Kind::OrMsr as u32,
    op_mmio_read = const crate::apic_script::Kind::ReadPage as u32,
    op_mmio_write = const crate::apic_script::Kind::WritePage as u32,
    op_delay = const crate::apic_script::Kind::Delay as u32,
    op_barrier = const crate::apic_script::Kind::Barrier as u32,
    op_wrmsr_tsc = const crate::apic_script::Kind::WriteMsrAfterTsc as u32,
    status_done = const crate::apic_script::STATUS_DONE,
    status_faulted = const crate::apic_script::STATUS_FAULTED,
    msr_eoi = const apic::MSR_EOI,
    msr_svr = const apic::MSR_SVR,
    msr_apic_base = const apic::MSR_APIC_BASE,
    xapic_base = const apic::XAPIC_BASE,
    msr_icr = const apic::MSR_ICR,
    msr_esr = const apic::MSR_ESR,
    msr_lvt_timer = const apic::MSR_LVT_TIMER,
    msr_timer_initial = const apic::MSR_TIMER_INITIAL_COUNT,
    msr_timer_divide = const apic::MSR_TIMER_DIVIDE,
    msr_tsc_deadline = const apic::MSR_TSC_DEADLINE,
    irq_record_below_data = const VCPU_DATA_OFFSET - KERNEL_STACK_TOP_OFFSET + IRQ_RECORD_SIZE,
    params = const SHARED_DATA_ADDR + PARAMS_OFFSET,
    samples = const SAMPLES_ADDR,
    acks = const SHARED_DATA_ADDR + ACKS_OFFSET,
    apic_ready = const SHARED_DATA_ADDR + APIC_READY_OFFSET,
    pause_port = const PAUSE_PORT,
    post_port = const POST_PORT,
    gate_port = const GATE_PORT,
    yield_port = const YIELD_PORT,
    mailboxes = const SHARED_DATA_ADDR + MAILBOX_OFFSET,
    vcpu_area_size = const VCPU_AREA_SIZE,
    mailbox_shift = const MAILBOX_SHIFT,
    ring_mask = const MAILBOX_RING - 1,
    dirty_area = const DIRTY_AREA_ADDR,
    ucall_transport = const SHARED_DATA_ADDR + UCALL_TRANSPORT_OFFSET,
    done_count = const SHARED_DATA_ADDR + DONE_COUNT_OFFSET,
    migrations = const SHARED_DATA_ADDR + MIGRATIONS_OFFSET,
    guest_lock = const SHARED_DATA_ADDR + GUEST_LOCK_OFFSET,
    completion_port = const COMPLETION_PORT,
    virtio_area = const DEVICE_AREA_ADDR,
    boost_requests = const SHARED_DATA_ADDR + BOOST_REQUESTS_OFFSET,
    boot_table = const SHARED_DATA_ADDR + BOOT_TABLE_OFFSET,
    boot_vcpus = const SHARED_DATA_ADDR + BOOT_TABLE_OFFSET + 16,
    debug_exit_port = const DEBUG_EXIT_PORT,
    acpi_shutdown_port = const ACPI_SHUTDOWN_PORT,
    acpi_s5 = const ACPI_S5,
    i8042_command_port = const I8042_COMMAND_PORT,
    i8042_reset = const I8042_RESET,
    pic_master_data = const PIC_MASTER_DATA,
    pic_slave_data = const PIC_SLAVE_DATA,
    ucall_probe = const ucall::UCALL_PROBE,
    vcpu_area_base = const VCPU_AREA_BASE,
    image_addr = const IMAGE_ADDR,
    trampoline = const TRAMPOLINE_ADDR,
    cr0 = const boot::CR0,
    cr4 = const boot::CR4,
    pml4 = const PML4_ADDR,
    msr_efer = const MSR_EFER,
    efer_lme = const boot::EFER & !EFER_LMA,
    kernel_cs = const gdt::KERNEL_CS,
    kernel_ds = const gdt::KERNEL_DS,
    user_cs = const gdt::USER_CS,
    user_ds = const gdt::USER_DS,
    tss_base_selector = const gdt::TSS_BASE_SELECTOR,
    idt_limit = const IDT_SIZE - 1,
    idt_offset = const IDT_OFFSET,
    exception_stack = const KERNEL_STACK_TOP_OFFSET - EXCEPTION_STACK_GAP,
    user_stack = const USER_STACK_TOP_OFFSET,
    vcpu_data = const VCPU_DATA_OFFSET,
    rflags = const boot::RFLAGS,
);

/// IA32_EFER, which the PVH start-up sets to enter long mode.
const MSR_EFER: u32 = 0xC000_0080;
/// EFER.LMA: set by the CPU once paging is on, never written.
const EFER_LMA: u64 = 1 << 10;

// SAFETY: these symbols are labels in the read-only image emitted by the
// `global_asm!` above; they are never written, so reading them is always sound.
unsafe extern "C" {
    safe static test_guests_image_start: u8;
    safe static test_guests_image_end: u8;
    safe static test_guests_exception_stubs: u8;
    safe static test_guests_hello: u8;
    safe static test_guests_triple_fault: u8;
    safe static test_guests_bad_port: u8;
    safe static test_guests_bad_ucall: u8;
    safe static test_guests_gp_fault: u8;
    safe static test_guests_assert_fail: u8;
    safe static test_guests_spin: u8;
    safe static test_guests_irq_entry: u8;
    safe static test_guests_xapic_irq_entry: u8;
    safe static test_guests_pingpong: u8;
    safe static test_guests_apic_abuse: u8;
    safe static test_guests_apic_gp: u8;
    safe static test_guests_cyclictest: u8;
    safe static test_guests_timer_spin: u8;
    safe static test_guests_sched_ipi: u8;
    safe static test_guests_lock_holders: u8;
    safe static test_guests_apic_script: u8;
    safe static test_guests_ipi_ring: u8;
    safe static test_guests_port_exits: u8;
    safe static test_guests_dirty_writer: u8;
    safe static test_guests_migrate: u8;
    safe static test_guests_halt_wake: u8;
    safe static test_guests_report_flood: u8;
    safe static test_guests_serial_flood: u8;
    safe static test_guests_periodic_timer: u8;
    safe static test_guests_xapic_bytes: u8;
    safe static test_guests_yield_spin: u8;
    safe static test_guests_virtio_rng: u8;
    safe static test_guests_pvh_entry: u8;
}

/// The whole guest image: runtime and every program.
pub fn image() -> &'static [u8] {
    let start = &raw const test_guests_image_start;
    let len = offset_of(&test_guests_image_end) as usize;
    // SAFETY: start and end label the beginning and end of one contiguous,
    // immutable section emitted by the `global_asm!` above, end after start.
    unsafe { std::slice::from_raw_parts(start, len) }
}

/// Offset of an image label from the start of the image.
fn offset_of(label: &'static u8) -> u64 {
    let start = &raw const test_guests_image_start as usize;
    (label as *const u8 as usize - start) as u64
}

/// Offset in the image of the runtime's entry for external interrupts (32 up
/// to [`XAPIC_VECTORS`], and 0xFF).
pub fn irq_entry_offset() -> u64 {
    offset_of(&test_guests_irq_entry)
}

/// Offset in the [`image`] of the PVH start-up (`pvh.s`), where a VMM that
/// boots an image file enters it.
pub fn pvh_entry_offset() -> u64 {
    offset_of(&test_guests_pvh_entry)
}

/// First vector whose interrupts enter [`xapic_irq_entry_offset`]'s handler.
pub const XAPIC_VECTORS: u8 = 0xF0;

/// Offset in the [`image`] of the interrupt entry for vectors
/// [`XAPIC_VECTORS`]-0xFE, which EOIs through the xAPIC page.
pub fn xapic_irq_entry_offset() -> u64 {
    offset_of(&test_guests_xapic_irq_entry)
}

/// Offset in the image of the runtime's stub for exception `vector` (< 32).
pub fn exception_stub_offset(vector: u8) -> u64 {
    debug_assert!(vector < EXCEPTION_VECTORS);
    offset_of(&test_guests_exception_stubs) + u64::from(vector) * EXCEPTION_STUB_SIZE
}

/// A program that cannot run as asked.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProgramError {
    /// A parameter below what the program needs.
    #[error("guest program {guest} needs params[{index}] ({name}) of at least {min}, not {got}")]
    Param {
        /// The program.
        guest: &'static str,
        /// Which parameter.
        index: usize,
        /// What it means.
        name: &'static str,
        /// The smallest value it takes.
        min: u64,
        /// The value given.
        got: u64,
    },
    /// Fewer vCPUs than the program works on.
    #[error("guest program {guest} needs at least {min} vCPUs, not {got}")]
    TooFewVcpus {
        /// The program.
        guest: &'static str,
        /// The fewest it runs on.
        min: u32,
        /// The number given.
        got: u32,
    },
    /// Parameters that ask for more memory than the VM has.
    #[error(
        "guest program {guest} needs {needs_mib} MiB of guest memory for its parameters, not \
         {got_mib}"
    )]
    TooLittleMemory {
        /// The program.
        guest: &'static str,
        /// The memory it needs, MiB (even).
        needs_mib: u64,
        /// The memory given, MiB.
        got_mib: u64,
    },
    /// Parameters that make the program wait for a migration, run without one.
    #[error(
        "guest program {guest}'s parameters make it wait for a migration to end: give it one, \
         or set that parameter to 0"
    )]
    NeedsMigration {
        /// The program.
        guest: &'static str,
    },
    /// A program that never finishes, run without a timeout.
    #[error("guest program {guest} runs until it is stopped: give it a timeout")]
    NeedsTimeout {
        /// The program.
        guest: &'static str,
    },
    /// No built-in program has this name.
    #[error("no guest program is called {name:?}; the built-in ones are: {known}")]
    Unknown {
        /// The name given.
        name: String,
        /// The names there are, comma-separated.
        known: String,
    },
}

/// A built-in guest program.
#[derive(Clone, Copy)]
pub struct GuestProgram {
    /// Its name.
    pub name: &'static str,
    /// One line on what it does.
    pub about: &'static str,
    /// Its parameters, in order (`params[0]` first).
    pub params: &'static [Param],
    /// Whether it only ends when the VMM stops it (after a timeout).
    pub until_stopped: bool,
    /// The fewest vCPUs it runs on (pingpong bounces between vCPUs 0 and 1).
    pub min_vcpus: u32,
    /// The guest memory its parameters ask for, past the fixed layout.
    pub data: DataArea,
    entry: &'static u8,
}

/// The guest memory a program's parameters ask for, past the fixed layout
/// ([`crate::layout`]): a program given more than the VM has would fault
/// on its first access past the end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataArea {
    /// None.
    None,
    /// `params[0]` samples of 8 bytes at [`SAMPLES_ADDR`].
    Samples,
    /// A `1 << APIC_SCRIPT_SHIFT`-byte area per vCPU from
    /// [`APIC_SCRIPT_ADDR`].
    ApicScripts,
    /// A device driver's page tables, queue and buffer:
    /// [`DEVICE_AREA_SIZE`] bytes from [`DEVICE_AREA_ADDR`].
    Device,
    /// `params[0]` pages per vCPU from [`DIRTY_AREA_ADDR`], `bytes_each`
    /// bytes for each (the page, and whatever the program keeps per page).
    Pages {
        /// Bytes per page.
        bytes_each: u64,
    },
}

impl DataArea {
    /// The first guest address past what the program touches with
    /// `params[0] = count` on `vcpus` vCPUs (saturating: a count too large
    /// for any memory is still too large).
    pub fn end(self, count: u64, vcpus: u32) -> u64 {
        match self {
            Self::None => 0,
            Self::Samples => count.saturating_mul(8).saturating_add(SAMPLES_ADDR),
            Self::ApicScripts => crate::layout::apic_script(vcpus),
            Self::Device => DEVICE_AREA_ADDR + DEVICE_AREA_SIZE,
            Self::Pages { bytes_each } => count
                .saturating_mul(bytes_each)
                .saturating_mul(u64::from(vcpus))
                .saturating_add(DIRTY_AREA_ADDR),
        }
    }
}

/// One parameter of a guest program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    /// What it means.
    pub name: &'static str,
    /// The smallest value the program works with.
    pub min: u64,
    /// Whether a value other than 0 makes the program wait for a migration
    /// to end (the VMM's migration count) before it can finish.
    pub waits_for_migration: bool,
}

impl GuestProgram {
    /// Offset of the program's entry point in the [`image`].
    pub fn entry_offset(&self) -> u64 {
        offset_of(self.entry)
    }

    /// Whether the program can run with `params` and `timeout`: every
    /// parameter at least its minimum (a program asked for 0 rounds would
    /// measure nothing and say nothing), and a timeout for one that never
    /// finishes.
    pub fn check(&self, params: &[u64], timeout: Option<Duration>) -> Result<(), ProgramError> {
        if self.until_stopped && timeout.is_none() {
            return Err(ProgramError::NeedsTimeout { guest: self.name });
        }
        self.check_params(params)
    }

    /// Whether it can run on `vcpus` vCPUs and `mem_mib` MiB with `params`:
    /// enough vCPUs for what it does, and memory for what its parameters
    /// ask. Refused before any vCPU starts, where it would otherwise hang
    /// or fault.
    pub fn check_machine(
        &self,
        params: &[u64],
        vcpus: u32,
        mem_mib: u64,
    ) -> Result<(), ProgramError> {
        if vcpus < self.min_vcpus {
            return Err(ProgramError::TooFewVcpus {
                guest: self.name,
                min: self.min_vcpus,
                got: vcpus,
            });
        }
        let end = self.data.end(params.first().copied().unwrap_or(0), vcpus);
        if end > mem_mib.saturating_mul(1 << 20) {
            // Guest memory comes in even MiB.
            let needs_mib = end.div_ceil(2 << 20).saturating_mul(2);
            return Err(ProgramError::TooLittleMemory {
                guest: self.name,
                needs_mib,
                got_mib: mem_mib,
            });
        }
        Ok(())
    }

    /// Every check before a run on `vcpus` vCPUs and `mem_mib` MiB:
    /// [`check`](Self::check), [`check_machine`](Self::check_machine), and
    /// that a program told to wait for a migration is `migrating`.
    pub fn check_run(
        &self,
        params: &[u64],
        vcpus: u32,
        mem_mib: u64,
        timeout: Option<Duration>,
        migrating: bool,
    ) -> Result<(), ProgramError> {
        self.check(params, timeout)?;
        self.check_machine(params, vcpus, mem_mib)?;
        match self.waits_for_migration(params) && !migrating {
            true => Err(ProgramError::NeedsMigration { guest: self.name }),
            false => Ok(()),
        }
    }

    /// Whether `params` make the program wait for a migration to end: run
    /// without one, it would never finish.
    pub fn waits_for_migration(&self, params: &[u64]) -> bool {
        self.params
            .iter()
            .zip(params)
            .any(|(p, &value)| p.waits_for_migration && value != 0)
    }

    /// Whether every parameter is at least its minimum.
    pub fn check_params(&self, params: &[u64]) -> Result<(), ProgramError> {
        for (index, p) in self.params.iter().enumerate() {
            let got = params.get(index).copied().unwrap_or(0);
            if got < p.min {
                return Err(ProgramError::Param {
                    guest: self.name,
                    index,
                    name: p.name,
                    min: p.min,
                    got,
                });
            }
        }
        Ok(())
    }
}

/// A count of at least one.
const fn count(name: &'static str) -> Param {
    Param {
        name,
        min: 1,
        waits_for_migration: false,
    }
}

/// Any value, 0 included.
const fn any(name: &'static str) -> Param {
    Param {
        name,
        min: 0,
        waits_for_migration: false,
    }
}

/// 1: the program waits for a migration to end before it can finish.
const fn migration_wait(name: &'static str) -> Param {
    Param {
        name,
        min: 0,
        waits_for_migration: true,
    }
}

impl fmt::Debug for GuestProgram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuestProgram")
            .field("name", &self.name)
            .field("entry_offset", &self.entry_offset())
            .finish()
    }
}

/// Every built-in guest program.
pub static PROGRAMS: &[GuestProgram] = &[
    GuestProgram {
        name: "hello",
        about: "each vCPU prints its id on serial, reports its APIC id and a TSC reading",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_hello,
    },
    GuestProgram {
        name: "spin",
        about: "each vCPU spins in guest mode until stopped (use with --timeout-ms)",
        params: &[],
        until_stopped: true,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_spin,
    },
    GuestProgram {
        name: "triple-fault",
        about: "loads an empty IDT and faults: the vCPU shuts down",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_triple_fault,
    },
    GuestProgram {
        name: "bad-port",
        about: "vCPU 0 writes to port 0x1234, where no device lives; the others spin",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_bad_port,
    },
    GuestProgram {
        name: "bad-ucall",
        about: "sends a ucall with an unknown command",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_bad_ucall,
    },
    GuestProgram {
        name: "gp-fault",
        about: "executes hlt at CPL3, which raises #GP",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_gp_fault,
    },
    GuestProgram {
        name: "pingpong",
        about: "vCPUs 0 and 1 bounce a message params[0] times (params[1] = 1: poll a mailbox first); vCPU 0 idles params[2] TSC ticks before every params[3]-th (params[4] = 1: one in params[3] at random); params[5] = 1: through the xAPIC page; params[6] = 1: spin, not halt",
        params: &[
            count("rounds"),
            any("1: poll the mailbox first"),
            any("gap, TSC ticks"),
            any("a gap every n round trips, 0: none"),
            any("1: gaps at random, one in n"),
            any("1: the xAPIC page, vector 0xF0 (no gaps)"),
            any("1: spin for the IPI instead of halting"),
        ],
        until_stopped: false,
        min_vcpus: 2,
        data: DataArea::None,
        entry: &test_guests_pingpong,
    },
    GuestProgram {
        name: "apic-abuse",
        about: "programs absurd local-APIC values (illegal vector, missing vCPU, past deadline)",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_apic_abuse,
    },
    GuestProgram {
        name: "apic-gp",
        about: "writes a non-zero value to the x2APIC EOI register, which raises #GP",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_apic_gp,
    },
    GuestProgram {
        name: "cyclictest",
        about: "vCPU 0 arms params[0] TSC deadlines params[1] ticks apart and records each lateness (params[2] = 1: reports each too)",
        params: &[
            count("timers"),
            any("period, TSC ticks"),
            any("1: report each lateness"),
        ],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::Samples,
        entry: &test_guests_cyclictest,
    },
    GuestProgram {
        name: "timer-spin",
        about: "every vCPU arms params[0] TSC deadlines, each params[1] ticks (plus jitter) ahead, and spins without exits until each fires",
        params: &[count("deadlines"), any("distance, TSC ticks")],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_timer_spin,
    },
    GuestProgram {
        name: "sched-ipi",
        about: "vCPU 0 IPIs all others params[0] times, spinning (with pause exits) for their acks (params[2] = 1: through the xAPIC page)",
        params: &[
            count("rounds"),
            any("pauses per pause exit, 0: none"),
            any("1: through the xAPIC page"),
        ],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_sched_ipi,
    },
    GuestProgram {
        name: "lock-holders",
        about: "every vCPU takes a shared spinlock params[0] times, holding it params[1] pauses and working params[2] outside it (params[3] = 1: marking its boost-request word while it holds it; params[4] = 1: then an I/O to the completion device, halting until it completes; 2: an I/O in flight during each round, spinning after it until it completes; KVM's irqchip only)",
        params: &[
            count("rounds"),
            any("pauses holding the lock"),
            any("pauses outside it"),
            any("1: request a boost while holding it"),
            any("1: an I/O after each round, 2: one during it"),
        ],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_lock_holders,
    },
    GuestProgram {
        name: "apic-script",
        about: "every vCPU runs the params[0] local-APIC operations the VMM wrote for it (test_guests::apic_script) at CPL0 with interrupts off, recording what each read back and whether it faulted",
        params: &[count("operations per vCPU")],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::ApicScripts,
        entry: &test_guests_apic_script,
    },
    GuestProgram {
        name: "ipi-ring",
        about: "each vCPU IPIs the next params[0] times, one pending at a time (params[1]: pauses per pause exit; params[2] = 1: through the xAPIC page)",
        params: &[
            count("rounds"),
            any("pauses per pause exit, 0: none"),
            any("1: through the xAPIC page"),
        ],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_ipi_ring,
    },
    GuestProgram {
        name: "port-exits",
        about: "every vCPU writes params[0] times to the POST-code port, params[1] pauses apart",
        params: &[count("writes"), count("pauses between writes")],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_port_exits,
    },
    GuestProgram {
        name: "dirty-writer",
        about: "each vCPU writes its params[0] pages once per pass, params[1] passes, waiting at a gate port",
        params: &[count("pages per vCPU"), count("passes")],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::Pages {
            bytes_each: PAGE_SIZE,
        },
        entry: &test_guests_dirty_writer,
    },
    GuestProgram {
        name: "migrate",
        about: "for params[1] TSC ticks (params[4] = 1: from when a migration ended) each vCPU rewrites its params[0] pages in turn, params[2] ticks apart, keeping per-page generations (with params[5] = w > 0, vCPUs from w on only compute in registers, counting passes; with params[6] = s > 0, each stall over s ticks is reported as it ends); vCPU 0 runs a params[3]-tick timer, each vCPU IPIs the next; at the end every page, timer and IPI is checked (for migration)",
        params: &[
            count("pages per vCPU"),
            count("run time, ticks"),
            any("ticks between writes"),
            any("timer period, ticks"),
            migration_wait("1: the run time counts from when a migration ended"),
            any("vCPUs that write (0: all); the others only compute"),
            any("report each stall longer than this many ticks (0: none), 256 at most"),
        ],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::Pages {
            bytes_each: PAGE_SIZE + 8,
        },
        entry: &test_guests_migrate,
    },
    GuestProgram {
        name: "halt-wake",
        about: "vCPU 0 halts until the last vCPU, after params[0] TSC ticks of spinning (params[1] = 1: from when a migration ended), sends it an IPI (for migrating a halted vCPU)",
        params: &[
            count("ticks before the IPI"),
            migration_wait("1: they count from when a migration ended"),
        ],
        until_stopped: false,
        min_vcpus: 2,
        data: DataArea::None,
        entry: &test_guests_halt_wake,
    },
    GuestProgram {
        name: "report-flood",
        about: "every vCPU reports a value for ever (the VMM caps reports per vCPU)",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_report_flood,
    },
    GuestProgram {
        name: "serial-flood",
        about: "every vCPU writes to the serial port until stopped (use with --timeout-ms)",
        params: &[],
        until_stopped: true,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_serial_flood,
    },
    GuestProgram {
        name: "periodic-timer",
        about: "vCPU 0 runs a periodic LAPIC timer of params[0] ns for params[1] interrupts (params[2] = 1: masked, params[1] port exits instead)",
        params: &[
            count("initial count, ns"),
            count("interrupts or exits"),
            any("1: masked"),
        ],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_periodic_timer,
    },
    GuestProgram {
        name: "xapic-bytes",
        about: "vCPU 0 accesses its xAPIC page with 1-, 2- and 8-byte loads and stores",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_xapic_bytes,
    },
    GuestProgram {
        name: "yield-spin",
        about: "vCPU 0 yields to vCPU 1 params[0] times (the PV yield port), params[1] pauses apart; the others spin without exits until it is done",
        params: &[count("yields"), count("pauses between yields")],
        until_stopped: false,
        min_vcpus: 2,
        data: DataArea::None,
        entry: &test_guests_yield_spin,
    },
    GuestProgram {
        name: "virtio-rng",
        about: "vCPU 0 drives the VMM's virtio entropy device (modern virtio-pci on bus 0, as Cloud Hypervisor always has and QEMU's virtio-rng-pci; not this workspace's VMM), its queue's MSI-X interrupt routed to itself: params[0] requests of 64 bytes, one at a time, each from its notify to the interrupt (params[1] = 1: spinning for it, 0: halting)",
        params: &[count("requests"), any("1: spin for the interrupt, 0: halt")],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::Device,
        entry: &test_guests_virtio_rng,
    },
    GuestProgram {
        name: "assert-fail",
        about: "fails a guest assertion (1 == 2)",
        params: &[],
        until_stopped: false,
        min_vcpus: 1,
        data: DataArea::None,
        entry: &test_guests_assert_fail,
    },
];

/// The built-in program called `name`.
pub fn find(name: &str) -> Option<&'static GuestProgram> {
    PROGRAMS.iter().find(|p| p.name == name)
}

/// The built-in program called `name`, or an error that lists them all.
pub fn named(name: &str) -> Result<&'static GuestProgram, ProgramError> {
    find(name).ok_or_else(|| ProgramError::Unknown {
        name: name.to_owned(),
        known: PROGRAMS
            .iter()
            .map(|p| p.name)
            .collect::<Vec<_>>()
            .join(", "),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::IMAGE_MAX_SIZE;

    #[test]
    fn unknown_names_list_the_programs_and_debug_names_the_program() {
        let err = named("nope").unwrap_err().to_string();
        assert!(
            err.starts_with("no guest program is called \"nope\"; the built-in ones are: hello"),
            "{err}"
        );
        assert_eq!(named("hello").unwrap().name, "hello");
        let debug = format!("{:?}", find("hello").unwrap());
        assert!(
            debug.starts_with("GuestProgram { name: \"hello\", entry_offset: "),
            "{debug}"
        );
    }

    #[test]
    fn image_fits_and_every_entry_is_inside_it() {
        let len = image().len() as u64;
        assert!(len > 0 && len <= IMAGE_MAX_SIZE);
        for p in PROGRAMS {
            assert!(p.entry_offset() < len, "{}", p.name);
        }
    }

    #[test]
    fn exception_stubs_are_16_bytes_apart_and_start_with_a_push_or_jmp() {
        let image = image();
        for v in 0..EXCEPTION_VECTORS {
            let at = exception_stub_offset(v) as usize;
            assert_eq!(at % 16, 0);
            // push imm8 (0x6a) for every vector but #UD, which jumps (0xe9 / 0xeb).
            let expected: &[u8] = if v == 6 { &[0xe9, 0xeb] } else { &[0x6a] };
            assert!(
                expected.contains(&image[at]),
                "vector {v}: {:#x}",
                image[at]
            );
        }
    }

    #[test]
    fn parameters_below_their_minimum_and_endless_runs_without_a_timeout_are_refused() {
        let pingpong = find("pingpong").unwrap();
        assert_eq!(
            pingpong.check(&[0, 0], None),
            Err(ProgramError::Param {
                guest: "pingpong",
                index: 0,
                name: "rounds",
                min: 1,
                got: 0
            })
        );
        assert_eq!(pingpong.check(&[5, 0], None), Ok(()));
        assert_eq!(
            pingpong.check(&[], None).map_err(|e| e.to_string()),
            Err("guest program pingpong needs params[0] (rounds) of at least 1, not 0".into())
        );
        let spin = find("spin").unwrap();
        assert_eq!(
            spin.check(&[], None),
            Err(ProgramError::NeedsTimeout { guest: "spin" })
        );
        assert_eq!(spin.check(&[], Some(Duration::from_millis(1))), Ok(()));
        assert_eq!(find("hello").unwrap().check(&[], None), Ok(()));
    }

    #[test]
    fn too_few_vcpus_and_memory_short_of_the_parameters_are_refused() {
        let pingpong = find("pingpong").unwrap();
        assert_eq!(
            pingpong.check_machine(&[1], 1, 64),
            Err(ProgramError::TooFewVcpus {
                guest: "pingpong",
                min: 2,
                got: 1
            })
        );
        assert_eq!(pingpong.check_machine(&[1], 2, 64), Ok(()));
        let migrate = find("migrate").unwrap();
        // 32 MiB of layout, then 4104 bytes a page for each vCPU's pages.
        let fits = (32 << 20) / 4104 / 2;
        assert_eq!(migrate.check_machine(&[fits], 2, 64), Ok(()));
        assert_eq!(
            migrate.check_machine(&[fits + 1], 2, 64),
            Err(ProgramError::TooLittleMemory {
                guest: "migrate",
                needs_mib: 66,
                got_mib: 64
            })
        );
        // A count no memory holds saturates instead of wrapping to a fit.
        assert!(migrate.check_machine(&[u64::MAX / 4096], 64, 3072).is_err());
        assert!(
            find("cyclictest")
                .unwrap()
                .check_machine(&[u64::MAX], 1, 3072)
                .is_err()
        );
        assert_eq!(
            find("hello").unwrap().check_machine(&[u64::MAX], 1, 32),
            Ok(())
        );
    }

    #[test]
    fn only_a_nonzero_wait_parameter_waits_for_a_migration() {
        let migrate = find("migrate").unwrap();
        assert!(!migrate.waits_for_migration(&[1, 1, 0, 0, 0]));
        assert!(migrate.waits_for_migration(&[1, 1, 0, 0, 1]));
        assert!(find("halt-wake").unwrap().waits_for_migration(&[1, 1]));
        assert!(!find("pingpong").unwrap().waits_for_migration(&[1; 7]));
    }

    #[test]
    fn names_are_unique_and_found() {
        for p in PROGRAMS {
            assert_eq!(find(p.name).unwrap().entry_offset(), p.entry_offset());
        }
        assert!(find("no-such-guest").is_none());
    }
}
