//! What guest memory holds before a vCPU's first instruction: the GDT, the
//! page tables, the guest image, each vCPU's TSS and IDT (see
//! [`crate::layout`]). A direct boot writes these pieces into the VM's
//! memory; [`crate::pvh`] puts the same pieces into an image file.

use crate::layout::*;
use crate::programs::{self as guest, EXCEPTION_VECTORS};
use crate::x86::apic::XAPIC_BASE;
use crate::x86::gdt::{IO_BITMAP_SIZE, TSS_HEADER_SIZE, build_gdt, tss_header};
use crate::x86::idt::build_idt;
use crate::x86::paging::{identity_map, map_mmio};

/// Bytes to place at a guest physical address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// What the bytes are, for an error message.
    pub what: &'static str,
    /// Guest physical address.
    pub addr: u64,
    /// The bytes.
    pub bytes: Vec<u8>,
}

impl Segment {
    fn new(what: &'static str, addr: u64, bytes: Vec<u8>) -> Self {
        Self { what, addr, bytes }
    }
}

/// The interrupt-stack-table entry of external interrupts.
const IRQ_STACK: u8 = 1;

/// Every piece of the boot memory of `vcpus` vCPUs in `mem_size` bytes of
/// RAM, apart from the shared page (zero until the VMM writes parameters).
pub fn segments(vcpus: u32, mem_size: u64) -> Vec<Segment> {
    let mut out = vec![Segment::new(
        "the GDT",
        GDT_ADDR,
        build_gdt(vcpus, tss_addr),
    )];
    let mut tables = identity_map(mem_size, PML4_ADDR, PD_ADDR);
    map_mmio(&mut tables, PML4_ADDR, XAPIC_BASE, APIC_PD_ADDR);
    out.extend(
        tables
            .iter()
            .map(|t| Segment::new("a page table", t.addr, t.to_bytes())),
    );
    out.push(Segment::new(
        "the guest image",
        IMAGE_ADDR,
        guest::image().to_vec(),
    ));
    let irq_entry = |v| match v {
        guest::XAPIC_VECTORS..=0xFE => IMAGE_ADDR + guest::xapic_irq_entry_offset(),
        _ => IMAGE_ADDR + guest::irq_entry_offset(),
    };
    let idt = build_idt(
        (0..EXCEPTION_VECTORS)
            .map(|v| (v, IMAGE_ADDR + guest::exception_stub_offset(v), 0))
            .chain((EXCEPTION_VECTORS..=u8::MAX).map(|v| (v, irq_entry(v), IRQ_STACK))),
    );
    for i in 0..vcpus {
        let tss = tss_header(exception_stack_top(i), irq_record(i));
        out.push(Segment::new("a TSS", tss_addr(i), tss.to_vec()));
        // The I/O bitmap after the header is all zero (every port allowed);
        // only its trailing byte is not.
        out.push(Segment::new(
            "an I/O bitmap",
            tss_addr(i) + TSS_HEADER_SIZE + IO_BITMAP_SIZE,
            vec![0xff],
        ));
        out.push(Segment::new("an IDT", idt_addr(i), idt.clone()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_disjoint_and_below_the_shared_page() {
        let mut segments = segments(4, 64 << 20);
        segments.sort_by_key(|s| s.addr);
        for pair in segments.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            assert!(
                a.addr + a.bytes.len() as u64 <= b.addr,
                "{} overlaps {}",
                a.what,
                b.what
            );
        }
        let last = segments.last().unwrap();
        assert!(last.addr + last.bytes.len() as u64 <= SHARED_DATA_ADDR);
        assert_eq!(segments.iter().filter(|s| s.what == "an IDT").count(), 4);
    }
}
