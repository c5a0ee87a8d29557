//! [`WindowTuner`]: sets KVM's per-VM halt-polling window from what KVM's
//! own polling did, for VMMs on the in-kernel LAPIC (the only lever they have).
//!
//! KVM grows and shrinks each vCPU's window one halt at a time, under one
//! maximum per VM (`KVM_CAP_HALT_POLL`; the module's `halt_poll_ns` until a
//! VMM sets it). Its rule sees only the last halt: it polls a little on every
//! long halt before it shrinks, and grows back on the next short one. The
//! tuner looks at the distribution of halts instead and picks the maximum
//! that pays, under which KVM's rule keeps working.
//!
//! # The rule
//! Called every interval (10 ms is a good default: a few halts of a busy
//! vCPU, a cheap read of a few stats files), with every vCPU's statistics:
//! 1. **Halt lengths**, from the histograms' growth since the last call, all
//!    vCPUs together: a halt a poll caught lasted its poll time
//!    (`halt_poll_success_hist`), a halt that blocked its block time
//!    (`halt_wait_hist`, which KVM counts from the end of the poll) plus the
//!    poll that failed before it: the interval's failed polling
//!    (`halt_poll_fail_ns`) shared out over its blocked halts. Where KVM has no
//!    histograms (before Linux 5.15), each count goes in the bucket of its mean
//!    (`halt_poll_success_ns` over `halt_successful_poll`, `halt_wait_ns` over
//!    `halt_wakeup`, which counts only the blocks an interrupt or another vCPU
//!    ended, not a signal).
//! 2. They join a histogram of KVM's log2 buckets whose counts keep
//!    [`keep`](TunerConfig::keep) of their weight per interval, so it follows
//!    the workload.
//! 3. For the window `0` and every power of two up to
//!    [`max_window`](TunerConfig::max_window), the expected cost of a halt:
//!    a halt shorter than the window costs its length in polling, a longer
//!    one the window in polling plus [`block_latency`](TunerConfig::block_latency)
//!    (blocking at once costs only that); polling is weighed by
//!    [`cpu_weight`](TunerConfig::cpu_weight) ns of latency per ns of CPU, as
//!    in [`Predictive`](crate::Predictive). The cheapest window is set; ties go
//!    to the shorter one.
//! 4. With fewer than [`min_halts`](TunerConfig::min_halts) halts in the
//!    histogram it changes nothing: too little to go on.
//!
//! Both sides stay observed whatever the window: a halt polled through shows in
//! the success histogram, one that blocked in the wait histogram. So the
//! window can always move either way.

use std::time::Duration;

use kvm_ioctls::VmFd;

use super::{BinaryStats, KvmError, KvmHaltStats, set_vm_halt_poll};
use crate::stats::HIST_BUCKETS;

/// Settings of a [`WindowTuner`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct TunerConfig {
    /// The longest window it sets.
    pub max_window: Duration,
    /// Latency a wake-up pays when it finds the vCPU blocked rather than
    /// polling (schedule-in on the host).
    pub block_latency: Duration,
    /// Nanoseconds of latency one nanosecond of polling CPU is worth.
    pub cpu_weight: f64,
    /// Share of the halt histogram's weight kept from one interval to the next.
    pub keep: f64,
    /// Halts (weighted) in the histogram before it sets a window.
    pub min_halts: f64,
}

impl Default for TunerConfig {
    fn default() -> Self {
        Self {
            max_window: Duration::from_micros(500),
            block_latency: Duration::from_micros(30),
            cpu_weight: 0.1,
            keep: 0.75,
            min_halts: 16.0,
        }
    }
}

/// Tunes one VM's `KVM_CAP_HALT_POLL` window; see the [module docs](self).
///
/// ```no_run
/// use std::time::Duration;
/// use halt_poll::kvm::{BinaryStats, KvmError, WindowTuner};
/// use kvm_ioctls::{VcpuFd, VmFd};
///
/// /// Tunes `vm` until `running` says stop (a VMM runs this on a thread of its own).
/// fn tune(vm: &VmFd, vcpus: &[VcpuFd], running: impl Fn() -> bool) -> Result<(), KvmError> {
///     let stats: Vec<BinaryStats> = vcpus.iter().map(BinaryStats::for_vcpu).collect::<Result<_, _>>()?;
///     let mut tuner = WindowTuner::default();
///     while running() {
///         std::thread::sleep(Duration::from_millis(10));
///         if let Some(window) = tuner.tune(vm, &stats)? {
///             println!("halt polling up to {window:?}");
///         }
///     }
///     Ok(())
/// }
/// ```
#[derive(Clone, Debug, Default)]
pub struct WindowTuner {
    config: TunerConfig,
    last: Vec<KvmHaltStats>,
    halts: [f64; HIST_BUCKETS],
    window: Option<Duration>,
    applied: Option<Duration>,
}

impl WindowTuner {
    /// A tuner with `config`; it sets nothing until it has seen
    /// `config.min_halts` halts.
    pub fn new(config: TunerConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// The window it chose last (`None`: none yet, KVM's own applies).
    pub fn window(&self) -> Option<Duration> {
        self.window
    }

    /// Reads every vCPU's statistics, updates the window and sets it on `vm`
    /// when it changed. Returns the window now chosen.
    pub fn tune(&mut self, vm: &VmFd, vcpus: &[BinaryStats]) -> Result<Option<Duration>, KvmError> {
        let now = vcpus
            .iter()
            .map(KvmHaltStats::read)
            .collect::<Result<Vec<_>, _>>()?;
        let window = self.update(&now);
        if let Some(w) = window.filter(|&w| Some(w) != self.applied) {
            set_vm_halt_poll(vm, w)?;
            self.applied = Some(w);
        }
        Ok(window)
    }

    /// Feeds every vCPU's cumulative statistics as read now (one entry per
    /// vCPU, in the same order each time) and returns the window chosen.
    /// This is the rule without KVM: unit tests feed it recorded statistics.
    pub fn update(&mut self, vcpus: &[KvmHaltStats]) -> Option<Duration> {
        if self.last.len() != vcpus.len() {
            self.last = vec![KvmHaltStats::default(); vcpus.len()];
        }
        self.halts.iter_mut().for_each(|h| *h *= self.config.keep);
        for (now, last) in vcpus.iter().zip(&mut self.last) {
            add_halts(&mut self.halts, now, last);
            *last = now.clone();
        }
        if self.halts.iter().sum::<f64>() >= self.config.min_halts {
            self.window = Some(self.cheapest_window());
        }
        self.window
    }

    /// The window with the least expected cost over the halt histogram.
    fn cheapest_window(&self) -> Duration {
        let c = &self.config;
        let block = c.block_latency.as_nanos() as f64;
        let mut best = (self.cost(0, block), Duration::ZERO);
        for k in 1..HIST_BUCKETS as u32 {
            let window = Duration::from_nanos(1 << k);
            if window > c.max_window {
                break;
            }
            let cost = self.cost(k as usize, block);
            if cost < best.0 {
                best = (cost, window);
            }
        }
        best.1
    }

    /// Expected cost of the window `2^k` ns (k = 0: no polling): buckets
    /// `0..=k` hold the halts shorter than it.
    fn cost(&self, k: usize, block: f64) -> f64 {
        let window = if k == 0 { 0.0 } else { (1u64 << k) as f64 };
        let w = self.config.cpu_weight;
        self.halts
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                if k > 0 && i <= k {
                    n * w * typical_ns(i)
                } else {
                    n * (block + w * window)
                }
            })
            .sum()
    }
}

/// A typical length of a halt in log2 bucket `i` (`[2^(i-1), 2^i)` ns): the
/// middle.
fn typical_ns(i: usize) -> f64 {
    match i {
        0 => 0.0,
        i => 0.75 * (1u64 << i) as f64,
    }
}

/// The bucket of `ns` (KVM's `KVM_STATS_LOG_HIST_UPDATE`).
fn bucket_of(ns: u64) -> usize {
    (64 - ns.leading_zeros() as usize).min(HIST_BUCKETS - 1)
}

/// Adds the halts between `last` and `now` (one vCPU's) to `halts`.
fn add_halts(halts: &mut [f64; HIST_BUCKETS], now: &KvmHaltStats, last: &KvmHaltStats) {
    let caught = now
        .halt_successful_poll
        .saturating_sub(last.halt_successful_poll);
    let polled = now
        .halt_poll_success_ns
        .saturating_sub(last.halt_poll_success_ns);
    add_hist(
        halts,
        &now.halt_poll_success_hist,
        &last.halt_poll_success_hist,
        caught,
        polled,
        0,
    );
    let blocked = now.halt_wakeup.saturating_sub(last.halt_wakeup);
    let waited = now.halt_wait_ns.saturating_sub(last.halt_wait_ns);
    let failed = now.halt_poll_fail_ns.saturating_sub(last.halt_poll_fail_ns);
    let poll_before_block = failed.checked_div(blocked).unwrap_or(0);
    add_hist(
        halts,
        &now.halt_wait_hist,
        &last.halt_wait_hist,
        blocked,
        waited,
        poll_before_block,
    );
}

/// Adds a histogram's growth, or, without one, `count` halts at the mean
/// `total_ns / count`; each halt `extra_ns` longer than it was recorded.
fn add_hist(
    halts: &mut [f64; HIST_BUCKETS],
    now: &[u64],
    last: &[u64],
    count: u64,
    total_ns: u64,
    extra_ns: u64,
) {
    if now.is_empty() {
        if count > 0 {
            halts[bucket_of((total_ns / count).saturating_add(extra_ns))] += count as f64;
        }
        return;
    }
    for (i, &n) in now.iter().enumerate() {
        let before = last.get(i).copied().unwrap_or(0);
        let bucket =
            bucket_of((typical_ns(i.min(HIST_BUCKETS - 1)) as u64).saturating_add(extra_ns));
        halts[bucket] += n.saturating_sub(before) as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1000;

    /// Cumulative stats of a vCPU whose halts so far were `caught` (lengths,
    /// ns, that a poll caught) and `blocked` (block times, ns).
    fn stats(caught: &[u64], blocked: &[u64]) -> KvmHaltStats {
        let mut s = KvmHaltStats {
            halt_poll_success_hist: vec![0; HIST_BUCKETS],
            halt_wait_hist: vec![0; HIST_BUCKETS],
            ..KvmHaltStats::default()
        };
        for &ns in caught {
            s.halt_successful_poll += 1;
            s.halt_poll_success_ns += ns;
            s.halt_poll_success_hist[bucket_of(ns)] += 1;
        }
        for &ns in blocked {
            s.halt_wakeup += 1;
            s.halt_wait_ns += ns;
            s.halt_wait_hist[bucket_of(ns)] += 1;
        }
        s
    }

    #[test]
    fn short_halts_get_a_window_just_above_them() {
        let mut t = WindowTuner::default();
        // 40 µs halts, seen while KVM's window caught them.
        let w = t.update(&[stats(&[40 * US; 32], &[])]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 16)), "65.5 µs > 40 µs");
    }

    #[test]
    fn long_halts_get_no_window() {
        let mut t = WindowTuner::default();
        // A 1 ms periodic timer: every halt blocks for about 1 ms.
        let w = t.update(&[stats(&[], &[1000 * US; 32])]);
        assert_eq!(w, Some(Duration::ZERO));
    }

    #[test]
    fn short_halts_seen_as_blocks_open_the_window_again() {
        let mut t = WindowTuner::default();
        t.update(&[stats(&[], &[1000 * US; 32])]);
        // The workload turns to short halts; with no window they block briefly.
        let w = t.update(&[stats(
            &[],
            &[[1000 * US; 32].as_slice(), &[20 * US; 200]].concat(),
        )]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 15)), "32.8 µs > 20 µs");
    }

    #[test]
    fn too_few_halts_change_nothing_and_the_histogram_fades() {
        let mut t = WindowTuner::default();
        assert_eq!(t.update(&[stats(&[40 * US; 4], &[])]), None);
        let first = stats(&[40 * US; 40], &[]);
        assert!(
            t.update(std::slice::from_ref(&first))
                .is_some_and(|w| w > Duration::ZERO)
        );
        // Later only long halts: the short ones fade (keep 0.75 per interval).
        let mut now = first;
        let mut windows = Vec::new();
        for _ in 0..8 {
            let long = stats(&[], &[2000 * US; 8]);
            now.halt_wakeup += long.halt_wakeup;
            now.halt_wait_ns += long.halt_wait_ns;
            for (a, b) in now.halt_wait_hist.iter_mut().zip(&long.halt_wait_hist) {
                *a += b;
            }
            windows.push(t.update(&[now.clone()]));
        }
        assert!(
            windows[0].is_some_and(|w| w > Duration::ZERO),
            "{windows:?}"
        );
        assert_eq!(windows[7], Some(Duration::ZERO), "{windows:?}");
    }

    #[test]
    fn a_mix_polls_for_the_short_mode_only_while_it_pays() {
        let mut t = WindowTuner::default();
        // Half 20 µs halts, half 1 ms: catching the short ones saves 30 µs
        // each, for 3.3 µs of polling on each long one.
        let w = t.update(&[stats(&[20 * US; 20], &[1000 * US; 20])]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 15)));
        // One short halt per 40 long ones: not worth polling every long one.
        let mut t = WindowTuner::default();
        let w = t.update(&[stats(&[20 * US; 2], &[1000 * US; 200])]);
        assert_eq!(w, Some(Duration::ZERO));
    }

    #[test]
    fn a_blocked_halt_counts_the_poll_that_failed_before_it() {
        // KVM polled 200 µs, then blocked 20 µs: 220 µs halts, too long for
        // the 32.8 µs window that 20 µs halts would get.
        let mut s = stats(&[], &[20 * US; 32]);
        s.halt_attempted_poll = 32;
        s.halt_poll_fail_ns = 32 * 200 * US;
        let w = WindowTuner::default().update(&[s]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 18)), "262 µs > 220 µs");
    }

    #[test]
    fn the_window_never_exceeds_max_window() {
        let config = TunerConfig {
            max_window: Duration::from_micros(50),
            ..TunerConfig::default()
        };
        let mut t = WindowTuner::new(config);
        // 100 µs halts would be worth a 131 µs window.
        let w = t.update(&[stats(&[100 * US; 64], &[])]);
        assert!(w.is_some_and(|w| w <= config.max_window), "{w:?}");
    }

    #[test]
    fn without_histograms_the_means_stand_in() {
        let mut t = WindowTuner::default();
        let mut s = stats(&[40 * US; 32], &[]);
        s.halt_poll_success_hist.clear();
        s.halt_wait_hist.clear();
        assert_eq!(t.update(&[s]), Some(Duration::from_nanos(1 << 16)));
    }

    #[test]
    fn vcpus_are_summed_and_counters_are_deltas() {
        let mut t = WindowTuner::default();
        let a = stats(&[40 * US; 10], &[]);
        let b = stats(&[40 * US; 10], &[]);
        assert_eq!(
            t.update(&[a.clone(), b.clone()]),
            Some(Duration::from_nanos(1 << 16))
        );
        // The same cumulative values again: nothing new, so the histogram only
        // fades (20 * 0.75 = 15 < 16 halts): the window stays as it was.
        assert_eq!(t.update(&[a, b]), Some(Duration::from_nanos(1 << 16)));
        assert!(t.halts.iter().sum::<f64>() < 16.0);
    }
}
