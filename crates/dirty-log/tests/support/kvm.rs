//! A minimal KVM guest that dirties memory: one vCPU thread per writer, at
//! CPL3 in 64-bit mode (this machine's KVM emulates CPL0 code instruction by
//! instruction), with no interrupts, no descriptor tables in memory and no
//! stack. Memory slot 0 holds the page tables and the code; slot 1 is the
//! data the writers dirty, at [`DATA_ADDR`]. A round ends with a store to the
//! [`DOORBELL`] (an MMIO exit); the VMM resumes the vCPU for the next one.

use std::sync::Arc;

use kvm_bindings::{KVM_MAX_CPUID_ENTRIES, kvm_segment, kvm_userspace_memory_region};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

/// Guest memory with vm-memory's dirty tracking of the VMM's own writes.
pub type Memory = vm_memory::GuestMemoryMmap<AtomicBitmap>;

/// Guest address of the data the writers dirty (memory slot 1).
pub const DATA_ADDR: u64 = 1 << 30;
/// Largest data region: one page directory of 2 MiB pages.
pub const MAX_DATA_BYTES: u64 = 1 << 30;
/// Guest address whose stores exit to the VMM: the end of a round.
pub const DOORBELL: u64 = 3 << 30;
/// Bytes in a guest page.
pub const PAGE: u64 = 4096;

const SYSTEM_BYTES: u64 = 2 << 20;
const PML4: u64 = 0x1000;
const PDPT: u64 = 0x2000;
const PD_LOW: u64 = 0x3000;
const PD_DATA: u64 = 0x4000;
const PD_DOORBELL: u64 = 0x5000;
const CODE: u64 = 0x1_0000;
/// Present, writable, user; and for a page-directory entry, a 2 MiB page.
const TABLE: u64 = 0x7;
const LARGE: u64 = 0x87;

core::arch::global_asm!(include_str!("guest/writers.s"));

// SAFETY: the symbols are labels in the read-only section emitted by the
// `global_asm!` above; they are never written, so reading them is sound.
unsafe extern "C" {
    safe static dirty_log_writer_guest_image_start: u8;
    safe static dirty_log_writer_guest_image_end: u8;
    safe static dirty_log_writer_guest_random_writer: u8;
    safe static dirty_log_writer_guest_sequential_writer: u8;
}

fn image() -> &'static [u8] {
    let start = &raw const dirty_log_writer_guest_image_start;
    let len = &raw const dirty_log_writer_guest_image_end as usize - start as usize;
    // SAFETY: start and end delimit one immutable section, end after start.
    unsafe { std::slice::from_raw_parts(start, len) }
}

fn entry(label: &'static u8) -> u64 {
    CODE + (label as *const u8 as u64 - &raw const dirty_log_writer_guest_image_start as u64)
}

/// What a vCPU writes.
#[derive(Clone, Copy, Debug)]
pub enum Writer {
    /// `writes_per_round` pseudo-random pages per round, from a xorshift64
    /// stream seeded with `seed` (not 0); [`Xorshift`] replays it.
    Random {
        /// The stream's seed.
        seed: u64,
        /// Page writes per round.
        writes_per_round: u64,
    },
    /// Every page once per round, in order.
    Sequential,
}

/// The random writer's page stream, as the VMM replays it.
#[derive(Clone, Copy, Debug)]
pub struct Xorshift {
    state: u64,
    pages: u64,
}

impl Xorshift {
    /// The stream of a writer seeded with `seed` over `pages` pages.
    pub fn new(seed: u64, pages: u64) -> Self {
        Self { state: seed, pages }
    }
}

impl Iterator for Xorshift {
    type Item = u64;
    fn next(&mut self) -> Option<u64> {
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        Some(self.state % self.pages)
    }
}

/// What ended a vCPU's run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// The writer finished round `n`.
    Round(u64),
    /// `KVM_EXIT_DIRTY_RING_FULL`: harvest and reset the rings, then resume.
    RingFull,
}

/// A VM whose slot 1 the writers dirty.
pub struct WriterVm {
    /// The KVM system handle.
    pub kvm: Kvm,
    /// The VM, shared with dirty-log backends.
    pub vm: Arc<VmFd>,
    /// Slot 0 (system) and slot 1 (data), in that order.
    pub memory: Memory,
}

/// Why the test VM could not be built or run.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

impl WriterVm {
    /// Creates a VM with `data_bytes` of data memory (a multiple of 2 MiB, at
    /// most [`MAX_DATA_BYTES`]), backed by transparent huge pages if `thp`.
    /// `before_slots` runs on the VM first (dirty rings must be enabled before
    /// any vCPU exists).
    pub fn new(
        data_bytes: u64,
        thp: bool,
        before_slots: impl FnOnce(&VmFd) -> Result<(), Error>,
    ) -> Result<Self, Error> {
        if data_bytes == 0 || data_bytes % (2 << 20) != 0 || data_bytes > MAX_DATA_BYTES {
            return Err(
                format!("data of {data_bytes} bytes: want 2 MiB multiples up to 1 GiB").into(),
            );
        }
        let kvm = Kvm::new()?;
        let vm = kvm.create_vm()?;
        before_slots(&vm)?;
        let memory = Memory::from_ranges(&[
            (GuestAddress(0), SYSTEM_BYTES as usize),
            (GuestAddress(DATA_ADDR), data_bytes as usize),
        ])?;
        for (slot, region) in memory.iter().enumerate() {
            let host = memory.get_host_address(region.start_addr())?;
            if thp && slot == 1 {
                // SAFETY: advises the kernel about a mapping owned by `memory`.
                unsafe { libc::madvise(host.cast(), region.len() as usize, libc::MADV_HUGEPAGE) };
            }
            let region = kvm_userspace_memory_region {
                slot: slot as u32,
                flags: 0,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
            };
            // SAFETY: the mapping is owned by `memory`, which lives in the
            // returned value next to the VM, and is dropped after it.
            unsafe { vm.set_user_memory_region(region)? };
        }
        write_system(&memory, data_bytes)?;
        Ok(Self {
            kvm,
            vm: Arc::new(vm),
            memory,
        })
    }

    /// The memory as dirty-log slots: region i as slot i, which `new`
    /// registered.
    pub fn slots(&self) -> Result<dirty_log::Slots, dirty_log::Error> {
        let slots = dirty_log::Slots::from_memory(&self.memory)?;
        // SAFETY: `new` registered region i of this memory as slot i of this
        // VM with no flags, and the memory lives beside the VM.
        unsafe { slots.assume_registered(&*self.vm) }
    }

    /// Pages of data memory.
    pub fn data_pages(&self) -> u64 {
        self.memory.iter().nth(1).map_or(0, |r| r.len() / PAGE)
    }

    /// Creates vCPU `index` running `writer` over data pages `first..first + pages`.
    pub fn vcpu(
        &self,
        index: u64,
        writer: Writer,
        first: u64,
        pages: u64,
    ) -> Result<VcpuFd, Error> {
        if pages == 0 || first + pages > self.data_pages() {
            return Err(format!("pages {first}..{} outside the data", first + pages).into());
        }
        let vcpu = self.vm.create_vcpu(index)?;
        vcpu.set_cpuid2(&self.kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?)?;
        let mut sregs = vcpu.get_sregs()?;
        let segment = |selector: u16, type_: u8| kvm_segment {
            limit: 0xFFFF_FFFF,
            selector,
            type_,
            present: 1,
            dpl: 3,
            s: 1,
            l: u8::from(type_ == 0xB),
            g: 1,
            ..Default::default()
        };
        sregs.cs = segment(0x2b, 0xB);
        let data = segment(0x23, 0x3);
        (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
        (sregs.cr0, sregs.cr3, sregs.cr4, sregs.efer) = (0x8005_0033, PML4, 0x620, 0x501);
        vcpu.set_sregs(&sregs)?;
        let (rip, rcx, r8) = match writer {
            Writer::Random {
                seed,
                writes_per_round,
            } => (
                entry(&dirty_log_writer_guest_random_writer),
                seed.max(1),
                writes_per_round.max(1),
            ),
            Writer::Sequential => (entry(&dirty_log_writer_guest_sequential_writer), 0, 0),
        };
        let mut regs = vcpu.get_regs()?;
        (regs.rip, regs.rflags, regs.rdi, regs.rsi) = (rip, 0x2, DATA_ADDR + first * PAGE, pages);
        (regs.rcx, regs.r8, regs.r10) = (rcx, r8, DOORBELL);
        vcpu.set_regs(&regs)?;
        Ok(vcpu)
    }
}

/// Runs `vcpu` until its writer finishes a round or its dirty ring fills.
pub fn run(vcpu: &mut VcpuFd) -> Result<Stop, Error> {
    match vcpu.run()? {
        VcpuExit::MmioWrite(DOORBELL, data) => {
            let mut round = [0u8; 8];
            round[..data.len().min(8)].copy_from_slice(&data[..data.len().min(8)]);
            Ok(Stop::Round(u64::from_le_bytes(round)))
        }
        VcpuExit::Unsupported(kvm_bindings::KVM_EXIT_DIRTY_RING_FULL) => Ok(Stop::RingFull),
        other => {
            let exit = format!("{other:?}");
            let rip = vcpu.get_regs().map(|r| r.rip).unwrap_or_default();
            Err(format!("unexpected exit {exit} at rip {rip:#x}").into())
        }
    }
}

/// Page tables (identity: the system page, the data, the doorbell) and code.
fn write_system(memory: &Memory, data_bytes: u64) -> Result<(), Error> {
    let mut tables = vec![0u64; 5 * 512];
    let mut set = |table: u64, index: u64, value: u64| {
        tables[((table - PML4) / 8 + index) as usize] = value;
    };
    set(PML4, 0, PDPT | TABLE);
    set(PDPT, 0, PD_LOW | TABLE);
    set(PDPT, 1, PD_DATA | TABLE);
    set(PDPT, 3, PD_DOORBELL | TABLE);
    set(PD_LOW, 0, LARGE);
    for i in 0..data_bytes >> 21 {
        set(PD_DATA, i, (DATA_ADDR + (i << 21)) | LARGE);
    }
    set(PD_DOORBELL, 0, DOORBELL | LARGE);
    let bytes: Vec<u8> = tables.iter().flat_map(|e| e.to_le_bytes()).collect();
    memory.write_slice(&bytes, GuestAddress(PML4))?;
    memory.write_slice(image(), GuestAddress(CODE))?;
    Ok(())
}

/// Whether `/dev/kvm` can be opened. Where it cannot the test fails, or
/// with `VM_LATENCY_ALLOW_NO_KVM=1` skips, saying so on stderr and in
/// `SKIPPED_TESTS_LOG`.
pub fn kvm_available() -> bool {
    let Err(e) = Kvm::new() else {
        return true;
    };
    if std::env::var_os("VM_LATENCY_ALLOW_NO_KVM").is_none_or(|v| v != "1") {
        panic!("cannot open /dev/kvm ({e}); set VM_LATENCY_ALLOW_NO_KVM=1 to skip");
    }
    eprintln!("SKIPPED: cannot open /dev/kvm ({e})");
    if let Some(log) = std::env::var_os("SKIPPED_TESTS_LOG") {
        let line = format!("dirty-log::kvm: cannot open /dev/kvm ({e})\n");
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writers_dirty_the_pages_the_vmm_replays() {
        if !kvm_available() {
            return;
        }
        let vm = WriterVm::new(4 << 20, false, |_| Ok(())).unwrap();
        let writer = Writer::Random {
            seed: 7,
            writes_per_round: 50,
        };
        let mut vcpu = vm.vcpu(0, writer, 0, vm.data_pages()).unwrap();
        assert_eq!(run(&mut vcpu).unwrap(), Stop::Round(0));
        assert_eq!(run(&mut vcpu).unwrap(), Stop::Round(1));
        let mut replay = Xorshift::new(7, vm.data_pages());
        let second_round: Vec<u64> = replay.by_ref().skip(50).take(50).collect();
        for page in second_round {
            let value: u64 = vm
                .memory
                .read_obj(GuestAddress(DATA_ADDR + page * PAGE))
                .unwrap();
            assert_eq!(value, 1, "page {page} holds the round that last wrote it");
        }
        let mut seq = vm.vcpu(1, Writer::Sequential, 10, 5).unwrap();
        assert_eq!(run(&mut seq).unwrap(), Stop::Round(0));
        assert!(
            vm.vcpu(2, Writer::Sequential, 1020, 5).is_err(),
            "past the data"
        );
    }
}
