//! The dirty limit of a pre-copy that does not converge (dirty ring only):
//! dirty-log's [`DirtyRate`] per vCPU from the ring's counts, and its
//! [`DirtyLimit`]'s pauses, set once per pre-copy round, which each vCPU
//! thread takes at its next exit ([`VcpuPauses`]; the migration thread
//! kicks the vCPUs so that one comes). The rounds harvest the rings before
//! they fill, so a ring-full exit alone would come too seldom. Only the
//! vCPUs that write get a pause.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use dirty_log::{DirtyLimit, DirtyRate, RingFull};

/// Half-life of the rate the limit follows: a few pre-copy rounds.
const HALF_LIFE: Duration = Duration::from_millis(50);
/// The first target, as a share of the rate when the limit engages; each
/// round that still does not fit the downtime halves it.
const TIGHTEN: f64 = 0.5;
/// The lowest target, pages per second.
const FLOOR: f64 = 256.0;
/// The longest pause at one full ring: with 4096 entries, a writer held
/// to about 4 000 pages a second, so that pre-copy converges even over a
/// slow link.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// Each vCPU's pause at its next exit, set by the migration thread and
/// taken by the vCPU thread.
#[derive(Debug, Default)]
pub(crate) struct VcpuPauses(Vec<AtomicU64>);

impl VcpuPauses {
    /// No pause for any of `vcpus` vCPUs.
    pub fn new(vcpus: usize) -> Self {
        Self((0..vcpus).map(|_| AtomicU64::new(0)).collect())
    }

    /// vCPU `vcpu`'s pause, now taken (zero for none). Only a pause set
    /// writes the shared word: the check on every exit reads it.
    pub fn take(&self, vcpu: usize) -> Duration {
        let Some(word) = self.0.get(vcpu) else {
            return Duration::ZERO;
        };
        match word.load(Relaxed) {
            0 => Duration::ZERO,
            _ => Duration::from_nanos(word.swap(0, Relaxed)),
        }
    }

    /// Sets each vCPU's next pause; whether any is one.
    fn set(&self, pauses: &[Duration]) -> bool {
        for (word, pause) in self.0.iter().zip(pauses) {
            word.store(u64::try_from(pause.as_nanos()).unwrap_or(u64::MAX), Relaxed);
        }
        pauses.iter().any(|p| !p.is_zero())
    }

    /// No more pauses.
    pub fn clear(&self) {
        self.0.iter().for_each(|p| p.store(0, Relaxed));
    }
}

/// The rate per vCPU and, once engaged, the limit.
pub(crate) struct Throttle {
    ring: RingFull,
    pauses: std::sync::Arc<VcpuPauses>,
    rate: DirtyRate,
    limit: Option<DirtyLimit>,
    epoch: Instant,
}

impl Throttle {
    /// Follows `ring`'s vCPUs, setting `pauses`.
    pub fn new(ring: RingFull, pauses: std::sync::Arc<VcpuPauses>) -> Self {
        let vcpus = pauses.0.len();
        Self {
            ring,
            pauses,
            rate: DirtyRate::new(vcpus, HALF_LIFE),
            limit: None,
            epoch: Instant::now(),
        }
    }

    /// Samples the ring's counts and, under the limit, sets each vCPU's
    /// next pause; returns the VM's pages per second and whether a vCPU
    /// has a pause to take (kick them).
    pub fn observe(&mut self) -> (f64, bool) {
        let mut counts = vec![0; self.rate.rates().len()];
        for (vcpu, pages) in self.ring.pages_by_vcpu() {
            if let Some(count) = counts.get_mut(vcpu) {
                *count = pages;
            }
        }
        // The lengths match by construction.
        let _ = self.rate.observe(self.epoch.elapsed(), &counts);
        let pausing = match &mut self.limit {
            Some(limit) => {
                limit.update(self.rate.rates()).is_ok() && self.pauses.set(limit.pauses())
            }
            None => false,
        };
        (self.rate.total(), pausing)
    }

    /// The target now, if the limit is engaged.
    pub fn target(&self) -> Option<f64> {
        self.limit.as_ref().map(DirtyLimit::target)
    }

    /// Engages the limit at half the rate last observed, or halves its
    /// target; nothing before a rate was observed.
    pub fn tighten(&mut self) {
        let total = self.rate.total();
        match &mut self.limit {
            Some(limit) => limit.set_target((limit.target() * TIGHTEN).max(FLOOR)),
            None if total > 0.0 => {
                let vcpus = self.rate.rates().len();
                let limit = DirtyLimit::new(vcpus, (total * TIGHTEN).max(FLOOR));
                self.limit = Some(limit.with_max_pause(MAX_PAUSE));
            }
            None => {}
        }
    }

    /// Ends every pause.
    pub fn release(&self) {
        self.pauses.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pause_is_taken_once_per_vcpu() {
        let p = VcpuPauses::new(2);
        assert!(p.set(&[Duration::from_micros(5), Duration::ZERO]));
        assert_eq!(p.take(0), Duration::from_micros(5));
        assert_eq!(p.take(0), Duration::ZERO, "taken");
        assert_eq!(p.take(1), Duration::ZERO);
        assert_eq!(p.take(9), Duration::ZERO, "no such vCPU");
        assert!(!p.set(&[Duration::ZERO; 2]));
        p.set(&[Duration::from_micros(5); 2]);
        p.clear();
        assert_eq!(p.take(1), Duration::ZERO);
    }
}
