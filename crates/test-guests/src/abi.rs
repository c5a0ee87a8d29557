//! The guests' ABI: the ports and shared-page channels between the built-in
//! programs and the VMM that runs them. Only ucalls and the serial console
//! are needed to run a program; the other channels serve programs that
//! measure a VMM's mechanisms, and a VMM that does not implement them runs
//! the programs that use none.
//!
//! | channel | where | the guest | the VMM |
//! |---|---|---|---|
//! | ucall | `out` of a frame's address to [`UCALL_PORT`]; frame: `cmd`, 4 args (u64s) | reports values, asserts, finishes | decodes it ([`crate::ucall`]), checking every address |
//! | serial console | a 16550 at [`SERIAL_PORT`] (COM1) | writes text | prints it |
//! | POST code | `out` to [`POST_PORT`] | `port-exits` writes it back to back | counts the exits |
//! | pause port | `out` to [`PAUSE_PORT`], any width | spins waiting for other vCPUs | hears a pause-loop exit |
//! | gate port | `out` to [`GATE_PORT`] | `dirty-writer` ends a pass | holds the vCPU until the next pass |
//! | yield port | `out` of a vCPU index to [`YIELD_PORT`] | asks to yield to that vCPU (`KVM_HC_SCHED_YIELD`) | yields to it |
//! | interrupt record | [`IRQ_RECORD_SIZE`](crate::layout::IRQ_RECORD_SIZE) bytes at [`irq_record`](crate::layout::irq_record)`(vcpu)` | its interrupt entry writes the TSC it ran at and a count | learns how long delivery takes |
//! | migration count | a u64 at [`MIGRATIONS_OFFSET`] in the shared page | `migrate` and `halt-wake` can wait for it to change, so that a move never races a fixed run time | adds one where the guest runs on after a migration ([`note_migration_ended`]) |
//! | mailbox | 256 bytes at [`mailbox`](crate::layout::mailbox)`(vcpu)`: +0 the window in TSC ticks, +8 state, +16 count, +32 a ring of outcomes | polls for the window before it halts; writes each wait's outcome | learns from the outcomes and writes the next window |
//! | debug exit | `out` to [`DEBUG_EXIT_PORT`] (QEMU's `isa-debug-exit`), then [`ACPI_S5`] to [`ACPI_SHUTDOWN_PORT`] (Cloud Hypervisor's), then [`I8042_RESET`] to [`I8042_COMMAND_PORT`] (Firecracker's) | ends the run under a VMM without the ucall port, whichever it is | |
//! | legacy PIC | [`PIC_MASTER_DATA`], [`PIC_SLAVE_DATA`] | masks every line at its start, without the ucall port, as a kernel does: a legacy interrupt (Firecracker's on restore) never reaches an exception vector | |

use vm_memory::{Bytes, GuestAddress, GuestMemory};

use crate::layout::{MIGRATIONS_OFFSET, SHARED_DATA_ADDR};
pub use crate::ucall::UCALL_PORT;

/// Port of the 16550 serial console (COM1).
pub const SERIAL_PORT: u16 = 0x3f8;
/// The POST-code port: one byte, written back to back by `port-exits`.
pub const POST_PORT: u16 = 0x80;
/// Port the guests write to while they spin waiting for other vCPUs, where
/// hardware would take a pause-loop exit.
pub const PAUSE_PORT: u16 = 0x1001;
/// Port `dirty-writer` writes to at the end of each pass over its pages; the
/// VMM holds the vCPU there until the next pass.
pub const GATE_PORT: u16 = 0x1002;
/// Port the guests write a vCPU index to, to yield to that vCPU, as Linux's
/// `KVM_HC_SCHED_YIELD` hypercall does.
pub const YIELD_PORT: u16 = 0x1003;
/// Port a guest writes its vCPU index to (4 bytes) to submit an "I/O" to
/// the VMM's completion device on KVM's irqchip: an ioeventfd per vCPU
/// (matching the index) takes it without an exit, and the device completes
/// it with an interrupt of vector [`COMPLETION_VECTOR`] to the submitter.
pub const COMPLETION_PORT: u16 = 0x1004;
/// The vector of the completion device's interrupts.
pub const COMPLETION_VECTOR: u8 = 0x42;
/// The port of QEMU's `isa-debug-exit` device (`-device
/// isa-debug-exit,iobase=0xf4,iosize=4`): a write of `v` ends QEMU with
/// status `2 * v + 1`.
pub const DEBUG_EXIT_PORT: u16 = 0xf4;
/// Cloud Hypervisor's ACPI shutdown device (x86): a write of [`ACPI_S5`]
/// ends the VM.
pub const ACPI_SHUTDOWN_PORT: u16 = 0x600;
/// Sleep state S5 (soft off) with its enable bit, as Cloud Hypervisor's
/// DSDT gives it: `5 << 2 | 1 << 5`.
pub const ACPI_S5: u8 = 0x34;
/// The i8042 keyboard controller's command port.
pub const I8042_COMMAND_PORT: u16 = 0x64;
/// The i8042 command that pulses the CPU reset line: Firecracker stops its
/// VM on it.
pub const I8042_RESET: u8 = 0xfe;
/// The master 8259 PIC's data port: a write there sets its interrupt mask.
pub const PIC_MASTER_DATA: u16 = 0x21;
/// The slave 8259 PIC's data port.
pub const PIC_SLAVE_DATA: u16 = 0xa1;

/// Adds one to the guest's migration count: call it where the guest runs on
/// after a migration or snapshot (at the destination before its vCPUs
/// start, at the source when the move failed).
pub fn note_migration_ended<M: GuestMemory>(memory: &M) -> Result<(), vm_memory::GuestMemoryError> {
    let at = GuestAddress(SHARED_DATA_ADDR + MIGRATIONS_OFFSET);
    let count: u64 = memory.read_obj(at)?;
    memory.write_obj(count.wrapping_add(1), at)
}
