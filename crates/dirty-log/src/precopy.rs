//! Pre-copy rounds (live migration, snapshots) that cannot get the order of
//! copying and re-protecting wrong: a page is always re-protected (cleared)
//! before it is copied, and every page a GET reports is cleared.
//!
//! The order matters because a write that lands between copying a page and
//! clearing its dirty bit is lost: the copy misses it and the cleared bit
//! forgets it. Clearing first means any later write dirties the page again.

use crate::error::Error;
use crate::log::{DirtyLog, DirtySet};
use crate::slots::{PAGE_SIZE, Slot};

#[cfg(feature = "kvm")]
mod pipelined;
#[cfg(feature = "kvm")]
pub use pipelined::copy_round_pipelined;

/// Consecutive dirty pages of one slot, ready to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct CopyRun {
    /// The slot.
    pub slot: Slot,
    /// First page, counted from the slot's start.
    pub first_page: u64,
    /// Pages.
    pub pages: u64,
}

impl CopyRun {
    /// Guest physical address of the first byte.
    pub fn guest_addr(&self) -> u64 {
        self.slot.guest_addr + self.first_page * PAGE_SIZE
    }

    /// The VMM's address of the first byte (the slot's mapping).
    pub fn host_addr(&self) -> u64 {
        self.slot.host_addr + self.first_page * PAGE_SIZE
    }

    /// Bytes in the run.
    pub fn len(&self) -> usize {
        (self.pages * PAGE_SIZE) as usize
    }

    /// Whether the run is empty (it never is when handed to a copy).
    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }
}

/// One round over any backend: harvest (which re-protects what it reports),
/// then hand every dirty run to `copy`. Returns the pages handed over.
pub fn copy_round<L: DirtyLog + ?Sized>(
    log: &mut L,
    mut copy: impl FnMut(CopyRun) -> Result<(), Error>,
) -> Result<u64, Error> {
    let slots = log.slots().to_vec();
    let mut set = DirtySet::for_slots(&slots);
    log.harvest(&mut set)?;
    let mut copied = 0;
    for (slot, (_, dirty)) in slots.iter().zip(set.iter()) {
        copied += hand_over(slot, dirty.runs(), &mut copy)?;
    }
    Ok(copied)
}

/// Hands each of `runs` of `slot` to `copy`; returns the pages handed over.
fn hand_over(
    slot: &Slot,
    runs: impl Iterator<Item = (u64, u64)>,
    copy: &mut impl FnMut(CopyRun) -> Result<(), Error>,
) -> Result<u64, Error> {
    let mut copied = 0;
    for (first_page, pages) in runs {
        copy(CopyRun {
            slot: *slot,
            first_page,
            pages,
        })?;
        copied += pages;
    }
    Ok(copied)
}
