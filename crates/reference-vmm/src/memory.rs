//! Guest memory as this VMM maps it.

use vm_memory::GuestMemoryMmap;
use vm_memory::bitmap::AtomicBitmap;

/// Guest memory: vm-memory's mmap regions with a dirty bitmap of the VMM's
/// own writes, which a migration's dirty log merges with KVM's.
pub type VmMemory = GuestMemoryMmap<AtomicBitmap>;
