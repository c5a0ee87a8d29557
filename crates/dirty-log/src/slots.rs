//! The memory slots being tracked, and the VMM's own writes to them.

use vm_memory::bitmap::{AtomicBitmap, Bitmap};
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use crate::error::Error;
use crate::log::DirtySet;

#[cfg(feature = "kvm")]
mod kvm;
#[cfg(feature = "kvm")]
pub(crate) use kvm::Tracked;

/// The page size KVM logs dirty memory in.
pub const PAGE_SIZE: u64 = 4096;

/// How a guest memory region reports the VMM's own writes (device emulation,
/// DMA), which KVM never sees. vm-memory's `AtomicBitmap` records every write
/// made through vm-memory; `()` records nothing.
pub trait VmmWrites: Bitmap + Send + Sync {
    /// Whether this bitmap records writes at all.
    const TRACKS: bool;
    /// Pages recorded (in KVM's word layout), if any.
    fn pages(&self) -> usize;
    /// Takes the pages written since the last call, in KVM's word layout.
    fn take_written(&self) -> Vec<u64>;
}

impl VmmWrites for () {
    const TRACKS: bool = false;
    fn pages(&self) -> usize {
        0
    }
    fn take_written(&self) -> Vec<u64> {
        Vec::new()
    }
}

impl VmmWrites for AtomicBitmap {
    const TRACKS: bool = true;
    fn pages(&self) -> usize {
        self.len()
    }
    fn take_written(&self) -> Vec<u64> {
        self.get_and_reset()
    }
}

/// One KVM memory slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot {
    /// KVM's slot id.
    pub id: u32,
    /// Guest physical address of its first page.
    pub guest_addr: u64,
    /// Pages in it.
    pub pages: u64,
    pub(crate) host_addr: u64,
}

/// The slots a backend tracks: guest memory regions and the KVM slot id each
/// is registered as. Holding the memory keeps every mapping alive for as long
/// as the backend may re-register it with KVM.
#[derive(Debug)]
pub struct Slots<B: VmmWrites> {
    memory: GuestMemoryMmap<B>,
    slots: Vec<Slot>,
    /// Whether they are registered with the VM: a KVM backend switches
    /// logging only on slots that exist (a safe call must not create them).
    #[cfg(feature = "kvm")]
    registered: std::sync::atomic::AtomicBool,
}

impl<B: VmmWrites> Slots<B> {
    /// Region `i` of `memory` as KVM slot `i`, the usual registration.
    pub fn new(memory: &GuestMemoryMmap<B>) -> Result<Self, Error> {
        let ids: Vec<u32> = (0..memory.num_regions() as u32).collect();
        Self::with_ids(memory, &ids)
    }

    /// Region `i` of `memory` as KVM slot `ids[i]`.
    pub fn with_ids(memory: &GuestMemoryMmap<B>, ids: &[u32]) -> Result<Self, Error> {
        if ids.len() != memory.num_regions() {
            return Err(Error::Config(format!(
                "{} slot ids for {} regions",
                ids.len(),
                memory.num_regions()
            )));
        }
        let slots = memory
            .iter()
            .zip(ids)
            .map(|(region, &id)| slot(memory, region, id))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            memory: memory.clone(),
            slots,
            #[cfg(feature = "kvm")]
            registered: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The slots, in region order.
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
    /// [`Error::Bitmap`] if `into` is not shaped like these slots.
    pub fn merge_vmm_writes(&self, into: &mut DirtySet) -> Result<(), Error> {
        if !B::TRACKS {
            return Ok(());
        }
        for (i, region) in self.memory.iter().enumerate() {
            let written = std::ops::Deref::deref(region).bitmap().take_written();
            into.bitmap_mut(i).merge_kvm_words(&written)?;
        }
        Ok(())
    }
}

fn slot<B: VmmWrites>(
    memory: &GuestMemoryMmap<B>,
    region: &vm_memory::GuestRegionMmap<B>,
    id: u32,
) -> Result<Slot, Error> {
    let bad = |reason: String| Error::Memory { slot: id, reason };
    if region.len() % PAGE_SIZE != 0 {
        return Err(bad(format!("{} bytes is not whole pages", region.len())));
    }
    let pages = region.len() / PAGE_SIZE;
    let tracked = std::ops::Deref::deref(region).bitmap().pages();
    if B::TRACKS && tracked as u64 != pages {
        return Err(bad(format!(
            "its write bitmap has {tracked} pages for {pages}"
        )));
    }
    let host = memory
        .get_host_address(region.start_addr())
        .map_err(|e| bad(e.to_string()))?;
    Ok(Slot {
        id,
        guest_addr: region.start_addr().0,
        pages,
        host_addr: host as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::{Bytes, GuestAddress};

    #[test]
    fn the_vmm_s_writes_are_added_to_the_pages_a_harvest_found_in_the_same_word() {
        // KVM's log said page 1 and 64; the VMM wrote page 2, in the same
        // word as page 1, through vm-memory. All three stay dirty.
        let memory = GuestMemoryMmap::<AtomicBitmap>::from_ranges(&[(
            GuestAddress(0),
            (128 * PAGE_SIZE) as usize,
        )])
        .unwrap();
        let slots = Slots::new(&memory).unwrap();
        let mut set = DirtySet::new(&slots);
        set.bitmap_mut(0).merge_kvm_words(&[1 << 1, 1]).unwrap();
        memory.write_obj(7u8, GuestAddress(2 * PAGE_SIZE)).unwrap();
        slots.merge_vmm_writes(&mut set).unwrap();
        assert_eq!(
            set.get(0).unwrap().as_kvm_words(),
            &[1 << 1 | 1 << 2, 1],
            "the VMM's writes are ORed into the harvest, not written over it"
        );
        slots.merge_vmm_writes(&mut set).unwrap();
        assert_eq!(set.count(), 3, "taken once, and nothing lost after");
    }
}
