//! A vCPU thread's run loop, where the five mechanisms meet on the exit path,
//! generic over where the local APIC lives ([`IrqChip`]).
//!
//! ```text
//! loop {
//!     stop requested?  -> finish                  (set by the VMM before a kick)
//!     pause requested? -> save state, park        (a migration: resume, or end here)
//!     halted?          -> chip waits (halt-poll)  (until it has work)
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
use std::time::Duration;

use crate::memory::VmMemory;
use halt_poll::set_timer_slack;
use kvm_ioctls::VcpuFd;
use lapic_timer::time::rdtsc;
use rcu_qs::Reader;

use crate::devices::IoBus;
use crate::duty_cycle::PauseTaker;
use crate::error::{Error, RegisterDump};
use crate::exit::{ExitContext, ExitError, Flow, VcpuError, handle_exit};
use crate::fault::GuestFault;
use crate::irqchip::ChipState;
use crate::irqchip::IrqChip;
use crate::kick;
use crate::report::VcpuSummary;
use crate::shared::VmShared;
use crate::vm::pause::Decision;
use test_guests::Report;

pub(crate) mod state;

pub use state::{StateSupport, VcpuState};

/// One vCPU and the loop that runs it.
pub struct VcpuRunner {
    index: u32,
    fd: VcpuFd,
    shared: Arc<VmShared>,
    exits: u64,
    /// Pauses under a migration's dirty limit.
    dirty_pauses: PauseTaker,
    reports: Vec<Report>,
    /// Bus lookups and their TSC ticks, added to the VM's when the run ends.
    lookups: (u64, u64),
    /// Halted (`hlt` with interrupts on) and not woken yet.
    halted: bool,
    /// A migrated interrupt-controller state to take on before the first entry.
    incoming: Option<ChipState>,
}

/// Unregisters the vCPU thread from kicks, and tells a pausing controller
/// it will not park, however the loop ends.
struct Registered<'a>(&'a VmShared, usize);

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        self.0.irqs.unregister_thread(self.1);
        self.0.moving.pause.ended(self.1);
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
            dirty_pauses: PauseTaker::new(),
            reports: Vec::new(),
            lookups: (0, 0),
            halted: false,
            incoming: None,
        }
    }

    /// The same runner for a migrated vCPU, whose KVM state is restored:
    /// its interrupt controller takes on `chip` on its thread, and it starts
    /// halted if it was.
    pub fn incoming(mut self, chip: ChipState, halted: bool) -> Self {
        self.incoming = Some(chip);
        self.halted = halted;
        self
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
        shared
            .irqs
            .register_thread(vcpu)
            .map_err(|source| Error::SpawnThread {
                vcpu: self.index,
                source,
            })?;
        let _registered = Registered(&shared, vcpu);
        let mut chip = C::start(&self.fd, self.index, &shared)?;
        if let Some(state) = self.incoming.take() {
            chip.restore(&state)?;
        }
        let mut reader = shared.rcu.domain.register_reader();
        loop {
            if shared.stop_requested() {
                chip.finish()?;
                return Ok(self.summary(false));
            }
            if shared.moving.pause.requested() {
                match self.park(&mut chip)? {
                    Decision::Resume => continue,
                    Decision::HandOver => {
                        chip.finish()?;
                        return Ok(self.summary(false));
                    }
                }
            }
            // A dirty limit: this vCPU writes faster than its share.
            if self.dirty_pauses.take(&shared.moving.dirty_pauses, vcpu) {
                continue;
            }
            if self.halted {
                match chip.halt() {
                    true => self.halted = false,
                    false => continue,
                }
            }
            // Published before looking for work (see `crate::irq`): a post
            // from here on either is seen by `prepare_entry` or kicks, and a
            // kick sent before `KVM_RUN` makes it return at once.
            chip.entering_guest();
            chip.prepare_entry(&mut self.fd)?;
            match self.run_once(&mut chip, &mut reader) {
                Ok(Flow::Continue) => {}
                Ok(Flow::Halted) => self.halted = true,
                Ok(Flow::Kicked) => kick::acknowledge()?,
                Ok(Flow::Done) => {
                    chip.finish()?;
                    return Ok(self.summary(true));
                }
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
        let exit = if self.shared.rcu.extended_qs {
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
            index: self.index,
            shared: &self.shared,
            chip: &mut *chip,
            reader,
            reports: &mut self.reports,
            lookups: &mut self.lookups,
        };
        match handle_exit(exit, &mut ctx)? {
            Flow::Halted if self.fd.get_kvm_run().if_flag == 0 => {
                Err(GuestFault::HaltedForever.into())
            }
            flow => Ok(flow),
        }
    }

    /// Saves the vCPU's state for a pausing controller and waits for its
    /// decision.
    fn park<C: IrqChip>(&mut self, chip: &mut C) -> Result<Decision, Error> {
        let shared = &self.shared;
        let chip_state = chip.save(&self.fd)?;
        let state = VcpuState::capture(
            &self.fd,
            self.index,
            self.halted,
            chip_state,
            &shared.moving.state_support,
        )?;
        Ok(shared.moving.pause.park(self.index as usize, state))
    }

    fn summary(self, finished: bool) -> VcpuSummary {
        self.add_lookups();
        VcpuSummary {
            index: self.index,
            finished,
            exits: self.exits,
            dirty_paused: self.dirty_pauses.taken,
            dirty_pause_given: self.shared.moving.dirty_pauses.given(self.index as usize),
            reports: self.reports,
        }
    }

    fn add_lookups(&self) {
        let (count, ticks) = self.lookups;
        self.shared.devices.lookups.add(count, ticks);
    }

    fn exit_error(&self, e: ExitError) -> Error {
        self.add_lookups();
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
    /// The vCPU's index.
    index: u32,
    shared: &'a VmShared,
    chip: &'a mut C,
    reader: &'a Reader,
    reports: &'a mut Vec<Report>,
    /// Bus lookups and their TSC ticks (see [`crate::shared::BusLookups`]).
    lookups: &'a mut (u64, u64),
}

impl<C: IrqChip> ExitContext for VcpuExits<'_, C> {
    type Memory = VmMemory;
    type Apic = C::Apic;

    fn memory(&self) -> &VmMemory {
        &self.shared.memory
    }

    fn reports(&mut self) -> &mut Vec<Report> {
        self.reports
    }

    fn max_reports(&self) -> usize {
        self.shared.devices.max_reports
    }

    /// Times the lookup and the device's handling, for `reference-bench rcu`.
    fn with_bus<R>(&mut self, f: impl FnOnce(&IoBus) -> R) -> R {
        let start = rdtsc();
        let result = self.shared.devices.bus.with(self.reader, f);
        self.lookups.0 += 1;
        self.lookups.1 += rdtsc().wrapping_sub(start);
        result
    }

    fn apic(&mut self) -> &mut C::Apic {
        self.chip.apic()
    }

    fn dirty_ring_full(&mut self) -> Result<(), VcpuError> {
        let rings = self
            .shared
            .moving
            .ring_full
            .as_ref()
            .ok_or(VcpuError::NoDirtyRing)?;
        rings
            .drain(self.index as usize)
            .map_err(VcpuError::DrainDirtyRing)
    }
}
