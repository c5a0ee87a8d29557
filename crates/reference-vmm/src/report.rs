//! What a run reports: each vCPU's summary and what the mechanisms did.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use test_guests::Report;

/// How a vCPU's run ended, and what its guest program reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VcpuSummary {
    /// vCPU index.
    pub index: u32,
    /// Whether the program finished (ucall done) rather than being stopped.
    pub finished: bool,
    /// Exits handled.
    pub exits: u64,
    /// Time the vCPU paused under a migration's dirty limit.
    pub dirty_paused: Duration,
    /// The longest pause per run slice a migration's dirty limit gave the
    /// vCPU, whether or not it reached an exit to take it before the limit
    /// ended (zero: it was never given one).
    pub dirty_pause_given: Duration,
    /// Named values the program reported, in order.
    pub reports: Vec<Report>,
}

/// The outcome of a run that finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunReport {
    /// The guest program that ran.
    pub guest: &'static str,
    /// Each vCPU's summary, by index.
    pub vcpus: Vec<VcpuSummary>,
    /// Wall time from starting the first vCPU to the last one finishing.
    pub elapsed: Duration,
    /// What the mechanisms did.
    pub stats: VmStats,
    /// Whether the VM was handed over to a migration's destination (its
    /// vCPUs then stopped here, unfinished).
    pub handed_over: bool,
}

/// What the mechanisms did during a run, summed over the vCPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmStats {
    /// Time halted vCPU threads spent polling, ns (halt-poll).
    pub polled_ns: u64,
    /// Of which in polls that ended in a block (the wake-up came later), ns.
    pub failed_poll_ns: u64,
    /// Time halted vCPU threads spent blocked, ns.
    pub blocked_ns: u64,
    /// Halts that ended while polling.
    pub successful_polls: u64,
    /// Halts whose plan had a poll window (polled, or blocked at once
    /// because the CPU was contended).
    pub attempted_polls: u64,
    /// Interrupts posted to vCPUs.
    pub interrupts: u64,
    /// Kicks of vCPUs in the guest.
    pub kicks: u64,
    /// Wake-ups of halted vCPUs.
    pub wakes: u64,
    /// Boosts of vCPU threads (vcpu-sched).
    pub boosts: u64,
    /// The longest of them, ns.
    pub longest_boost_ns: u64,
    /// The latest the booster's revoker, taking a boost back, woke past the
    /// deadline it slept until, ns: the host's wake-up latency, the most
    /// that boost outlasted its budget by.
    pub latest_revoker_wake_ns: u64,
    /// The most CPU time a vCPU thread ran in one boost, ns (its own CPU
    /// clock): what a boost took from other threads, however long it lasted.
    pub most_boost_cpu_ns: u64,
    /// Directed yields attempted (KVM's `directed_yield_attempted`).
    pub directed_yield_attempted: u64,
    /// Guest output bytes that never reached the output: dropped when the
    /// buffer was full, or still buffered when the run ended, because the
    /// output blocked (a pipe nobody reads, say).
    pub output_lost: u64,
    /// Device-bus lookups on exits.
    pub bus_lookups: u64,
    /// TSC ticks spent in them (with the device's handling).
    pub bus_lookup_ticks: u64,
    /// LAPIC timer expiries delivered by the userspace APIC.
    pub timer_expiries: u64,
    /// CPU time vCPU threads spun to their timers' targets, ns (the
    /// advance's CPU; a preemption in a spin does not count).
    pub timer_spin_ns: u64,
    /// The median of the userspace APIC's timer deliveries, from delivery
    /// start to the guest's interrupt entry, whole µs (`None`: none measured).
    pub timer_delivery_p50_us: Option<u64>,
    /// The 99th percentile of how late the userspace APIC's timer deliveries
    /// started after their targets (the advance's own miss), as the upper
    /// edge of its power-of-two bucket, ns (`None`: none delivered).
    pub timer_start_p99_ns: Option<u64>,
    /// KVM's halt-polling window, ns, as `--halt-poll tuned` or
    /// `budget:SHARE` set it last (`None`: not tuned, or too few halts to
    /// set one).
    pub tuned_window_ns: Option<u64>,
    /// How many times the tuner changed KVM's window (each a
    /// `KVM_ENABLE_CAP` that restarts the vCPUs' own windows).
    pub tuned_window_changes: u64,
    /// I/Os the completion device (KVM's irqchip) completed by irqfd.
    pub completions: u64,
    /// Of which to a vCPU whose thread waited for a CPU (handed to the
    /// boost policy).
    pub completions_to_preempted: u64,
}

/// The bucket of `hist` that holds its `num / den` quantile (`None` for an
/// empty one).
pub(crate) fn bucket_holding(hist: &[AtomicU64], num: u64, den: u64) -> Option<usize> {
    let counts: Vec<u64> = hist.iter().map(|c| c.load(Relaxed)).collect();
    let total: u64 = counts.iter().sum();
    let mut below = 0;
    counts.iter().position(|&c| {
        below += c;
        c > 0 && below.saturating_mul(den) >= total.saturating_mul(num)
    })
}

/// The upper edge, ns, of the power-of-two bucket (bucket `i`: below `2^i`
/// ns) that holds the 99th percentile of `hist`; `None` for an empty one.
pub(crate) fn p99_bucket_edge(hist: &[AtomicU64]) -> Option<u64> {
    let bucket = bucket_holding(hist, 99, 100)?;
    Some(1u64.checked_shl(bucket as u32).unwrap_or(u64::MAX))
}

impl RunReport {
    /// The first value called `name` that vCPU `vcpu` reported.
    pub fn value(&self, vcpu: u32, name: &str) -> Option<u64> {
        let summary = self.vcpus.iter().find(|s| s.index == vcpu)?;
        summary
            .reports
            .iter()
            .find(|r| r.name == name)
            .map(|r| r.value)
    }
}

/// TSC ticks in milliseconds at this host's TSC rate (the guest's: KVM
/// gives it the host's), for a reader who does not count in ticks.
fn ticks_in_ms(ticks: u64) -> String {
    let khz = lapic_timer::TscClock::shared().tsc_khz().max(1);
    format!("{:.3} ms", ticks as f64 / khz as f64)
}

impl fmt::Display for RunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stopped = self.vcpus.iter().filter(|s| !s.finished).count();
        write!(f, "guest {}: {} vCPU(s) ", self.guest, self.vcpus.len())?;
        match stopped {
            _ if self.handed_over => write!(f, "ran {:.3?}, then handed over", self.elapsed)?,
            0 => write!(f, "finished in {:.3?}", self.elapsed)?,
            n => write!(f, "ran {:.3?}, {n} stopped before finishing", self.elapsed)?,
        }
        for s in &self.vcpus {
            write!(f, "\n  vcpu {}: {} exits", s.index, s.exits)?;
            if !s.dirty_pause_given.is_zero() {
                write!(
                    f,
                    ", {:.1?} paused by the dirty limit (given up to {:.1?} a slice)",
                    s.dirty_paused, s.dirty_pause_given
                )?;
            }
            for Report { name, value } in &s.reports {
                write!(f, ", {name} = {value}")?;
                if name.ends_with("_ticks") {
                    write!(f, " ({})", ticks_in_ms(*value))?;
                }
            }
        }
        let st = &self.stats;
        write!(
            f,
            "\n  halts: {:.3} ms polling ({} ended while polling; {:.3} ms in polls that \
             failed), {:.3} ms blocked; {} interrupts, {} kicks, {} wakes, {} boosts",
            st.polled_ns as f64 / 1e6,
            st.successful_polls,
            st.failed_poll_ns as f64 / 1e6,
            st.blocked_ns as f64 / 1e6,
            st.interrupts,
            st.kicks,
            st.wakes,
            st.boosts,
        )?;
        if st.boosts > 0 {
            write!(
                f,
                " (the longest {:.0} µs, the most CPU in one {:.0} µs; the revoker woke at most \
                 {:.0} µs late)",
                st.longest_boost_ns as f64 / 1e3,
                st.most_boost_cpu_ns as f64 / 1e3,
                st.latest_revoker_wake_ns as f64 / 1e3
            )?;
        }
        if let Some(ns) = st.tuned_window_ns {
            write!(
                f,
                "\n  KVM's halt-polling window, as last tuned: {:.1} µs ({} changes)",
                ns as f64 / 1e3,
                st.tuned_window_changes
            )?;
        }
        if st.completions > 0 {
            write!(
                f,
                "\n  completion device: {} I/Os completed, {} to a vCPU waiting for a CPU",
                st.completions, st.completions_to_preempted
            )?;
        }
        if st.output_lost > 0 {
            write!(
                f,
                "\n  guest output: {} byte(s) never written (the output blocked)",
                st.output_lost
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_p99_bucket_is_the_upper_edge_of_the_one_holding_it() {
        let hist: Vec<AtomicU64> = (0..32).map(|_| AtomicU64::new(0)).collect();
        assert_eq!(p99_bucket_edge(&hist), None);
        hist[0].store(98, Relaxed); // on time
        hist[13].store(1, Relaxed); // [4096, 8192) ns
        hist[15].store(1, Relaxed); // [16384, 32768) ns
        assert_eq!(p99_bucket_edge(&hist), Some(8192));
        hist[15].store(2, Relaxed);
        assert_eq!(p99_bucket_edge(&hist), Some(32768));
    }

    #[test]
    fn report_finds_values_by_vcpu_and_name() {
        let report = RunReport {
            guest: "hello",
            vcpus: vec![VcpuSummary {
                index: 1,
                finished: true,
                exits: 3,
                dirty_paused: Duration::ZERO,
                dirty_pause_given: Duration::ZERO,
                reports: vec![Report {
                    name: "apic_id".into(),
                    value: 1,
                }],
            }],
            elapsed: Duration::from_millis(2),
            stats: VmStats::default(),
            handed_over: false,
        };
        assert_eq!(report.value(1, "apic_id"), Some(1));
        assert_eq!(report.value(0, "apic_id"), None);
        assert!(report.to_string().contains("vcpu 1: 3 exits, apic_id = 1"));
    }
}
