//! What the VMM does with each vCPU exit.
//!
//! A free function over the exit and the devices, as in Firecracker, so unit tests
//! can drive it with synthetic exits. Every exit a guest can cause ends in either
//! a [`Flow`] or an [`ExitError`]; none panics.

use std::io;

use kvm_ioctls::VcpuExit;
use vm_memory::GuestMemory;

use crate::devices::IoBus;
use crate::error::GuestFault;
use crate::ucall::{self, UCALL_PORT, Ucall};

/// What the run loop does after an exit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Enter the guest again.
    Continue,
    /// `KVM_RUN` was interrupted by a kick: acknowledge it, look at requests.
    Kicked,
    /// The program finished on this vCPU.
    Done,
}

/// Why an exit ends the run.
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
}

/// The most named values one vCPU may report in a run: a guest that reports
/// in a loop would otherwise grow the VMM without bound. The built-in
/// programs report a handful each.
pub const MAX_REPORTS: usize = 1024;

/// A named value a guest reported through ucall.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Its name.
    pub name: String,
    /// Its value.
    pub value: u64,
}

/// Handles one exit; named values the guest reports are appended to `reports`
/// (at most [`MAX_REPORTS`]: one more is [`GuestFault::TooManyReports`]).
pub fn handle_exit<M: GuestMemory>(
    exit: VcpuExit<'_>,
    bus: &IoBus,
    memory: &M,
    reports: &mut Vec<Report>,
) -> Result<Flow, ExitError> {
    match exit {
        VcpuExit::IoOut(UCALL_PORT, data) => handle_ucall(
            ucall::decode(memory, data).map_err(GuestFault::from)?,
            reports,
        ),
        VcpuExit::IoOut(port, data) => {
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
        VcpuExit::IoIn(port, data) => {
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
        VcpuExit::MmioRead(addr, data) => Err(GuestFault::UnknownMmio {
            addr,
            write: false,
            len: data.len(),
        }
        .into()),
        VcpuExit::MmioWrite(addr, data) => Err(GuestFault::UnknownMmio {
            addr,
            write: true,
            len: data.len(),
        }
        .into()),
        VcpuExit::Intr => Ok(Flow::Kicked),
        VcpuExit::Hlt => Err(GuestFault::HaltedForever.into()),
        VcpuExit::Shutdown => Err(GuestFault::TripleFault.into()),
        VcpuExit::FailEntry(reason, cpu) => Err(GuestFault::FailEntry { reason, cpu }.into()),
        other => Err(GuestFault::UnhandledExit(format!("{other:?}")).into()),
    }
}

fn handle_ucall(call: Ucall, reports: &mut Vec<Report>) -> Result<Flow, ExitError> {
    match call {
        Ucall::Report { .. } if reports.len() >= MAX_REPORTS => {
            Err(GuestFault::TooManyReports { max: MAX_REPORTS }.into())
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
    use crate::ucall::{CMD_DONE, CMD_REPORT, UcallError, UcallFrame};
    use std::sync::{Arc, Mutex};
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
        let flow = handle_exit(VcpuExit::IoOut(0x3f8, b"x"), &bus, &mem, &mut reports).unwrap();
        assert_eq!(flow, Flow::Continue);
        assert_eq!(*latch.0.lock().unwrap(), b"x");
        let mut data = [0u8; 2];
        handle_exit(VcpuExit::IoIn(0x3f9, &mut data), &bus, &mem, &mut reports).unwrap();
        assert_eq!(data, [0xab, 0xab]);
        let err =
            handle_exit(VcpuExit::IoOut(0x1234, &[0x5a]), &bus, &mem, &mut reports).unwrap_err();
        assert!(matches!(
            err,
            ExitError::Guest(GuestFault::UnknownPort {
                port: 0x1234,
                write: true,
                ..
            })
        ));
        let err =
            handle_exit(VcpuExit::IoIn(0x60, &mut data), &bus, &mem, &mut reports).unwrap_err();
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
            handle_exit(VcpuExit::IoOut(0x3f8, &[0xff]), &bus, &mem, &mut vec![]).unwrap_err();
        assert!(matches!(err, ExitError::Device { port: 0x3f8, .. }));
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
            handle_exit(VcpuExit::IoOut(UCALL_PORT, &port), &bus, &mem, &mut reports).unwrap(),
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
            handle_exit(VcpuExit::IoOut(UCALL_PORT, &port), &bus, &mem, &mut reports).unwrap(),
            Flow::Done
        );
        let err =
            handle_exit(VcpuExit::IoOut(UCALL_PORT, &[1]), &bus, &mem, &mut reports).unwrap_err();
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
            || handle_exit(VcpuExit::IoOut(UCALL_PORT, &port), &bus, &mem, &mut reports);
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
        let fault = |exit| match handle_exit(exit, &bus, &mem, &mut vec![]) {
            Err(ExitError::Guest(f)) => f,
            other => panic!("expected a guest fault, got {other:?}"),
        };
        assert_eq!(fault(VcpuExit::Shutdown), GuestFault::TripleFault);
        assert_eq!(fault(VcpuExit::Hlt), GuestFault::HaltedForever);
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
            GuestFault::UnhandledExit("InternalError".into())
        );
        assert_eq!(
            handle_exit(VcpuExit::Intr, &bus, &mem, &mut r).unwrap(),
            Flow::Kicked
        );
    }
}
