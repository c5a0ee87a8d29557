//! Statistics, under the names of KVM's binary stats, as [`HaltEvents`].

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::events::HaltEvents;
use crate::policy::{HaltOutcome, PollPlan, WokenDuring};

/// Buckets of a log2 histogram, as KVM's.
pub const HIST_BUCKETS: usize = 32;

/// A log2 histogram: bucket `i` counts values in `[2^(i-1), 2^i)` ns, bucket 0
/// counts zeros, the last bucket everything above (KVM's `KVM_STATS_LOG_HIST_UPDATE`).
#[derive(Debug, Default)]
pub struct LogHistogram([AtomicU64; HIST_BUCKETS]);

impl LogHistogram {
    /// Counts `value`.
    pub fn record(&self, value: u64) {
        let index = (64 - value.leading_zeros() as usize).min(HIST_BUCKETS - 1);
        self.0[index].fetch_add(1, Relaxed);
    }

    /// The counts.
    pub fn snapshot(&self) -> [u64; HIST_BUCKETS] {
        std::array::from_fn(|i| self.0[i].load(Relaxed))
    }
}

/// Counters with the names and meanings of KVM's vCPU binary stats, updated as
/// `kvm_vcpu_halt` and `update_halt_poll_stats` update them.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct HaltStats {
    /// Halts that polled and never blocked.
    pub halt_successful_poll: AtomicU64,
    /// Halts that polled (a non-zero window).
    pub halt_attempted_poll: AtomicU64,
    /// Successful polls ended by a spurious wake-up.
    pub halt_poll_invalid: AtomicU64,
    /// Halts woken from a block (or a hybrid sleep).
    pub halt_wakeup: AtomicU64,
    /// Time polling in successful polls, ns.
    pub halt_poll_success_ns: AtomicU64,
    /// Time polling in polls that then blocked, ns.
    pub halt_poll_fail_ns: AtomicU64,
    /// Time blocked (and asleep), ns.
    pub halt_wait_ns: AtomicU64,
    /// Histogram of successful poll times.
    pub halt_poll_success_hist: LogHistogram,
    /// Histogram of failed poll times.
    pub halt_poll_fail_hist: LogHistogram,
    /// Histogram of block times.
    pub halt_wait_hist: LogHistogram,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl HaltEvents for HaltStats {
    fn halted(&self, plan: &PollPlan, o: &HaltOutcome) {
        let polled = ns(o.polled);
        if plan.window > Duration::ZERO {
            self.halt_attempted_poll.fetch_add(1, Relaxed);
            if o.poll_succeeded() {
                self.halt_successful_poll.fetch_add(1, Relaxed);
                if !o.valid {
                    self.halt_poll_invalid.fetch_add(1, Relaxed);
                }
                self.halt_poll_success_ns.fetch_add(polled, Relaxed);
                self.halt_poll_success_hist.record(polled);
            } else {
                self.halt_poll_fail_ns.fetch_add(polled, Relaxed);
                self.halt_poll_fail_hist.record(polled);
            }
        }
        if o.woken != WokenDuring::Poll {
            let waited = ns(o.blocked() + o.slept);
            self.halt_wakeup.fetch_add(1, Relaxed);
            self.halt_wait_ns.fetch_add(waited, Relaxed);
            self.halt_wait_hist.record(waited);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn log_histogram_buckets_like_kvm() {
        let h = LogHistogram::default();
        for v in [0, 1, 2, 3, 4, 1 << 40] {
            h.record(v);
        }
        let s = h.snapshot();
        assert_eq!(&s[..4], &[1, 1, 2, 1]);
        assert_eq!(
            s[HIST_BUCKETS - 1],
            1,
            "everything large lands in the last bucket"
        );
    }

    #[test]
    fn stats_follow_kvm_update_halt_poll_stats() {
        let st = HaltStats::default();
        let poll = PollPlan::poll(50 * US);
        st.halted(&poll, &HaltOutcome::woken_while_polling(5 * US));
        st.halted(&poll, &HaltOutcome::woken_after_blocking(50 * US, 150 * US));
        st.halted(
            &PollPlan::default(),
            &HaltOutcome::woken_after_blocking(Duration::ZERO, 80 * US),
        );
        let invalid = HaltOutcome {
            valid: false,
            ..HaltOutcome::woken_while_polling(US)
        };
        st.halted(&poll, &invalid);
        let get = |a: &AtomicU64| a.load(Relaxed);
        assert_eq!(
            get(&st.halt_attempted_poll),
            3,
            "a zero window is not a poll"
        );
        assert_eq!(get(&st.halt_successful_poll), 2);
        assert_eq!(get(&st.halt_poll_invalid), 1);
        assert_eq!(get(&st.halt_poll_success_ns), 6_000);
        assert_eq!(get(&st.halt_poll_fail_ns), 50_000);
        assert_eq!(get(&st.halt_wakeup), 2);
        assert_eq!(get(&st.halt_wait_ns), 100_000 + 80_000);
        assert_eq!(st.halt_poll_fail_hist.snapshot().iter().sum::<u64>(), 1);
    }
}
