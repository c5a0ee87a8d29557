//! Time for the booster's limits: the real monotonic clock, or a fake one that
//! only moves when told, so that revocation is tested in simulated time.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// A source of monotonic time.
pub trait Clock: Send + Sync {
    /// Time since some fixed start.
    fn now(&self) -> Duration;
}

/// The host's monotonic clock, from the moment it was made.
#[derive(Clone, Copy, Debug)]
pub struct MonotonicClock(Instant);

impl MonotonicClock {
    /// A clock at 0 now.
    pub fn new() -> Self {
        Self(Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// A clock for tests: it stands still until moved.
#[derive(Debug, Default)]
pub struct FakeClock(AtomicU64);

impl FakeClock {
    /// A clock at `at`.
    pub fn at(at: Duration) -> Self {
        Self(AtomicU64::new(at.as_nanos() as u64))
    }

    /// Moves it forward by `by`.
    pub fn advance(&self, by: Duration) {
        self.0.fetch_add(by.as_nanos() as u64, SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        Duration::from_nanos(self.0.load(SeqCst))
    }
}

impl<C: Clock + ?Sized> Clock for std::sync::Arc<C> {
    fn now(&self) -> Duration {
        (**self).now()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fake_clock_moves_only_when_told_and_the_real_one_moves_on() {
        let fake = FakeClock::at(Duration::from_micros(5));
        assert_eq!(fake.now(), Duration::from_micros(5));
        fake.advance(Duration::from_micros(2));
        assert_eq!(fake.now(), Duration::from_micros(7));
        let real = MonotonicClock::new();
        let first = real.now();
        std::thread::sleep(Duration::from_millis(1));
        assert!(real.now() > first);
    }
}
