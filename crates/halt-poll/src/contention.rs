//! Whether other threads are waiting for this thread's CPU: the userspace
//! counterpart of the kernel's `single_task_running()` check in halt polling.
//!
//! The signal is the thread's own `run_delay` (`/proc/thread-self/schedstat`):
//! time it spent runnable but waiting on a runqueue. When that grows, the CPUs
//! are oversubscribed, and a thread that polls takes CPU time from one that
//! would do work, on a 2-core machine often from the very thread that would
//! wake it. Reading it costs a system call, so it is read at most once per
//! [`CHECK_INTERVAL`], and a verdict of "contended" holds for [`HOLD`].

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::time::Duration;

/// How often `run_delay` is read.
pub const CHECK_INTERVAL: Duration = Duration::from_millis(1);
/// How long the thread stops polling once it saw contention.
pub const HOLD: Duration = Duration::from_millis(5);
/// Waiting on a runqueue for more than this share of the time is contention.
pub const THRESHOLD: f64 = 0.2;

/// Per-thread sampler of `run_delay`. Opened lazily on the thread that uses it;
/// where `/proc/thread-self/schedstat` is missing it never reports contention.
#[derive(Debug, Default)]
pub struct RunDelayProbe {
    file: Option<(File, std::thread::ThreadId)>,
    unavailable: bool,
    last_check: Option<Duration>,
    last_delay_ns: u64,
    contended_until: Duration,
}

impl RunDelayProbe {
    /// A probe that has not read anything yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether other threads have been waiting for this thread's CPU; `now` is
    /// the caller's clock.
    pub fn contended(&mut self, now: Duration) -> bool {
        let due = self
            .last_check
            .is_none_or(|t| now.saturating_sub(t) >= CHECK_INTERVAL);
        if due {
            if let Some(delay_ns) = self.read_run_delay() {
                self.observe(now, delay_ns);
            }
        }
        now < self.contended_until
    }

    /// Takes a `run_delay` reading at `now`.
    fn observe(&mut self, now: Duration, delay_ns: u64) {
        if let Some(last) = self.last_check {
            let waited = delay_ns.saturating_sub(self.last_delay_ns) as f64;
            if waited / (now.saturating_sub(last).as_nanos().max(1) as f64) > THRESHOLD {
                self.contended_until = now + HOLD;
            }
        }
        self.last_delay_ns = delay_ns;
        self.last_check = Some(now);
    }

    /// Opens the calling thread's `schedstat` now, unless it is open for
    /// this thread already. An error (no such file) switches the probe off.
    pub fn open(&mut self) -> io::Result<()> {
        let me = std::thread::current().id();
        if self.file.as_ref().is_some_and(|(_, owner)| *owner == me) {
            return Ok(());
        }
        match File::open("/proc/thread-self/schedstat") {
            Ok(f) => {
                self.file = Some((f, me));
                self.unavailable = false;
                Ok(())
            }
            Err(e) => {
                self.unavailable = true;
                Err(e)
            }
        }
    }

    fn read_run_delay(&mut self) -> Option<u64> {
        if self.unavailable || self.open().is_err() {
            return None;
        }
        let (file, _) = self.file.as_ref()?;
        let mut buf = [0u8; 96];
        let n = file.read_at(&mut buf, 0).ok()?;
        parse_run_delay(&buf[..n])
    }
}

/// The second field of a schedstat line: "<on-cpu ns> <run_delay ns> <slices>".
fn parse_run_delay(text: &[u8]) -> Option<u64> {
    std::str::from_utf8(text)
        .ok()?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    #[test]
    fn parses_schedstat_and_rejects_garbage() {
        assert_eq!(parse_run_delay(b"123 456 7\n"), Some(456));
        assert_eq!(parse_run_delay(b"123"), None);
        assert_eq!(parse_run_delay(b"a b c"), None);
        assert_eq!(parse_run_delay(&[0xff, 0xfe]), None);
    }

    #[test]
    fn opened_ahead_it_reads_without_opening_again_on_the_same_thread() {
        let mut probe = RunDelayProbe::new();
        probe.open().unwrap();
        let fd = |p: &RunDelayProbe| p.file.as_ref().map(|(f, _)| f.as_raw_fd());
        let opened = fd(&probe);
        assert!(probe.read_run_delay().is_some());
        assert_eq!(fd(&probe), opened, "the same file");
        std::thread::scope(|s| {
            s.spawn(|| {
                assert!(probe.read_run_delay().is_some());
                let owner = probe.file.as_ref().map(|(_, t)| *t);
                assert_eq!(owner, Some(std::thread::current().id()), "its own file");
            });
        });
    }

    #[test]
    fn reads_this_threads_run_delay() {
        let mut probe = RunDelayProbe::new();
        assert!(
            probe.read_run_delay().is_some(),
            "/proc/thread-self/schedstat is readable here"
        );
    }

    #[test]
    fn a_share_above_the_threshold_holds_contention() {
        let mut probe = RunDelayProbe {
            unavailable: true,
            ..RunDelayProbe::new()
        };
        let ms = Duration::from_millis(1);
        probe.observe(ms, 0);
        probe.observe(3 * ms, 40_000); // waited 2% of 2 ms: fine
        assert!(!probe.contended(3 * ms));
        probe.observe(5 * ms, 1_040_000); // waited 50% of 2 ms
        assert!(probe.contended(5 * ms));
        assert!(probe.contended(9 * ms), "holds for a while");
        assert!(!probe.contended(11 * ms));
    }
}
