//! What a guest did that ends its run: the faults the exit handler finds.

use test_guests::ucall::UcallError;

/// What a guest did that ends its run.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum GuestFault {
    /// Port I/O where no device lives.
    #[error("port {} of {} byte(s) at port {port:#x}, where no device lives{}",
        if *write { "write" } else { "read" }, data.len(), hex_data(*write, data))]
    UnknownPort {
        /// The port.
        port: u16,
        /// Whether it was an `out`.
        write: bool,
        /// The bytes written (or a buffer of the read's size).
        data: Vec<u8>,
    },
    /// MMIO where no device lives.
    #[error("MMIO {} of {len} byte(s) at {addr:#x}, where no device lives",
        if *write { "write" } else { "read" })]
    UnknownMmio {
        /// Guest physical address.
        addr: u64,
        /// Whether it was a write.
        write: bool,
        /// Access size.
        len: usize,
    },
    /// The vCPU shut down: a triple fault (KVM_EXIT_SHUTDOWN).
    #[error("triple fault: the vCPU shut down (KVM_EXIT_SHUTDOWN)")]
    TripleFault,
    /// An exception the guest runtime has no handler for.
    #[error("unhandled exception {} (vector {vector}), error code {error_code:#x}, at rip {rip:#x}, cr2 {cr2:#x}",
        exception_name(*vector))]
    Exception {
        /// Exception vector.
        vector: u64,
        /// Error code.
        error_code: u64,
        /// Faulting instruction.
        rip: u64,
        /// CR2 at the time.
        cr2: u64,
    },
    /// A guest assertion failed.
    #[error("guest assertion failed: {message} (a = {a:#x}, b = {b:#x})")]
    AssertFailed {
        /// The assertion.
        message: String,
        /// First value.
        a: u64,
        /// Second value.
        b: u64,
    },
    /// More named values than one vCPU may report.
    #[error(
        "more than {max} reports from one vCPU (a guest that reports in a loop? \
         `run --max-reports N` lifts the cap)"
    )]
    TooManyReports {
        /// The cap ([`crate::VmConfig::max_reports`]).
        max: usize,
    },
    /// A ucall that cannot be decoded.
    #[error("bad ucall: {0}")]
    BadUcall(#[from] UcallError),
    /// `hlt` with nothing that could ever wake the vCPU.
    #[error("halted (KVM_EXIT_HLT), and this VMM has no interrupt source that could wake it")]
    HaltedForever,
    /// KVM could not enter the guest.
    #[error("KVM_EXIT_FAIL_ENTRY: hardware reason {reason:#x} on host CPU {cpu}")]
    FailEntry {
        /// Hardware entry failure reason.
        reason: u64,
        /// Host CPU.
        cpu: u32,
    },
    /// An exit this VMM does not handle, by its `KVM_EXIT_*` name.
    #[error("unhandled exit {0}")]
    UnhandledExit(&'static str),
    /// An exit reason kvm-ioctls does not decode (`KVM_EXIT_*` number).
    #[error("unhandled exit reason {0}")]
    UnsupportedExit(u32),
}

fn hex_data(write: bool, data: &[u8]) -> String {
    if !write {
        return String::new();
    }
    let bytes: Vec<String> = data.iter().map(|b| format!("{b:02x}")).collect();
    format!(", data [{}]", bytes.join(" "))
}

/// The architectural mnemonic of exception `vector`.
pub fn exception_name(vector: u64) -> &'static str {
    const NAMES: [&str; 32] = [
        "#DE",
        "#DB",
        "NMI",
        "#BP",
        "#OF",
        "#BR",
        "#UD",
        "#NM",
        "#DF",
        "CSO",
        "#TS",
        "#NP",
        "#SS",
        "#GP",
        "#PF",
        "(reserved)",
        "#MF",
        "#AC",
        "#MC",
        "#XM",
        "#VE",
        "#CP",
        "(reserved)",
        "(reserved)",
        "(reserved)",
        "(reserved)",
        "(reserved)",
        "(reserved)",
        "#HV",
        "#VC",
        "#SX",
        "(reserved)",
    ];
    usize::try_from(vector)
        .ok()
        .and_then(|v| NAMES.get(v))
        .copied()
        .unwrap_or("(not an exception)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_say_what_happened() {
        let port = GuestFault::UnknownPort {
            port: 0x1234,
            write: true,
            data: vec![0x5a],
        };
        assert_eq!(
            port.to_string(),
            "port write of 1 byte(s) at port 0x1234, where no device lives, data [5a]"
        );
        let exc = GuestFault::Exception {
            vector: 13,
            error_code: 0,
            rip: 0x10_0040,
            cr2: 0,
        };
        assert!(
            exc.to_string()
                .starts_with("unhandled exception #GP (vector 13)")
        );
        assert_eq!(exception_name(99), "(not an exception)");
    }
}
