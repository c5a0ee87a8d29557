//! Concurrent wakers hammer one halted thread; every wake-up must end a halt,
//! and a waker sharing the poller's CPU is not held back by its poll.
//! A lost wake-up leaves both sides waiting forever, which the watchdog turns
//! into a failure.

#[path = "support/affinity.rs"]
mod affinity;
use affinity::{allowed_cpus, pin_to};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

use halt_poll::{
    EventFdWake, FutexWake, HaltPoller, KvmGrowShrink, Never, PollPolicy, Predictive, WakeSource,
};

const WAKERS: usize = 4;
const WAKES: u64 = 5_000;

/// Runs `f` on a thread; fails if it does not finish in time.
fn watchdog(name: &str, f: impl FnOnce() + Send + 'static) {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        f();
        tx.send(()).unwrap();
    });
    rx.recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("{name}: a wake-up was lost"));
}

/// Each waker wakes its own source, then waits for the halted thread to
/// acknowledge it before waking again, so no two wake-ups of a source merge.
fn hammer<W, P>(source: Arc<W>, wake: impl Fn(&W, usize) + Send + Sync + 'static, policy: fn() -> P)
where
    W: WakeSource + Send + Sync + 'static,
    P: PollPolicy,
{
    let acked: Arc<Vec<AtomicU64>> = Arc::new((0..WAKERS).map(|_| AtomicU64::new(0)).collect());
    let wake = Arc::new(wake);
    let wakers: Vec<_> = (0..WAKERS)
        .map(|i| {
            let (source, acked, wake) = (source.clone(), acked.clone(), wake.clone());
            thread::spawn(move || {
                for n in 1..=WAKES {
                    wake(&source, i);
                    while acked[i].load(SeqCst) < n {
                        std::hint::spin_loop();
                        thread::yield_now();
                    }
                }
            })
        })
        .collect();
    let policies = (0..WAKERS).map(|_| policy()).collect();
    let mut poller = HaltPoller::with_policies(source, policies);
    while acked.iter().any(|a| a.load(SeqCst) < WAKES) {
        let events = poller.halt().fired;
        for (i, a) in acked.iter().enumerate() {
            if events & (1 << i) != 0 {
                a.fetch_add(1, SeqCst);
            }
        }
    }
    wakers.into_iter().for_each(|w| w.join().unwrap());
    assert!(acked.iter().all(|a| a.load(SeqCst) == WAKES));
}

#[test]
fn futex_wakes_are_never_lost_blocking() {
    watchdog("futex, block", || {
        hammer(Arc::new(FutexWake::new()), |w, i| w.wake(i), || Never)
    });
}

#[test]
fn futex_wakes_are_never_lost_polling() {
    watchdog("futex, kvm", || {
        hammer(
            Arc::new(FutexWake::new()),
            |w, i| w.wake(i),
            KvmGrowShrink::new,
        )
    });
    watchdog("futex, own", || {
        hammer(
            Arc::new(FutexWake::new()),
            |w, i| w.wake(i),
            Predictive::default,
        )
    });
}

#[test]
fn eventfd_wakes_are_never_lost() {
    let source = Arc::new(EventFdWake::new(WAKERS).unwrap());
    let fds: Vec<_> = (0..WAKERS).map(|i| source.waker(i).unwrap()).collect();
    watchdog("eventfd", move || {
        hammer(
            source,
            move |_, i| fds[i].write(1).unwrap(),
            KvmGrowShrink::new,
        )
    });
}

/// Sleeps 1.8 ms, then polls for up to 500 ms.
struct SleepThenPoll;

impl PollPolicy for SleepThenPoll {
    fn plan(&self) -> halt_poll::PollPlan {
        halt_poll::PollPlan::sleep_then_poll(
            Duration::from_micros(1800),
            Duration::from_millis(500),
        )
    }
    fn window(&self) -> Duration {
        self.plan().window
    }
    fn learn(&mut self, _: &halt_poll::HaltOutcome) {}
}

#[test]
fn a_poll_lets_a_waker_queued_on_its_cpu_run() {
    // The waker and the poller share one CPU. The waker sleeps 2 ms, then
    // wakes the poller, which has slept 1.8 ms and polls with a 500 ms window
    // (a hybrid plan). The median halt must end with the waker's sleep, not
    // with the window: the poll must not hold the CPU its waker is queued on.
    // The waker waits for each wake-up to be taken, so none merge.
    const ROUNDS: usize = 20;
    let cpu = allowed_cpus().unwrap()[0];
    let wake = Arc::new(FutexWake::new());
    let taken = Arc::new(AtomicU64::new(0));
    let waker = {
        let (wake, taken) = (wake.clone(), taken.clone());
        thread::spawn(move || {
            pin_to(cpu).unwrap();
            for n in 1..=ROUNDS as u64 {
                thread::sleep(Duration::from_millis(2));
                wake.wake(0);
                while taken.load(SeqCst) < n {
                    thread::yield_now();
                }
            }
        })
    };
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        pin_to(cpu).unwrap();
        let mut poller = HaltPoller::new(wake, SleepThenPoll);
        let halts: Vec<Duration> = (0..ROUNDS)
            .map(|_| {
                let halt = poller.halt().outcome.halt;
                taken.fetch_add(1, SeqCst);
                halt
            })
            .collect();
        tx.send(halts).unwrap();
    });
    let mut halts = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("every wake-up ends a halt");
    waker.join().unwrap();
    halts.sort();
    // 100 ms: far below the window, with room for a host busy beside it.
    assert!(halts[ROUNDS / 2] < Duration::from_millis(100), "{halts:?}");
}
