//! Whether threads other than a VM's own vCPUs compete for the host's CPUs.
//!
//! A plain `sched_yield` gives the CPU to whoever the scheduler picks next.
//! When the only other runnable threads are the VM's own vCPUs, that is one
//! of them, and a yield is as good as a directed one; when other tenants are
//! runnable too, it may be one of them. [`Crowding`] tells the two apart from
//! the host's runnable-thread count (`/proc/loadavg`) and the vCPUs' run state.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::state::VcpuState;

/// Where the host's runnable-thread count comes from.
pub trait LoadSource: Send + Sync {
    /// Threads runnable on the host now, the caller included.
    fn runnable(&self) -> io::Result<usize>;
}

/// The host's runnable threads from `/proc/loadavg`'s fourth field
/// ("running/total").
#[derive(Debug)]
pub struct RunnableThreads {
    file: File,
}

/// Parses the running count out of "<1m> <5m> <15m> <running>/<total> <pid>".
fn parse_running(text: &[u8]) -> Option<usize> {
    let field = std::str::from_utf8(text).ok()?.split_whitespace().nth(3)?;
    field.split_once('/')?.0.parse().ok()
}

impl RunnableThreads {
    /// Opens `/proc/loadavg`.
    pub fn new() -> io::Result<Self> {
        Ok(Self {
            file: File::open("/proc/loadavg")?,
        })
    }
}

impl LoadSource for RunnableThreads {
    fn runnable(&self) -> io::Result<usize> {
        let mut buf = [0u8; 128];
        let n = self.file.read_at(&mut buf, 0)?;
        parse_running(&buf[..n]).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "unexpected /proc/loadavg format",
            )
        })
    }
}

/// Runnable threads besides the VM's vCPUs still taken for an uncrowded host:
/// the two counts race with the vCPUs' own state changes (a vCPU blocks or
/// wakes between the reads), and a lone kernel worker is not a tenant.
pub const OTHERS_TOLERATED: usize = 1;

/// How often [`Crowding`] samples the load by default.
pub const SAMPLE_PERIOD: Duration = Duration::from_micros(500);

const BOTH_CROWDED: u8 = 0b11;

/// Decides, from samples at most every period, whether other threads compete
/// with the VM's vCPUs: more runnable threads than the vCPUs that are not
/// halted (or are being woken) plus [`OTHERS_TOLERATED`], in the last two
/// samples running, so a count caught mid-wake-up does not flip the verdict.
/// Without a load source (no `/proc/loadavg`) the host counts as crowded, the
/// safe side for a policy that would otherwise yield to anyone.
#[derive(Debug)]
pub struct Crowding<L: LoadSource = RunnableThreads> {
    load: Option<L>,
    period: Duration,
    epoch: Instant,
    /// When the load was last sampled, ns since `epoch`, plus 1; 0 before the first.
    sampled_at: AtomicU64,
    /// The last two verdicts, one bit each.
    samples: AtomicU8,
}

impl Default for Crowding {
    fn default() -> Self {
        Self::with_source(RunnableThreads::new().ok(), SAMPLE_PERIOD)
    }
}

impl Crowding {
    /// Samples `/proc/loadavg` every [`SAMPLE_PERIOD`].
    pub fn new() -> Self {
        Self::default()
    }
}

impl<L: LoadSource> Crowding<L> {
    /// Samples `load` (none: always crowded) at most every `period`.
    pub fn with_source(load: Option<L>, period: Duration) -> Self {
        Self {
            load,
            period,
            epoch: Instant::now(),
            sampled_at: AtomicU64::new(0),
            samples: AtomicU8::new(BOTH_CROWDED),
        }
    }

    /// Whether threads other than `vcpus` want the host's CPUs. One caller
    /// per period samples; the others read the last verdict.
    pub fn crowded(&self, vcpus: &[VcpuState]) -> bool {
        let Some(load) = &self.load else {
            return true;
        };
        let now = self.epoch.elapsed().as_nanos() as u64 + 1;
        let last = self.sampled_at.load(Relaxed);
        let due = last == 0 || now.saturating_sub(last) >= self.period.as_nanos() as u64;
        if due
            && self
                .sampled_at
                .compare_exchange(last, now, Relaxed, Relaxed)
                .is_ok()
        {
            let ours = vcpus
                .iter()
                .filter(|v| !v.is_blocking() || v.is_ready())
                .count();
            let crowded = load
                .runnable()
                .map_or(true, |n| n > ours + OTHERS_TOLERATED);
            let previous = self.samples.load(Relaxed);
            let samples = ((previous << 1) | u8::from(crowded)) & BOTH_CROWDED;
            self.samples.store(samples, Relaxed);
        }
        self.samples.load(Relaxed) == BOTH_CROWDED
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::RunState;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn parses_loadavg() {
        assert_eq!(parse_running(b"0.00 0.01 0.05 3/245 12345\n"), Some(3));
        assert_eq!(parse_running(b"0.00 0.01 0.05 3-245 1"), None);
        assert_eq!(parse_running(b"0.00"), None);
    }

    #[test]
    fn spinning_threads_are_counted_as_runnable() {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinners: Vec<_> = (0..4)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(20));
        let busy = RunnableThreads::new().unwrap().runnable().unwrap();
        stop.store(true, Relaxed);
        spinners.into_iter().for_each(|t| t.join().unwrap());
        assert!(busy >= 5, "four spinners and the caller: {busy}");
    }

    struct Fake(AtomicUsize);

    impl LoadSource for Fake {
        fn runnable(&self) -> io::Result<usize> {
            match self.0.load(Relaxed) {
                usize::MAX => Err(io::Error::other("unreadable")),
                n => Ok(n),
            }
        }
    }

    fn vcpus_running(n: usize) -> Vec<VcpuState> {
        let v: Vec<VcpuState> = (0..4).map(|_| VcpuState::new()).collect();
        v[n..]
            .iter()
            .for_each(|v| v.set_run_state(RunState::Halted));
        v
    }

    #[test]
    fn crowded_only_after_two_samples_over_the_vcpus_and_the_tolerance() {
        let c = Crowding::with_source(Some(Fake(AtomicUsize::new(3))), Duration::ZERO);
        let v = vcpus_running(2);
        assert!(!c.crowded(&v), "3 runnable, 2 vCPUs running, 1 tolerated");
        c.load.as_ref().unwrap().0.store(4, Relaxed);
        assert!(!c.crowded(&v), "one crowded sample is not enough");
        assert!(c.crowded(&v), "two are");
        v[2].delivered(); // a halted vCPU being woken counts as ours
        assert!(!c.crowded(&v));
    }

    #[test]
    fn no_or_failing_source_is_crowded() {
        let none: Crowding<Fake> = Crowding::with_source(None, Duration::ZERO);
        assert!(none.crowded(&vcpus_running(4)));
        let failing =
            Crowding::with_source(Some(Fake(AtomicUsize::new(usize::MAX))), Duration::ZERO);
        failing.crowded(&vcpus_running(4));
        assert!(failing.crowded(&vcpus_running(4)));
    }

    #[test]
    fn samples_at_most_once_per_period() {
        let c = Crowding::with_source(Some(Fake(AtomicUsize::new(99))), Duration::from_secs(3600));
        let v = vcpus_running(4);
        c.crowded(&v); // the first call samples: crowded, one bit
        c.load.as_ref().unwrap().0.store(0, Relaxed);
        assert!(c.crowded(&v), "no new sample within the period");
    }
}
