//! A manual-protect round whose clearing runs beside the copy (KVM only).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;

use super::{CopyRun, hand_over};
use crate::error::Error;
use crate::events::DirtyEvents;
use crate::log::{DirtyLog, DirtySet};
use crate::manual::KvmManualProtect;

/// One manual-protect round with the clear work on a background thread: per
/// slot, one GET; a worker thread CLEARs the reported pages chunk by chunk in
/// page order (each CLEAR bounded by [`ManualConfig::max_stall`]); this
/// thread copies each dirty run as soon as the worker has cleared past it.
/// The VMM's own writes are taken (and reset) first and copied too. Returns
/// the pages handed over.
///
/// [`ManualConfig::max_stall`]: crate::ManualConfig::max_stall
pub fn copy_round_pipelined<E: DirtyEvents>(
    log: &KvmManualProtect<E>,
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
