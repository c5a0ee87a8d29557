//! The timer thread on real host timers: deliveries never start before their
//! target, re-arming replaces, disarming cancels, and a receiver can do the
//! spin itself.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::time::Duration;

use lapic_timer::{
    Clock, Expiry, Fixed, MonotonicClock, NoEvents, Percentile, SpinAt, TimerSink, TimerStats,
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
        "spun {} µs over 200 expiries",
        stats.spin_ns.load(Relaxed) / 1000
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
    let now = MonotonicClock.now_ns();
    timer.arm(now + 50_000_000, 1).unwrap();
    timer.arm(now + 2_000_000, 2).unwrap();
    assert_eq!(rx.recv_timeout(WAIT).unwrap().0.payload, 2);
    timer.arm(MonotonicClock.now_ns() + 5_000_000, 3).unwrap();
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
