//! A run: the vCPU threads started on the VM's shared state, a controller
//! beside them (a migration), and their results collected into a report.
//!
//! [`Vm::run`] reads as its steps: check the program fits, set each vCPU's
//! entry registers, build the device bus, share the VM's state, start the
//! vCPU threads and the controller, then collect their ends.

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use test_guests::GuestProgram;
use test_guests::abi::{SERIAL_PORT, note_migration_ended};
use test_guests::layout::{IMAGE_ADDR, user_stack_top, vcpu_data};
use test_guests::x86::boot::{entry_regs, pvh_regs};

use super::VmDescription;
use super::pause::{Decision, PauseError, PauseGate};
use super::{Boot, Vm, kvm_err};
use crate::devices::completion::CompletionDevice;
use crate::devices::{
    BoundedOutput, IoBus, OUTPUT_BUFFER_BYTES, POST_PORT, PostCode, SerialConsole,
};
use crate::error::{ConfigError, Error};
use crate::irq::Interrupts;
use crate::irqchip::ChipState;
use crate::irqchip::{KernelIrqChip, TunerThread, UserIrqChip};
use crate::kick;
use crate::policies::{Irqchip, KvmHaltPoll};
use crate::report::{RunReport, VcpuSummary, VmStats, p99_bucket_edge};
use crate::shared::{ApicSetup, Devices, Moving, Rcu, VmShared};
use crate::stop::{DEFAULT_TIMEOUT, OUTPUT_GRACE, STOP_GRACE, StopHandle, StopReason};
use crate::vcpu::VcpuRunner;
use crate::vcpu::state::VcpuState;

/// What a controller started beside the run does ([`Vm::on_start`]).
pub type Controller = Box<dyn FnOnce(&RunControl) + Send>;

/// What a vCPU thread sends when its run ends.
type Answer = (u32, Result<VcpuSummary, Error>);

impl Vm {
    /// Runs `program` on every vCPU, each on its own thread, until all have
    /// finished, one fails, the timeout passes or a [`StopHandle`] asks.
    /// Serial output goes to `serial_out` through a bounded buffer, so a
    /// writer that blocks never holds a vCPU (see [`BoundedOutput`]).
    ///
    /// # Errors
    /// A stopped run is [`Error::Stopped`], with what the guest reported so
    /// far; a guest that misbehaves is [`Error::Guest`].
    pub fn run(
        mut self,
        program: &GuestProgram,
        serial_out: Box<dyn Write + Send>,
    ) -> Result<RunReport, Error> {
        self.check_program(program)?;
        self.set_entry_registers(program)?;
        let incoming = self.take_incoming()?;
        let description = self.description(program);
        let (output, drain) =
            BoundedOutput::start(serial_out, OUTPUT_BUFFER_BYTES).map_err(|source| {
                Error::SpawnHelper {
                    thread: "output",
                    source,
                }
            })?;
        let bus = self.io_bus(output)?;
        let shared = Arc::new(self.share(bus));
        publish_incoming_apics(&shared.irqs, &incoming);
        let tuner = match (self.config.irqchip, self.config.kvm_halt_poll) {
            (Irqchip::Kernel, KvmHaltPoll::Tuned) => {
                Some(TunerThread::spawn(self.vm.clone(), &self.vcpus, None)?)
            }
            (Irqchip::Kernel, KvmHaltPoll::Budget(share)) => Some(TunerThread::spawn(
                self.vm.clone(),
                &self.vcpus,
                Some(share.get()),
            )?),
            _ => None,
        };
        let guest_boosts = self
            .config
            .guest_boosts
            .map(|limits| shared.irqs.grant_guest_boosts(self.memory.clone(), limits))
            .transpose()
            .map_err(|source| Error::SpawnHelper {
                thread: "guest-requested boosts",
                source,
            })?;
        let completions = match self.config.irqchip {
            Irqchip::Kernel => Some(CompletionDevice::start(
                &self.vm,
                self.config.vcpus,
                shared.irqs.scheduler_handle(),
            )?),
            Irqchip::User => None,
        };
        let start = Instant::now();
        let (rx, threads) = self.start_vcpus(&shared, incoming)?;
        let controller = match self
            .controller
            .take()
            .map(|c| spawn_controller(c, RunControl::new(shared.clone(), description)))
            .transpose()
        {
            Ok(controller) => controller,
            Err(e) => {
                abandon(&shared, threads);
                return Err(e);
            }
        };
        let timeout = self.config.timeout.unwrap_or(DEFAULT_TIMEOUT);
        let (mut vcpus, ending, answered) = collect(&rx, &shared, &threads, &self.stop, timeout);
        let elapsed = start.elapsed();
        if let Some(c) = controller {
            c.join().map_err(|_| Error::ThreadPanicked("migration"))?;
        }
        let tuner = tuner.map(TunerThread::finish).transpose();
        drop(guest_boosts);
        let completions = completions.map(CompletionDevice::finish).transpose()?;
        let unresponsive = join_or_leave(threads, &answered)?;
        // The guest's last output is written (or given up on) whatever the end.
        let unwritten = drain.finish(OUTPUT_GRACE);
        if !unresponsive.is_empty() {
            return Err(Error::Unresponsive(unresponsive));
        }
        vcpus.sort_by_key(|s| s.index);
        let mut stats = stats(&shared, drain.dropped() + unwritten);
        if let Some(c) = completions {
            stats.completions = c.completions.load(Relaxed);
            stats.completions_to_preempted = c.preempted.load(Relaxed);
        }
        if let Some(tuner) = tuner? {
            stats.tuned_window_ns = tuner.window().map(|w| w.as_nanos() as u64);
            stats.tuned_window_changes = tuner.changes();
        }
        let report = RunReport {
            guest: program.name,
            vcpus,
            elapsed,
            stats,
            handed_over: shared.moving.pause.handed_over(),
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

    /// Whether `program` fits this VM: its parameters, vCPUs, memory, and a
    /// migration if it waits for one.
    fn check_program(&self, program: &GuestProgram) -> Result<(), Error> {
        let migrating = self.controller.is_some() || self.config.boot == Boot::Incoming;
        let c = &self.config;
        program
            .check_run(&c.params, c.vcpus, c.mem_mib, c.timeout, migrating)
            .map_err(|e| ConfigError::from(e).into())
    }

    /// Each vCPU's registers at the program's entry (a stream's vCPUs have
    /// theirs already).
    fn set_entry_registers(&self, program: &GuestProgram) -> Result<(), Error> {
        let count = self.config.vcpus;
        let entry = IMAGE_ADDR + program.entry_offset();
        for (i, fd) in (0..count).zip(&self.vcpus) {
            let regs = match &self.config.boot {
                Boot::Direct => entry_regs(entry, user_stack_top(i), i, count, vcpu_data(i)),
                Boot::Image(image) => pvh_regs(image.entry()),
                Boot::Incoming => continue,
            };
            fd.set_regs(&regs).map_err(kvm_err("KVM_SET_REGS"))?;
        }
        Ok(())
    }

    /// A stream's vCPU states, one per vCPU, and the guest told that its
    /// migration ended.
    fn take_incoming(&mut self) -> Result<Vec<Option<(ChipState, bool)>>, Error> {
        let count = self.vcpus.len();
        match (&self.config.boot, self.incoming.take()) {
            (Boot::Incoming, Some(states)) if states.len() == count => {
                note_migration_ended(&self.memory).map_err(|source| Error::WriteMemory {
                    what: "the migration count",
                    source,
                })?;
                Ok(states.into_iter().map(Some).collect())
            }
            (Boot::Incoming, _) => Err(ConfigError::NoIncomingState.into()),
            (_, _) => Ok((0..count).map(|_| None).collect()),
        }
    }

    /// The console, the POST-code port and the devices added.
    fn io_bus(&mut self, output: BoundedOutput) -> Result<IoBus, Error> {
        let mut bus = IoBus::new();
        let console = Arc::new(SerialConsole::new(Box::new(output)));
        bus.insert(SERIAL_PORT, 8, console)
            .expect("the serial console is the first device on an empty bus");
        bus.insert(POST_PORT, 1, Arc::new(PostCode::default()))
            .expect("the POST-code port is free");
        for (base, len, device) in self.devices.drain(..) {
            bus.insert(base, len, device)
                .map_err(|e| Error::Config(e.into()))?;
        }
        Ok(bus)
    }

    /// What the vCPU threads share, each concern made as the config says.
    fn share(&mut self, bus: IoBus) -> VmShared {
        let c = &self.config;
        let devices = Devices {
            bus: c.policies.bus(bus, &self.domain),
            lookups: Default::default(),
            max_reports: c.max_reports,
        };
        let rcu = Rcu {
            domain: self.domain.clone(),
            extended_qs: c.extended_qs,
        };
        let irqs = Arc::new(Interrupts::new(
            self.vcpus.len(),
            c.policies.boost(),
            c.policies.boost_budget(),
        ));
        let apic = ApicSetup {
            policies: c.policies.clone(),
            timer_placement: c.timer_placement,
            min_timer_period_ns: c.min_timer_period.as_nanos() as u64,
            phys_bits: self.phys_bits,
        };
        let moving = Moving {
            pause: PauseGate::new(self.vcpus.len()),
            state_support: self.state_support.clone(),
            ring_full: self.ring_full.take(),
            dirty_pauses: self.dirty_pauses.clone(),
        };
        VmShared::new(self.memory.clone(), devices, rcu, irqs, apic, moving)
    }

    /// Starts a thread per vCPU, its local APIC where the config says.
    fn start_vcpus(
        &mut self,
        shared: &Arc<VmShared>,
        incoming: Vec<Option<(ChipState, bool)>>,
    ) -> Result<(mpsc::Receiver<Answer>, Vec<JoinHandle<()>>), Error> {
        let (tx, rx) = mpsc::channel();
        let mut threads = Vec::new();
        let irqchip = self.config.irqchip;
        for ((i, fd), state) in (0..).zip(self.vcpus.drain(..)).zip(incoming) {
            let mut runner = VcpuRunner::new(i, fd, shared.clone());
            if let Some((chip, halted)) = state {
                runner = runner.incoming(chip, halted);
            }
            let tx = tx.clone();
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
                    abandon(shared, threads);
                    return Err(Error::SpawnThread { vcpu: i, source });
                }
            }
        }
        Ok((rx, threads))
    }
}

/// What the mechanisms did; `output_lost` guest output bytes never reached
/// the output.
fn stats(shared: &VmShared, output_lost: u64) -> VmStats {
    let (h, i, t) = (&shared.stats.halt, &shared.irqs.stats, &shared.stats.timer);
    let s = shared.irqs.scheduler().events();
    let lookups = &shared.devices.lookups;
    VmStats {
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
        latest_revoker_wake_ns: s.latest_revoker_wake_ns.load(Relaxed),
        most_boost_cpu_ns: s.most_boost_cpu_ns.load(Relaxed),
        directed_yield_attempted: s.directed_yield_attempted.load(Relaxed),
        output_lost,
        bus_lookups: lookups.count.load(Relaxed),
        bus_lookup_ticks: lookups.ticks.load(Relaxed),
        timer_expiries: t.wakeups.load(Relaxed),
        timer_spin_ns: t.spin_cpu_ns.load(Relaxed),
        timer_delivery_p50_us: shared.stats.delivery.median_us(),
        timer_start_p99_ns: p99_bucket_edge(&t.lateness_hist),
        tuned_window_ns: None,
        tuned_window_changes: 0,
        completions: 0,
        completions_to_preempted: 0,
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

    /// Kicks vCPU `vcpu` out of the guest, so that it looks at its
    /// requests (a dirty limit's pause due) before it enters again.
    pub fn kick(&self, vcpu: usize) {
        self.shared.irqs.kick(vcpu);
    }

    /// What a destination needs to create the VM.
    pub fn description(&self) -> &VmDescription {
        &self.description
    }

    /// What the mechanisms have done so far (`output_lost` is counted as
    /// the run ends: 0 here).
    pub fn stats(&self) -> VmStats {
        stats(&self.shared, 0)
    }

    /// Waits up to `timeout`; returns early, with `true`, if a vCPU's run
    /// ended (its program finished or failed, or the run was stopped).
    pub fn wait_for_end(&self, timeout: Duration) -> bool {
        self.shared.moving.pause.wait_for_end(timeout)
    }

    /// Whether the run was asked to stop (a signal, its timeout, a vCPU's
    /// failure): its vCPUs are leaving.
    pub fn stopping(&self) -> bool {
        self.shared.stop_requested()
    }

    /// The first vCPU whose run ended (0 if none has).
    pub fn ended_vcpu(&self) -> u32 {
        self.shared.moving.pause.first_ended().unwrap_or(0)
    }

    /// Pauses every vCPU and returns their states, by index. On an error
    /// the vCPUs that parked run on.
    pub fn pause(&self, timeout: Duration) -> Result<Vec<VcpuState>, PauseError> {
        self.shared.moving.pause.request();
        self.shared.irqs.kick_all();
        self.shared.irqs.boost_all();
        self.shared
            .moving
            .pause
            .wait_parked(timeout)
            .inspect_err(|_| {
                self.shared.moving.pause.decide(Decision::Resume);
            })
    }

    /// Resumes paused vCPUs.
    pub fn resume(&self) {
        self.shared.moving.pause.decide(Decision::Resume);
    }

    /// Ends the paused vCPUs here: the VM runs elsewhere now.
    pub fn hand_over(&self) {
        self.shared.moving.pause.decide(Decision::HandOver);
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
    shared.moving.pause.decide(Decision::Resume);
    shared.irqs.wake_all();
    for t in threads {
        // A thread that already returned cannot be kicked and needs no kick.
        let _ = kick::kick(t);
    }
}

/// Which IPIs reach each incoming vCPU's APIC, before any vCPU runs: the
/// first to start may send to one that has not restored its state yet.
fn publish_incoming_apics(irqs: &Interrupts, incoming: &[Option<(ChipState, bool)>]) {
    for (vcpu, state) in incoming.iter().enumerate() {
        if let Some((ChipState::User { apic, .. }, _)) = state {
            irqs.set_apic_state(vcpu, apic.enabled(), apic.x2apic);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
