//! One KVM memory slot, as plain data a VMM fills from whatever describes
//! its memory.

use crate::error::Error;

/// The page size KVM logs dirty memory in.
pub const PAGE_SIZE: u64 = 4096;

/// One KVM memory slot: where it is in the guest and in the VMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Slot {
    /// KVM's slot id (with the address space in bits 16 and up, as
    /// `KVM_SET_USER_MEMORY_REGION` takes it; only address space 0 is
    /// tracked).
    pub id: u32,
    /// Guest physical address of its first page.
    pub guest_addr: u64,
    /// Pages in it.
    pub pages: u64,
    /// The VMM's address of its first page.
    pub host_addr: u64,
}

impl Slot {
    /// Slot `id`: `bytes` of guest memory from `guest_addr`, mapped in the
    /// VMM at `host_addr`, as the VMM registered it with KVM.
    ///
    /// # Errors
    /// [`Error::Memory`] where an address or the size is not whole pages,
    /// or the size is 0.
    pub fn new(id: u32, guest_addr: u64, host_addr: u64, bytes: u64) -> Result<Self, Error> {
        let bad = |reason: String| Error::Memory { slot: id, reason };
        if bytes == 0 || bytes % PAGE_SIZE != 0 {
            return Err(bad(format!("{bytes} bytes is not whole pages")));
        }
        if guest_addr % PAGE_SIZE != 0 || host_addr % PAGE_SIZE != 0 {
            return Err(bad(format!(
                "guest address {guest_addr:#x} or host address {host_addr:#x} is not page-aligned"
            )));
        }
        guest_addr
            .checked_add(bytes)
            .ok_or_else(|| bad("it ends past the guest address space".into()))?;
        Ok(Self {
            id,
            guest_addr,
            pages: bytes / PAGE_SIZE,
            host_addr,
        })
    }

    /// Bytes in it.
    pub fn len(&self) -> u64 {
        self.pages * PAGE_SIZE
    }

    /// Whether it has no pages (never, for a slot [`Slot::new`] made).
    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }

    /// Whether the two share guest memory.
    pub(crate) fn overlaps(&self, other: &Slot) -> bool {
        self.guest_addr < other.guest_addr + other.len()
            && other.guest_addr < self.guest_addr + self.len()
    }
}
