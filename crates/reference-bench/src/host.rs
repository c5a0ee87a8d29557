//! How busy the host was while a benchmark ran: the CPU time that other
//! processes took, from `/proc/stat`, less this process's own and its
//! finished children's (`reference-bench halt`'s CPU hog is part of the measurement). A reader
//! comparing two reports needs it: on a machine where other tenants kept
//! the CPUs busy, every figure moves, and ratios move too.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::cpu_time_with_children;

/// Other processes above this many CPUs on average make a run "busy".
pub const BUSY_CPUS: f64 = 0.25;

/// A reading taken when a measurement starts.
#[derive(Clone, Copy, Debug)]
pub struct HostLoad {
    busy: Option<Duration>,
    own: Duration,
    start: Instant,
}

impl HostLoad {
    /// Starts watching.
    pub fn start() -> Self {
        Self {
            busy: busy_time(),
            own: cpu_time_with_children(),
            start: Instant::now(),
        }
    }

    /// CPUs that other processes kept busy on average since the start, or
    /// None where `/proc/stat` cannot be read.
    pub fn others_cpus(&self) -> Option<f64> {
        let busy = busy_time()?.checked_sub(self.busy?)?;
        let own = cpu_time_with_children().saturating_sub(self.own);
        let wall = self.start.elapsed().as_secs_f64();
        (wall > 0.0).then(|| (busy.as_secs_f64() - own.as_secs_f64()).max(0.0) / wall)
    }

    /// A line for a report: how busy the host was, and what that means for
    /// reading the figures.
    pub fn note(&self) -> String {
        let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
        match self.others_cpus() {
            Some(cpus) => format!(
                "Host: other processes kept {cpus:.2} of {cores} CPUs busy on average during \
                 this measurement{}",
                if cpus > BUSY_CPUS {
                    ": a busy host, so every figure here moved with it; rerun on an idle host \
                     before comparing with another report."
                } else {
                    " (idle enough to compare with another idle run)."
                }
            ),
            None => {
                "Host: /proc/stat could not be read, so how busy the host was is unknown.".into()
            }
        }
    }
}

/// What this machine is, as read from it: its cores, CPU model, kernel, and
/// which KVM module serves `/dev/kvm` (PVM's `kvm_pvm` emulates guest CPL0
/// code an instruction at a time; `kvm_intel` and `kvm_amd` run it on the
/// CPU), for a report to say where its figures come from.
pub fn machine() -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
        .map_or("an unknown CPU", |(_, m)| m.trim());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let kvm = match ["kvm_pvm", "kvm_intel", "kvm_amd"]
        .into_iter()
        .find(|m| Path::new("/sys/module").join(m).exists())
    {
        Some("kvm_pvm") => "KVM is PVM (kvm_pvm: software virtualization, where guest CPL0 code \
                           is emulated one instruction at a time, so every interrupt handler, EOI \
                           and halt costs tens of microseconds; the guests' hot loops run at CPL3)"
            .to_owned(),
        Some(module) => format!("KVM is hardware virtualization ({module})"),
        None => "no KVM module was found in /sys/module".to_owned(),
    };
    format!("{cores} cores ({model}), Linux {}; {kvm}", kernel.trim())
}

/// Busy CPU time of the whole host so far (every CPU's user, nice, system,
/// irq, softirq and steal time, from the first line of `/proc/stat`).
fn busy_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    busy_from_stat(&stat, clock_ticks_per_second()?)
}

fn busy_from_stat(stat: &str, ticks_per_second: u64) -> Option<Duration> {
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal (guest time is in user).
    let busy: u64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .map(|&i| fields.get(i).copied().unwrap_or(0))
        .sum();
    Some(Duration::from_secs_f64(
        busy as f64 / ticks_per_second as f64,
    ))
}

fn clock_ticks_per_second() -> Option<u64> {
    // SAFETY: sysconf has no memory-safety preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    u64::try_from(ticks).ok().filter(|&t| t > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_time_counts_everything_but_idle_and_iowait() {
        let stat = "cpu  100 20 30 5000 7 1 2 3 40 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n";
        assert_eq!(busy_from_stat(stat, 100), Some(Duration::from_millis(1560)));
        assert_eq!(busy_from_stat("intr 5\n", 100), None);
        assert_eq!(busy_from_stat("cpu  1 x 3\n", 100), None);
    }

    #[test]
    fn another_process_burning_cpu_is_counted() {
        // A shell in a busy loop takes its fair share of a CPU even on a
        // crowded host: at 2 cores and 7 runnable threads, about 0.3 CPU.
        let load = HostLoad::start();
        let mut burner = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(500));
        let others = load.others_cpus();
        let _ = burner.kill();
        let _ = burner.wait();
        let others = others.expect("/proc/stat is readable on Linux");
        assert!(others > 0.1, "{others} CPUs");
        assert!(load.note().starts_with("Host: other processes kept"));
        // Once waited for, the child's CPU is this process's own.
        let after = load.others_cpus().unwrap();
        assert!(
            after < others,
            "{after} CPUs after the wait, {others} before"
        );
    }
}
