//! Poll policies: how long to poll before blocking, learned from past halts.

use std::time::Duration;

/// The phase of a halt in which the wake-up was seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WokenDuring {
    /// During the hybrid sleep before polling (a timed block).
    Sleep,
    /// While polling, or already pending when the halt began: the thread never
    /// blocked.
    #[default]
    Poll,
    /// While blocked after the poll window.
    Block,
}

/// What happened during one halt: the input every policy learns from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct HaltOutcome {
    /// Time from the start of the halt until the thread resumed (KVM's `halt_ns`).
    pub halt: Duration,
    /// Time spent in the hybrid sleep before polling.
    pub slept: Duration,
    /// Time spent polling.
    pub polled: Duration,
    /// The phase the wake-up came in.
    pub woken: WokenDuring,
    /// Whether the wake-up was a real event (KVM's `vcpu_valid_wakeup`); a
    /// spurious one makes KVM shrink its window.
    pub valid: bool,
    /// Whether polling stopped early because another thread needed the CPU.
    pub preempted: bool,
}

impl HaltOutcome {
    /// A valid, unpreempted halt of `halt` in all that slept `slept`, then
    /// polled `polled`, and was woken during `woken`.
    pub fn new(halt: Duration, slept: Duration, polled: Duration, woken: WokenDuring) -> Self {
        Self {
            halt,
            slept,
            polled,
            woken,
            valid: true,
            preempted: false,
        }
    }

    /// The same halt, woken by something that was not an event (KVM's
    /// `!vcpu_valid_wakeup`).
    pub fn spurious(self) -> Self {
        Self {
            valid: false,
            ..self
        }
    }

    /// The same halt, whose polling stopped early for another thread.
    pub fn preempted(self) -> Self {
        Self {
            preempted: true,
            ..self
        }
    }

    /// A halt woken `after` its start while polling.
    pub fn woken_while_polling(after: Duration) -> Self {
        Self::new(after, Duration::ZERO, after, WokenDuring::Poll)
    }

    /// A halt that polled for `polled`, then blocked until it resumed `halt` after its start.
    pub fn woken_after_blocking(polled: Duration, halt: Duration) -> Self {
        Self::new(halt, Duration::ZERO, polled, WokenDuring::Block)
    }

    /// Whether the thread never blocked (KVM counts such a poll as successful).
    pub fn poll_succeeded(&self) -> bool {
        self.woken == WokenDuring::Poll
    }

    /// Time blocked after the poll window (the haltpoll governor's residency).
    pub fn blocked(&self) -> Duration {
        self.halt.saturating_sub(self.slept + self.polled)
    }
}

/// What to do at the start of a halt: optionally sleep, then poll, then block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PollPlan {
    /// Sleep this long first (hybrid polling); a wake-up ends the sleep early.
    pub sleep: Duration,
    /// Then poll this long.
    pub window: Duration,
}

impl PollPlan {
    /// Poll for `window` from the start of the halt.
    pub fn poll(window: Duration) -> Self {
        Self::sleep_then_poll(Duration::ZERO, window)
    }

    /// Sleep for `sleep` (hybrid polling), then poll for `window`.
    pub fn sleep_then_poll(sleep: Duration, window: Duration) -> Self {
        Self { sleep, window }
    }

    /// The plan covering both: the shorter sleep and polling until the later end.
    /// A plan that does not poll covers nothing: its sleep ends in a block, so
    /// it does not pull the other's poll start forward.
    pub fn union(self, other: PollPlan) -> PollPlan {
        if other.window.is_zero() {
            return self;
        }
        if self.window.is_zero() {
            return other;
        }
        let sleep = self.sleep.min(other.sleep);
        let end = (self.sleep + self.window).max(other.sleep + other.window);
        PollPlan {
            sleep,
            window: end.saturating_sub(sleep),
        }
    }
}

/// Decides how long a halted thread polls before it blocks.
///
/// The mechanism asks for a [`plan`](PollPolicy::plan) at the start of every
/// halt, carries it out, and reports the halt through [`learn`](PollPolicy::learn).
pub trait PollPolicy {
    /// How the next halt should wait. By default: poll for [`window`](PollPolicy::window).
    fn plan(&self) -> PollPlan {
        PollPlan::poll(self.window())
    }

    /// How long to poll at the start of the next halt; zero means block at once.
    fn window(&self) -> Duration;

    /// Learns from a finished halt.
    fn learn(&mut self, outcome: &HaltOutcome);
}

impl<P: PollPolicy + ?Sized> PollPolicy for Box<P> {
    fn plan(&self) -> PollPlan {
        (**self).plan()
    }

    fn window(&self) -> Duration {
        (**self).window()
    }

    fn learn(&mut self, outcome: &HaltOutcome) {
        (**self).learn(outcome)
    }
}

/// Never poll: block at once (KVM with `halt_poll_ns=0`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Never;

impl PollPolicy for Never {
    fn window(&self) -> Duration {
        Duration::ZERO
    }

    fn learn(&mut self, _: &HaltOutcome) {}
}

/// Always poll for the same window, whatever happened before.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fixed(pub Duration);

impl PollPolicy for Fixed {
    fn window(&self) -> Duration {
        self.0
    }

    fn learn(&mut self, _: &HaltOutcome) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn never_blocks_at_once_whatever_it_learns() {
        let mut p = Never;
        p.learn(&HaltOutcome::woken_while_polling(3 * US));
        assert_eq!(p.plan(), PollPlan::poll(Duration::ZERO));
    }

    #[test]
    fn fixed_keeps_its_window() {
        let mut p = Fixed(100 * US);
        for outcome in [
            HaltOutcome::woken_after_blocking(100 * US, 900 * US),
            HaltOutcome::woken_while_polling(US),
        ] {
            p.learn(&outcome);
            assert_eq!(p.window(), 100 * US);
        }
    }

    #[test]
    fn outcome_helpers() {
        let polled = HaltOutcome::woken_while_polling(7 * US);
        assert!(polled.poll_succeeded() && polled.valid);
        assert_eq!(polled.blocked(), Duration::ZERO);
        let blocked = HaltOutcome::woken_after_blocking(2 * US, 9 * US);
        assert!(!blocked.poll_succeeded());
        assert_eq!(blocked.blocked(), 7 * US);
    }

    #[test]
    fn union_of_plans_covers_both() {
        let a = PollPlan {
            sleep: 10 * US,
            window: 5 * US,
        };
        let b = PollPlan::poll(8 * US);
        assert_eq!(
            a.union(b),
            PollPlan {
                sleep: Duration::ZERO,
                window: 15 * US
            }
        );
        assert_eq!(b.union(b), b);
        // Blocking at once covers no wake-up: the other plan stands.
        assert_eq!(a.union(PollPlan::default()), a);
        assert_eq!(PollPlan::default().union(a), a);
        assert_eq!(
            PollPlan::default().union(PollPlan::default()),
            PollPlan::default()
        );
    }
}
