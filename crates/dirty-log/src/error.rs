//! Why a dirty-log operation failed.

use crate::bitmap::BitmapError;

/// Errors of the dirty-log backends. None of them loses a dirty page: a
/// harvest that fails part-way has merged what it read, and a ring entry that
/// cannot be placed marks its whole slot dirty.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A KVM ioctl failed.
    #[error("{op} failed: {source}")]
    Kvm {
        /// The ioctl.
        op: &'static str,
        /// The error it returned.
        source: std::io::Error,
    },
    /// KVM lacks a capability this backend needs.
    #[error("KVM does not support {0}")]
    Unsupported(&'static str),
    /// A bitmap operation was refused.
    #[error(transparent)]
    Bitmap(#[from] BitmapError),
    /// A guest memory region has no host mapping.
    #[error("memory slot {slot}: {reason}")]
    Memory {
        /// The slot.
        slot: u32,
        /// What is wrong with it.
        reason: String,
    },
    /// A dirty-ring entry named a slot or page that does not exist.
    #[error(
        "vCPU {vcpu} dirty ring entry {index}: slot {slot} offset {offset} is not a tracked page"
    )]
    BadRingEntry {
        /// The vCPU whose ring held it.
        vcpu: usize,
        /// Its index in the ring.
        index: u32,
        /// The raw slot field (address space in the high 16 bits).
        slot: u32,
        /// The raw page offset.
        offset: u64,
    },
    /// A configuration value was out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The operation needs logging enabled (or disabled) first.
    #[error("dirty logging is {}", if *.0 { "already enabled" } else { "not enabled" })]
    Enabled(bool),
    /// Logging was asked of slots no one switches: this crate never
    /// registers a slot it was not told about (that would create it).
    #[error(
        "no one switches these slots' dirty logging: give the VMM's SlotOwner \
         (Slots::owned_by), or let this crate register them (Slots::register, \
         Slots::assume_registered)"
    )]
    NotRegistered,
    /// The slot's owner failed to turn its logging on or off.
    #[error("switching dirty logging of slot {slot} failed: {source}")]
    Owner {
        /// The slot.
        slot: u32,
        /// What the owner returned.
        source: std::io::Error,
    },
    /// KVM no longer logs a tracked slot as it was described: it was
    /// removed, registered again without logging, or replaced by a larger
    /// one while tracked. Its pages since the last harvest are unknown:
    /// copy the whole slot again (or stop), never skip it.
    #[error(
        "slot {slot} ({pages} pages) changed while tracked: removed, resized or registered again \
         without dirty logging"
    )]
    SlotChanged {
        /// The slot.
        slot: u32,
        /// Its pages as tracked.
        pages: u64,
    },
    /// A vCPU's ring is not there to attach: the VM's dirty ring was not
    /// enabled before the vCPU was created, or is smaller than asked for.
    #[error(
        "vCPU {vcpu} has no dirty ring of {bytes} bytes: enable_dirty_ring with that size before \
         creating the vCPUs"
    )]
    RingNotEnabled {
        /// The vCPU.
        vcpu: usize,
        /// The ring size asked for.
        bytes: u32,
    },
    /// The dirty-ring backend has no vCPU ring to harvest.
    #[error(
        "no vCPU's dirty ring is attached: enable the ring before creating the vCPUs \
         (enable_dirty_ring), then attach each (KvmDirtyRing::attach)"
    )]
    NoRing,
    /// A vCPU left the guest because its ring was full, and there was
    /// nothing to collect: its ring is not attached, or it was full again
    /// with no reset since (KVM's ring and the VMM's view disagree).
    /// Re-entering would exit again at once.
    #[error(
        "vCPU {vcpu} exited with a full dirty ring and there is nothing to collect: its ring is \
         not attached (KvmDirtyRing::attach), or is full again with no reset since"
    )]
    NothingToCollect {
        /// The vCPU.
        vcpu: usize,
    },
    /// The background clear worker stopped.
    #[error("the clear worker stopped: {0}")]
    Worker(String),
}

/// Wraps an ioctl error with its name.
#[cfg(feature = "kvm")]
pub(crate) fn kvm(op: &'static str) -> impl Fn(std::io::Error) -> Error {
    move |source| Error::Kvm { op, source }
}
