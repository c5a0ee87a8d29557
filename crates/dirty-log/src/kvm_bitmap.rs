//! `KVM_GET_DIRTY_LOG`: each call returns a slot's dirty bitmap and, in the
//! same ioctl, clears it and write-protects those pages again.

use std::sync::Arc;

use kvm_ioctls::VmFd;

use crate::error::Error;
use crate::events::{DirtyEvents, NoEvents};
use crate::log::{DirtyLog, DirtySet};
use crate::slots::{Slot, Slots, Tracked, VmmWrites};

/// The plain bitmap backend. Enabling write-protects every page of every slot
/// at once (O(slot size)); each harvest is one `KVM_GET_DIRTY_LOG` per slot.
#[derive(Debug)]
pub struct KvmBitmap<B: VmmWrites, E: DirtyEvents = NoEvents> {
    tracked: Tracked<B, E>,
}

impl<B: VmmWrites> KvmBitmap<B> {
    /// Tracks `slots` of `vm`.
    pub fn new(vm: Arc<VmFd>, slots: Slots<B>) -> Self {
        Self::with_events(vm, slots, NoEvents)
    }
}

impl<B: VmmWrites, E: DirtyEvents> KvmBitmap<B, E> {
    /// Tracks `slots` of `vm`, reporting to `events`.
    pub fn with_events(vm: Arc<VmFd>, slots: Slots<B>, events: E) -> Self {
        Self {
            tracked: Tracked::new(vm, slots, events),
        }
    }
}

impl<B: VmmWrites, E: DirtyEvents> DirtyLog for KvmBitmap<B, E> {
    fn slots(&self) -> &[Slot] {
        self.tracked.slots.as_slice()
    }

    fn enable(&mut self) -> Result<(), Error> {
        self.tracked.set_logging(true)
    }

    fn harvest(&mut self, into: &mut DirtySet) -> Result<(), Error> {
        let start = self.tracked.start_harvest()?;
        let mut found = 0;
        for (i, slot) in self.tracked.slots.as_slice().iter().enumerate() {
            let words = self.tracked.get_dirty_log(slot)?;
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
