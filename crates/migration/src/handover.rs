//! The hand-over protocol: the bytes a source and its destination exchange
//! around the [stream](super::stream), so that the guest runs at exactly
//! one of them, or (only where the network loses the commit itself) at
//! neither and the source says so; never at both.
//!
//! ```text
//! source                                        destination
//! connect, TLS handshake, stream header  ─────▶ each connection on its own
//!                                               thread, HANDSHAKE_TIMEOUT
//!                                        ◀───── TAKEN, or REFUSED and why
//!    (the guest runs: --migrate-after-ms)
//! Config, pre-copy page runs             ─────▶ the VM made, pages written
//!    (post-copy: Postcopy after Config)  ◀───── MADE; the source pauses only then
//!    (pause: the clock of --downtime-ms + HANDOVER_MARGIN starts)
//! last page runs, every Vcpu, End        ─────▶ every vCPU's state restored
//!                                        ◀───── READY, or REFUSED and why
//! COMMIT (or ABORT)                      ─────▶ only now may its VM run
//!    (the vCPUs here end)                ◀───── RUNNING
//! ```
//!
//! What each side does when the other disappears:
//!
//! | the peer is lost | at the source | at the destination |
//! |---|---|---|
//! | before TAKEN | an error before its guest starts | drops the connection, logs it, takes the next |
//! | during the stream | resumes its guest | no VM ran: exits with the error |
//! | before READY (or past the pause's limit) | resumes its guest, sends ABORT | gets ABORT or nothing: its VM never runs |
//! | after READY, before COMMIT arrives | (had sent nothing: resumed; had sent COMMIT: see below) | waits [`PEER_TIMEOUT`](super::PEER_TIMEOUT) for it, then exits: its VM never ran |
//! | after COMMIT was sent | never resumes: without RUNNING within [`HANDOVER_MARGIN`] it reports the guest as running there or lost | runs the guest, whether or not RUNNING arrives |
//!
//! A source that wrote its COMMIT never takes the guest back, whatever
//! happens next: a commit the network lost after it left (the one case
//! where the guest then runs nowhere) cannot be told from one that arrived
//! and whose RUNNING was lost, and resuming on a guess could run the guest
//! twice.

use std::io::{self, Read, Write};
use std::time::Duration;

use super::MigrationError;

/// How long past the downtime limit the source's guest may stand paused
/// waiting for the destination's READY (the last pages' trip, the vCPU
/// states restored there), and how long the source then waits for RUNNING.
pub const HANDOVER_MARGIN: Duration = Duration::from_secs(1);

/// The destination took this source's connection (its TLS certificate and
/// stream header).
const TAKEN: u8 = 0xA5;
/// The destination restored the whole VM and waits for the commit.
const READY: u8 = 0;
/// Post-copy: the destination made the VM; the source may pause its guest.
const MADE: u8 = 0x4D;
/// The destination refused: a length (u32, little-endian) and why follow.
const REFUSED: u8 = 1;
/// The source hands the guest over: the destination may run it.
const COMMIT: u8 = 0xC3;
/// The source keeps the guest: the destination must not run it.
const ABORT: u8 = 0xAB;
/// The destination runs the guest.
const RUNNING: u8 = 0x52;

/// The longest refusal read back.
const MAX_REASON: usize = 4096;

/// Sends the destination's answer after the whole stream: READY, or
/// REFUSED and why.
pub fn answer(out: &mut impl Write, result: Result<(), &str>) -> io::Result<()> {
    match result {
        Ok(()) => out.write_all(&[READY])?,
        Err(why) => refuse(out, why)?,
    }
    out.flush()
}

/// Sends REFUSED and why.
fn refuse(out: &mut impl Write, why: &str) -> io::Result<()> {
    let why = &why.as_bytes()[..why.len().min(MAX_REASON)];
    out.write_all(&[REFUSED])?;
    out.write_all(&(why.len() as u32).to_le_bytes())?;
    out.write_all(why)
}

/// Sends TAKEN: the source may start its guest.
pub(crate) fn take(out: &mut impl Write) -> io::Result<()> {
    out.write_all(&[TAKEN])?;
    out.flush()
}

/// Refuses a connection before it is taken, saying why.
pub(crate) fn turn_away(out: &mut impl Write, why: &str) -> io::Result<()> {
    refuse(out, why)?;
    out.flush()
}

/// What the destination said: `expected`, or a refusal (its reason), or
/// something else; `Err` where nothing could be read.
fn read_reply(input: &mut impl Read, expected: u8) -> io::Result<Result<(), Reply>> {
    let mut tag = [0u8];
    input.read_exact(&mut tag)?;
    match tag[0] {
        t if t == expected => Ok(Ok(())),
        REFUSED => {
            let mut len = [0u8; 4];
            input.read_exact(&mut len)?;
            let len = (u32::from_le_bytes(len) as usize).min(MAX_REASON);
            let mut why = vec![0u8; len];
            input.read_exact(&mut why)?;
            Ok(Err(Reply::Refused(
                String::from_utf8_lossy(&why).into_owned(),
            )))
        }
        other => Ok(Err(Reply::Other(other))),
    }
}

/// A reply that was not the one expected.
#[derive(Debug)]
enum Reply {
    Refused(String),
    Other(u8),
}

/// Reads TAKEN at the source, after its stream header.
pub(crate) fn read_taken(input: &mut impl Read) -> Result<(), MigrationError> {
    match read_reply(input, TAKEN) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(Reply::Refused(why))) => Err(MigrationError::Turned(why)),
        Ok(Err(Reply::Other(byte))) => Err(MigrationError::Turned(format!(
            "it answered {byte:#04x}, which no reference-vmm destination sends"
        ))),
        Err(e) => Err(MigrationError::NotTaken(e)),
    }
}

/// Reads the destination's answer after the whole stream: READY, or its
/// refusal.
pub(crate) fn read_answer(input: &mut impl Read) -> Result<(), MigrationError> {
    read_or_refusal(input, READY, "READY")
}

/// Sends MADE at a post-copy destination: its VM exists.
pub(crate) fn made(out: &mut impl Write) -> io::Result<()> {
    out.write_all(&[MADE])?;
    out.flush()
}

/// Reads MADE at a post-copy source, before its pause: or the
/// destination's refusal.
pub(crate) fn read_made(input: &mut impl Read) -> Result<(), MigrationError> {
    read_or_refusal(input, MADE, "saying it made the VM")
}

/// `expected` (`what`, in words), or the destination's refusal.
fn read_or_refusal(input: &mut impl Read, expected: u8, what: &str) -> Result<(), MigrationError> {
    match read_reply(input, expected) {
        Ok(Ok(())) => Ok(()),
        Ok(Err(Reply::Refused(why))) => Err(MigrationError::Refused(why)),
        Ok(Err(Reply::Other(byte))) => Err(MigrationError::Refused(format!(
            "it answered {byte:#04x} instead of {what}"
        ))),
        Err(e) => Err(MigrationError::NoAnswer(e)),
    }
}

/// Sends COMMIT: once this returns `Ok`, the guest is the destination's.
pub(crate) fn commit(out: &mut impl Write) -> io::Result<()> {
    out.write_all(&[COMMIT])?;
    out.flush()
}

/// Sends ABORT, where the connection still takes it: the source keeps the
/// guest.
pub(crate) fn abort(out: &mut impl Write) {
    let _ = out.write_all(&[ABORT]).and_then(|()| out.flush());
}

/// Waits for the source's COMMIT at the destination: `Ok` only for it.
pub fn read_commit(input: &mut impl Read) -> Result<(), MigrationError> {
    let mut tag = [0u8];
    match input.read_exact(&mut tag) {
        Ok(()) if tag[0] == COMMIT => Ok(()),
        Ok(()) if tag[0] == ABORT => Err(MigrationError::NotCommitted(
            "it aborted the hand-over and keeps the guest".into(),
        )),
        Ok(()) => Err(MigrationError::NotCommitted(format!(
            "it sent {:#04x} instead of COMMIT",
            tag[0]
        ))),
        Err(e) => Err(MigrationError::NotCommitted(e.to_string())),
    }
}

/// Sends RUNNING at the destination, where the connection takes it: the
/// guest runs here whether or not it arrives.
pub fn running(out: &mut impl Write) {
    let _ = out.write_all(&[RUNNING]).and_then(|()| out.flush());
}

/// Reads RUNNING at the source, after its COMMIT.
pub(crate) fn read_running(input: &mut impl Read) -> Result<(), MigrationError> {
    let mut tag = [0u8];
    match input.read_exact(&mut tag) {
        Ok(()) if tag[0] == RUNNING => Ok(()),
        Ok(()) => Err(MigrationError::Unconfirmed(format!(
            "it sent {:#04x} instead of RUNNING",
            tag[0]
        ))),
        Err(e) => Err(MigrationError::Unconfirmed(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reaches_the_source_with_its_reason() {
        let mut wire = Vec::new();
        answer(&mut wire, Err("no room")).unwrap();
        let e = read_answer(&mut &wire[..]).unwrap_err();
        assert_eq!(e.to_string(), "the destination refused the VM: no room");
        wire.clear();
        answer(&mut wire, Ok(())).unwrap();
        assert!(read_answer(&mut &wire[..]).is_ok());
        assert!(matches!(
            read_answer(&mut &[][..]),
            Err(MigrationError::NoAnswer(_))
        ));
    }

    #[test]
    fn a_source_turned_away_hears_why_and_a_stranger_byte_is_no_taken() {
        let mut wire = Vec::new();
        turn_away(&mut wire, "TLS sources only").unwrap();
        let e = read_taken(&mut &wire[..]).unwrap_err().to_string();
        assert!(e.ends_with("TLS sources only"), "{e}");
        take(&mut wire).unwrap();
        assert!(read_taken(&mut &[TAKEN][..]).is_ok());
        assert!(read_taken(&mut &[READY][..]).is_err());
        assert!(matches!(
            read_taken(&mut &[][..]),
            Err(MigrationError::NotTaken(_))
        ));
    }

    #[test]
    fn only_a_commit_lets_the_destination_run_the_guest() {
        let mut wire = Vec::new();
        commit(&mut wire).unwrap();
        assert!(read_commit(&mut &wire[..]).is_ok());
        wire.clear();
        abort(&mut wire);
        let e = read_commit(&mut &wire[..]).unwrap_err().to_string();
        assert!(e.contains("aborted the hand-over"), "{e}");
        for not_a_commit in [&[][..], &[READY], &[RUNNING]] {
            assert!(read_commit(&mut &not_a_commit[..]).is_err());
        }
        let mut wire = Vec::new();
        running(&mut wire);
        assert!(read_running(&mut &wire[..]).is_ok());
        assert!(matches!(
            read_running(&mut &[][..]),
            Err(MigrationError::Unconfirmed(_))
        ));
    }

    #[test]
    fn a_refusal_longer_than_the_limit_is_cut_to_it() {
        let mut wire = Vec::new();
        answer(&mut wire, Err(&"x".repeat(MAX_REASON * 2))).unwrap();
        let Err(MigrationError::Refused(why)) = read_answer(&mut &wire[..]) else {
            panic!("a refusal")
        };
        assert_eq!(why.len(), MAX_REASON);
    }
}
