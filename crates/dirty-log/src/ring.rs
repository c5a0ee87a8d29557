//! The dirty ring (`KVM_CAP_DIRTY_LOG_RING[_ACQ_REL]`): each vCPU publishes
//! the pages it dirties into a ring shared with the VMM, which harvests
//! entries, marks them reset, and calls `KVM_RESET_DIRTY_RINGS` to re-protect
//! those pages. A full ring stops its vCPU with `KVM_EXIT_DIRTY_RING_FULL`
//! until entries are harvested and reset.
//!
//! Entries that hardware buffers (Intel PML) reach the ring only when their
//! vCPU exits: kick every vCPU out of `KVM_RUN` before the final harvest.

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use kvm_bindings::{
    KVM_CAP_DIRTY_LOG_RING, KVM_CAP_DIRTY_LOG_RING_ACQ_REL, KVM_DIRTY_LOG_PAGE_OFFSET,
};

use crate::error::{Error, kvm};
use crate::events::{DirtyEvents, Ioctl, NoEvents};
use crate::ioctls::{
    DIRTY_GFN_F_DIRTY, DIRTY_GFN_F_RESET, DirtyGfn, check_extension, enable_cap, reset_dirty_rings,
};
use crate::log::{DirtyLog, DirtySet};
use crate::slots::{PAGE_SIZE, Slot, Slots, Tracked};

/// Bytes in one ring entry.
pub const ENTRY_BYTES: u32 = std::mem::size_of::<DirtyGfn>() as u32;

/// Which ring capability is in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RingMode {
    /// `KVM_CAP_DIRTY_LOG_RING_ACQ_REL`: flags are published with release and
    /// must be read with acquire (what the harvest does in both modes).
    AcqRel,
    /// `KVM_CAP_DIRTY_LOG_RING` (x86's strongly ordered original).
    Plain,
}

/// Enables a dirty ring of `bytes` per vCPU on the VM whose fd is `vm` (a
/// power of two of at least a page, within what KVM allows). Must come
/// before any vCPU exists. Prefers the acquire/release capability.
pub fn enable_dirty_ring(vm: &impl AsRawFd, bytes: u32) -> Result<RingMode, Error> {
    let acq_rel = check_extension(vm, KVM_CAP_DIRTY_LOG_RING_ACQ_REL);
    let plain = check_extension(vm, KVM_CAP_DIRTY_LOG_RING);
    let (cap, mode, max) = if acq_rel > 0 {
        (KVM_CAP_DIRTY_LOG_RING_ACQ_REL, RingMode::AcqRel, acq_rel)
    } else if plain > 0 {
        (KVM_CAP_DIRTY_LOG_RING, RingMode::Plain, plain)
    } else {
        return Err(Error::Unsupported("KVM_CAP_DIRTY_LOG_RING"));
    };
    if !bytes.is_power_of_two() || u64::from(bytes) < PAGE_SIZE || bytes > max as u32 {
        return Err(Error::Config(format!(
            "a dirty ring of {bytes} bytes: want a power of two from {PAGE_SIZE} to {max}"
        )));
    }
    enable_cap(vm, cap, u64::from(bytes)).map_err(kvm("KVM_ENABLE_CAP(DIRTY_LOG_RING)"))?;
    Ok(mode)
}

/// Where a ring entry's page is: `(slot position, page)`, or why it is not a
/// tracked page. Only address space 0 is tracked (x86's SMM space is not).
pub fn decode(entry: &DirtyGfn, slots: &[Slot]) -> Result<(usize, u64), EntryError> {
    if entry.slot >> 16 != 0 {
        return Err(EntryError::AddressSpace);
    }
    let index = slots
        .iter()
        .position(|s| s.id == entry.slot & 0xFFFF)
        .ok_or(EntryError::UnknownSlot)?;
    if entry.offset >= slots[index].pages {
        return Err(EntryError::OffsetBeyondSlot(index));
    }
    Ok((index, entry.offset))
}

/// Why a ring entry names no tracked page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum EntryError {
    /// An address space other than 0.
    AddressSpace,
    /// A slot id that is not tracked.
    UnknownSlot,
    /// A page past the end of the slot at this position.
    OffsetBeyondSlot(usize),
}

/// One vCPU's mapped ring.
#[derive(Debug)]
struct Ring {
    vcpu: usize,
    entries: NonNull<DirtyGfn>,
    len: u32,
    /// The next entry to look at (free-running; the slot is `next % len`).
    next: u32,
    /// [`Rings::resets`] when a ring-full exit of this vCPU last found
    /// nothing to collect (a harvest may have reset the ring just before).
    empty_full_exit: Option<u64>,
    /// Pages this ring reported first since it was mapped: each entry
    /// naming a page not yet pending for the next harvest.
    fresh: u64,
}

// SAFETY: the ring is a MAP_SHARED mapping owned by this value; it is only
// accessed under the `Rings` mutex.
unsafe impl Send for Ring {}

impl Ring {
    fn map(vcpu: usize, fd: &impl AsRawFd, bytes: u32) -> Result<Self, Error> {
        let offset = libc::off_t::from(KVM_DIRTY_LOG_PAGE_OFFSET) * PAGE_SIZE as libc::off_t;
        // SAFETY: maps `bytes` of the vCPU fd at KVM's ring offset; the result
        // is checked, and only this value ever unmaps it.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                offset,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(Error::Kvm {
                op: "mmap(dirty ring)",
                source: std::io::Error::last_os_error(),
            });
        }
        let entries =
            NonNull::new(addr.cast()).ok_or(Error::Unsupported("a dirty ring mapping"))?;
        if !readable(addr.cast(), bytes as usize) {
            // SAFETY: unmaps exactly the mapping made above, never used.
            unsafe { libc::munmap(addr, bytes as usize) };
            return Err(Error::RingNotEnabled { vcpu, bytes });
        }
        Ok(Self {
            vcpu,
            entries,
            len: bytes / ENTRY_BYTES,
            next: 0,
            empty_full_exit: None,
            fresh: 0,
        })
    }

    /// Takes every published entry, marking each reset; `place` gets each
    /// and says whether its page was not pending yet.
    fn collect(&mut self, mut place: impl FnMut(DirtyGfn, u32) -> bool) -> u32 {
        let mut fresh = 0;
        // SAFETY: `entries` maps `len` entries for as long as `self` lives.
        let taken = unsafe {
            collect_entries(self.entries, self.len, &mut self.next, |gfn, index| {
                fresh += u64::from(place(gfn, index));
            })
        };
        self.fresh += fresh;
        taken
    }
}

/// Whether the first and last pages of the `len` bytes at `addr`, in this
/// process, can be read: a vCPU's ring pages past the ring KVM enabled (or
/// with none enabled) raise SIGBUS when touched, where `process_vm_readv`
/// fails with EFAULT instead.
fn readable(addr: *const u8, len: usize) -> bool {
    let last = len.saturating_sub(PAGE_SIZE as usize);
    [0, last].iter().all(|&at| {
        let mut byte = 0u8;
        let local = libc::iovec {
            iov_base: (&raw mut byte).cast(),
            iov_len: 1,
        };
        let remote = libc::iovec {
            iov_base: addr.wrapping_add(at).cast_mut().cast(),
            iov_len: 1,
        };
        // SAFETY: reads one byte of this process's memory into a local; the
        // kernel checks the remote address and fails instead of faulting.
        let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
        n == 1
    })
}

/// Takes the published entries of the ring of `len` entries at `entries`,
/// from `*next` on: reads each entry's flags with acquire, hands the entry
/// and its index to `place`, and marks it reset with release. Returns how
/// many it took.
///
/// # Safety
/// `entries` must point to `len` (non-zero) `DirtyGfn`s, valid for reads and
/// writes for the duration of the call, and not accessed by other threads
/// except atomically on the flags (as KVM does).
pub(crate) unsafe fn collect_entries(
    entries: NonNull<DirtyGfn>,
    len: u32,
    next: &mut u32,
    mut place: impl FnMut(DirtyGfn, u32),
) -> u32 {
    let mut taken = 0;
    while taken < len {
        let index = *next % len;
        // SAFETY: `index < len`, inside the ring; entries are 16-byte aligned,
        // so the flags word is an aligned u32 (the caller's contract).
        let entry = unsafe { entries.as_ptr().add(index as usize) };
        // SAFETY: as above; the atomic view lives no longer than this turn.
        let flags = unsafe { AtomicU32::from_ptr(&raw mut (*entry).flags) };
        if flags.load(Ordering::Acquire) & DIRTY_GFN_F_DIRTY == 0 {
            break;
        }
        // SAFETY: a published entry's fields are stable until it is reset.
        let gfn = unsafe { entry.read_volatile() };
        place(gfn, index);
        flags.store(DIRTY_GFN_F_RESET, Ordering::Release);
        *next = next.wrapping_add(1);
        taken += 1;
    }
    taken
}

impl Drop for Ring {
    fn drop(&mut self) {
        let bytes = self.len as usize * ENTRY_BYTES as usize;
        // SAFETY: unmaps exactly the mapping `map` created, once.
        unsafe { libc::munmap(self.entries.as_ptr().cast(), bytes) };
    }
}

/// What the harvest thread and the vCPU threads (on a full ring) share.
#[derive(Debug)]
struct Rings {
    rings: Vec<Ring>,
    /// Pages taken off the rings and not yet handed to a harvest.
    pending: DirtySet,
    /// The first entry that named no tracked page, kept for the next harvest.
    bad: Option<Error>,
    /// `KVM_RESET_DIRTY_RINGS` calls so far.
    resets: u64,
}

impl Rings {
    /// Each attached vCPU's index and the pages its ring reported first.
    fn pages_by_vcpu(&self) -> Vec<(usize, u64)> {
        self.rings.iter().map(|r| (r.vcpu, r.fresh)).collect()
    }
}

/// The dirty-ring backend.
#[derive(Debug)]
pub struct KvmDirtyRing<E: DirtyEvents = NoEvents> {
    tracked: Tracked<E>,
    bytes: u32,
    shared: Arc<Mutex<Rings>>,
}

impl KvmDirtyRing {
    /// Tracks `slots` of the VM whose fd is `vm`, whose rings of `bytes`
    /// were enabled with [`enable_dirty_ring`].
    pub fn new(vm: &impl AsRawFd, slots: Slots, bytes: u32) -> Result<Self, Error> {
        Self::with_events(vm, slots, bytes, NoEvents)
    }
}

impl<E: DirtyEvents> KvmDirtyRing<E> {
    /// Tracks `slots` of `vm`, reporting to `events`.
    pub fn with_events(
        vm: &impl AsRawFd,
        slots: Slots,
        bytes: u32,
        events: E,
    ) -> Result<Self, Error> {
        let pending = DirtySet::for_slots(slots.as_slice());
        Ok(Self {
            tracked: Tracked::new(vm, slots, events)?,
            bytes,
            shared: Arc::new(Mutex::new(Rings {
                rings: Vec::new(),
                pending,
                bad: None,
                resets: 0,
            })),
        })
    }

    /// Maps vCPU `index`'s ring, from its fd `vcpu` (any handle: the
    /// mapping outlives it). One `mmap`, from any thread.
    pub fn attach(&self, index: usize, vcpu: &impl AsRawFd) -> Result<(), Error> {
        let ring = Ring::map(index, vcpu, self.bytes)?;
        self.lock().rings.push(ring);
        Ok(())
    }

    /// Each attached vCPU's index and the pages its ring has reported since
    /// it was attached (taken by harvests and by [`RingFull::drain`]): the
    /// counts a [`DirtyRate`](crate::DirtyRate) per vCPU samples. A page
    /// counts once per harvest, for the first ring that reported it: KVM
    /// pushes an entry at every write it emulates (at every guest write
    /// through its instruction emulator, as PVM's guest kernel mode makes),
    /// so a vCPU rewriting one page would otherwise count as writing many.
    pub fn pages_by_vcpu(&self) -> Vec<(usize, u64)> {
        self.lock().pages_by_vcpu()
    }

    /// A handle for vCPU threads: on `KVM_EXIT_DIRTY_RING_FULL`, call
    /// [`RingFull::drain`] and re-enter the guest. It reports its resets to
    /// (a clone of) this backend's events.
    pub fn full_handler(&self) -> RingFull
    where
        E: Clone + Send + Sync + 'static,
    {
        RingFull {
            shared: self.shared.clone(),
            vm: self.tracked.vm.clone(),
            slots: self.tracked.slots.as_slice().to_vec(),
            events: Arc::new(self.tracked.events.clone()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Rings> {
        self.shared.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl<E: DirtyEvents> DirtyLog for KvmDirtyRing<E> {
    fn slots(&self) -> &[Slot] {
        self.tracked.slots.as_slice()
    }

    fn enable(&mut self) -> Result<(), Error> {
        if self.lock().rings.is_empty() {
            return Err(Error::NoRing);
        }
        self.tracked.set_logging(true)
    }

    fn harvest(&mut self, into: &mut DirtySet) -> Result<(), Error> {
        let start = self.tracked.start_harvest()?;
        let slots = self.tracked.slots.as_slice();
        let mut rings = self.lock();
        let on_reset = |took| self.tracked.events.ioctl(Ioctl::ResetDirtyRings, took);
        let taken = drain(&mut rings, slots, &self.tracked.vm, &on_reset)?;
        into.merge(&rings.pending)?;
        rings.pending.clear();
        let bad = rings.bad.take();
        drop(rings);
        self.tracked.slots.merge_vmm_writes(into)?;
        self.tracked.events.harvested(taken, start.elapsed());
        bad.map_or(Ok(()), Err)
    }

    /// Stops logging new writes; the rings stay mapped until dropped.
    fn disable(&mut self) -> Result<(), Error> {
        self.tracked.set_logging(false)
    }
}

/// Lets a vCPU thread drain the rings when its own is full.
#[derive(Clone)]
pub struct RingFull {
    shared: Arc<Mutex<Rings>>,
    vm: Arc<OwnedFd>,
    slots: Vec<Slot>,
    events: Arc<dyn DirtyEvents + Send + Sync>,
}

impl std::fmt::Debug for RingFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingFull")
            .field("slots", &self.slots)
            .finish_non_exhaustive()
    }
}

impl RingFull {
    /// As [`KvmDirtyRing::pages_by_vcpu`], from a vCPU thread.
    pub fn pages_by_vcpu(&self) -> Vec<(usize, u64)> {
        self.shared
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pages_by_vcpu()
    }

    /// On vCPU `vcpu`'s `KVM_EXIT_DIRTY_RING_FULL`: takes every published
    /// entry into the next harvest and resets the rings, so the vCPU can run
    /// again.
    ///
    /// # Errors
    /// [`Error::NothingToCollect`] where the vCPU's ring is not attached, or
    /// where it exits full twice with nothing to collect and no reset in
    /// between (once is a harvest that reset the ring just before): either
    /// way it would exit again at once, for ever.
    pub fn drain(&self, vcpu: usize) -> Result<(), Error> {
        let mut rings = self.shared.lock().unwrap_or_else(PoisonError::into_inner);
        let on_reset = |took| self.events.ioctl(Ioctl::ResetDirtyRings, took);
        let before = rings.resets;
        let taken = drain(&mut rings, &self.slots, &self.vm, &on_reset)?;
        let ring = rings.rings.iter_mut().find(|r| r.vcpu == vcpu);
        let Some(ring) = ring else {
            return Err(Error::NothingToCollect { vcpu });
        };
        match taken {
            0 if ring.empty_full_exit == Some(before) => Err(Error::NothingToCollect { vcpu }),
            0 => {
                ring.empty_full_exit = Some(before);
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

/// Takes every ring's published entries into `pending` and resets them.
fn drain(
    rings: &mut Rings,
    slots: &[Slot],
    vm: &OwnedFd,
    on_reset: &dyn Fn(std::time::Duration),
) -> Result<u64, Error> {
    let Rings {
        rings,
        pending,
        bad,
        resets,
    } = rings;
    let mut taken = 0;
    for ring in rings.iter_mut() {
        let vcpu = ring.vcpu;
        taken += u64::from(ring.collect(|gfn, index| place(pending, bad, slots, vcpu, gfn, index)));
    }
    if taken > 0 {
        let start = Instant::now();
        reset_dirty_rings(vm).map_err(kvm("KVM_RESET_DIRTY_RINGS"))?;
        *resets += 1;
        on_reset(start.elapsed());
    }
    Ok(taken)
}

/// Puts one harvested entry into `pending`; whether it named a page not
/// pending yet. An entry that names no tracked page marks its whole slot
/// dirty when the slot is known (nothing is lost) and is kept in `bad` as
/// the harvest's error.
pub(crate) fn place(
    pending: &mut DirtySet,
    bad: &mut Option<Error>,
    slots: &[Slot],
    vcpu: usize,
    gfn: DirtyGfn,
    index: u32,
) -> bool {
    match decode(&gfn, slots) {
        Ok((slot, page)) => {
            let bitmap = pending.bitmap_mut(slot);
            let fresh = !bitmap.is_dirty(page);
            let _ = bitmap.set(page);
            fresh
        }
        Err(e) => {
            if let EntryError::OffsetBeyondSlot(slot) = e {
                pending.bitmap_mut(slot).set_all();
            }
            bad.get_or_insert(Error::BadRingEntry {
                vcpu,
                index,
                slot: gfn.slot,
                offset: gfn.offset,
            });
            false
        }
    }
}
