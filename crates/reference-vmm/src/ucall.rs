//! The ucall channel: how guest programs report to the VMM, as KVM selftests do.
//!
//! The guest writes a [`UcallFrame`] anywhere in its memory and executes a 32-bit
//! `out` of the frame's guest physical address to [`UCALL_PORT`]. The VMM reads
//! the frame back and decodes it into a [`Ucall`]. Everything in the frame is
//! guest-controlled: decoding checks every address and length and returns a
//! [`UcallError`] instead of trusting it.

use vm_memory::{ByteValued, Bytes, GuestAddress, GuestMemory};

/// The port guest programs send ucalls to.
pub const UCALL_PORT: u16 = 0x1000;
/// A named value for the run report: `(name, value)`.
pub const CMD_REPORT: u64 = 1;
/// A failed guest assertion: `(message, a, b)`.
pub const CMD_ASSERT_FAIL: u64 = 2;
/// The vCPU has finished its program.
pub const CMD_DONE: u64 = 3;
/// The runtime caught an exception it has no handler for: `(vector, error code, rip, cr2)`.
pub const CMD_EXCEPTION: u64 = 4;

/// Longest string (without its NUL) a ucall may point at.
pub const MAX_STRING_LEN: usize = 64;

/// A ucall as the guest lays it out in memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UcallFrame {
    /// One of the `CMD_*` values.
    pub cmd: u64,
    /// Command arguments.
    pub args: [u64; 4],
}

// SAFETY: UcallFrame is repr(C), made of u64s only, so it has no padding and
// every bit pattern is a valid value.
unsafe impl ByteValued for UcallFrame {}

/// A decoded ucall.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ucall {
    /// A named value.
    Report {
        /// Name of the value.
        name: String,
        /// The value.
        value: u64,
    },
    /// A guest assertion failed.
    AssertFailed {
        /// What the guest asserted.
        message: String,
        /// First compared value.
        a: u64,
        /// Second compared value.
        b: u64,
    },
    /// The program finished on this vCPU.
    Done,
    /// An exception the guest runtime could not handle.
    Exception {
        /// Exception vector.
        vector: u64,
        /// Error code (0 where the CPU pushes none).
        error_code: u64,
        /// Address of the faulting instruction.
        rip: u64,
        /// CR2 at the time (the faulting address for #PF).
        cr2: u64,
    },
}

/// Why a ucall could not be decoded.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum UcallError {
    /// The `out` was not 4 bytes wide.
    #[error("ucall must be a 4-byte out, got {0} bytes")]
    BadWidth(usize),
    /// The frame is not inside guest memory.
    #[error("ucall frame at {0:#x} is outside guest memory")]
    FrameOutsideMemory(u64),
    /// The command is not one of the known ones.
    #[error("unknown ucall command {0:#x}")]
    UnknownCommand(u64),
    /// A string argument is not a short NUL-terminated UTF-8 string in guest memory.
    #[error("ucall string at {addr:#x}: {reason}")]
    BadString {
        /// Where the guest said the string is.
        addr: u64,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// Decodes the ucall whose `out` carried `data`, reading the frame from `mem`.
pub fn decode<M: GuestMemory>(mem: &M, data: &[u8]) -> Result<Ucall, UcallError> {
    let addr: [u8; 4] = data
        .try_into()
        .map_err(|_| UcallError::BadWidth(data.len()))?;
    let addr = u64::from(u32::from_le_bytes(addr));
    let frame: UcallFrame = mem
        .read_obj(GuestAddress(addr))
        .map_err(|_| UcallError::FrameOutsideMemory(addr))?;
    let [a0, a1, a2, a3] = frame.args;
    Ok(match frame.cmd {
        CMD_REPORT => Ucall::Report {
            name: read_string(mem, a0)?,
            value: a1,
        },
        CMD_ASSERT_FAIL => Ucall::AssertFailed {
            message: read_string(mem, a0)?,
            a: a1,
            b: a2,
        },
        CMD_DONE => Ucall::Done,
        CMD_EXCEPTION => Ucall::Exception {
            vector: a0,
            error_code: a1,
            rip: a2,
            cr2: a3,
        },
        other => return Err(UcallError::UnknownCommand(other)),
    })
}

/// Reads a NUL-terminated UTF-8 string of at most [`MAX_STRING_LEN`] bytes.
fn read_string<M: GuestMemory>(mem: &M, addr: u64) -> Result<String, UcallError> {
    let bad = |reason| UcallError::BadString { addr, reason };
    let mut buf = Vec::with_capacity(MAX_STRING_LEN);
    for i in 0..=MAX_STRING_LEN as u64 {
        let at = addr.checked_add(i).ok_or(bad("address overflows"))?;
        let byte: u8 = mem
            .read_obj(GuestAddress(at))
            .map_err(|_| bad("outside guest memory"))?;
        if byte == 0 {
            return String::from_utf8(buf).map_err(|_| bad("not UTF-8"));
        }
        buf.push(byte);
    }
    Err(bad("no NUL within 64 bytes"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    const FRAME: u64 = 0x1000;
    const STR: u64 = 0x2000;

    fn memory() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x4000)]).unwrap()
    }

    fn send(mem: &GuestMemoryMmap, cmd: u64, args: [u64; 4]) -> Result<Ucall, UcallError> {
        mem.write_obj(UcallFrame { cmd, args }, GuestAddress(FRAME))
            .unwrap();
        decode(mem, &(FRAME as u32).to_le_bytes())
    }

    #[test]
    fn decodes_every_command() {
        let mem = memory();
        mem.write_slice(b"apic_id\0", GuestAddress(STR)).unwrap();
        let report = send(&mem, CMD_REPORT, [STR, 7, 0, 0]).unwrap();
        assert_eq!(
            report,
            Ucall::Report {
                name: "apic_id".into(),
                value: 7
            }
        );
        let failed = send(&mem, CMD_ASSERT_FAIL, [STR, 1, 2, 0]).unwrap();
        assert_eq!(
            failed,
            Ucall::AssertFailed {
                message: "apic_id".into(),
                a: 1,
                b: 2
            }
        );
        assert_eq!(send(&mem, CMD_DONE, [0; 4]).unwrap(), Ucall::Done);
        let exc = send(&mem, CMD_EXCEPTION, [13, 0, 0x10_0000, 0]).unwrap();
        assert_eq!(
            exc,
            Ucall::Exception {
                vector: 13,
                error_code: 0,
                rip: 0x10_0000,
                cr2: 0
            }
        );
    }

    #[test]
    fn rejects_a_bad_width_and_a_frame_outside_memory() {
        let mem = memory();
        assert_eq!(decode(&mem, &[0; 2]), Err(UcallError::BadWidth(2)));
        let far = 0xffff_fff0u32.to_le_bytes();
        assert_eq!(
            decode(&mem, &far),
            Err(UcallError::FrameOutsideMemory(0xffff_fff0))
        );
        // A frame that starts inside memory but runs past its end.
        let edge = (0x4000u32 - 8).to_le_bytes();
        assert_eq!(
            decode(&mem, &edge),
            Err(UcallError::FrameOutsideMemory(0x3ff8))
        );
    }

    #[test]
    fn rejects_unknown_commands_and_bad_strings() {
        let mem = memory();
        assert_eq!(
            send(&mem, 0xbad, [0; 4]),
            Err(UcallError::UnknownCommand(0xbad))
        );
        let outside = send(&mem, CMD_REPORT, [u64::MAX - 2, 0, 0, 0]).unwrap_err();
        assert!(matches!(outside, UcallError::BadString { .. }), "{outside}");
        mem.write_slice(&[b'x'; 100], GuestAddress(STR)).unwrap();
        let long = send(&mem, CMD_REPORT, [STR, 0, 0, 0]).unwrap_err();
        assert_eq!(
            long,
            UcallError::BadString {
                addr: STR,
                reason: "no NUL within 64 bytes"
            }
        );
        mem.write_slice(&[0xff, 0xfe, 0], GuestAddress(STR))
            .unwrap();
        let utf8 = send(&mem, CMD_ASSERT_FAIL, [STR, 0, 0, 0]).unwrap_err();
        assert_eq!(
            utf8,
            UcallError::BadString {
                addr: STR,
                reason: "not UTF-8"
            }
        );
    }
}
