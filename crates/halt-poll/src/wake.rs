//! Wake sources: how a halted thread learns that an event arrived, by polling
//! (cheap, repeated) or by blocking.
//!
//! A wake-up carries the index of its source as a bit (a [`SourceSet`]), so
//! a poller can keep one window per source.

use std::io;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

/// Bit `i` set: source `i` fired.
pub type SourceSet = u64;

/// How many sources one [`WakeSource`] can tell apart: one per bit of
/// [`SourceSet`]. Sources are numbered `0..MAX_SOURCES` (`usize`, as the
/// policies of [`HaltPoller::with_policies`](crate::HaltPoller::with_policies)
/// are indexed).
pub const MAX_SOURCES: usize = SourceSet::BITS as usize;

/// Where a halted thread's wake-ups come from.
pub trait WakeSource {
    /// Takes the events that fired since the last call, without blocking; 0 if
    /// none. Called in the poll loop, so it must be cheap.
    fn take(&self) -> SourceSet;

    /// Blocks until an event fires or `timeout` (if any) passes; takes the events.
    fn wait(&self, timeout: Option<Duration>) -> SourceSet;
}

impl<W: WakeSource + ?Sized> WakeSource for &W {
    fn take(&self) -> SourceSet {
        (**self).take()
    }

    fn wait(&self, timeout: Option<Duration>) -> SourceSet {
        (**self).wait(timeout)
    }
}

impl<W: WakeSource + ?Sized> WakeSource for std::sync::Arc<W> {
    fn take(&self) -> SourceSet {
        (**self).take()
    }

    fn wait(&self, timeout: Option<Duration>) -> SourceSet {
        (**self).wait(timeout)
    }
}

const AWAKE: u32 = 0;
const SLEEPING: u32 = 1;

/// An atomic event mask and a futex: polling is one load, waking a thread that
/// is not blocked is one atomic OR and one load (no system call).
///
/// The waker publishes the event, then looks whether the thread sleeps; the
/// thread announces it sleeps, then looks for events (SeqCst on all four, so one
/// of the two sees the other). A waker that sees the thread asleep clears the
/// futex word before `FUTEX_WAKE`, so a thread about to call `FUTEX_WAIT` returns
/// at once.
#[derive(Debug, Default)]
pub struct FutexWake {
    pending: AtomicU64,
    sleeping: AtomicU32,
}

impl FutexWake {
    /// No event pending, nobody asleep.
    pub fn new() -> Self {
        Self::default()
    }

    /// Signals source `source`. Sources at or above [`MAX_SOURCES`] are taken
    /// modulo [`MAX_SOURCES`], so every wake wakes the thread.
    pub fn wake(&self, source: usize) {
        self.pending.fetch_or(1 << (source % MAX_SOURCES), SeqCst);
        if self.sleeping.load(SeqCst) == SLEEPING && self.sleeping.swap(AWAKE, SeqCst) == SLEEPING {
            futex_wake(&self.sleeping);
        }
    }
}

impl WakeSource for FutexWake {
    #[inline]
    fn take(&self) -> SourceSet {
        if self.pending.load(SeqCst) == 0 {
            0
        } else {
            self.pending.swap(0, SeqCst)
        }
    }

    fn wait(&self, timeout: Option<Duration>) -> SourceSet {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            self.sleeping.store(SLEEPING, SeqCst);
            let events = self.take();
            if events != 0 {
                self.sleeping.store(AWAKE, SeqCst);
                return events;
            }
            let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if remaining == Some(Duration::ZERO) {
                self.sleeping.store(AWAKE, SeqCst);
                return self.take();
            }
            futex_wait(&self.sleeping, SLEEPING, remaining);
        }
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as _,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: FUTEX_WAIT reads the aligned u32 behind `word`, which lives for the
    // call, and an optional timespec on our stack; any result (woken, timed out,
    // EAGAIN because the word changed, EINTR) makes the caller re-check.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            ts_ptr,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address of `word` as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

/// Event file descriptors (as a VMM's devices signal through irqfd-like
/// eventfds): source `i` is the `i`-th eventfd. Polling costs a `ppoll` system
/// call, so it suits waits where the events come from other processes or the
/// kernel.
#[derive(Debug)]
pub struct EventFdWake {
    fds: Vec<EventFd>,
}

impl EventFdWake {
    /// `count` new non-blocking eventfds (1 to [`MAX_SOURCES`]).
    pub fn new(count: usize) -> io::Result<Self> {
        if count == 0 || count > MAX_SOURCES {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "1 to 64 event sources",
            ));
        }
        let fds = (0..count)
            .map(|_| EventFd::new(EFD_NONBLOCK))
            .collect::<io::Result<_>>()?;
        Ok(Self { fds })
    }

    /// A handle that signals source `source`, for another thread or process.
    pub fn waker(&self, source: usize) -> io::Result<EventFd> {
        let fd = self
            .fds
            .get(source)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no such source"))?;
        fd.try_clone()
    }

    fn ppoll(&self, timeout: Option<Duration>) -> SourceSet {
        let mut pfds: Vec<libc::pollfd> = self
            .fds
            .iter()
            .map(|f| libc::pollfd {
                fd: f.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        let ts = timeout.map(|t| libc::timespec {
            tv_sec: t.as_secs().min(i64::MAX as u64) as _,
            tv_nsec: t.subsec_nanos() as libc::c_long,
        });
        let ts_ptr = ts
            .as_ref()
            .map_or(std::ptr::null(), |t| t as *const libc::timespec);
        // SAFETY: `pfds` is a live array of `pfds.len()` pollfds and `ts_ptr` is
        // null or points at a timespec on our stack.
        let ret = unsafe {
            libc::ppoll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                ts_ptr,
                std::ptr::null(),
            )
        };
        if ret <= 0 {
            return 0;
        }
        let mut events = 0;
        for (i, (p, fd)) in pfds.iter().zip(&self.fds).enumerate() {
            // Reading resets the counter; a concurrent write between poll and read
            // is read here or seen by the next poll.
            if p.revents & libc::POLLIN != 0 && fd.read().is_ok() {
                events |= 1 << i;
            }
        }
        events
    }
}

impl WakeSource for EventFdWake {
    fn take(&self) -> SourceSet {
        self.ppoll(Some(Duration::ZERO))
    }

    fn wait(&self, timeout: Option<Duration>) -> SourceSet {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let remaining = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let events = self.ppoll(remaining);
            if events != 0 || remaining == Some(Duration::ZERO) {
                return events;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::thread;

    #[test]
    fn futex_wake_events_are_taken_once() {
        let w = FutexWake::new();
        assert_eq!(w.take(), 0);
        w.wake(0);
        w.wake(3);
        w.wake(64 + 1);
        assert_eq!(w.take(), 0b1011);
        assert_eq!(w.take(), 0);
    }

    #[test]
    fn futex_wait_times_out_and_returns_a_pending_event_at_once() {
        let w = FutexWake::new();
        assert_eq!(w.wait(Some(Duration::from_millis(1))), 0);
        w.wake(2);
        assert_eq!(w.wait(None), 0b100);
    }

    #[test]
    fn a_blocked_futex_waiter_is_woken_by_another_thread() {
        let w = Arc::new(FutexWake::new());
        let waiter = {
            let w = w.clone();
            thread::spawn(move || w.wait(None))
        };
        thread::sleep(Duration::from_millis(20));
        w.wake(5);
        assert_eq!(waiter.join().unwrap(), 1 << 5);
    }

    #[test]
    fn eventfd_sources_map_to_bits() {
        let w = EventFdWake::new(3).unwrap();
        assert_eq!(w.take(), 0);
        w.waker(2).unwrap().write(1).unwrap();
        w.waker(0).unwrap().write(7).unwrap();
        assert_eq!(w.take(), 0b101);
        assert_eq!(w.take(), 0, "reading reset the counters");
        assert_eq!(w.wait(Some(Duration::from_millis(1))), 0);
        let waker = w.waker(1).unwrap();
        thread::spawn(move || {
            thread::sleep(Duration::from_millis(10));
            waker.write(1).unwrap();
        });
        assert_eq!(w.wait(None), 0b10);
    }

    #[test]
    fn eventfd_source_counts_are_checked() {
        assert!(EventFdWake::new(0).is_err());
        assert!(EventFdWake::new(65).is_err());
        assert!(EventFdWake::new(1).unwrap().waker(1).is_err());
    }
}
