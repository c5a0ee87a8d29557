//! Time, behind a trait so that the mechanism runs in simulated time in tests.
//!
//! The same file in every crate of the family (each ships its own copy, so
//! none depends on another): one [`Clock`] shape, one [`MonotonicClock`], one
//! [`FakeClock`], whichever crate a VMM takes them from.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::Duration;

/// A monotonic clock.
pub trait Clock: Send + Sync {
    /// Time since a fixed point; only differences between readings mean
    /// anything, except that [`MonotonicClock`] reads `CLOCK_MONOTONIC`.
    fn now(&self) -> Duration;

    /// [`now`](Clock::now) in whole nanoseconds (saturating).
    fn now_ns(&self) -> u64 {
        u64::try_from(self.now().as_nanos()).unwrap_or(u64::MAX)
    }
}

impl<C: Clock + ?Sized> Clock for &C {
    fn now(&self) -> Duration {
        (**self).now()
    }
}

impl<C: Clock + ?Sized> Clock for Arc<C> {
    fn now(&self) -> Duration {
        (**self).now()
    }
}

/// `CLOCK_MONOTONIC` (a vDSO call, about 20 ns), whose time is also what
/// `timerfd`s and `clock_nanosleep` take.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MonotonicClock;

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes the timespec we own; CLOCK_MONOTONIC
        // exists on every Linux.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }
}

/// A clock for tests: it moves only when told, and by `step` at every
/// reading if one is set (so that a loop that waits on it ends).
#[derive(Debug, Default)]
pub struct FakeClock {
    now_ns: AtomicU64,
    step_ns: u64,
}

impl FakeClock {
    /// A clock that stands at `at`.
    pub fn at(at: Duration) -> Self {
        Self {
            now_ns: AtomicU64::new(duration_ns(at)),
            step_ns: 0,
        }
    }

    /// The same clock, moving `step` after every reading.
    pub fn with_step(self, step: Duration) -> Self {
        Self {
            step_ns: duration_ns(step),
            ..self
        }
    }

    /// Moves it forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.now_ns.fetch_add(duration_ns(by), SeqCst);
    }

    /// Sets it to `at`.
    pub fn set(&self, at: Duration) {
        self.now_ns.store(duration_ns(at), SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.now_ns.fetch_add(self.step_ns, SeqCst))
    }
}

fn duration_ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_monotonic_clock_moves_on_with_real_time() {
        let a = MonotonicClock.now();
        std::thread::sleep(Duration::from_millis(1));
        assert!(MonotonicClock.now() - a >= Duration::from_millis(1));
    }

    #[test]
    fn the_fake_clock_moves_only_when_told_or_by_its_step() {
        let c = FakeClock::at(Duration::from_nanos(5));
        assert_eq!(
            (c.now(), c.now()),
            (Duration::from_nanos(5), Duration::from_nanos(5))
        );
        c.advance(Duration::from_nanos(10));
        assert_eq!(Clock::now_ns(&&c), 15, "through &C too");
        c.set(Duration::from_nanos(1));
        assert_eq!(
            Arc::new(c).now(),
            Duration::from_nanos(1),
            "through Arc<C> too"
        );
        let stepping = FakeClock::default().with_step(Duration::from_nanos(10));
        assert_eq!((stepping.now_ns(), stepping.now_ns()), (0, 10));
    }
}
