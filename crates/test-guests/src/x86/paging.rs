//! The guest's 4-level page tables: an identity map of all RAM with 2 MiB pages.
//!
//! Every page is user-accessible (U bit) so that CPL3 code can reach its stacks,
//! the shared page and the runtime's CPL3 library; CR4.SMEP/SMAP stay clear so the
//! CPL0 stubs can too.

use crate::layout::{LARGE_PAGE_SIZE, PAGE_SIZE};

const PRESENT: u64 = 1 << 0;
const WRITABLE: u64 = 1 << 1;
const USER: u64 = 1 << 2;
const LARGE: u64 = 1 << 7;
/// Write-through and cache-disable: device memory.
const UNCACHED: u64 = 1 << 3 | 1 << 4;
/// Bits of a table entry that point at the next level.
const TABLE: u64 = PRESENT | WRITABLE | USER;

/// Entries in one page table.
const ENTRIES: u64 = 512;
/// Memory one page directory maps with large pages.
pub const PD_SPAN: u64 = ENTRIES * LARGE_PAGE_SIZE;

/// One page table to write into guest memory.
#[derive(Debug, PartialEq, Eq)]
pub struct PageTable {
    /// Guest physical address of the table.
    pub addr: u64,
    /// Its 512 entries.
    pub entries: Vec<u64>,
}

impl PageTable {
    /// The table as little-endian bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.entries.iter().flat_map(|e| e.to_le_bytes()).collect()
    }
}

/// The tables that identity-map `[0, mem_size)`, rounded up to whole 2 MiB pages.
///
/// The PML4 is at `pml4`, the PDPT in the page after it, and one page directory per
/// GiB starts at `pd`.
pub fn identity_map(mem_size: u64, pml4: u64, pd: u64) -> Vec<PageTable> {
    let pdpt = pml4 + PAGE_SIZE;
    let large_pages = mem_size.div_ceil(LARGE_PAGE_SIZE);
    let directories = large_pages.div_ceil(ENTRIES);
    let mut tables = vec![
        table(pml4, [pdpt | TABLE]),
        table(pdpt, (0..directories).map(|d| (pd + d * PAGE_SIZE) | TABLE)),
    ];
    for d in 0..directories {
        let pages = (d * ENTRIES..large_pages.min((d + 1) * ENTRIES))
            .map(|p| (p * LARGE_PAGE_SIZE) | PRESENT | WRITABLE | USER | LARGE);
        tables.push(table(pd + d * PAGE_SIZE, pages));
    }
    tables
}

/// Adds to `tables` (from [`identity_map`], whose PML4 is at `pml4`) an
/// uncached identity mapping of the 2 MiB that hold `gpa`, a device's MMIO
/// page, through a page directory at `pd`. The GiB of `gpa` must be above
/// RAM: it gets that directory to itself.
pub fn map_mmio(tables: &mut Vec<PageTable>, pml4: u64, gpa: u64, pd: u64) {
    let pdpt = pml4 + PAGE_SIZE;
    let large_page = gpa & !(LARGE_PAGE_SIZE - 1);
    if let Some(t) = tables.iter_mut().find(|t| t.addr == pdpt) {
        let entry = &mut t.entries[((gpa >> 30) & (ENTRIES - 1)) as usize];
        debug_assert_eq!(*entry, 0, "the MMIO GiB is not RAM");
        *entry = pd | TABLE;
    }
    let mut directory = table(pd, []);
    directory.entries[((gpa >> 21) & (ENTRIES - 1)) as usize] =
        large_page | PRESENT | WRITABLE | USER | LARGE | UNCACHED;
    tables.push(directory);
}

fn table(addr: u64, entries: impl IntoIterator<Item = u64>) -> PageTable {
    let mut entries: Vec<u64> = entries.into_iter().collect();
    entries.resize(ENTRIES as usize, 0);
    PageTable { addr, entries }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Walks the tables the way the MMU does and returns the physical address.
    fn translate(tables: &[PageTable], pml4: u64, va: u64) -> Option<u64> {
        let lookup = |addr: u64, index: u64| {
            let t = tables.iter().find(|t| t.addr == addr)?;
            let e = t.entries[index as usize];
            (e & PRESENT != 0 && e & USER != 0).then_some(e)
        };
        let e4 = lookup(pml4, (va >> 39) & 511)?;
        let e3 = lookup(e4 & !0xFFF, (va >> 30) & 511)?;
        let e2 = lookup(e3 & !0xFFF, (va >> 21) & 511)?;
        assert!(e2 & LARGE != 0);
        Some((e2 & !0x1F_FFFF & !(1 << 63)) | (va & 0x1F_FFFF))
    }

    #[test]
    fn maps_every_byte_of_ram_to_itself() {
        let mem = 1536 << 20;
        let tables = identity_map(mem, 0x2000, 0x4000);
        assert_eq!(tables.len(), 2 + 2);
        for va in [0, 0x1234, 0x20_0000, 0x3fff_ffff, 0x4000_0000, mem - 1] {
            assert_eq!(translate(&tables, 0x2000, va), Some(va), "va {va:#x}");
        }
        assert_eq!(translate(&tables, 0x2000, mem), None);
    }

    #[test]
    fn rounds_a_partial_large_page_up() {
        let tables = identity_map(3 << 20, 0x2000, 0x4000);
        assert_eq!(
            translate(&tables, 0x2000, (4 << 20) - 1),
            Some((4 << 20) - 1)
        );
        assert_eq!(translate(&tables, 0x2000, 4 << 20), None);
    }

    #[test]
    fn an_mmio_page_above_ram_is_mapped_uncached_beside_it() {
        let mut tables = identity_map(64 << 20, 0x2000, 0x4000);
        map_mmio(&mut tables, 0x2000, 0xFEE0_0000, 0x7000);
        assert_eq!(translate(&tables, 0x2000, 0xFEE0_00B0), Some(0xFEE0_00B0));
        assert_eq!(
            translate(&tables, 0x2000, 0x1234),
            Some(0x1234),
            "RAM unchanged"
        );
        assert_eq!(
            translate(&tables, 0x2000, 0xFE00_0000),
            None,
            "only its 2 MiB"
        );
        let pd = tables.iter().find(|t| t.addr == 0x7000).unwrap();
        assert_eq!(pd.entries[0x1F7] & UNCACHED, UNCACHED);
    }

    #[test]
    fn tables_serialize_to_one_page() {
        for t in identity_map(64 << 20, 0x2000, 0x4000) {
            assert_eq!(t.to_bytes().len(), PAGE_SIZE as usize);
        }
    }
}
