//! Live migration, snapshot and restore: a running VM's memory and vCPU
//! state, sent as one [`stream`] to another reference-vmm process
//! (`run --migrate-to`, `receive --listen`) or to a file
//! (`run --snapshot-to`, `restore`).
//!
//! # Pre-copy
//! The source ([`source::Migration`]) tracks dirty pages with the
//! [dirty-log](dirty_log) backend chosen (`bitmap`, `manual`, `ring`) while
//! the guest runs: a first full pass (with manual protect's
//! `INITIALLY_SET`, the first harvest), then rounds of the pages dirtied
//! since, until one round's pages would take no longer than the downtime
//! target at the bandwidth measured, or the round limit. Then it pauses the
//! vCPUs ([`crate::pause`]), sends the last dirty pages (the VMM's own writes
//! among them) and every vCPU's [`state`], and waits for the
//! destination's answer: once the destination has restored everything it
//! answers, the source's vCPU threads end and the destination's start; if
//! anything fails before that, the source resumes its guest.
//!
//! # Destination
//! [`destination::receive`] creates the VM from the stream's description,
//! writes each page run as it arrives, restores each vCPU's KVM state and
//! then answers the source. Every record is checked before it is applied: a
//! cut, corrupted, oversized or reordered stream is an error that names the
//! record, and the destination's VM never runs.

pub mod destination;
pub mod source;
pub mod state;
pub mod stream;

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::str::FromStr;
use std::time::{Duration, Instant};

pub use destination::{Incoming, receive};
pub use source::{DirtyLogBackend, MigrateOptions, Migration, MigrationReport, Target};
pub use state::{ChipState, StateSupport, VcpuState, VmDescription};
pub use stream::{Record, StreamError, StreamReader, StreamWriter};

/// How long either side waits for the other before giving up: a peer that
/// stops answering never holds a VM paused (the source resumes it).
pub const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a migration, snapshot or restore did not complete.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The peer could not be reached, or the file opened.
    #[error("cannot reach {what}: {source}")]
    Connect {
        /// The address or file.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The stream failed or was rejected.
    #[error(transparent)]
    Stream(#[from] StreamError),
    /// The vCPUs could not all be paused.
    #[error("cannot pause the guest: {0}")]
    Pause(#[from] crate::pause::PauseError),
    /// Dirty logging failed.
    #[error("dirty logging: {0}")]
    DirtyLog(#[from] dirty_log::Error),
    /// Reading or writing guest memory failed.
    #[error("guest memory: {0}")]
    Memory(#[from] vm_memory::GuestMemoryError),
    /// The destination refused the VM, and said why.
    #[error("the destination refused the VM: {0}")]
    Refused(String),
    /// The destination did not answer after the whole stream.
    #[error("the destination did not confirm the hand-over: {0}")]
    NoAnswer(#[source] io::Error),
    /// The VM could not be created or its state restored at the destination.
    #[error("cannot restore the VM: {0}")]
    Restore(#[source] Box<crate::Error>),
    /// The stream names a guest program this build does not have.
    #[error("the stream's guest program {0:?} is not one this reference-vmm has")]
    UnknownGuest(String),
    /// A vCPU's state is for the other kind of interrupt controller.
    #[error("vCPU {vcpu}'s state is for the other interrupt controller than the VM's ({irqchip})")]
    ChipMismatch {
        /// The vCPU.
        vcpu: u32,
        /// The VM's.
        irqchip: crate::mechanisms::Irqchip,
    },
}

/// Where a migration goes or comes from: `unix:<path>` or `tcp:<ip>:<port>`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Address {
    /// A Unix stream socket.
    Unix(PathBuf),
    /// A TCP socket.
    Tcp(SocketAddr),
}

impl FromStr for Address {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.split_once(':') {
            Some(("unix", path)) if !path.is_empty() => Ok(Self::Unix(path.into())),
            Some(("tcp", addr)) => addr
                .parse()
                .map(Self::Tcp)
                .map_err(|e| format!("{addr:?} is not an IP address and port: {e}")),
            _ => Err(format!(
                "{s:?} is not an address: give unix:<path> or tcp:<ip>:<port>"
            )),
        }
    }
}

impl fmt::Display for Address {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix(path) => write!(f, "unix:{}", path.display()),
            Self::Tcp(addr) => write!(f, "tcp:{addr}"),
        }
    }
}

impl Address {
    /// Connects to a listening destination, retrying for up to
    /// [`CONNECT_WAIT`] while nothing listens there yet (the destination
    /// may be starting).
    pub fn connect(&self) -> Result<Connection, MigrationError> {
        let deadline = Instant::now() + CONNECT_WAIT;
        loop {
            let connection = match self {
                Self::Unix(path) => UnixStream::connect(path).map(Connection::Unix),
                Self::Tcp(addr) => {
                    TcpStream::connect_timeout(addr, PEER_TIMEOUT).map(Connection::Tcp)
                }
            };
            match connection {
                Err(e) if not_listening(&e) && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                other => {
                    return other
                        .and_then(Connection::with_timeouts)
                        .map_err(|source| self.unreachable(source));
                }
            }
        }
    }

    /// Starts listening for a source.
    pub fn listen(&self) -> Result<Listener, MigrationError> {
        let listener = match self {
            Self::Unix(path) => {
                // A socket file left by an earlier listener would refuse the
                // bind; anything else at the path is not ours to remove.
                if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                    let _ = std::fs::remove_file(path);
                }
                UnixListener::bind(path).map(Listener::Unix)
            }
            Self::Tcp(addr) => TcpListener::bind(addr).map(Listener::Tcp),
        };
        listener.map_err(|source| self.unreachable(source))
    }

    fn unreachable(&self, source: io::Error) -> MigrationError {
        MigrationError::Connect {
            what: self.to_string(),
            source,
        }
    }
}

/// How long a source waits for its destination to start listening.
pub const CONNECT_WAIT: Duration = Duration::from_secs(5);

fn not_listening(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::NotFound
    )
}

/// A destination listening for its source.
#[derive(Debug)]
pub enum Listener {
    /// On a Unix socket.
    Unix(UnixListener),
    /// On TCP.
    Tcp(TcpListener),
}

impl Listener {
    /// Where it listens (the port the kernel picked, for `tcp:<ip>:0`).
    pub fn address(&self) -> io::Result<Address> {
        match self {
            Self::Unix(l) => l
                .local_addr()?
                .as_pathname()
                .map(|p| Address::Unix(p.to_owned()))
                .ok_or_else(|| io::Error::other("an unnamed Unix socket")),
            Self::Tcp(l) => l.local_addr().map(Address::Tcp),
        }
    }

    /// Waits for the source and accepts it.
    pub fn accept(&self) -> Result<Connection, MigrationError> {
        let accepted = match self {
            Self::Unix(l) => l.accept().map(|(s, _)| Connection::Unix(s)),
            Self::Tcp(l) => l.accept().map(|(s, _)| Connection::Tcp(s)),
        };
        accepted
            .and_then(Connection::with_timeouts)
            .map_err(|source| MigrationError::Connect {
                what: "the source".into(),
                source,
            })
    }
}

/// A connection between source and destination.
#[derive(Debug)]
pub enum Connection {
    /// Over a Unix socket.
    Unix(UnixStream),
    /// Over TCP.
    Tcp(TcpStream),
}

impl Connection {
    fn with_timeouts(self) -> io::Result<Self> {
        match &self {
            Self::Unix(s) => {
                s.set_read_timeout(Some(PEER_TIMEOUT))?;
                s.set_write_timeout(Some(PEER_TIMEOUT))?;
            }
            Self::Tcp(s) => {
                s.set_read_timeout(Some(PEER_TIMEOUT))?;
                s.set_write_timeout(Some(PEER_TIMEOUT))?;
                s.set_nodelay(true)?;
            }
        }
        Ok(self)
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Unix(s) => s.read(buf),
            Self::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Unix(s) => s.write(buf),
            Self::Tcp(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Unix(s) => s.flush(),
            Self::Tcp(s) => s.flush(),
        }
    }
}

/// The destination's answer after the whole stream: `ANSWER_OK`, or
/// `ANSWER_REFUSED` followed by a length (u32) and a message.
const ANSWER_OK: u8 = 0;
const ANSWER_REFUSED: u8 = 1;

/// Sends the destination's answer.
pub fn answer(out: &mut impl Write, result: Result<(), &str>) -> io::Result<()> {
    match result {
        Ok(()) => out.write_all(&[ANSWER_OK])?,
        Err(message) => {
            out.write_all(&[ANSWER_REFUSED])?;
            out.write_all(&(message.len() as u32).to_le_bytes())?;
            out.write_all(message.as_bytes())?;
        }
    }
    out.flush()
}

/// Reads the destination's answer.
fn read_answer(input: &mut impl Read) -> Result<(), MigrationError> {
    let mut tag = [0u8];
    input
        .read_exact(&mut tag)
        .map_err(MigrationError::NoAnswer)?;
    match tag[0] {
        ANSWER_OK => Ok(()),
        _ => {
            let mut len = [0u8; 4];
            input
                .read_exact(&mut len)
                .map_err(MigrationError::NoAnswer)?;
            let len = u32::from_le_bytes(len).min(4096) as usize;
            let mut message = vec![0u8; len];
            input
                .read_exact(&mut message)
                .map_err(MigrationError::NoAnswer)?;
            Err(MigrationError::Refused(
                String::from_utf8_lossy(&message).into_owned(),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_and_print_back() {
        for text in ["unix:/tmp/x.sock", "tcp:127.0.0.1:4444", "tcp:[::1]:80"] {
            assert_eq!(text.parse::<Address>().unwrap().to_string(), text);
        }
        for bad in ["unix:", "udp:1.2.3.4:5", "/tmp/x", "tcp:host:1"] {
            assert!(bad.parse::<Address>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_source_waits_for_a_destination_that_starts_listening_late() {
        let path = std::env::temp_dir().join(format!("rvmm-late-{}.sock", std::process::id()));
        let address = Address::Unix(path.clone());
        let late = address.clone();
        let listener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            let listener = late.listen().unwrap();
            assert_eq!(listener.address().unwrap(), late);
            listener.accept().map(|_| ())
        });
        let connected = address.connect();
        listener.join().unwrap().unwrap();
        assert!(connected.is_ok());
        std::fs::remove_file(path).unwrap();
    }

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
}
