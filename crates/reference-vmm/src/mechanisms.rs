//! The latency mechanisms on the vCPU exit path, each with its baseline, as
//! the command line chooses them: `--halt-poll`, `--timer-advance` and
//! `--timer-placement`, `--boost` and `--bus`; and `--irqchip`, which can
//! hand the whole local APIC to KVM to measure the family against the
//! kernel's own mechanisms.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use clap::ValueEnum;

use halt_poll::{
    AioPoll, Fixed as FixedPoll, GuestHaltpoll, KvmGrowShrink, Never, PollPolicy, Predictive,
    PredictiveConfig,
};
use lapic_timer::{AdvancePolicy, Fixed, KvmAdaptive, NoAdvance, Percentile, PercentileConfig};
use vcpu_sched::{BoostPolicy, DirectedYield, KvmReady, NoBoost};

/// A choice given on the command line that names nothing.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what} {given:?} is not one of: {choices}")]
pub struct ChoiceError {
    /// The option.
    pub what: &'static str,
    /// What was given.
    pub given: String,
    /// What it takes.
    pub choices: String,
}

/// The error for `given`.
fn choice<T>(what: &'static str, choices: &str, given: &str) -> Result<T, ChoiceError> {
    Err(ChoiceError {
        what,
        given: given.to_owned(),
        choices: choices.to_owned(),
    })
}

/// The command-line names of a switch's values, comma-separated.
fn names<T: ValueEnum>() -> String {
    let names: Vec<String> = T::value_variants()
        .iter()
        .filter_map(|v| Some(v.to_possible_value()?.get_name().to_owned()))
        .collect();
    names.join(", ")
}

/// `FromStr` and `Display` by a switch's `ValueEnum` names, with its option
/// in errors.
macro_rules! switch {
    ($t:ty, $what:literal) => {
        impl FromStr for $t {
            type Err = ChoiceError;
            fn from_str(s: &str) -> Result<Self, ChoiceError> {
                <$t as ValueEnum>::from_str(s, false).or_else(|_| choice($what, &names::<$t>(), s))
            }
        }

        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.to_possible_value() {
                    Some(v) => f.write_str(v.get_name()),
                    None => Ok(()),
                }
            }
        }
    };
}

switch!(HaltPoll, "--halt-poll");
switch!(Boost, "--boost");
switch!(BusAccess, "--bus");
switch!(Irqchip, "--irqchip");
switch!(TimerPlacement, "--timer-placement");

/// How a halted vCPU waits (`halt-poll`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum HaltPoll {
    /// KVM's grow/shrink window (`KvmGrowShrink`).
    Kvm,
    /// The guest cpuidle-haltpoll governor's rule (`GuestHaltpoll`).
    Haltpoll,
    /// QEMU's AioContext rule (`AioPoll`).
    Aio,
    /// halt-poll's `Predictive`: learns the distribution of wake times.
    #[default]
    Predictive,
    /// Block at once (`Never`): the baseline.
    Off,
    /// Poll for up to 10 ms before blocking (`Fixed`): the other baseline.
    Always,
    /// KVM's halt polling under the window halt-poll's `WindowTuner` sets
    /// from the vCPUs' binary statistics every 10 ms: `--irqchip kernel` only.
    Tuned,
}

impl HaltPoll {
    /// The policy on this VMM's APIC. (`tuned` is KVM's alone: [`Vm::new`]
    /// refuses it here; its window follows `Predictive`'s cost model.)
    ///
    /// [`Vm::new`]: crate::Vm::new
    pub fn policy(self) -> Box<dyn PollPolicy + Send> {
        match self {
            Self::Kvm => Box::new(KvmGrowShrink::new()),
            Self::Haltpoll => Box::new(GuestHaltpoll::new()),
            Self::Aio => Box::new(AioPoll::new()),
            Self::Predictive | Self::Tuned => Box::new(Predictive::default()),
            Self::Off => Box::new(Never),
            Self::Always => Box::new(FixedPoll(ALWAYS_POLL)),
        }
    }

    /// The policy for halts that end at the vCPU's own timer: the same,
    /// except that `Predictive` never sleeps to poll just before the deadline
    /// (hybrid polling). A deadline is known; meeting it early is a timer
    /// advance's job, at a spin it bounds, while polling for it took about
    /// 5 % of a CPU at 1 kHz for a block's wake-up latency (`bench halt`'s
    /// idle timer), the trade KVM's shrink rule refuses.
    pub fn timer_policy(self) -> Box<dyn PollPolicy + Send> {
        match self {
            Self::Predictive | Self::Tuned => Box::new(Predictive::new(PredictiveConfig {
                hybrid: false,
                ..PredictiveConfig::default()
            })),
            other => other.policy(),
        }
    }

    /// KVM's halt-polling window (`KVM_CAP_HALT_POLL`) for this choice, where
    /// the kernel handles halts (`--irqchip kernel`): `off` stops polling,
    /// `always` polls up to the same 10 ms, and the policies KVM does not have
    /// leave its own grow/shrink under the module's `halt_poll_ns` (None), as
    /// `tuned` does until its tuner has seen enough halts.
    pub fn kvm_window(self) -> Option<Duration> {
        match self {
            Self::Off => Some(Duration::ZERO),
            Self::Always => Some(ALWAYS_POLL),
            Self::Kvm | Self::Haltpoll | Self::Aio | Self::Predictive | Self::Tuned => None,
        }
    }

    /// Whether KVM's in-kernel halt polling does this choice (`kvm`, `off`,
    /// `always`, `tuned`); the others are policies of this VMM's APIC.
    pub fn in_kernel(self) -> bool {
        matches!(self, Self::Kvm | Self::Off | Self::Always | Self::Tuned)
    }
}

/// How long `always` polls before it blocks.
const ALWAYS_POLL: Duration = Duration::from_millis(10);

/// How early the host timer of a guest timer fires (`lapic-timer`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TimerAdvance {
    /// Armed for the deadline itself: the baseline.
    None,
    /// A fixed advance.
    Fixed(Duration),
    /// KVM's adaptive `lapic_timer_advance`.
    Kvm,
    /// lapic-timer's `Percentile`: a high quantile of recent lateness (its
    /// default, p91).
    #[default]
    Percentile,
    /// `Percentile` aimed at another quantile, in percent (50 to 99): a
    /// higher one covers more of the host's late wake-ups, for more spin.
    PercentileAt(u8),
}

impl TimerAdvance {
    /// The policy, for a TSC of `tsc_khz`.
    pub fn policy(self, tsc_khz: u64) -> Box<dyn AdvancePolicy + Send> {
        match self {
            Self::None => Box::new(NoAdvance),
            Self::Fixed(d) => Box::new(Fixed(d)),
            Self::Kvm => Box::new(KvmAdaptive::new(tsc_khz)),
            Self::Percentile => Box::new(Percentile::default()),
            Self::PercentileAt(q) => Box::new(Percentile::new(PercentileConfig {
                // It aims at the 1 / (1 + spin_weight) quantile.
                spin_weight: 100.0 / f64::from(q) - 1.0,
                ..PercentileConfig::default()
            })),
        }
    }
}

impl FromStr for TimerAdvance {
    type Err = ChoiceError;
    fn from_str(s: &str) -> Result<Self, ChoiceError> {
        const CHOICES: &str =
            "none, fixed:NS (NS up to 1000000), kvm, percentile, percentile:Q (Q from 50 to 99)";
        Ok(match s {
            "none" => Self::None,
            "kvm" => Self::Kvm,
            "percentile" => Self::Percentile,
            _ => match (
                s.strip_prefix("fixed:").map(str::parse::<u64>),
                s.strip_prefix("percentile:").map(str::parse::<u8>),
            ) {
                (Some(Ok(ns)), _) if ns <= 1_000_000 => Self::Fixed(Duration::from_nanos(ns)),
                (_, Some(Ok(q))) if (50..=99).contains(&q) => Self::PercentileAt(q),
                _ => return choice("--timer-advance", CHOICES, s),
            },
        })
    }
}

impl fmt::Display for TimerAdvance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::None => f.write_str("none"),
            Self::Fixed(d) => write!(f, "fixed:{}", d.as_nanos()),
            Self::Kvm => f.write_str("kvm"),
            Self::Percentile => f.write_str("percentile"),
            Self::PercentileAt(q) => write!(f, "percentile:{q}"),
        }
    }
}

/// Where a vCPU's host timer expires (`lapic-timer`'s `SignalTimer`, or its
/// `TimerThread` and `TimerPlacement`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum TimerPlacement {
    /// On the vCPU thread itself: a POSIX timer signals it out of `KVM_RUN`
    /// from the timer interrupt, with no timer thread, as KVM's hrtimer
    /// kicks its vCPU.
    #[default]
    VcpuThread,
    /// A timer thread on its vCPU thread's CPU, moved when the vCPU thread
    /// has moved, as KVM keeps a vCPU's hrtimer on the vCPU's CPU.
    VcpuCpu,
    /// A timer thread wherever the host's scheduler puts it: the baseline.
    Anywhere,
}

impl TimerPlacement {
    /// The placement of lapic-timer's `TimerThread`, which the vCPU thread
    /// arms; `None`: no timer thread (`SignalTimer`).
    pub fn placement(self) -> Option<lapic_timer::TimerPlacement> {
        match self {
            Self::VcpuThread => None,
            Self::VcpuCpu => Some(lapic_timer::TimerPlacement::ArmingCpu),
            Self::Anywhere => Some(lapic_timer::TimerPlacement::Anywhere),
        }
    }
}

/// What delivering an interrupt does for its target's thread (`vcpu-sched`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Boost {
    /// Nothing: the baseline.
    None,
    /// Mark it ready for directed yield (`KvmReady`, the seed).
    Ready,
    /// vcpu-sched's `DirectedYield`: yields or boosts by who competes for
    /// the CPU.
    #[default]
    DirectedYield,
}

impl Boost {
    /// The policy.
    pub fn policy(self) -> Box<dyn BoostPolicy> {
        match self {
            Self::None => Box::new(NoBoost),
            Self::Ready => Box::new(KvmReady),
            Self::DirectedYield => Box::new(DirectedYield::new()),
        }
    }
}

/// How vCPU threads read the device bus on an exit (`rcu-qs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum BusAccess {
    /// Through an `RcuCell`; the vCPU thread is offline around `KVM_RUN`.
    #[default]
    Rcu,
    /// Through a `RwLock`: the baseline.
    #[value(name = "rwlock")]
    RwLock,
    /// Through an `ArcSwap`.
    ArcSwap,
}

/// Where the local APICs live (`--irqchip`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Irqchip {
    /// In this VMM: x2APIC and TSC-deadline MSRs exit to userspace, and the
    /// five crates are on the interrupt, halt and timer paths.
    #[default]
    User,
    /// In KVM (`KVM_CREATE_IRQCHIP`): the kernel's LAPIC, LAPIC timer (with
    /// its `lapic_timer_advance`) and halt polling (`halt_poll_ns`), as the
    /// baseline the family is measured against. `--halt-poll`,
    /// `--timer-advance`, `--boost` and `--guest-poll` then have nothing to act on.
    Kernel,
}

/// Every mechanism's choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mechanisms {
    /// `--halt-poll`.
    pub halt_poll: HaltPoll,
    /// `--timer-advance`.
    pub timer_advance: TimerAdvance,
    /// `--timer-placement` (a host matter: a migration does not carry it,
    /// and the destination runs the default).
    pub timer_placement: TimerPlacement,
    /// `--boost`.
    pub boost: Boost,
    /// `--bus`.
    pub bus: BusAccess,
    /// vCPU threads are RCU-offline while in the guest (an extended
    /// quiescent state, as KVM treats guest mode); without it they note a
    /// quiescent state at each exit (`--no-extended-qs`).
    pub extended_qs: bool,
    /// Guest-side polling (`--guest-poll`): the halt-poll policy sets the
    /// window a guest polls its mailbox for before it halts (published in the
    /// mailbox, learned from the outcomes the guest reports there), and the
    /// VMM itself then blocks at once on a halt.
    pub guest_poll: bool,
    /// `--irqchip`.
    pub irqchip: Irqchip,
}

impl Default for Mechanisms {
    fn default() -> Self {
        Self {
            halt_poll: HaltPoll::default(),
            timer_advance: TimerAdvance::default(),
            timer_placement: TimerPlacement::default(),
            boost: Boost::default(),
            bus: BusAccess::default(),
            extended_qs: true,
            guest_poll: false,
            irqchip: Irqchip::User,
        }
    }
}

impl Mechanisms {
    /// The halt-poll policy of each wake source of a halted vCPU, indexed by
    /// source (`irq::WAKE_INTERRUPT`, then `irq::WAKE_TIMER`), so each learns
    /// its own wake times. With guest-side polling the VMM blocks at once. A
    /// timer with an advance needs no polling of its own: its host timer
    /// fires early enough to cover the vCPU thread's wake-up too (the advance
    /// learns where the receiver arrives). A halt that polls anyway (for an
    /// interrupt, or with `always`) fires the timer itself once its deadline
    /// comes, as KVM's poll loop checks the vCPU's timer.
    pub fn halt_poll_per_source(self) -> [HaltPoll; 2] {
        let interrupts = if self.guest_poll {
            HaltPoll::Off
        } else {
            self.halt_poll
        };
        let timer = match self.timer_advance {
            TimerAdvance::None => interrupts,
            _ => HaltPoll::Off,
        };
        [interrupts, timer]
    }

    /// The halt-poll policies of [`Mechanisms::halt_poll_per_source`], the
    /// timer's as [`HaltPoll::timer_policy`] makes it.
    pub fn halt_poll_policies(self) -> [Box<dyn PollPolicy + Send>; 2] {
        let [interrupts, timer] = self.halt_poll_per_source();
        [interrupts.policy(), timer.timer_policy()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_wake_source_gets_its_own_halt_poll_policy() {
        let m = |halt_poll, timer_advance, guest_poll| Mechanisms {
            halt_poll,
            timer_advance,
            guest_poll,
            ..Mechanisms::default()
        };
        use HaltPoll::{Kvm, Off, Predictive};
        assert_eq!(
            m(Predictive, TimerAdvance::None, false).halt_poll_per_source(),
            [Predictive, Predictive],
            "the timer learns its own wake times"
        );
        assert_eq!(
            m(Kvm, TimerAdvance::Percentile, false).halt_poll_per_source(),
            [Kvm, Off],
            "an advance covers the timer's wake-up"
        );
        assert_eq!(
            m(Predictive, TimerAdvance::None, true).halt_poll_per_source(),
            [Off, Off],
            "the guest polls; the VMM blocks"
        );
    }

    #[test]
    fn predictive_sleeps_to_poll_for_interrupts_but_not_for_the_timer() {
        use halt_poll::HaltOutcome;
        let m = Mechanisms {
            timer_advance: TimerAdvance::None,
            ..Mechanisms::default()
        };
        let [mut interrupts, mut timer] = m.halt_poll_policies();
        // Regular 900 µs halts, each woken 10 µs into a poll after a sleep.
        let outcome = HaltOutcome {
            slept: Duration::from_micros(890),
            ..HaltOutcome::woken_while_polling(Duration::from_micros(900))
        };
        for _ in 0..200 {
            interrupts.learn(&outcome);
            timer.learn(&outcome);
        }
        assert!(
            interrupts.plan().sleep > Duration::ZERO,
            "{:?}",
            interrupts.plan()
        );
        assert_eq!(timer.plan().sleep, Duration::ZERO, "{:?}", timer.plan());
        assert_eq!(timer.plan().window, Duration::ZERO, "900 µs is no poll");
    }

    #[test]
    fn choices_round_trip_and_bad_ones_list_the_good_ones() {
        for &h in HaltPoll::value_variants() {
            assert_eq!(h.to_string().parse::<HaltPoll>(), Ok(h));
        }
        for t in [
            TimerAdvance::None,
            TimerAdvance::Fixed(Duration::from_micros(20)),
            TimerAdvance::Kvm,
            TimerAdvance::Percentile,
            TimerAdvance::PercentileAt(99),
        ] {
            assert_eq!(t.to_string().parse::<TimerAdvance>(), Ok(t));
        }
        for bad in [
            "percentile:49",
            "percentile:100",
            "percentile:",
            "fixed:1000001",
        ] {
            let err = bad.parse::<TimerAdvance>().unwrap_err().to_string();
            assert!(
                err.contains("percentile:Q (Q from 50 to 99)"),
                "{bad}: {err}"
            );
        }
        for b in [Boost::None, Boost::Ready, Boost::DirectedYield] {
            assert_eq!(b.to_string().parse::<Boost>(), Ok(b));
        }
        for b in [BusAccess::Rcu, BusAccess::RwLock, BusAccess::ArcSwap] {
            assert_eq!(b.to_string().parse::<BusAccess>(), Ok(b));
        }
        for i in [Irqchip::User, Irqchip::Kernel] {
            assert_eq!(i.to_string().parse::<Irqchip>(), Ok(i));
        }
        for &p in TimerPlacement::value_variants() {
            assert_eq!(p.to_string().parse::<TimerPlacement>(), Ok(p));
        }
        let err = "cpu0".parse::<TimerPlacement>().unwrap_err().to_string();
        assert!(err.contains("vcpu-cpu, anywhere"), "{err}");
        let err = "fast".parse::<HaltPoll>().unwrap_err().to_string();
        assert!(
            err.contains("kvm, haltpoll, aio, predictive, off, always, tuned"),
            "{err}"
        );
        assert!("own".parse::<Boost>().is_err());
        assert!("fixed:x".parse::<TimerAdvance>().is_err());
        assert!("fixed:9999999".parse::<TimerAdvance>().is_err());
        assert!("spin".parse::<BusAccess>().is_err());
        assert!("max".parse::<Boost>().is_err());
        assert!("split".parse::<Irqchip>().is_err());
    }
}
