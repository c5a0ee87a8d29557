//! Metrics of the deadline backend, through an events trait.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::advance::Wakeup;

/// What one busy-wait to a target took.
///
/// The wall time counts any preemption in the middle of the spin (the spin
/// ends at its first clock reading past its bound, however late that is);
/// the CPU time is what the spinning thread used, which stays within the
/// spin's bound (`Expiry::max_spin`) plus one clock reading.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Spin {
    /// From the spin's first clock reading to its last.
    pub wall: Duration,
    /// The spinning thread's CPU time over the same readings.
    pub cpu: Duration,
}

impl Spin {
    /// A spin of `wall` that used `cpu` of its thread's CPU.
    pub fn new(wall: Duration, cpu: Duration) -> Self {
        Self { wall, cpu }
    }
}

/// Receives what the backend observes. Every method has an empty default.
pub trait TimerEvents: Send + Sync {
    /// The host timer woke the timer thread.
    fn woke(&self, _wakeup: &Wakeup) {}
    /// The expiry path busy-waited to its target.
    fn spun(&self, _spin: Spin) {}
    /// Delivery started this many ns after its target (negative: early, which
    /// spinning prevents).
    fn delivered(&self, _lateness_ns: i64) {}
}

/// No metrics, at no cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoEvents;

impl TimerEvents for NoEvents {}

impl<E: TimerEvents + ?Sized> TimerEvents for std::sync::Arc<E> {
    fn woke(&self, wakeup: &Wakeup) {
        (**self).woke(wakeup)
    }
    fn spun(&self, spin: Spin) {
        (**self).spun(spin)
    }
    fn delivered(&self, lateness_ns: i64) {
        (**self).delivered(lateness_ns)
    }
}

/// Buckets of the lateness histogram.
pub const HIST_BUCKETS: usize = 32;

/// Counters and a log2 histogram of delivery lateness.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct TimerStats {
    /// Host-timer wake-ups.
    pub wakeups: AtomicU64,
    /// Deliveries that started before their target.
    pub early: AtomicU64,
    /// Deliveries that started after their target.
    pub late: AtomicU64,
    /// Total lateness of late deliveries, ns.
    pub late_ns: AtomicU64,
    /// Total busy-wait, CPU ns of the spinning threads ([`Spin::cpu`]).
    pub spin_cpu_ns: AtomicU64,
    /// Total busy-wait, wall ns, preemption included ([`Spin::wall`]).
    pub spin_wall_ns: AtomicU64,
    /// Bucket `i` counts late deliveries of `[2^(i-1), 2^i)` ns (0: on time).
    pub lateness_hist: [AtomicU64; HIST_BUCKETS],
}

impl TimerEvents for TimerStats {
    fn woke(&self, _: &Wakeup) {
        self.wakeups.fetch_add(1, Relaxed);
    }

    fn spun(&self, spin: Spin) {
        self.spin_cpu_ns
            .fetch_add(spin.cpu.as_nanos() as u64, Relaxed);
        self.spin_wall_ns
            .fetch_add(spin.wall.as_nanos() as u64, Relaxed);
    }

    fn delivered(&self, lateness_ns: i64) {
        if lateness_ns < 0 {
            self.early.fetch_add(1, Relaxed);
            return;
        }
        let ns = lateness_ns as u64;
        if ns > 0 {
            self.late.fetch_add(1, Relaxed);
            self.late_ns.fetch_add(ns, Relaxed);
        }
        let bucket = (64 - ns.leading_zeros() as usize).min(HIST_BUCKETS - 1);
        self.lateness_hist[bucket].fetch_add(1, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_count_early_late_and_spin() {
        let s = TimerStats::default();
        s.woke(&Wakeup::default());
        s.spun(Spin::new(
            Duration::from_micros(5),
            Duration::from_micros(3),
        ));
        for l in [-5, 0, 1, 1000] {
            s.delivered(l);
        }
        let get = |a: &AtomicU64| a.load(Relaxed);
        assert_eq!(
            (
                get(&s.wakeups),
                get(&s.early),
                get(&s.late),
                get(&s.late_ns),
                get(&s.spin_cpu_ns),
                get(&s.spin_wall_ns)
            ),
            (1, 1, 2, 1001, 3000, 5000)
        );
        assert_eq!(
            get(&s.lateness_hist[0]) + get(&s.lateness_hist[1]) + get(&s.lateness_hist[10]),
            3
        );
    }
}
