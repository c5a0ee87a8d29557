//! The reference policies, each reproducing its source's rule and constants exactly.
//!
//! - [`KvmGrowShrink`]: KVM's host halt polling (`virt/kvm/kvm_main.c`,
//!   `kvm_vcpu_halt`, `grow_halt_poll_ns`, `shrink_halt_poll_ns`).
//! - [`GuestHaltpoll`]: the guest cpuidle-haltpoll governor
//!   (`drivers/cpuidle/governors/haltpoll.c`, `adjust_poll_limit`).
//! - [`AioPoll`]: QEMU's AioContext polling, one window per event source
//!   (`util/aio-posix.c`, `adjust_polling_time`).

use std::time::Duration;

use crate::policy::{HaltOutcome, PollPolicy};

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// KVM's grow/shrink halt polling.
///
/// After each halt of `halt_ns` (start to resume, polling included), with the
/// current window `poll` and the maximum `max`:
/// an invalid wake-up shrinks; otherwise, if `halt_ns <= poll` keep; if
/// `poll != 0 && halt_ns > max` shrink; if `poll < max && halt_ns < max` grow.
/// Grow: `poll * grow`, at least `grow_start`. Shrink: `poll / shrink` (0 if
/// `shrink` is 0), and 0 if that is below `grow_start`. The window is clamped to
/// `max` when a halt starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvmGrowShrink {
    poll_ns: u64,
    /// `halt_poll_ns`, or the per-VM `KVM_CAP_HALT_POLL` value.
    pub max_ns: u64,
    /// `halt_poll_ns_grow`.
    pub grow: u64,
    /// `halt_poll_ns_grow_start`.
    pub grow_start_ns: u64,
    /// `halt_poll_ns_shrink`.
    pub shrink: u64,
}

impl Default for KvmGrowShrink {
    fn default() -> Self {
        Self::new()
    }
}

impl KvmGrowShrink {
    /// The x86 defaults since Linux 6.11: max 200 µs, grow 2, grow_start 10 µs, shrink 2.
    pub const fn new() -> Self {
        Self {
            poll_ns: 0,
            max_ns: 200_000,
            grow: 2,
            grow_start_ns: 10_000,
            shrink: 2,
        }
    }

    /// The defaults before Linux 6.11: shrink 0, so any shrink resets the window to 0.
    pub const fn pre_6_11() -> Self {
        Self {
            shrink: 0,
            ..Self::new()
        }
    }

    /// The same rule with another maximum (as `KVM_CAP_HALT_POLL` sets per VM).
    pub const fn with_max(self, max: Duration) -> Self {
        Self {
            max_ns: max.as_nanos() as u64,
            ..self
        }
    }

    fn grow_window(&mut self) {
        if self.grow == 0 {
            return;
        }
        self.poll_ns = self
            .poll_ns
            .saturating_mul(self.grow)
            .max(self.grow_start_ns);
    }

    fn shrink_window(&mut self) {
        let val = self.poll_ns.checked_div(self.shrink).unwrap_or(0);
        self.poll_ns = if val < self.grow_start_ns { 0 } else { val };
    }
}

impl PollPolicy for KvmGrowShrink {
    fn window(&self) -> Duration {
        Duration::from_nanos(self.poll_ns.min(self.max_ns))
    }

    fn learn(&mut self, o: &HaltOutcome) {
        // kvm_vcpu_halt clamps the window to the maximum as the halt starts.
        self.poll_ns = self.poll_ns.min(self.max_ns);
        let halt_ns = ns(o.halt);
        if !o.valid {
            self.shrink_window();
        } else if self.max_ns == 0 {
            self.poll_ns = 0;
        } else if halt_ns <= self.poll_ns {
            // The sweet spot.
        } else if self.poll_ns != 0 && halt_ns > self.max_ns {
            self.shrink_window();
        } else if self.poll_ns < self.max_ns && halt_ns < self.max_ns {
            self.grow_window();
        }
    }
}

/// The guest cpuidle-haltpoll governor.
///
/// It learns only from halts that blocked, from `block_ns`, the time spent in
/// the halt state: if `limit < block_ns <= guest_halt_poll_ns` grow
/// (`limit * grow`, at least `grow_start`, at most `guest_halt_poll_ns`); if
/// `block_ns > guest_halt_poll_ns` and shrinking is allowed, shrink
/// (`limit / shrink`, 0 if `shrink` is 0 or the result is below `grow_start`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GuestHaltpoll {
    limit_ns: u64,
    /// `guest_halt_poll_ns`.
    pub max_ns: u64,
    /// `guest_halt_poll_grow`.
    pub grow: u64,
    /// `guest_halt_poll_shrink`.
    pub shrink: u64,
    /// `guest_halt_poll_grow_start`.
    pub grow_start_ns: u64,
    /// `guest_halt_poll_allow_shrink`.
    pub allow_shrink: bool,
}

impl Default for GuestHaltpoll {
    fn default() -> Self {
        Self::new()
    }
}

impl GuestHaltpoll {
    /// The defaults: 200 µs, grow 2, shrink 2, grow_start 50 µs, shrinking allowed.
    pub const fn new() -> Self {
        Self {
            limit_ns: 0,
            max_ns: 200_000,
            grow: 2,
            shrink: 2,
            grow_start_ns: 50_000,
            allow_shrink: true,
        }
    }
}

impl PollPolicy for GuestHaltpoll {
    fn window(&self) -> Duration {
        Duration::from_nanos(self.limit_ns)
    }

    fn learn(&mut self, o: &HaltOutcome) {
        // haltpoll_reflect adjusts only after the halt state, not after a poll
        // that caught the wake-up.
        if o.poll_succeeded() {
            return;
        }
        let block_ns = ns(o.blocked());
        if block_ns > self.limit_ns && block_ns <= self.max_ns {
            let val = self
                .limit_ns
                .saturating_mul(self.grow)
                .max(self.grow_start_ns);
            self.limit_ns = val.min(self.max_ns);
        } else if block_ns > self.max_ns && self.allow_shrink {
            let val = self.limit_ns.checked_div(self.shrink).unwrap_or(0);
            self.limit_ns = if val < self.grow_start_ns { 0 } else { val };
        }
    }
}

/// QEMU's AioContext polling, as kept per event source since 2025.
///
/// After each wait of `block_ns` (polling included): keep if `block_ns <= ns`;
/// if `block_ns > poll_max_ns` shrink (`ns / shrink`, or 0 if `shrink` is 0);
/// else if `ns < poll_max_ns && block_ns < poll_max_ns` grow (`ns * grow`,
/// `grow` 0 meaning 2, or 4 µs from 0), capped at `poll_max_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct AioPoll {
    ns: u64,
    /// `poll-max-ns`.
    pub max_ns: u64,
    /// `poll-grow` (0: double).
    pub grow: u64,
    /// `poll-shrink` (0: reset to 0).
    pub shrink: u64,
}

impl Default for AioPoll {
    fn default() -> Self {
        Self::new()
    }
}

impl AioPoll {
    /// QEMU's iothread defaults: poll-max-ns 32768, grow 0 (double), shrink 0 (reset).
    pub const fn new() -> Self {
        Self {
            ns: 0,
            max_ns: 32_768,
            grow: 0,
            shrink: 0,
        }
    }

    /// Where polling starts when it grows from zero.
    const START_NS: u64 = 4_000;
}

impl PollPolicy for AioPoll {
    fn window(&self) -> Duration {
        Duration::from_nanos(self.ns)
    }

    fn learn(&mut self, o: &HaltOutcome) {
        let block_ns = ns(o.halt);
        if block_ns <= self.ns {
            // The sweet spot.
        } else if block_ns > self.max_ns {
            self.ns = self.ns.checked_div(self.shrink).unwrap_or(0);
        } else if self.ns < self.max_ns && block_ns < self.max_ns {
            let grow = if self.grow == 0 { 2 } else { self.grow };
            let ns = if self.ns == 0 {
                Self::START_NS
            } else {
                self.ns.saturating_mul(grow)
            };
            self.ns = ns.min(self.max_ns);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1000;

    fn polled(halt_ns: u64) -> HaltOutcome {
        HaltOutcome::woken_while_polling(Duration::from_nanos(halt_ns))
    }

    fn blocked(polled_ns: u64, halt_ns: u64) -> HaltOutcome {
        HaltOutcome::woken_after_blocking(
            Duration::from_nanos(polled_ns),
            Duration::from_nanos(halt_ns),
        )
    }

    /// Windows (in ns) after each outcome.
    fn windows(policy: &mut impl PollPolicy, outcomes: &[HaltOutcome]) -> Vec<u64> {
        outcomes
            .iter()
            .map(|o| {
                policy.learn(o);
                policy.window().as_nanos() as u64
            })
            .collect()
    }

    #[test]
    fn kvm_grows_from_grow_start_and_doubles_up_to_max() {
        // Halts shorter than max but longer than the window: grow.
        let mut kvm = KvmGrowShrink::new();
        let w = windows(&mut kvm, &[blocked(0, 50 * US); 6]);
        // 0 -> 10 (grow_start) -> 20 -> 40 -> 80 -> 80 (50 <= 80: keep).
        assert_eq!(w, [10 * US, 20 * US, 40 * US, 80 * US, 80 * US, 80 * US]);
        // Short halts keep pushing to 160, then 320 is clamped to max at the next halt.
        let w = windows(
            &mut kvm,
            &[blocked(80 * US, 150 * US), blocked(160 * US, 199 * US)],
        );
        assert_eq!(w, [160 * US, 200 * US]);
        assert_eq!(
            kvm.poll_ns,
            320 * US,
            "the kernel stores the grown value and clamps at halt start"
        );
        // Longer than max shrinks; exactly max neither shrinks (not > max) nor grows (not < max).
        let w = windows(
            &mut kvm,
            &[blocked(200 * US, 200 * US + 1), blocked(100 * US, 200 * US)],
        );
        assert_eq!(w, [100 * US, 100 * US]);
    }

    #[test]
    fn kvm_shrinks_by_half_since_6_11_and_to_zero_before() {
        let mut kvm = KvmGrowShrink::new();
        windows(&mut kvm, &[blocked(0, 50 * US); 4]); // 80 µs
        let w = windows(&mut kvm, &[blocked(80 * US, 1_000 * US); 3]);
        // 80 -> 40 -> 20 -> 10, and 10/2 = 5 < grow_start would reset to 0.
        assert_eq!(w, [40 * US, 20 * US, 10 * US]);
        assert_eq!(windows(&mut kvm, &[blocked(10 * US, 1_000 * US)]), [0]);
        // At 0, a long halt does not shrink (poll == 0) and does not grow (halt > max).
        assert_eq!(windows(&mut kvm, &[blocked(0, 1_000 * US)]), [0]);

        let mut old = KvmGrowShrink::pre_6_11();
        windows(&mut old, &[blocked(0, 50 * US); 4]);
        assert_eq!(windows(&mut old, &[blocked(80 * US, 1_000 * US)]), [0]);
    }

    #[test]
    fn kvm_shrinks_on_invalid_wakeups_and_stops_with_max_zero() {
        let mut kvm = KvmGrowShrink::new();
        windows(&mut kvm, &[blocked(0, 30 * US); 3]); // 40 µs
        let invalid = HaltOutcome {
            valid: false,
            ..polled(US)
        };
        assert_eq!(windows(&mut kvm, &[invalid]), [20 * US]);
        let mut off = KvmGrowShrink::new().with_max(Duration::ZERO);
        assert_eq!(windows(&mut off, &[blocked(0, 5 * US)]), [0]);
    }

    #[test]
    fn kvm_keeps_a_window_that_a_halt_fills_exactly_and_grows_past_it() {
        // kvm_vcpu_halt keeps the window when `halt_ns <= halt_poll_ns`.
        let mut kvm = KvmGrowShrink::new();
        windows(&mut kvm, &[blocked(0, 30 * US); 3]); // 40 µs
        assert_eq!(windows(&mut kvm, &[polled(40 * US)]), [40 * US]);
        assert_eq!(windows(&mut kvm, &[blocked(40 * US, 40 * US)]), [40 * US]);
        // One nanosecond longer is a short halt the window missed: grow.
        assert_eq!(
            windows(&mut kvm, &[blocked(40 * US, 40 * US + 1)]),
            [80 * US]
        );
    }

    #[test]
    fn haltpoll_learns_only_from_blocked_halts_and_caps_at_max() {
        let mut g = GuestHaltpoll::new();
        assert_eq!(g.window(), Duration::ZERO, "starts at 0: halt");
        // block_ns = halt - polled.
        let w = windows(
            &mut g,
            &[
                blocked(0, 20 * US),
                blocked(50 * US, 130 * US),
                polled(5 * US),
            ],
        );
        // 0 -> 50 (grow_start) -> 100 (80 > 50) -> 100 (a successful poll changes nothing)
        assert_eq!(w, [50 * US, 100 * US, 100 * US]);
        let w = windows(
            &mut g,
            &[blocked(100 * US, 250 * US), blocked(200 * US, 400 * US)],
        );
        // 150 > 100 -> 200 (capped at max); then 200 is not > limit 200: keep.
        assert_eq!(w, [200 * US, 200 * US]);
        // A block longer than guest_halt_poll_ns shrinks: 200 -> 100 -> 50 -> 25 < 50 -> 0.
        let w = windows(&mut g, &[blocked(200 * US, 500 * US); 3]);
        assert_eq!(w, [100 * US, 50 * US, 0]);
        let mut no_shrink = GuestHaltpoll {
            allow_shrink: false,
            ..GuestHaltpoll::new()
        };
        windows(&mut no_shrink, &[blocked(0, 20 * US)]);
        assert_eq!(
            windows(&mut no_shrink, &[blocked(50 * US, 1_000 * US)]),
            [50 * US]
        );
    }

    #[test]
    fn haltpoll_keeps_a_limit_that_a_block_fills_exactly_and_grows_past_it() {
        // adjust_poll_limit grows only when `block_ns > poll_limit_ns`.
        let mut g = GuestHaltpoll::new();
        windows(&mut g, &[blocked(0, 20 * US)]); // 50 µs
        assert_eq!(windows(&mut g, &[blocked(50 * US, 100 * US)]), [50 * US]);
        assert_eq!(
            windows(&mut g, &[blocked(50 * US, 100 * US + 1)]),
            [100 * US]
        );
    }

    #[test]
    fn haltpoll_grows_on_a_block_of_exactly_guest_halt_poll_ns_and_shrinks_past_it() {
        // Grow while `block_ns <= guest_halt_poll_ns`, shrink once it is greater.
        let mut g = GuestHaltpoll::new();
        windows(&mut g, &[blocked(0, 20 * US)]); // 50 µs
        assert_eq!(windows(&mut g, &[blocked(50 * US, 250 * US)]), [100 * US]);
        assert_eq!(
            windows(&mut g, &[blocked(100 * US, 300 * US + 1)]),
            [50 * US]
        );
    }

    #[test]
    fn aio_starts_at_4us_doubles_to_max_and_resets() {
        let mut a = AioPoll::new();
        let w = windows(&mut a, &[blocked(0, 20 * US); 5]);
        // 0 -> 4 -> 8 -> 16 -> 32 -> 32 (20 <= 32: keep)
        assert_eq!(w, [4_000, 8_000, 16_000, 32_000, 32_000]);
        // 32000 < 32768 and 32500 < max: grow to 64000, capped at 32768.
        assert_eq!(windows(&mut a, &[blocked(32_000, 32_500)]), [32_768]);
        // Longer than poll-max-ns: reset to 0 (shrink 0).
        assert_eq!(windows(&mut a, &[blocked(32_768, 100 * US)]), [0]);
        let mut halves = AioPoll {
            shrink: 2,
            ..AioPoll::new()
        };
        windows(&mut halves, &[blocked(0, 20 * US); 4]);
        assert_eq!(windows(&mut halves, &[blocked(32_000, 100 * US)]), [16_000]);
    }

    #[test]
    fn aio_keeps_a_window_that_a_wait_fills_exactly_and_grows_past_it() {
        // adjust_polling_time's sweet spot is `block_ns <= poll->ns`.
        let mut a = AioPoll::new();
        windows(&mut a, &[blocked(0, 20 * US); 2]); // 8 µs
        assert_eq!(windows(&mut a, &[blocked(8_000, 8_000)]), [8_000]);
        assert_eq!(windows(&mut a, &[blocked(8_000, 8_001)]), [16_000]);
    }

    #[test]
    fn aio_neither_grows_nor_shrinks_on_a_wait_of_exactly_poll_max_ns() {
        // Shrink needs `block_ns > poll_max_ns`, grow `block_ns < poll_max_ns`.
        let mut a = AioPoll::new();
        windows(&mut a, &[blocked(0, 20 * US); 3]); // 16 µs
        assert_eq!(windows(&mut a, &[blocked(16_000, 32_768)]), [16_000]);
        // One nanosecond longer: reset to 0 (shrink 0).
        assert_eq!(windows(&mut a, &[blocked(16_000, 32_769)]), [0]);
    }
}
