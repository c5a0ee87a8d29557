//! `KVM_GET_DIRTY_LOG`: each call returns a slot's dirty bitmap and, in the
//! same ioctl, clears it and write-protects those pages again.

use std::os::fd::AsRawFd;

use crate::error::Error;
use crate::events::{DirtyEvents, NoEvents};
use crate::log::{DirtyLog, DirtySet};
use crate::slots::{Slot, Slots, Tracked};

/// The plain bitmap backend. Enabling write-protects every page of every slot
/// at once (O(slot size)); each harvest is one `KVM_GET_DIRTY_LOG` per slot.
#[derive(Debug)]
pub struct KvmBitmap<E: DirtyEvents = NoEvents> {
    tracked: Tracked<E>,
}

impl KvmBitmap {
    /// Tracks `slots` of the VM whose fd is `vm` (a kvm-ioctls `VmFd` of
    /// any version, or the VMM's own handle; a duplicate is kept).
    pub fn new(vm: &impl AsRawFd, slots: Slots) -> Result<Self, Error> {
        Self::with_events(vm, slots, NoEvents)
    }
}

impl<E: DirtyEvents> KvmBitmap<E> {
    /// Tracks `slots` of `vm`, reporting to `events`.
    pub fn with_events(vm: &impl AsRawFd, slots: Slots, events: E) -> Result<Self, Error> {
        Ok(Self {
            tracked: Tracked::new(vm, slots, events)?,
        })
    }
}

impl<E: DirtyEvents> DirtyLog for KvmBitmap<E> {
    fn slots(&self) -> &[Slot] {
        self.tracked.slots.as_slice()
    }

    fn enable(&mut self) -> Result<(), Error> {
        self.tracked.set_logging(true)
    }

    fn harvest(&mut self, into: &mut DirtySet) -> Result<(), Error> {
        let start = self.tracked.start_harvest()?;
        let mut found = 0;
        for i in 0..self.tracked.slots.as_slice().len() {
            let words = self.tracked.get_dirty_log(i)?;
            found += words.iter().map(|w| u64::from(w.count_ones())).sum::<u64>();
            into.bitmap_mut(i).merge_kvm_words(&words)?;
        }
        self.tracked.slots.merge_vmm_writes(into)?;
        self.tracked.events.harvested(found, start.elapsed());
        Ok(())
    }

    fn disable(&mut self) -> Result<(), Error> {
        self.tracked.set_logging(false)
    }
}
