//! The KVM half of the slots: registering them with a VM, switching logging
//! on and off, and what every KVM backend holds.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use kvm_bindings::{KVM_MEM_LOG_DIRTY_PAGES, kvm_userspace_memory_region};
use kvm_ioctls::VmFd;

use super::{PAGE_SIZE, Slot, Slots, VmmWrites};
use crate::error::{Error, kvm};
use crate::events::{DirtyEvents, Ioctl};

impl<B: VmmWrites> Slots<B> {
    /// Registers every slot with KVM (`KVM_SET_USER_MEMORY_REGION`), logging off:
    /// what a VMM does once when it creates the VM.
    ///
    /// # Safety
    /// KVM maps the regions' memory into the guest: the caller keeps that
    /// memory mapped for as long as the VM can run (these slots hold a handle
    /// to it, so keeping them alive beside the VM is enough).
    pub unsafe fn register(&self, vm: &VmFd) -> Result<(), Error> {
        self.set_logging(vm, false, &crate::NoEvents)?;
        self.registered.store(true, Relaxed);
        Ok(())
    }

    /// Says that the VMM registered these slots with the VM itself, so that
    /// a KVM backend may switch their logging. Without this or
    /// [`register`](Self::register), enabling logging is
    /// [`Error::NotRegistered`]: re-registering a slot that does not exist
    /// would create it.
    ///
    /// # Safety
    /// Each slot is registered with the VM the backend will use, as its id,
    /// with this memory's region (its guest address, size and host mapping),
    /// and that memory stays mapped as long as the VM can run: a backend
    /// re-registers the slots to switch logging on and off.
    pub unsafe fn assume_registered(&self) {
        self.registered.store(true, Relaxed);
    }

    /// Whether [`register`](Self::register) or
    /// [`assume_registered`](Self::assume_registered) was called.
    pub fn is_registered(&self) -> bool {
        self.registered.load(Relaxed)
    }

    /// Re-registers every slot with logging on or off.
    pub(crate) fn set_logging(
        &self,
        vm: &VmFd,
        on: bool,
        events: &impl DirtyEvents,
    ) -> Result<(), Error> {
        for s in &self.slots {
            let region = kvm_userspace_memory_region {
                slot: s.id,
                flags: if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
                guest_phys_addr: s.guest_addr,
                memory_size: s.pages * PAGE_SIZE,
                userspace_addr: s.host_addr,
            };
            let start = Instant::now();
            // SAFETY: the mapping of a region of `self.memory`, which these
            // slots keep alive; its registration for the VM's lifetime is the
            // caller's, as with any memory a VMM registers (see `register`).
            unsafe { vm.set_user_memory_region(region) }
                .map_err(kvm("KVM_SET_USER_MEMORY_REGION"))?;
            events.ioctl(Ioctl::SetMemoryRegion, start.elapsed());
        }
        Ok(())
    }
}

/// What every backend holds: the VM, the slots, the events, and whether
/// logging is on.
#[derive(Debug)]
pub(crate) struct Tracked<B: VmmWrites, E> {
    pub vm: Arc<VmFd>,
    pub slots: Slots<B>,
    pub events: E,
    pub enabled: bool,
}

impl<B: VmmWrites, E: DirtyEvents> Tracked<B, E> {
    pub fn new(vm: Arc<VmFd>, slots: Slots<B>, events: E) -> Self {
        Self {
            vm,
            slots,
            events,
            enabled: false,
        }
    }

    /// Starts a harvest: logging must be on. Returns the start time.
    pub fn start_harvest(&self) -> Result<Instant, Error> {
        if self.enabled {
            Ok(Instant::now())
        } else {
            Err(Error::Enabled(false))
        }
    }

    /// `KVM_GET_DIRTY_LOG` of `slot`, timed.
    pub fn get_dirty_log(&self, slot: &Slot) -> Result<Vec<u64>, Error> {
        let size = (slot.pages * PAGE_SIZE) as usize;
        self.timed(Ioctl::GetDirtyLog, || self.vm.get_dirty_log(slot.id, size))
            .map_err(kvm("KVM_GET_DIRTY_LOG"))
    }

    pub fn set_logging(&mut self, on: bool) -> Result<(), Error> {
        if self.enabled == on {
            return Err(Error::Enabled(on));
        }
        if !self.slots.is_registered() {
            return Err(Error::NotRegistered);
        }
        self.slots.set_logging(&self.vm, on, &self.events)?;
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
