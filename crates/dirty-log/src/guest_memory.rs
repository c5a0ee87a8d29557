//! Slots from the guest memory a VMM already has: vm-memory's
//! `GuestMemoryMmap` of version 0.16, 0.17 or 0.18 (features
//! `vm-memory-0-16`, `vm-memory-0-17`, `vm-memory-0-18`), with its
//! `AtomicBitmap`, if it has one, as the VMM's writes.
//!
//! vm-memory 0.17.2 is 0.18 under the old name: the `vm-memory-0-17`
//! feature is 0.17.1 exactly (what kata's dragonball and libkrun pin), and
//! a VMM on 0.17.2 takes `vm-memory-0-18`.

use crate::error::Error;
use crate::slots::Slots;

/// Guest memory that can describe itself as slots.
pub trait GuestRegions {
    /// Regions in it.
    fn regions(&self) -> usize;
    /// Region `i` as slot `ids[i]`, with the VMM's writes its bitmaps
    /// record, keeping the memory alive as long as the slots.
    fn slots_with_ids(&self, ids: &[u32]) -> Result<Slots, Error>;
}

impl Slots {
    /// Region `i` of `memory` as KVM slot `i`, the usual registration.
    pub fn from_memory(memory: &impl GuestRegions) -> Result<Self, Error> {
        let ids: Vec<u32> = (0..memory.regions() as u32).collect();
        memory.slots_with_ids(&ids)
    }

    /// Region `i` of `memory` as KVM slot `ids[i]`.
    pub fn from_memory_with_ids(memory: &impl GuestRegions, ids: &[u32]) -> Result<Self, Error> {
        memory.slots_with_ids(ids)
    }
}

/// A region's record of the VMM's writes: vm-memory's `AtomicBitmap`, or
/// `()` for none.
pub trait RegionBitmap {
    /// Pages it records, if it records any.
    fn recorded_pages(&self) -> Option<usize>;
    /// The pages written since the last call, in KVM's word layout.
    fn take(&self) -> Option<Vec<u64>>;
}

impl RegionBitmap for () {
    fn recorded_pages(&self) -> Option<usize> {
        None
    }
    fn take(&self) -> Option<Vec<u64>> {
        None
    }
}

/// The adapter for one vm-memory version: `$krate` its dependency name,
/// `$GuestMemory` its name for the memory trait.
macro_rules! adapter {
    ($module:ident, $krate:ident, $GuestMemory:ident) => {
        mod $module {
            use $krate::bitmap::{AtomicBitmap, Bitmap};
            use $krate::{GuestMemoryMmap, GuestMemoryRegion, $GuestMemory};

            use super::{GuestRegions, RegionBitmap};
            use crate::error::Error;
            use crate::slots::{Slot, Slots, VmmWrites};

            impl RegionBitmap for AtomicBitmap {
                fn recorded_pages(&self) -> Option<usize> {
                    Some(self.len())
                }
                fn take(&self) -> Option<Vec<u64>> {
                    Some(self.get_and_reset())
                }
            }

            /// The memory, kept alive, whose bitmaps hold the VMM's writes.
            #[derive(Debug)]
            struct Writes<B: Bitmap>(GuestMemoryMmap<B>);

            impl<B> VmmWrites for Writes<B>
            where
                B: Bitmap + RegionBitmap + Send + Sync + std::fmt::Debug + 'static,
            {
                fn take_written(&self, slot: &Slot) -> Option<Vec<u64>> {
                    self.0
                        .iter()
                        .find(|r| r.start_addr().0 == slot.guest_addr && r.len() == slot.len())
                        .and_then(|r| std::ops::Deref::deref(r).bitmap().take())
                }
            }

            impl<B> GuestRegions for GuestMemoryMmap<B>
            where
                B: Bitmap + RegionBitmap + Clone + Send + Sync + std::fmt::Debug + 'static,
            {
                fn regions(&self) -> usize {
                    self.num_regions()
                }

                fn slots_with_ids(&self, ids: &[u32]) -> Result<Slots, Error> {
                    if ids.len() != self.num_regions() {
                        return Err(Error::Config(format!(
                            "{} slot ids for {} regions",
                            ids.len(),
                            self.num_regions()
                        )));
                    }
                    let slots = self
                        .iter()
                        .zip(ids)
                        .map(|(region, &id)| {
                            let bad = |reason: String| Error::Memory { slot: id, reason };
                            let host = self
                                .get_host_address(region.start_addr())
                                .map_err(|e| bad(e.to_string()))?;
                            let slot =
                                Slot::new(id, region.start_addr().0, host as u64, region.len())?;
                            let bitmap = std::ops::Deref::deref(region).bitmap();
                            match bitmap.recorded_pages() {
                                Some(pages) if pages as u64 != slot.pages => Err(bad(format!(
                                    "its write bitmap has {pages} pages for {}",
                                    slot.pages
                                ))),
                                _ => Ok(slot),
                            }
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    Ok(Slots::new(slots)?.with_vmm_writes(Writes(self.clone())))
                }
            }
        }
    };
}

#[cfg(feature = "vm-memory-0-16")]
adapter!(v0_16, vm_memory_0_16, GuestMemory);
#[cfg(feature = "vm-memory-0-17")]
adapter!(v0_17, vm_memory_0_17, GuestMemory);
#[cfg(feature = "vm-memory-0-18")]
adapter!(v0_18, vm_memory, GuestMemoryBackend);

#[cfg(all(test, feature = "vm-memory-0-18"))]
mod tests {
    use vm_memory::bitmap::AtomicBitmap;
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    use crate::log::DirtySet;
    use crate::slots::{PAGE_SIZE, Slots};

    #[test]
    fn the_regions_become_slots_and_their_bitmaps_the_vmm_s_writes() {
        let memory = GuestMemoryMmap::<AtomicBitmap>::from_ranges(&[
            (GuestAddress(0), (128 * PAGE_SIZE) as usize),
            (GuestAddress(1 << 20), (64 * PAGE_SIZE) as usize),
        ])
        .unwrap();
        let slots = Slots::from_memory_with_ids(&memory, &[4, 9]).unwrap();
        let s = slots.as_slice();
        assert_eq!(
            (s[0].id, s[0].pages, s[1].id, s[1].guest_addr),
            (4, 128, 9, 1 << 20)
        );
        memory
            .write_obj(7u8, GuestAddress((1 << 20) + 3 * PAGE_SIZE))
            .unwrap();
        let mut set = DirtySet::for_slots(slots.as_slice());
        slots.merge_vmm_writes(&mut set).unwrap();
        assert!(set.get(9).unwrap().is_dirty(3));
        assert_eq!(set.count(), 1);
        assert!(
            Slots::from_memory_with_ids(&memory, &[1]).is_err(),
            "one id for two"
        );
    }

    #[test]
    fn memory_without_a_bitmap_records_no_writes() {
        let memory =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), PAGE_SIZE as usize)]).unwrap();
        let slots = Slots::from_memory(&memory).unwrap();
        memory.write_obj(7u8, GuestAddress(0)).unwrap();
        let mut set = DirtySet::for_slots(slots.as_slice());
        slots.merge_vmm_writes(&mut set).unwrap();
        assert_eq!(set.count(), 0);
    }
}
