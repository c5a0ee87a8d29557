//! What every vCPU thread of a VM shares: guest memory, the device bus, the
//! RCU domain, the interrupts, the mechanisms, their statistics and the stop
//! flag.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::vm::VmMemory;
use halt_poll::HaltStats;
use lapic_timer::TimerStats;
use rcu_qs::Domain;

use crate::devices::SharedBus;
use crate::guest_abi::DeliveryPath;
use crate::irq::Interrupts;
use crate::mechanisms::Mechanisms;
use crate::migration::StateSupport;
use crate::pause::PauseGate;

/// What every vCPU thread of a VM shares.
pub struct VmShared {
    /// Guest memory.
    pub memory: VmMemory,
    /// Port-I/O devices, as the vCPU threads read them.
    pub bus: SharedBus,
    /// The RCU domain whose readers are the vCPU threads.
    pub domain: Arc<Domain>,
    /// Pending interrupts, run states and boosts.
    pub irqs: Arc<Interrupts>,
    /// The mechanisms chosen.
    pub mechanisms: Mechanisms,
    /// What the halt pollers did.
    pub halt_stats: Arc<HaltStats>,
    /// What the LAPIC host timers did (wake-ups, spins, deliveries).
    pub timer_stats: Arc<TimerStats>,
    /// How long the userspace APIC's timer deliveries took.
    pub timer_delivery: DeliveryPath,
    /// Device-bus lookups on exits, and their cost.
    pub bus_lookups: BusLookups,
    /// Drains the dirty rings when one is full (with a dirty ring only).
    pub ring_full: Option<dirty_log::RingFull>,
    /// The floor on a periodic LAPIC timer's period, ns (KVM's
    /// `min_timer_period_us`).
    pub min_timer_period_ns: u64,
    /// Where vCPUs park for a migration.
    pub pause: PauseGate,
    /// What a vCPU's state capture may save on this host.
    pub state_support: Arc<StateSupport>,
    /// Set before kicking the vCPUs to make them stop.
    stop: AtomicBool,
}

impl VmShared {
    /// State for a VM.
    pub fn new(
        memory: VmMemory,
        bus: SharedBus,
        domain: Arc<Domain>,
        irqs: Arc<Interrupts>,
        mechanisms: Mechanisms,
    ) -> Self {
        let vcpus = irqs.vcpus();
        Self {
            memory,
            bus,
            domain,
            irqs,
            mechanisms,
            halt_stats: Arc::default(),
            timer_stats: Arc::default(),
            timer_delivery: DeliveryPath::default(),
            bus_lookups: BusLookups::default(),
            ring_full: None,
            min_timer_period_ns: lapic_timer::KVM_MIN_TIMER_PERIOD_NS,
            pause: PauseGate::new(vcpus),
            state_support: Arc::default(),
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
pub struct BusLookups {
    /// Lookups.
    pub count: std::sync::atomic::AtomicU64,
    /// TSC ticks in them.
    pub ticks: std::sync::atomic::AtomicU64,
}

impl BusLookups {
    /// Adds one vCPU's `count` lookups of `ticks` in all.
    pub(crate) fn add(&self, count: u64, ticks: u64) {
        self.count.fetch_add(count, Ordering::Relaxed);
        self.ticks.fetch_add(ticks, Ordering::Relaxed);
    }
}
