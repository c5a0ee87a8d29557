//! Detecting a preempted vCPU from userspace: runnable, but not running.
//!
//! KVM knows from its scheduler notifiers. A userspace VMM has two looks:
//! - [`ThreadProbe`], at one moment: is the thread on a CPU, waiting for one,
//!   or asleep? For a VMM on KVM's in-kernel irqchip, whose vCPU threads stay
//!   inside `KVM_RUN` and halt there, this is all it can know at the moment a
//!   device thread raises an interrupt ([`crate::Scheduler::delivering`]).
//! - [`PreemptionProbe`], over an interval: was the thread kept off its CPU?
//!
//! For the second, a VMM can see, in
//! `/proc/self/task/<tid>/schedstat`, how long a thread has run and how long it
//! waited on a runqueue: a vCPU thread in the guest or the VMM that, since the
//! last look, waited for a CPU more than a quarter of the time and ran less than
//! half of it is runnable but kept off the CPU. (Waking from a sleep also adds
//! a little run delay, hence the quarter.)

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use crate::thread::{Tid, read_cpu_clock, thread_cpu_clock};

/// Samples one thread's scheduler statistics.
#[derive(Debug)]
pub struct PreemptionProbe {
    file: File,
    last: Option<(Instant, u64, u64)>,
}

/// Parses "<on-cpu ns> <run-delay ns> <timeslices>".
fn parse(text: &[u8]) -> Option<(u64, u64)> {
    let mut fields = std::str::from_utf8(text).ok()?.split_whitespace();
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

impl PreemptionProbe {
    /// A probe of thread `tid` of this process.
    pub fn new(tid: Tid) -> io::Result<Self> {
        Ok(Self {
            file: File::open(format!("/proc/self/task/{tid}/schedstat"))?,
            last: None,
        })
    }

    fn read(&self) -> io::Result<(u64, u64)> {
        let mut buf = [0u8; 96];
        let n = self.file.read_at(&mut buf, 0)?;
        parse(&buf[..n]).ok_or_else(|| {
            io::Error::new(io::ErrorKind::InvalidData, "unexpected schedstat format")
        })
    }

    /// Whether the thread was kept off the CPU since the last call (false on
    /// the first).
    pub fn preempted(&mut self) -> io::Result<bool> {
        let (ran, waited) = self.read()?;
        let now = Instant::now();
        let verdict = self.last.is_some_and(|(at, ran0, waited0)| {
            let wall = now.duration_since(at).as_nanos() as u64;
            kept_off_cpu(
                wall,
                ran.saturating_sub(ran0),
                waited.saturating_sub(waited0),
            )
        });
        self.last = Some((now, ran, waited));
        Ok(verdict)
    }
}

/// Over `wall` ns, a thread that ran `ran` ns and waited for a CPU `waited`
/// ns was kept off its CPU: it waited more than a quarter of the time and ran
/// less than half of it.
fn kept_off_cpu(wall: u64, ran: u64, waited: u64) -> bool {
    waited > wall / 4 && ran < wall / 2
}

/// Where a thread is at one moment, as the host scheduler has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ThreadSeen {
    /// On a CPU (for a vCPU: in the guest, in KVM, halt polling in KVM).
    Running,
    /// Runnable but waiting for a CPU: KVM's `preempted` (and `ready`), the
    /// one state in which a boost buys anything.
    Preempted,
    /// Asleep (for a vCPU inside `KVM_RUN`: halted, blocked in KVM until an
    /// interrupt wakes it), stopped, or exited.
    Blocked,
}

/// Tells, at one moment, whether a thread of this process runs, waits for a
/// CPU or sleeps, from outside it: its state letter in
/// `/proc/self/task/<tid>/stat` (`R`: running or runnable) and whether its
/// CPU clock (`CLOCK_THREAD_CPUTIME_ID` of that thread, which the kernel
/// brings up to date for a thread on a CPU) advances between two reads.
///
/// [`ThreadProbe::new`] opens the stat file; a VMM that installs a seccomp
/// filter opens its probes first. Each [`ThreadProbe::seen`] then makes
/// three system calls: `clock_gettime`, `pread64`, `clock_gettime`.
#[derive(Debug)]
pub struct ThreadProbe {
    stat: File,
    cpu_clock: libc::clockid_t,
}

impl ThreadProbe {
    /// A probe of thread `tid` of this process.
    ///
    /// # Errors
    /// The thread's stat file cannot be opened (no such thread, no `/proc`).
    pub fn new(tid: Tid) -> io::Result<Self> {
        Ok(Self {
            stat: File::open(format!("/proc/self/task/{tid}/stat"))?,
            cpu_clock: thread_cpu_clock(tid),
        })
    }

    /// Where the thread is now.
    ///
    /// # Errors
    /// The stat file or the CPU clock cannot be read (the thread exited).
    pub fn seen(&self) -> io::Result<ThreadSeen> {
        let before = self.cpu_time()?;
        let runnable = self.runnable()?;
        let after = self.cpu_time()?;
        Ok(match (after > before, runnable) {
            (true, _) => ThreadSeen::Running,
            (false, true) => ThreadSeen::Preempted,
            (false, false) => ThreadSeen::Blocked,
        })
    }

    /// The CPU time the thread has used.
    pub fn cpu_time(&self) -> io::Result<Duration> {
        read_cpu_clock(self.cpu_clock)
    }

    /// Whether the stat file says `R` (running or runnable).
    fn runnable(&self) -> io::Result<bool> {
        let mut buf = [0u8; 512];
        let n = self.stat.read_at(&mut buf, 0)?;
        state_letter(&buf[..n])
            .map(|state| state == b'R')
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unexpected stat format"))
    }
}

/// The state letter of a `/proc/<pid>/stat` line: the first field after the
/// command name, which is in parentheses and may itself hold spaces and
/// parentheses (hence the last `)`).
fn state_letter(stat: &[u8]) -> Option<u8> {
    let close = stat.iter().rposition(|&b| b == b')')?;
    match stat.get(close + 1..close + 3)? {
        [b' ', state] => Some(*state),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::thread::current_tid;

    /// The spinning test would keep the sleeping one off its CPU when it
    /// wakes: they take turns.
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
        ONE_AT_A_TIME
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    #[test]
    fn parses_schedstat() {
        assert_eq!(parse(b"10 20 3\n"), Some((10, 20)));
        assert_eq!(parse(b"10"), None);
        assert_eq!(parse(b"x y"), None);
    }

    #[test]
    fn waiting_a_quarter_of_the_time_while_running_less_than_half_is_preempted() {
        const MS: u64 = 1_000_000;
        assert!(
            !kept_off_cpu(100 * MS, 0, 2 * MS),
            "asleep, a short wake-up delay"
        );
        assert!(
            kept_off_cpu(100 * MS, 30 * MS, 70 * MS),
            "one of three spinners"
        );
        assert!(
            !kept_off_cpu(100 * MS, 60 * MS, 40 * MS),
            "ran more than half"
        );
        assert!(
            !kept_off_cpu(100 * MS, 10 * MS, 25 * MS),
            "waited only a quarter"
        );
    }

    #[test]
    fn a_thread_that_sleeps_is_not_preempted() {
        let _turn = one_at_a_time();
        let mut p = PreemptionProbe::new(current_tid()).unwrap();
        assert!(!p.preempted().unwrap(), "no verdict on the first look");
        // Long enough that the wait for a CPU after waking, a few ms on a
        // busy host, stays well under a quarter of it; three tries, for the
        // rare wake-up that waits 50 ms.
        let slept_unpreempted = (0..3).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(200));
            !p.preempted().unwrap()
        });
        assert!(slept_unpreempted, "sleeping is not waiting for a CPU");
    }

    #[test]
    fn a_thread_kept_off_its_cpu_is_preempted() {
        let _turn = one_at_a_time();
        // Pin three spinning threads to one CPU: the probed one (runnable,
        // spinning) runs about a third of the time and waits the rest.
        let cpu = crate::thread::available_cpus().unwrap()[0];
        let (tx, rx) = std::sync::mpsc::channel();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinner = |stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
                       tx: std::sync::mpsc::Sender<Tid>| {
            std::thread::spawn(move || {
                crate::thread::pin(0, &[cpu]).unwrap();
                tx.send(current_tid()).unwrap();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            })
        };
        let threads = [(); 3].map(|()| spinner(stop.clone(), tx.clone()));
        // Probed once all three are pinned and spinning.
        let tids: Vec<Tid> = rx.iter().take(3).collect();
        let mut p = PreemptionProbe::new(tids[0]).unwrap();
        p.preempted().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let verdict = p.preempted().unwrap();
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        for t in threads {
            t.join().unwrap();
        }
        assert!(
            verdict,
            "three spinners on one CPU: each waits about two thirds of the time"
        );
    }

    #[test]
    fn reads_the_state_letter_past_any_command_name() {
        assert_eq!(state_letter(b"42 (vcpu 0) R 1 2"), Some(b'R'));
        assert_eq!(state_letter(b"42 (a) b) (c) S 1 2"), Some(b'S'));
        assert_eq!(state_letter(b"42 (x)"), None);
        assert_eq!(state_letter(b"42 x R"), None);
    }

    #[test]
    fn a_thread_is_seen_running_asleep_and_waiting_for_its_cpu() {
        let _turn = one_at_a_time();
        let me = ThreadProbe::new(current_tid()).unwrap();
        assert_eq!(me.seen().unwrap(), ThreadSeen::Running, "the caller runs");
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let sleeper = std::thread::spawn(move || {
            tid_tx.send(current_tid()).unwrap();
            rx.recv().unwrap();
        });
        let asleep = ThreadProbe::new(tid_rx.recv().unwrap()).unwrap();
        // It may not have reached recv() yet: a few looks.
        let blocked = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            asleep.seen().unwrap() == ThreadSeen::Blocked
        });
        tx.send(()).unwrap();
        sleeper.join().unwrap();
        assert!(blocked, "a thread waiting on a channel sleeps");
        // `join` returns once the thread cleared its tid; the kernel may
        // still be tearing it down for a moment (longer under qemu-user).
        let gone = (0..1000).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            asleep.seen().is_err()
        });
        assert!(gone, "an exited thread has no state");

        // Three spinners pinned to one CPU: at any moment two of them wait.
        // Probed once all spin (before, a page fault can sleep on the
        // process's memory map lock while the test harness maps stacks).
        use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
        let cpu = crate::thread::available_cpus().unwrap()[0];
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let spinning = std::sync::Arc::new(AtomicUsize::new(0));
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let spinners: Vec<_> = (0..3)
            .map(|_| {
                let (stop, spinning, tid_tx) = (stop.clone(), spinning.clone(), tid_tx.clone());
                std::thread::spawn(move || {
                    crate::thread::pin(0, &[cpu]).unwrap();
                    tid_tx.send(current_tid()).unwrap();
                    spinning.fetch_add(1, Relaxed);
                    while !stop.load(Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        let probes: Vec<_> = tid_rx
            .iter()
            .take(3)
            .map(|tid| ThreadProbe::new(tid).unwrap())
            .collect();
        while spinning.load(Relaxed) < 3 {
            std::thread::yield_now();
        }
        let mut seen = std::collections::HashSet::new();
        for _ in 0..2000 {
            for p in &probes {
                seen.insert(p.seen().unwrap());
            }
            if seen.len() == 2 {
                break;
            }
        }
        stop.store(true, Relaxed);
        spinners.into_iter().for_each(|t| t.join().unwrap());
        assert!(
            seen.contains(&ThreadSeen::Preempted) && !seen.contains(&ThreadSeen::Blocked),
            "spinners sharing a CPU take turns: {seen:?}"
        );
    }
}
