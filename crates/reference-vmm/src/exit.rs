//! What the VMM does with each vCPU exit: one dispatch, [`handle_exit`], over
//! an [`ExitContext`] that the run loop implements on KVM and tests implement
//! with fakes, so every arm runs without KVM. Every exit a guest can cause
//! ends in either a [`Flow`] or an [`ExitError`]; none panics.

use std::io;

use kvm_bindings::KVM_EXIT_DIRTY_RING_FULL;
use kvm_ioctls::VcpuExit;
use vm_memory::GuestMemory;

use crate::devices::IoBus;
use crate::fault::GuestFault;
use test_guests::Report;
use test_guests::abi::{PAUSE_PORT, UCALL_PORT, YIELD_PORT};
use test_guests::ucall::{self, Ucall};

/// What the run loop does after an exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Enter the guest again.
    Continue,
    /// `KVM_RUN` was interrupted by a kick: acknowledge it, look at requests.
    Kicked,
    /// The program finished on this vCPU.
    Done,
    /// The vCPU halted (`hlt`): wait until it has something to do, then
    /// enter again. The run loop waits: only it may touch the vCPU.
    Halted,
}

/// Why an exit ends the run: the guest's doing, or the VMM's.
#[derive(Debug, thiserror::Error)]
pub enum ExitError {
    /// The guest's doing.
    #[error(transparent)]
    Guest(#[from] GuestFault),
    /// A device failed on the VMM's side.
    #[error("device at port {port:#x} failed: {source}")]
    Device {
        /// The port accessed.
        port: u16,
        /// The device's error.
        #[source]
        source: io::Error,
    },
    /// The VMM cannot go on with the vCPU.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
}

/// A failure of the VMM's own on a vCPU's exit path: never the guest's doing.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// `KVM_RUN` failed other than by a kick.
    #[error("KVM_RUN failed: {0}")]
    Run(#[source] kvm_ioctls::Error),
    /// A full dirty ring could not be drained.
    #[error("cannot drain the dirty rings: {0}")]
    DrainDirtyRing(#[source] dirty_log::Error),
    /// KVM reported a full dirty ring on a VM without one.
    #[error("KVM_EXIT_DIRTY_RING_FULL on a VM without a dirty ring")]
    NoDirtyRing,
}

/// The most named values one vCPU may report in a run, unless its
/// [`VmConfig::max_reports`](crate::VmConfig::max_reports) says otherwise: a
/// guest that reports in a loop would otherwise grow the VMM without bound.
/// The built-in programs report a handful each.
pub const MAX_REPORTS: usize = 1024;

/// The exits a vCPU's local APIC and its scheduler hooks take.
pub trait ApicExits {
    /// A read of a local APIC MSR (x2APIC or TSC-deadline); `None` is a #GP.
    fn read_msr(&mut self, index: u32) -> Option<u64>;
    /// A write of a local APIC MSR; `false` is a #GP.
    fn write_msr(&mut self, index: u32, value: u64) -> bool;
    /// An MMIO read the local APIC answers (its xAPIC page); `false` if `addr`
    /// is not the APIC's.
    fn read_apic_mmio(&mut self, addr: u64, data: &mut [u8]) -> bool;
    /// An MMIO write the local APIC takes; `false` if `addr` is not the APIC's.
    fn write_apic_mmio(&mut self, addr: u64, data: &[u8]) -> bool;
    /// The vCPU spins waiting for others (the bench guests' pause port stands
    /// in for a pause-loop exit).
    fn waiting(&mut self);
    /// The guest asks to yield to vCPU `target` (`KVM_HC_SCHED_YIELD`).
    fn yield_to(&mut self, target: usize);
}

/// No local APIC in this VMM (a vCPU with devices only, or KVM's in-kernel
/// LAPIC): its MSRs are a #GP, its page is unknown MMIO, and waits and
/// yields do nothing.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoApic;

impl ApicExits for NoApic {
    fn read_msr(&mut self, _: u32) -> Option<u64> {
        None
    }
    fn write_msr(&mut self, _: u32, _: u64) -> bool {
        false
    }
    fn read_apic_mmio(&mut self, _: u64, _: &mut [u8]) -> bool {
        false
    }
    fn write_apic_mmio(&mut self, _: u64, _: &[u8]) -> bool {
        false
    }
    fn waiting(&mut self) {}
    fn yield_to(&mut self, _: usize) {}
}

/// What handling an exit needs beyond the exit itself: the vCPU's local
/// APIC, the device bus, guest memory, the reports and the dirty rings.
/// [`Devices`] is the context of a vCPU with devices only.
pub trait ExitContext {
    /// The guest memory ucall frames are read from.
    type Memory: GuestMemory;
    /// The vCPU's local APIC.
    type Apic: ApicExits;
    /// Guest memory.
    fn memory(&self) -> &Self::Memory;
    /// Where the guest's named values go.
    fn reports(&mut self) -> &mut Vec<Report>;
    /// The most named values the vCPU may report.
    fn max_reports(&self) -> usize {
        MAX_REPORTS
    }
    /// Runs `f` on the device bus, as the VMM shares it between vCPUs.
    fn with_bus<R>(&mut self, f: impl FnOnce(&IoBus) -> R) -> R;
    /// The vCPU's local APIC.
    fn apic(&mut self) -> &mut Self::Apic;
    /// A vCPU's dirty ring is full: drain the rings before it runs again.
    fn dirty_ring_full(&mut self) -> Result<(), VcpuError>;
}

/// Handles one exit; named values the guest reports go to the context's
/// reports (at most [`ExitContext::max_reports`]: one more is
/// [`GuestFault::TooManyReports`]).
pub fn handle_exit(exit: VcpuExit<'_>, ctx: &mut impl ExitContext) -> Result<Flow, ExitError> {
    match exit {
        VcpuExit::X86Rdmsr(msr) => {
            match ctx.apic().read_msr(msr.index) {
                Some(value) => *msr.data = value,
                None => *msr.error = 1, // #GP, as the architecture says
            }
            Ok(Flow::Continue)
        }
        VcpuExit::X86Wrmsr(msr) => {
            if !ctx.apic().write_msr(msr.index, msr.data) {
                *msr.error = 1;
            }
            Ok(Flow::Continue)
        }
        VcpuExit::MmioRead(addr, data) => match ctx.apic().read_apic_mmio(addr, data) {
            true => Ok(Flow::Continue),
            false => Err(GuestFault::UnknownMmio {
                addr,
                write: false,
                len: data.len(),
            }
            .into()),
        },
        VcpuExit::MmioWrite(addr, data) => match ctx.apic().write_apic_mmio(addr, data) {
            true => Ok(Flow::Continue),
            false => Err(GuestFault::UnknownMmio {
                addr,
                write: true,
                len: data.len(),
            }
            .into()),
        },
        VcpuExit::Hlt => Ok(Flow::Halted),
        VcpuExit::IoOut(PAUSE_PORT, _) => {
            ctx.apic().waiting();
            Ok(Flow::Continue)
        }
        VcpuExit::IoOut(YIELD_PORT, data) => {
            // Any width, zero-extended.
            let target = data.iter().rev().fold(0, |n, &b| n << 8 | usize::from(b));
            ctx.apic().yield_to(target);
            Ok(Flow::Continue)
        }
        VcpuExit::IoOut(UCALL_PORT, data) => {
            let call = ucall::decode(ctx.memory(), data).map_err(GuestFault::from)?;
            let max = ctx.max_reports();
            handle_ucall(call, ctx.reports(), max)
        }
        VcpuExit::IoOut(port, data) => ctx.with_bus(|bus| port_out(bus, port, data)),
        VcpuExit::IoIn(UCALL_PORT, data) => {
            let probe = ucall::UCALL_PROBE.to_le_bytes();
            data.iter_mut()
                .zip(probe.iter().chain(std::iter::repeat(&0)))
                .for_each(|(d, p)| *d = *p);
            Ok(Flow::Continue)
        }
        VcpuExit::IoIn(port, data) => ctx.with_bus(|bus| port_in(bus, port, data)),
        VcpuExit::IrqWindowOpen => Ok(Flow::Continue),
        VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL) => {
            ctx.dirty_ring_full()?;
            Ok(Flow::Continue)
        }
        VcpuExit::Intr => Ok(Flow::Kicked),
        VcpuExit::Shutdown => Err(GuestFault::TripleFault.into()),
        VcpuExit::FailEntry(reason, cpu) => Err(GuestFault::FailEntry { reason, cpu }.into()),
        VcpuExit::Unsupported(reason) => Err(GuestFault::UnsupportedExit(reason).into()),
        other => Err(GuestFault::UnhandledExit(exit_name(&other)).into()),
    }
}

fn port_out(bus: &IoBus, port: u16, data: &[u8]) -> Result<Flow, ExitError> {
    let Some((device, offset)) = bus.find(port) else {
        return Err(GuestFault::UnknownPort {
            port,
            write: true,
            data: data.to_vec(),
        }
        .into());
    };
    device
        .write(offset, data)
        .map_err(|source| ExitError::Device { port, source })?;
    Ok(Flow::Continue)
}

fn port_in(bus: &IoBus, port: u16, data: &mut [u8]) -> Result<Flow, ExitError> {
    let Some((device, offset)) = bus.find(port) else {
        return Err(GuestFault::UnknownPort {
            port,
            write: false,
            data: vec![0; data.len()],
        }
        .into());
    };
    device.read(offset, data);
    Ok(Flow::Continue)
}

/// The name of an exit this VMM does not handle, as KVM's `KVM_EXIT_*`.
fn exit_name(exit: &VcpuExit<'_>) -> &'static str {
    match exit {
        VcpuExit::Unknown => "KVM_EXIT_UNKNOWN",
        VcpuExit::Exception => "KVM_EXIT_EXCEPTION",
        VcpuExit::Nmi => "KVM_EXIT_NMI",
        VcpuExit::Hypercall(_) => "KVM_EXIT_HYPERCALL",
        VcpuExit::Debug(_) => "KVM_EXIT_DEBUG",
        VcpuExit::SetTpr => "KVM_EXIT_SET_TPR",
        VcpuExit::TprAccess => "KVM_EXIT_TPR_ACCESS",
        VcpuExit::InternalError => "KVM_EXIT_INTERNAL_ERROR",
        VcpuExit::SystemEvent(..) => "KVM_EXIT_SYSTEM_EVENT",
        VcpuExit::IoapicEoi(_) => "KVM_EXIT_IOAPIC_EOI",
        VcpuExit::Hyperv => "KVM_EXIT_HYPERV",
        _ => "another exit",
    }
}

/// The context of a vCPU with devices only ([`NoApic`], no dirty ring).
/// The fuzz target drives [`handle_exit`] through it.
#[cfg(any(test, feature = "fuzzing"))]
pub struct Devices<'a, M> {
    /// The device bus.
    pub bus: &'a IoBus,
    /// Guest memory.
    pub memory: &'a M,
    /// The guest's named values.
    pub reports: &'a mut Vec<Report>,
    /// No local APIC.
    pub apic: NoApic,
}

#[cfg(any(test, feature = "fuzzing"))]
impl<M: GuestMemory> ExitContext for Devices<'_, M> {
    type Memory = M;
    type Apic = NoApic;
    fn memory(&self) -> &M {
        self.memory
    }
    fn reports(&mut self) -> &mut Vec<Report> {
        self.reports
    }
    fn with_bus<R>(&mut self, f: impl FnOnce(&IoBus) -> R) -> R {
        f(self.bus)
    }
    fn apic(&mut self) -> &mut NoApic {
        &mut self.apic
    }
    fn dirty_ring_full(&mut self) -> Result<(), VcpuError> {
        Err(VcpuError::NoDirtyRing)
    }
}

fn handle_ucall(call: Ucall, reports: &mut Vec<Report>, max: usize) -> Result<Flow, ExitError> {
    match call {
        Ucall::Report { .. } if reports.len() >= max => {
            Err(GuestFault::TooManyReports { max }.into())
        }
        Ucall::Report { name, value } => {
            reports.push(Report { name, value });
            Ok(Flow::Continue)
        }
        Ucall::Done => Ok(Flow::Done),
        Ucall::AssertFailed { message, a, b } => {
            Err(GuestFault::AssertFailed { message, a, b }.into())
        }
        Ucall::Exception {
            vector,
            error_code,
            rip,
            cr2,
        } => Err(GuestFault::Exception {
            vector,
            error_code,
            rip,
            cr2,
        }
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::PioDevice;
    use std::sync::{Arc, Mutex};
    use test_guests::ucall::{CMD_DONE, CMD_REPORT, UcallError, UcallFrame};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

    #[derive(Default)]
    struct Latch(Mutex<Vec<u8>>);

    impl PioDevice for Latch {
        fn read(&self, _: u16, data: &mut [u8]) {
            data.fill(0xab);
        }
        fn write(&self, _: u16, data: &[u8]) -> io::Result<()> {
            if data == [0xff] {
                return Err(io::Error::other("full"));
            }
            self.0.lock().unwrap().extend_from_slice(data);
            Ok(())
        }
    }

    /// The exit through a devices-only context.
    fn devices_exit(
        exit: VcpuExit<'_>,
        bus: &IoBus,
        memory: &GuestMemoryMmap,
        reports: &mut Vec<Report>,
    ) -> Result<Flow, ExitError> {
        let mut ctx = Devices {
            bus,
            memory,
            reports,
            apic: NoApic,
        };
        handle_exit(exit, &mut ctx)
    }

    fn setup() -> (IoBus, Arc<Latch>, GuestMemoryMmap) {
        let latch = Arc::new(Latch::default());
        let mut bus = IoBus::new();
        bus.insert(0x3f8, 8, latch.clone()).unwrap();
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        (bus, latch, mem)
    }

    #[test]
    fn port_io_reaches_the_device_and_unknown_ports_are_guest_faults() {
        let (bus, latch, mem) = setup();
        let mut reports = vec![];
        let flow = devices_exit(VcpuExit::IoOut(0x3f8, b"x"), &bus, &mem, &mut reports).unwrap();
        assert_eq!(flow, Flow::Continue);
        assert_eq!(*latch.0.lock().unwrap(), b"x");
        let mut data = [0u8; 2];
        devices_exit(VcpuExit::IoIn(0x3f9, &mut data), &bus, &mem, &mut reports).unwrap();
        assert_eq!(data, [0xab, 0xab]);
        let err =
            devices_exit(VcpuExit::IoOut(0x1234, &[0x5a]), &bus, &mem, &mut reports).unwrap_err();
        assert!(matches!(
            err,
            ExitError::Guest(GuestFault::UnknownPort {
                port: 0x1234,
                write: true,
                ..
            })
        ));
        let err =
            devices_exit(VcpuExit::IoIn(0x60, &mut data), &bus, &mem, &mut reports).unwrap_err();
        assert!(matches!(
            err,
            ExitError::Guest(GuestFault::UnknownPort {
                port: 0x60,
                write: false,
                ..
            })
        ));
    }

    #[test]
    fn device_failures_are_the_vmms_not_the_guests() {
        let (bus, _, mem) = setup();
        let err =
            devices_exit(VcpuExit::IoOut(0x3f8, &[0xff]), &bus, &mem, &mut vec![]).unwrap_err();
        assert!(matches!(err, ExitError::Device { port: 0x3f8, .. }));
    }

    #[test]
    fn a_read_of_the_ucall_port_answers_the_probe() {
        let (bus, _, mem) = setup();
        let mut reports = vec![];
        let mut data = [0xffu8; 4];
        let flow = devices_exit(
            VcpuExit::IoIn(UCALL_PORT, &mut data),
            &bus,
            &mem,
            &mut reports,
        );
        assert_eq!(flow.unwrap(), Flow::Continue);
        assert_eq!(u32::from_le_bytes(data), test_guests::ucall::UCALL_PROBE);
        let mut byte = [0xffu8; 1];
        devices_exit(
            VcpuExit::IoIn(UCALL_PORT, &mut byte),
            &bus,
            &mem,
            &mut reports,
        )
        .unwrap();
        assert_eq!(byte[0], test_guests::ucall::UCALL_PROBE.to_le_bytes()[0]);
    }

    #[test]
    fn ucalls_report_values_and_finish() {
        let (bus, _, mem) = setup();
        mem.write_slice(b"tsc\0", GuestAddress(0x200)).unwrap();
        mem.write_obj(
            UcallFrame {
                cmd: CMD_REPORT,
                args: [0x200, 42, 0, 0],
            },
            GuestAddress(0x100),
        )
        .unwrap();
        let mut reports = vec![];
        let port = 0x100u32.to_le_bytes();
        assert_eq!(
            devices_exit(VcpuExit::IoOut(UCALL_PORT, &port), &bus, &mem, &mut reports).unwrap(),
            Flow::Continue
        );
        assert_eq!(
            reports,
            vec![Report {
                name: "tsc".into(),
                value: 42
            }]
        );
        mem.write_obj(
            UcallFrame {
                cmd: CMD_DONE,
                args: [0; 4],
            },
            GuestAddress(0x100),
        )
        .unwrap();
        assert_eq!(
            devices_exit(VcpuExit::IoOut(UCALL_PORT, &port), &bus, &mem, &mut reports).unwrap(),
            Flow::Done
        );
        let err =
            devices_exit(VcpuExit::IoOut(UCALL_PORT, &[1]), &bus, &mem, &mut reports).unwrap_err();
        assert!(matches!(
            err,
            ExitError::Guest(GuestFault::BadUcall(UcallError::BadWidth(1)))
        ));
    }

    #[test]
    fn a_vcpu_reports_at_most_max_reports_values() {
        let (bus, _, mem) = setup();
        mem.write_slice(b"n\0", GuestAddress(0x200)).unwrap();
        let frame = UcallFrame {
            cmd: CMD_REPORT,
            args: [0x200, 1, 0, 0],
        };
        mem.write_obj(frame, GuestAddress(0x100)).unwrap();
        let port = 0x100u32.to_le_bytes();
        let mut reports = vec![];
        let mut report =
            || devices_exit(VcpuExit::IoOut(UCALL_PORT, &port), &bus, &mem, &mut reports);
        for _ in 0..MAX_REPORTS {
            assert_eq!(report().unwrap(), Flow::Continue);
        }
        let err = report().unwrap_err();
        assert!(matches!(
            err,
            ExitError::Guest(GuestFault::TooManyReports { max: MAX_REPORTS })
        ));
        assert_eq!(reports.len(), MAX_REPORTS, "nothing past the cap is kept");
    }

    #[test]
    fn other_exits_end_the_run_with_a_named_fault() {
        let (bus, _, mem) = setup();
        let mut r = vec![];
        let fault = |exit| match devices_exit(exit, &bus, &mem, &mut vec![]) {
            Err(ExitError::Guest(f)) => f,
            other => panic!("expected a guest fault, got {other:?}"),
        };
        assert_eq!(fault(VcpuExit::Shutdown), GuestFault::TripleFault);
        assert_eq!(
            fault(VcpuExit::FailEntry(7, 1)),
            GuestFault::FailEntry { reason: 7, cpu: 1 }
        );
        assert_eq!(
            fault(VcpuExit::MmioWrite(0xfee0_0000, &[0; 4])),
            GuestFault::UnknownMmio {
                addr: 0xfee0_0000,
                write: true,
                len: 4
            }
        );
        assert_eq!(
            fault(VcpuExit::InternalError),
            GuestFault::UnhandledExit("KVM_EXIT_INTERNAL_ERROR")
        );
        assert_eq!(
            fault(VcpuExit::Unsupported(99)),
            GuestFault::UnsupportedExit(99)
        );
        assert_eq!(
            devices_exit(VcpuExit::Intr, &bus, &mem, &mut r).unwrap(),
            Flow::Kicked
        );
        assert_eq!(
            devices_exit(VcpuExit::Hlt, &bus, &mem, &mut r).unwrap(),
            Flow::Halted,
            "the run loop waits out a halt"
        );
        assert!(matches!(
            devices_exit(
                VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL),
                &bus,
                &mem,
                &mut r
            ),
            Err(ExitError::Vcpu(VcpuError::NoDirtyRing))
        ));
    }

    /// Records what each hook was asked; its APIC knows MSR 0x830 and the
    /// page at 0xfee0_0000, and its dirty ring drains.
    #[derive(Default)]
    struct Fake {
        bus: IoBus,
        memory: Option<GuestMemoryMmap>,
        reports: Vec<Report>,
        calls: Vec<String>,
    }

    impl ExitContext for Fake {
        type Memory = GuestMemoryMmap;
        type Apic = Self;
        fn memory(&self) -> &GuestMemoryMmap {
            self.memory.as_ref().unwrap()
        }
        fn reports(&mut self) -> &mut Vec<Report> {
            &mut self.reports
        }
        fn with_bus<R>(&mut self, f: impl FnOnce(&IoBus) -> R) -> R {
            self.calls.push("bus".into());
            f(&self.bus)
        }
        fn apic(&mut self) -> &mut Self {
            self
        }
        fn dirty_ring_full(&mut self) -> Result<(), VcpuError> {
            self.calls.push("drain".into());
            Ok(())
        }
    }

    impl ApicExits for Fake {
        fn read_msr(&mut self, index: u32) -> Option<u64> {
            self.calls.push(format!("rdmsr {index:#x}"));
            (index == 0x830).then_some(7)
        }
        fn write_msr(&mut self, index: u32, value: u64) -> bool {
            self.calls.push(format!("wrmsr {index:#x} {value}"));
            index == 0x830
        }
        fn read_apic_mmio(&mut self, addr: u64, data: &mut [u8]) -> bool {
            self.calls.push(format!("mmio read {addr:#x}"));
            data.fill(1);
            addr == 0xfee0_0000
        }
        fn write_apic_mmio(&mut self, addr: u64, _: &[u8]) -> bool {
            self.calls.push(format!("mmio write {addr:#x}"));
            addr == 0xfee0_0000
        }
        fn waiting(&mut self) {
            self.calls.push("waiting".into());
        }
        fn yield_to(&mut self, target: usize) {
            self.calls.push(format!("yield to {target}"));
        }
    }

    #[test]
    fn every_arm_reaches_its_hook() {
        use kvm_ioctls::{MsrExitReason, ReadMsrExit, WriteMsrExit};
        let (bus, _, mem) = setup();
        let mut f = Fake {
            bus,
            memory: Some(mem),
            ..Fake::default()
        };
        let (mut data, mut error) = (0u64, 0u8);
        fn read<'a>(index: u32, data: &'a mut u64, error: &'a mut u8) -> VcpuExit<'a> {
            let reason = MsrExitReason::Filter;
            VcpuExit::X86Rdmsr(ReadMsrExit {
                error,
                reason,
                index,
                data,
            })
        }
        assert_eq!(
            handle_exit(read(0x830, &mut data, &mut error), &mut f).unwrap(),
            Flow::Continue
        );
        assert_eq!((data, error), (7, 0));
        handle_exit(read(0x831, &mut data, &mut error), &mut f).unwrap();
        assert_eq!(error, 1, "an MSR the APIC refuses is a #GP");
        let mut error = 0u8;
        fn write(index: u32, error: &mut u8) -> VcpuExit<'_> {
            let reason = MsrExitReason::Filter;
            VcpuExit::X86Wrmsr(WriteMsrExit {
                error,
                reason,
                index,
                data: 5,
            })
        }
        handle_exit(write(0x830, &mut error), &mut f).unwrap();
        assert_eq!(error, 0);
        handle_exit(write(0x900, &mut error), &mut f).unwrap();
        assert_eq!(error, 1);
        let mut bytes = [0u8; 4];
        handle_exit(VcpuExit::MmioRead(0xfee0_0000, &mut bytes), &mut f).unwrap();
        assert_eq!(bytes, [1; 4]);
        handle_exit(VcpuExit::MmioWrite(0xfee0_0000, &[0; 4]), &mut f).unwrap();
        assert!(matches!(
            handle_exit(VcpuExit::MmioWrite(0xfed0_0000, &[0; 4]), &mut f),
            Err(ExitError::Guest(GuestFault::UnknownMmio {
                write: true,
                ..
            }))
        ));
        handle_exit(VcpuExit::IoOut(PAUSE_PORT, &[0]), &mut f).unwrap();
        handle_exit(VcpuExit::IoOut(YIELD_PORT, &[1, 2]), &mut f).unwrap();
        handle_exit(VcpuExit::IoOut(0x3f8, b"x"), &mut f).unwrap();
        handle_exit(VcpuExit::Unsupported(KVM_EXIT_DIRTY_RING_FULL), &mut f).unwrap();
        assert_eq!(
            handle_exit(VcpuExit::IrqWindowOpen, &mut f).unwrap(),
            Flow::Continue
        );
        assert_eq!(handle_exit(VcpuExit::Hlt, &mut f).unwrap(), Flow::Halted);
        assert_eq!(
            f.calls,
            [
                "rdmsr 0x830",
                "rdmsr 0x831",
                "wrmsr 0x830 5",
                "wrmsr 0x900 5",
                "mmio read 0xfee00000",
                "mmio write 0xfee00000",
                "mmio write 0xfed00000",
                "waiting",
                "yield to 513",
                "bus",
                "drain",
            ]
        );
    }
}
