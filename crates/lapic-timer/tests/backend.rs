//! The timer thread on real host timers: deliveries never start before their
//! target, re-arming replaces, disarming cancels, a receiver can do the
//! spin itself, and the thread can follow the CPU of the one that arms it.

#[path = "support/affinity.rs"]
mod affinity;
use affinity::{allowed_cpus, pin_to};

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::mpsc;
use std::time::Duration;

use lapic_timer::{
    Clock, DEFAULT_SPIN_SHARE, Expiry, Fixed, MonotonicClock, NoAdvance, NoEvents, Percentile,
    PercentileConfig, SPIN_BURST, SpinAt, ThreadCpuClock, TimerPlacement, TimerSink, TimerStats,
    TimerThread,
};

/// Forwards each expiry with the time the sink saw it.
struct Forward(mpsc::Sender<(Expiry, u64)>);

impl TimerSink for Forward {
    fn expired(&self, e: Expiry) {
        let _ = self.0.send((e, MonotonicClock.now_ns()));
    }
}

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn deliveries_never_start_before_their_target() {
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(TimerStats::default());
    let timer = TimerThread::start(
        Fixed(Duration::from_micros(60)),
        Forward(tx),
        stats.clone(),
        SpinAt::TimerThread,
    )
    .unwrap();
    timer.set_lead(Duration::from_micros(5));
    // The deadlines are 150 µs apart: the default budget (15 µs of spin per
    // 150 µs) would cut the 60 µs advance whenever spins use it all.
    timer.set_spin_share(1.0);
    let start = MonotonicClock.now_ns() + 1_000_000;
    for k in 0..200u64 {
        timer.arm(start + k * 150_000, k).unwrap();
        let (e, seen) = rx.recv_timeout(WAIT).unwrap();
        assert_eq!(e.payload, k);
        assert_eq!(
            e.target_ns,
            e.deadline_ns - 5_000,
            "target = deadline - lead"
        );
        assert_eq!(
            e.max_spin,
            Duration::from_micros(60),
            "armed to fire the advance before the target"
        );
        assert!(
            seen >= e.target_ns,
            "delivery {k} started {} ns early",
            e.target_ns - seen
        );
    }
    assert_eq!(stats.early.load(Relaxed), 0);
    assert_eq!(stats.wakeups.load(Relaxed), 200);
    // Whether a wake-up came early enough to spin is the host's business: a
    // busy host wakes the timer thread later than the advance.
    eprintln!(
        "spun {} µs of CPU over 200 expiries",
        stats.spin_cpu_ns.load(Relaxed) / 1000
    );
}

/// The spin statistic is the CPU the spinning thread used, which stays
/// within the spin's bound, however long a hog on the same CPU makes the
/// spin in wall time.
#[test]
fn the_spin_statistic_is_the_cpu_the_receiver_used() {
    let cpu = allowed_cpus().unwrap()[0];
    let stop = Arc::new(AtomicBool::new(false));
    let hog = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            pin_to(cpu).unwrap();
            while !stop.load(Relaxed) {
                std::hint::spin_loop();
            }
        })
    };
    pin_to(cpu).unwrap();
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(TimerStats::default());
    let timer = TimerThread::start(
        Fixed(Duration::from_micros(500)),
        Forward(tx),
        stats.clone(),
        SpinAt::Receiver,
    )
    .unwrap();
    timer.set_spin_share(1.0); // spins long enough for the hog to preempt
    let (mut used_ns, mut stretched) = (0, 0);
    for _ in 0..300 {
        timer.arm(MonotonicClock.now_ns() + 1_000_000, 0).unwrap();
        let (e, _) = rx.recv_timeout(WAIT).unwrap();
        let before = ThreadCpuClock.now_ns();
        let spin = timer.receive(&e);
        let used = ThreadCpuClock.now_ns() - before;
        used_ns += used;
        assert!(
            spin.cpu.as_nanos() as u64 <= used,
            "{spin:?} of {used} ns used"
        );
        assert!(
            spin.cpu <= e.max_spin + Duration::from_micros(50),
            "{spin:?}"
        );
        stretched += u32::from(spin.wall > e.max_spin);
    }
    stop.store(true, Relaxed);
    hog.join().unwrap();
    assert!(stats.spin_cpu_ns.load(Relaxed) <= used_ns);
    eprintln!("{stretched} of 300 spins were preempted past their bound in wall time");
}

/// At KVM's shortest period, 200 µs, with the advance at the largest
/// `Percentile` allows (500 µs), so that every host timer fires as it is
/// armed: the spins take at most their share of the time, and the burst.
#[test]
fn at_a_200_us_period_an_advance_at_its_cap_spins_at_most_its_share() {
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(TimerStats::default());
    let cap = PercentileConfig::default().max_advance;
    let timer =
        TimerThread::start(Fixed(cap), Forward(tx), stats.clone(), SpinAt::Receiver).unwrap();
    let period = 200_000;
    let start = MonotonicClock.now_ns();
    for k in 1..=1000u64 {
        timer.arm(start + k * period, k).unwrap();
        let (e, _) = rx.recv_timeout(WAIT).unwrap();
        timer.receive(&e);
    }
    let elapsed = (MonotonicClock.now_ns() - start) as f64;
    let spin = stats.spin_cpu_ns.load(Relaxed) as f64;
    // Each spin may overrun its bound by one clock reading (2 µs allowed).
    let bound = DEFAULT_SPIN_SHARE * elapsed + SPIN_BURST.as_nanos() as f64 + 1000.0 * 2_000.0;
    assert!(
        spin <= bound,
        "spun {:.1} % of {:.0} ms",
        100.0 * spin / elapsed,
        elapsed / 1e6
    );
}

/// A stall injected on the receiver (6 ms before each of 40 receives)
/// teaches the advance a slow host; once the stalls stop, the advance
/// forgets them within `Percentile::RECENT_WAKEUPS` expiries: it is at most
/// 1.25 times the longest wake lateness of those (which on a busy host may
/// itself be milliseconds).
#[test]
fn the_advance_forgets_a_stall_within_its_window_on_real_timers() {
    let (tx, rx) = mpsc::channel();
    let mut config = PercentileConfig::default();
    config.max_advance = Duration::from_millis(100);
    let policy = Percentile::new(config);
    let timer = TimerThread::start(policy, Forward(tx), NoEvents, SpinAt::Receiver).unwrap();
    // Returns at least the wake lateness the policy learned.
    let expire = |stall: Duration| {
        timer.arm(MonotonicClock.now_ns() + 2_000_000, 0).unwrap();
        let (e, _) = rx.recv_timeout(WAIT).unwrap();
        std::thread::sleep(stall);
        timer.receive(&e);
        Duration::from_nanos(MonotonicClock.now_ns().saturating_sub(e.target_ns)) + e.max_spin
    };
    (0..64).for_each(|_| {
        expire(Duration::ZERO);
    });
    (0..40).for_each(|_| {
        expire(Duration::from_millis(6));
    });
    assert!(
        timer.advance() >= Duration::from_millis(4),
        "learned: {:?}",
        timer.advance()
    );
    let recent = (0..Percentile::RECENT_WAKEUPS)
        .map(|_| expire(Duration::ZERO))
        .max()
        .unwrap();
    assert!(
        timer.advance() <= recent.mul_f64(1.25),
        "forgot: {:?}, the longest recent lateness {recent:?}",
        timer.advance()
    );
}

#[test]
fn rearming_replaces_and_disarming_cancels() {
    let (tx, rx) = mpsc::channel();
    let timer = TimerThread::start(
        Fixed(Duration::ZERO),
        Forward(tx),
        NoEvents,
        SpinAt::TimerThread,
    )
    .unwrap();
    // Deadlines a minute away where a stall must not let them come first.
    let now = MonotonicClock.now_ns();
    timer.arm(now + 60_000_000_000, 1).unwrap();
    timer.arm(now + 2_000_000, 2).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap().0.payload, 2);
    timer
        .arm(MonotonicClock.now_ns() + 60_000_000_000, 3)
        .unwrap();
    timer.disarm().unwrap();
    assert!(
        rx.recv_timeout(Duration::from_millis(50)).is_err(),
        "a disarmed deadline never fires"
    );
    // A deadline in the past fires at once.
    timer.arm(1, 4).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap().0.payload, 4);
    let shown = format!("{timer:?}");
    assert!(
        shown.contains("advance: 0ns") && shown.contains("running: true"),
        "{shown}"
    );
}

#[test]
fn a_receiver_can_spin_to_the_target_itself() {
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(TimerStats::default());
    let timer = TimerThread::start(
        Fixed(Duration::from_micros(200)),
        Forward(tx),
        stats.clone(),
        SpinAt::Receiver,
    )
    .unwrap();
    for _ in 0..20 {
        timer.arm(MonotonicClock.now_ns() + 1_000_000, 0).unwrap();
        let (e, _) = rx.recv_timeout(WAIT).unwrap();
        // The timer thread woke at `target - max_spin` or later, so a spin
        // bounded by `max_spin` always reaches the target (how long it took
        // in wall time is the host's business: the bound itself is checked
        // with a fake clock in the unit tests).
        timer.receive(&e);
        assert!(
            MonotonicClock.now_ns() >= e.target_ns,
            "the receiver reached the target"
        );
    }
    // The receiver's spins and deliveries reach the events too.
    let delivered: u64 = stats.lateness_hist.iter().map(|b| b.load(Relaxed)).sum();
    assert_eq!((stats.early.load(Relaxed), delivered), (0, 20));
    assert_eq!(stats.wakeups.load(Relaxed), 20);
}

#[test]
fn a_receiver_teaches_the_advance_its_own_lateness() {
    // The receiver gets to the spin 300 µs after the timer thread hands the
    // expiry over (a vCPU thread waking from a halt, say): the advance must
    // cover that too, or every delivery starts late.
    let (tx, rx) = mpsc::channel();
    let timer = TimerThread::start(
        Percentile::default(),
        Forward(tx),
        NoEvents,
        SpinAt::Receiver,
    )
    .unwrap();
    for _ in 0..50 {
        timer.arm(MonotonicClock.now_ns() + 2_000_000, 0).unwrap();
        let (e, _) = rx.recv_timeout(WAIT).unwrap();
        std::thread::sleep(Duration::from_micros(300));
        timer.receive(&e);
    }
    assert!(
        timer.advance() >= Duration::from_micros(250),
        "the advance covers the receiver's 300 µs: {:?}",
        timer.advance()
    );
}

#[test]
fn deadlines_already_due_when_armed_teach_the_advance_nothing() {
    // A guest behind its timers arms deadlines that are already past; they
    // fire at once, and their "lateness" is the backlog, not the host timer's.
    for spin_at in [SpinAt::TimerThread, SpinAt::Receiver] {
        let (tx, rx) = mpsc::channel();
        let timer =
            TimerThread::start(Percentile::default(), Forward(tx), NoEvents, spin_at).unwrap();
        for _ in 0..50 {
            timer.arm(MonotonicClock.now_ns() - 5_000_000, 0).unwrap();
            let (e, _) = rx.recv_timeout(WAIT).unwrap();
            if spin_at == SpinAt::Receiver {
                timer.receive(&e);
            }
        }
        assert_eq!(timer.advance(), Duration::ZERO, "{spin_at:?}");
    }
}

#[test]
fn the_own_policy_learns_an_advance_on_real_timers() {
    let (tx, rx) = mpsc::channel();
    let timer = TimerThread::start(
        Percentile::default(),
        Forward(tx),
        NoEvents,
        SpinAt::TimerThread,
    )
    .unwrap();
    assert_eq!(timer.advance(), Duration::ZERO);
    for _ in 0..50 {
        timer.arm(MonotonicClock.now_ns() + 300_000, 0).unwrap();
        rx.recv_timeout(WAIT).unwrap();
    }
    // Host timers always wake somewhat late, so the learned advance is positive.
    assert!(timer.advance() > Duration::ZERO);
}

/// Says why `test` did not run, on stderr and in `SKIPPED_TESTS_LOG` if set.
fn skip(test: &str, reason: &str) {
    eprintln!("SKIPPED {test}: {reason}");
    if let Some(log) = std::env::var_os("SKIPPED_TESTS_LOG") {
        let line = format!("lapic-timer::{test}: {reason}\n");
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    }
}

/// A sink that reports the CPUs the timer thread may run on at each expiry.
struct ReportCpus(mpsc::Sender<Vec<usize>>);

impl TimerSink for ReportCpus {
    fn expired(&self, _: Expiry) {
        let _ = self.0.send(allowed_cpus().unwrap());
    }
}

/// Arms a timer 100 µs out and returns the CPUs its thread could run on
/// when it fired.
fn cpus_at_expiry(timer: &TimerThread, rx: &mpsc::Receiver<Vec<usize>>) -> Vec<usize> {
    timer.arm(MonotonicClock.now_ns() + 100_000, 0).unwrap();
    rx.recv_timeout(WAIT).unwrap()
}

#[test]
fn the_timer_thread_follows_the_cpu_of_the_thread_that_arms_it() {
    let cpus = std::thread::spawn(|| allowed_cpus().unwrap())
        .join()
        .unwrap();
    let &[first, second, ..] = cpus.as_slice() else {
        skip(
            "the_timer_thread_follows_the_cpu_of_the_thread_that_arms_it",
            &format!("this process may run on one CPU only ({cpus:?})"),
        );
        return;
    };
    // The arming happens on a thread of the test's own, pinned as it goes;
    // both timer threads start before it is (a new thread inherits the
    // CPUs of the one that started it).
    std::thread::spawn(move || {
        let (tx, rx) = mpsc::channel();
        let timer = TimerThread::start(NoAdvance, ReportCpus(tx), NoEvents, SpinAt::TimerThread)
            .unwrap()
            .with_placement(TimerPlacement::ArmingCpu);
        let (tx, anywhere_rx) = mpsc::channel();
        let anywhere =
            TimerThread::start(NoAdvance, ReportCpus(tx), NoEvents, SpinAt::TimerThread).unwrap();
        pin_to(first).unwrap();
        assert_eq!(cpus_at_expiry(&timer, &rx), [first]);
        assert_eq!(
            cpus_at_expiry(&timer, &rx),
            [first],
            "stays while the armer does"
        );
        pin_to(second).unwrap();
        assert_eq!(
            cpus_at_expiry(&timer, &rx),
            [second],
            "moves with the armer"
        );
        assert_eq!(
            cpus_at_expiry(&anywhere, &anywhere_rx),
            cpus,
            "the default leaves it alone"
        );
    })
    .join()
    .unwrap();
}
