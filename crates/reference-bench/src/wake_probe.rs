//! The host's own real-time wake-up latency, measured beside a benchmark:
//! one `SCHED_FIFO` 99 thread per CPU, pinned there, sleeping to an
//! absolute deadline every millisecond and recording how late it ran
//! (cyclictest's method).
//!
//! A boost's revoker can take a boost back no sooner than the host lets
//! its highest-priority thread run. Where the host itself is late (a
//! kernel that does not preempt, a hypervisor below it that holds the
//! CPU), no userspace revoker keeps a boost to its budget, and this probe
//! shows by how much in the same runs, independently of the booster.
//! Likewise a post-copy remote fault waits on a fetch and a serve thread:
//! beside post-copy runs the probe counts the times no thread could run
//! for over [`HELD`], and a fault caught in one waits as long.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::thread::{self, JoinHandle};
use std::time::Duration;

/// How often each probe thread wakes.
pub const PERIOD: Duration = Duration::from_millis(1);

/// A wake-up later than this is the host holding a CPU from every thread
/// of this machine, its highest-priority one included: a thread that
/// waits for a CPU then (a page fault's handler, say) waits as long.
pub const HELD: Duration = Duration::from_millis(1);

/// What the probe threads saw over an interval.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lateness {
    /// The latest any probe thread woke past its deadline.
    pub latest: Duration,
    /// Wake-ups later than [`HELD`], over every probe thread.
    pub held: u64,
}

/// The probe threads; see the [module docs](self).
pub struct WakeProbe {
    stop: Arc<AtomicBool>,
    seen: Arc<Seen>,
    threads: Vec<JoinHandle<()>>,
}

/// The probe threads' tallies since the last [`WakeProbe::take`].
#[derive(Default)]
struct Seen {
    latest_ns: AtomicU64,
    held: AtomicU64,
}

impl Seen {
    /// Tallies a wake-up `late_ns` past its deadline.
    fn record(&self, late_ns: u64) {
        self.latest_ns.fetch_max(late_ns, Relaxed);
        if late_ns > HELD.as_nanos() as u64 {
            self.held.fetch_add(1, Relaxed);
        }
    }
}

impl WakeProbe {
    /// Starts a probe thread on each of this process's CPUs, or says why
    /// it cannot (no real-time priority for this process, no CPU list).
    pub fn start() -> Result<Self, String> {
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Seen::default());
        let mut probe = Self {
            stop: stop.clone(),
            seen: seen.clone(),
            threads: Vec::new(),
        };
        for cpu in allowed_cpus()? {
            let (ready, started) = std::sync::mpsc::channel();
            let (stop, seen) = (stop.clone(), seen.clone());
            let thread = thread::Builder::new()
                .name(format!("wake-probe-{cpu}"))
                .spawn(move || match make_real_time(cpu) {
                    Ok(()) => {
                        let _ = ready.send(Ok(()));
                        sleep_and_measure(&stop, &seen);
                    }
                    Err(e) => {
                        let _ = ready.send(Err(e));
                    }
                })
                .map_err(|e| format!("cannot start a probe thread: {e}"))?;
            probe.threads.push(thread);
            started
                .recv()
                .map_err(|_| "a probe thread ended before starting".to_string())??;
        }
        Ok(probe)
    }

    /// What the probe threads saw since the last call (or the start);
    /// starts the next interval.
    pub fn take(&self) -> Lateness {
        Lateness {
            latest: Duration::from_nanos(self.seen.latest_ns.swap(0, Relaxed)),
            held: self.seen.held.swap(0, Relaxed),
        }
    }
}

impl Drop for WakeProbe {
    fn drop(&mut self) {
        self.stop.store(true, Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// The CPUs this process may run on.
fn allowed_cpus() -> Result<Vec<usize>, String> {
    // SAFETY: a zeroed cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a cpu_set_t of the size given, written by the call.
    let ret = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    if ret != 0 {
        return Err(format!(
            "cannot read the CPUs: {}",
            std::io::Error::last_os_error()
        ));
    }
    // SAFETY: CPU_ISSET reads the set within its size.
    Ok((0..libc::CPU_SETSIZE as usize)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Pins the calling thread to `cpu` at `SCHED_FIFO` 99.
fn make_real_time(cpu: usize) -> Result<(), String> {
    // SAFETY: a zeroed cpu_set_t is a valid, empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `cpu` is below CPU_SETSIZE (it came from a set).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: sets the calling thread's affinity from a valid set.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(format!(
            "cannot pin a probe thread to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        ));
    }
    let param = libc::sched_param { sched_priority: 99 };
    // SAFETY: sets the calling thread's policy from a valid parameter.
    if unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) } != 0 {
        return Err(format!(
            "no SCHED_FIFO 99 for a probe thread ({}): the host's real-time wake-up is not measured",
            std::io::Error::last_os_error()
        ));
    }
    Ok(())
}

/// Sleeps to a deadline each [`PERIOD`] until `stop`, raising the latest
/// lateness in `seen` to each wake-up's and counting those past [`HELD`].
fn sleep_and_measure(stop: &AtomicBool, seen: &Seen) {
    let mut deadline = now_ns() + PERIOD.as_nanos() as u64;
    while !stop.load(Relaxed) {
        let at = libc::timespec {
            tv_sec: (deadline / 1_000_000_000) as _,
            tv_nsec: (deadline % 1_000_000_000) as _,
        };
        // SAFETY: sleeps to an absolute time on the monotonic clock; no
        // remaining time is asked for with TIMER_ABSTIME.
        let ret = unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &at,
                std::ptr::null_mut(),
            )
        };
        if ret != 0 {
            continue; // interrupted: sleep to the same deadline
        }
        let woke = now_ns();
        seen.record(woke.saturating_sub(deadline));
        // After a long stall, the next deadline is a period from now, not
        // a run of deadlines already past.
        deadline = (deadline + PERIOD.as_nanos() as u64).max(woke + 1);
    }
}

/// The monotonic clock, ns.
fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: writes the monotonic time into `ts`.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_wake_ups_later_than_held_count_as_held() {
        let seen = Seen::default();
        seen.record(900_000);
        seen.record(HELD.as_nanos() as u64);
        assert_eq!(seen.held.load(Relaxed), 0);
        seen.record(4_400_000);
        seen.record(1_200_000);
        assert_eq!(seen.held.load(Relaxed), 2);
        assert_eq!(seen.latest_ns.load(Relaxed), 4_400_000);
    }
}
