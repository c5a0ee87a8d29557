//! The dirty limit of a pre-copy that does not converge: dirty-log's
//! [`DirtyRate`] per vCPU and its [`DirtyLimit`]'s pauses, set as it
//! engages and then once per pre-copy round, as each vCPU's duty cycle
//! ([`VcpuPauses`]): it sleeps at an exit, and a kicker thread forces one
//! when its run slice is up ([`kick_paused`]). A pause once per round would not do: a round lasts
//! long enough for a flat-out writer to dirty all it writes.
//!
//! With the dirty ring each vCPU's rate is its own ring's count, and only
//! the vCPUs that write get a pause. A bitmap says which pages were
//! written, not by whom: there the rounds' page counts are spread evenly
//! over the vCPUs, so every vCPU pauses alike (QEMU's auto-converge), the
//! ones that do not write too.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::thread;
use std::time::{Duration, Instant};

use dirty_log::{DirtyLimit, DirtyRate, RingFull};

use reference_vmm::RunControl;
use reference_vmm::duty_cycle::{RUN_SLICE, VcpuPauses, duty};

/// Half-life of the rate the limit follows: a few pre-copy rounds.
const HALF_LIFE: Duration = Duration::from_millis(50);
/// The first target, as a share of the rate when the limit engages; each
/// round that still does not fit the downtime halves it.
const TIGHTEN: f64 = 0.5;
/// The lowest target, pages per second per vCPU (4 MiB/s): below it a
/// vCPU's own stack and interrupt records, dirtied anew after every
/// harvest, would count as writing.
const FLOOR_PER_VCPU: f64 = 1024.0;
/// The first pause per [`RUN_SLICE`] of a vCPU above its share (it then
/// runs 80 % of the time; each round may multiply it by up to 4), and the
/// longest (2 %).
const FIRST_PAUSE: Duration = Duration::from_millis(5);
const MAX_PAUSE: Duration = Duration::from_secs(1);
/// How far above the target the VM's rate must be for the limit to count
/// it as exceeded: then some vCPU is as far above its share (water-filling
/// gives the rest what they write), beyond the limit's tolerance, so it
/// gets a pause.
const EXCEEDED: f64 = 1.5;

/// Kicks each vCPU with a pause out of the guest as its run slice ends,
/// so that it sleeps, until the thread is unparked with `stop` set.
pub(crate) fn kick_paused(pauses: &VcpuPauses, control: &RunControl, stop: &AtomicBool) {
    while !stop.load(Relaxed) {
        let slices: Vec<_> = (0..pauses.len())
            .map(|v| (v, pauses.pause(v)))
            .filter(|(_, p)| !p.is_zero())
            .map(|(v, p)| (v, duty(p).1))
            .collect();
        let next = slices.iter().map(|s| s.1).min().unwrap_or(RUN_SLICE);
        thread::park_timeout(next);
        for (vcpu, _) in slices {
            control.kick(vcpu);
        }
    }
}

/// Where the pages each vCPU dirtied are counted.
pub(crate) enum Counts {
    /// Each vCPU's ring.
    Ring(RingFull),
    /// The pages of every round so far, with no vCPU to tell apart.
    Rounds(u64),
}

impl Counts {
    /// Each of `vcpus` vCPUs' pages so far, having seen a round of `pages`.
    fn by_vcpu(&mut self, vcpus: usize, pages: u64) -> Vec<u64> {
        match self {
            Self::Ring(ring) => {
                let mut counts = vec![0; vcpus];
                for (vcpu, pages) in ring.pages_by_vcpu() {
                    if let Some(count) = counts.get_mut(vcpu) {
                        *count = pages;
                    }
                }
                counts
            }
            Self::Rounds(total) => {
                *total += pages;
                vec![*total / vcpus.max(1) as u64; vcpus]
            }
        }
    }
}

/// The rate per vCPU and, once engaged, the limit.
pub(crate) struct Throttle {
    counts: Counts,
    pauses: std::sync::Arc<VcpuPauses>,
    rate: DirtyRate,
    limit: Option<DirtyLimit>,
    /// Updates of the limit that found the VM's rate [`EXCEEDED`] times its
    /// target or more.
    exceeded: u32,
    epoch: Instant,
}

impl Throttle {
    /// Follows the vCPUs' `counts`, setting `pauses`.
    pub fn new(counts: Counts, pauses: std::sync::Arc<VcpuPauses>) -> Self {
        let vcpus = pauses.len();
        Self {
            counts,
            pauses,
            rate: DirtyRate::new(vcpus, HALF_LIFE),
            limit: None,
            exceeded: 0,
            epoch: Instant::now(),
        }
    }

    /// Samples the counts after a round of `pages` and, under the limit,
    /// sets each vCPU's pause; returns the VM's pages per second.
    pub fn observe(&mut self, pages: u64) -> f64 {
        let counts = self.counts.by_vcpu(self.rate.rates().len(), pages);
        // The lengths match by construction.
        let _ = self.rate.observe(self.epoch.elapsed(), &counts);
        self.apply();
        self.rate.total()
    }

    /// Under the limit, moves each vCPU's pause toward its share of the
    /// target from the rates last observed.
    fn apply(&mut self) {
        let Some(limit) = &mut self.limit else {
            return;
        };
        if self.rate.total() >= limit.target() * EXCEEDED {
            self.exceeded += 1;
        }
        if limit.update(self.rate.rates()).is_ok() {
            self.pauses.set(limit.pauses());
        }
    }

    /// How many times the limit found the VM's rate [`EXCEEDED`] times its
    /// target or more, when it engaged or after a round under it: each time
    /// the vCPUs furthest above their share were given a pause.
    pub fn exceeded(&self) -> u32 {
        self.exceeded
    }

    /// The target now, if the limit is engaged.
    pub fn target(&self) -> Option<f64> {
        self.limit.as_ref().map(DirtyLimit::target)
    }

    /// Engages the limit at half the rate last observed, pausing at once
    /// the vCPUs above their share (the next round is the first under it),
    /// or halves its target; nothing before a rate was observed.
    pub fn tighten(&mut self) {
        let total = self.rate.total();
        let vcpus = self.rate.rates().len();
        let floor = FLOOR_PER_VCPU * vcpus as f64;
        match &mut self.limit {
            Some(limit) => limit.set_target((limit.target() * TIGHTEN).max(floor)),
            None if total > 0.0 => {
                let limit = DirtyLimit::new(vcpus, (total * TIGHTEN).max(floor));
                let limit = limit.with_max_pause(MAX_PAUSE);
                self.limit = Some(limit.with_first_pause(FIRST_PAUSE));
                self.apply();
            }
            None => {}
        }
    }

    /// Ends every pause.
    pub fn release(&self) {
        self.pauses.clear();
    }

    /// The pauses the vCPUs take.
    pub fn pauses(&self) -> std::sync::Arc<VcpuPauses> {
        self.pauses.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a ring, a round's pages count alike for every vCPU: under
    /// the limit every vCPU gets the same pause, from the moment it engages
    /// (at half the rate: exceeded), not only after a round under it.
    #[test]
    fn rounds_spread_their_pages_evenly_over_the_vcpus() {
        let pauses = std::sync::Arc::new(VcpuPauses::new(3));
        let mut throttle = Throttle::new(Counts::Rounds(0), pauses.clone());
        let set = || (0..3).map(|v| pauses.pause(v)).collect::<Vec<_>>();
        assert_eq!(throttle.observe(0), 0.0, "the baseline");
        thread::sleep(Duration::from_millis(20));
        assert!(throttle.observe(300_000) > 0.0);
        assert!(pauses.pause(0).is_zero(), "no limit yet");
        throttle.tighten();
        let engaged = set();
        assert!(!engaged[0].is_zero(), "paused as the limit engages");
        assert!(engaged.iter().all(|&p| p == engaged[0]), "{engaged:?}");
        assert_eq!(throttle.exceeded(), 1, "the rate is twice the target");
        thread::sleep(Duration::from_millis(20));
        throttle.observe(300_000);
        let after = set();
        assert!(!after[0].is_zero());
        assert!(after.iter().all(|&p| p == after[0]), "{after:?}");
        // Eight half-lives writing nothing: the rate falls far under the
        // target, however late the sleeps end.
        let exceeded = throttle.exceeded();
        thread::sleep(Duration::from_millis(400));
        throttle.observe(0);
        assert_eq!(throttle.exceeded(), exceeded, "not exceeded");
        assert!(set()[0] < after[0], "shorter below its share");
        throttle.release();
        assert!((0..3).all(|v| pauses.pause(v).is_zero()));
        let longest = engaged[0].max(after[0]);
        assert!((0..3).all(|v| pauses.given(v) == longest), "kept");
    }
}
