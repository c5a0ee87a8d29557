//! The set of memory slots a backend tracks, who switches their logging,
//! and the VMM's own writes to them.

use std::fmt::Debug;

use crate::error::Error;
use crate::log::DirtySet;
pub use crate::slot::{PAGE_SIZE, Slot};

#[cfg(feature = "kvm")]
mod kvm;
#[cfg(feature = "kvm")]
mod owner;
#[cfg(feature = "kvm")]
pub(crate) use kvm::Tracked;
#[cfg(feature = "kvm")]
pub use owner::SlotOwner;

/// The VMM's own writes to the tracked memory (device emulation, DMA),
/// which KVM never sees. vm-memory's `AtomicBitmap` records every write
/// made through vm-memory: the adapters (features `vm-memory-0-17`,
/// `vm-memory-0-18`) take them from it.
pub trait VmmWrites: Send + Sync + Debug {
    /// Takes the pages of `slot` written since the last call, in KVM's
    /// word layout (a bit per page, a word per 64 pages of the slot), and
    /// forgets them; `None` where nothing records that slot's writes.
    fn take_written(&self, slot: &Slot) -> Option<Vec<u64>>;
}

/// The slots a backend tracks, any subset of the VM's, and who switches
/// their logging (feature `kvm`: [`Slots::owned_by`], or this crate's own
/// registration) and records the VMM's writes ([`Slots::with_vmm_writes`]).
#[derive(Debug)]
pub struct Slots {
    slots: Vec<Slot>,
    writes: Option<Box<dyn VmmWrites>>,
    #[cfg(feature = "kvm")]
    owner: Option<Box<dyn SlotOwner>>,
}

impl Slots {
    /// The slots `slots`, in that order.
    ///
    /// # Errors
    /// [`Error::Config`] where two share an id or overlap in the guest.
    pub fn new(slots: impl IntoIterator<Item = Slot>) -> Result<Self, Error> {
        let slots: Vec<Slot> = slots.into_iter().collect();
        for (i, a) in slots.iter().enumerate() {
            if let Some(b) = slots[..i].iter().find(|b| b.id == a.id || b.overlaps(a)) {
                return Err(Error::Config(format!(
                    "slots {} and {} share an id or guest memory",
                    b.id, a.id
                )));
            }
        }
        Ok(Self {
            slots,
            writes: None,
            #[cfg(feature = "kvm")]
            owner: None,
        })
    }

    /// Keeps only the slots whose ids are in `ids`, in their order here: a
    /// VMM tracks a subset (not its device or hot-plugged memory).
    ///
    /// # Errors
    /// [`Error::Config`] where an id is not one of these slots.
    pub fn only(mut self, ids: &[u32]) -> Result<Self, Error> {
        if let Some(id) = ids.iter().find(|&&id| self.index_of(id).is_none()) {
            return Err(Error::Config(format!("no slot {id} to track")));
        }
        self.slots.retain(|s| ids.contains(&s.id));
        Ok(self)
    }

    /// These slots, with the VMM's own writes taken from `writes` at every
    /// harvest.
    pub fn with_vmm_writes(mut self, writes: impl VmmWrites + 'static) -> Self {
        self.writes = Some(Box::new(writes));
        self
    }

    /// The slots, in order.
    pub fn as_slice(&self) -> &[Slot] {
        &self.slots
    }

    /// The position of slot `id` in [`Slots::as_slice`].
    pub fn index_of(&self, id: u32) -> Option<usize> {
        self.slots.iter().position(|s| s.id == id)
    }

    /// Merges the VMM's own writes since the last call into `into` (one
    /// bitmap per slot, as [`DirtySet::for_slots`] makes it), and resets them:
    /// what every backend adds to KVM's log, and all there is without one.
    ///
    /// # Errors
    /// [`Error::Bitmap`] if `into`, or what the [`VmmWrites`] returned, is
    /// not shaped like these slots.
    pub fn merge_vmm_writes(&self, into: &mut DirtySet) -> Result<(), Error> {
        let Some(writes) = &self.writes else {
            return Ok(());
        };
        for (i, slot) in self.slots.iter().enumerate() {
            if let Some(written) = writes.take_written(slot) {
                into.bitmap_mut(i).merge_kvm_words(&written)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Writes recorded by hand: words per slot id, taken once.
    #[derive(Debug, Default)]
    struct Recorded(Mutex<Vec<(u32, Vec<u64>)>>);

    impl VmmWrites for Recorded {
        fn take_written(&self, slot: &Slot) -> Option<Vec<u64>> {
            let mut all = self.0.lock().unwrap();
            let at = all.iter().position(|(id, _)| *id == slot.id)?;
            Some(all.remove(at).1)
        }
    }

    fn slot(id: u32, guest: u64, pages: u64) -> Slot {
        Slot::new(id, guest, 0x7f00_0000_0000 + guest, pages * PAGE_SIZE).unwrap()
    }

    #[test]
    fn the_vmm_s_writes_are_added_to_the_pages_a_harvest_found_in_the_same_word() {
        // KVM's log said page 1 and 64; the VMM wrote page 2, in the same
        // word as page 1. All three stay dirty.
        let writes = Recorded(Mutex::new(vec![(0, vec![1 << 2, 0])]));
        let slots = Slots::new([slot(0, 0, 128)])
            .unwrap()
            .with_vmm_writes(writes);
        let mut set = DirtySet::for_slots(slots.as_slice());
        set.bitmap_mut(0).merge_kvm_words(&[1 << 1, 1]).unwrap();
        slots.merge_vmm_writes(&mut set).unwrap();
        assert_eq!(
            set.get(0).unwrap().as_kvm_words(),
            &[1 << 1 | 1 << 2, 1],
            "the VMM's writes are ORed into the harvest, not written over it"
        );
        slots.merge_vmm_writes(&mut set).unwrap();
        assert_eq!(set.count(), 3, "taken once, and nothing lost after");
    }

    #[test]
    fn writes_shaped_unlike_their_slot_are_an_error() {
        let writes = Recorded(Mutex::new(vec![(0, vec![1])]));
        let slots = Slots::new([slot(0, 0, 128)])
            .unwrap()
            .with_vmm_writes(writes);
        let mut set = DirtySet::for_slots(slots.as_slice());
        assert!(matches!(
            slots.merge_vmm_writes(&mut set),
            Err(Error::Bitmap(_))
        ));
    }

    #[test]
    fn slots_are_whole_pages_with_distinct_ids_and_memory() {
        assert!(matches!(
            Slot::new(1, 0, 0, 100),
            Err(Error::Memory { slot: 1, .. })
        ));
        assert!(
            Slot::new(1, 0x800, 0, PAGE_SIZE).is_err(),
            "unaligned guest"
        );
        assert!(Slot::new(1, 0, 0x800, PAGE_SIZE).is_err(), "unaligned host");
        assert!(Slot::new(1, !0xfff, 0, 2 * PAGE_SIZE).is_err());
        assert!(
            Slots::new([slot(0, 0, 4), slot(0, 0x10000, 4)]).is_err(),
            "same id"
        );
        assert!(
            Slots::new([slot(0, 0, 4), slot(1, 0x3000, 4)]).is_err(),
            "overlap"
        );
        let s = Slots::new([slot(0, 0, 4), slot(1, 0x4000, 4)]).unwrap();
        assert_eq!(s.as_slice()[1].len(), 4 * PAGE_SIZE);
    }

    #[test]
    fn a_subset_keeps_the_slots_named_in_their_order() {
        let all = Slots::new([slot(0, 0, 4), slot(5, 0x10000, 8), slot(9, 0x20000, 2)]).unwrap();
        let some = all.only(&[9, 0]).unwrap();
        let ids: Vec<u32> = some.as_slice().iter().map(|s| s.id).collect();
        assert_eq!(ids, [0, 9]);
        assert!(
            matches!(some.only(&[5]), Err(Error::Config(_))),
            "5 is gone"
        );
    }
}
