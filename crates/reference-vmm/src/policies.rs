//! Where each crate's policy goes: the values a VMM author passes in
//! [`VmConfig`](crate::VmConfig), and the choices that are not policies but
//! places (where the APICs live, where a host timer expires).
//!
//! | crate | hook | called | default |
//! |---|---|---|---|
//! | halt-poll | [`Policies::halt_poll`] | once per vCPU and wake source, on its thread | `Predictive` for interrupts; none for a timer with an advance |
//! | halt-poll | [`Policies::guest_poll`] | once per vCPU, on its thread | none: the VMM polls |
//! | lapic-timer | [`Policies::timer_advance`] | once per vCPU, on its thread | `Percentile` |
//! | vcpu-sched | [`Policies::boost`] | once per run | `DirectedYield` |
//! | rcu-qs | [`Policies::bus`] | once per run | [`RcuBus`](crate::devices::RcuBus) |
//!
//! dirty-log is wired where a migration starts (`migration::Migration`),
//! with the backend its options name.

use std::time::Duration;

use halt_poll::{Never, PollPolicy, Predictive};
use lapic_timer::{AdvancePolicy, Percentile};
use rcu_qs::Domain;
use vcpu_sched::{BoostBudget, BoostPolicy, DirectedYield};

use crate::devices::{BusRead, IoBus, RcuBus};

/// What ends a halt. The halt poller keeps one policy per source, so that
/// each learns its own wake times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeSource {
    /// An interrupt posted to the vCPU (an IPI, a device's).
    Interrupt,
    /// The vCPU's own LAPIC timer.
    Timer,
}

/// The policies of the mechanisms on this VMM's local APIC (and the bus
/// read, on either), made as the VM starts. Every method has the family's
/// own policy as its default: implement the trait and override the hooks
/// you replace.
///
/// ```
/// use std::time::Duration;
/// use reference_vmm::{Policies, WakeSource};
///
/// /// Polls 20 µs before it blocks, whatever ended the halt.
/// struct Fixed20us;
///
/// impl Policies for Fixed20us {
///     fn halt_poll(&self, _vcpu: u32, _source: WakeSource) -> Box<dyn halt_poll::PollPolicy + Send> {
///         Box::new(halt_poll::Fixed(Duration::from_micros(20)))
///     }
/// }
/// ```
pub trait Policies: Send + Sync {
    /// How vCPU `vcpu` waits in a halt that `source` ends. The default polls
    /// with `Predictive` for interrupts, and not at all for the timer: its
    /// advance (below) fires the host timer early enough to cover the vCPU
    /// thread's wake-up too. A policy that polls for the timer fires it
    /// itself once the deadline comes, as KVM's poll loop checks the
    /// vCPU's timer.
    fn halt_poll(&self, vcpu: u32, source: WakeSource) -> Box<dyn PollPolicy + Send> {
        let _ = vcpu;
        match source {
            WakeSource::Interrupt => Box::new(Predictive::default()),
            WakeSource::Timer => Box::new(Never),
        }
    }

    /// Guest-side polling: a policy whose window vCPU `vcpu`'s guest polls
    /// its mailbox for before it halts (the guest kit's `pingpong` does,
    /// given the parameter), learning from the outcomes the guest reports
    /// there. `None`, the default: the guest halts at once and the VMM
    /// polls ([`halt_poll`](Self::halt_poll)). With one, `halt_poll` should
    /// block at once: the guest has polled already.
    fn guest_poll(&self, vcpu: u32) -> Option<Box<dyn PollPolicy + Send>> {
        let _ = vcpu;
        None
    }

    /// How early vCPU `vcpu`'s host timer fires before a guest deadline, for
    /// a TSC of `tsc_khz`. The default is `Percentile`'s p91.
    fn timer_advance(&self, vcpu: u32, tsc_khz: u64) -> Box<dyn AdvancePolicy + Send> {
        let _ = (vcpu, tsc_khz);
        Box::new(Percentile::default())
    }

    /// What delivering an interrupt does for its target's thread: one for
    /// the VM. The default is `DirectedYield`.
    fn boost(&self) -> Box<dyn BoostPolicy> {
        Box::new(DirectedYield::new())
    }

    /// How long a boost may last, and how much boosting each vCPU may have
    /// per period. The default is vcpu-sched's: 1 ms per boost, 2 ms per
    /// 10 ms.
    fn boost_budget(&self) -> BoostBudget {
        BoostBudget::default()
    }

    /// How vCPU threads read `bus` on an exit; `domain` is the RCU domain
    /// whose readers they are. The default is the VMM's RCU cell, read in
    /// place ([`BusRead::Rcu`]); any other [`BusAccess`](crate::devices::BusAccess) goes through a trait
    /// object.
    fn bus(&self, bus: IoBus, domain: &Domain) -> BusRead {
        BusRead::Rcu(RcuBus::new(domain, bus))
    }
}

/// The family's own policies: every default of [`Policies`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FamilyPolicies;

impl Policies for FamilyPolicies {}

/// Where the local APICs live.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Irqchip {
    /// In this VMM: x2APIC and TSC-deadline MSRs exit to userspace, and the
    /// [`Policies`] act on the interrupt, halt and timer paths.
    #[default]
    User,
    /// In KVM (`KVM_CREATE_IRQCHIP`): the kernel's LAPIC, its timer (with its
    /// own `lapic_timer_advance`) and halt polling, which
    /// [`KvmHaltPoll`] sets. Only [`Policies::bus`] acts there.
    Kernel,
}

/// KVM's own halt polling, with [`Irqchip::Kernel`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvmHaltPoll {
    /// KVM's grow/shrink under the module's `halt_poll_ns`.
    #[default]
    Module,
    /// A fixed per-VM maximum window (`KVM_CAP_HALT_POLL`; zero: no polling).
    Window(Duration),
    /// The window halt-poll's `WindowTuner` sets from the vCPUs' binary
    /// statistics every 10 ms.
    Tuned,
    /// The widest window whose polling stays within this share of each
    /// vCPU's time, as halt-poll's `WindowTuner` with a budget sets it every
    /// 10 ms: an operator's bound on the CPU an idle or bursty guest burns.
    Budget(CpuShare),
}

/// A share of one vCPU's time in (0, 1], kept in parts per million so that
/// the choices holding it stay `Eq` and round-trip through their names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuShare(u32);

impl CpuShare {
    /// `share` (0.05: 5 %); `None` unless it is in (0, 1] and at least one
    /// part per million.
    pub fn new(share: f64) -> Option<Self> {
        let ppm = (share * 1e6).round();
        (share <= 1.0 && ppm >= 1.0).then_some(Self(ppm as u32))
    }

    /// `ppm` parts per million of a vCPU (50 000: 5 %); `None` unless in
    /// 1..=1 000 000. A `const fn`, for shares named in constants.
    pub const fn from_ppm(ppm: u32) -> Option<Self> {
        match ppm {
            1..=1_000_000 => Some(Self(ppm)),
            _ => None,
        }
    }

    /// The share, as a fraction of the vCPU.
    pub fn get(self) -> f64 {
        f64::from(self.0) / 1e6
    }
}

impl std::str::FromStr for CpuShare {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let share = s.parse::<f64>().map_err(|e| format!("{s:?}: {e}"))?;
        Self::new(share).ok_or_else(|| format!("{s:?} is not a share in (0, 1]"))
    }
}

impl std::fmt::Display for CpuShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// Where a vCPU's host timer expires (this VMM's APIC).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TimerPlacement {
    /// On the vCPU thread itself: a POSIX timer signals it out of `KVM_RUN`
    /// from the timer interrupt, with no timer thread, as KVM's hrtimer
    /// kicks its vCPU (lapic-timer's `SignalTimer`).
    #[default]
    VcpuThread,
    /// A timer thread on its vCPU thread's CPU, moved when the vCPU thread
    /// has moved, as KVM keeps a vCPU's hrtimer on the vCPU's CPU.
    VcpuCpu,
    /// A timer thread wherever the host's scheduler puts it: the baseline.
    Anywhere,
}

impl TimerPlacement {
    /// The placement of lapic-timer's `TimerThread`; `None`: no timer
    /// thread (`SignalTimer`).
    pub fn thread(self) -> Option<lapic_timer::TimerPlacement> {
        match self {
            Self::VcpuThread => None,
            Self::VcpuCpu => Some(lapic_timer::TimerPlacement::ArmingCpu),
            Self::Anywhere => Some(lapic_timer::TimerPlacement::Anywhere),
        }
    }
}
