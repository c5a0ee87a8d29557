//! KVM's in-kernel LAPIC (`Irqchip::Kernel`): interrupts, the LAPIC timer
//! (with `lapic_timer_advance`) and halts (with KVM's halt polling) never
//! leave the kernel, so the vCPU's side in this VMM has no APIC: only KVM's
//! halt-polling window (set per VM, `KVM_CAP_HALT_POLL`, by [`set_window`],
//! or tuned while the VM runs by [`TunerThread`]) and the vCPU's binary
//! statistics, which say what KVM's polling did.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use halt_poll::kvm::{
    BinaryStats, KvmError, KvmHaltStats, TunedVcpus, TunerConfig, WindowTuner, set_vm_halt_poll,
};
use kvm_ioctls::{VcpuFd, VmFd};

use super::ChipState;
use super::IrqChip;
use crate::error::Error;
use crate::exit::NoApic;
use crate::policies::KvmHaltPoll;
use crate::shared::VmShared;

/// Sets the VM's halt-polling window where `polling` fixes one (the module's
/// `halt_poll_ns` stays otherwise, and a tuned window starts from it).
pub fn set_window(vm: &VmFd, polling: KvmHaltPoll) -> Result<(), Error> {
    match polling {
        KvmHaltPoll::Window(window) => Ok(set_vm_halt_poll(vm, window)?),
        KvmHaltPoll::Module | KvmHaltPoll::Tuned | KvmHaltPoll::Budget(_) => Ok(()),
    }
}

/// A vCPU on KVM's LAPIC: no timer thread, no poller, no scheduler hooks;
/// the APIC exits never reach this VMM (if one did, it would be a #GP).
pub struct KernelIrqChip {
    stats: BinaryStats,
    shared: Arc<VmShared>,
    apic: NoApic,
    vcpu: u32,
}

impl IrqChip for KernelIrqChip {
    type Apic = NoApic;

    fn start(fd: &VcpuFd, index: u32, shared: &Arc<VmShared>) -> Result<Self, Error> {
        Ok(Self {
            stats: BinaryStats::for_vcpu(fd)?,
            shared: shared.clone(),
            apic: NoApic,
            vcpu: index,
        })
    }
    fn apic(&mut self) -> &mut NoApic {
        &mut self.apic
    }
    fn entering_guest(&mut self) {}
    fn prepare_entry(&mut self, _: &mut VcpuFd) -> Result<(), Error> {
        Ok(())
    }
    fn left_guest(&mut self) {}
    /// KVM halts the vCPU inside `KVM_RUN`: a halt never reaches here.
    fn halt(&mut self) -> bool {
        true
    }

    fn save(&mut self, fd: &VcpuFd) -> Result<ChipState, Error> {
        let lapic = fd.get_lapic().map_err(|source| Error::Kvm {
            op: "KVM_GET_LAPIC",
            source,
        })?;
        Ok(ChipState::Kernel(Box::new(lapic)))
    }

    /// KVM's LAPIC is restored with the vCPU's KVM state
    /// ([`crate::VcpuState::restore`]).
    fn restore(&mut self, state: &ChipState) -> Result<(), Error> {
        match state {
            ChipState::Kernel(_) => Ok(()),
            ChipState::User { .. } => Err(Error::ChipMismatch(self.vcpu)),
        }
    }

    /// Adds what KVM's halt polling did for this vCPU to the VM's halt
    /// statistics, which keep the same names.
    fn finish(&mut self) -> Result<(), Error> {
        let kvm = KvmHaltStats::read(&self.stats)?;
        let h = &self.shared.stats.halt;
        h.halt_poll_success_ns
            .fetch_add(kvm.halt_poll_success_ns, Relaxed);
        h.halt_poll_fail_ns
            .fetch_add(kvm.halt_poll_fail_ns, Relaxed);
        h.halt_wait_ns.fetch_add(kvm.halt_wait_ns, Relaxed);
        h.halt_successful_poll
            .fetch_add(kvm.halt_successful_poll, Relaxed);
        h.halt_attempted_poll
            .fetch_add(kvm.halt_attempted_poll, Relaxed);
        Ok(())
    }
}

/// How often `--halt-poll tuned` and `budget:SHARE` read the vCPUs'
/// statistics.
pub const TUNE_INTERVAL: Duration = Duration::from_millis(10);

/// `--halt-poll tuned` or `budget:SHARE`: a thread that runs halt-poll's
/// [`WindowTuner`] on the VM every [`TUNE_INTERVAL`] until it is finished.
#[derive(Debug)]
pub struct TunerThread {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<Result<WindowTuner, KvmError>>,
}

impl TunerThread {
    /// Starts tuning `vm`, whose vCPUs are `vcpus`, with `budget` (a share
    /// of each vCPU's time) or, without one, by the cost model. It counts
    /// only the halts from now on. Until its first look KVM's module window
    /// applies: the halts its polls catch show their true lengths, so the
    /// first window fits, and a budget the first interval broke by twice
    /// shrinks it at once.
    pub fn spawn(vm: Arc<VmFd>, vcpus: &[VcpuFd], budget: Option<f64>) -> Result<Self, Error> {
        let stats = TunedVcpus::open(vcpus)?;
        let mut config = TunerConfig::default();
        config.budget = budget;
        let mut tuner = WindowTuner::starting_from(config, &stats)?;
        let (stop, stopped) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("halt-poll-tuner".into())
            .spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(TUNE_INTERVAL) {
                    tuner.tune(&vm, &stats)?;
                }
                Ok(tuner)
            })
            .map_err(|source| Error::SpawnHelper {
                thread: "halt-poll tuner",
                source,
            })?;
        Ok(Self { stop, thread })
    }

    /// Stops it. Returns the tuner, which has the window it set last
    /// ([`WindowTuner::window`]; `None`: it saw too few halts to set one)
    /// and how many times it changed it ([`WindowTuner::changes`]).
    pub fn finish(self) -> Result<WindowTuner, Error> {
        drop(self.stop);
        match self.thread.join() {
            Ok(tuner) => Ok(tuner?),
            Err(_) => Err(Error::ThreadPanicked("halt-poll tuner")),
        }
    }
}
