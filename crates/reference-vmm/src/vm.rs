//! A VM: guest memory with the boot structures, vCPUs, devices, and a run.

use std::fmt;
use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::bitmap::AtomicBitmap;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use crate::apic::{MSR_APIC_BASE, MSR_TSC_DEADLINE};
use crate::devices::{
    BoundedOutput, IoBus, OUTPUT_BUFFER_BYTES, POST_PORT, PostCode, SerialConsole, SharedBus,
};
use crate::error::{ConfigError, Error};
use crate::irq::Interrupts;
use crate::irqchip::{self, KernelIrqChip, TunerThread, UserIrqChip};
use crate::kick;
use crate::mechanisms::{HaltPoll, Irqchip, Mechanisms};
use crate::migration::{ChipState, StateSupport, VcpuState, VmDescription};
use crate::pause::{Decision, PauseError};
use crate::shared::VmShared;
use crate::stop::{DEFAULT_TIMEOUT, OUTPUT_GRACE, STOP_GRACE, StopHandle, StopReason};
use crate::vcpu::{VcpuRunner, VcpuSummary};
use test_guests::GuestProgram;
use test_guests::Report;
use test_guests::abi::SERIAL_PORT;
use test_guests::abi::note_migration_ended;
use test_guests::boot_memory;
use test_guests::layout::*;
use test_guests::layout::{check_mem_mib, check_vcpus};
use test_guests::pvh::Image;
use test_guests::x86::boot::{
    VcpuBootInfo, advertise_apic_features, entry_regs, long_mode_sregs, pvh_regs, pvh_sregs,
    set_apic_id,
};
use test_guests::x86::gdt::build_gdt;
use test_guests::x86::idt::IDT_SIZE;

/// Guest memory as this VMM maps it: vm-memory's mmap regions with a
/// dirty bitmap of the VMM's own writes, which a migration's dirty log merges
/// with KVM's.
pub type VmMemory = GuestMemoryMmap<AtomicBitmap>;

/// How to build a VM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmConfig {
    /// Number of vCPUs, 1 to [`MAX_VCPUS`].
    pub vcpus: u32,
    /// Guest memory in MiB: even, [`MIN_MEM_MIB`] to [`MAX_MEM_MIB`].
    pub mem_mib: u64,
    /// Stop every vCPU and fail if the guest has not finished by then; `None`:
    /// the watchdog, [`DEFAULT_TIMEOUT`]. A program that runs until it is
    /// stopped needs one given.
    pub timeout: Option<Duration>,
    /// The floor on a periodic LAPIC timer's period (KVM's
    /// `min_timer_period_us`; the userspace APIC only).
    pub min_timer_period: Duration,
    /// The latency mechanisms on the exit path.
    pub mechanisms: Mechanisms,
    /// The guest program's parameters (in the shared page).
    pub params: [u64; PARAMS],
    /// A dirty ring of this many bytes per vCPU (enabled before the vCPUs
    /// exist, as KVM requires).
    pub dirty_ring: Option<u32>,
    /// How the vCPUs start.
    pub boot: Boot,
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
    /// From a migration stream or a snapshot ([`crate::migration`]): nothing
    /// is written at creation; memory and the vCPUs' state come from the
    /// stream, and [`Vm::set_incoming`] before the run.
    Incoming,
}

impl Default for VmConfig {
    fn default() -> Self {
        Self {
            vcpus: 1,
            mem_mib: 64,
            timeout: None,
            min_timer_period: Duration::from_nanos(lapic_timer::KVM_MIN_TIMER_PERIOD_NS),
            mechanisms: Mechanisms::default(),
            params: [0; PARAMS],
            dirty_ring: None,
            boot: Boot::Direct,
        }
    }
}

/// The outcome of a run that finished.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RunReport {
    /// The guest program that ran.
    pub guest: &'static str,
    /// Each vCPU's summary, by index.
    pub vcpus: Vec<VcpuSummary>,
    /// Wall time from starting the first vCPU to the last one finishing.
    pub elapsed: Duration,
    /// What the mechanisms did.
    pub stats: VmStats,
    /// Whether the VM was handed over to a migration's destination (its
    /// vCPUs then stopped here, unfinished).
    pub handed_over: bool,
}

/// What the mechanisms did during a run, summed over the vCPUs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct VmStats {
    /// Time halted vCPU threads spent polling, ns (halt-poll).
    pub polled_ns: u64,
    /// Of which in polls that ended in a block (the wake-up came later), ns.
    pub failed_poll_ns: u64,
    /// Time halted vCPU threads spent blocked, ns.
    pub blocked_ns: u64,
    /// Halts that ended while polling.
    pub successful_polls: u64,
    /// Halts whose plan had a poll window (polled, or blocked at once
    /// because the CPU was contended).
    pub attempted_polls: u64,
    /// Interrupts posted to vCPUs.
    pub interrupts: u64,
    /// Kicks of vCPUs in the guest.
    pub kicks: u64,
    /// Wake-ups of halted vCPUs.
    pub wakes: u64,
    /// Boosts of vCPU threads (vcpu-sched).
    pub boosts: u64,
    /// The longest of them, ns.
    pub longest_boost_ns: u64,
    /// Directed yields attempted (KVM's `directed_yield_attempted`).
    pub directed_yield_attempted: u64,
    /// Guest output bytes that never reached the output: dropped when the
    /// buffer was full, or still buffered when the run ended, because the
    /// output blocked (a pipe nobody reads, say).
    pub output_lost: u64,
    /// Device-bus lookups on exits.
    pub bus_lookups: u64,
    /// TSC ticks spent in them (with the device's handling).
    pub bus_lookup_ticks: u64,
    /// LAPIC timer expiries delivered by the userspace APIC.
    pub timer_expiries: u64,
    /// Time vCPU threads spun to their timers' targets, ns (the advance's CPU).
    pub timer_spin_ns: u64,
    /// The median of the userspace APIC's timer deliveries, from delivery
    /// start to the guest's interrupt entry, whole µs (`None`: none measured).
    pub timer_delivery_p50_us: Option<u64>,
    /// The 99th percentile of how late the userspace APIC's timer deliveries
    /// started after their targets (the advance's own miss), as the upper
    /// edge of its power-of-two bucket, ns (`None`: none delivered).
    pub timer_start_p99_ns: Option<u64>,
    /// KVM's halt-polling window, ns, as `--halt-poll tuned` set it last
    /// (`None`: not tuned, or too few halts to set one).
    pub tuned_window_ns: Option<u64>,
}

impl VmStats {
    fn collect(shared: &VmShared) -> Self {
        let (h, i) = (&shared.halt_stats, &shared.irqs.stats);
        let s = shared.irqs.scheduler().events();
        Self {
            polled_ns: h.halt_poll_success_ns.load(Relaxed) + h.halt_poll_fail_ns.load(Relaxed),
            failed_poll_ns: h.halt_poll_fail_ns.load(Relaxed),
            blocked_ns: h.halt_wait_ns.load(Relaxed),
            successful_polls: h.halt_successful_poll.load(Relaxed),
            attempted_polls: h.halt_attempted_poll.load(Relaxed),
            interrupts: i.posted.load(Relaxed),
            kicks: i.kicks.load(Relaxed),
            wakes: i.wakes.load(Relaxed),
            boosts: s.boosts.load(Relaxed),
            longest_boost_ns: s.longest_boost_ns.load(Relaxed),
            directed_yield_attempted: s.directed_yield_attempted.load(Relaxed),
            output_lost: 0,
            bus_lookups: shared.bus_lookups.count.load(Relaxed),
            bus_lookup_ticks: shared.bus_lookups.ticks.load(Relaxed),
            timer_expiries: shared.timer_stats.wakeups.load(Relaxed),
            timer_spin_ns: shared.timer_stats.spin_ns.load(Relaxed),
            timer_delivery_p50_us: shared.timer_delivery.median_us(),
            timer_start_p99_ns: p99_bucket_edge(&shared.timer_stats.lateness_hist),
            tuned_window_ns: None,
        }
    }
}

/// The bucket of `hist` that holds its `num / den` quantile (`None` for an
/// empty one).
pub(crate) fn bucket_holding(hist: &[AtomicU64], num: u64, den: u64) -> Option<usize> {
    let counts: Vec<u64> = hist.iter().map(|c| c.load(Relaxed)).collect();
    let total: u64 = counts.iter().sum();
    let mut below = 0;
    counts.iter().position(|&c| {
        below += c;
        c > 0 && below.saturating_mul(den) >= total.saturating_mul(num)
    })
}

/// The upper edge, ns, of the power-of-two bucket (bucket `i`: below `2^i`
/// ns) that holds the 99th percentile of `hist`; `None` for an empty one.
fn p99_bucket_edge(hist: &[AtomicU64]) -> Option<u64> {
    let bucket = bucket_holding(hist, 99, 100)?;
    Some(1u64.checked_shl(bucket as u32).unwrap_or(u64::MAX))
}

impl RunReport {
    /// The first value called `name` that vCPU `vcpu` reported.
    pub fn value(&self, vcpu: u32, name: &str) -> Option<u64> {
        let summary = self.vcpus.iter().find(|s| s.index == vcpu)?;
        summary
            .reports
            .iter()
            .find(|r| r.name == name)
            .map(|r| r.value)
    }
}

impl fmt::Display for RunReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stopped = self.vcpus.iter().filter(|s| !s.finished).count();
        write!(f, "guest {}: {} vCPU(s) ", self.guest, self.vcpus.len())?;
        match stopped {
            _ if self.handed_over => write!(f, "ran {:.3?}, then handed over", self.elapsed)?,
            0 => write!(f, "finished in {:.3?}", self.elapsed)?,
            n => write!(f, "ran {:.3?}, {n} stopped before finishing", self.elapsed)?,
        }
        for s in &self.vcpus {
            write!(f, "\n  vcpu {}: {} exits", s.index, s.exits)?;
            for Report { name, value } in &s.reports {
                write!(f, ", {name} = {value}")?;
            }
        }
        let st = &self.stats;
        write!(
            f,
            "\n  halts: {:.3} ms polling ({} ended while polling; {:.3} ms in polls that \
             failed), {:.3} ms blocked; {} interrupts, {} kicks, {} wakes, {} boosts",
            st.polled_ns as f64 / 1e6,
            st.successful_polls,
            st.failed_poll_ns as f64 / 1e6,
            st.blocked_ns as f64 / 1e6,
            st.interrupts,
            st.kicks,
            st.wakes,
            st.boosts,
        )?;
        if let Some(ns) = st.tuned_window_ns {
            write!(
                f,
                "\n  KVM's halt-polling window, as last tuned: {:.1} µs",
                ns as f64 / 1e3
            )?;
        }
        if st.output_lost > 0 {
            write!(
                f,
                "\n  guest output: {} byte(s) never written (the output blocked)",
                st.output_lost
            )?;
        }
        Ok(())
    }
}

/// What a controller started beside the run does ([`Vm::on_start`]).
pub type Controller = Box<dyn FnOnce(&RunControl) + Send>;

/// A VM ready to run a guest program: memory, boot structures and vCPUs set up.
pub struct Vm {
    vcpus: Vec<VcpuFd>,
    vm: Arc<VmFd>,
    memory: VmMemory,
    timeout: Option<Duration>,
    min_timer_period: Duration,
    stop: StopHandle,
    params: [u64; PARAMS],
    boot: Boot,
    mechanisms: Mechanisms,
    devices: Vec<(u16, u16, Arc<dyn crate::devices::PioDevice>)>,
    domain: Arc<rcu_qs::Domain>,
    ring_full: Option<dirty_log::RingFull>,
    mem_mib: u64,
    state_support: Arc<StateSupport>,
    controller: Option<Controller>,
    /// Each vCPU's interrupt controller state and halt, from a stream.
    incoming: Option<Vec<(ChipState, bool)>>,
}

impl Vm {
    /// Creates the VM on `/dev/kvm`.
    pub fn new(config: &VmConfig) -> Result<Self, Error> {
        let m = config.mechanisms;
        if m.halt_poll == HaltPoll::Tuned && m.irqchip == Irqchip::User {
            return Err(ConfigError::TunedNeedsKernelIrqchip.into());
        }
        let (vcpus, mem_mib, params) = match &config.boot {
            Boot::Direct | Boot::Incoming => (config.vcpus, config.mem_mib, config.params),
            Boot::Image(image) => (image.vcpus(), image.mem_mib(), image.params()),
        };
        let kvm = Kvm::new().map_err(Error::OpenKvm)?;
        let kvm_max = u32::try_from(kvm.get_max_vcpus()).unwrap_or(u32::MAX);
        let vcpus = check_vcpus(vcpus, kvm_max).map_err(ConfigError::from)?;
        let mem_size = check_mem_mib(mem_mib).map_err(ConfigError::from)? << 20;
        let vm = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        if let Some(bytes) = config.dirty_ring {
            dirty_log::enable_dirty_ring(&vm, bytes)?;
        }
        let memory = VmMemory::from_ranges(&[(GuestAddress(0), mem_size as usize)])
            .map_err(Error::AllocateMemory)?;
        register_memory(&vm, &memory)?;
        match config.mechanisms.irqchip {
            Irqchip::User => route_apic_msrs_to_userspace(&vm)?,
            Irqchip::Kernel => {
                vm.create_irq_chip()
                    .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
                irqchip::set_window(&vm, config.mechanisms.halt_poll.kvm_window())?;
            }
        }
        match &config.boot {
            Boot::Direct => write_boot_structures(&memory, vcpus, mem_size)?,
            Boot::Image(image) => {
                image.load(&memory)?;
            }
            Boot::Incoming => {}
        }
        if config.boot != Boot::Incoming {
            write_params(&memory, &params)?;
        }
        let state_support = Arc::new(StateSupport::query(&kvm)?);
        let cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
        let vcpu_fds = (0..vcpus)
            .map(|i| create_vcpu(&vm, &cpuid, i, vcpus, config))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            vcpus: vcpu_fds,
            vm: Arc::new(vm),
            memory,
            timeout: config.timeout,
            min_timer_period: config.min_timer_period,
            stop: StopHandle::default(),
            params,
            boot: config.boot.clone(),
            mechanisms: config.mechanisms,
            devices: Vec::new(),
            domain: Arc::new(rcu_qs::Domain::new()),
            ring_full: None,
            mem_mib,
            state_support,
            controller: None,
            incoming: None,
        })
    }

    /// Runs `controller` on a thread of its own once the vCPUs have started
    /// (a migration: [`crate::migration::Migration::run`]); the run waits for
    /// it before it returns.
    pub fn on_start(&mut self, controller: Controller) {
        self.controller = Some(controller);
    }

    /// Each vCPU's interrupt-controller state and whether it was halted, by
    /// index, for a VM created with [`Boot::Incoming`] whose KVM state is
    /// restored already ([`crate::migration::receive`]).
    pub fn set_incoming(&mut self, vcpus: Vec<(ChipState, bool)>) {
        self.incoming = Some(vcpus);
    }

    /// Guest memory, shared with the VM (for a scenario to read results).
    pub fn memory(&self) -> VmMemory {
        self.memory.clone()
    }

    /// Guest memory as dirty-log slots (region i as slot i), as this VM
    /// registered them: what a dirty-log backend tracks.
    pub fn dirty_slots(&self) -> Result<dirty_log::Slots<AtomicBitmap>, dirty_log::Error> {
        let slots = dirty_log::Slots::new(&self.memory)?;
        // SAFETY: `Vm::new` registered region i of this memory as slot i
        // (`register_memory`), and the VM and its vCPU threads keep it mapped.
        unsafe { slots.assume_registered() };
        Ok(slots)
    }

    /// The VM, for dirty logging.
    pub fn vm_fd(&self) -> Arc<VmFd> {
        self.vm.clone()
    }

    /// The vCPUs, for attaching dirty rings.
    pub fn vcpu_fds(&self) -> &[VcpuFd] {
        &self.vcpus
    }

    /// What vCPU threads do on `KVM_EXIT_DIRTY_RING_FULL`: drain the rings.
    pub fn set_ring_full(&mut self, handler: dirty_log::RingFull) {
        self.ring_full = Some(handler);
    }

    /// The RCU domain whose readers the vCPU threads will be: a writer may
    /// wait for grace periods on it while the VM runs.
    pub fn rcu_domain(&self) -> Arc<rcu_qs::Domain> {
        self.domain.clone()
    }

    /// A handle that stops the run from another thread (on a signal, say).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Adds `device` at ports `base..base + len` for the run.
    pub fn add_device(&mut self, base: u16, len: u16, device: Arc<dyn crate::devices::PioDevice>) {
        self.devices.push((base, len, device));
    }

    /// Runs `program` on every vCPU, each on its own thread, until all have
    /// finished, one fails, the timeout passes or a [`StopHandle`] asks.
    /// Serial output goes to `serial_out` through a bounded buffer, so a
    /// writer that blocks never holds a vCPU (see [`crate::devices::BoundedOutput`]).
    ///
    /// # Errors
    /// A stopped run is [`Error::Stopped`], with what the guest reported so
    /// far; a guest that misbehaves is [`Error::Guest`].
    pub fn run(
        mut self,
        program: &GuestProgram,
        serial_out: Box<dyn Write + Send>,
    ) -> Result<RunReport, Error> {
        let count = self.vcpus.len() as u32;
        let migrating = self.controller.is_some() || self.boot == Boot::Incoming;
        program
            .check_run(&self.params, count, self.mem_mib, self.timeout, migrating)
            .map_err(ConfigError::from)?;
        let entry = IMAGE_ADDR + program.entry_offset();
        for (i, fd) in (0..count).zip(&self.vcpus) {
            let regs = match &self.boot {
                Boot::Direct => entry_regs(entry, user_stack_top(i), i, count, vcpu_data(i)),
                Boot::Image(image) => pvh_regs(image.entry()),
                Boot::Incoming => continue,
            };
            fd.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
        }
        let mut incoming = match (&self.boot, self.incoming.take()) {
            (Boot::Incoming, states)
                if states.as_ref().is_none_or(|s| s.len() != count as usize) =>
            {
                return Err(ConfigError::NoIncomingState.into());
            }
            (_, states) => states.map(|s| s.into_iter().map(Some).collect::<Vec<_>>()),
        };
        if self.boot == Boot::Incoming {
            note_migration_ended(&self.memory).map_err(|source| Error::WriteMemory {
                what: "the migration count",
                source,
            })?;
        }
        let description = self.description(program);
        let (output, drain) =
            BoundedOutput::start(serial_out, OUTPUT_BUFFER_BYTES).map_err(|source| {
                Error::SpawnHelper {
                    thread: "output",
                    source,
                }
            })?;
        let mut io_bus = IoBus::new();
        io_bus
            .insert(
                SERIAL_PORT,
                8,
                Arc::new(SerialConsole::new(Box::new(output))),
            )
            .expect("the serial console is the first device on an empty bus");
        io_bus
            .insert(POST_PORT, 1, Arc::new(PostCode::default()))
            .expect("the POST-code port is free");
        for (base, len, device) in self.devices {
            io_bus
                .insert(base, len, device)
                .map_err(|e| Error::Config(e.into()))?;
        }
        let domain = self.domain;
        let bus = SharedBus::new(self.mechanisms.bus, io_bus, &domain);
        let irqs = Arc::new(Interrupts::new(
            count as usize,
            self.mechanisms.boost.policy(),
        ));
        let mut shared = VmShared::new(self.memory, bus, domain, irqs, self.mechanisms);
        shared.ring_full = self.ring_full;
        shared.state_support = self.state_support;
        shared.min_timer_period_ns = self.min_timer_period.as_nanos() as u64;
        let shared = Arc::new(shared);
        let tuner = match (self.mechanisms.irqchip, self.mechanisms.halt_poll) {
            (Irqchip::Kernel, HaltPoll::Tuned) => {
                Some(TunerThread::spawn(self.vm.clone(), &self.vcpus)?)
            }
            _ => None,
        };
        let start = Instant::now();
        let (tx, rx) = mpsc::channel();
        let mut threads = Vec::new();
        for (i, fd) in (0..count).zip(self.vcpus) {
            let mut runner = VcpuRunner::new(i, fd, shared.clone());
            if let Some((chip, halted)) = incoming
                .as_mut()
                .and_then(|v| v.get_mut(i as usize)?.take())
            {
                runner = runner.incoming(chip, halted);
            }
            let tx = tx.clone();
            let irqchip = self.mechanisms.irqchip;
            let spawned = thread::Builder::new()
                .name(format!("vcpu{i}"))
                .spawn(move || {
                    let summary = match irqchip {
                        Irqchip::User => runner.run::<UserIrqChip>(),
                        Irqchip::Kernel => runner.run::<KernelIrqChip>(),
                    };
                    tx.send((i, summary)).unwrap_or(())
                });
            match spawned {
                Ok(handle) => threads.push(handle),
                Err(source) => {
                    abandon(&shared, threads);
                    return Err(Error::SpawnThread { vcpu: i, source });
                }
            }
        }
        drop(tx);
        let controller = match self
            .controller
            .map(|c| spawn_controller(c, RunControl::new(shared.clone(), description)))
            .transpose()
        {
            Ok(controller) => controller,
            Err(e) => {
                abandon(&shared, threads);
                return Err(e);
            }
        };
        let timeout = self.timeout.unwrap_or(DEFAULT_TIMEOUT);
        let (mut vcpus, ending, answered) = collect(&rx, &shared, &threads, &self.stop, timeout);
        let elapsed = start.elapsed();
        if let Some(c) = controller {
            c.join().map_err(|_| Error::ThreadPanicked("migration"))?;
        }
        let tuned_window = tuner.map(TunerThread::finish).transpose();
        let unresponsive = join_or_leave(threads, &answered)?;
        let unwritten = drain.finish(OUTPUT_GRACE);
        if !unresponsive.is_empty() {
            return Err(Error::Unresponsive(unresponsive));
        }
        vcpus.sort_by_key(|s| s.index);
        let mut stats = VmStats::collect(&shared);
        stats.output_lost = drain.dropped() + unwritten;
        stats.tuned_window_ns = tuned_window?.flatten().map(|w| w.as_nanos() as u64);
        let report = RunReport {
            guest: program.name,
            vcpus,
            elapsed,
            stats,
            handed_over: shared.pause.handed_over(),
        };
        match ending {
            Ending::Finished => Ok(report),
            Ending::Stopped(reason) => Err(Error::Stopped {
                reason,
                partial: Box::new(report),
            }),
            Ending::Failed(e) => Err(e),
        }
    }
}

impl Vm {
    /// What a migration's destination needs to create this VM.
    fn description(&self, program: &GuestProgram) -> VmDescription {
        let tsc_khz = self
            .vcpus
            .first()
            .and_then(|fd| fd.get_tsc_khz().ok())
            .unwrap_or_else(|| lapic_timer::TscClock::shared().tsc_khz() as u32);
        VmDescription {
            program: program.name.to_owned(),
            vcpus: self.vcpus.len() as u32,
            mem_mib: self.mem_mib,
            params: self.params,
            mechanisms: self.mechanisms,
            min_timer_period_ns: self.min_timer_period.as_nanos() as u64,
            tsc_khz,
        }
    }
}

/// What a controller beside a run ([`Vm::on_start`]) can do with it.
pub struct RunControl {
    shared: Arc<VmShared>,
    description: VmDescription,
}

impl RunControl {
    fn new(shared: Arc<VmShared>, description: VmDescription) -> Self {
        Self {
            shared,
            description,
        }
    }

    /// What a destination needs to create the VM.
    pub fn description(&self) -> &VmDescription {
        &self.description
    }

    /// Waits up to `timeout`; returns early, with `true`, if a vCPU's run
    /// ended (its program finished or failed, or the run was stopped).
    pub fn wait_for_end(&self, timeout: Duration) -> bool {
        self.shared.pause.wait_for_end(timeout)
    }

    /// The first vCPU whose run ended (0 if none has).
    pub fn ended_vcpu(&self) -> u32 {
        self.shared.pause.first_ended().unwrap_or(0)
    }

    /// Pauses every vCPU and returns their states, by index. On an error
    /// the vCPUs that parked run on.
    pub fn pause(&self, timeout: Duration) -> Result<Vec<VcpuState>, PauseError> {
        self.shared.pause.request();
        self.shared.irqs.kick_all();
        self.shared.pause.wait_parked(timeout).inspect_err(|_| {
            self.shared.pause.decide(Decision::Resume);
        })
    }

    /// Resumes paused vCPUs.
    pub fn resume(&self) {
        self.shared.pause.decide(Decision::Resume);
    }

    /// Ends the paused vCPUs here: the VM runs elsewhere now.
    pub fn hand_over(&self) {
        self.shared.pause.decide(Decision::HandOver);
    }
}

fn spawn_controller(controller: Controller, control: RunControl) -> Result<JoinHandle<()>, Error> {
    thread::Builder::new()
        .name("migration".into())
        .spawn(move || controller(&control))
        .map_err(|source| Error::SpawnHelper {
            thread: "migration",
            source,
        })
}

/// How the vCPU threads' run ended.
enum Ending {
    /// Every vCPU finished its program.
    Finished,
    /// Stopped before that: the timeout passed or a stop was asked for.
    Stopped(StopReason),
    /// A vCPU failed (the first failure).
    Failed(Error),
}

/// How often the VMM looks at its [`StopHandle`] while the vCPUs run.
const STOP_POLL: Duration = Duration::from_millis(10);

/// Waits for every vCPU thread's result; at the first error, the timeout or
/// a requested stop, stops the others and waits [`STOP_GRACE`] for them.
/// Returns the summaries received, how the run ended, and which vCPUs
/// answered.
fn collect(
    rx: &mpsc::Receiver<(u32, Result<VcpuSummary, Error>)>,
    shared: &VmShared,
    threads: &[JoinHandle<()>],
    stop: &StopHandle,
    timeout: Duration,
) -> (Vec<VcpuSummary>, Ending, Vec<u32>) {
    let deadline = Instant::now() + timeout;
    let mut summaries = Vec::new();
    let mut ending = None;
    let mut stopped_at: Option<Instant> = None;
    let mut answered = Vec::new();
    loop {
        let now = Instant::now();
        let wait = match stopped_at {
            Some(at) => (at + STOP_GRACE).saturating_duration_since(now),
            None => STOP_POLL.min(deadline.saturating_duration_since(now)),
        };
        let failure = match rx.recv_timeout(wait) {
            Ok((i, Ok(summary))) => {
                answered.push(i);
                summaries.push(summary);
                continue;
            }
            Ok((i, Err(e))) => {
                answered.push(i);
                Ending::Failed(e)
            }
            // Stopped, and the grace is over: the threads left are stuck.
            Err(mpsc::RecvTimeoutError::Timeout) if stopped_at.is_some() => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let timed_out =
                    (Instant::now() >= deadline).then_some(StopReason::Timeout(timeout));
                match stop.requested().or(timed_out) {
                    Some(reason) => Ending::Stopped(reason),
                    None => continue,
                }
            }
            // Every thread has ended (one that panicked never sends).
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        };
        ending.get_or_insert(failure);
        if stopped_at.is_none() {
            stop_all(shared, threads);
            stopped_at = Some(Instant::now());
        }
    }
    (summaries, ending.unwrap_or(Ending::Finished), answered)
}

/// Joins the vCPU threads that answered or ended, and leaves the ones still
/// stuck (joining them would hang the VMM). Returns the indices of those
/// left, or the first thread that panicked.
fn join_or_leave(threads: Vec<JoinHandle<()>>, answered: &[u32]) -> Result<Vec<u32>, Error> {
    let mut left = Vec::new();
    let mut panicked = None;
    for (i, t) in (0u32..).zip(threads) {
        // Sending its answer is a thread's last act: it is on its way out.
        if answered.contains(&i) || t.is_finished() {
            if t.join().is_err() {
                panicked.get_or_insert(i);
            }
        } else {
            left.push(i);
        }
    }
    match panicked {
        Some(i) => Err(Error::VcpuPanicked(i)),
        None => Ok(left),
    }
}

/// Stops the vCPU threads started so far and waits for them: the run
/// cannot go on.
fn abandon(shared: &VmShared, threads: Vec<JoinHandle<()>>) {
    stop_all(shared, &threads);
    threads.into_iter().for_each(|t| t.join().unwrap_or(()));
}

fn stop_all(shared: &VmShared, threads: &[JoinHandle<()>]) {
    shared.request_stop();
    // Parked vCPUs (a migration in progress) go on, to their stop.
    shared.pause.decide(Decision::Resume);
    shared.irqs.wake_all();
    for t in threads {
        // A thread that already returned cannot be kicked and needs no kick.
        let _ = kick::kick(t);
    }
}

fn kvm_err(op: &'static str) -> impl Fn(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { op, source }
}

fn write_params(memory: &VmMemory, params: &[u64; PARAMS]) -> Result<(), Error> {
    let bytes: Vec<u8> = params.iter().flat_map(|p| p.to_le_bytes()).collect();
    memory
        .write_slice(&bytes, GuestAddress(SHARED_DATA_ADDR + PARAMS_OFFSET))
        .map_err(|source| Error::WriteMemory {
            what: "the program parameters",
            source,
        })
}

fn register_memory(vm: &VmFd, memory: &VmMemory) -> Result<(), Error> {
    let slots = dirty_log::Slots::new(memory).map_err(Error::RegisterMemory)?;
    // SAFETY: `memory` stays mapped as long as the VM can run: the Vm and
    // then the vCPU threads' shared state hold it.
    unsafe { slots.register(vm) }.map_err(Error::RegisterMemory)
}

/// Writes the GDT, page tables, guest image, and each vCPU's TSS and IDT.
fn write_boot_structures(memory: &VmMemory, vcpus: u32, mem_size: u64) -> Result<(), Error> {
    for segment in boot_memory::segments(vcpus, mem_size) {
        memory
            .write_slice(&segment.bytes, GuestAddress(segment.addr))
            .map_err(|source| Error::WriteMemory {
                what: segment.what,
                source,
            })?;
    }
    Ok(())
}

/// x2APIC MSRs exit to userspace as invalid (there is no in-kernel APIC);
/// IA32_TSC_DEADLINE and IA32_APIC_BASE, which KVM would otherwise handle or
/// drop, are denied by the MSR filter so that they exit too.
fn route_apic_msrs_to_userspace(vm: &VmFd) -> Result<(), Error> {
    use kvm_bindings::{
        KVM_CAP_X86_USER_SPACE_MSR, KVM_MSR_EXIT_REASON_FILTER, KVM_MSR_EXIT_REASON_INVAL,
        kvm_enable_cap,
    };
    use kvm_ioctls::{MsrFilterDefaultAction, MsrFilterRange, MsrFilterRangeFlags};
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_X86_USER_SPACE_MSR,
        ..Default::default()
    };
    cap.args[0] = u64::from(KVM_MSR_EXIT_REASON_INVAL | KVM_MSR_EXIT_REASON_FILTER);
    vm.enable_cap(&cap)
        .map_err(kvm_err("KVM_ENABLE_CAP(X86_USER_SPACE_MSR)"))?;
    let deny = [0u8];
    let range = |base| MsrFilterRange {
        flags: MsrFilterRangeFlags::READ | MsrFilterRangeFlags::WRITE,
        base,
        msr_count: 1,
        bitmap: &deny,
    };
    vm.set_msr_filter(
        MsrFilterDefaultAction::ALLOW,
        &[range(MSR_TSC_DEADLINE), range(MSR_APIC_BASE)],
    )
    .map_err(kvm_err("KVM_X86_SET_MSR_FILTER"))
}

fn create_vcpu(
    vm: &VmFd,
    cpuid: &kvm_bindings::CpuId,
    index: u32,
    count: u32,
    config: &VmConfig,
) -> Result<VcpuFd, Error> {
    let irqchip = config.mechanisms.irqchip;
    let fd = vm
        .create_vcpu(u64::from(index))
        .map_err(kvm_err("KVM_CREATE_VCPU"))?;
    if irqchip == Irqchip::Kernel {
        // KVM's LAPIC holds every vCPU but the first in wait-for-SIPI; these
        // guests start all vCPUs at their entry point, as the userspace one does.
        let runnable = kvm_bindings::kvm_mp_state {
            mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
        };
        fd.set_mp_state(runnable)
            .map_err(kvm_err("KVM_SET_MP_STATE"))?;
    }
    let mut cpuid = cpuid.clone();
    set_apic_id(&mut cpuid, index);
    advertise_apic_features(&mut cpuid);
    fd.set_cpuid2(&cpuid).map_err(kvm_err("KVM_SET_CPUID2"))?;
    let mut sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
    let gdt_len = build_gdt(count, tss_addr).len();
    let boot = VcpuBootInfo {
        index,
        gdt: (GDT_ADDR, (gdt_len - 1) as u16),
        idt: (idt_addr(index), (IDT_SIZE - 1) as u16),
        tss: tss_addr(index),
        cr3: PML4_ADDR,
    };
    match config.boot {
        Boot::Direct | Boot::Incoming => long_mode_sregs(&mut sregs, &boot),
        Boot::Image(_) => pvh_sregs(&mut sregs, boot.gdt),
    }
    fd.set_sregs(&sregs).map_err(kvm_err("KVM_SET_SREGS"))?;
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_p99_bucket_is_the_upper_edge_of_the_one_holding_it() {
        let hist: Vec<AtomicU64> = (0..32).map(|_| AtomicU64::new(0)).collect();
        assert_eq!(p99_bucket_edge(&hist), None);
        hist[0].store(98, Relaxed); // on time
        hist[13].store(1, Relaxed); // [4096, 8192) ns
        hist[15].store(1, Relaxed); // [16384, 32768) ns
        assert_eq!(p99_bucket_edge(&hist), Some(8192));
        hist[15].store(2, Relaxed);
        assert_eq!(p99_bucket_edge(&hist), Some(32768));
    }

    #[test]
    fn threads_that_answered_are_joined_and_stuck_ones_left_and_named() {
        let (release, stuck) = mpsc::channel::<()>();
        let threads = vec![
            thread::spawn(|| {}),
            thread::spawn(move || stuck.recv().unwrap_or(())),
            thread::spawn(|| panic!("a VMM bug")),
        ];
        while !threads[2].is_finished() {
            thread::yield_now();
        }
        // vCPU 0 answered; 1 is stuck (it never will); 2 panicked silently.
        assert!(matches!(
            join_or_leave(threads, &[0]),
            Err(Error::VcpuPanicked(2))
        ));
        let (release2, stuck2) = mpsc::channel::<()>();
        let threads = vec![
            thread::spawn(|| {}),
            thread::spawn(move || stuck2.recv().unwrap_or(())),
        ];
        assert_eq!(join_or_leave(threads, &[0]).unwrap(), vec![1]);
        release.send(()).unwrap();
        release2.send(()).unwrap();
    }

    #[test]
    fn report_finds_values_by_vcpu_and_name() {
        let report = RunReport {
            guest: "hello",
            vcpus: vec![VcpuSummary {
                index: 1,
                finished: true,
                exits: 3,
                reports: vec![Report {
                    name: "apic_id".into(),
                    value: 1,
                }],
            }],
            elapsed: Duration::from_millis(2),
            stats: VmStats::default(),
            handed_over: false,
        };
        assert_eq!(report.value(1, "apic_id"), Some(1));
        assert_eq!(report.value(0, "apic_id"), None);
        assert!(report.to_string().contains("vcpu 1: 3 exits, apic_id = 1"));
    }
}
