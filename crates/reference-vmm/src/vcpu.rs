//! A vCPU thread's run loop.
//!
//! ```text
//! loop {
//!     stop requested?  -> finish                  (set by the VMM before a kick)
//!     exit = KVM_RUN                              later: rcu-qs offline / online around it,
//!                                                 vcpu-sched run state, lapic-timer expiry
//!     match handle_exit(exit) { continue | kicked: acknowledge | done | error }
//! }
//! ```
//! The exit handling itself is [`exit::handle_exit`](crate::exit::handle_exit);
//! kicks follow the strategy described in [`crate::kick`].

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvm_ioctls::VcpuFd;
use vm_memory::GuestMemoryMmap;

use crate::devices::IoBus;
use crate::error::{Error, RegisterDump};
use crate::exit::{ExitError, Flow, Report, handle_exit};
use crate::kick;

/// What every vCPU thread of a VM shares.
pub struct VmShared {
    /// Guest memory.
    pub memory: GuestMemoryMmap,
    /// Port-I/O devices.
    pub io_bus: IoBus,
    /// Set before kicking the vCPUs to make them stop.
    stop: AtomicBool,
}

impl VmShared {
    /// State for a VM with `memory` and the devices on `io_bus`.
    pub fn new(memory: GuestMemoryMmap, io_bus: IoBus) -> Self {
        Self {
            memory,
            io_bus,
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

    /// Runs the vCPU on the calling thread until its program finishes, it is
    /// stopped, or something goes wrong.
    pub fn run(mut self) -> Result<VcpuSummary, Error> {
        kick::prepare_vcpu_thread(&self.fd).map_err(Error::Kick)?;
        loop {
            if self.shared.stop_requested() {
                return Ok(self.summary(false));
            }
            let flow = match self.fd.run() {
                Ok(exit) => {
                    self.exits += 1;
                    handle_exit(
                        exit,
                        &self.shared.io_bus,
                        &self.shared.memory,
                        &mut self.reports,
                    )
                }
                Err(e) if e.errno() == libc::EINTR => Ok(Flow::Kicked),
                Err(source) => {
                    return Err(Error::Kvm {
                        op: "KVM_RUN",
                        source,
                    });
                }
            };
            match flow {
                Ok(Flow::Continue) => {}
                Ok(Flow::Kicked) => kick::acknowledge().map_err(Error::Kick)?,
                Ok(Flow::Done) => return Ok(self.summary(true)),
                Err(e) => return Err(self.exit_error(e)),
            }
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
        }
    }
}
