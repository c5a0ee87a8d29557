//! The dirty-logging ioctls, issued on whatever file descriptor the VMM
//! holds (a kvm-ioctls `VmFd` of any version, or its own), defined with
//! vmm-sys-util's macros over kvm-bindings' structures (private: none of
//! them is in the API); and the dirty ring's entry layout.

use std::io;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;

use kvm_bindings::{
    kvm_clear_dirty_log, kvm_clear_dirty_log__bindgen_ty_1, kvm_dirty_log,
    kvm_dirty_log__bindgen_ty_1, kvm_enable_cap, kvm_userspace_memory_region,
};
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref, ioctl_with_val};

/// The request numbers, from `include/uapi/linux/kvm.h`.
mod nr {
    use kvm_bindings::{
        kvm_clear_dirty_log, kvm_dirty_log, kvm_enable_cap, kvm_userspace_memory_region,
    };

    const KVMIO: u32 = 0xAE;
    vmm_sys_util::ioctl_io_nr!(KVM_CHECK_EXTENSION, KVMIO, 0x03);
    vmm_sys_util::ioctl_iow_nr!(KVM_GET_DIRTY_LOG, KVMIO, 0x42, kvm_dirty_log);
    vmm_sys_util::ioctl_iow_nr!(
        KVM_SET_USER_MEMORY_REGION,
        KVMIO,
        0x46,
        kvm_userspace_memory_region
    );
    vmm_sys_util::ioctl_iow_nr!(KVM_ENABLE_CAP, KVMIO, 0xa3, kvm_enable_cap);
    vmm_sys_util::ioctl_iowr_nr!(KVM_CLEAR_DIRTY_LOG, KVMIO, 0xc0, kvm_clear_dirty_log);
    vmm_sys_util::ioctl_io_nr!(KVM_RESET_DIRTY_RINGS, KVMIO, 0xc7);
}

/// `KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2` flag: start with every page dirty and
/// unprotected, so enabling costs nothing and protection happens per CLEAR.
pub const MANUAL_PROTECT_INITIALLY_SET: u64 = 2;

/// `KVM_MEM_LOG_DIRTY_PAGES`: the memslot flag that turns logging on.
pub const KVM_MEM_LOG_DIRTY_PAGES: u32 = 1;

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

/// An ioctl's return value as a result.
fn checked(ret: i32) -> io::Result<i32> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `KVM_CHECK_EXTENSION` on the VM: what it says of capability `cap` (0:
/// not supported).
pub fn check_extension(vm: &impl AsRawFd, cap: u32) -> i32 {
    // SAFETY: the ioctl takes an integer and returns one; it touches no memory.
    let ret = unsafe { ioctl_with_val(vm, nr::KVM_CHECK_EXTENSION(), cap.into()) };
    ret.max(0)
}

/// `KVM_ENABLE_CAP` on the VM: capability `cap` with `arg0`.
pub fn enable_cap(vm: &impl AsRawFd, cap: u32, arg0: u64) -> io::Result<()> {
    let mut enable = kvm_enable_cap {
        cap,
        ..Default::default()
    };
    enable.args[0] = arg0;
    // SAFETY: KVM reads one `kvm_enable_cap`, which lives for the call.
    checked(unsafe { ioctl_with_ref(vm, nr::KVM_ENABLE_CAP(), &enable) }).map(drop)
}

/// `KVM_SET_USER_MEMORY_REGION`: (re-)registers slot `slot` with `flags`.
///
/// # Safety
/// KVM maps `bytes` from `host_addr` into the guest: that memory must stay
/// mapped for as long as the VM can run with this slot.
pub unsafe fn set_user_memory_region(
    vm: &impl AsRawFd,
    slot: u32,
    flags: u32,
    guest_addr: u64,
    bytes: u64,
    host_addr: u64,
) -> io::Result<()> {
    let region = kvm_userspace_memory_region {
        slot,
        flags,
        guest_phys_addr: guest_addr,
        memory_size: bytes,
        userspace_addr: host_addr,
    };
    // SAFETY: KVM reads one region description; the mapping it names is
    // the caller's to keep (this function's contract).
    checked(unsafe { ioctl_with_ref(vm, nr::KVM_SET_USER_MEMORY_REGION(), &region) }).map(drop)
}

/// `KVM_GET_DIRTY_LOG` of slot `slot` into `bitmap`, whose bytes KVM fills
/// for the slot as KVM has it.
///
/// # Safety
/// `bitmap` must be valid for writes for as many bytes as KVM's slot has
/// bitmap, or be followed by memory whose writes fail (a guard page, as
/// [`GuardedWords`] has): KVM writes its whole bitmap.
pub unsafe fn get_dirty_log(vm: &impl AsRawFd, slot: u32, bitmap: NonNull<u64>) -> io::Result<()> {
    let log = kvm_dirty_log {
        slot,
        padding1: 0,
        __bindgen_anon_1: kvm_dirty_log__bindgen_ty_1 {
            dirty_bitmap: bitmap.as_ptr().cast(),
        },
    };
    // SAFETY: KVM reads `log` and writes the slot's bitmap through its
    // pointer, which the caller's contract covers.
    checked(unsafe { ioctl_with_ref(vm, nr::KVM_GET_DIRTY_LOG(), &log) }).map(drop)
}

/// `KVM_CLEAR_DIRTY_LOG`: re-protects the pages of `slot` from `first_page`
/// on, for `num_pages`, whose bits are set in `words` (KVM's layout, word 0
/// for `first_page`). `first_page` and `num_pages` must be multiples of 64,
/// except that the range may end at the slot's end.
pub fn clear_dirty_log(
    vm: &impl AsRawFd,
    slot: u32,
    first_page: u64,
    num_pages: u32,
    words: &[u64],
) -> io::Result<()> {
    if words.len() < (num_pages as usize).div_ceil(64) || first_page % 64 != 0 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
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
    checked(unsafe { ioctl_with_ref(vm, nr::KVM_CLEAR_DIRTY_LOG(), &clear) }).map(drop)
}

/// `KVM_RESET_DIRTY_RINGS`: re-protects every entry marked reset in every
/// vCPU's ring and frees them; returns how many were reset.
pub fn reset_dirty_rings(vm: &impl AsRawFd) -> io::Result<u32> {
    // SAFETY: the ioctl takes no argument and touches only KVM's own state.
    checked(unsafe { ioctl(vm, nr::KVM_RESET_DIRTY_RINGS()) }).map(|n| n as u32)
}

/// Room for a slot's dirty bitmap that ends at an inaccessible page, so
/// that KVM's copy of a larger bitmap than expected (the slot was replaced
/// by a larger one) fails with `EFAULT` instead of writing past it.
#[derive(Debug)]
pub struct GuardedWords {
    map: NonNull<libc::c_void>,
    map_len: usize,
    words: usize,
}

// SAFETY: the mapping is owned by this value and only reached through it.
unsafe impl Send for GuardedWords {}
// SAFETY: as above; `&self` methods only read the mapping's address.
unsafe impl Sync for GuardedWords {}

impl GuardedWords {
    /// Room for `words` words, followed by a guard page.
    pub fn new(words: usize) -> io::Result<Self> {
        let page = super::PAGE_SIZE as usize;
        let data = (words * 8).next_multiple_of(page).max(page);
        let map_len = data + page;
        // SAFETY: a fresh anonymous mapping; the result is checked.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                map_len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let guarded = Self {
            map: NonNull::new(addr).ok_or_else(io::Error::last_os_error)?,
            map_len,
            words,
        };
        // SAFETY: the last page of the mapping just made.
        let guard = unsafe { addr.cast::<u8>().add(data) };
        // SAFETY: changes the protection of a page of this mapping only.
        checked(unsafe { libc::mprotect(guard.cast(), page, libc::PROT_NONE) })?;
        Ok(guarded)
    }

    /// Where the words start: they end right at the guard page.
    pub fn start(&self) -> NonNull<u64> {
        let data = self.map_len - super::PAGE_SIZE as usize;
        // SAFETY: `data - 8 * words` is within the mapping's data pages.
        unsafe { self.map.cast::<u8>().add(data - 8 * self.words).cast() }
    }

    /// Zeroes the words, lets `fill` write them, and returns them.
    pub fn fill(
        &mut self,
        fill: impl FnOnce(NonNull<u64>) -> io::Result<()>,
    ) -> io::Result<Vec<u64>> {
        let start = self.start();
        // SAFETY: `words` u64s from `start` are mapped, writable and
        // aligned, and `&mut self` makes this the only access.
        unsafe { start.as_ptr().write_bytes(0, self.words) };
        fill(start)?;
        // SAFETY: as above; `fill` has returned.
        Ok(unsafe { std::slice::from_raw_parts(start.as_ptr(), self.words) }.to_vec())
    }
}

impl Drop for GuardedWords {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made, once.
        unsafe { libc::munmap(self.map.as_ptr(), self.map_len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guarded_words_end_at_a_page_that_refuses_writes() {
        let mut g = GuardedWords::new(3).unwrap();
        let words = g
            .fill(|p| {
                // SAFETY: the three words are the mapping's.
                unsafe { p.as_ptr().add(2).write(7) };
                Ok(())
            })
            .unwrap();
        assert_eq!(words, [0, 0, 7]);
        // The byte after the last word is the guard page: the kernel's
        // write there fails as KVM's copy of a larger bitmap would.
        let after = g.start().as_ptr().wrapping_add(3);
        let src = 0u64;
        let local = libc::iovec {
            iov_base: (&raw const src).cast_mut().cast(),
            iov_len: 8,
        };
        let remote = libc::iovec {
            iov_base: after.cast(),
            iov_len: 8,
        };
        // SAFETY: the kernel checks the remote range and fails on the guard.
        let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
        assert_eq!(n, -1, "the guard page refused the write");
        assert_eq!(g.fill(|_| Ok(())).unwrap(), [0, 0, 0], "zeroed each time");
    }

    #[test]
    fn clear_ranges_must_be_covered_and_aligned() {
        let err = clear_dirty_log(&std::io::stdin(), 0, 1, 64, &[0]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
        let err = clear_dirty_log(&std::io::stdin(), 0, 0, 128, &[0]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EINVAL));
    }
}
