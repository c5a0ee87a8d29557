//! The dirty-logging ioctls kvm-ioctls does not wrap, defined with
//! vmm-sys-util's macros, and the dirty ring's entry layout.

use kvm_bindings::{kvm_clear_dirty_log, kvm_clear_dirty_log__bindgen_ty_1};
use kvm_ioctls::VmFd;
use vmm_sys_util::errno;
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref};

/// The request numbers, from `include/uapi/linux/kvm.h`.
mod nr {
    use kvm_bindings::kvm_clear_dirty_log;

    const KVMIO: u32 = 0xAE;
    vmm_sys_util::ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
    vmm_sys_util::ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);
}
use nr::{KVM_CLEAR_DIRTY_LOG, KVM_RESET_DIRTY_RINGS};

/// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` flag: start with every page dirty and
/// unprotected, so enabling costs nothing and protection happens per CLEAR.
pub const MANUAL_PROTECT_INITIALLY_SET: u64 = 2;

/// A dirty-ring entry flag: KVM published this entry.
pub const DIRTY_GFN_F_DIRTY: u32 = 1;
/// A dirty-ring entry flag: the VMM harvested it; KVM may reuse it after
/// `KVM_RESET_DIRTY_RINGS`.
pub const DIRTY_GFN_F_RESET: u32 = 2;

/// One dirty-ring entry, `struct kvm_dirty_gfn`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DirtyGfn {
    /// `DIRTY_GFN_F_*`.
    pub flags: u32,
    /// Address space (high 16 bits) and slot id (low 16 bits).
    pub slot: u32,
    /// Page offset within the slot.
    pub offset: u64,
}

/// `KVM_CLEAR_DIRTY_LOG`: re-protects the pages of `slot` from `first_page`
/// on, for `num_pages`, whose bits are set in `words` (KVM's layout, word 0
/// for `first_page`). `first_page` and `num_pages` must be multiples of 64,
/// except that the range may end at the slot's end.
pub fn clear_dirty_log(
    vm: &VmFd,
    slot: u32,
    first_page: u64,
    num_pages: u32,
    words: &[u64],
) -> Result<(), errno::Error> {
    if words.len() < (num_pages as usize).div_ceil(64) || first_page % 64 != 0 {
        return Err(errno::Error::new(libc::EINVAL));
    }
    let clear = kvm_clear_dirty_log {
        slot,
        num_pages,
        first_page,
        __bindgen_anon_1: kvm_clear_dirty_log__bindgen_ty_1 {
            dirty_bitmap: words.as_ptr() as *mut libc::c_void,
        },
    };
    // SAFETY: KVM reads `clear` and ceil(num_pages / 64) words from the bitmap
    // pointer, which `words` covers (checked above); it writes nothing back.
    let ret = unsafe { ioctl_with_ref(vm, KVM_CLEAR_DIRTY_LOG(), &clear) };
    if ret == 0 {
        Ok(())
    } else {
        Err(errno::Error::last())
    }
}

/// `KVM_RESET_DIRTY_RINGS`: re-protects every entry marked reset in every
/// vCPU's ring and frees them; returns how many were reset.
pub fn reset_dirty_rings(vm: &VmFd) -> Result<u32, errno::Error> {
    // SAFETY: the ioctl takes no argument and touches only KVM's own state.
    let ret = unsafe { ioctl(vm, KVM_RESET_DIRTY_RINGS()) };
    u32::try_from(ret).map_err(|_| errno::Error::last())
}
