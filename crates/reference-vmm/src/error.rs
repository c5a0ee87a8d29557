//! Errors: what went wrong, on which vCPU, with the registers to debug it.

use std::fmt;
use std::io;

use kvm_bindings::{kvm_regs, kvm_sregs};

use crate::fault::GuestFault;
use crate::report::RunReport;
use crate::stop::StopReason;

/// Everything that can end a run early.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `/dev/kvm` is missing or cannot be opened.
    #[error("cannot open /dev/kvm: {0}")]
    OpenKvm(#[source] kvm_ioctls::Error),
    /// A KVM ioctl failed.
    #[error("{op} failed: {source}")]
    Kvm {
        /// The operation, named after its ioctl.
        op: &'static str,
        /// The error KVM returned.
        #[source]
        source: kvm_ioctls::Error,
    },
    /// The configuration cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// Guest memory could not be allocated.
    #[error("cannot allocate guest memory: {0}")]
    AllocateMemory(#[source] vm_memory::mmap::FromRangesError),
    /// An image file could not be loaded.
    #[error(transparent)]
    Image(#[from] test_guests::pvh::ImageError),
    /// Guest memory could not be registered with KVM.
    #[error("cannot register guest memory with KVM: {0}")]
    RegisterMemory(#[source] dirty_log::Error),
    /// Writing the VMM's own structures into guest memory failed.
    #[error("cannot write {what} into guest memory: {source}")]
    WriteMemory {
        /// What was being written.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// Reading what the guest left in its memory after a run failed.
    #[error("cannot read {what} from guest memory: {source}")]
    ReadMemory {
        /// What was being read.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The guest did something the VMM cannot handle; the run ends.
    #[error("vCPU {vcpu}: {fault}\n{registers}")]
    Guest {
        /// The vCPU that did it.
        vcpu: u32,
        /// What it did.
        fault: GuestFault,
        /// Its registers at the time.
        registers: RegisterDump,
    },
    /// A device failed on the VMM's side (its output, say).
    #[error("vCPU {vcpu}: device at port {port:#x} failed: {source}")]
    Device {
        /// The vCPU whose access failed.
        vcpu: u32,
        /// The port it accessed.
        port: u16,
        /// The device's error.
        #[source]
        source: io::Error,
    },
    /// KVM refused an MSR value of a vCPU being restored.
    #[error("vCPU {vcpu}: KVM refused MSR {msr:#x} = {value:#x}")]
    MsrRefused {
        /// The vCPU.
        vcpu: u32,
        /// The MSR.
        msr: u32,
        /// The value.
        value: u64,
    },
    /// A vCPU's interrupt-controller state is for the other kind of controller.
    #[error("vCPU {0}: its interrupt-controller state is for the other kind of controller")]
    ChipMismatch(u32),
    /// Kicking vCPUs out of `KVM_RUN` could not be set up.
    #[error("cannot set up vCPU kicks: {0}")]
    Kick(#[from] crate::kick::KickError),
    /// The VMM could not go on with a vCPU: never the guest's doing.
    #[error("vCPU {vcpu}: {source}")]
    Vcpu {
        /// The vCPU.
        vcpu: u32,
        /// What failed.
        #[source]
        source: crate::exit::VcpuError,
    },
    /// A vCPU thread could not be started.
    #[error("cannot start the thread of vCPU {vcpu}: {source}")]
    SpawnThread {
        /// The vCPU.
        vcpu: u32,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A thread that is not a vCPU's (the output drain, the halt-poll tuner)
    /// could not be started.
    #[error("cannot start the {thread} thread: {source}")]
    SpawnHelper {
        /// Which.
        thread: &'static str,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A vCPU thread panicked: a bug in the VMM, never the guest's doing.
    #[error("the thread of vCPU {0} panicked")]
    VcpuPanicked(u32),
    /// Dirty logging could not be set up.
    #[error("dirty logging: {0}")]
    DirtyLog(#[from] dirty_log::Error),
    /// A thread that is not a vCPU's (a benchmark's, the halt-poll tuner)
    /// panicked: a bug in the VMM.
    #[error("the {0} thread panicked")]
    ThreadPanicked(&'static str),
    /// KVM's halt polling (`--irqchip kernel`) could not be set or its
    /// binary statistics read.
    #[error("KVM halt polling: {0}")]
    KvmHaltPoll(#[from] halt_poll::kvm::KvmError),
    /// The run was stopped before its guest finished (its timeout, or a
    /// signal); every vCPU was kicked out and stopped.
    #[error("{reason}; stopped every vCPU. What it reported until then:\n{partial}")]
    Stopped {
        /// Why.
        reason: StopReason,
        /// What the guest reported and the mechanisms did until the stop.
        partial: Box<RunReport>,
    },
    /// vCPU threads that did not leave `KVM_RUN` within `STOP_GRACE`
    /// of being stopped: a VMM bug (a blocked device), never the guest's doing.
    #[error("vCPU thread(s) {0:?} did not stop when asked; the run ended without them")]
    Unresponsive(Vec<u32>),
}

/// A configuration that cannot work, with the accepted values.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The guest was to have CPU features this host's KVM does not offer.
    #[error("this host's CPU lacks what the guest was given: {}", .0.join(", "))]
    MissingCpuFeatures(Vec<String>),
    /// A machine the guest kit's layout does not fit (vCPUs, memory), or
    /// more vCPUs than KVM allows.
    #[error(transparent)]
    Layout(#[from] test_guests::LayoutError),
    /// A guest program that cannot run as asked.
    #[error(transparent)]
    Program(#[from] test_guests::ProgramError),
    /// A device could not be added to the bus.
    #[error("cannot add a device: {0}")]
    Device(#[from] crate::devices::BusError),
    /// KVM's halt polling set on this VMM's APIC, where KVM does not halt.
    #[error(
        "KVM's halt-polling window is set in the kernel irqchip's halts: it needs Irqchip::Kernel"
    )]
    KvmHaltPollNeedsKernelIrqchip,
    /// A VM created to receive a stream was run before it received one.
    #[error(
        "a VM created with Boot::Incoming runs only once every vCPU's state is set (Vm::set_incoming)"
    )]
    NoIncomingState,
}

/// A vCPU's registers when something went wrong, or why they could not be read.
#[derive(Debug)]
pub struct RegisterDump(pub Result<Box<(kvm_regs, kvm_sregs)>, kvm_ioctls::Error>);

impl fmt::Display for RegisterDump {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (r, s) = match &self.0 {
            Ok(regs) => &**regs,
            Err(e) => return write!(f, "  (registers unavailable: {e})"),
        };
        writeln!(
            f,
            "  rip {:#018x} rsp {:#018x} rflags {:#010x} cpl {}",
            r.rip, r.rsp, r.rflags, s.cs.dpl
        )?;
        writeln!(
            f,
            "  rax {:#018x} rbx {:#018x} rcx {:#018x} rdx {:#018x}",
            r.rax, r.rbx, r.rcx, r.rdx
        )?;
        writeln!(
            f,
            "  rsi {:#018x} rdi {:#018x} rbp {:#018x} r8  {:#018x}",
            r.rsi, r.rdi, r.rbp, r.r8
        )?;
        writeln!(
            f,
            "  r9  {:#018x} r10 {:#018x} r11 {:#018x} r12 {:#018x}",
            r.r9, r.r10, r.r11, r.r12
        )?;
        writeln!(
            f,
            "  r13 {:#018x} r14 {:#018x} r15 {:#018x}",
            r.r13, r.r14, r.r15
        )?;
        write!(
            f,
            "  cr0 {:#x} cr2 {:#x} cr3 {:#x} cr4 {:#x} efer {:#x}",
            s.cr0, s.cr2, s.cr3, s.cr4, s.efer
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn register_dump_shows_rip_and_cpl() {
        let regs = kvm_regs {
            rip: 0x10_0000,
            ..Default::default()
        };
        let mut sregs = kvm_sregs::default();
        sregs.cs.dpl = 3;
        let dump = RegisterDump(Ok(Box::new((regs, sregs)))).to_string();
        assert!(dump.contains("rip 0x0000000000100000"), "{dump}");
        assert!(dump.contains("cpl 3"), "{dump}");
        let missing = RegisterDump(Err(kvm_ioctls::Error::new(libc::EBADF))).to_string();
        assert!(missing.contains("registers unavailable"), "{missing}");
    }
}
