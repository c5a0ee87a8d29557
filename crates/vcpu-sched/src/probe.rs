//! Detecting a preempted vCPU from userspace: runnable, but not running.
//!
//! KVM knows from its scheduler notifiers. A VMM can see, in
//! `/proc/self/task/<tid>/schedstat`, how long a thread has run and how long it
//! waited on a runqueue: a vCPU thread in the guest or the VMM that, since the
//! last look, waited for a CPU more than a quarter of the time and ran less than
//! half of it is runnable but kept off the CPU. (Waking from a sleep also adds
//! a little run delay, hence the quarter.)

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::time::Instant;

use crate::thread::Tid;

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
}
