//! The deadline backend: a timer thread whose host timer (a `timerfd` on
//! `CLOCK_MONOTONIC`, which has no timer slack) is armed `advance + lead` before
//! each deadline, and an expiry path that busy-waits to the exact target
//! (`deadline − lead`) before delivery starts.
//!
//! The busy-wait never lasts longer than the advance it was armed with, the
//! advance is never more than the spin budget holds
//! ([`DEFAULT_SPIN_SHARE`] of real time, so that
//! spinning takes at most that share of a CPU however short the period), and
//! it runs where the VMM chooses ([`SpinAt`]): on the timer thread, or on the
//! receiver (the vCPU thread, just before `KVM_RUN`, as the kernel does).
//! The advance policy learns where the spin starts: on the timer thread from
//! its own wake-up; on the receiver from when the receiver got there
//! ([`TimerThread::receive`]), which also counts the receiver's own wake-up,
//! as KVM's tuning measures at VM entry.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::thread::JoinHandleExt;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::advance::{AdvancePolicy, Wakeup};
use crate::clock::{Clock, MonotonicClock};
use crate::events::{Spin, TimerEvents};
use crate::spin_budget::{DEFAULT_SPIN_SHARE, SpinBudget};
use crate::time::ThreadCpuClock;

/// Where the expiry path busy-waits to the target.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum SpinAt {
    /// On the timer thread, before it calls the sink.
    TimerThread,
    /// On the receiver: the sink gets the expiry early, and the receiver
    /// calls [`TimerThread::receive`] where delivery starts.
    Receiver,
}

/// Where the timer thread runs.
///
/// KVM keeps a vCPU's LAPIC hrtimer on the CPU the vCPU runs on, and moves it
/// when the vCPU moves (`kvm_migrate_timers`): the expiry then finds the
/// vCPU's CPU awake and the vCPU close. A timer thread left to the scheduler
/// instead often sleeps on the other CPU, which an idle host (or the
/// hypervisor under it) may take long to wake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimerPlacement {
    /// Wherever the host's scheduler puts it.
    #[default]
    Anywhere,
    /// On the CPU of the thread that last armed it (in a VMM, the vCPU
    /// thread): each [`TimerThread::arm`] from another CPU than the last one
    /// moves the timer thread there (one `sched_getcpu`, and a
    /// `pthread_setaffinity_np` only when the CPU changed). A thread of
    /// higher priority that keeps that CPU (a `SCHED_FIFO` boost of the
    /// vCPU thread) delays the timer thread until it lets go.
    ArmingCpu,
}

/// A deadline whose time has come.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Expiry {
    /// What the deadline was armed with.
    pub payload: u64,
    /// The deadline, host ns.
    pub deadline_ns: u64,
    /// When delivery should start: the deadline less the lead, host ns.
    pub target_ns: u64,
    /// When the timer thread woke, host ns.
    pub woke_ns: u64,
    /// When the deadline was armed, host ns.
    pub armed_ns: u64,
    /// The longest busy-wait allowed: the advance the timer was armed with.
    pub max_spin: Duration,
}

impl Expiry {
    /// What this expiry teaches the advance policy if its host timer's
    /// wake-up is measured at `now_ns` ([`Wakeup::of_deadline`]).
    pub fn wakeup_at(&self, now_ns: u64) -> Option<Wakeup> {
        Wakeup::of_deadline(self.max_spin, self.armed_ns, self.target_ns, now_ns)
    }

    /// Busy-waits until the target, for at most `max_spin` by `clock`;
    /// returns the wall time spun and the CPU time it took by `cpu` (read
    /// only when there is anything to spin).
    fn spin(&self, clock: &impl Clock, cpu: &impl Clock) -> Spin {
        let start = clock.now_ns();
        let until = self
            .target_ns
            .min(start.saturating_add(self.max_spin.as_nanos() as u64));
        if start >= until {
            return Spin::default();
        }
        let cpu_start = cpu.now_ns();
        let mut now = start;
        while now < until {
            std::hint::spin_loop();
            now = clock.now_ns();
        }
        Spin::new(
            Duration::from_nanos(now - start),
            Duration::from_nanos(cpu.now_ns().saturating_sub(cpu_start)),
        )
    }
}

/// Where expired deadlines go ("timer fired → deliver vector").
pub trait TimerSink: Send + Sync {
    /// `expiry` is due (already spun to its target with [`SpinAt::TimerThread`]).
    fn expired(&self, expiry: Expiry);
}

/// A sink that drops every expiry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoSink;

impl TimerSink for NoSink {
    fn expired(&self, _: Expiry) {}
}

impl<S: TimerSink + ?Sized> TimerSink for Arc<S> {
    fn expired(&self, expiry: Expiry) {
        (**self).expired(expiry)
    }
}

/// A deadline as it was armed: with the lead and advance of that moment.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Armed {
    deadline_ns: u64,
    payload: u64,
    lead_ns: u64,
    advance_ns: u64,
    armed_ns: u64,
}

impl Armed {
    /// When the host timer fires for it: `advance + lead` before the deadline
    /// (never 0, which disarms a host timer).
    pub(crate) fn fire_at_ns(&self) -> u64 {
        self.deadline_ns
            .saturating_sub(self.lead_ns)
            .saturating_sub(self.advance_ns)
            .max(1)
    }

    /// The expiry of a host timer that woke at `woke_ns`.
    pub(crate) fn expiry(&self, woke_ns: u64) -> Expiry {
        Expiry {
            payload: self.payload,
            deadline_ns: self.deadline_ns,
            target_ns: self.deadline_ns.saturating_sub(self.lead_ns),
            woke_ns,
            armed_ns: self.armed_ns,
            max_spin: Duration::from_nanos(self.advance_ns),
        }
    }
}

/// What both backends share: the advance policy, the advance and lead in
/// use, and the events.
pub(crate) struct Tuning {
    /// The advance policy, taught by whoever spins (see [`SpinAt`]).
    policy: Mutex<Box<dyn AdvancePolicy + Send>>,
    /// The policy's current advance, published after each lesson.
    advance_ns: AtomicU64,
    lead_ns: AtomicU64,
    /// What the spins may still cost.
    budget: Mutex<SpinBudget>,
    /// Told of every wake-up, and of each spin and delivery wherever it runs.
    events: Box<dyn TimerEvents>,
}

impl Tuning {
    pub(crate) fn new<P, E>(policy: P, events: E) -> Self
    where
        P: AdvancePolicy + Send + 'static,
        E: TimerEvents + 'static,
    {
        Self {
            advance_ns: AtomicU64::new(policy.advance().as_nanos() as u64),
            policy: Mutex::new(Box::new(policy)),
            lead_ns: AtomicU64::new(0),
            budget: Mutex::new(SpinBudget::new(DEFAULT_SPIN_SHARE, MonotonicClock.now_ns())),
            events: Box::new(events),
        }
    }

    /// `deadline_ns` armed now, with the current lead, and the current
    /// advance if the spin budget holds it (what it holds otherwise).
    pub(crate) fn arm(&self, deadline_ns: u64, payload: u64) -> Armed {
        let armed_ns = MonotonicClock.now_ns();
        let wanted = self.advance_ns.load(Relaxed);
        Armed {
            deadline_ns,
            payload,
            lead_ns: self.lead_ns.load(Relaxed),
            advance_ns: self.budget().grant(wanted, armed_ns),
            armed_ns,
        }
    }

    fn budget(&self) -> std::sync::MutexGuard<'_, SpinBudget> {
        self.budget.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn set_spin_share(&self, share: f64) {
        self.budget().set_share(share);
    }

    /// Teaches the policy what `expiry` measured at `now_ns`, if anything,
    /// and publishes its new advance.
    pub(crate) fn learn(&self, expiry: &Expiry, now_ns: u64) {
        let Some(wakeup) = expiry.wakeup_at(now_ns) else {
            return;
        };
        let mut policy = self.policy.lock().unwrap_or_else(PoisonError::into_inner);
        policy.learn(&wakeup);
        self.advance_ns
            .store(policy.advance().as_nanos() as u64, Relaxed);
    }

    /// Reports the host timer's wake-up for `expiry`.
    pub(crate) fn woke(&self, expiry: &Expiry) {
        let delta_ns = i128::from(expiry.woke_ns) - i128::from(expiry.target_ns);
        self.events.woke(&wakeup(expiry.max_spin, delta_ns));
    }

    /// The receiver's side of an expiry (see [`TimerThread::receive`]).
    pub(crate) fn receive(&self, expiry: &Expiry) -> Spin {
        self.learn(expiry, MonotonicClock.now_ns());
        self.spin_to_target(expiry, &MonotonicClock)
    }

    /// Busy-waits to `expiry`'s target and reports the spin and the
    /// delivery's lateness; returns the spin.
    pub(crate) fn spin_to_target(&self, expiry: &Expiry, clock: &impl Clock) -> Spin {
        let spun = expiry.spin(clock, &ThreadCpuClock);
        self.budget().spend(spun.cpu);
        self.events.spun(spun);
        let lateness = i128::from(clock.now_ns()) - i128::from(expiry.target_ns);
        self.events
            .delivered(lateness.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64);
        spun
    }

    pub(crate) fn advance(&self) -> Duration {
        Duration::from_nanos(self.advance_ns.load(Relaxed))
    }

    pub(crate) fn lead_ns(&self) -> u64 {
        self.lead_ns.load(Relaxed)
    }

    pub(crate) fn set_lead(&self, lead: Duration) {
        self.lead_ns.store(lead.as_nanos() as u64, Relaxed);
    }
}

struct Shared {
    timerfd: OwnedFd,
    stop: EventFd,
    armed: Mutex<Option<Armed>>,
    tuning: Tuning,
}

impl Shared {
    /// Sets the timerfd to fire at `at_ns` (`CLOCK_MONOTONIC`), or disarms it (0).
    fn set_timer(&self, at_ns: u64) -> io::Result<()> {
        let spec = itimerspec_at(at_ns);
        // SAFETY: a valid timerfd and a valid itimerspec; the old value is not wanted.
        let ret = unsafe {
            libc::timerfd_settime(
                self.timerfd.as_raw_fd(),
                libc::TFD_TIMER_ABSTIME,
                &spec,
                std::ptr::null_mut(),
            )
        };
        if ret == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

/// A one-shot timer setting for `CLOCK_MONOTONIC` ns `at_ns` (0: disarmed).
pub(crate) fn itimerspec_at(at_ns: u64) -> libc::itimerspec {
    libc::itimerspec {
        it_interval: libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        },
        it_value: libc::timespec {
            tv_sec: (at_ns / 1_000_000_000).min(i64::MAX as u64) as _,
            tv_nsec: (at_ns % 1_000_000_000) as libc::c_long,
        },
    }
}

/// A wake-up `delta_ns` after the target (saturated to `i64`).
fn wakeup(advance: Duration, delta_ns: i128) -> Wakeup {
    Wakeup {
        advance,
        delta_ns: delta_ns.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64,
    }
}

/// One deadline at a time, on a timer thread of its own.
pub struct TimerThread {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    placement: TimerPlacement,
    /// The CPU the timer thread was last moved to (-1: none yet).
    cpu: AtomicI32,
}

/// Shows the advance and lead in use: the policy and sink are trait objects.
impl std::fmt::Debug for TimerThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimerThread")
            .field("advance", &self.advance())
            .field("lead_ns", &self.shared.tuning.lead_ns())
            .field("placement", &self.placement)
            .field("running", &self.thread.is_some())
            .finish_non_exhaustive()
    }
}

impl TimerThread {
    /// Starts the timer thread with an advance `policy`, delivering to `sink`.
    pub fn start<P, S, E>(policy: P, sink: S, events: E, spin_at: SpinAt) -> io::Result<Self>
    where
        P: AdvancePolicy + Send + 'static,
        S: TimerSink + 'static,
        E: TimerEvents + 'static,
    {
        // SAFETY: creates a new timerfd; the result is checked.
        let fd = unsafe {
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_CLOEXEC | libc::TFD_NONBLOCK,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let shared = Arc::new(Shared {
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            timerfd: unsafe { OwnedFd::from_raw_fd(fd) },
            stop: EventFd::new(EFD_NONBLOCK)?,
            armed: Mutex::new(None),
            tuning: Tuning::new(policy, events),
        });
        let worker = Worker {
            shared: shared.clone(),
            sink,
            spin_at,
            clock: MonotonicClock,
        };
        let thread = thread::Builder::new()
            .name("lapic-timer".into())
            .spawn(move || worker.run())?;
        Ok(Self {
            shared,
            thread: Some(thread),
            placement: TimerPlacement::Anywhere,
            cpu: AtomicI32::new(-1),
        })
    }

    /// Sets where the timer thread runs ([`TimerPlacement::Anywhere`] unless
    /// set).
    pub fn with_placement(mut self, placement: TimerPlacement) -> Self {
        self.placement = placement;
        self
    }

    /// Moves the timer thread to the calling thread's CPU, if the placement
    /// asks for it and it is not there already. A move that fails leaves the
    /// thread where it was, to be tried at the next arming.
    fn follow_caller(&self) {
        if self.placement != TimerPlacement::ArmingCpu {
            return;
        }
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = unsafe { libc::sched_getcpu() };
        if cpu < 0 || cpu as usize >= libc::CPU_SETSIZE as usize || cpu == self.cpu.load(Relaxed) {
            return;
        }
        let Some(thread) = &self.thread else { return };
        // SAFETY: an all-zero cpu_set_t is a valid empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` is below CPU_SETSIZE (checked above).
        unsafe { libc::CPU_SET(cpu as usize, &mut set) };
        // SAFETY: the thread is alive (joined only on drop) and the set is valid.
        let ret = unsafe {
            libc::pthread_setaffinity_np(
                thread.as_pthread_t(),
                std::mem::size_of::<libc::cpu_set_t>(),
                &set,
            )
        };
        if ret == 0 {
            self.cpu.store(cpu, Relaxed);
        }
    }

    /// Arms the deadline `deadline_ns` (host `CLOCK_MONOTONIC` ns), replacing any
    /// armed one; the sink will get `payload` back.
    pub fn arm(&self, deadline_ns: u64, payload: u64) -> io::Result<()> {
        self.follow_caller();
        let armed = self.shared.tuning.arm(deadline_ns, payload);
        *self
            .shared
            .armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(armed);
        self.shared.set_timer(armed.fire_at_ns())
    }

    /// Disarms the deadline, if any.
    pub fn disarm(&self) -> io::Result<()> {
        *self
            .shared
            .armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = None;
        self.shared.set_timer(0)
    }

    /// The advance the policy chose most recently.
    pub fn advance(&self) -> Duration {
        self.shared.tuning.advance()
    }

    /// The receiver's half of [`SpinAt::Receiver`], where delivery starts:
    /// teaches the advance policy how late the receiver got here after the
    /// target, then busy-waits to the target (at most `expiry.max_spin`),
    /// reporting the spin and the delivery to the events. Returns the spin
    /// (its wall time, and the CPU time it took).
    pub fn receive(&self, expiry: &Expiry) -> Spin {
        self.shared.tuning.receive(expiry)
    }

    /// Sets the delivery lead for deadlines armed from now on.
    pub fn set_lead(&self, lead: Duration) {
        self.shared.tuning.set_lead(lead);
    }

    /// Sets the share of real time the spins may take
    /// ([`DEFAULT_SPIN_SHARE`] unless set;
    /// clamped to 0..=1, 0 turns the advance off).
    pub fn set_spin_share(&self, share: f64) {
        self.shared.tuning.set_spin_share(share);
    }
}

impl Drop for TimerThread {
    fn drop(&mut self) {
        let _ = self.shared.stop.write(1);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Worker<S> {
    shared: Arc<Shared>,
    sink: S,
    spin_at: SpinAt,
    clock: MonotonicClock,
}

impl<S: TimerSink> Worker<S> {
    fn run(mut self) {
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: self.shared.timerfd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.shared.stop.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds on our stack; no timeout.
            let ret = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
            if ret < 0 || fds[1].revents != 0 {
                if ret < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return;
            }
            let mut expirations = [0u8; 8];
            // SAFETY: reads 8 bytes into our buffer from the non-blocking timerfd;
            // EAGAIN (a re-arm raced with the wake) just returns -1.
            unsafe {
                libc::read(
                    self.shared.timerfd.as_raw_fd(),
                    expirations.as_mut_ptr().cast(),
                    8,
                )
            };
            if let Some(armed) = self.take_due() {
                self.expire(armed);
            }
        }
    }

    /// The armed deadline, if this wake-up is for it (a re-arm may have moved it).
    fn take_due(&self) -> Option<Armed> {
        let now = self.clock.now_ns();
        let mut slot = self
            .shared
            .armed
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let armed = (*slot)?;
        if now < armed.fire_at_ns() {
            return None; // re-armed later; the timerfd will fire again
        }
        *slot = None;
        Some(armed)
    }

    fn expire(&mut self, armed: Armed) {
        let expiry = armed.expiry(self.clock.now_ns());
        let tuning = &self.shared.tuning;
        // The receiver teaches the policy itself, from where it spins.
        if self.spin_at == SpinAt::TimerThread {
            tuning.learn(&expiry, expiry.woke_ns);
        }
        tuning.woke(&expiry);
        if self.spin_at == SpinAt::TimerThread {
            tuning.spin_to_target(&expiry, &self.clock);
        }
        self.sink.expired(expiry);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;

    #[test]
    fn a_timer_closer_than_its_advance_teaches_the_distance_it_was_armed_at() {
        let us = Duration::from_micros;
        let e = Expiry {
            payload: 0,
            deadline_ns: 110_000,
            target_ns: 100_000,
            woke_ns: 0,
            armed_ns: 0,
            max_spin: us(50),
        };
        // Fired at 50 µs, woke at 60 µs: 10 µs late.
        assert_eq!(e.wakeup_at(60_000).unwrap().wake_lateness(), us(10));
        // Armed 20 µs before its target: fired at once, woke 5 µs later.
        let near = Expiry {
            armed_ns: 80_000,
            ..e
        };
        let w = near.wakeup_at(85_000).unwrap();
        assert_eq!((w.advance, w.wake_lateness()), (us(20), us(5)));
        // Armed at or after its target (a guest behind): nothing to learn.
        for armed_ns in [100_000, 200_000] {
            assert_eq!(Expiry { armed_ns, ..e }.wakeup_at(210_000), None);
        }
    }

    /// A clock that moves `step` at every reading, as a busy-wait sees time pass.
    struct Stepping(FakeClock, Duration);

    impl Clock for Stepping {
        fn now(&self) -> Duration {
            self.0.advance(self.1);
            self.0.now()
        }
    }

    #[test]
    fn spin_reaches_the_target_but_never_spins_longer_than_allowed() {
        let e = Expiry {
            payload: 0,
            deadline_ns: 1_000,
            target_ns: 1_000,
            woke_ns: 0,
            armed_ns: 0,
            max_spin: Duration::from_micros(5),
        };
        let us = Duration::from_micros;
        let wall = |e: &Expiry, clock: &Stepping| {
            e.spin(clock, &FakeClock::at(Duration::from_nanos(0))).wall
        };
        let still = FakeClock::at(Duration::from_nanos(1_000));
        assert_eq!(
            e.spin(&still, &still),
            Spin::default(),
            "already at the target"
        );
        let near = Expiry {
            target_ns: 4_000,
            ..e
        };
        assert_eq!(
            wall(
                &near,
                &Stepping(FakeClock::at(Duration::from_nanos(0)), us(1))
            ),
            us(3),
            "to the target"
        );
        let far = Expiry {
            target_ns: 10_000_000,
            ..e
        };
        assert_eq!(
            wall(
                &far,
                &Stepping(FakeClock::at(Duration::from_nanos(0)), us(1))
            ),
            us(5),
            "cut at max_spin"
        );
        // A host stall in the middle of a spin (the thread preempted for 1 ms):
        // the spin ends at the first reading past its bound, not later, and
        // its wall time counts the stall while its CPU time does not.
        let preempted = Stepping(
            FakeClock::at(Duration::from_nanos(0)),
            Duration::from_millis(1),
        );
        let cpu = Stepping(FakeClock::at(Duration::from_nanos(0)), us(2));
        assert_eq!(far.spin(&preempted, &cpu), Spin::new(us(1000), us(2)));
    }

    #[test]
    fn the_advance_is_what_the_spin_budget_holds() {
        let tuning = Tuning::new(crate::Fixed(Duration::from_micros(500)), crate::NoEvents);
        let now = MonotonicClock.now_ns();
        let advance = |a: Armed| a.deadline_ns - a.fire_at_ns();
        let far = tuning.arm(now + 100_000_000, 0);
        assert_eq!(
            advance(far),
            500_000,
            "a full budget: the policy's own advance"
        );
        // Two spins that used 500 µs each empty the bucket (1 ms).
        tuning.budget().spend(Duration::from_micros(1000));
        assert!(
            advance(tuning.arm(now + 100_000_000, 0)) < 100_000,
            "what refilled since"
        );
        tuning.set_spin_share(f64::NAN);
        assert_eq!(advance(tuning.arm(now + 100_000_000, 0)), 0, "NaN: none");
    }
}
