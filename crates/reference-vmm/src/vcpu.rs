//! A vCPU thread's run loop, where the five mechanisms meet on the exit path.
//!
//! ```text
//! loop {
//!     stop requested?  -> finish                  (set by the VMM before a kick)
//!     run state = in guest                       (vcpu-sched; before any look for work)
//!     timer expired?   -> spin to the deadline, fire the LVT timer (lapic-timer)
//!     inject the highest deliverable interrupt, or ask for an interrupt window
//!     offline; exit = KVM_RUN; online            (rcu-qs: the guest is a quiescent state)
//!     run state = in the VMM; boost policy: ran
//!     x2APIC / TSC-deadline MSR  -> the local APIC (IPIs to the others, timer re-armed)
//!     HLT                        -> wait through the halt poller until work arrives (halt-poll)
//!     port I/O                   -> the device bus, read through RCU (or a lock, as chosen)
//!     kick (EINTR)               -> acknowledge, look again
//! }
//! ```
//! Kicks follow the strategy described in [`crate::kick`]; delivery to other
//! vCPUs, and the handshake that orders the run state before every look for
//! work, is [`crate::irq`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use halt_poll::{
    FutexWake, HaltPoller, HaltStats, MonotonicClock as MonotonicPoll, PollPolicy, set_timer_slack,
};
use kvm_bindings::kvm_interrupt;
use kvm_ioctls::VcpuFd;
use lapic_timer::time::rdtsc;
use lapic_timer::{Clock, GuestTime, MonotonicClock, SpinAt, TimerStats, TimerThread, TscClock};
use rcu_qs::{Domain, Reader};
use std::time::Duration;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::ioctl::ioctl_with_ref;

use crate::apic::{Action, LocalApic, XAPIC_BASE, XAPIC_SIZE};
use crate::devices::{IoBus, SharedBus};
use crate::error::{Error, GuestFault, RegisterDump};
use crate::exit::{ExitContext, ExitError, Flow, Report, VcpuError, handle_exit};
use crate::guest_abi::{GuestPoll, TimerLead};
use crate::irq::{Interrupts, WAKE_INTERRUPT, WAKE_TIMER};
use crate::kick;
use crate::layout::{irq_record, mailbox};
use crate::mechanisms::{HaltPoll, Mechanisms};

// The halt poller keeps one policy per wake source: policy `i` learns from
// the halts that source `i` (bit `i` of the events) ended.
const _: () = assert!(WAKE_INTERRUPT == 0 && WAKE_TIMER == 1);

/// The vCPU ioctl this needs that kvm-ioctls does not wrap.
mod ioctls {
    use kvm_bindings::{KVMIO, kvm_interrupt};
    vmm_sys_util::ioctl_iow_nr!(KVM_INTERRUPT, KVMIO, 0x86, kvm_interrupt);
}

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

    fn stop_requested(&self) -> bool {
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

/// The per-thread pieces of the loop.
struct Loop {
    clock: GuestClock,
    guest_poll: Option<GuestPoll>,
    apic: LocalApic,
    timer: TimerThread,
    lead: TimerLead,
    poller: HaltPoller<Box<dyn PollPolicy + Send>, Arc<FutexWake>, MonotonicPoll, Arc<HaltStats>>,
    reader: Reader,
}

impl Loop {
    /// Whether the LVT timer's delivery is due already (its deadline is
    /// within the lead of now): a deadline the guest wrote in the past, or
    /// one that came due while the vCPU ran. The vCPU thread fires it itself
    /// at entry, as KVM fires a past TSC deadline at once instead of arming
    /// an hrtimer, rather than through a timer-thread wake-up and a kick.
    /// (Deadlines just ahead still go through the timer thread, whose wake-ups
    /// the advance learns from.)
    /// The clock is read only when a deadline is armed: this runs before
    /// every entry.
    fn due_now(&mut self) -> bool {
        let lead = self.lead.current().as_nanos() as u64;
        self.apic
            .timer()
            .next_expiry_ns()
            .is_some_and(|at| at <= MonotonicClock.now_ns().saturating_add(lead))
    }

    /// Refreshes the guest-time mapping of the timer and the lead from a
    /// fresh (TSC, clock) pair, before a deadline is armed or checked.
    fn reanchor(&mut self) {
        let time = self.clock.now();
        self.apic.timer().set_guest_time(time);
        self.lead.set_guest_time(time);
    }
}

/// The guest's TSC against the host's `CLOCK_MONOTONIC`: the frequency KVM
/// gives the guest (`KVM_GET_TSC_KHZ`) and the offset between guest and
/// host TSC, read once; [`GuestClock::now`] pairs a fresh TSC reading with the
/// clock, so conversions never drift far from an anchor.
struct GuestClock {
    tsc_khz: u64,
    offset: i64,
}

impl GuestClock {
    fn new(fd: &VcpuFd) -> Self {
        const IA32_TSC: u32 = 0x10;
        let tsc_khz = fd
            .get_tsc_khz()
            .map(u64::from)
            .unwrap_or_else(|_| TscClock::shared().tsc_khz());
        let mut msrs = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index: IA32_TSC,
            ..Default::default()
        }])
        .expect("one entry fits");
        let offset = match fd.get_msrs(&mut msrs) {
            Ok(1) => msrs.as_slice()[0].data.wrapping_sub(rdtsc()) as i64,
            _ => 0,
        };
        Self { tsc_khz, offset }
    }

    fn now(&self) -> GuestTime {
        GuestTime {
            tsc_khz: self.tsc_khz,
            ns: MonotonicClock.now_ns(),
            tsc_at_ns: rdtsc().wrapping_add_signed(self.offset),
        }
    }
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

    fn vcpu(&self) -> usize {
        self.index as usize
    }

    /// Runs the vCPU on the calling thread until its program finishes, it is
    /// stopped, or something goes wrong.
    pub fn run(mut self) -> Result<VcpuSummary, Error> {
        kick::prepare_vcpu_thread(&self.fd)?;
        // A hybrid halt-poll sleep must end when planned, not up to the default
        // 50 µs of timer slack later. Without it the sleeps only end late.
        let _ = set_timer_slack(Duration::from_nanos(1));
        let shared = self.shared.clone();
        let irqs = &shared.irqs;
        irqs.register_thread(self.vcpu());
        let _registered = Registered(irqs, self.vcpu());
        let mut l = self.start_loop()?;
        loop {
            if shared.stop_requested() {
                return Ok(self.summary(false));
            }
            // Published before looking for work (see `crate::irq`): a post
            // from here on either is seen by `prepare_entry` or kicks, and a
            // kick sent before `KVM_RUN` makes it return at once.
            irqs.scheduler().entering_guest(self.vcpu());
            self.prepare_entry(&mut l)?;
            let flow = self.run_once(&mut l);
            match flow {
                // `run_once` waits out a halt itself.
                Ok(Flow::Continue | Flow::Halted) => {}
                Ok(Flow::Kicked) => kick::acknowledge()?,
                Ok(Flow::Done) => return Ok(self.summary(true)),
                Err(e) => return Err(self.exit_error(e)),
            }
        }
    }

    fn start_loop(&self) -> Result<Loop, Error> {
        let clock = GuestClock::new(&self.fd);
        let time = clock.now();
        let m = self.shared.mechanisms;
        let sink = self.shared.irqs.timer_sink(self.vcpu());
        let timer = TimerThread::start(
            m.timer_advance.policy(clock.tsc_khz),
            sink,
            self.shared.timer_stats.clone(),
            SpinAt::Receiver,
        )
        .map_err(|source| Error::SpawnThread {
            vcpu: self.index,
            source,
        })?;
        let policies = m.halt_poll_per_source().map(HaltPoll::policy).into();
        let poller = HaltPoller::with_policies(self.shared.irqs.wake_source(self.vcpu()), policies)
            .with_events(self.shared.halt_stats.clone());
        Ok(Loop {
            apic: LocalApic::new(self.index, time)
                .with_min_timer_period_ns(self.shared.min_timer_period_ns),
            timer,
            lead: TimerLead::new(time, irq_record(self.index)),
            guest_poll: m
                .guest_poll
                .then(|| GuestPoll::new(m.halt_poll.policy(), mailbox(self.index), clock.tsc_khz)),
            clock,
            poller,
            reader: self.shared.domain.register_reader(),
        })
    }

    /// Before entry: fire a due timer (spinning to its exact deadline first),
    /// then inject the highest deliverable interrupt or ask for a window.
    fn prepare_entry(&mut self, l: &mut Loop) -> Result<(), Error> {
        let irqs = &self.shared.irqs;
        let vcpu = self.vcpu();
        if let Some(expiry) = irqs.take_timer(vcpu) {
            l.timer.receive(&expiry);
            fire_timer(irqs, vcpu, l);
        } else if l.due_now() {
            fire_timer(irqs, vcpu, l);
        }
        let pending = irqs.pending(vcpu);
        let deliverable = l.apic.deliverable(&pending);
        let run = self.fd.get_kvm_run();
        let can_inject = run.ready_for_interrupt_injection != 0 && run.if_flag != 0;
        run.request_interrupt_window = u8::from(deliverable.is_some() && !can_inject);
        if let (Some(vector), true) = (deliverable, can_inject) {
            let arg = kvm_interrupt {
                irq: u32::from(vector),
            };
            // SAFETY: a vCPU fd and a kvm_interrupt that lives for the call,
            // which only reads it; the result is checked.
            let ret = unsafe { ioctl_with_ref(&self.fd, ioctls::KVM_INTERRUPT(), &arg) };
            if ret != 0 {
                return Err(Error::Kvm {
                    op: "KVM_INTERRUPT",
                    source: vmm_sys_util::errno::Error::last(),
                });
            }
            irqs.take(vcpu, vector);
            l.apic.start_service(vector);
            l.lead.injected(vector, &self.shared.memory);
            // More pending: come back as soon as the guest can take one.
            self.fd.get_kvm_run().request_interrupt_window = u8::from(irqs.pending(vcpu) != [0; 4]);
        }
        Ok(())
    }

    /// One `KVM_RUN`, offline for RCU and with the run state published, and
    /// the handling of its exit.
    fn run_once(&mut self, l: &mut Loop) -> Result<Flow, ExitError> {
        let shared = self.shared.clone();
        let (irqs, vcpu) = (&shared.irqs, self.vcpu());
        let exit = if shared.mechanisms.extended_qs {
            l.reader.offline();
            let exit = self.fd.run();
            l.reader.online();
            exit
        } else {
            let exit = self.fd.run();
            l.reader.quiescent();
            exit
        };
        // It ran: the policy undoes what it did for it (a boost ends).
        irqs.scheduler().left_guest(vcpu);
        if let Some(lead) = l.lead.learn(&shared.memory) {
            l.timer.set_lead(lead);
        }
        if let Some(poll) = &mut l.guest_poll {
            poll.learn(&shared.memory);
        }
        let exit = match exit {
            Ok(exit) => exit,
            Err(e) if e.errno() == libc::EINTR => return Ok(Flow::Kicked),
            Err(source) => return Err(VcpuError::Run(source).into()),
        };
        self.exits += 1;
        let mut ctx = VcpuExits {
            shared: &shared,
            vcpu,
            l: &mut *l,
            reports: &mut self.reports,
            now: MonotonicClock.now_ns(),
        };
        match handle_exit(exit, &mut ctx)? {
            Flow::Halted => self.halt(l),
            flow => Ok(flow),
        }
    }

    /// `KVM_EXIT_HLT`: wait, polling or blocked as the halt-poll policy says,
    /// until an interrupt can be delivered, the timer fires, or a stop.
    fn halt(&mut self, l: &mut Loop) -> Result<Flow, ExitError> {
        if self.fd.get_kvm_run().if_flag == 0 {
            return Err(GuestFault::HaltedForever.into());
        }
        let (irqs, vcpu) = (&self.shared.irqs, self.vcpu());
        let sched = irqs.scheduler();
        loop {
            // Published before the look for work (see `crate::irq`).
            sched.halted(vcpu);
            let work = l.apic.deliverable(&irqs.pending(vcpu)).is_some() || irqs.has_timer(vcpu);
            if work || self.shared.stop_requested() {
                sched.woken(vcpu);
                return Ok(Flow::Continue);
            }
            l.poller.halt();
            sched.woken(vcpu);
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

/// Does what an APIC register write asks beyond the register: send an IPI,
/// or re-arm the timer.
fn apply(irqs: &Interrupts, vcpu: usize, l: &mut Loop, action: Action) {
    match action {
        Action::Ipi { vector, to } => {
            irqs.ipi(vcpu, vector, to);
        }
        // Due already: the next entry fires it (`due_now`), so the timer
        // thread must not fire it again.
        Action::TimerChanged if l.due_now() => {
            let _ = l.timer.disarm();
        }
        Action::TimerChanged => rearm(l),
        Action::Eoi | Action::None => {}
    }
}

/// The run loop's side of [`handle_exit`]: one vCPU's local APIC, timer,
/// scheduler hooks and RCU reader, at the time of one exit.
struct VcpuExits<'a> {
    shared: &'a VmShared,
    vcpu: usize,
    l: &'a mut Loop,
    reports: &'a mut Vec<Report>,
    now: u64,
}

impl ExitContext for VcpuExits<'_> {
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
        let result = self.shared.bus.with(&self.l.reader, f);
        self.shared.bus_lookups.record(rdtsc().wrapping_sub(start));
        result
    }

    fn read_msr(&mut self, index: u32) -> Option<u64> {
        let pending = self.shared.irqs.pending(self.vcpu);
        self.l.apic.read(index, &pending, self.now).ok()
    }

    fn write_msr(&mut self, index: u32, value: u64) -> bool {
        self.l.reanchor();
        let action = self.l.apic.write(index, value, self.now);
        action
            .map(|a| apply(&self.shared.irqs, self.vcpu, self.l, a))
            .is_ok()
    }

    fn read_apic_mmio(&mut self, addr: u64, data: &mut [u8]) -> bool {
        if !in_xapic_page(addr) {
            return false;
        }
        let pending = self.shared.irqs.pending(self.vcpu);
        (self.l.apic).mmio_read_bytes(addr - XAPIC_BASE, data, &pending, self.now);
        true
    }

    fn write_apic_mmio(&mut self, addr: u64, data: &[u8]) -> bool {
        if !in_xapic_page(addr) {
            return false;
        }
        self.l.reanchor();
        let action = self
            .l
            .apic
            .mmio_write_bytes(addr - XAPIC_BASE, data, self.now);
        apply(&self.shared.irqs, self.vcpu, self.l, action);
        true
    }

    fn waiting(&mut self) {
        self.shared.irqs.scheduler().waiting(self.vcpu);
    }

    fn yield_to(&mut self, target: usize) {
        vcpu_sched::pv_yield_to(&self.shared.irqs.scheduler().ctx(), self.vcpu, target);
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

/// Whether an MMIO access is to the xAPIC page: the local APIC answers it
/// whatever its size (see [`LocalApic::mmio_read_bytes`]).
fn in_xapic_page(addr: u64) -> bool {
    (XAPIC_BASE..XAPIC_BASE + XAPIC_SIZE).contains(&addr)
}

/// Fires the LVT timer if it is due `lead` from now (delivery starts that
/// early, and the guest's entry runs that much later), and re-arms it.
fn fire_timer(irqs: &Interrupts, vcpu: usize, l: &mut Loop) {
    l.reanchor();
    let start = MonotonicClock.now_ns();
    let now = start + l.lead.current().as_nanos() as u64;
    if let Some(fired) = l.apic.timer().expire(now).filter(|f| f.deliver) {
        irqs.post_local(vcpu, fired.vector);
        l.lead.fired(fired.vector, fired.due_ns, start);
    }
    rearm(l);
}

/// Arms the host timer for the LVT timer's next expiry, or disarms it.
fn rearm(l: &mut Loop) {
    // A timerfd that cannot be set is out of the guest's reach and of ours: the
    // timer then fires at the next exit instead (prepare_entry checks).
    // A masked timer delivers nothing, so it needs no host timer: its expiries
    // are spent at the next entry (`due_now`) or when it is unmasked.
    let _ = match l.apic.timer().next_delivery_ns() {
        Some(at) => l.timer.arm(at, 0),
        None => l.timer.disarm(),
    };
}
