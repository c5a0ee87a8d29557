//! Poll policies: how long to poll before blocking, learned from past halts.

use std::time::Duration;

/// What happened during one halt: the input every policy learns from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HaltOutcome {
    /// Time from the start of the halt to the wake-up.
    pub halt: Duration,
    /// Time spent polling (the rest, if any, was spent blocked).
    pub polled: Duration,
    /// Whether the wake-up came while polling, so the thread never blocked.
    pub woken_while_polling: bool,
}

impl HaltOutcome {
    /// A halt woken `after` its start while still polling.
    pub fn woken_while_polling(after: Duration) -> Self {
        Self {
            halt: after,
            polled: after,
            woken_while_polling: true,
        }
    }

    /// A halt that polled for `polled`, then blocked until woken `halt` after its start.
    pub fn woken_after_blocking(polled: Duration, halt: Duration) -> Self {
        Self {
            halt,
            polled,
            woken_while_polling: false,
        }
    }
}

/// Decides how long a halted thread polls before it blocks.
///
/// The mechanism asks for [`window`](PollPolicy::window) at the start of every
/// halt, polls for at most that long, blocks if nothing woke it, and reports the
/// halt through [`learn`](PollPolicy::learn).
pub trait PollPolicy {
    /// How long to poll at the start of the next halt; zero means block at once.
    fn window(&self) -> Duration;

    /// Learns from a finished halt.
    fn learn(&mut self, outcome: &HaltOutcome);
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
        assert_eq!(p.window(), Duration::ZERO);
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
    fn outcome_constructors_fill_every_field() {
        let polled = HaltOutcome::woken_while_polling(7 * US);
        assert_eq!(
            (polled.halt, polled.polled, polled.woken_while_polling),
            (7 * US, 7 * US, true)
        );
        let blocked = HaltOutcome::woken_after_blocking(2 * US, 9 * US);
        assert_eq!(
            (blocked.halt, blocked.polled, blocked.woken_while_polling),
            (9 * US, 2 * US, false)
        );
    }
}
