//! The signal backend on real POSIX timers and signals: the signal comes to
//! the thread that made the timer, interrupts it where it runs, never before
//! the host timer's time, and leaves nothing stale behind a re-arm.
//!
//! Each test uses a real-time signal of its own: handlers are per process,
//! masks per thread.

use std::os::raw::c_int;
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering::Relaxed};
use std::time::Duration;

use lapic_timer::{Clock, Fixed, MonotonicClock, NoEvents, Percentile, SignalTimer, TimerStats};

fn signal(offset: c_int) -> c_int {
    libc::SIGRTMIN() + offset
}

fn set_of(sig: c_int) -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        set
    }
}

/// Blocks (`how` = `SIG_BLOCK`) or unblocks `sig` on the calling thread.
fn mask(how: c_int, sig: c_int) {
    // SAFETY: a valid set; the old mask is not wanted.
    let ret = unsafe { libc::pthread_sigmask(how, &set_of(sig), std::ptr::null_mut()) };
    assert_eq!(ret, 0);
}

/// Waits up to `timeout` for `sig` (blocked) and returns its `si_code`.
fn wait_for(sig: c_int, timeout: Duration) -> Option<c_int> {
    let spec = libc::timespec {
        tv_sec: timeout.as_secs() as _,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: siginfo_t is plain data that sigtimedwait fills.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    // SAFETY: a valid set, siginfo and timeout.
    let got = unsafe { libc::sigtimedwait(&set_of(sig), &mut info, &spec) };
    (got == sig).then_some(info.si_code)
}

fn pending(sig: c_int) -> bool {
    // SAFETY: sigset_t is plain data that sigpending fills.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        assert_eq!(libc::sigpending(&mut set), 0);
        libc::sigismember(&set, sig) == 1
    }
}

fn tid() -> c_int {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) as c_int }
}

#[test]
fn the_signal_comes_to_the_thread_that_made_the_timer_never_before_its_time() {
    let sig = signal(1);
    mask(libc::SIG_BLOCK, sig);
    let stats = Arc::new(TimerStats::default());
    let advance = Duration::from_micros(100);
    let mut timer = SignalTimer::new(Fixed(advance), stats.clone(), sig).unwrap();
    for _ in 0..20 {
        let deadline = MonotonicClock.now_ns() + 2_000_000;
        timer.arm(deadline, 7).unwrap();
        let fire_at = timer.fire_at_ns().unwrap();
        assert_eq!(fire_at, deadline - advance.as_nanos() as u64);
        let expiry = match timer.take_due() {
            // Only a stall of this thread past the fire time makes it due
            // before the signal, which taking it then consumes.
            Some(early) => early,
            None => {
                assert_eq!(wait_for(sig, Duration::from_secs(10)), Some(libc::SI_TIMER));
                timer.take_due().expect("due once signalled")
            }
        };
        assert!(expiry.woke_ns >= fire_at, "due before its time");
        assert_eq!((expiry.payload, expiry.deadline_ns), (7, deadline));
        timer.receive(&expiry);
        assert!(
            MonotonicClock.now_ns() >= expiry.target_ns,
            "delivered early"
        );
        assert_eq!(
            (timer.take_due(), timer.fire_at_ns()),
            (None, None),
            "taken"
        );
    }
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed);
    assert_eq!((get(&stats.wakeups), get(&stats.early)), (20, 0));
}

/// The thread the last signal's handler ran on.
static HANDLED_ON: AtomicI32 = AtomicI32::new(0);

extern "C" fn note_thread(_: c_int) {
    HANDLED_ON.store(tid(), Relaxed);
}

#[test]
fn a_running_thread_is_interrupted_where_it_runs() {
    let sig = signal(2);
    // SAFETY: a handler that only stores to an atomic (async-signal-safe).
    let old = unsafe { libc::signal(sig, note_thread as *const () as libc::sighandler_t) };
    assert_ne!(old, libc::SIG_ERR);
    mask(libc::SIG_UNBLOCK, sig);
    let mut timer = SignalTimer::new(Fixed(Duration::ZERO), NoEvents, sig).unwrap();
    timer.arm(MonotonicClock.now_ns() + 1_000_000, 0).unwrap();
    // Busy, as a vCPU thread in the guest is: no system call to return from.
    let give_up = MonotonicClock.now_ns() + 10_000_000_000;
    while HANDLED_ON.load(Relaxed) == 0 && MonotonicClock.now_ns() < give_up {
        std::hint::spin_loop();
    }
    mask(libc::SIG_BLOCK, sig);
    assert_eq!(
        HANDLED_ON.load(Relaxed),
        tid(),
        "interrupted, on this thread"
    );
    assert!(timer.take_due().is_some());
}

#[test]
fn rearming_and_disarming_leave_no_stale_signal() {
    let sig = signal(3);
    mask(libc::SIG_BLOCK, sig);
    let mut timer = SignalTimer::new(Fixed(Duration::ZERO), NoEvents, sig).unwrap();
    let fired = |timer: &mut SignalTimer| {
        timer.arm(MonotonicClock.now_ns() + 100_000, 0).unwrap();
        std::thread::sleep(Duration::from_millis(5));
        assert!(pending(sig), "fired, not taken");
    };
    fired(&mut timer);
    timer
        .arm(MonotonicClock.now_ns() + 60_000_000_000, 0)
        .unwrap();
    assert!(!pending(sig), "a re-arm consumes the old deadline's signal");
    assert_eq!(timer.take_due(), None, "the new deadline is a minute away");
    fired(&mut timer);
    timer.disarm().unwrap();
    assert!(!pending(sig), "a disarm consumes it too");
    assert_eq!((timer.take_due(), timer.fire_at_ns()), (None, None));
}

/// A thread that took what was due, then re-armed a deadline whose time has
/// come (a guest's next timer already late), is about to enter a wait that
/// only the signal ends: the signal of that arming must stay pending, while
/// a taken expiry's own signal, however late it comes, never does.
#[test]
fn a_deadline_armed_already_due_stays_signalled() {
    let sig = signal(5);
    mask(libc::SIG_BLOCK, sig);
    let mut timer = SignalTimer::new(Fixed(Duration::ZERO), NoEvents, sig).unwrap();
    for round in 0..50 {
        timer.arm(MonotonicClock.now_ns() + 20_000, round).unwrap();
        while timer.take_due().is_none() {}
        assert!(!pending(sig), "round {round}: taken with its signal");
        timer.arm(MonotonicClock.now_ns() - 1_000, round).unwrap();
        timer.arm(MonotonicClock.now_ns() - 1_000, round).unwrap();
        assert_eq!(
            wait_for(sig, Duration::from_secs(5)),
            Some(libc::SI_TIMER),
            "round {round}: the re-arm kept the due deadline's signal"
        );
        assert!(timer.take_due().is_some(), "round {round}");
    }
}

#[test]
fn the_own_policy_learns_an_advance_from_the_receivers_lateness() {
    let sig = signal(4);
    mask(libc::SIG_BLOCK, sig);
    let stats = Arc::new(TimerStats::default());
    let mut timer = SignalTimer::new(Percentile::default(), stats.clone(), sig).unwrap();
    for _ in 0..200 {
        timer.arm(MonotonicClock.now_ns() + 500_000, 0).unwrap();
        assert!(wait_for(sig, Duration::from_secs(10)).is_some());
        let expiry = timer.take_due().expect("due once signalled");
        timer.receive(&expiry);
    }
    assert_eq!(stats.early.load(Relaxed), 0);
    assert!(timer.advance() > Duration::ZERO, "a real wake-up is late");
}
