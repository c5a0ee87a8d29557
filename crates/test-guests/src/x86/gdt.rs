//! The global descriptor table, its segments and the per-vCPU task-state segments.
//!
//! Guest code runs at CPL3 because this machine's KVM (PVM) emulates CPL0 code one
//! instruction at a time; CPL0 is entered only through exceptions, which switch to
//! the TSS's RSP0. The layout is the one measured to work on PVM.

use kvm_bindings::kvm_segment;

/// Selector of the 64-bit kernel code segment.
pub const KERNEL_CS: u16 = 0x08;
/// Selector of the kernel data segment.
pub const KERNEL_DS: u16 = 0x10;
/// Selector of the 32-bit user code segment (kept for the SYSRET layout).
pub const USER_CS32: u16 = 0x18 | 3;
/// Selector of the user data and stack segment (DPL 3).
pub const USER_DS: u16 = 0x20 | 3;
/// Selector of the 64-bit user code segment (DPL 3).
pub const USER_CS: u16 = 0x28 | 3;
/// Byte offset of the first TSS descriptor; vCPU `i` uses `TSS_BASE_SELECTOR + 16 * i`.
pub const TSS_BASE_SELECTOR: u16 = 0x30;

/// Size of a 64-bit TSS without its I/O permission bitmap.
pub const TSS_HEADER_SIZE: u64 = 0x68;
/// Size of an I/O permission bitmap covering all 65536 ports.
pub const IO_BITMAP_SIZE: u64 = 0x2000;
/// Segment limit of a TSS with a full I/O bitmap and its trailing 0xFF byte.
pub const TSS_LIMIT: u32 = (TSS_HEADER_SIZE + IO_BITMAP_SIZE) as u32;

/// One 8-byte code or data segment descriptor.
const fn segment_descriptor(access: u8, flags: u8) -> u64 {
    // Base 0, limit 0xFFFFF (with G set: the whole 4 GiB; ignored in long mode).
    0xFFFF | (access as u64) << 40 | 0xF << 48 | ((flags as u64) & 0xF) << 52
}

/// Access byte bits.
const PRESENT: u8 = 0x80;
const DPL3: u8 = 0x60;
const CODE_OR_DATA: u8 = 0x10;
const EXECUTABLE: u8 = 0x08;
const READ_WRITE: u8 = 0x02;
const ACCESSED: u8 = 0x01;
/// Flag nibble bits.
const GRANULARITY: u8 = 0x8;
const SIZE_32: u8 = 0x4;
const LONG_MODE: u8 = 0x2;

const CODE: u8 = PRESENT | CODE_OR_DATA | EXECUTABLE | READ_WRITE | ACCESSED;
const DATA: u8 = PRESENT | CODE_OR_DATA | READ_WRITE | ACCESSED;

/// The fixed part of the GDT, indexed by selector / 8.
pub const FIXED_DESCRIPTORS: [u64; 6] = [
    0,
    segment_descriptor(CODE, GRANULARITY | LONG_MODE),
    segment_descriptor(DATA, GRANULARITY | SIZE_32),
    segment_descriptor(CODE | DPL3, GRANULARITY | SIZE_32),
    segment_descriptor(DATA | DPL3, GRANULARITY | SIZE_32),
    segment_descriptor(CODE | DPL3, GRANULARITY | LONG_MODE),
];

/// Type of an available 64-bit TSS (with the present bit in the access byte).
const TSS_AVAILABLE_ACCESS: u8 = PRESENT | 0x9;
/// Type of a busy 64-bit TSS, as the task register holds it once loaded.
const TSS_BUSY_TYPE: u8 = 0xB;

/// The 16-byte system descriptor of a 64-bit TSS at `base`.
pub fn tss_descriptor(base: u64) -> [u64; 2] {
    let limit = u64::from(TSS_LIMIT);
    let low = (limit & 0xFFFF)
        | (base & 0xFF_FFFF) << 16
        | u64::from(TSS_AVAILABLE_ACCESS) << 40
        | ((limit >> 16) & 0xF) << 48
        | ((base >> 24) & 0xFF) << 56;
    [low, base >> 32]
}

/// Selector of vCPU `index`'s TSS descriptor.
pub fn tss_selector(index: u32) -> u16 {
    TSS_BASE_SELECTOR + 16 * index as u16
}

/// The whole GDT for `vcpus` vCPUs whose TSSs are at `tss_addr(i)`, as bytes.
pub fn build_gdt(vcpus: u32, tss_addr: impl Fn(u32) -> u64) -> Vec<u8> {
    let mut words: Vec<u64> = FIXED_DESCRIPTORS.to_vec();
    for i in 0..vcpus {
        words.extend(tss_descriptor(tss_addr(i)));
    }
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}

/// The 64-bit TSS header of a vCPU: kernel stack `rsp0`, interrupt stack
/// `ist1` (every external interrupt switches to it, from CPL3 or CPL0), I/O
/// bitmap right after the header.
///
/// The I/O bitmap itself (all zero: every port allowed at CPL3) and its trailing
/// 0xFF byte follow the header in memory. PVM drops RFLAGS.IOPL once a TSS is
/// loaded, so the bitmap is what lets CPL3 code use `in`/`out`.
pub fn tss_header(rsp0: u64, ist1: u64) -> [u8; TSS_HEADER_SIZE as usize] {
    let mut tss = [0u8; TSS_HEADER_SIZE as usize];
    tss[4..12].copy_from_slice(&rsp0.to_le_bytes());
    tss[0x24..0x2c].copy_from_slice(&ist1.to_le_bytes());
    tss[0x66..0x68].copy_from_slice(&(TSS_HEADER_SIZE as u16).to_le_bytes());
    tss
}

/// The KVM view of a flat code or data segment with `selector`.
pub fn flat_segment(selector: u16) -> kvm_segment {
    let descriptor = FIXED_DESCRIPTORS[usize::from(selector >> 3)];
    let access = (descriptor >> 40) as u8;
    let flags = (descriptor >> 52) as u8 & 0xF;
    kvm_segment {
        base: 0,
        limit: 0xFFFF_FFFF,
        selector,
        type_: access & 0xF,
        present: 1,
        dpl: (access >> 5) & 3,
        db: u8::from(flags & SIZE_32 != 0),
        s: 1,
        l: u8::from(flags & LONG_MODE != 0),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

/// The KVM view of vCPU `index`'s loaded (busy) task register.
pub fn task_register(index: u32, base: u64) -> kvm_segment {
    kvm_segment {
        base,
        limit: TSS_LIMIT,
        selector: tss_selector(index),
        type_: TSS_BUSY_TYPE,
        present: 1,
        dpl: 0,
        db: 0,
        s: 0,
        l: 0,
        g: 0,
        avl: 0,
        unusable: 0,
        padding: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_descriptors_match_the_well_known_encodings() {
        assert_eq!(FIXED_DESCRIPTORS[1], 0x00af_9b00_0000_ffff);
        assert_eq!(FIXED_DESCRIPTORS[2], 0x00cf_9300_0000_ffff);
        assert_eq!(FIXED_DESCRIPTORS[3], 0x00cf_fb00_0000_ffff);
        assert_eq!(FIXED_DESCRIPTORS[4], 0x00cf_f300_0000_ffff);
        assert_eq!(FIXED_DESCRIPTORS[5], 0x00af_fb00_0000_ffff);
    }

    #[test]
    fn user_segments_are_dpl3_and_the_code_segment_is_64_bit() {
        let cs = flat_segment(USER_CS);
        assert_eq!((cs.dpl, cs.l, cs.db, cs.type_), (3, 1, 0, 0xB));
        let ds = flat_segment(USER_DS);
        assert_eq!((ds.dpl, ds.l, ds.db, ds.type_), (3, 0, 1, 0x3));
        let kcs = flat_segment(KERNEL_CS);
        assert_eq!((kcs.dpl, kcs.l), (0, 1));
    }

    #[test]
    fn tss_descriptor_splits_base_and_limit() {
        let [low, high] = tss_descriptor(0x1234_5678_9abc_def0);
        assert_eq!(low & 0xFFFF, 0x2068);
        assert_eq!((low >> 16) & 0xFF_FFFF, 0xbc_def0);
        assert_eq!((low >> 40) & 0xFF, 0x89);
        assert_eq!((low >> 56) & 0xFF, 0x9a);
        assert_eq!(high, 0x1234_5678);
    }

    #[test]
    fn gdt_has_one_tss_descriptor_per_vcpu() {
        let gdt = build_gdt(3, |i| 0x10_0000 * u64::from(i + 1));
        assert_eq!(gdt.len(), 6 * 8 + 3 * 16);
        let at = |sel: u16| {
            let o = usize::from(sel);
            u64::from_le_bytes(gdt[o..o + 8].try_into().unwrap())
        };
        assert_eq!((at(tss_selector(2)) >> 16) & 0xFF_FFFF, 0x30_0000);
        assert_eq!(tss_selector(2), 0x50);
    }

    #[test]
    fn tss_header_holds_rsp0_ist1_and_the_io_bitmap_offset() {
        let tss = tss_header(0xdead_b000, 0xbeef_c000);
        assert_eq!(
            u64::from_le_bytes(tss[4..12].try_into().unwrap()),
            0xdead_b000
        );
        assert_eq!(
            u64::from_le_bytes(tss[0x24..0x2c].try_into().unwrap()),
            0xbeef_c000
        );
        assert_eq!(
            u16::from_le_bytes(tss[0x66..0x68].try_into().unwrap()),
            0x68
        );
    }
}
