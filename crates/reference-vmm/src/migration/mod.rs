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
//! vCPUs ([`pause`]), sends the last dirty pages (the VMM's own writes
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

mod codec;
pub mod destination;
mod favour;
mod local;
pub mod pause;
pub mod source;
pub mod state;
pub mod stream;
mod throttle;
pub mod tls;

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub use destination::{Incoming, receive};
pub use local::{Moved, move_in_process, move_in_process_tls, move_to_listener};
pub use source::{DirtyLogBackend, MigrateOptions, Migration, MigrationReport, Progress, Target};
pub use state::{ChipState, StateSupport, VcpuState, VmDescription};
pub use stream::{Record, StreamError, StreamReader, StreamWriter};
pub(crate) use throttle::{PauseTaker, VcpuPauses};

impl From<crate::Error> for MigrationError {
    fn from(e: crate::Error) -> Self {
        Self::Vm(Box::new(e))
    }
}

/// How long either side waits for the other before giving up: a peer that
/// stops answering never holds a VM paused (the source resumes it).
pub const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// Why a migration, snapshot or restore did not complete.
#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    /// The peer could not be reached.
    #[error("cannot reach {what}: {source}")]
    Connect {
        /// The address or file.
        what: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The snapshot file could not be created.
    #[error("cannot create the snapshot file {path}: {source}")]
    CreateSnapshot {
        /// The path given.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// A destination could not listen where it was asked to.
    #[error("cannot listen on {what}: {source}")]
    Listen {
        /// The address.
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
    Pause(#[from] pause::PauseError),
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
    /// A VM of the migration failed: created, prepared or run.
    #[error(transparent)]
    Vm(Box<crate::Error>),
    /// Pre-copy ran past the migration's time limit: the guest runs on
    /// here.
    #[error("the migration ran past its {} ms limit; the guest runs on here", .0.as_millis())]
    TimedOut(Duration),
    /// TLS could not be set up, or the peer was refused or refused us.
    #[error("TLS: {0}")]
    Tls(String),
    /// The source's vCPUs carry MSRs this host's KVM does not list, so
    /// their values could not be restored (named before any page is read).
    #[error(
        "this host's KVM cannot save or restore MSRs the source's vCPUs carry: {}",
        .0.iter().map(|m| format!("{m:#x}")).collect::<Vec<_>>().join(", ")
    )]
    MissingMsrs(Vec<u32>),
    /// The stream's guest program is not one this VMM has.
    #[error("the stream's guest program {0:?} is not one this reference-vmm has")]
    UnknownGuest(String),
    /// A vCPU's state is for the other kind of interrupt controller.
    #[error("vCPU {vcpu}'s state is for the other interrupt controller than the VM's ({irqchip})")]
    ChipMismatch {
        /// The vCPU.
        vcpu: u32,
        /// The VM's.
        irqchip: crate::policies::Irqchip,
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
    /// Connects to a listening destination (`receive --listen`, started
    /// first: it prints the address once it listens).
    pub fn connect(&self) -> Result<Connection, MigrationError> {
        let connection = match self {
            Self::Unix(path) => UnixStream::connect(path).map(Connection::Unix),
            Self::Tcp(addr) => TcpStream::connect_timeout(addr, PEER_TIMEOUT).map(Connection::Tcp),
        };
        connection
            .and_then(Connection::with_timeouts)
            .map_err(|source| MigrationError::Connect {
                what: self.to_string(),
                source,
            })
    }

    /// Connects to a destination that listens with TLS, and runs the
    /// handshake: an error before the guest starts if either side refuses
    /// the other's certificate.
    ///
    /// # Errors
    /// [`MigrationError::Tls`] for a Unix socket (TLS is for TCP), or a
    /// refused handshake; [`MigrationError::Connect`] as [`connect`](Self::connect).
    pub fn connect_tls(&self, tls: &tls::TlsClient) -> Result<Connection, MigrationError> {
        let Self::Tcp(addr) = self else {
            return Err(MigrationError::Tls(format!(
                "{self}: TLS is for tcp: addresses"
            )));
        };
        let Connection::Tcp(sock) = self.connect()? else {
            unreachable!("a tcp: address connects over TCP")
        };
        Ok(Connection::TlsClient(Box::new(tls.connect(sock, *addr)?)))
    }

    /// Listens for a source that must speak TLS ([`tls::TlsServer`]).
    ///
    /// # Errors
    /// As [`listen`](Self::listen), and [`MigrationError::Tls`] for a Unix
    /// socket.
    pub fn listen_tls(&self, tls: tls::TlsServer) -> Result<Listener, MigrationError> {
        match self.listen()? {
            Listener::Tcp(l) => Ok(Listener::Tls(l, tls)),
            Listener::Unix(..) => Err(MigrationError::Tls(format!(
                "{self}: TLS is for tcp: addresses"
            ))),
            Listener::Tls(..) => unreachable!("listen makes no TLS listener"),
        }
    }

    /// Starts listening for a source. A Unix socket's path must be free, or
    /// hold a socket nobody listens on any more (left by a listener that
    /// died), which is replaced; the socket is removed when the listener is
    /// dropped.
    pub fn listen(&self) -> Result<Listener, MigrationError> {
        let listener = match self {
            Self::Unix(path) => claim_socket_path(path)
                .and_then(|()| UnixListener::bind(path))
                .and_then(|l| Ok(Listener::Unix(l, BoundPath::new(path)?))),
            Self::Tcp(addr) => TcpListener::bind(addr).map(Listener::Tcp),
        };
        listener.map_err(|source| MigrationError::Listen {
            what: self.to_string(),
            source,
        })
    }
}

/// Makes `path` free to bind: nothing there, or a socket that refuses a
/// connection (its listener is gone), which is removed. A socket that
/// accepts one is another listener's, and anything else is not ours.
fn claim_socket_path(path: &Path) -> io::Result<()> {
    let kind = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
        Ok(m) => m.file_type(),
    };
    if !kind.is_socket() {
        return Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!("{} is there, not a socket (left as it is)", file_kind(kind)),
        ));
    }
    match UnixStream::connect(path) {
        // A receive takes a connection that ends before sending anything
        // for a probe like this one, and goes on listening.
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "another process is listening on this socket",
        )),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => std::fs::remove_file(path),
        Err(e) => Err(e),
    }
}

/// What a non-socket at a socket's path is, in words.
fn file_kind(kind: std::fs::FileType) -> &'static str {
    match kind {
        k if k.is_dir() => "a directory",
        k if k.is_file() => "a regular file",
        k if k.is_symlink() => "a symbolic link",
        k if k.is_fifo() => "a FIFO",
        k if k.is_block_device() || k.is_char_device() => "a device node",
        _ => "something",
    }
}

/// The path a Unix listener bound, removed when it is dropped if the socket
/// there is still the one it bound.
#[derive(Debug)]
pub struct BoundPath {
    path: PathBuf,
    inode: u64,
}

impl BoundPath {
    fn new(path: &Path) -> io::Result<Self> {
        Ok(Self {
            path: path.to_owned(),
            inode: std::fs::symlink_metadata(path)?.ino(),
        })
    }
}

impl Drop for BoundPath {
    fn drop(&mut self) {
        if std::fs::symlink_metadata(&self.path).is_ok_and(|m| m.ino() == self.inode) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A destination listening for its source.
#[derive(Debug)]
pub enum Listener {
    /// On a Unix socket, removed with the listener.
    Unix(UnixListener, BoundPath),
    /// On TCP.
    Tcp(TcpListener),
    /// On TCP, taking only TLS sources it allows.
    Tls(TcpListener, tls::TlsServer),
}

impl Listener {
    /// Where it listens (the port the kernel picked, for `tcp:<ip>:0`).
    pub fn address(&self) -> io::Result<Address> {
        match self {
            Self::Unix(l, _) => l
                .local_addr()?
                .as_pathname()
                .map(|p| Address::Unix(p.to_owned()))
                .ok_or_else(|| io::Error::other("an unnamed Unix socket")),
            Self::Tcp(l) | Self::Tls(l, _) => l.local_addr().map(Address::Tcp),
        }
    }

    /// Waits for the source and accepts it; with TLS, a source refused (no
    /// TLS, a certificate not signed by the CA or not for an allowed name)
    /// is [`MigrationError::Tls`].
    pub fn accept(&self) -> Result<Connection, MigrationError> {
        let accepted = match self {
            Self::Unix(l, _) => l.accept().map(|(s, _)| Connection::Unix(s)),
            Self::Tcp(l) | Self::Tls(l, _) => l.accept().map(|(s, _)| Connection::Tcp(s)),
        };
        let connection = accepted
            .and_then(Connection::with_timeouts)
            .map_err(|source| MigrationError::Connect {
                what: "the source".into(),
                source,
            })?;
        match (self, connection) {
            (Self::Tls(_, tls), Connection::Tcp(sock)) => {
                Ok(Connection::TlsServer(Box::new(tls.accept(sock)?)))
            }
            (_, connection) => Ok(connection),
        }
    }

    /// Waits for a source and reads its stream's header. The source may
    /// connect long before it sends (it connects before its guest starts),
    /// so the wait for the first byte has no time limit; a connection that
    /// ends before sending anything (a probe, see [`Address::listen`]) is
    /// not a source, and the wait goes on.
    pub fn accept_stream(&self) -> Result<StreamReader<Connection>, MigrationError> {
        loop {
            let connection = self.accept()?;
            // A TLS source has proved itself: nothing to wait for.
            if matches!(connection, Connection::TlsServer(_))
                || connection.wait_for_data().map_err(StreamError::Io)?
            {
                return Ok(StreamReader::new(connection)?);
            }
        }
    }
}

/// A connection between source and destination.
#[derive(Debug)]
pub enum Connection {
    /// Over a Unix socket.
    Unix(UnixStream),
    /// Over TCP.
    Tcp(TcpStream),
    /// A source's, in TLS.
    TlsClient(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
    /// A destination's, in TLS.
    TlsServer(Box<rustls::StreamOwned<rustls::ServerConnection, TcpStream>>),
}

impl Connection {
    fn fd(&self) -> std::os::fd::RawFd {
        match self {
            Self::Unix(s) => s.as_raw_fd(),
            Self::Tcp(s) => s.as_raw_fd(),
            Self::TlsClient(s) => s.sock.as_raw_fd(),
            Self::TlsServer(s) => s.sock.as_raw_fd(),
        }
    }

    /// Bytes written to the socket that the peer has not taken yet (for
    /// TCP, not acknowledged yet: still in this host's queues or on the
    /// wire).
    fn unsent(&self) -> io::Result<usize> {
        let mut bytes: libc::c_int = 0;
        // SAFETY: SIOCOUTQ writes one int, into a local, about a socket
        // this connection owns.
        match unsafe { libc::ioctl(self.fd(), libc::TIOCOUTQ, &raw mut bytes) } {
            0 => Ok(usize::try_from(bytes).unwrap_or(0)),
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// Waits, until `deadline` at most, for the peer to have taken all
    /// that was written to the socket: a pre-copy round's time is then the
    /// time its pages took to arrive, not to fill the queues on the way.
    pub(crate) fn wait_delivered(&self, deadline: std::time::Instant) -> io::Result<()> {
        while self.unsent()? > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Blocks until the peer sends something (true) or closes (false),
    /// without taking it.
    fn wait_for_data(&self) -> io::Result<bool> {
        let fd = self.fd();
        let mut byte = 0u8;
        loop {
            // SAFETY: recv(2) into one byte of a local, on a socket this
            // connection owns; MSG_PEEK leaves the byte to be read.
            let n = unsafe { libc::recv(fd, (&raw mut byte).cast(), 1, libc::MSG_PEEK) };
            match n {
                0 => return Ok(false),
                1.. => return Ok(true),
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e => return Err(e),
                },
            }
        }
    }

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
            // Set on the socket before the handshake.
            Self::TlsClient(_) | Self::TlsServer(_) => {}
        }
        Ok(self)
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Self::Unix(s) => s.read(buf),
            Self::Tcp(s) => s.read(buf),
            Self::TlsClient(s) => s.read(buf),
            Self::TlsServer(s) => s.read(buf),
        }
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Self::Unix(s) => s.write(buf),
            Self::Tcp(s) => s.write(buf),
            Self::TlsClient(s) => s.write(buf),
            Self::TlsServer(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Self::Unix(s) => s.flush(),
            Self::Tcp(s) => s.flush(),
            Self::TlsClient(s) => s.flush(),
            Self::TlsServer(s) => s.flush(),
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

    fn socket_path(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("rvmm-{name}-{}.sock", std::process::id()))
    }

    #[test]
    fn a_source_with_no_destination_listening_fails_at_once() {
        let address = Address::Unix(socket_path("nobody"));
        let e = address.connect().unwrap_err().to_string();
        assert!(e.starts_with("cannot reach unix:"), "{e}");
    }

    #[test]
    fn a_listener_keeps_its_socket_from_a_second_one_and_removes_it_when_dropped() {
        let path = socket_path("owned");
        let address = Address::Unix(path.clone());
        let first = address.listen().unwrap();
        let e = address.listen().unwrap_err().to_string();
        assert!(e.contains("another process is listening"), "{e}");
        // The second one's probe was no source: the first still takes one.
        let source = std::thread::spawn({
            let address = address.clone();
            move || {
                let mut c = address.connect().unwrap();
                c.write_all(b"x").unwrap();
                c
            }
        });
        // The probe's connection comes first, and has nothing to say.
        assert!(!first.accept().unwrap().wait_for_data().unwrap());
        assert!(first.accept().unwrap().wait_for_data().unwrap());
        drop(source.join().unwrap());
        assert!(path.exists());
        drop(first);
        assert!(!path.exists(), "the socket outlived its listener");
    }

    #[test]
    fn a_dead_listeners_socket_is_replaced_and_anything_else_is_left_alone() {
        let path = socket_path("stale");
        drop(UnixListener::bind(&path).unwrap()); // the file stays
        let address = Address::Unix(path.clone());
        drop(address.listen().unwrap());
        std::fs::write(&path, b"mine").unwrap();
        let e = address.listen().unwrap_err().to_string();
        assert!(e.contains("a regular file is there, not a socket"), "{e}");
        assert_eq!(std::fs::read(&path).unwrap(), b"mine");
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        let e = address.listen().unwrap_err().to_string();
        assert!(e.contains("a directory is there"), "{e}");
        std::fs::remove_dir(&path).unwrap();
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
