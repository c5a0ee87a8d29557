//! How to build a VM: the machine, what its guest sees, and the mechanisms
//! its host runs, as values.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use test_guests::layout::PARAMS;
use test_guests::pvh::Image;

use crate::CpuFeatures;
use crate::error::ConfigError;
use crate::policies::{FamilyPolicies, Irqchip, KvmHaltPoll, Policies, TimerPlacement};

/// How to build a VM. The machine and what its guest sees travel with it in
/// a migration; the mechanisms are the host's, and a destination brings its
/// own (the `migration` crate's `receive`).
#[derive(Clone)]
pub struct VmConfig {
    /// Number of vCPUs, 1 to [`MAX_VCPUS`](test_guests::layout::MAX_VCPUS).
    pub vcpus: u32,
    /// Guest memory in MiB: even, from
    /// [`MIN_MEM_MIB`](test_guests::layout::MIN_MEM_MIB) to
    /// [`MAX_MEM_MIB`](test_guests::layout::MAX_MEM_MIB).
    pub mem_mib: u64,
    /// The guest program's parameters (in the shared page).
    pub params: [u64; PARAMS],
    /// How the vCPUs start.
    pub boot: Boot,
    /// Stop every vCPU and fail if the guest has not finished by then; `None`:
    /// the watchdog, [`DEFAULT_TIMEOUT`](crate::stop::DEFAULT_TIMEOUT). A
    /// program that runs until it is stopped needs one given.
    pub timeout: Option<Duration>,
    /// A dirty ring of this many bytes per vCPU (enabled before the vCPUs
    /// exist, as KVM requires).
    pub dirty_ring: Option<u32>,
    /// Where the local APICs live.
    pub irqchip: Irqchip,
    /// The floor on a periodic LAPIC timer's period (KVM's
    /// `min_timer_period_us`; this VMM's APIC).
    pub min_timer_period: Duration,
    /// The policies of halt-poll, lapic-timer and vcpu-sched on this VMM's
    /// APIC, and of the bus read (rcu-qs) on either.
    pub policies: Arc<dyn Policies>,
    /// Where each vCPU's host timer expires (this VMM's APIC).
    pub timer_placement: TimerPlacement,
    /// vCPU threads are RCU-offline while in the guest (an extended
    /// quiescent state, as KVM treats guest mode); `false`: they note a
    /// quiescent state at each exit instead, the baseline.
    pub extended_qs: bool,
    /// KVM's own halt polling (the kernel irqchip).
    pub kvm_halt_poll: KvmHaltPoll,
    /// Grant the boosts the guest asks for in its boost-request words
    /// ([`test_guests::layout::boost_request`]), within these limits, from a
    /// thread that looks every 500 µs; `None`: ignore them.
    pub guest_boosts: Option<vcpu_sched::RequestLimits>,
    /// The guest's CPU features at most these: a baseline of several hosts
    /// (`run --cpu-baseline`), or a migration source's. [`Vm::new`](crate::Vm::new)
    /// refuses, naming them, any this host lacks. `None`: all this host's
    /// KVM offers.
    pub cpu_features: Option<CpuFeatures>,
    /// The most named values one vCPU may report in a run
    /// ([`MAX_REPORTS`](crate::MAX_REPORTS) by default): a guest that
    /// reports in a loop would otherwise grow the VMM without bound, and a
    /// longer measurement asks for more.
    pub max_reports: usize,
}

/// How a VM's vCPUs start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Boot {
    /// The VMM writes the [boot memory](test_guests::boot_memory) and sets every
    /// vCPU's registers for the program at CPL3: no CPL0 code runs first.
    #[default]
    Direct,
    /// From an image file ([`test_guests::pvh`]): every vCPU enters its PVH
    /// start-up in 32-bit protected mode. The image's vCPU count, memory
    /// size and parameters take the place of the configuration's.
    Image(Arc<Image>),
    /// From a migration stream or a snapshot (the `migration` crate): nothing
    /// is written at creation; memory and the vCPUs' state come from the
    /// stream, and [`Vm::set_incoming`](crate::Vm::set_incoming) before the run.
    Incoming,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            vcpus: 1,
            mem_mib: 64,
            params: [0; PARAMS],
            boot: Boot::Direct,
            timeout: None,
            dirty_ring: None,
            irqchip: Irqchip::User,
            min_timer_period: Duration::from_nanos(lapic_timer::KVM_MIN_TIMER_PERIOD_NS),
            policies: Arc::new(FamilyPolicies),
            timer_placement: TimerPlacement::default(),
            extended_qs: true,
            kvm_halt_poll: KvmHaltPoll::default(),
            guest_boosts: None,
            cpu_features: None,
            max_reports: crate::MAX_REPORTS,
        }
    }
}

impl VmConfig {
    /// The vCPUs, memory and parameters the VM gets: an image's own, or these.
    pub fn machine(&self) -> (u32, u64, [u64; PARAMS]) {
        match &self.boot {
            Boot::Direct | Boot::Incoming => (self.vcpus, self.mem_mib, self.params),
            Boot::Image(image) => (image.vcpus(), image.mem_mib(), image.params()),
        }
    }

    /// Whether the choices fit together: KVM's halt polling is the kernel
    /// irqchip's.
    pub fn check(&self) -> Result<(), ConfigError> {
        match (self.irqchip, self.kvm_halt_poll) {
            (
                Irqchip::User,
                KvmHaltPoll::Window(_) | KvmHaltPoll::Tuned | KvmHaltPoll::Budget(_),
            ) => Err(ConfigError::KvmHaltPollNeedsKernelIrqchip),
            _ => Ok(()),
        }
    }
}

impl fmt::Debug for VmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VmConfig")
            .field("vcpus", &self.vcpus)
            .field("mem_mib", &self.mem_mib)
            .field("params", &self.params)
            .field("boot", &self.boot)
            .field("timeout", &self.timeout)
            .field("dirty_ring", &self.dirty_ring)
            .field("irqchip", &self.irqchip)
            .field("min_timer_period", &self.min_timer_period)
            .field("timer_placement", &self.timer_placement)
            .field("extended_qs", &self.extended_qs)
            .field("kvm_halt_poll", &self.kvm_halt_poll)
            .field("guest_boosts", &self.guest_boosts)
            .field("cpu_features", &self.cpu_features)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kvm_halt_polling_is_the_kernel_irqchips_alone() {
        let on = |irqchip, kvm_halt_poll| VmConfig {
            irqchip,
            kvm_halt_poll,
            ..VmConfig::default()
        };
        let window = KvmHaltPoll::Window(Duration::ZERO);
        let budget = KvmHaltPoll::Budget(crate::CpuShare::new(0.05).unwrap());
        for polling in [window, KvmHaltPoll::Tuned, budget] {
            assert_eq!(
                on(Irqchip::User, polling).check(),
                Err(ConfigError::KvmHaltPollNeedsKernelIrqchip),
                "{polling:?}"
            );
            assert_eq!(on(Irqchip::Kernel, polling).check(), Ok(()));
        }
        assert_eq!(on(Irqchip::User, KvmHaltPoll::Module).check(), Ok(()));
    }

    #[test]
    fn an_images_machine_takes_the_configurations_place_and_debug_shows_it() {
        let program = test_guests::find("hello").unwrap();
        let image = Image::build(program, 3, 64, [7; PARAMS]).unwrap();
        let config = VmConfig {
            boot: Boot::Image(Arc::new(image)),
            ..VmConfig::default()
        };
        assert_eq!(config.machine(), (3, 64, [7; PARAMS]));
        assert_eq!(VmConfig::default().machine(), (1, 64, [0; PARAMS]));
        let debug = format!("{:?}", VmConfig::default());
        assert!(
            debug.starts_with("VmConfig { vcpus: 1, mem_mib: 64"),
            "{debug}"
        );
        assert!(
            debug.contains("kvm_halt_poll: Module") && debug.ends_with(", .. }"),
            "{debug}"
        );
    }
}
