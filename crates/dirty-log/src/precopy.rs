//! Pre-copy rounds (live migration, snapshots) that cannot get the order of
//! copying and re-protecting wrong: a page is always re-protected (cleared)
//! before it is copied, and every page a GET reports is cleared.
//!
//! The order matters because a write that lands between copying a page and
//! clearing its dirty bit is lost: the copy misses it and the cleared bit
//! forgets it. Clearing first means any later write dirties the page again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use vm_memory::GuestAddress;

use crate::error::Error;
use crate::events::DirtyEvents;
use crate::log::{DirtyLog, DirtySet};
use crate::manual::KvmManualProtect;
use crate::slots::{PAGE_SIZE, Slot, VmmWrites};

/// Consecutive dirty pages of one slot, ready to copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    pub fn guest_addr(&self) -> GuestAddress {
        GuestAddress(self.slot.guest_addr + self.first_page * PAGE_SIZE)
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

/// One manual-protect round with the clear work on a background thread: per
/// slot, one GET; a worker thread CLEARs the reported pages chunk by chunk in
/// page order (each CLEAR bounded by [`ManualConfig::max_stall`]); this
/// thread copies each dirty run as soon as the worker has cleared past it.
/// The VMM's own writes are taken (and reset) first and copied too. Returns
/// the pages handed over.
///
/// [`ManualConfig::max_stall`]: crate::ManualConfig::max_stall
pub fn copy_round_pipelined<B: VmmWrites, E: DirtyEvents>(
    log: &KvmManualProtect<B, E>,
    mut copy: impl FnMut(CopyRun) -> Result<(), Error>,
) -> Result<u64, Error> {
    let slots = log.slots().to_vec();
    let mut vmm = DirtySet::for_slots(&slots);
    log.merge_vmm_writes(&mut vmm)?;
    let mut copied = 0;
    for (i, (slot, (_, vmm_dirty))) in slots.iter().zip(vmm.iter()).enumerate() {
        let mut dirty = log.get(i)?;
        let kvm_dirty = dirty.clone();
        dirty.merge(vmm_dirty)?;
        let cleared = AtomicU64::new(0);
        let failed = AtomicBool::new(false);
        let main = thread::current();
        copied += thread::scope(|s| {
            let worker = s.spawn(|| {
                let result = log.clear(i, &kvm_dirty, |page| {
                    cleared.store(page, Ordering::Release);
                    main.unpark();
                });
                failed.store(result.is_err(), Ordering::Release);
                cleared.store(u64::MAX, Ordering::Release);
                main.unpark();
                result
            });
            // Each run waits until the worker has cleared past it; after a
            // failed CLEAR nothing more is copied (what was not cleared stays
            // dirty in KVM's bitmap for the next round).
            let cleared_runs = dirty.runs().take_while(|&(first, pages)| {
                while cleared.load(Ordering::Acquire) < first + pages {
                    thread::park();
                }
                !failed.load(Ordering::Acquire)
            });
            let copied = hand_over(slot, cleared_runs, &mut copy)?;
            worker
                .join()
                .map_err(|_| Error::Worker("the clear thread panicked".into()))??;
            Ok::<_, Error>(copied)
        })?;
    }
    Ok(copied)
}
