//! Dirty-page tracking for live migration and snapshots.
//!
//! A VMM copying a running guest's memory must know which pages the guest (and
//! the VMM's own devices) wrote since the last copy. KVM offers three ways to
//! learn it, `KVM_GET_DIRTY_LOG` bitmaps, manual protect with
//! `KVM_CLEAR_DIRTY_LOG`, and the per-vCPU dirty ring, and none of them sees
//! the VMM's own writes. This crate puts them behind one API, merges the VMM's
//! writes in, and moves the heavy clear/protect work off the vCPU threads.
//!
//! # Shape
//! - [`DirtyBitmap`]: one bit per page of a memory slot, in KVM's `u64` word layout.
//! - [`DirtyLog`]: enable, harvest into a [`DirtySet`], disable; backends
//!   [`KvmBitmap`], [`KvmManualProtect`] and [`KvmDirtyRing`], on the VMM's
//!   own VM fd (`impl AsRawFd`). Each merges the VMM's writes ([`VmmWrites`]).
//! - [`Slots`]: plain data ([`Slot`]: id, guest and host address, size), any
//!   subset of the VM's; from vm-memory's `GuestMemoryMmap` of 0.16, 0.17 or
//!   0.18 with [`Slots::from_memory`] (features `vm-memory-0-*`). The VMM that
//!   owns the memslots switches their logging ([`SlotOwner`]), or leaves
//!   them to this crate ([`Slots::register`]).
//! - [`precopy`]: rounds that always clear before they copy;
//!   [`copy_round_pipelined`] clears on a background thread, in bounded chunks.
//! - [`DirtyEvents`] with the no-op [`NoEvents`], and [`DirtyStats`].
//! - [`rate`]: [`DirtyRate`], pages dirtied per second per vCPU or slot, and
//!   [`DirtyLimit`], a pause per writing vCPU that brings the rate to a
//!   target.
//!
//! # Example
//! ```
//! use dirty_log::DirtyBitmap;
//!
//! let mut bitmap = DirtyBitmap::new(100);
//! bitmap.set(3).unwrap();
//! bitmap.set(64).unwrap();
//! bitmap.set(65).unwrap();
//! assert_eq!(bitmap.count(), 3);
//! assert_eq!(bitmap.runs().collect::<Vec<_>>(), [(3, 1), (64, 2)]);
//! assert_eq!(bitmap.as_kvm_words(), &[1 << 3, 0b11]);
//! ```

#![deny(missing_docs)]

pub mod bitmap;
pub mod error;
pub mod events;
#[cfg(any(
    feature = "vm-memory-0-16",
    feature = "vm-memory-0-17",
    feature = "vm-memory-0-18"
))]
pub mod guest_memory;
#[cfg(all(feature = "kvm", any(test, feature = "fuzzing")))]
pub mod invariants;
#[cfg(feature = "kvm")]
pub mod ioctls;
#[cfg(feature = "kvm")]
pub mod kvm_bitmap;
pub mod log;
#[cfg(feature = "kvm")]
pub mod manual;
#[cfg(feature = "kvm")]
#[doc(hidden)]
pub mod perf;
pub mod precopy;
pub mod rate;
#[cfg(feature = "kvm")]
pub mod ring;
pub mod slot;
pub mod slots;

pub use bitmap::{BitmapError, DirtyBitmap, Runs};
pub use error::Error;
pub use events::{DirtyEvents, DirtyStats, Ioctl, NoEvents};
#[cfg(any(
    feature = "vm-memory-0-16",
    feature = "vm-memory-0-17",
    feature = "vm-memory-0-18"
))]
pub use guest_memory::{GuestRegions, RegionBitmap};
#[cfg(feature = "kvm")]
pub use kvm_bitmap::KvmBitmap;
pub use log::{DirtyLog, DirtySet};
#[cfg(feature = "kvm")]
pub use manual::{KvmManualProtect, ManualConfig};
#[cfg(feature = "kvm")]
pub use precopy::copy_round_pipelined;
pub use precopy::{CopyRun, copy_round};
pub use rate::{DEFAULT_HALF_LIFE, DirtyLimit, DirtyRate};
#[cfg(feature = "kvm")]
pub use ring::{KvmDirtyRing, RingFull, RingMode, enable_dirty_ring};
pub use slot::{PAGE_SIZE, Slot};
#[cfg(feature = "kvm")]
pub use slots::SlotOwner;
pub use slots::{Slots, VmmWrites};

// The README's examples are doctests too: they use KVM and vm-memory 0.18.
#[cfg(all(doctest, feature = "kvm", feature = "vm-memory-0-18"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
