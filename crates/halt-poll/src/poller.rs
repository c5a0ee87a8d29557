//! `HaltPoller`: the mechanism that carries out a policy's plan for each halt.

use std::hint::spin_loop;
use std::io;
use std::time::Duration;

use crate::clock::{Clock, MonotonicClock};
use crate::contention::RunDelayProbe;
use crate::events::{HaltEvents, NoEvents};
use crate::policy::{HaltOutcome, PollPlan, PollPolicy, WokenDuring};
use crate::wake::{SourceSet, WakeSource};

/// Polls between two clock readings.
const SPINS_PER_CHECK: u32 = 16;

/// How often a poll offers its CPU to threads waiting for it (`sched_yield`),
/// the userspace counterpart of the kernel's `single_task_running()` check in
/// its poll loop: on a busy core the thread that would end the halt (another
/// vCPU, a timer thread) may be queued behind the poller, and a poll that kept
/// the CPU would delay the very wake-up it waits for.
pub const YIELD_EVERY: Duration = Duration::from_micros(5);

/// Default gap between two clock readings in the poll loop that means the
/// thread was preempted. The loop reads the clock every few hundred ns; on this
/// project's (nested, virtualized) machines an idle host still shows gaps of up
/// to a few hundred µs, while a preemption by another thread lasts a scheduler
/// slice (milliseconds).
pub const DEFAULT_PREEMPT_GAP: Duration = Duration::from_micros(500);

/// The result of one halt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Halt {
    /// The sources that fired (bit `i`: source `i`).
    pub fired: SourceSet,
    /// What happened, as the policies learned it.
    pub outcome: HaltOutcome,
}

/// Waits for a wake-up the way its policies plan: sleep (hybrid), poll with
/// `spin_loop` hints, then block.
///
/// Each event source has its own policy: a halt polls for the longest of their
/// plans, and only the sources that fired learn from it, so a slow source
/// cannot switch polling off for a fast one (QEMU's per-handler windows).
///
/// Polling is skipped while other threads wait for this thread's CPU (its
/// `run_delay` in `/proc/thread-self/schedstat` grows faster than a fifth of
/// the time, checked at most once per millisecond), and stops early when the thread was
/// preempted, seen as a gap between two clock readings in the poll loop: on a
/// busy host the thread that polls may starve the very thread that would wake
/// it. Either way the outcome says `preempted`, for the policies to learn from.
/// While it polls it also offers its CPU every [`YIELD_EVERY`], so a waker
/// queued on it runs at once.
pub struct HaltPoller<P, W, C = MonotonicClock, E = NoEvents> {
    policies: Vec<P>,
    source: W,
    clock: C,
    events: E,
    preempt_gap: Duration,
    contention: Option<RunDelayProbe>,
}

/// Shows what the poller would do next, so that it needs nothing of its
/// policies (a `Box<dyn PollPolicy>` has no `Debug`).
impl<P: PollPolicy, W, C, E> std::fmt::Debug for HaltPoller<P, W, C, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HaltPoller")
            .field("sources", &self.policies.len())
            .field("next_plan", &self.plan())
            .field("preempt_gap", &self.preempt_gap)
            .field("yields_to_waiting_threads", &self.contention.is_some())
            .finish_non_exhaustive()
    }
}

impl<P: PollPolicy, W, C, E> HaltPoller<P, W, C, E> {
    /// The plan for the next halt: the union of every source's plan.
    pub fn plan(&self) -> PollPlan {
        let mut plans = self.policies.iter().map(PollPolicy::plan);
        let first = plans.next().unwrap_or_default();
        plans.fold(first, PollPlan::union)
    }
}

impl<P: PollPolicy, W: WakeSource> HaltPoller<P, W> {
    /// A poller for one event source (source 0) with `policy`.
    pub fn new(source: W, policy: P) -> Self {
        Self::with_policies(source, vec![policy])
    }

    /// A poller with one policy per event source, source `i` using `policies[i]`
    /// (a policy past [`MAX_SOURCES`](crate::MAX_SOURCES) never learns; the
    /// events of sources without a policy wake the thread but teach nothing). Different policy
    /// types go in boxes: `Vec<Box<dyn PollPolicy + Send>>`.
    pub fn with_policies(source: W, policies: Vec<P>) -> Self {
        Self {
            policies,
            source,
            clock: MonotonicClock,
            events: NoEvents,
            preempt_gap: DEFAULT_PREEMPT_GAP,
            contention: Some(RunDelayProbe::new()),
        }
    }
}

impl<P: PollPolicy, W: WakeSource, C: Clock, E: HaltEvents> HaltPoller<P, W, C, E> {
    /// The same poller reading time from `clock`.
    ///
    /// The contention probe measures real time, so it is switched off: a poller
    /// on a fake clock is fully deterministic.
    pub fn with_clock<C2: Clock>(self, clock: C2) -> HaltPoller<P, W, C2, E> {
        let Self {
            policies,
            source,
            events,
            preempt_gap,
            ..
        } = self;
        HaltPoller {
            policies,
            source,
            clock,
            events,
            preempt_gap,
            contention: None,
        }
    }

    /// The same poller reporting every halt to `events`.
    pub fn with_events<E2: HaltEvents>(self, events: E2) -> HaltPoller<P, W, C, E2> {
        let Self {
            policies,
            source,
            clock,
            preempt_gap,
            contention,
            ..
        } = self;
        HaltPoller {
            policies,
            source,
            clock,
            events,
            preempt_gap,
            contention,
        }
    }

    /// The same poller with or without the check for threads waiting for this
    /// CPU and the yield to them while polling (on by default; off on a fake
    /// clock).
    pub fn yield_to_waiting_threads(mut self, check: bool) -> Self {
        self.contention = check.then(RunDelayProbe::new);
        self
    }

    /// Opens the calling thread's `/proc/thread-self/schedstat` for the check
    /// for threads waiting for its CPU, which the first halt would otherwise
    /// open: call it on the vCPU thread before a seccomp filter that denies
    /// `openat`. Where the file cannot be opened the check is off, and the
    /// error says why (the first halt switches it off silently). Nothing to
    /// do with the check off.
    pub fn open_contention_probe(&mut self) -> io::Result<()> {
        self.contention.as_mut().map_or(Ok(()), RunDelayProbe::open)
    }

    /// The same poller with another preemption gap ([`DEFAULT_PREEMPT_GAP`]).
    pub fn with_preempt_gap(mut self, gap: Duration) -> Self {
        self.preempt_gap = gap;
        self
    }

    /// The policy of source `i`.
    pub fn policy(&self, i: usize) -> Option<&P> {
        self.policies.get(i)
    }

    /// The wake source.
    pub fn source(&self) -> &W {
        &self.source
    }

    /// Halts until a source fires; returns which ones and what happened.
    ///
    /// Nothing else ends a halt, so to stop a vCPU thread (shutdown, pause),
    /// set the thread's stop flag, then wake any of its sources: the halt
    /// returns, and the thread sees the flag before it halts again.
    pub fn halt(&mut self) -> Halt {
        let plan = self.plan();
        let start = self.clock.now();
        let mut outcome = HaltOutcome {
            valid: true,
            ..HaltOutcome::default()
        };
        let mut events = self.source.take();
        // While other threads wait for this CPU, neither poll nor sleep-then-poll:
        // block, and let them run (a sleep that ends would only queue behind them).
        let contended = events == 0
            && plan.window > Duration::ZERO
            && self
                .contention
                .as_mut()
                .is_some_and(|c| c.contended(self.clock.now()));
        outcome.preempted = contended;
        if events == 0 && plan.sleep > Duration::ZERO && !contended {
            events = self.source.wait(Some(plan.sleep));
            outcome.slept = self.clock.now().saturating_sub(start);
            outcome.woken = WokenDuring::Sleep;
        }
        if events == 0 && plan.window > Duration::ZERO && !contended {
            let (fired, polled, preempted) = self.poll(plan.window);
            (events, outcome.polled, outcome.preempted) = (fired, polled, preempted);
            outcome.woken = WokenDuring::Poll;
        }
        if events == 0 {
            while events == 0 {
                events = self.source.wait(None);
            }
            outcome.woken = WokenDuring::Block;
        }
        outcome.halt = self.clock.now().saturating_sub(start);
        self.learn(&plan, &outcome, events);
        Halt {
            fired: events,
            outcome,
        }
    }

    /// Polls for up to `window`: returns the events, the time polled, and whether
    /// the thread was preempted.
    fn poll(&self, window: Duration) -> (SourceSet, Duration, bool) {
        let start = self.clock.now();
        let (mut last, mut last_yield) = (start, start);
        loop {
            if self.contention.is_some() && last.saturating_sub(last_yield) >= YIELD_EVERY {
                // SAFETY: sched_yield has no preconditions; it cannot fail on Linux.
                unsafe { libc::sched_yield() };
                last_yield = last;
            }
            for _ in 0..SPINS_PER_CHECK {
                let events = self.source.take();
                if events != 0 {
                    return (events, self.clock.now().saturating_sub(start), false);
                }
                spin_loop();
            }
            let now = self.clock.now();
            let polled = now.saturating_sub(start);
            if now.saturating_sub(last) > self.preempt_gap {
                return (0, polled, true);
            }
            if polled >= window {
                return (0, polled, false);
            }
            last = now;
        }
    }

    fn learn(&mut self, plan: &PollPlan, outcome: &HaltOutcome, events: SourceSet) {
        for (i, policy) in self.policies.iter_mut().enumerate() {
            if i < crate::MAX_SOURCES && events & (1 << i) != 0 {
                policy.learn(outcome);
            }
        }
        self.events.halted(plan, outcome);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use crate::policy::{Fixed, Never};
    use crate::wake::FutexWake;
    use crate::{HaltStats, KvmGrowShrink};
    use std::sync::Arc;
    use std::sync::atomic::Ordering::Relaxed;

    const US: Duration = Duration::from_micros(1);

    /// A wake source that fires source `fire` when the fake clock passes `at`.
    struct FiresAt<'c> {
        clock: &'c FakeClock,
        at: Duration,
        fire: u64,
        fired: std::cell::Cell<bool>,
    }

    impl WakeSource for FiresAt<'_> {
        fn take(&self) -> SourceSet {
            if !self.fired.get() && self.clock.now() >= self.at {
                self.fired.set(true);
                return self.fire;
            }
            0
        }

        fn wait(&self, timeout: Option<Duration>) -> SourceSet {
            let now = self.clock.now();
            match timeout {
                Some(t) if now + t < self.at => {
                    self.clock.advance(t);
                    0
                }
                _ => {
                    self.clock.advance(self.at.saturating_sub(now));
                    self.take()
                }
            }
        }
    }

    fn source(clock: &FakeClock, at: Duration, fire: u64) -> FiresAt<'_> {
        FiresAt {
            clock,
            at,
            fire,
            fired: std::cell::Cell::new(false),
        }
    }

    #[test]
    fn a_wake_inside_the_window_is_caught_while_polling() {
        let clock = FakeClock::default().with_step(Duration::from_nanos(50));
        let mut p = HaltPoller::new(source(&clock, 20 * US, 1), Fixed(100 * US)).with_clock(&clock);
        let halt = p.halt();
        assert_eq!(halt.fired, 1);
        assert_eq!(halt.outcome.woken, WokenDuring::Poll);
        assert!(
            halt.outcome.polled >= 19 * US && halt.outcome.polled < 25 * US,
            "{halt:?}"
        );
    }

    #[test]
    fn a_wake_after_the_window_is_caught_after_blocking() {
        let clock = FakeClock::default().with_step(Duration::from_nanos(50));
        let mut p =
            HaltPoller::new(source(&clock, 300 * US, 1), Fixed(100 * US)).with_clock(&clock);
        let halt = p.halt();
        assert_eq!((halt.fired, halt.outcome.woken), (1, WokenDuring::Block));
        assert!(halt.outcome.polled >= 100 * US && halt.outcome.polled < 102 * US);
        assert!(halt.outcome.halt >= 300 * US);
    }

    #[test]
    fn a_pending_wake_returns_at_once_and_a_zero_window_blocks() {
        let clock = FakeClock::default().with_step(Duration::from_nanos(1));
        let mut p = HaltPoller::new(source(&clock, Duration::ZERO, 1), Never).with_clock(&clock);
        let halt = p.halt();
        assert_eq!(
            (halt.fired, halt.outcome.polled, halt.outcome.woken),
            (1, Duration::ZERO, WokenDuring::Poll)
        );
    }

    #[test]
    fn a_clock_gap_while_polling_is_a_preemption() {
        let clock = FakeClock::default().with_step(600 * US); // every reading jumps 600 µs: preempted
        let mut p =
            HaltPoller::new(source(&clock, 100_000 * US, 1), Fixed(10_000 * US)).with_clock(&clock);
        let halt = p.halt();
        assert!(halt.outcome.preempted);
        assert_eq!(halt.outcome.woken, WokenDuring::Block);
    }

    #[test]
    fn a_hybrid_plan_sleeps_first() {
        struct Hybrid;
        impl PollPolicy for Hybrid {
            fn plan(&self) -> PollPlan {
                PollPlan {
                    sleep: 80 * US,
                    window: 40 * US,
                }
            }
            fn window(&self) -> Duration {
                40 * US
            }
            fn learn(&mut self, _: &HaltOutcome) {}
        }
        let clock = FakeClock::default().with_step(Duration::from_nanos(50));
        let mut p = HaltPoller::new(source(&clock, 100 * US, 1), Hybrid).with_clock(&clock);
        let o = p.halt().outcome;
        assert_eq!(o.woken, WokenDuring::Poll);
        assert!(o.slept >= 80 * US && o.slept < 81 * US, "{o:?}");
        assert!(o.polled >= 19 * US && o.polled < 22 * US, "{o:?}");
        let clock = FakeClock::default().with_step(Duration::from_nanos(50));
        let mut p = HaltPoller::new(source(&clock, 30 * US, 1), Hybrid).with_clock(&clock);
        assert_eq!(p.halt().outcome.woken, WokenDuring::Sleep);
    }

    #[test]
    fn only_the_sources_that_fired_learn() {
        let clock = FakeClock::default().with_step(Duration::from_nanos(50));
        // Source 1 fires at 50 µs; source 0 never does.
        let policies = vec![KvmGrowShrink::new(), KvmGrowShrink::new()];
        let mut p =
            HaltPoller::with_policies(source(&clock, 50 * US, 0b10), policies).with_clock(&clock);
        p.halt();
        assert_eq!(p.policy(0).unwrap().window(), Duration::ZERO);
        assert_eq!(p.policy(1).unwrap().window(), 10 * US, "grew to grow_start");
        assert_eq!(p.plan(), PollPlan::poll(10 * US), "the longest plan wins");
        let shown = format!("{p:?}");
        assert!(
            shown.contains("sources: 2") && shown.contains("window: 10µs"),
            "{shown}"
        );
    }

    #[test]
    fn stats_see_every_halt() {
        let stats = Arc::new(HaltStats::default());
        let wake = Arc::new(FutexWake::new());
        let mut p = HaltPoller::new(wake.clone(), Fixed(50 * US)).with_events(stats.clone());
        wake.wake(0);
        assert_eq!(p.halt().fired, 1);
        assert_eq!(stats.halt_attempted_poll.load(Relaxed), 1);
        assert_eq!(stats.halt_successful_poll.load(Relaxed), 1);
        assert!(p.source().take() == 0);
    }
}
