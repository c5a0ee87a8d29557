//! The signal backend: no timer thread. A POSIX timer (`timer_create` on
//! `CLOCK_MONOTONIC` with `SIGEV_THREAD_ID`) signals the receiving thread
//! itself, `advance + lead` before each deadline.
//!
//! # Why
//! A [`TimerThread`](crate::TimerThread)'s expiry starts with a scheduler
//! wake-up of the timer thread, and then a second hop to the receiver (in a
//! VMM, a kick of the vCPU thread out of `KVM_RUN`). On a busy or idle host
//! the first hop has a long tail: a woken thread waits for its CPU, and one
//! on the receiver's CPU waits for the scheduler to preempt the receiver. The
//! kernel sends a POSIX timer's signal from the timer interrupt itself, to
//! the thread it names: a thread running (or in `KVM_RUN`, where KVM leaves
//! the guest for a pending signal) is interrupted on its own CPU, as KVM's
//! in-kernel LAPIC hrtimer interrupts its vCPU. No thread is woken.
//!
//! # Contract
//! - Made on the thread it signals, and not `Send`: the timer belongs to
//!   that thread, which arms it, takes its expiries and spins to them.
//! - The signal is only the interrupt. [`SignalTimer::take_due`] reads the
//!   clock, so a thread that checks it before each wait never misses a
//!   deadline, whether or not the signal was delivered, blocked or consumed.
//! - Give it a signal of its own: `take_due`, `disarm` and a re-`arm` stop
//!   the timer and consume that signal if it is pending (a stale one would
//!   interrupt every wait until the next deadline), while a deadline armed
//!   already due keeps its signal pending, so a thread that checked before
//!   arming is still interrupted. Keep the signal blocked except where the thread
//!   wants to be interrupted (a VMM: inside `KVM_RUN`, with
//!   `KVM_SET_SIGNAL_MASK`), with a handler installed if it is ever
//!   unblocked (a real-time signal's default action ends the process).
//!
//! # Example
//! Its signal stays blocked except in `KVM_RUN` (`KVM_SET_SIGNAL_MASK`), which
//! it ends with `EINTR`; `take_due` reads the clock, so nothing is missed
//! whether the signal came or not (the mask here uses `libc`):
//! ```
//! use lapic_timer::{Clock, MonotonicClock, NoEvents, Percentile, SignalTimer};
//!
//! let signal = libc::SIGRTMIN() + 1;
//! // SAFETY: a valid set; blocks the signal on this thread only.
//! unsafe {
//!     let mut set = std::mem::zeroed();
//!     (libc::sigemptyset(&mut set), libc::sigaddset(&mut set, signal));
//!     libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
//! }
//! let mut timer = SignalTimer::new(Percentile::default(), NoEvents, signal)?;
//! timer.arm(MonotonicClock.now_ns() + 200_000, 0xec)?;
//! // Before each KVM_RUN (and after it returned EINTR): anything due?
//! let expiry = loop { if let Some(due) = timer.take_due() { break due; } };
//! timer.receive(&expiry); // learns, then spins to the target
//! assert_eq!(expiry.payload, 0xec);
//! # Ok::<(), std::io::Error>(())
//! ```

use std::io;
use std::os::raw::c_int;
use std::time::Duration;

use crate::advance::AdvancePolicy;
use crate::backend::{Armed, Expiry, Tuning, itimerspec_at};
use crate::clock::{Clock, MonotonicClock};
use crate::events::{Spin, TimerEvents};

/// One deadline at a time, signalled to the thread that made the timer.
pub struct SignalTimer {
    timer: libc::timer_t,
    signal: c_int,
    armed: Option<Armed>,
    tuning: Tuning,
}

/// Shows the signal, the armed deadline and the advance and lead in use.
impl std::fmt::Debug for SignalTimer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SignalTimer")
            .field("signal", &self.signal)
            .field("armed", &self.armed)
            .field("advance", &self.tuning.advance())
            .field("lead_ns", &self.tuning.lead_ns())
            .finish_non_exhaustive()
    }
}

impl SignalTimer {
    /// A timer that sends `signal` to the calling thread, with an advance
    /// `policy` and `events` as a [`TimerThread`](crate::TimerThread) has.
    pub fn new<P, E>(policy: P, events: E, signal: c_int) -> io::Result<Self>
    where
        P: AdvancePolicy + Send + 'static,
        E: TimerEvents + 'static,
    {
        // SAFETY: an all-zero sigevent is valid plain data; the fields that
        // matter are set below.
        let mut event: libc::sigevent = unsafe { std::mem::zeroed() };
        event.sigev_notify = libc::SIGEV_THREAD_ID;
        event.sigev_signo = signal;
        // SAFETY: gettid has no preconditions.
        event.sigev_notify_thread_id = unsafe { libc::syscall(libc::SYS_gettid) } as c_int;
        let mut timer: libc::timer_t = std::ptr::null_mut();
        // SAFETY: a valid sigevent and a place for the timer id; checked.
        if unsafe { libc::timer_create(libc::CLOCK_MONOTONIC, &mut event, &mut timer) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Self {
            timer,
            signal,
            armed: None,
            tuning: Tuning::new(policy, events),
        })
    }

    /// Arms the deadline `deadline_ns` (host `CLOCK_MONOTONIC` ns), replacing
    /// any armed one; its expiry carries `payload`. A deadline whose time has
    /// come already signals at once.
    pub fn arm(&mut self, deadline_ns: u64, payload: u64) -> io::Result<()> {
        if self.armed.is_some() {
            self.clear()?;
        }
        let armed = self.tuning.arm(deadline_ns, payload);
        self.armed = Some(armed);
        self.set_timer(armed.fire_at_ns())
    }

    /// Disarms the deadline, if any, and takes its signal if it was sent.
    /// With none armed there is nothing to do: taking an expiry (or a
    /// disarm) already stopped the timer and took its signal.
    pub fn disarm(&mut self) -> io::Result<()> {
        match self.armed.take() {
            Some(_) => self.clear(),
            None => Ok(()),
        }
    }

    /// When the host timer fires for the armed deadline (`advance + lead`
    /// before it): a thread that sleeps with the signal blocked (a halted
    /// vCPU) wakes itself then.
    pub fn fire_at_ns(&self) -> Option<u64> {
        self.armed.map(|a| a.fire_at_ns())
    }

    /// The armed deadline's expiry, once its host timer's time has come: the
    /// deadline is then taken (disarmed), its signal consumed and its wake-up
    /// (now) reported to the events. Pass it to [`SignalTimer::receive`]
    /// where delivery starts.
    pub fn take_due(&mut self) -> Option<Expiry> {
        let armed = self.armed?;
        let now = MonotonicClock.now_ns();
        if now < armed.fire_at_ns() {
            return None;
        }
        self.armed = None;
        // The signal may be a moment behind the clock: stopping the timer
        // first means none comes after it is taken.
        let _ = self.clear();
        let expiry = armed.expiry(now);
        self.tuning.woke(&expiry);
        Some(expiry)
    }

    /// Where delivery starts: teaches the advance policy how late the thread
    /// got here after the target, then busy-waits to the target (at most
    /// `expiry.max_spin`), reporting the spin and the delivery to the
    /// events. Returns the spin (its wall time, and the CPU time it took).
    pub fn receive(&self, expiry: &Expiry) -> Spin {
        self.tuning.receive(expiry)
    }

    /// The advance the policy chose most recently.
    pub fn advance(&self) -> Duration {
        self.tuning.advance()
    }

    /// Sets the delivery lead for deadlines armed from now on.
    pub fn set_lead(&self, lead: Duration) {
        self.tuning.set_lead(lead);
    }

    /// Sets the share of real time the spins may take
    /// ([`DEFAULT_SPIN_SHARE`](crate::DEFAULT_SPIN_SHARE) unless set;
    /// clamped to 0..=1, 0 turns the advance off).
    pub fn set_spin_share(&self, share: f64) {
        self.tuning.set_spin_share(share);
    }

    /// Stops the POSIX timer, then takes the signal it sent, if any: after
    /// this no signal of an earlier setting is pending or can come, so one
    /// from the next setting is never taken for a stale one.
    fn clear(&self) -> io::Result<()> {
        let stopped = self.set_timer(0);
        self.consume_signal();
        stopped
    }

    /// Sets the POSIX timer to fire at `at_ns` (at once if that has passed),
    /// or stops it (0).
    fn set_timer(&self, at_ns: u64) -> io::Result<()> {
        let spec = itimerspec_at(at_ns);
        // SAFETY: our live timer and a valid itimerspec; the old value is not wanted.
        let ret = unsafe {
            libc::timer_settime(self.timer, libc::TIMER_ABSTIME, &spec, std::ptr::null_mut())
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }

    /// Takes this timer's signal if it is pending on this thread (blocked):
    /// one `sigtimedwait` that does not wait.
    fn consume_signal(&self) {
        // SAFETY: sigset_t is plain data, initialised by sigemptyset.
        let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
        let zero = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid set and signal; a zero timeout returns at once
        // (EAGAIN when nothing is pending), and no siginfo is wanted.
        unsafe {
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, self.signal);
            libc::sigtimedwait(&set, std::ptr::null_mut(), &zero);
        }
    }
}

impl Drop for SignalTimer {
    fn drop(&mut self) {
        // SAFETY: our timer, deleted once.
        unsafe { libc::timer_delete(self.timer) };
        self.consume_signal();
    }
}
