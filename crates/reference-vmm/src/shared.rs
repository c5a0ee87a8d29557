//! What every vCPU thread of a VM shares, one handle per concern: guest
//! memory, the devices, the RCU domain, the interrupts, this VMM's APIC
//! setup, the statistics, a migration's hooks, and the stop flag.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use halt_poll::HaltStats;
use lapic_timer::TimerStats;
use rcu_qs::Domain;

use crate::devices::BusRead;
use crate::duty_cycle::VcpuPauses;
use crate::guest_abi::DeliveryPath;
use crate::irq::Interrupts;
use crate::memory::VmMemory;
use crate::policies::{Policies, TimerPlacement};
use crate::vcpu::state::StateSupport;
use crate::vm::pause::PauseGate;

/// What every vCPU thread of a VM shares.
pub(crate) struct VmShared {
    /// Guest memory.
    pub memory: VmMemory,
    /// Port-I/O devices, as the vCPU threads read them.
    pub devices: Devices,
    /// The RCU domain whose readers are the vCPU threads.
    pub rcu: Rcu,
    /// Pending interrupts, run states and boosts.
    pub irqs: Arc<Interrupts>,
    /// What this VMM's local APIC runs (`Irqchip::User`).
    pub apic: ApicSetup,
    /// What the halt pollers and host timers did.
    pub stats: Stats,
    /// Where vCPUs park for a migration, and what they save there.
    pub moving: Moving,
    /// Set before kicking the vCPUs to make them stop.
    stop: AtomicBool,
}

/// The device bus and what reading it costs.
pub(crate) struct Devices {
    /// How vCPU threads read it.
    pub bus: BusRead,
    /// Lookups on exits, and their cost.
    pub lookups: BusLookups,
    /// The most named values each vCPU may report at the ucall port.
    pub max_reports: usize,
}

/// The vCPU threads as RCU readers.
pub(crate) struct Rcu {
    /// Their domain.
    pub domain: Arc<Domain>,
    /// Offline while in the guest (an extended quiescent state).
    pub extended_qs: bool,
}

/// What each vCPU's local APIC in this VMM is made with.
pub(crate) struct ApicSetup {
    /// The policies it asks for its poller, timer and guest-side polling.
    pub policies: Arc<dyn Policies>,
    /// Where its host timer expires.
    pub timer_placement: TimerPlacement,
    /// The floor on a periodic timer's period, ns.
    pub min_timer_period_ns: u64,
    /// The vCPUs' MAXPHYADDR, from their CPUID.
    pub phys_bits: u8,
}

/// What the mechanisms measured, summed over the vCPUs.
#[derive(Default)]
pub(crate) struct Stats {
    /// The halt pollers'.
    pub halt: Arc<HaltStats>,
    /// The LAPIC host timers' (wake-ups, spins, deliveries).
    pub timer: Arc<TimerStats>,
    /// How long the userspace APIC's timer deliveries took.
    pub delivery: DeliveryPath,
}

/// A migration's hooks in the vCPU threads.
pub(crate) struct Moving {
    /// Where vCPUs park.
    pub pause: PauseGate,
    /// What a vCPU's state capture may save on this host.
    pub state_support: Arc<StateSupport>,
    /// Drains the dirty rings when one is full (with a dirty ring only).
    pub ring_full: Option<dirty_log::RingFull>,
    /// How long each vCPU pauses per slice it runs (a dirty limit; none
    /// unless a migration sets one).
    pub dirty_pauses: Arc<VcpuPauses>,
}

impl VmShared {
    /// State for a VM; the vCPU count is the interrupts'.
    pub fn new(
        memory: VmMemory,
        devices: Devices,
        rcu: Rcu,
        irqs: Arc<Interrupts>,
        apic: ApicSetup,
        moving: Moving,
    ) -> Self {
        Self {
            memory,
            devices,
            rcu,
            irqs,
            apic,
            stats: Stats::default(),
            moving,
            stop: AtomicBool::new(false),
        }
    }

    /// Asks every vCPU to stop; kick them afterwards.
    pub fn request_stop(&self) {
        // SeqCst, and before the kick: a vCPU that consumes the kick sees the flag.
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Whether the VMM asked the vCPUs to stop.
    pub fn stop_requested(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }
}

/// Counts device-bus lookups on exits and the TSC ticks they took
/// (including the device's handling). Each vCPU thread counts its own and
/// adds them here once, when it ends: a counter every vCPU wrote on every
/// exit would bounce its cache line between them, and the bus beside it,
/// inside the very time it measures.
#[derive(Debug, Default)]
pub(crate) struct BusLookups {
    /// Lookups.
    pub count: AtomicU64,
    /// TSC ticks in them.
    pub ticks: AtomicU64,
}

impl BusLookups {
    /// Adds one vCPU's `count` lookups of `ticks` in all.
    pub(crate) fn add(&self, count: u64, ticks: u64) {
        self.count.fetch_add(count, Ordering::Relaxed);
        self.ticks.fetch_add(ticks, Ordering::Relaxed);
    }
}
