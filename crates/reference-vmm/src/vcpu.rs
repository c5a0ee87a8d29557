//! A vCPU thread's run loop, where the five mechanisms meet on the exit path,
//! generic over where the local APIC lives ([`IrqChip`]).
//!
//! ```text
//! loop {
//!     stop requested?  -> finish                  (set by the VMM before a kick)
//!     chip: entering guest                       (vcpu-sched run state; before any look for work)
//!     chip: prepare entry                        (fire a due timer, spinning to its deadline; inject)
//!     offline; exit = KVM_RUN; online            (rcu-qs: the guest is a quiescent state)
//!     chip: left guest                           (boost policy: ran; learn the delivery lead)
//!     handle_exit: APIC MSR/MMIO -> chip; HLT -> chip waits (halt-poll);
//!                  pause, yield -> chip (vcpu-sched); port I/O -> the bus, through RCU
//!     kick (EINTR)               -> acknowledge, look again
//! }
//! ```
//! Kicks follow the strategy described in [`crate::kick`]; delivery to other
//! vCPUs, and the handshake that orders the run state before every look for
//! work, is [`crate::irq`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use halt_poll::{HaltStats, set_timer_slack};
use kvm_ioctls::VcpuFd;
use lapic_timer::TimerStats;
use lapic_timer::time::rdtsc;
use rcu_qs::{Domain, Reader};
use vm_memory::GuestMemoryMmap;

use crate::devices::{IoBus, SharedBus};
use crate::error::{Error, GuestFault, RegisterDump};
use crate::exit::{ExitContext, ExitError, Flow, Report, VcpuError, handle_exit};
use crate::irq::Interrupts;
use crate::irqchip::IrqChip;
use crate::kick;
use crate::mechanisms::Mechanisms;

/// What every vCPU thread of a VM shares.
pub struct VmShared {
    /// Guest memory.
    pub memory: GuestMemoryMmap,
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
    /// What the LAPIC timer threads did (wake-ups, spins, deliveries).
    pub timer_stats: Arc<TimerStats>,
    /// Device-bus lookups on exits, and their cost.
    pub bus_lookups: BusLookups,
    /// Drains the dirty rings when one is full (with a dirty ring only).
    pub ring_full: Option<dirty_log::RingFull>,
    /// The floor on a periodic LAPIC timer's period, ns (KVM's
    /// `min_timer_period_us`).
    pub min_timer_period_ns: u64,
    /// Set before kicking the vCPUs to make them stop.
    stop: AtomicBool,
}

impl VmShared {
    /// State for a VM.
    pub fn new(
        memory: GuestMemoryMmap,
        bus: SharedBus,
        domain: Arc<Domain>,
        irqs: Arc<Interrupts>,
        mechanisms: Mechanisms,
    ) -> Self {
        Self {
            memory,
            bus,
            domain,
            irqs,
            mechanisms,
            halt_stats: Arc::default(),
            timer_stats: Arc::default(),
            bus_lookups: BusLookups::default(),
            ring_full: None,
            min_timer_period_ns: lapic_timer::KVM_MIN_TIMER_PERIOD_NS,
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
/// (including the device's handling).
#[derive(Debug, Default)]
pub struct BusLookups {
    /// Lookups.
    pub count: std::sync::atomic::AtomicU64,
    /// TSC ticks in them.
    pub ticks: std::sync::atomic::AtomicU64,
}

impl BusLookups {
    fn record(&self, ticks: u64) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.ticks.fetch_add(ticks, Ordering::Relaxed);
    }
}

/// How a vCPU's run ended, and what its guest program reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VcpuSummary {
    /// vCPU index.
    pub index: u32,
    /// Whether the program finished (ucall done) rather than being stopped.
    pub finished: bool,
    /// Exits handled.
    pub exits: u64,
    /// Named values the program reported, in order.
    pub reports: Vec<Report>,
}

/// One vCPU and the loop that runs it.
pub struct VcpuRunner {
    index: u32,
    fd: VcpuFd,
    shared: Arc<VmShared>,
    exits: u64,
    reports: Vec<Report>,
}

/// Unregisters the vCPU thread from kicks however the loop ends.
struct Registered<'a>(&'a Interrupts, usize);

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.0.unregister_thread(self.1);
    }
}

impl VcpuRunner {
    /// A runner for vCPU `index`, whose registers are already set.
    pub fn new(index: u32, fd: VcpuFd, shared: Arc<VmShared>) -> Self {
        Self {
            index,
            fd,
            shared,
            exits: 0,
            reports: Vec::new(),
        }
    }

    /// Runs the vCPU on the calling thread, its local APIC in `C`, until its
    /// program finishes, it is stopped, or something goes wrong.
    pub fn run<C: IrqChip>(mut self) -> Result<VcpuSummary, Error> {
        kick::prepare_vcpu_thread(&self.fd)?;
        // A hybrid halt-poll sleep must end when planned, not up to the default
        // 50 µs of timer slack later. Without it the sleeps only end late.
        let _ = set_timer_slack(Duration::from_nanos(1));
        let shared = self.shared.clone();
        let vcpu = self.index as usize;
        shared.irqs.register_thread(vcpu);
        let _registered = Registered(&shared.irqs, vcpu);
        let mut chip = C::start(&self.fd, self.index, &shared)?;
        let mut reader = shared.domain.register_reader();
        loop {
            if shared.stop_requested() {
                return Ok(self.summary(false));
            }
            // Published before looking for work (see `crate::irq`): a post
            // from here on either is seen by `prepare_entry` or kicks, and a
            // kick sent before `KVM_RUN` makes it return at once.
            chip.entering_guest();
            chip.prepare_entry(&mut self.fd)?;
            match self.run_once(&mut chip, &mut reader) {
                Ok(Flow::Continue | Flow::Halted) => {}
                Ok(Flow::Kicked) => kick::acknowledge()?,
                Ok(Flow::Done) => return Ok(self.summary(true)),
                Err(e) => return Err(self.exit_error(e)),
            }
        }
    }

    /// One `KVM_RUN`, offline for RCU, and the handling of its exit.
    fn run_once<C: IrqChip>(
        &mut self,
        chip: &mut C,
        reader: &mut Reader,
    ) -> Result<Flow, ExitError> {
        let shared = self.shared.clone();
        let exit = if shared.mechanisms.extended_qs {
            reader.offline();
            let exit = self.fd.run();
            reader.online();
            exit
        } else {
            let exit = self.fd.run();
            reader.quiescent();
            exit
        };
        chip.left_guest();
        let exit = match exit {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR => return Ok(Flow::Kicked),
            Err(source) => return Err(VcpuError::Run(source).into()),
        };
        self.exits += 1;
        let mut ctx = VcpuExits {
            shared: &shared,
            chip: &mut *chip,
            reader,
            reports: &mut self.reports,
        };
        match handle_exit(exit, &mut ctx)? {
            Flow::Halted if self.fd.get_kvm_run().if_flag == 0 => {
                Err(GuestFault::HaltedForever.into())
            }
            Flow::Halted => {
                chip.halt();
                Ok(Flow::Continue)
            }
            flow => Ok(flow),
        }
    }

    fn summary(self, finished: bool) -> VcpuSummary {
        VcpuSummary {
            index: self.index,
            finished,
            exits: self.exits,
            reports: self.reports,
        }
    }

    fn exit_error(&self, e: ExitError) -> Error {
        match e {
            ExitError::Guest(fault) => Error::Guest {
                vcpu: self.index,
                fault,
                registers: RegisterDump(
                    self.fd
                        .get_regs()
                        .and_then(|r| Ok(Box::new((r, self.fd.get_sregs()?)))),
                ),
            },
            ExitError::Device { port, source } => Error::Device {
                vcpu: self.index,
                port,
                source,
            },
            ExitError::Vcpu(source) => Error::Vcpu {
                vcpu: self.index,
                source,
            },
        }
    }
}

/// The run loop's side of [`handle_exit`]: the vCPU's interrupt controller,
/// its RCU reader for the bus, and the VM's memory, reports and dirty rings.
struct VcpuExits<'a, C> {
    shared: &'a VmShared,
    chip: &'a mut C,
    reader: &'a Reader,
    reports: &'a mut Vec<Report>,
}

impl<C: IrqChip> ExitContext for VcpuExits<'_, C> {
    type Memory = GuestMemoryMmap;

    fn memory(&self) -> &GuestMemoryMmap {
        &self.shared.memory
    }

    fn reports(&mut self) -> &mut Vec<Report> {
        self.reports
    }

    /// Times the lookup and the device's handling, for `bench rcu`.
    fn with_bus<R>(&mut self, f: impl FnOnce(&IoBus) -> R) -> R {
        let start = rdtsc();
        let result = self.shared.bus.with(self.reader, f);
        self.shared.bus_lookups.record(rdtsc().wrapping_sub(start));
        result
    }

    fn read_msr(&mut self, index: u32) -> Option<u64> {
        self.chip.read_msr(index)
    }

    fn write_msr(&mut self, index: u32, value: u64) -> bool {
        self.chip.write_msr(index, value)
    }

    fn read_apic_mmio(&mut self, addr: u64, data: &mut [u8]) -> bool {
        self.chip.read_apic_mmio(addr, data)
    }

    fn write_apic_mmio(&mut self, addr: u64, data: &[u8]) -> bool {
        self.chip.write_apic_mmio(addr, data)
    }

    fn waiting(&mut self) {
        self.chip.waiting();
    }

    fn yield_to(&mut self, target: usize) {
        self.chip.yield_to(target);
    }

    fn dirty_ring_full(&mut self) -> Result<(), VcpuError> {
        let rings = self
            .shared
            .ring_full
            .as_ref()
            .ok_or(VcpuError::NoDirtyRing)?;
        rings.drain().map_err(VcpuError::DrainDirtyRing)
    }
}
