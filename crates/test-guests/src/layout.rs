//! Where everything lives in guest physical memory.
//!
//! Guest physical addresses are identity-mapped to guest virtual addresses, so
//! every address here is both. Everything the VMM builds (descriptor tables,
//! page tables, the guest image, per-vCPU stacks) lives from 1 MiB to 16 MiB,
//! above what firmware uses when another VMM boots the image file
//! ([`crate::pvh`]); guest programs own the memory from [`FREE_MEMORY_START`]
//! to the end.
//!
//! ```text
//! 0x0000_8000  the AP start-up trampoline, copied here only under other VMMs
//! 0x0010_0000  guest image: runtime (CPL0 stubs, CPL3 library) and programs
//! 0x001F_0000  GDT (shared): fixed segments, then one 16-byte TSS descriptor per vCPU
//! 0x001F_1000  PML4, +0x1000 PDPT, +0x2000.. one page directory per GiB (2 MiB pages)
//! 0x0020_0000  per-vCPU areas, VCPU_AREA_SIZE each:
//!                +0x0_0000 TSS with an all-zero I/O permission bitmap
//!                +0x0_3000 IDT
//!                +0x0_4000 kernel stacks: RSP0 (exceptions, service calls)
//!                          tops at +0x0_7000; IST1 (interrupts) at +0x0_7fc0,
//!                          right below the interrupt record (+0x0_7fc0..+0x0_8000)
//!                +0x0_8000 user stack, top at +0x1_8000
//!                +0x1_8000 per-vCPU data (guest program scratch)
//! 0x0100_0000  shared data page (serial lock, program mailboxes)
//! 0x0110_0000  free memory for guest programs, up to the end of RAM
//! ```
//!
//! The guest's ucall frames live on its stacks, so everything a ucall can
//! point at is below 4 GiB and fits the 32-bit value of an `out` instruction.

/// Size of a small page.
pub const PAGE_SIZE: u64 = 0x1000;
/// Size of the large pages the identity map is built from.
pub const LARGE_PAGE_SIZE: u64 = 0x20_0000;

/// Guest physical address of the global descriptor table.
pub const GDT_ADDR: u64 = 0x1F_0000;
/// Guest physical address of the top-level page table.
pub const PML4_ADDR: u64 = GDT_ADDR + PAGE_SIZE;
/// Guest physical address of the page-directory-pointer table.
pub const PDPT_ADDR: u64 = PML4_ADDR + PAGE_SIZE;
/// Guest physical address of the first page directory (one per GiB follows).
pub const PD_ADDR: u64 = PDPT_ADDR + PAGE_SIZE;
/// Guest physical address of the page directory that maps the xAPIC page
/// (after the three that RAM can need).
pub const APIC_PD_ADDR: u64 = PD_ADDR + 3 * PAGE_SIZE;

/// Where the boot vCPU of an image booted by another VMM copies the
/// real-mode trampoline that the other vCPUs start at (`programs/pvh.s`): a
/// page below 1 MiB, whose number is the start-up IPI's vector.
pub const TRAMPOLINE_ADDR: u64 = 0x8000;

/// Guest physical address the guest image is loaded at.
pub const IMAGE_ADDR: u64 = 0x10_0000;
/// Largest guest image that fits below the GDT.
pub const IMAGE_MAX_SIZE: u64 = GDT_ADDR - IMAGE_ADDR;

/// Guest physical address of vCPU 0's area.
pub const VCPU_AREA_BASE: u64 = 0x20_0000;
/// Size of one vCPU's area.
pub const VCPU_AREA_SIZE: u64 = 0x2_0000;
/// Offset of the task-state segment in a vCPU area.
pub const TSS_OFFSET: u64 = 0;
/// Offset of the interrupt descriptor table in a vCPU area.
pub const IDT_OFFSET: u64 = 0x3000;
/// Offset of the top of the kernel (CPL0) stack in a vCPU area.
pub const KERNEL_STACK_TOP_OFFSET: u64 = 0x8000;
/// Bytes of the per-vCPU interrupt record, at the top of the kernel stack
/// area: the guest's interrupt entry stores the TSC of the last interrupt at
/// +0 and counts interrupts at +8 (see `programs/runtime.s`).
pub const IRQ_RECORD_SIZE: u64 = 64;
/// How far below the interrupt stack the exception stack (RSP0) starts.
pub const EXCEPTION_STACK_GAP: u64 = 0x1000;

/// Offset of the top of the user (CPL3) stack in a vCPU area.
pub const USER_STACK_TOP_OFFSET: u64 = 0x1_8000;
/// Offset of the per-vCPU data block in a vCPU area.
pub const VCPU_DATA_OFFSET: u64 = 0x1_8000;

/// Most vCPUs the layout has room for.
pub const MAX_VCPUS: u32 = 64;

/// Guest physical address of the page shared by all vCPUs.
pub const SHARED_DATA_ADDR: u64 = 0x100_0000;
/// Offset of the serial-console spinlock in the shared page.
pub const SERIAL_LOCK_OFFSET: u64 = 0;
/// Offset of the program parameters in the shared page: [`PARAMS`] u64s that
/// the VMM writes before the run (rounds, periods, ...).
pub const PARAMS_OFFSET: u64 = 0x100;
/// Number of program parameters.
pub const PARAMS: usize = 16;
/// Offset of a counter of acknowledgements in the shared page, on a cache
/// line of its own.
pub const ACKS_OFFSET: u64 = 0x200;
/// Offset of the count of vCPUs whose local APIC is enabled, in the shared
/// page, on a cache line of its own (the guests' start-up barrier).
pub const APIC_READY_OFFSET: u64 = 0x240;
/// Offset of the PVH boot table in the shared page, which an image file
/// carries for its start-up (`programs/pvh.s`, [`crate::pvh::BootTable`]).
pub const BOOT_TABLE_OFFSET: u64 = 0x280;
/// Offset of the ucall transport in the shared page: 0, the ucall port (this
/// VMM, the default); 1, text lines on the serial console, for a VMM without
/// the port. The PVH start-up probes the port and sets it.
pub const UCALL_TRANSPORT_OFFSET: u64 = 0x2c0;
/// Offset of the count of vCPUs that have finished, under the text
/// transport (the last one ends the run), on a cache line of its own.
pub const DONE_COUNT_OFFSET: u64 = 0x300;
/// Offset of the count of migrations that ended, in the shared page, on a
/// cache line of its own: the VMM adds one where the guest runs on after a
/// migration or snapshot (at the destination before its vCPUs start, at the
/// source when the move failed), so that a guest can wait for the move
/// instead of racing it (see [`crate::abi`]).
pub const MIGRATIONS_OFFSET: u64 = 0x340;
/// Offset of the spinlock the `lock-holders` program contends, on a cache
/// line of its own.
pub const GUEST_LOCK_OFFSET: u64 = 0x380;
/// Offset of the per-vCPU boost-request words (8 bytes each, up to
/// [`MAX_VCPUS`]; vcpu-sched's `BoostRequest` layout: bits 31:0 a sequence
/// the guest bumps on each critical section, bit 32 set while in one), which
/// a VMM that grants guest-requested boosts reads.
pub const BOOST_REQUESTS_OFFSET: u64 = 0x400;
/// Offset of the per-vCPU mailboxes (guest-side polling) in the shared area:
/// `1 << MAILBOX_SHIFT` bytes each. +0: the poll window in TSC ticks (the
/// VMM writes it); +8: 0 idle, 1 polling, 2 a message was posted; +16: the
/// outcome count; +32: a ring of [`MAILBOX_RING`] outcomes, 16 bytes each
/// (ticks polled; ticks waited, bit 63 set if it then halted).
pub const MAILBOX_OFFSET: u64 = 0x1000;
/// log2 of a mailbox's size.
pub const MAILBOX_SHIFT: u64 = 8;
/// Outcomes a mailbox's ring holds.
pub const MAILBOX_RING: u64 = 8;

/// Guest physical address of vCPU `index`'s boost-request word.
pub const fn boost_request(index: u32) -> u64 {
    SHARED_DATA_ADDR + BOOST_REQUESTS_OFFSET + 8 * index as u64
}

/// Guest physical address of vCPU `index`'s mailbox.
pub const fn mailbox(index: u32) -> u64 {
    SHARED_DATA_ADDR + MAILBOX_OFFSET + ((index as u64) << MAILBOX_SHIFT)
}
/// First guest physical address that guest programs may use freely.
pub const FREE_MEMORY_START: u64 = 0x110_0000;
/// Where measuring programs store their samples (u64 each), for the VMM to
/// read after the run: the start of free memory.
pub const SAMPLES_ADDR: u64 = FREE_MEMORY_START;
/// Where a guest's device driver (`virtio-rng`) keeps the page tables that
/// map the device, its queue and its buffer: free memory, as the samples.
pub const DEVICE_AREA_ADDR: u64 = FREE_MEMORY_START;
/// Bytes of the device area: three table pages, the driver's words, the
/// queue and the buffer, a page each.
pub const DEVICE_AREA_SIZE: u64 = 6 * PAGE_SIZE;
/// Where `dirty-writer` writes: free memory from 32 MiB on.
pub const DIRTY_AREA_ADDR: u64 = 32 << 20;
/// Where the VMM writes `apic-script`'s operations, one area per vCPU of
/// `1 << APIC_SCRIPT_SHIFT` bytes from here (free memory, as the samples).
pub const APIC_SCRIPT_ADDR: u64 = FREE_MEMORY_START;
/// log2 of a vCPU's `apic-script` area.
pub const APIC_SCRIPT_SHIFT: u32 = 16;

/// Guest physical address of vCPU `index`'s `apic-script` operations.
pub const fn apic_script(index: u32) -> u64 {
    APIC_SCRIPT_ADDR + ((index as u64) << APIC_SCRIPT_SHIFT)
}

/// Smallest guest memory the layout fits in, in MiB.
pub const MIN_MEM_MIB: u64 = 32;
/// Largest guest memory, in MiB: RAM stays below the 32-bit MMIO hole at 3 GiB.
pub const MAX_MEM_MIB: u64 = 3072;

/// Guest physical address of vCPU `index`'s area.
pub const fn vcpu_area(index: u32) -> u64 {
    VCPU_AREA_BASE + index as u64 * VCPU_AREA_SIZE
}

/// Guest physical address of vCPU `index`'s task-state segment.
pub const fn tss_addr(index: u32) -> u64 {
    vcpu_area(index) + TSS_OFFSET
}

/// Guest physical address of vCPU `index`'s interrupt descriptor table.
pub const fn idt_addr(index: u32) -> u64 {
    vcpu_area(index) + IDT_OFFSET
}

/// Initial kernel stack pointer (TSS.RSP0) of vCPU `index`.
pub const fn kernel_stack_top(index: u32) -> u64 {
    vcpu_area(index) + KERNEL_STACK_TOP_OFFSET
}

/// Guest physical address of vCPU `index`'s interrupt record, which is also
/// the top of its interrupt stack (TSS.IST1).
pub const fn irq_record(index: u32) -> u64 {
    kernel_stack_top(index) - IRQ_RECORD_SIZE
}

/// Top of vCPU `index`'s exception and service-call stack (TSS.RSP0).
pub const fn exception_stack_top(index: u32) -> u64 {
    kernel_stack_top(index) - EXCEPTION_STACK_GAP
}

/// Initial user stack pointer of vCPU `index`.
pub const fn user_stack_top(index: u32) -> u64 {
    vcpu_area(index) + USER_STACK_TOP_OFFSET
}

/// Guest physical address of vCPU `index`'s data block.
pub const fn vcpu_data(index: u32) -> u64 {
    vcpu_area(index) + VCPU_DATA_OFFSET
}

/// A machine the layout does not fit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// Too few or too many vCPUs.
    #[error("the number of vCPUs must be between 1 and {max}, not {requested}")]
    VcpuCount {
        /// What was asked for.
        requested: u32,
        /// The most the layout (and the caller) allows.
        max: u32,
    },
    /// Guest memory size out of range or not a whole number of 2 MiB pages.
    #[error("guest memory must be an even number of MiB between {min} and {max}, not {requested}")]
    MemorySize {
        /// What was asked for, in MiB.
        requested: u64,
        /// Smallest accepted size in MiB.
        min: u64,
        /// Largest accepted size in MiB.
        max: u64,
    },
}

/// Checks a vCPU count against [`MAX_VCPUS`] and `max` (a hypervisor's own
/// limit, say).
pub fn check_vcpus(vcpus: u32, max: u32) -> Result<u32, LayoutError> {
    let max = MAX_VCPUS.min(max);
    if (1..=max).contains(&vcpus) {
        Ok(vcpus)
    } else {
        Err(LayoutError::VcpuCount {
            requested: vcpus,
            max,
        })
    }
}

/// Checks a guest memory size in MiB: even, [`MIN_MEM_MIB`] to [`MAX_MEM_MIB`].
pub fn check_mem_mib(mem_mib: u64) -> Result<u64, LayoutError> {
    if (MIN_MEM_MIB..=MAX_MEM_MIB).contains(&mem_mib) && mem_mib % 2 == 0 {
        Ok(mem_mib)
    } else {
        Err(LayoutError::MemorySize {
            requested: mem_mib,
            min: MIN_MEM_MIB,
            max: MAX_MEM_MIB,
        })
    }
}

// The fixed layout must not overlap; these fail the build if it ever does.
const _: () = assert!(APIC_PD_ADDR + PAGE_SIZE <= VCPU_AREA_BASE);
const _: () = assert!(TRAMPOLINE_ADDR % PAGE_SIZE == 0 && TRAMPOLINE_ADDR < 1 << 20);
const _: () = assert!(PDPT_ADDR == PML4_ADDR + PAGE_SIZE && GDT_ADDR < PML4_ADDR);
const _: () = assert!(vcpu_area(MAX_VCPUS) <= SHARED_DATA_ADDR);
const _: () = assert!(SHARED_DATA_ADDR + PAGE_SIZE <= FREE_MEMORY_START);
const _: () = assert!(FREE_MEMORY_START < MIN_MEM_MIB << 20);
const _: () = assert!(SAMPLES_ADDR < DIRTY_AREA_ADDR);
const _: () = assert!(apic_script(MAX_VCPUS) <= DIRTY_AREA_ADDR);
const _: () = assert!(mailbox(MAX_VCPUS) <= FREE_MEMORY_START);
const _: () = assert!(PARAMS_OFFSET + 8 * PARAMS as u64 <= ACKS_OFFSET);
const _: () = assert!(APIC_READY_OFFSET + 64 <= BOOT_TABLE_OFFSET);
const _: () = assert!(BOOT_TABLE_OFFSET + 64 <= UCALL_TRANSPORT_OFFSET);
const _: () = assert!(DONE_COUNT_OFFSET + 64 <= MIGRATIONS_OFFSET);
const _: () = assert!(MIGRATIONS_OFFSET + 64 <= MAILBOX_OFFSET);
const _: () = assert!(32 + 16 * MAILBOX_RING <= 1 << MAILBOX_SHIFT);
const _: () = assert!(MAX_MEM_MIB << 20 <= 3 << 30);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vcpu_areas_are_disjoint_and_ordered() {
        for i in 0..MAX_VCPUS {
            assert!(tss_addr(i) < idt_addr(i));
            assert!(idt_addr(i) + PAGE_SIZE <= kernel_stack_top(i) - 0x1000);
            assert!(kernel_stack_top(i) <= user_stack_top(i) - 0x1000);
            assert!(user_stack_top(i) <= vcpu_data(i));
            assert!(vcpu_data(i) < vcpu_area(i + 1));
        }
    }

    #[test]
    fn everything_a_ucall_can_point_at_is_below_4_gib() {
        assert!(user_stack_top(MAX_VCPUS - 1) < 1 << 32);
        assert!(kernel_stack_top(MAX_VCPUS - 1) < 1 << 32);
    }

    #[test]
    fn vcpu_count_is_checked_against_the_layout_and_the_callers_limit() {
        assert_eq!(check_vcpus(4, 1024), Ok(4));
        let count = |requested, max| Err(LayoutError::VcpuCount { requested, max });
        assert_eq!(check_vcpus(0, 1024), count(0, MAX_VCPUS));
        assert_eq!(check_vcpus(65, 1024), count(65, 64));
        assert_eq!(check_vcpus(3, 2), count(3, 2));
    }

    #[test]
    fn memory_size_is_even_and_in_range() {
        assert_eq!(check_mem_mib(64), Ok(64));
        for bad in [0, 30, 33, 3074, u64::MAX] {
            assert!(check_mem_mib(bad).is_err(), "{bad}");
        }
    }
}
