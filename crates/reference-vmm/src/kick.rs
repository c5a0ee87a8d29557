//! Kicking a vCPU thread out of `KVM_RUN`, without a lost kick and without writing
//! `kvm_run` from a signal handler.
//!
//! # Strategy
//! The kick is a real-time signal ([`kick_signal`]) sent with `pthread_kill`. Each
//! vCPU thread keeps it **blocked** at all times, and tells KVM, with
//! `KVM_SET_SIGNAL_MASK`, to unblock it only while the thread is inside `KVM_RUN`:
//!
//! - kick while the thread is in the guest: KVM sees the pending signal, leaves
//!   the guest and `KVM_RUN` returns `EINTR`;
//! - kick while the thread is in the VMM (even a moment before it calls `KVM_RUN`):
//!   the signal stays pending, so the next `KVM_RUN` returns `EINTR` at once
//!   instead of entering the guest. No kick is ever lost.
//!
//! After `EINTR` the thread consumes the pending signal ([`acknowledge`]) and looks
//! at its requests. The requester sets its request flag *before* sending the
//! signal, so a thread that consumes the signal always sees the flag.
//!
//! Interrupt delivery kicks only a vCPU whose run state says it is in the
//! guest, and a vCPU publishes that state *before* it looks for pending
//! interrupts ([`crate::irq`] has the whole handshake). So the one kick that
//! can arrive after the vCPU's last look is one sent between that look and
//! `KVM_RUN`, and the second case above keeps it.
//!
//! This is QEMU's original scheme. The alternative, setting `kvm_run.immediate_exit`
//! from the signal handler, needs a second mutable path to the `kvm_run` page that
//! kvm-ioctls' `VcpuFd::set_kvm_immediate_exit(&mut self)` cannot offer soundly
//! (rust-vmm/kvm issue 373); this scheme needs no access to `kvm_run` at all.

use std::os::raw::c_int;
use std::sync::{Mutex, OnceLock, PoisonError};

use kvm_ioctls::VcpuFd;
use vmm_sys_util::errno::Error as Errno;
use vmm_sys_util::ioctl::ioctl_with_ref;
use vmm_sys_util::signal::{self, Killable, SIGRTMIN};

/// The one vCPU ioctl this needs that kvm-ioctls does not wrap.
mod ioctls {
    use kvm_bindings::{KVMIO, kvm_signal_mask};
    vmm_sys_util::ioctl_iow_nr!(KVM_SET_SIGNAL_MASK, KVMIO, 0x8b, kvm_signal_mask);
}

/// Bytes of the kernel's `sigset_t` on x86-64 (64 signals).
const KERNEL_SIGSET_BYTES: usize = 8;

/// `struct kvm_signal_mask` followed by its sigset, as the ioctl reads it.
#[repr(C)]
struct SignalMask {
    len: u32,
    sigset: [u8; KERNEL_SIGSET_BYTES],
}

/// The signal that kicks vCPU threads: the first real-time signal.
pub fn kick_signal() -> c_int {
    SIGRTMIN()
}

/// The signal a vCPU's own host timer kicks it with (`--timer-placement
/// vcpu-thread`): a signal of its own, blocked and unblocked in `KVM_RUN` as
/// the kick is, which the timer consumes when it takes its expiry, so
/// taking one never consumes a kick.
pub fn timer_signal() -> c_int {
    SIGRTMIN() + 1
}

/// Why a vCPU thread cannot be kicked, or a kick cannot be consumed: the
/// host refused a signal operation, never the guest's doing.
#[derive(Debug, thiserror::Error)]
pub enum KickError {
    /// The handler that keeps the kick signal from ending the process.
    #[error("cannot install the kick signal handler: {0}")]
    InstallHandler(#[source] Errno),
    /// Blocking the kick signal outside `KVM_RUN`. (vmm-sys-util's signal
    /// errors are not `std::error::Error`s, so they are shown, not chained.)
    #[error("cannot block signal {signal}: {cause}")]
    Block {
        /// The kick signal.
        signal: c_int,
        /// Why.
        cause: signal::Error,
    },
    /// Reading the thread's signal mask.
    #[error("cannot read the signal mask: {0}")]
    ReadMask(#[source] std::io::Error),
    /// `KVM_SET_SIGNAL_MASK`.
    #[error("KVM_SET_SIGNAL_MASK failed: {0}")]
    SetRunMask(#[source] std::io::Error),
    /// Consuming a kick after `KVM_RUN` returned `EINTR`.
    #[error("cannot consume the kick signal: {0}")]
    Acknowledge(signal::Error),
    /// Signalling a vCPU thread.
    #[error("cannot signal a vCPU thread: {0}")]
    Signal(#[source] Errno),
}

/// Prepares the calling thread, which runs `vcpu`, to be kicked, by other
/// threads ([`kick_signal`]) and by its own host timer ([`timer_signal`]).
///
/// Call it on the vCPU's own thread before its first `KVM_RUN`.
pub fn prepare_vcpu_thread(vcpu: &VcpuFd) -> Result<(), KickError> {
    install_handlers()?;
    let signals = [kick_signal(), timer_signal()];
    for sig in signals {
        match signal::block_signal(sig) {
            Ok(()) | Err(signal::Error::SignalAlreadyBlocked(_)) => {}
            Err(cause) => return Err(KickError::Block { signal: sig, cause }),
        }
    }
    let mut mask = current_blocked_signals()?;
    for sig in signals {
        // SAFETY: `mask` is a valid, initialized sigset and `sig` a valid signal.
        unsafe { libc::sigdelset(&mut mask, sig) };
    }
    set_run_signal_mask(vcpu, &mask)
}

/// Consumes a pending kick after `KVM_RUN` returned `EINTR`.
pub fn acknowledge() -> Result<(), KickError> {
    signal::clear_signal(kick_signal()).map_err(KickError::Acknowledge)
}

/// Kicks the vCPU thread `thread` out of `KVM_RUN` (or keeps it from entering).
///
/// Set the request the kick is for before calling this.
pub fn kick(thread: &impl Killable) -> Result<(), KickError> {
    thread.kill(kick_signal()).map_err(KickError::Signal)
}

/// A vCPU thread to kick: the thread registers itself and clears the slot
/// before it exits, so a kick never signals a thread that is gone.
#[derive(Debug, Default)]
pub struct KickTarget(Mutex<Option<libc::pthread_t>>);

impl KickTarget {
    /// Registers the calling thread as the one to kick.
    pub fn register_current(&self) {
        // SAFETY: pthread_self has no preconditions.
        *self.slot() = Some(unsafe { libc::pthread_self() });
    }

    /// No thread to kick any more (the registered one is about to exit).
    pub fn clear(&self) {
        *self.slot() = None;
    }

    /// Kicks the registered thread; `Ok(false)` when none is registered.
    pub fn kick(&self) -> Result<bool, KickError> {
        let slot = self.slot();
        match *slot {
            // The lock is held across the signal, so the thread cannot clear
            // the slot and exit in between.
            Some(thread) => kick(&Pthread(thread)).map(|()| true),
            None => Ok(false),
        }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Option<libc::pthread_t>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A registered vCPU thread's handle.
struct Pthread(libc::pthread_t);

// SAFETY: a `Pthread` only lives while its `KickTarget`'s lock is held, and
// the thread clears that slot (under the lock) before it exits.
unsafe impl Killable for Pthread {
    fn pthread_handle(&self) -> libc::pthread_t {
        self.0
    }
}

/// The handler never runs on a prepared vCPU thread (the signals are blocked
/// outside `KVM_RUN`); it only replaces the default action, which would end
/// the process.
extern "C" fn ignore_kick(_: c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

fn install_handlers() -> Result<(), KickError> {
    static INSTALLED: OnceLock<Result<(), Errno>> = OnceLock::new();
    (*INSTALLED.get_or_init(|| {
        signal::register_signal_handler(kick_signal(), ignore_kick)?;
        signal::register_signal_handler(timer_signal(), ignore_kick)
    }))
    .map_err(KickError::InstallHandler)
}

fn current_blocked_signals() -> Result<libc::sigset_t, KickError> {
    // SAFETY: sigset_t is plain data; pthread_sigmask fills it below.
    let mut mask: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: a null new set only reads the current mask into `mask`.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask) };
    match ret {
        0 => Ok(mask),
        e => Err(KickError::ReadMask(std::io::Error::from_raw_os_error(e))),
    }
}

/// `KVM_SET_SIGNAL_MASK`: the signals blocked while `vcpu` is in `KVM_RUN`.
fn set_run_signal_mask(vcpu: &VcpuFd, mask: &libc::sigset_t) -> Result<(), KickError> {
    // glibc's sigset_t starts with the kernel's 64-bit signal set.
    // SAFETY: sigset_t is at least KERNEL_SIGSET_BYTES long and plain data.
    let bytes: [u8; KERNEL_SIGSET_BYTES] =
        unsafe { std::ptr::read_unaligned(mask as *const _ as *const _) };
    let arg = SignalMask {
        len: KERNEL_SIGSET_BYTES as u32,
        sigset: bytes,
    };
    // SAFETY: `vcpu` is a vCPU fd and `arg` is a kvm_signal_mask followed by `len`
    // bytes of sigset, which is all the ioctl reads; the return value is checked.
    let ret = unsafe { ioctl_with_ref(vcpu, ioctls::KVM_SET_SIGNAL_MASK(), &arg) };
    if ret == 0 {
        Ok(())
    } else {
        Err(KickError::SetRunMask(std::io::Error::last_os_error()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kick_reaches_the_registered_thread_and_none_after_it_cleared() {
        let target = KickTarget::default();
        assert!(!target.kick().expect("no thread: nothing to signal"));
        let (registered, kicked) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
        std::thread::scope(|s| {
            s.spawn(|| {
                install_handlers().expect("handler");
                signal::block_signal(kick_signal()).expect("block");
                target.register_current();
                registered.wait();
                kicked.wait();
                assert!(kick_pending(), "the blocked kick waits for KVM_RUN");
                acknowledge().expect("consume the kick");
                assert!(!kick_pending());
                target.clear();
            });
            registered.wait();
            assert!(target.kick().expect("a registered thread"));
            kicked.wait();
        });
        assert!(!target.kick().expect("cleared"));
    }

    fn kick_pending() -> bool {
        // SAFETY: sigset_t is plain data that sigpending fills.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid sigset to write.
        assert_eq!(unsafe { libc::sigpending(&mut set) }, 0);
        // SAFETY: `set` was filled by sigpending and the signal is valid.
        unsafe { libc::sigismember(&set, kick_signal()) == 1 }
    }
}
