//! The one API over every way of tracking dirty pages.

use crate::bitmap::DirtyBitmap;
use crate::error::Error;
use crate::slot::Slot;

/// One [`DirtyBitmap`] per tracked slot, in the slots' order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtySet {
    slots: Vec<(u32, DirtyBitmap)>,
}

impl DirtySet {
    /// An all-clean set for `slots` (as [`DirtyLog::slots`] lists them).
    pub fn for_slots(slots: &[Slot]) -> Self {
        Self {
            slots: slots
                .iter()
                .map(|s| (s.id, DirtyBitmap::new(s.pages)))
                .collect(),
        }
    }

    /// The bitmap of slot `id`.
    pub fn get(&self, id: u32) -> Option<&DirtyBitmap> {
        self.slots.iter().find(|(s, _)| *s == id).map(|(_, b)| b)
    }

    /// Every slot id with its bitmap.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &DirtyBitmap)> {
        self.slots.iter().map(|(id, b)| (*id, b))
    }

    /// Dirty pages in all slots.
    pub fn count(&self) -> u64 {
        self.slots.iter().map(|(_, b)| b.count()).sum()
    }

    /// Dirty pages of each slot, in the slots' order: summed over harvests,
    /// the per-slot counts a [`DirtyRate`](crate::DirtyRate) samples.
    pub fn counts(&self) -> Vec<u64> {
        self.slots.iter().map(|(_, b)| b.count()).collect()
    }

    /// Marks every page clean.
    pub fn clear(&mut self) {
        self.slots.iter_mut().for_each(|(_, b)| b.clear());
    }

    /// Adds every page dirty in `other` (a set for the same slots).
    pub fn merge(&mut self, other: &DirtySet) -> Result<(), Error> {
        if self.slots.len() != other.slots.len() {
            return Err(Error::Config("merging sets of different slots".into()));
        }
        for ((_, a), (_, b)) in self.slots.iter_mut().zip(&other.slots) {
            a.merge(b)?;
        }
        Ok(())
    }

    /// The bitmap of the slot at position `index`.
    pub(crate) fn bitmap_mut(&mut self, index: usize) -> &mut DirtyBitmap {
        &mut self.slots[index].1
    }
}

/// Dirty-page tracking for a VM's memory slots.
///
/// After [`harvest`](DirtyLog::harvest) returns, every page it added to the
/// set has been re-protected: a guest write from then on shows up in the next
/// harvest. So a copy of those pages made after `harvest` returns is never
/// stale without the next harvest saying so. Every harvest also merges the
/// VMM's own writes (see [`VmmWrites`](crate::VmmWrites)).
pub trait DirtyLog {
    /// The slots it tracks, in the order of a [`DirtySet`] made for them.
    fn slots(&self) -> &[Slot];
    /// Starts logging every slot.
    fn enable(&mut self) -> Result<(), Error>;
    /// Adds the pages dirtied since logging began or the last harvest to `into`.
    fn harvest(&mut self, into: &mut DirtySet) -> Result<(), Error>;
    /// Stops logging.
    fn disable(&mut self) -> Result<(), Error>;
}
