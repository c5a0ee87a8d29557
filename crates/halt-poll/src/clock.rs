//! Time, behind a trait so the poller can run in simulated time in tests.

use std::io;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A monotonic clock.
pub trait Clock {
    /// Time since an arbitrary fixed point.
    fn now(&self) -> Duration;
}

/// `CLOCK_MONOTONIC`, through [`Instant`] (a vDSO call, about 20 ns here).
#[derive(Clone, Copy, Debug, Default)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        static EPOCH: OnceLock<Instant> = OnceLock::new();
        EPOCH.get_or_init(Instant::now).elapsed()
    }
}

/// Sets the calling thread's timer slack (`PR_SET_TIMERSLACK`).
///
/// A normal thread's timed waits may end up to 50 µs late by default; a thread
/// that uses hybrid polling (sleep, then poll) wants its sleeps to end on time.
pub fn set_timer_slack(slack: Duration) -> io::Result<()> {
    let ns = slack.as_nanos().clamp(1, libc::c_ulong::MAX as u128) as libc::c_ulong;
    // SAFETY: PR_SET_TIMERSLACK takes an integer and changes only this thread.
    match unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, ns, 0, 0, 0) } {
        0 => Ok(()),
        _ => Err(io::Error::last_os_error()),
    }
}

/// A clock for tests: it moves only when told, plus `step` on every reading, so
/// that a poll loop driven by it ends.
#[derive(Debug, Default)]
pub struct FakeClock {
    now_ns: AtomicU64,
    step_ns: u64,
}

impl FakeClock {
    /// A clock at zero that advances `step` per reading.
    pub fn new(step: Duration) -> Self {
        Self {
            now_ns: AtomicU64::new(0),
            step_ns: step.as_nanos() as u64,
        }
    }

    /// Moves the clock forward.
    pub fn advance(&self, by: Duration) {
        self.now_ns
            .fetch_add(by.as_nanos() as u64, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.now_ns.fetch_add(self.step_ns, Ordering::SeqCst))
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Duration {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn monotonic_clock_never_goes_back() {
        let c = MonotonicClock;
        let a = c.now();
        assert!(c.now() >= a);
    }

    #[test]
    fn timer_slack_can_be_set() {
        std::thread::spawn(|| {
            set_timer_slack(Duration::from_nanos(1)).unwrap();
            // SAFETY: PR_GET_TIMERSLACK takes no arguments.
            let slack = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) };
            assert_eq!(slack, 1);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn fake_clock_steps_and_advances() {
        let c = FakeClock::new(Duration::from_nanos(10));
        assert_eq!(c.now(), Duration::ZERO);
        assert_eq!(c.now(), Duration::from_nanos(10));
        c.advance(Duration::from_micros(1));
        assert_eq!(
            Clock::now(&&c),
            Duration::from_nanos(1020),
            "through &C too"
        );
    }
}
