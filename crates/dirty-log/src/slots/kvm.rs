//! The KVM half of the slots: who switches their logging, and what every
//! KVM backend holds.

use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use super::owner::Registrar;
use super::{Slot, SlotOwner, Slots};
use crate::error::{Error, kvm};
use crate::events::{DirtyEvents, Ioctl};
use crate::ioctls::{GuardedWords, get_dirty_log};

impl Slots {
    /// These slots, whose logging the VMM that registered them switches
    /// through `owner`: this crate never registers or re-registers them.
    pub fn owned_by(mut self, owner: impl SlotOwner + 'static) -> Self {
        self.owner = Some(Box::new(owner));
        self
    }

    /// Registers every slot with the VM whose fd is `vm`
    /// (`KVM_SET_USER_MEMORY_REGION`, logging off), and from then on
    /// switches their logging by registering them again: for a VMM that
    /// leaves its memslots to this crate.
    ///
    /// # Safety
    /// KVM maps the slots' memory into the guest: the caller keeps that
    /// memory mapped for as long as the VM can run.
    pub unsafe fn register(self, vm: &impl AsRawFd) -> Result<Self, Error> {
        // SAFETY: the caller's contract is this one's.
        let slots = unsafe { self.assume_registered(vm) }?;
        slots.set_logging(false, &crate::NoEvents)?;
        Ok(slots)
    }

    /// Says that the VMM registered each slot with the VM whose fd is `vm`
    /// with `KVM_SET_USER_MEMORY_REGION`, no flags and this memory, and
    /// lets this crate switch logging by registering them again. A VMM with
    /// other flags, `KVM_SET_USER_MEMORY_REGION2` or its own view of which
    /// slots log gives its [`SlotOwner`] instead ([`Slots::owned_by`]).
    ///
    /// # Safety
    /// Each slot is registered as said, and its memory stays mapped as long
    /// as the VM can run: re-registering a slot that does not exist would
    /// create it.
    pub unsafe fn assume_registered(self, vm: &impl AsRawFd) -> Result<Self, Error> {
        let vm = duplicate(vm)?;
        Ok(self.owned_by(Registrar { vm }))
    }

    /// Whether someone switches these slots' logging: [`Slots::owned_by`],
    /// [`Slots::register`] or [`Slots::assume_registered`].
    pub fn has_owner(&self) -> bool {
        self.owner.is_some()
    }

    /// Switches logging of every slot on or off through the owner.
    fn set_logging(&self, on: bool, events: &impl DirtyEvents) -> Result<(), Error> {
        let owner = self.owner.as_ref().ok_or(Error::NotRegistered)?;
        for slot in &self.slots {
            let start = Instant::now();
            owner
                .set_dirty_logging(slot, on)
                .map_err(|source| Error::Owner {
                    slot: slot.id,
                    source,
                })?;
            events.ioctl(Ioctl::SetMemoryRegion, start.elapsed());
        }
        Ok(())
    }
}

/// A descriptor of the same VM the VMM's handle holds, that a backend keeps.
pub(crate) fn duplicate(fd: &impl AsRawFd) -> Result<OwnedFd, Error> {
    // SAFETY: `fd` is borrowed for this call, so its descriptor is open
    // while it is duplicated.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd.as_raw_fd()) };
    borrowed
        .try_clone_to_owned()
        .map_err(kvm("fcntl(F_DUPFD_CLOEXEC) of the VM fd"))
}

/// What every backend holds: the VM, the slots, the events, whether
/// logging is on, and room for each slot's bitmap.
#[derive(Debug)]
pub(crate) struct Tracked<E> {
    pub vm: Arc<OwnedFd>,
    pub slots: Slots,
    pub events: E,
    pub enabled: bool,
    bitmaps: std::sync::Mutex<Vec<GuardedWords>>,
}

impl<E: DirtyEvents> Tracked<E> {
    pub fn new(vm: &impl AsRawFd, slots: Slots, events: E) -> Result<Self, Error> {
        let bitmaps = slots
            .as_slice()
            .iter()
            .map(|s| GuardedWords::new(s.pages.div_ceil(64) as usize))
            .collect::<Result<_, _>>()
            .map_err(kvm("mmap(dirty bitmap)"))?;
        Ok(Self {
            vm: Arc::new(duplicate(vm)?),
            slots,
            events,
            enabled: false,
            bitmaps: std::sync::Mutex::new(bitmaps),
        })
    }

    /// Starts a harvest: logging must be on. Returns the start time.
    pub fn start_harvest(&self) -> Result<Instant, Error> {
        if self.enabled {
            Ok(Instant::now())
        } else {
            Err(Error::Enabled(false))
        }
    }

    /// `KVM_GET_DIRTY_LOG` of the slot at position `index`, timed. A slot
    /// KVM no longer logs (removed, or registered again without logging)
    /// or that grew is [`Error::SlotChanged`].
    pub fn get_dirty_log(&self, index: usize) -> Result<Vec<u64>, Error> {
        let slot: &Slot = &self.slots.as_slice()[index];
        let mut bitmaps = self
            .bitmaps
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let result = self.timed(Ioctl::GetDirtyLog, || {
            // SAFETY: the words end at a guard page (`GuardedWords`).
            bitmaps[index].fill(|words| unsafe { get_dirty_log(&*self.vm, slot.id, words) })
        });
        result.map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT | libc::EFAULT) => Error::SlotChanged {
                slot: slot.id,
                pages: slot.pages,
            },
            _ => Error::Kvm {
                op: "KVM_GET_DIRTY_LOG",
                source: e,
            },
        })
    }

    pub fn set_logging(&mut self, on: bool) -> Result<(), Error> {
        if self.enabled == on {
            return Err(Error::Enabled(on));
        }
        self.slots.set_logging(on, &self.events)?;
        self.enabled = on;
        Ok(())
    }

    /// Runs ioctl `op`, reporting its time.
    pub fn timed<T>(&self, op: Ioctl, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let result = f();
        self.events.ioctl(op, start.elapsed());
        result
    }
}
