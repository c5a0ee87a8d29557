//! The reference policies by the names `reference-vmm run`'s switches and
//! the bench's variants use, each with its baseline: a [`Policies`] made of
//! names, for a command line. A VMM author passes its own [`Policies`]
//! instead; nothing else in this crate looks at these names.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use halt_poll::{
    AioPoll, Fixed as FixedPoll, GuestHaltpoll, KvmGrowShrink, Never, PollPolicy, Predictive,
    PredictiveConfig,
};
use lapic_timer::{AdvancePolicy, Fixed, KvmAdaptive, NoAdvance, Percentile, PercentileConfig};
use vcpu_sched::{BoostBudget, BoostPolicy, DirectedYield, FifoOnDelivery, KvmReady, NoBoost};

use reference_vmm::{
    ChoiceError, CpuShare, Irqchip, KvmHaltPoll, Policies, TimerPlacement, VmConfig, WakeSource,
    choice_names,
};

choice_names!(HaltPoll, "--halt-poll", [
    Kvm => "kvm", Haltpoll => "haltpoll", Aio => "aio", Predictive => "predictive",
    Off => "off", Always => "always", Tuned => "tuned",
], Budget(CpuShare) => "budget" ("SHARE (of a vCPU, in (0, 1])"));
choice_names!(Boost, "--boost", [
    None => "none", Ready => "ready", DirectedYield => "directed-yield", OnDelivery => "on-delivery",
]);

/// How a halted vCPU waits (halt-poll).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
    /// KVM's halt polling under the window halt-poll's `WindowTuner` sets:
    /// the kernel irqchip only ([`KvmHaltPoll::Tuned`]).
    Tuned,
    /// KVM's halt polling under the widest window whose polling fits this
    /// share of each vCPU (`budget:0.05`): the kernel irqchip only
    /// ([`KvmHaltPoll::Budget`]).
    Budget(CpuShare),
}

/// How long `always` polls before it blocks.
const ALWAYS_POLL: Duration = Duration::from_millis(10);

impl HaltPoll {
    /// The policy on this VMM's APIC (`tuned` and `budget` are KVM's alone;
    /// here they stand for `Predictive`, whose cost model the tuner follows).
    pub fn policy(self) -> Box<dyn PollPolicy + Send> {
        match self {
            Self::Kvm => Box::new(KvmGrowShrink::new()),
            Self::Haltpoll => Box::new(GuestHaltpoll::new()),
            Self::Aio => Box::new(AioPoll::new()),
            Self::Predictive | Self::Tuned | Self::Budget(_) => Box::new(Predictive::default()),
            Self::Off => Box::new(Never),
            Self::Always => Box::new(FixedPoll(ALWAYS_POLL)),
        }
    }

    /// The policy for halts that end at the vCPU's own timer: the same,
    /// except that `Predictive` never sleeps to poll just before the deadline
    /// (hybrid polling). A deadline is known; meeting it early is a timer
    /// advance's job, at a spin it bounds, while polling for it took about
    /// 5 % of a CPU at 1 kHz for a block's wake-up latency (`reference-bench halt`'s
    /// idle timer), the trade KVM's shrink rule refuses.
    pub fn timer_policy(self) -> Box<dyn PollPolicy + Send> {
        match self {
            Self::Predictive | Self::Tuned | Self::Budget(_) => {
                let mut config = PredictiveConfig::default();
                config.hybrid = false;
                Box::new(Predictive::new(config))
            }
            other => other.policy(),
        }
    }

    /// KVM's halt polling for this choice on the kernel irqchip: `off` stops
    /// polling, `always` polls up to the same 10 ms, `tuned` and `budget`
    /// are tuned, and the policies KVM does not have leave its own
    /// grow/shrink.
    pub fn kvm(self) -> KvmHaltPoll {
        match self {
            Self::Off => KvmHaltPoll::Window(Duration::ZERO),
            Self::Always => KvmHaltPoll::Window(ALWAYS_POLL),
            Self::Tuned => KvmHaltPoll::Tuned,
            Self::Budget(share) => KvmHaltPoll::Budget(share),
            Self::Kvm | Self::Haltpoll | Self::Aio | Self::Predictive => KvmHaltPoll::Module,
        }
    }

    /// Whether KVM's in-kernel halt polling does this choice (`kvm`, `off`,
    /// `always`, `tuned`, `budget`); the others are policies of this VMM's
    /// APIC.
    pub fn in_kernel(self) -> bool {
        matches!(
            self,
            Self::Kvm | Self::Off | Self::Always | Self::Tuned | Self::Budget(_)
        )
    }

    /// Whether only KVM's in-kernel irqchip has this choice: a window that
    /// only KVM's halts poll under (`tuned`, `budget`).
    pub fn kernel_only(self) -> bool {
        matches!(self, Self::Tuned | Self::Budget(_))
    }
}

/// How early the host timer of a guest timer fires (lapic-timer).
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
            Self::PercentileAt(q) => {
                let mut config = PercentileConfig::default();
                // It aims at the 1 / (1 + spin_weight) quantile.
                config.spin_weight = 100.0 / f64::from(q) - 1.0;
                Box::new(Percentile::new(config))
            }
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
                _ => {
                    return Err(ChoiceError {
                        what: "--timer-advance",
                        given: s.to_owned(),
                        choices: CHOICES.to_owned(),
                    });
                }
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

/// What delivering an interrupt does for its target's thread (vcpu-sched).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Boost {
    /// Nothing: the baseline.
    None,
    /// Mark it ready for directed yield (`KvmReady`, KVM's delivery boost).
    Ready,
    /// vcpu-sched's `DirectedYield`: yields or boosts by who competes for
    /// the CPU.
    #[default]
    DirectedYield,
    /// Boost every target as its interrupt is delivered (`FifoOnDelivery`):
    /// on KVM's irqchip, the targets of the completion device's irqfds that
    /// wait for a CPU.
    OnDelivery,
}

impl Boost {
    /// The policy.
    pub fn policy(self) -> Box<dyn BoostPolicy> {
        match self {
            Self::None => Box::new(NoBoost),
            Self::Ready => Box::new(KvmReady),
            Self::DirectedYield => Box::new(DirectedYield::new()),
            Self::OnDelivery => Box::new(FifoOnDelivery),
        }
    }

    /// The booster's budget: vcpu-sched's default, but boosts of at most
    /// [`DELIVERY_BOOST`] for `on-delivery`.
    pub fn budget(self) -> BoostBudget {
        let mut budget = BoostBudget::default();
        if self == Self::OnDelivery {
            budget.max_boost = DELIVERY_BOOST;
        }
        budget
    }
}

/// The longest `--boost on-delivery` boost: long enough for a target
/// waiting for a CPU to be scheduled in and take its interrupt (tens of
/// microseconds here, where the guest's handler is emulated). Longer, a
/// boosted vCPU that goes on to spin on a guest lock keeps its holder off
/// the CPU (on KVM's irqchip no exit ends the boost sooner, only the
/// device's next request from it). In bench sched's I/O while working, one
/// quiet run each: 1.07x no boost's completions with 50 µs boosts,
/// 1.22-1.26x with 100 µs, 1.04x with 200 µs.
pub const DELIVERY_BOOST: Duration = Duration::from_micros(100);

/// The policies by name: [`Policies`] for a command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Presets {
    /// How halted vCPUs wait.
    pub halt_poll: HaltPoll,
    /// How early host timers fire.
    pub timer_advance: TimerAdvance,
    /// What delivery does for the target's thread.
    pub boost: Boost,
    /// The guest polls its mailbox for the halt-poll policy's window before
    /// it halts; the VMM then blocks at once.
    pub guest_poll: bool,
}

impl Presets {
    /// The choice for halts that `source` ends. With guest-side polling the
    /// VMM blocks at once; a timer with an advance needs no polling of its
    /// own (see [`Policies::halt_poll`]).
    pub fn halt_poll_for(&self, source: WakeSource) -> HaltPoll {
        let interrupts = match self.guest_poll {
            true => HaltPoll::Off,
            false => self.halt_poll,
        };
        match (source, self.timer_advance) {
            (WakeSource::Timer, TimerAdvance::None) | (WakeSource::Interrupt, _) => interrupts,
            (WakeSource::Timer, _) => HaltPoll::Off,
        }
    }
}

impl Policies for Presets {
    fn halt_poll(&self, _vcpu: u32, source: WakeSource) -> Box<dyn PollPolicy + Send> {
        let choice = self.halt_poll_for(source);
        match source {
            WakeSource::Interrupt => choice.policy(),
            WakeSource::Timer => choice.timer_policy(),
        }
    }

    fn timer_advance(&self, _vcpu: u32, tsc_khz: u64) -> Box<dyn AdvancePolicy + Send> {
        self.timer_advance.policy(tsc_khz)
    }

    fn boost(&self) -> Box<dyn BoostPolicy> {
        self.boost.policy()
    }

    fn boost_budget(&self) -> BoostBudget {
        self.boost.budget()
    }

    fn guest_poll(&self, _vcpu: u32) -> Option<Box<dyn PollPolicy + Send>> {
        self.guest_poll.then(|| self.halt_poll.policy())
    }
}

/// Every mechanism chosen by name, with where the APICs live: what a
/// command line or a bench variant sets on a [`VmConfig`]. The default is
/// [`Choices::on`] this VMM's APIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Choices {
    /// The policies.
    pub presets: Presets,
    /// Where host timers expire.
    pub timer_placement: TimerPlacement,
    /// vCPU threads are RCU-offline while in the guest.
    pub extended_qs: bool,
    /// Where the local APICs live.
    pub irqchip: Irqchip,
    /// Grant the boosts the guest asks for in its boost-request words
    /// (vcpu-sched's `GuestBoosts`, its default limits).
    pub guest_boosts: bool,
}

impl Default for Choices {
    fn default() -> Self {
        Self::on(Irqchip::User)
    }
}

impl Choices {
    /// The defaults, on `irqchip` (KVM's own halt polling on the kernel's).
    pub fn on(irqchip: Irqchip) -> Self {
        let halt_poll = match irqchip {
            Irqchip::User => HaltPoll::default(),
            Irqchip::Kernel => HaltPoll::Kvm,
        };
        Self {
            presets: Presets {
                halt_poll,
                ..Presets::default()
            },
            timer_placement: TimerPlacement::default(),
            extended_qs: true,
            irqchip,
            guest_boosts: false,
        }
    }

    /// Granting the boosts the guest asks for.
    pub fn with_guest_boosts(mut self) -> Self {
        self.guest_boosts = true;
        self
    }

    /// With `halt_poll`.
    pub fn with_halt_poll(mut self, halt_poll: HaltPoll) -> Self {
        self.presets.halt_poll = halt_poll;
        self
    }

    /// With `timer_advance`.
    pub fn with_timer_advance(mut self, timer_advance: TimerAdvance) -> Self {
        self.presets.timer_advance = timer_advance;
        self
    }

    /// With `boost`.
    pub fn with_boost(mut self, boost: Boost) -> Self {
        self.presets.boost = boost;
        self
    }

    /// With host timers expiring at `placement`.
    pub fn with_timer_placement(mut self, placement: TimerPlacement) -> Self {
        self.timer_placement = placement;
        self
    }

    /// With guest-side polling.
    pub fn with_guest_poll(mut self) -> Self {
        self.presets.guest_poll = true;
        self
    }

    /// Sets them on `config`.
    pub fn apply(self, config: &mut VmConfig) {
        config.irqchip = self.irqchip;
        config.policies = Arc::new(self.presets);
        config.timer_placement = self.timer_placement;
        config.extended_qs = self.extended_qs;
        config.guest_boosts = self.guest_boosts.then(vcpu_sched::RequestLimits::default);
        config.kvm_halt_poll = match self.irqchip {
            Irqchip::User => KvmHaltPoll::Module,
            Irqchip::Kernel => self.presets.halt_poll.kvm(),
        };
    }

    /// `config` with them.
    pub fn config(self, config: VmConfig) -> VmConfig {
        let mut config = config;
        self.apply(&mut config);
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use halt_poll::{HaltOutcome, WokenDuring};

    #[test]
    fn each_wake_source_gets_its_own_halt_poll_choice() {
        let p = |halt_poll, timer_advance, guest_poll| Presets {
            halt_poll,
            timer_advance,
            guest_poll,
            ..Presets::default()
        };
        let both =
            |p: Presets| [WakeSource::Interrupt, WakeSource::Timer].map(|s| p.halt_poll_for(s));
        use HaltPoll::{Kvm, Off, Predictive};
        assert_eq!(
            both(p(Predictive, TimerAdvance::None, false)),
            [Predictive, Predictive],
            "the timer learns its own wake times"
        );
        assert_eq!(
            both(p(Kvm, TimerAdvance::Percentile, false)),
            [Kvm, Off],
            "an advance covers the timer's wake-up"
        );
        assert_eq!(
            both(p(Predictive, TimerAdvance::None, true)),
            [Off, Off],
            "the guest polls; the VMM blocks"
        );
        assert!(
            p(Predictive, TimerAdvance::None, true)
                .guest_poll(0)
                .is_some()
        );
        assert!(Presets::default().guest_poll(0).is_none());
    }

    #[test]
    fn predictive_sleeps_to_poll_for_interrupts_but_not_for_the_timer() {
        let presets = Presets {
            timer_advance: TimerAdvance::None,
            ..Presets::default()
        };
        let mut interrupts = presets.halt_poll(0, WakeSource::Interrupt);
        let mut timer = presets.halt_poll(0, WakeSource::Timer);
        // Regular 900 µs halts, each woken 10 µs into a poll after a sleep.
        let outcome = HaltOutcome::new(
            Duration::from_micros(900),
            Duration::from_micros(890),
            Duration::from_micros(10),
            WokenDuring::Poll,
        );
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
    fn the_family_defaults_are_the_presets_defaults() {
        // The same plans from the same outcomes: the default presets are the
        // family's own policies.
        let family = reference_vmm::FamilyPolicies;
        let presets = Presets::default();
        let outcome = HaltOutcome::woken_while_polling(Duration::from_micros(30));
        for source in [WakeSource::Interrupt, WakeSource::Timer] {
            let (mut a, mut b) = (family.halt_poll(0, source), presets.halt_poll(0, source));
            for _ in 0..50 {
                a.learn(&outcome);
                b.learn(&outcome);
            }
            assert_eq!(a.plan(), b.plan(), "{source:?}");
        }
    }

    #[test]
    fn a_budget_is_a_share_of_a_vcpu_in_its_name() {
        let budget = "budget:0.05".parse::<HaltPoll>().unwrap();
        let share = CpuShare::new(0.05).unwrap();
        assert_eq!(budget, HaltPoll::Budget(share));
        assert_eq!(CpuShare::from_ppm(50_000), Some(share));
        assert_eq!(
            CpuShare::from_ppm(0).or(CpuShare::from_ppm(1_000_001)),
            None
        );
        assert_eq!(budget.to_string(), "budget:0.05");
        assert_eq!(budget.kvm(), KvmHaltPoll::Budget(share));
        assert!(budget.in_kernel() && budget.kernel_only());
        assert_eq!(
            "budget:1".parse(),
            Ok(HaltPoll::Budget(CpuShare::new(1.0).unwrap()))
        );
        for bad in [
            "budget",
            "budget:",
            "budget:0",
            "budget:-0.1",
            "budget:1.5",
            "budget:NaN",
            "budget:inf",
            "budget:0.0000001",
            "budget:5%",
        ] {
            let err = bad.parse::<HaltPoll>().unwrap_err().to_string();
            assert!(
                err.contains("budget:SHARE (of a vCPU, in (0, 1])"),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn choices_round_trip_and_bad_ones_list_the_good_ones() {
        for &h in HaltPoll::ALL {
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
        for &b in Boost::ALL {
            assert_eq!(b.to_string().parse::<Boost>(), Ok(b));
        }
        let err = "fast".parse::<HaltPoll>().unwrap_err().to_string();
        assert!(
            err.contains("kvm, haltpoll, aio, predictive, off, always, tuned, budget:SHARE"),
            "{err}"
        );
        assert!("own".parse::<Boost>().is_err());
        assert!("fixed:x".parse::<TimerAdvance>().is_err());
        assert!("fixed:9999999".parse::<TimerAdvance>().is_err());
        assert!("max".parse::<Boost>().is_err());
    }
}
