//! The guest programs as an ELF image with a PVH entry point, which any VMM
//! that boots kernels can start (QEMU's `-kernel`, the reference VMM's
//! `run --image`).
//!
//! [`Image::build`] makes one. It holds the [boot memory](crate::boot_memory)
//! that a direct boot writes and the
//! shared page with the program's parameters and a [`BootTable`], each a
//! `PT_LOAD` segment at its guest physical address, and a
//! `XEN_ELFNOTE_PHYS32_ENTRY` note naming the start-up in `programs/pvh.s`. That
//! start-up enters long mode on the image's page tables, loads the vCPU's
//! GDT, TSS and IDT, and starts the program at CPL3 with the registers the
//! direct boot gives it: one guest code, two ways in.
//!
//! What the image expects of whoever boots it:
//! - RAM from 0 to the image's memory size, COM1 at 0x3f8, the local APIC at
//!   0xFEE0_0000 (for the programs that use one);
//! - CPUID leaf 1 reporting each vCPU's index as its initial APIC ID.
//!
//! How results come back: where a read of the ucall port returns
//! [`UCALL_PROBE`] (a VMM with the ucall port), as ucalls; anywhere else as text lines on COM1
//! ([`TEXT_TAG`](crate::ucall::TEXT_TAG)), and the guest ends the run once
//! every vCPU has finished or at the first failure: through QEMU's
//! `isa-debug-exit` device at [`DEBUG_EXIT_PORT`] (0, or 1 on a failure),
//! else Cloud Hypervisor's ACPI shutdown, else the i8042's reset, which
//! Firecracker takes as the end ([`crate::abi`]). There the boot vCPU masks
//! the legacy PICs first, as a kernel does.
//!
//! The PVH protocol starts the boot vCPU only. A VMM may start every vCPU at
//! the entry (the reference VMM does); otherwise the boot vCPU starts the others with INIT and
//! start-up IPIs through a real-mode trampoline it copies to
//! [`TRAMPOLINE_ADDR`](crate::layout::TRAMPOLINE_ADDR).

use std::io::Cursor;

use linux_loader::loader::{Elf, KernelLoader, PvhBootCapability};
use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

pub use crate::abi::DEBUG_EXIT_PORT;
use crate::boot_memory::{self, Segment};
use crate::layout::{
    BOOT_TABLE_OFFSET, GDT_ADDR, IMAGE_ADDR, LayoutError, MAX_VCPUS, MIN_MEM_MIB, PAGE_SIZE,
    PARAMS, PARAMS_OFFSET, SHARED_DATA_ADDR, check_mem_mib, check_vcpus, tss_addr,
};
use crate::programs::{self as guest, GuestProgram, ProgramError};
use crate::ucall::UCALL_PROBE;
use crate::x86::gdt::build_gdt;

/// Longest program name the boot table holds.
const NAME_LEN: usize = 32;

/// What the PVH start-up reads, at [`BOOT_TABLE_OFFSET`] in the shared page.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BootTable {
    /// The GDT's pseudo-descriptor for `lgdt` in 32-bit mode: limit (u16),
    /// base (u32), two bytes of padding.
    pub gdtr: [u8; 8],
    /// The program's entry point.
    pub entry: u64,
    /// The number of vCPUs the image's tables are built for.
    pub vcpus: u64,
    /// The guest memory size, in bytes, that the page tables map.
    pub mem_size: u64,
    /// The program's name, NUL-padded.
    pub program: [u8; NAME_LEN],
}

// SAFETY: BootTable is repr(C) and made of u64s and byte arrays with no
// padding between them, so every bit pattern is a valid value.
unsafe impl ByteValued for BootTable {}

/// Why an image file cannot be booted.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// Not an ELF file this loader takes, or a segment outside guest memory.
    #[error("not a bootable ELF image: {0}")]
    Load(#[source] linux_loader::loader::Error),
    /// The scratch memory to read the image into could not be mapped.
    #[error("cannot map scratch memory to read the image into: {0}")]
    Scratch(#[source] vm_memory::mmap::FromRangesError),
    /// No `XEN_ELFNOTE_PHYS32_ENTRY` note.
    #[error("the image has no PVH entry note (XEN_ELFNOTE_PHYS32_ENTRY)")]
    NoPvhEntry,
    /// The boot table is missing or names no built-in program.
    #[error(
        "the image's boot table names no built-in program ({0:?}); build the image again with this version of test-guests"
    )]
    UnknownProgram(String),
    /// The boot table's vCPU count or memory size is out of range.
    #[error("the image's boot table is out of range: {0}")]
    BootTable(#[source] LayoutError),
    /// An image asked for a machine the layout does not fit.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// An image asked for a program that cannot run as asked.
    #[error(transparent)]
    Program(#[from] ProgramError),
}

/// An image file: its bytes and what its boot table says.
#[derive(Clone, Debug)]
pub struct Image {
    bytes: Vec<u8>,
    program: &'static GuestProgram,
    vcpus: u32,
    mem_mib: u64,
    params: [u64; PARAMS],
    entry: u64,
}

/// Two images are the same when their bytes are.
impl PartialEq for Image {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for Image {}

impl Image {
    /// The image of `program` with `params`, for `vcpus` vCPUs and `mem_mib`
    /// MiB of guest memory.
    pub fn build(
        program: &'static GuestProgram,
        vcpus: u32,
        mem_mib: u64,
        params: [u64; PARAMS],
    ) -> Result<Self, ImageError> {
        let vcpus = check_vcpus(vcpus, MAX_VCPUS)?;
        let mem_size = check_mem_mib(mem_mib)? << 20;
        program.check_params(&params)?;
        program.check_machine(&params, vcpus, mem_mib)?;
        let mut segments = boot_memory::segments(vcpus, mem_size);
        segments.push(shared_page(program, vcpus, mem_size, &params));
        let entry = IMAGE_ADDR + guest::pvh_entry_offset();
        Ok(Self {
            bytes: elf(entry, &segments),
            program,
            vcpus,
            mem_mib,
            params,
            entry,
        })
    }

    /// Reads an image file's bytes: loads them into scratch memory as a VMM
    /// would and checks the boot table.
    pub fn parse(bytes: Vec<u8>) -> Result<Self, ImageError> {
        let scratch =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), (MIN_MEM_MIB << 20) as usize)])
                .map_err(ImageError::Scratch)?;
        let entry = load(&bytes, &scratch)?;
        let table: BootTable = scratch
            .read_obj(GuestAddress(SHARED_DATA_ADDR + BOOT_TABLE_OFFSET))
            .expect("the shared page is inside the scratch memory");
        let params: [u64; PARAMS] = scratch
            .read_obj(GuestAddress(SHARED_DATA_ADDR + PARAMS_OFFSET))
            .expect("the parameters are inside the scratch memory");
        let name_len = table
            .program
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(NAME_LEN);
        let name = String::from_utf8_lossy(&table.program[..name_len]).into_owned();
        let program = guest::find(&name).ok_or(ImageError::UnknownProgram(name))?;
        let vcpus = u32::try_from(table.vcpus).unwrap_or(u32::MAX);
        let vcpus = check_vcpus(vcpus, MAX_VCPUS).map_err(ImageError::BootTable)?;
        let mem_mib = check_mem_mib(table.mem_size >> 20).map_err(ImageError::BootTable)?;
        Ok(Self {
            bytes,
            program,
            vcpus,
            mem_mib,
            params,
            entry,
        })
    }

    /// Loads the image into `memory`; returns the PVH entry.
    pub fn load<M: GuestMemoryBackend>(&self, memory: &M) -> Result<u64, ImageError> {
        load(&self.bytes, memory)
    }

    /// The file's bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The program the image starts.
    pub fn program(&self) -> &'static GuestProgram {
        self.program
    }

    /// The number of vCPUs the image is built for.
    pub fn vcpus(&self) -> u32 {
        self.vcpus
    }

    /// The guest memory the image's page tables map, in MiB.
    pub fn mem_mib(&self) -> u64 {
        self.mem_mib
    }

    /// The program's parameters.
    pub fn params(&self) -> [u64; PARAMS] {
        self.params
    }

    /// The PVH entry point (32-bit, guest physical).
    pub fn entry(&self) -> u64 {
        self.entry
    }
}

/// The arguments (after the binary) that boot the image file at `path`
/// under QEMU with `vcpus` vCPUs and `mem_mib` MiB: `-M microvm` (whose
/// firmware boots a PVH image in about a tenth of a second), COM1 on
/// standard output, `isa-debug-exit` at [`DEBUG_EXIT_PORT`], and its local
/// APICs in KVM (`kernel_irqchip`) or in QEMU. The CPU model hides KVM's
/// paravirtual features (the programs use none; QEMU 7.2 with its own APIC
/// fails at start-up writing KVM's poll-control MSR otherwise) and
/// `arch-capabilities`, which PVM does not let QEMU set.
pub fn qemu_args(
    path: &std::path::Path,
    vcpus: u32,
    mem_mib: u64,
    kernel_irqchip: bool,
) -> Vec<std::ffi::OsString> {
    let accel = match kernel_irqchip {
        true => "kvm,kernel-irqchip=on",
        false => "kvm,kernel-irqchip=off",
    };
    let debug_exit = format!("isa-debug-exit,iobase={DEBUG_EXIT_PORT:#x},iosize=4");
    let (vcpus, mem_mib) = (vcpus.to_string(), mem_mib.to_string());
    let args = [
        "-M",
        "microvm",
        "-accel",
        accel,
        "-cpu",
        "host,-arch-capabilities,kvm=off",
        "-smp",
        &vcpus,
        "-m",
        &mem_mib,
        "-nodefaults",
        "-no-reboot",
        "-display",
        "none",
        "-serial",
        "stdio",
        "-monitor",
        "none",
        "-device",
        &debug_exit,
        "-kernel",
    ];
    let mut out: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
    out.push(path.into());
    out
}

/// Loads an ELF image into `memory` and returns its PVH entry.
fn load<M: GuestMemoryBackend>(bytes: &[u8], memory: &M) -> Result<u64, ImageError> {
    let loaded =
        Elf::load(memory, None, &mut Cursor::new(bytes), None).map_err(ImageError::Load)?;
    match loaded.pvh_boot_cap {
        PvhBootCapability::PvhEntryPresent(entry) => Ok(entry.0),
        _ => Err(ImageError::NoPvhEntry),
    }
}

/// The shared page: the program's parameters and the boot table.
fn shared_page(
    program: &GuestProgram,
    vcpus: u32,
    mem_size: u64,
    params: &[u64; PARAMS],
) -> Segment {
    let gdt_limit = (build_gdt(vcpus, tss_addr).len() - 1) as u16;
    let mut gdtr = [0u8; 8];
    gdtr[..2].copy_from_slice(&gdt_limit.to_le_bytes());
    gdtr[2..6].copy_from_slice(&(GDT_ADDR as u32).to_le_bytes());
    let mut name = [0u8; NAME_LEN];
    let len = program.name.len().min(NAME_LEN - 1);
    name[..len].copy_from_slice(&program.name.as_bytes()[..len]);
    let table = BootTable {
        gdtr,
        entry: IMAGE_ADDR + program.entry_offset(),
        vcpus: u64::from(vcpus),
        mem_size,
        program: name,
    };
    let mut page = vec![0u8; PAGE_SIZE as usize];
    let at = |offset: u64| offset as usize;
    page[at(BOOT_TABLE_OFFSET)..][..size_of::<BootTable>()].copy_from_slice(table.as_slice());
    for (i, p) in params.iter().enumerate() {
        page[at(PARAMS_OFFSET) + 8 * i..][..8].copy_from_slice(&p.to_le_bytes());
    }
    Segment {
        what: "the shared page",
        addr: SHARED_DATA_ADDR,
        bytes: page,
    }
}

/// ELF constants (the System V ABI and its x86-64 supplement).
const ELF_HEADER_SIZE: usize = 64;
const PROGRAM_HEADER_SIZE: usize = 56;
const ET_EXEC: u16 = 2;
const EM_X86_64: u16 = 62;
const PT_LOAD: u32 = 1;
const PT_NOTE: u32 = 4;
const PF_RWX: u32 = 7;
const PF_R: u32 = 4;
/// Xen's note type for a 32-bit physical entry point, which PVH boots use.
const XEN_ELFNOTE_PHYS32_ENTRY: u32 = 18;

/// The PVH entry note: name "Xen", a 64-bit address (as Linux's own, which
/// QEMU reads whole in a 64-bit ELF).
fn pvh_note(entry: u64) -> Vec<u8> {
    let mut note = Vec::with_capacity(24);
    for word in [4u32, 8, XEN_ELFNOTE_PHYS32_ENTRY] {
        note.extend(word.to_le_bytes());
    }
    note.extend(b"Xen\0");
    note.extend(entry.to_le_bytes());
    note
}

/// A 64-bit little-endian executable: the header, a note and a `PT_LOAD`
/// per non-zero segment (guest memory starts zeroed), then their bytes.
fn elf(entry: u64, segments: &[Segment]) -> Vec<u8> {
    let note = pvh_note(entry);
    let loads: Vec<&Segment> = segments
        .iter()
        .filter(|s| s.bytes.iter().any(|&b| b != 0))
        .collect();
    let headers = 1 + loads.len();
    let mut out = Vec::new();
    out.extend(b"\x7fELF");
    out.extend([2, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // 64-bit, LSB, version 1
    out.extend(ET_EXEC.to_le_bytes());
    out.extend(EM_X86_64.to_le_bytes());
    out.extend(1u32.to_le_bytes());
    out.extend(entry.to_le_bytes());
    out.extend((ELF_HEADER_SIZE as u64).to_le_bytes()); // program headers
    out.extend(0u64.to_le_bytes()); // no section headers
    out.extend(0u32.to_le_bytes());
    for half in [ELF_HEADER_SIZE, PROGRAM_HEADER_SIZE, headers, 64, 0, 0] {
        out.extend((half as u16).to_le_bytes());
    }
    let mut offset = (ELF_HEADER_SIZE + headers * PROGRAM_HEADER_SIZE) as u64;
    let mut header = |kind: u32, flags: u32, addr: u64, len: usize, align: u64| {
        out.extend(kind.to_le_bytes());
        out.extend(flags.to_le_bytes());
        for quad in [offset, addr, addr, len as u64, len as u64, align] {
            out.extend(quad.to_le_bytes());
        }
        offset += len as u64;
    };
    header(PT_NOTE, PF_R, 0, note.len(), 4);
    for s in &loads {
        header(PT_LOAD, PF_RWX, s.addr, s.bytes.len(), 1);
    }
    out.extend(&note);
    for s in &loads {
        out.extend(&s.bytes);
    }
    out
}

// The start-up tells a VMM with the port from one without it by the probe value,
// so it must differ from what a read of an absent port returns.
const _: () = assert!(UCALL_PROBE != u32::MAX);

#[cfg(test)]
mod tests {
    use super::*;

    fn hello() -> &'static GuestProgram {
        guest::find("hello").unwrap()
    }

    #[test]
    fn an_image_reads_back_as_it_was_built() {
        let mut params = [0; PARAMS];
        params[0] = 7;
        let built = Image::build(guest::find("pingpong").unwrap(), 2, 64, params).unwrap();
        let parsed = Image::parse(built.bytes().to_vec()).unwrap();
        assert_eq!(parsed.program().name, "pingpong");
        assert_eq!(
            (parsed.vcpus(), parsed.mem_mib(), parsed.params()),
            (2, 64, params)
        );
        assert_eq!(parsed.entry(), IMAGE_ADDR + guest::pvh_entry_offset());
        assert_eq!(parsed, built);
    }

    #[test]
    fn loading_writes_the_boot_memory_and_the_boot_table() {
        let image = Image::build(hello(), 3, 64, [0; PARAMS]).unwrap();
        let memory = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 64 << 20)]).unwrap();
        assert_eq!(image.load(&memory).unwrap(), image.entry());
        for segment in boot_memory::segments(3, 64 << 20) {
            let mut bytes = vec![0; segment.bytes.len()];
            memory
                .read_slice(&mut bytes, GuestAddress(segment.addr))
                .unwrap();
            assert!(
                bytes == segment.bytes,
                "{} at {:#x}",
                segment.what,
                segment.addr
            );
        }
        let table: BootTable = memory
            .read_obj(GuestAddress(SHARED_DATA_ADDR + BOOT_TABLE_OFFSET))
            .unwrap();
        assert_eq!(table.entry, IMAGE_ADDR + hello().entry_offset());
        assert_eq!((table.vcpus, table.mem_size), (3, 64 << 20));
        assert_eq!(
            u32::from_le_bytes(table.gdtr[2..6].try_into().unwrap()),
            GDT_ADDR as u32
        );
    }

    #[test]
    fn bad_images_are_errors() {
        let good = Image::build(hello(), 1, 32, [0; PARAMS]).unwrap();
        let parse = |bytes: &[u8]| Image::parse(bytes.to_vec()).unwrap_err();
        assert!(matches!(parse(b"not an elf"), ImageError::Load(_)));
        assert!(matches!(parse(&good.bytes()[..200]), ImageError::Load(_)));
        let mut magic = good.bytes().to_vec();
        magic[1] = b'X';
        assert!(matches!(parse(&magic), ImageError::Load(_)));
        // Another note type (the note's program header comes first).
        let mut no_note = good.bytes().to_vec();
        let note_offset = u64::from_le_bytes(no_note[72..80].try_into().unwrap()) as usize;
        no_note[note_offset + 8] = 0x13;
        assert!(matches!(parse(&no_note), ImageError::NoPvhEntry));
        // A boot table naming no program.
        let mut renamed = good.bytes().to_vec();
        let name = renamed.windows(6).rposition(|w| w == b"hello\0").unwrap();
        renamed[name] = b'j';
        assert!(matches!(parse(&renamed), ImageError::UnknownProgram(n) if n == "jello"));
    }

    #[test]
    fn build_checks_its_arguments() {
        assert!(Image::build(hello(), 0, 64, [0; PARAMS]).is_err());
        assert!(Image::build(hello(), 1, 33, [0; PARAMS]).is_err());
        assert!(Image::build(guest::find("pingpong").unwrap(), 2, 64, [0; PARAMS]).is_err());
    }
}
