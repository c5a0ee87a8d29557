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
/// What a 4-byte read of [`UCALL_PORT`] returns on a VMM that implements the port, so that a guest
/// booted from an image file can tell it from a VMM without the port, where
/// the read returns all ones (`programs/pvh.s`).
pub const UCALL_PROBE: u32 = 0x7563_616c; // "ucal"
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

/// A named value a guest reported through a ucall.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Its name.
    pub name: String,
    /// Its value.
    pub value: u64,
}

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
    /// A ucall text line that does not follow the format ([`TEXT_TAG`]).
    #[error("ucall text line: {reason}")]
    BadLine {
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
    from_frame(frame, |addr| read_string(mem, addr))
}

/// The ucall a frame holds; `string` reads the string argument.
fn from_frame(
    frame: UcallFrame,
    string: impl FnOnce(u64) -> Result<String, UcallError>,
) -> Result<Ucall, UcallError> {
    let [a0, a1, a2, a3] = frame.args;
    Ok(match frame.cmd {
        CMD_REPORT => Ucall::Report {
            name: string(a0)?,
            value: a1,
        },
        CMD_ASSERT_FAIL => Ucall::AssertFailed {
            message: string(a0)?,
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

/// The start of a ucall sent as a line of text on the serial console, the
/// transport of a guest booted by a VMM without the ucall port (QEMU):
/// `@ucall <vcpu> <cmd> <arg0> <arg1> <arg2> <arg3>[ <string at arg0>]`, in
/// decimal (see `rt_ucall_text` in `programs/runtime.s`).
pub const TEXT_TAG: &str = "@ucall ";

/// Decodes a ucall text line (with or without its [`TEXT_TAG`]) into the
/// vCPU that sent it and the call.
pub fn decode_text(line: &str) -> Result<(u32, Ucall), UcallError> {
    let bad = |reason| UcallError::BadLine { reason };
    let line = line.strip_prefix(TEXT_TAG).unwrap_or(line);
    let mut fields = line.splitn(7, ' ');
    let mut number = || -> Result<u64, UcallError> {
        let field = fields.next().ok_or(bad("fewer than 6 numbers"))?;
        field.parse().map_err(|_| bad("a field is not a number"))
    };
    let vcpu = u32::try_from(number()?).map_err(|_| bad("vCPU index out of range"))?;
    let frame = UcallFrame {
        cmd: number()?,
        args: [number()?, number()?, number()?, number()?],
    };
    let text = fields.next();
    let call = from_frame(frame, |addr| match text {
        Some(s) if s.len() <= MAX_STRING_LEN => Ok(s.to_owned()),
        Some(_) => Err(UcallError::BadString {
            addr,
            reason: "longer than 64 bytes",
        }),
        None => Err(UcallError::BadString {
            addr,
            reason: "missing from the line",
        }),
    })?;
    Ok((vcpu, call))
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
    /// A #GP at the start of the guest image, as both transports carry it.
    const GP_AT_IMAGE: Ucall = Ucall::Exception {
        vector: 13,
        error_code: 0,
        rip: 0x10_0000,
        cr2: 0,
    };
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
        assert_eq!(exc, GP_AT_IMAGE);
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

    #[test]
    fn text_lines_decode_to_the_same_calls() {
        assert_eq!(
            decode_text("@ucall 3 1 4096 42 0 0 apic_id"),
            Ok((
                3,
                Ucall::Report {
                    name: "apic_id".into(),
                    value: 42
                }
            ))
        );
        assert_eq!(
            decode_text("0 2 4096 7 8 0 rounds done: too few"),
            Ok((
                0,
                Ucall::AssertFailed {
                    message: "rounds done: too few".into(),
                    a: 7,
                    b: 8
                }
            ))
        );
        assert_eq!(decode_text("@ucall 1 3 0 0 0 0"), Ok((1, Ucall::Done)));
        assert_eq!(
            decode_text("@ucall 0 4 13 0 1048576 0"),
            Ok((0, GP_AT_IMAGE))
        );
    }

    #[test]
    fn malformed_text_lines_are_errors() {
        let line = |reason| Err(UcallError::BadLine { reason });
        assert_eq!(decode_text("@ucall 0 3 0 0"), line("fewer than 6 numbers"));
        assert_eq!(
            decode_text("@ucall 0 3 0 x 0 0"),
            line("a field is not a number")
        );
        assert_eq!(
            decode_text("@ucall 4294967296 3 0 0 0 0"),
            line("vCPU index out of range")
        );
        assert_eq!(
            decode_text("@ucall 0 9 0 0 0 0"),
            Err(UcallError::UnknownCommand(9))
        );
        let missing = decode_text("@ucall 0 1 4096 1 0 0").unwrap_err();
        assert!(matches!(missing, UcallError::BadString { .. }), "{missing}");
        let long = format!("@ucall 0 1 4096 1 0 0 {}", "n".repeat(65));
        assert!(matches!(
            decode_text(&long),
            Err(UcallError::BadString { .. })
        ));
    }
}
