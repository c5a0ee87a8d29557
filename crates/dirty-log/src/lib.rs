//! Dirty-page tracking for live migration and snapshots.
//!
//! A VMM copying a running guest's memory must know which pages the guest (and
//! the VMM's own devices) wrote since the last copy. KVM offers three ways to
//! learn it — `KVM_GET_DIRTY_LOG` bitmaps, manual protect with `KVM_CLEAR_DIRTY_LOG`,
//! and the per-vCPU dirty ring — and none of them sees the VMM's own writes. This
//! crate puts them behind one API, merges the VMM's writes in, and moves the heavy
//! clear/protect work off the vCPU threads.
//!
//! # Shape
//! - [`DirtyBitmap`]: one bit per page of a memory slot, in KVM's `u64` word layout.
//! - The `DirtyLog` trait and its KVM backends are planned; see the README's status.
//!
//! # Example
//! ```
//! use dirty_log::DirtyBitmap;
//!
//! let mut bitmap = DirtyBitmap::new(100);
//! bitmap.set(3).unwrap();
//! bitmap.set(64).unwrap();
//! assert_eq!(bitmap.count(), 2);
//! assert_eq!(bitmap.as_kvm_words(), &[1 << 3, 1]);
//! ```

#![deny(missing_docs)]

pub mod bitmap;

pub use bitmap::{BitmapError, DirtyBitmap};

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
