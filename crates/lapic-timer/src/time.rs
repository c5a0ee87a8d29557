//! Time: the host TSC and the thread's CPU time as clocks, and the guest's
//! TSC as a function of host time.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::clock::{Clock, MonotonicClock};

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`, a system call):
/// what a spin cost, which a preemption in the middle of it does not add to.
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadCpuClock;

impl Clock for ThreadCpuClock {
    fn now(&self) -> Duration {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime writes the timespec we own; the clock exists
        // on every Linux this crate builds for.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
        Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
    }
}

/// The host TSC, converted to `CLOCK_MONOTONIC` nanoseconds with a calibrated
/// frequency (a reading is an `rdtsc`, about 10 ns here). Needs a constant,
/// invariant TSC.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TscClock {
    /// TSC ticks per ns.
    ticks_per_ns: f64,
    tsc0: u64,
    ns0: u64,
}

/// The host's time-stamp counter.
pub fn rdtsc() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: rdtsc has no memory effects; x86-64 always has it.
        unsafe { core::arch::x86_64::_rdtsc() }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        MonotonicClock.now_ns()
    }
}

impl TscClock {
    /// Measures the TSC against `CLOCK_MONOTONIC` for `over`.
    pub fn calibrate(over: Duration) -> Self {
        let (t0, n0) = paired_read();
        let start = Instant::now();
        while start.elapsed() < over {
            std::hint::spin_loop();
        }
        let (t1, n1) = paired_read();
        let ticks_per_ns = (t1 - t0) as f64 / (n1 - n0).max(1) as f64;
        Self {
            ticks_per_ns,
            tsc0: t1,
            ns0: n1,
        }
    }

    /// A clock calibrated once per process (10 ms).
    pub fn shared() -> Self {
        static CLOCK: OnceLock<TscClock> = OnceLock::new();
        *CLOCK.get_or_init(|| Self::calibrate(Duration::from_millis(10)))
    }

    /// The TSC frequency, in kHz.
    pub fn tsc_khz(&self) -> u64 {
        (self.ticks_per_ns * 1e6) as u64
    }
}

/// A TSC reading and a `CLOCK_MONOTONIC` reading of one instant: of a few
/// tries, the one whose clock read the TSC brackets most tightly, so that a
/// preemption between the two reads (milliseconds on a busy host) does not
/// skew the calibration.
fn paired_read() -> (u64, u64) {
    let mut best = (u64::MAX, 0, 0);
    for _ in 0..5 {
        let before = rdtsc();
        let ns = MonotonicClock.now_ns();
        let bracket = rdtsc().wrapping_sub(before);
        if bracket < best.0 {
            best = (bracket, before.wrapping_add(bracket / 2), ns);
        }
    }
    (best.1, best.2)
}

impl Clock for TscClock {
    fn now(&self) -> Duration {
        let ticks = rdtsc().wrapping_sub(self.tsc0) as i64 as f64;
        Duration::from_nanos((self.ns0 as f64 + ticks / self.ticks_per_ns) as u64)
    }
}

/// The guest's TSC as a linear function of host time: it read `tsc_at_ns` at
/// host time `ns`, and counts `tsc_khz` thousand ticks per host millisecond.
///
/// Built from the guest TSC frequency and offset that the VMM gave KVM (guest
/// TSC = host TSC + offset, with no TSC scaling).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GuestTime {
    /// Guest TSC ticks per ms.
    pub tsc_khz: u64,
    /// A host time (ns)...
    pub ns: u64,
    /// ...and the guest TSC at that moment.
    pub tsc_at_ns: u64,
}

impl GuestTime {
    /// Guest time for a guest whose TSC is the host TSC plus `tsc_offset`,
    /// sampled now from `clock`.
    pub fn from_host(clock: &TscClock, tsc_offset: i64) -> Self {
        let (tsc, ns) = (rdtsc(), clock.now_ns());
        Self {
            tsc_khz: clock.tsc_khz(),
            ns,
            tsc_at_ns: tsc.wrapping_add_signed(tsc_offset),
        }
    }

    /// The guest TSC at host time `ns`.
    pub fn tsc_at(&self, ns: u64) -> u64 {
        let delta = i128::from(ns) - i128::from(self.ns);
        let ticks = delta * i128::from(self.tsc_khz) / 1_000_000;
        (i128::from(self.tsc_at_ns) + ticks).clamp(0, i128::from(u64::MAX)) as u64
    }

    /// The host time (ns) at which the guest TSC reaches `tsc`; saturates for
    /// values out of range (a guest may write any deadline).
    pub fn ns_at(&self, tsc: u64) -> u64 {
        if self.tsc_khz == 0 {
            return u64::MAX;
        }
        let delta = i128::from(tsc) - i128::from(self.tsc_at_ns);
        let ns = delta * 1_000_000 / i128::from(self.tsc_khz);
        (i128::from(self.ns) + ns).clamp(0, i128::from(u64::MAX)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guest_time_converts_both_ways() {
        let t = GuestTime {
            tsc_khz: 2_000_000,
            ns: 1_000,
            tsc_at_ns: 10_000,
        };
        assert_eq!(t.tsc_at(2_000), 12_000, "2 ticks per ns");
        assert_eq!(t.ns_at(12_000), 2_000);
        assert_eq!(t.ns_at(0), 0, "before the epoch saturates at 0");
        assert_eq!(t.ns_at(u64::MAX), 1_000 + (u64::MAX - 10_000) / 2);
        assert_eq!(
            GuestTime { tsc_khz: 0, ..t }.ns_at(5),
            u64::MAX,
            "no TSC frequency: never"
        );
        assert_eq!(t.tsc_at(u64::MAX), u64::MAX);
    }

    #[test]
    fn tsc_clock_tracks_the_monotonic_clock() {
        let tsc = TscClock::calibrate(Duration::from_millis(5));
        assert!(
            tsc.tsc_khz() > 100_000,
            "a TSC of at least 100 MHz: {}",
            tsc.tsc_khz()
        );
        let before = MonotonicClock.now_ns();
        let now = tsc.now_ns();
        let after = MonotonicClock.now_ns();
        let within = before.saturating_sub(1_000_000)..after + 1_000_000;
        assert!(within.contains(&now), "within 1 ms: {before} {now} {after}");
    }

    #[test]
    fn thread_cpu_time_does_not_count_sleep() {
        let (cpu0, wall0) = (ThreadCpuClock.now_ns(), MonotonicClock.now_ns());
        std::thread::sleep(Duration::from_millis(20));
        let (cpu, wall) = (
            ThreadCpuClock.now_ns() - cpu0,
            MonotonicClock.now_ns() - wall0,
        );
        assert!(
            wall >= 20_000_000 && cpu < 10_000_000,
            "cpu {cpu} ns of wall {wall} ns"
        );
    }
}
