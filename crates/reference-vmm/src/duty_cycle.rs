//! Pausing vCPUs for a share of their time: a duty cycle per vCPU, set by
//! a controller (a migration's dirty limit) in [`VcpuPauses`] and taken by
//! each vCPU thread at its exits. A vCPU's pause `p` means it sleeps `p`
//! after each [`RUN_SLICE`] it runs, but never more than [`MAX_SLEEP`] at
//! once (the guest sees each sleep as a stall), the run slice shrinking
//! instead ([`duty`]). The controller kicks a paused vCPU out of the guest
//! as its slice ends, so that it reaches an exit.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::thread;
use std::time::{Duration, Instant};

/// How long a vCPU with a pause runs between two sleeps.
pub const RUN_SLICE: Duration = Duration::from_millis(20);
/// The longest sleep: a stronger pause shortens the run instead, down to
/// 200 µs.
pub const MAX_SLEEP: Duration = Duration::from_millis(10);
const MIN_RUN: Duration = Duration::from_micros(200);

/// A pause `p` per [`RUN_SLICE`] as one sleep and the run before it: the
/// same share of the time asleep, the sleep at most [`MAX_SLEEP`].
pub fn duty(pause: Duration) -> (Duration, Duration) {
    if pause <= MAX_SLEEP {
        return (pause, RUN_SLICE);
    }
    let run = RUN_SLICE.mul_f64(MAX_SLEEP.as_secs_f64() / pause.as_secs_f64());
    (MAX_SLEEP, run.max(MIN_RUN))
}

/// Each vCPU's pause per [`RUN_SLICE`], set by the migration thread and
/// taken by the vCPU thread, and the longest each was given.
#[derive(Debug, Default)]
pub struct VcpuPauses {
    pauses: Vec<AtomicU64>,
    given: Vec<AtomicU64>,
}

impl VcpuPauses {
    /// No pause for any of `vcpus` vCPUs.
    pub fn new(vcpus: usize) -> Self {
        let words = || (0..vcpus).map(|_| AtomicU64::new(0)).collect();
        Self {
            pauses: words(),
            given: words(),
        }
    }

    /// How many vCPUs the pauses are for.
    pub fn len(&self) -> usize {
        self.pauses.len()
    }

    /// Whether there are no vCPUs to pause.
    pub fn is_empty(&self) -> bool {
        self.pauses.is_empty()
    }

    /// vCPU `vcpu`'s pause per run slice (zero for none).
    pub fn pause(&self, vcpu: usize) -> Duration {
        nanos(&self.pauses, vcpu)
    }

    /// The longest pause vCPU `vcpu` was given (zero for none), whether or
    /// not it reached an exit to take it before the limit ended.
    pub fn given(&self, vcpu: usize) -> Duration {
        nanos(&self.given, vcpu)
    }

    /// Sets each vCPU's pause.
    pub fn set(&self, pauses: &[Duration]) {
        for ((word, given), pause) in self.pauses.iter().zip(&self.given).zip(pauses) {
            let ns = u64::try_from(pause.as_nanos()).unwrap_or(u64::MAX);
            word.store(ns, Relaxed);
            given.fetch_max(ns, Relaxed);
        }
    }

    /// No more pauses.
    pub fn clear(&self) {
        self.pauses.iter().for_each(|p| p.store(0, Relaxed));
    }
}

/// `words[index]` as nanoseconds (zero for no such word).
fn nanos(words: &[AtomicU64], index: usize) -> Duration {
    words
        .get(index)
        .map_or(Duration::ZERO, |w| Duration::from_nanos(w.load(Relaxed)))
}

/// A vCPU thread's side of the dirty limit: when it last slept, and the
/// time it has slept in all.
#[derive(Debug)]
pub(crate) struct PauseTaker {
    last: Instant,
    /// Time paused so far.
    pub taken: Duration,
}

impl PauseTaker {
    /// Nothing taken yet.
    pub fn new() -> Self {
        Self {
            last: Instant::now(),
            taken: Duration::ZERO,
        }
    }

    /// At an exit of vCPU `vcpu`: sleeps its pause's sleep if it has run
    /// its run slice since the last ([`duty`]); whether it slept.
    pub fn take(&mut self, pauses: &VcpuPauses, vcpu: usize) -> bool {
        let pause = pauses.pause(vcpu);
        if pause.is_zero() {
            return false;
        }
        let (sleep, run) = duty(pause);
        if self.last.elapsed() < run {
            return false;
        }
        thread::sleep(sleep);
        self.taken += sleep;
        self.last = Instant::now();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vCPU with a pause sleeps after each run slice, and owes nothing
    /// once the pause is gone.
    #[test]
    fn a_pause_falls_due_after_each_run_slice_and_ends_with_the_limit() {
        let pauses = VcpuPauses::new(2);
        let mut taker = PauseTaker::new();
        assert!(!taker.take(&pauses, 0), "no pause set");
        pauses.set(&[Duration::from_millis(3), Duration::ZERO]);
        assert!(!taker.take(&pauses, 0), "not run a slice yet");
        assert!(!taker.take(&pauses, 1), "vCPU 1 has none");
        assert!(!taker.take(&pauses, 9), "no such vCPU");
        thread::sleep(RUN_SLICE);
        assert!(taker.take(&pauses, 0));
        assert_eq!(taker.taken, Duration::from_millis(3));
        assert!(!taker.take(&pauses, 0), "slept until the next slice");
        thread::sleep(RUN_SLICE);
        pauses.clear();
        assert!(!taker.take(&pauses, 0), "the limit was released");
        assert_eq!(taker.taken, Duration::from_millis(3));
    }

    /// A long pause becomes short sleeps and shorter runs: the share of
    /// the time asleep holds, and no sleep is longer than the cap.
    #[test]
    fn a_long_pause_shortens_the_run_rather_than_lengthen_the_sleep() {
        assert_eq!(
            duty(Duration::from_millis(4)),
            (Duration::from_millis(4), RUN_SLICE)
        );
        let (sleep, run) = duty(Duration::from_millis(100));
        assert_eq!(sleep, MAX_SLEEP);
        assert_eq!(
            run,
            Duration::from_millis(2),
            "10 ms asleep per 2 ms run, as 100 per 20"
        );
        assert_eq!(duty(Duration::from_secs(10)), (MAX_SLEEP, MIN_RUN));
    }
}
