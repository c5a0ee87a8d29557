//! The few `userfaultfd(2)` calls post-copy needs: register guest memory
//! for missing-page faults, read the faults, and fill pages (which wakes
//! the threads waiting on them). Written here from the kernel's ABI
//! (`<linux/userfaultfd.h>`, x86-64) rather than taken from the
//! `userfaultfd` crate, whose bindings are generated at build time by
//! bindgen, which needs libclang and kernel headers on every machine that
//! builds this.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// `UFFD_API`: the protocol version asked for.
const UFFD_API: u64 = 0xAA;
/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
/// `_IOR(0xAA, 0x02, struct uffdio_range)`.
const UFFDIO_WAKE: libc::c_ulong = 0x8010_aa02;
/// `_IOWR(0xAA, 0x03, struct uffdio_copy)`.
const UFFDIO_COPY: libc::c_ulong = 0xc028_aa03;
/// `_IOWR(0xAA, 0x04, struct uffdio_zeropage)`.
const UFFDIO_ZEROPAGE: libc::c_ulong = 0xc020_aa04;
/// `UFFDIO_REGISTER_MODE_MISSING`: fault on pages not yet mapped.
const MODE_MISSING: u64 = 1;
/// `UFFD_EVENT_PAGEFAULT`.
const EVENT_PAGEFAULT: u8 = 0x12;
/// `sizeof(struct uffd_msg)`.
const MSG_BYTES: usize = 32;

#[repr(C)]
struct Api {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct Range {
    start: u64,
    len: u64,
}

#[repr(C)]
struct Register {
    range: Range,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct Copy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copied: i64,
}

#[repr(C)]
struct ZeroPage {
    range: Range,
    mode: u64,
    zeroed: i64,
}

/// What filling a page found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Filled {
    /// The page was filled, and its waiters woken.
    Now,
    /// It was there already (filled before, or written by its process).
    Already,
}

/// A userfaultfd: the faults on the memory registered with it come to
/// its reader, and each faulting thread waits until its page is filled.
#[derive(Debug)]
pub(crate) struct Userfaultfd {
    fd: OwnedFd,
}

impl Userfaultfd {
    /// Opens one (non-blocking) for faults from the kernel too: KVM's
    /// accesses to guest memory fault here as the guest's do.
    ///
    /// # Errors
    /// Where the kernel refuses it: no `CONFIG_USERFAULTFD`, a seccomp
    /// filter, or `vm.unprivileged_userfaultfd` 0 for a process without
    /// `CAP_SYS_PTRACE`.
    pub(crate) fn new() -> io::Result<Self> {
        // SAFETY: userfaultfd(2) takes flags only and returns a new fd.
        let fd =
            unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC | libc::O_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the fd was just returned to this process and nothing else owns it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let uffd = Self { fd };
        let mut api = Api {
            api: UFFD_API,
            features: 0,
            ioctls: 0,
        };
        uffd.ioctl(UFFDIO_API, &raw mut api)?;
        Ok(uffd)
    }

    /// Registers `len` bytes at `host` for missing-page faults: from now
    /// on a page there that is not mapped faults to this fd's reader.
    pub(crate) fn register(&self, host: *mut u8, len: usize) -> io::Result<()> {
        let mut register = Register {
            range: Range {
                start: host as u64,
                len: len as u64,
            },
            mode: MODE_MISSING,
            ioctls: 0,
        };
        self.ioctl(UFFDIO_REGISTER, &raw mut register)
    }

    /// Copies `src` into the registered page(s) at `dst` and wakes their
    /// waiters; a page there already is left as it is.
    pub(crate) fn copy(&self, dst: *mut u8, src: &[u8]) -> io::Result<Filled> {
        let mut copy = Copy {
            dst: dst as u64,
            src: src.as_ptr() as u64,
            len: src.len() as u64,
            mode: 0,
            copied: 0,
        };
        self.fill(UFFDIO_COPY, &raw mut copy, dst, src.len())
    }

    /// Maps zero pages at `dst` (`len` bytes) and wakes their waiters.
    pub(crate) fn zero(&self, dst: *mut u8, len: usize) -> io::Result<Filled> {
        let mut zero = ZeroPage {
            range: Range {
                start: dst as u64,
                len: len as u64,
            },
            mode: 0,
            zeroed: 0,
        };
        self.fill(UFFDIO_ZEROPAGE, &raw mut zero, dst, len)
    }

    /// A fill; where the page was there already, its waiters (if any
    /// raced the fill) are woken.
    fn fill<T>(
        &self,
        op: libc::c_ulong,
        arg: *mut T,
        dst: *mut u8,
        len: usize,
    ) -> io::Result<Filled> {
        match self.ioctl(op, arg) {
            Ok(()) => Ok(Filled::Now),
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => {
                let mut range = Range {
                    start: dst as u64,
                    len: len as u64,
                };
                self.ioctl(UFFDIO_WAKE, &raw mut range)?;
                Ok(Filled::Already)
            }
            Err(e) => Err(e),
        }
    }

    /// The faulting addresses waiting now, appended to `faults` (none if
    /// there are none).
    pub(crate) fn read_faults(&self, faults: &mut Vec<u64>) -> io::Result<()> {
        let mut msgs = [0u8; MSG_BYTES * 16];
        loop {
            // SAFETY: reads at most `msgs.len()` bytes into a local buffer.
            let n =
                unsafe { libc::read(self.fd.as_raw_fd(), msgs.as_mut_ptr().cast(), msgs.len()) };
            if n < 0 {
                let e = io::Error::last_os_error();
                return match e.kind() {
                    io::ErrorKind::WouldBlock => Ok(()),
                    io::ErrorKind::Interrupted => continue,
                    _ => Err(e),
                };
            }
            for msg in msgs[..n as usize].chunks_exact(MSG_BYTES) {
                if msg[0] == EVENT_PAGEFAULT {
                    faults.push(u64::from_ne_bytes(msg[16..24].try_into().expect("8 bytes")));
                }
            }
            if (n as usize) < msgs.len() {
                return Ok(());
            }
        }
    }

    /// The fd, to wait on beside others (readable: faults wait).
    pub(crate) fn raw_fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    /// Issues `op` with `arg`. Each `op` takes a pointer to the `T` its
    /// callers pass, laid out as the kernel's structure; the kernel reads
    /// and writes only that structure (and, for a copy, the source and
    /// destination ranges its callers own).
    fn ioctl<T>(&self, op: libc::c_ulong, arg: *mut T) -> io::Result<()> {
        // SAFETY: `arg` points to the structure `op` takes (see above).
        let rc = unsafe { libc::ioctl(self.fd.as_raw_fd(), op, arg) };
        match rc {
            0 => Ok(()),
            _ => Err(io::Error::last_os_error()),
        }
    }
}

/// Waits, `timeout` at most, until one of `fds` is readable; which are.
pub(crate) fn wait_readable(fds: &[i32], timeout: Duration) -> io::Result<Vec<bool>> {
    let mut polls: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
    // SAFETY: `polls` holds `polls.len()` pollfds for fds the caller owns.
    let n = unsafe { libc::poll(polls.as_mut_ptr(), polls.len() as libc::nfds_t, ms) };
    match n {
        0.. => Ok(polls.iter().map(|p| p.revents != 0).collect()),
        _ => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::Interrupted => Ok(vec![false; fds.len()]),
            e => Err(e),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An anonymous private mapping of `pages` pages.
    fn mapping(pages: usize) -> *mut u8 {
        // SAFETY: a fresh anonymous mapping; the test unmaps nothing (the
        // process ends soon).
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                pages * 4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        p.cast()
    }

    /// A thread touching a registered page waits until the page is
    /// copied in, then reads the copy; a page filled twice keeps the first.
    #[test]
    fn a_faulting_thread_waits_for_its_page_and_reads_what_was_copied() {
        let uffd = match Userfaultfd::new() {
            Ok(u) => u,
            Err(e) => {
                let why = format!("userfaultfd(2) is refused here: {e}");
                let test = "a_faulting_thread_waits_for_its_page_and_reads_what_was_copied";
                test_support::kvm::skip("migration", test, &why);
                return;
            }
        };
        let base = mapping(4);
        uffd.register(base, 4 * 4096).unwrap();
        let page = base as usize + 4096;
        // A reader of a page not filled yet: it waits for the fill.
        let reader = std::thread::spawn(move || byte_at(page + 8));
        let mut faults = Vec::new();
        while faults.is_empty() {
            wait_readable(&[uffd.raw_fd()], Duration::from_secs(10)).unwrap();
            uffd.read_faults(&mut faults).unwrap();
        }
        assert_eq!(faults[0] & !4095, page as u64);
        assert_eq!(
            uffd.copy(page as *mut u8, &[7u8; 4096]).unwrap(),
            Filled::Now
        );
        assert_eq!(reader.join().unwrap(), 7);
        assert_eq!(
            uffd.copy(page as *mut u8, &[9u8; 4096]).unwrap(),
            Filled::Already
        );
        assert_eq!(uffd.zero(base, 4096).unwrap(), Filled::Now);
        assert_eq!(byte_at(page + 8), 7);
        assert_eq!(byte_at(base as usize + 8), 0);
    }

    /// The byte at `addr`, inside the test's mapping.
    fn byte_at(addr: usize) -> u8 {
        // SAFETY: the callers pass addresses inside their mapping, which
        // lives on; a page not filled yet makes the read wait for its fill.
        unsafe { std::ptr::read_volatile(addr as *const u8) }
    }
}
