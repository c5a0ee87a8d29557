//! What the advance may cost: a bucket of spin time that fills at a share of
//! real time and that each spin empties by the CPU it used. Each armed
//! deadline's advance is at most what the bucket holds, so that spinning
//! takes at most that share of a CPU over any stretch longer than the
//! bucket, whatever the period, the policy or the host's wake-ups.

use std::time::Duration;

/// The share of real time the spins may take unless set otherwise
/// (`set_spin_share` on [`TimerThread`](crate::TimerThread) or
/// [`SignalTimer`](crate::SignalTimer)): at 200 µs, KVM's shortest period,
/// 20 µs of spin per expiry on average.
pub const DEFAULT_SPIN_SHARE: f64 = 0.1;

/// The most spin time the bucket holds: the burst a quiet stretch allows.
pub const SPIN_BURST: Duration = Duration::from_millis(1);

/// The bucket, in ns of spin, on the host's `CLOCK_MONOTONIC` ns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct SpinBudget {
    share: f64,
    tokens_ns: f64,
    at_ns: u64,
}

impl SpinBudget {
    /// A full bucket at `now_ns` filling at `share` (clamped to 0..=1; NaN
    /// is 0, which allows no advance at all).
    pub(crate) fn new(share: f64, now_ns: u64) -> Self {
        let share = clamp_share(share);
        Self {
            share,
            tokens_ns: if share > 0.0 { burst_ns() } else { 0.0 },
            at_ns: now_ns,
        }
    }

    /// The advance a deadline armed at `now_ns` may have: `wanted_ns`, or
    /// what the bucket holds if that is less.
    pub(crate) fn grant(&mut self, wanted_ns: u64, now_ns: u64) -> u64 {
        self.refill(now_ns);
        (wanted_ns as f64).min(self.tokens_ns) as u64
    }

    /// A spin used `cpu` of its thread's CPU.
    pub(crate) fn spend(&mut self, cpu: Duration) {
        self.tokens_ns = (self.tokens_ns - cpu.as_nanos() as f64).max(0.0);
    }

    /// Fills at `share` from now on (at 0 it is emptied too).
    pub(crate) fn set_share(&mut self, share: f64) {
        self.share = clamp_share(share);
        if self.share == 0.0 {
            self.tokens_ns = 0.0;
        }
    }

    fn refill(&mut self, now_ns: u64) {
        let elapsed = now_ns.saturating_sub(self.at_ns) as f64;
        self.tokens_ns = (self.tokens_ns + self.share * elapsed).min(burst_ns());
        self.at_ns = self.at_ns.max(now_ns);
    }
}

fn clamp_share(share: f64) -> f64 {
    if share.is_nan() {
        0.0
    } else {
        share.clamp(0.0, 1.0)
    }
}

fn burst_ns() -> f64 {
    SPIN_BURST.as_nanos() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;

    #[test]
    fn a_full_bucket_grants_the_whole_advance_up_to_its_burst() {
        let mut b = SpinBudget::new(DEFAULT_SPIN_SHARE, 0);
        assert_eq!(b.grant(500 * US, 0), 500 * US);
        assert_eq!(b.grant(5_000 * US, 0), 1_000 * US, "at most the burst");
    }

    #[test]
    fn spins_that_use_it_all_are_held_to_the_share() {
        // An advance of 500 µs at a 200 µs period, every spin using all it
        // was granted: after the burst, 20 µs per period.
        let mut b = SpinBudget::new(DEFAULT_SPIN_SHARE, 0);
        let mut spun = 0;
        for k in 0..1000u64 {
            let granted = b.grant(500 * US, k * 200 * US);
            b.spend(Duration::from_nanos(granted));
            spun += granted;
        }
        let bound = (0.1 * 1000.0 * 200.0) as u64 * US + 1_000 * US;
        assert!(spun <= bound, "{spun} ns over 200 ms");
        assert_eq!(
            b.grant(500 * US, 1000 * 200 * US),
            20 * US,
            "the share of one period"
        );
    }

    #[test]
    fn spins_that_use_little_leave_the_advance_whole() {
        let mut b = SpinBudget::new(DEFAULT_SPIN_SHARE, 0);
        for k in 0..1000u64 {
            assert_eq!(b.grant(30 * US, k * 200 * US), 30 * US, "expiry {k}");
            b.spend(Duration::from_micros(5));
        }
    }

    #[test]
    fn a_share_of_zero_or_nan_allows_no_advance() {
        for share in [0.0, f64::NAN, -1.0] {
            assert_eq!(SpinBudget::new(share, 0).grant(10 * US, 1_000_000 * US), 0);
        }
        let mut b = SpinBudget::new(0.5, 0);
        b.set_share(0.0);
        assert_eq!(b.grant(10 * US, 0), 0, "emptied");
        b.set_share(2.0);
        assert_eq!(b.grant(10 * US, 5 * US), 5 * US, "a share of 1 at most");
    }
}
