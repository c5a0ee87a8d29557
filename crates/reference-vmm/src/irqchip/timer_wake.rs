//! A halted vCPU's wake source that also sees its own timer come due, as
//! KVM's halt-poll loop does (`kvm_vcpu_check_block` asks
//! `kvm_cpu_has_pending_timer`): a vCPU that polls fires its timer itself at
//! the deadline, without waiting for the timer thread's wake-up.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use halt_poll::{FutexWake, SourceSet, WakeSource};
use lapic_timer::{Clock, MonotonicClock};

/// No timer armed.
const NONE: u64 = u64::MAX;

/// The vCPU's futex wake-ups, plus source `timer_bit` once the armed timer's
/// delivery is due (host `CLOCK_MONOTONIC` ns, set by the vCPU thread each
/// time it arms or disarms the timer).
pub(super) struct TimerWake {
    futex: Arc<FutexWake>,
    timer_bit: SourceSet,
    due_ns: AtomicU64,
}

impl TimerWake {
    /// Wake-ups from `futex`, and source `timer_source` when the timer is due.
    pub(super) fn new(futex: Arc<FutexWake>, timer_source: usize) -> Self {
        Self {
            futex,
            timer_bit: 1 << timer_source,
            due_ns: AtomicU64::new(NONE),
        }
    }

    /// The timer's delivery is due at `due_ns`, or never (`None`).
    pub(super) fn set_due(&self, due_ns: Option<u64>) {
        self.due_ns.store(due_ns.unwrap_or(NONE), Relaxed);
    }

    /// The timer bit if the timer is due by now.
    fn due(&self) -> SourceSet {
        match self.due_ns.load(Relaxed) {
            NONE => 0,
            at if MonotonicClock.now_ns() >= at => self.timer_bit,
            _ => 0,
        }
    }
}

impl WakeSource for TimerWake {
    fn take(&self) -> SourceSet {
        self.futex.take() | self.due()
    }

    /// A wait, timed (a hybrid policy's sleep) or not (a block), ends by the
    /// deadline: a timer thread's wake-up comes before it (by its advance)
    /// unless that thread is late, and a signal timer's is blocked here.
    fn wait(&self, timeout: Option<Duration>) -> SourceSet {
        let until_due = match self.due_ns.load(Relaxed) {
            NONE => None,
            at => Some(Duration::from_nanos(
                at.saturating_sub(MonotonicClock.now_ns()),
            )),
        };
        let timeout = match (timeout, until_due) {
            (Some(t), Some(d)) => Some(t.min(d)),
            (t, d) => t.or(d),
        };
        self.futex.wait(timeout) | self.due()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timer_bit_comes_once_due_and_futex_wakes_pass_through() {
        let futex = Arc::new(FutexWake::new());
        let wake = TimerWake::new(futex.clone(), 1);
        assert_eq!(wake.take(), 0, "nothing armed");
        wake.set_due(Some(MonotonicClock.now_ns() + 60_000_000_000));
        assert_eq!(wake.take(), 0, "not due for a minute");
        futex.wake(0);
        assert_eq!(wake.take(), 1, "an interrupt");
        wake.set_due(Some(MonotonicClock.now_ns()));
        assert_eq!(wake.take(), 2, "due");
        wake.set_due(None);
        assert_eq!(wake.take(), 0, "disarmed");
    }

    #[test]
    fn a_timed_wait_or_a_block_ends_at_the_deadline_and_says_why() {
        let wake = TimerWake::new(Arc::new(FutexWake::new()), 1);
        for timeout in [Some(Duration::from_secs(60)), None] {
            let start = MonotonicClock.now_ns();
            wake.set_due(Some(start + 2_000_000));
            let events = wake.wait(timeout);
            assert_eq!(events, 2, "{timeout:?}");
            assert!(MonotonicClock.now_ns() >= start + 2_000_000);
        }
    }
}
