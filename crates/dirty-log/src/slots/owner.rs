//! Who owns the memslots: the hook through which logging is switched on
//! and off, so that a VMM that registers its own slots (with
//! `KVM_SET_USER_MEMORY_REGION2`, its own flags, guest_memfd) keeps them,
//! and this crate's own registration for a VMM that leaves them to it.

use std::fmt::Debug;
use std::io;
use std::os::fd::OwnedFd;

use super::{PAGE_SIZE, Slot};
use crate::ioctls::{KVM_MEM_LOG_DIRTY_PAGES, set_user_memory_region};

/// Turns KVM's dirty logging on and off for the slots a VMM registered:
/// the VMM implements it with what it already does to log (Cloud
/// Hypervisor's `start_dirty_log`: `KVM_SET_USER_MEMORY_REGION2` with its
/// other flags as they are).
///
/// ```
/// use std::io;
/// use dirty_log::{Slot, SlotOwner};
///
/// /// A VMM's memslot table (here, flags by slot id).
/// #[derive(Debug)]
/// struct MyVmm { flags: std::sync::Mutex<Vec<(u32, u32)>> }
///
/// impl SlotOwner for MyVmm {
///     fn set_dirty_logging(&self, slot: &Slot, on: bool) -> io::Result<()> {
///         let mut table = self.flags.lock().unwrap();
///         let (_, flags) = table.iter_mut().find(|(id, _)| *id == slot.id)
///             .ok_or_else(|| io::Error::other(format!("no slot {}", slot.id)))?;
///         *flags = if on { *flags | 1 } else { *flags & !1 }; // KVM_MEM_LOG_DIRTY_PAGES
///         // ... then re-register the slot with `*flags`, as the VMM does.
///         Ok(())
///     }
/// }
/// ```
pub trait SlotOwner: Send + Sync + Debug {
    /// Sets (`on`) or clears `KVM_MEM_LOG_DIRTY_PAGES` on `slot`, leaving
    /// its other flags, its memory and its id as they are. Called for each
    /// tracked slot when a backend is enabled and disabled, from the thread
    /// that calls `enable`/`disable`.
    fn set_dirty_logging(&self, slot: &Slot, on: bool) -> io::Result<()>;
}

/// This crate's own registration: `KVM_SET_USER_MEMORY_REGION` with flags
/// `KVM_MEM_LOG_DIRTY_PAGES` or 0, for slots registered that way with no
/// other flag (by [`Slots::register`](super::Slots::register), or by the
/// VMM: [`Slots::assume_registered`](super::Slots::assume_registered)).
#[derive(Debug)]
pub(crate) struct Registrar {
    pub vm: OwnedFd,
}

impl SlotOwner for Registrar {
    fn set_dirty_logging(&self, slot: &Slot, on: bool) -> io::Result<()> {
        let flags = if on { KVM_MEM_LOG_DIRTY_PAGES } else { 0 };
        // SAFETY: the slot's memory is as it was registered; keeping it
        // mapped is the contract of `register`/`assume_registered`, which
        // alone make a `Registrar`.
        unsafe {
            set_user_memory_region(
                &self.vm,
                slot.id,
                flags,
                slot.guest_addr,
                slot.pages * PAGE_SIZE,
                slot.host_addr,
            )
        }
    }
}
