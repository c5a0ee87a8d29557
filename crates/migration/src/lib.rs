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
//! vCPUs ([`RunControl::pause`](reference_vmm::RunControl::pause)), sends the last dirty pages (the VMM's own writes
//! among them) and every vCPU's [`state`], and hands the guest over
//! ([`handover`]): the destination answers once it has restored
//! everything, the source commits, and only then does the destination's
//! VM run; a source that has not committed resumes its guest on any
//! failure, and its pause is bounded by the downtime limit and
//! [`HANDOVER_MARGIN`].
//!
//! # Post-copy
//! With [`MigrateOptions::postcopy`] the guest runs at the destination
//! before its memory is all there: the pages it lacks are registered with
//! `userfaultfd(2)`, asked for as they fault and pushed meanwhile
//! ([`postcopy`]); a cut link is survived where both sides were told to
//! ([`MigrateOptions::resume`], [`Resume`]), and a lost side loses the
//! guest ([`MigrationError::GuestLost`]).
//!
//! # Waits
//! Every wait on the peer is bounded and named when it ends: a source's
//! connection and the destination's taking it by [`CONNECT_TIMEOUT`], each
//! read and write of the stream by [`PEER_TIMEOUT`], the whole move by
//! [`MigrateOptions::timeout`], its pause by the downtime limit plus
//! [`HANDOVER_MARGIN`]. A destination's listener runs each connection's
//! handshake beside the others, under [`AcceptLimits`].
//!
//! # Destination
//! [`destination::receive`] creates the VM from the stream's description,
//! writes each page run as it arrives, restores each vCPU's KVM state and
//! then answers the source. Every record is checked before it is applied: a
//! cut, corrupted, oversized or reordered stream is an error that names the
//! record, and the destination's VM never runs.
//!
//! # Over the VMM's seam
//! This crate is a user of the [reference-vmm](reference_vmm) library, as
//! any controller of a running VM would be: it starts the run with
//! a [`Controller`](reference_vmm::Controller) ([`Vm::on_start`](reference_vmm::Vm::on_start)), pauses and
//! resumes it through [`RunControl`](reference_vmm::RunControl), takes each
//! part's saved state ([`VcpuState`](reference_vmm::VcpuState),
//! [`VmDescription`](reference_vmm::VmDescription)) as plain data, and
//! throttles the vCPUs through their duty cycles
//! ([`reference_vmm::duty_cycle`]). Nothing in the VMM imports it.

#![deny(missing_docs)]
// Its types hold threads, connections and trait objects whose Debug output
// would say nothing; the Debug requirement is for the published crates.
#![allow(missing_debug_implementations)]

mod codec;
mod connection;
pub mod destination;
mod favour;
pub mod handover;
pub mod image;
#[cfg(any(test, feature = "fuzzing"))]
pub mod invariants;
mod listener;
mod local;
pub mod postcopy;
pub mod snapshot;
pub mod source;
pub mod state;
pub mod stream;
mod throttle;
pub mod tls;
mod uffd;
mod watch;

use std::fmt;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

pub use connection::Connection;
pub use destination::{Incoming, hand_over, receive, receive_chain, receive_from};
pub use handover::{HANDOVER_MARGIN, answer};
pub use listener::{AcceptLimits, HANDSHAKE_TIMEOUT, Listener, MAX_HANDSHAKES};
pub use local::{Moved, move_in_process, move_in_process_tls, move_to_listener};
pub use postcopy::{FetchReport, Fetching, Postcopy, PostcopyPages, Resume};
pub use snapshot::SnapshotKind;
pub use source::{
    DirtyLogBackend, MigrateOptions, Migration, MigrationReport, Mover, Progress, Target,
};
pub use stream::{Link, Record, StreamError, StreamReader, StreamWriter};

impl From<reference_vmm::Error> for MigrationError {
    fn from(e: reference_vmm::Error) -> Self {
        Self::Vm(Box::new(e))
    }
}

/// How long either side waits on one read or write of the stream before
/// giving up on the peer.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a source waits to connect and be taken by its destination,
/// before its guest starts: longer than the destination's
/// [`HANDSHAKE_TIMEOUT`], so that the destination's refusal comes first.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
    Pause(#[from] reference_vmm::PauseError),
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
    /// The destination did not take this source (it answered nothing).
    #[error("the destination did not take this source: {0}")]
    NotTaken(#[source] io::Error),
    /// The destination turned this source away, and said why.
    #[error("the destination turned this source away: {0}")]
    Turned(String),
    /// The guest stood paused past the downtime limit and the hand-over
    /// margin without the destination's answer: the guest runs on here.
    #[error(
        "the destination did not answer within {} ms of the pause (the {} ms downtime limit and \
         the {} ms hand-over margin)",
        (*.downtime + *.margin).as_millis(), .downtime.as_millis(), .margin.as_millis()
    )]
    PauseLimit {
        /// The downtime limit.
        downtime: Duration,
        /// The margin past it.
        margin: Duration,
    },
    /// The run was stopped (a signal, its timeout, a vCPU's failure) while
    /// the migration waited.
    #[error("the run was stopped")]
    Stopped,
    /// The source committed the hand-over, but the destination did not say
    /// it runs the guest: the guest runs there, or nowhere if the commit
    /// was lost on the way; never here again.
    #[error(
        "the hand-over was committed, but the destination did not confirm that it runs the \
         guest ({0}): the guest runs there, or nowhere if the commit was lost on the way; it no \
         longer runs here"
    )]
    Unconfirmed(String),
    /// At the destination: the source did not commit the hand-over, so its
    /// VM never ran here.
    #[error("the source did not commit the hand-over ({0}): the guest was not started here")]
    NotCommitted(String),
    /// At the destination: no source began its stream in time.
    #[error("no source began its stream within {} ms", .0.as_millis())]
    NoSource(Duration),
    /// The VM could not be created or its state restored at the destination.
    #[error("cannot restore the VM: {0}")]
    Restore(#[source] Box<reference_vmm::Error>),
    /// A VM of the migration failed: created, prepared or run.
    #[error(transparent)]
    Vm(Box<reference_vmm::Error>),
    /// The migration ran past its time limit before the hand-over.
    #[error("the migration ran past its {} ms limit", .0.as_millis())]
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
    /// Snapshots that do not make a chain: an increment without its base,
    /// out of order, or of another VM; or an increment asked for with no
    /// snapshot before it to follow.
    #[error("snapshot chain: {0}")]
    Chain(String),
    /// Post-copy at the destination: `userfaultfd(2)` was refused (no
    /// `CONFIG_USERFAULTFD`, a seccomp filter, or
    /// `vm.unprivileged_userfaultfd` 0 without `CAP_SYS_PTRACE`), or a
    /// fill failed.
    #[error("post-copy needs userfaultfd(2), which this host refused: {0}")]
    Userfaultfd(#[source] io::Error),
    /// Post-copy: the guest ran at the destination, and the side that
    /// held the rest of its memory went away for good (or the link stayed
    /// down past the limits): it runs nowhere now. A source never resumes
    /// a guest it handed over.
    #[error("the guest is lost: {0}")]
    GuestLost(String),
    /// Post-copy asked of a target that is not a destination process.
    #[error("post-copy moves a guest to a destination process, not to a snapshot file")]
    PostcopyToFile,
    /// The stream's guest program is not one this VMM has.
    #[error("the stream's guest program {0:?} is not one this reference-vmm has")]
    UnknownGuest(String),
    /// A vCPU's state is for the other kind of interrupt controller.
    #[error("vCPU {vcpu}'s state is for the other interrupt controller than the VM's ({irqchip})")]
    ChipMismatch {
        /// The vCPU.
        vcpu: u32,
        /// The VM's.
        irqchip: reference_vmm::Irqchip,
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
    /// first: it prints the address once it listens), sends the stream's
    /// header and waits, [`CONNECT_TIMEOUT`] at most, to be taken.
    ///
    /// # Errors
    /// [`MigrationError::Connect`] where nothing listens;
    /// [`MigrationError::Turned`] or [`MigrationError::NotTaken`] where the
    /// destination refused or did not answer.
    pub fn connect(&self) -> Result<Connection, MigrationError> {
        let connection = match self {
            Self::Unix(path) => {
                UnixStream::connect(path).map(|s| Connection::unix(s, self.to_string()))
            }
            Self::Tcp(addr) => TcpStream::connect_timeout(addr, CONNECT_TIMEOUT)
                .map(|s| Connection::tcp(s, self.to_string())),
        };
        connection
            .and_then(|c| c.set_timeouts(Some(CONNECT_TIMEOUT)).map(|()| c))
            .map_err(|source| self.unreachable(source))
            .and_then(hello)
    }

    /// Connects to a destination that listens with TLS, and runs the
    /// handshake: an error before the guest starts if either side refuses
    /// the other's certificate.
    ///
    /// # Errors
    /// [`MigrationError::Tls`] for a Unix socket (TLS is for TCP), or a
    /// refused handshake; the others as [`connect`](Self::connect).
    pub fn connect_tls(&self, tls: &tls::TlsClient) -> Result<Connection, MigrationError> {
        let Self::Tcp(addr) = self else {
            return Err(MigrationError::Tls(format!(
                "{self}: TLS is for tcp: addresses"
            )));
        };
        let sock = TcpStream::connect_timeout(addr, CONNECT_TIMEOUT)
            .and_then(|s| {
                s.set_read_timeout(Some(CONNECT_TIMEOUT))?;
                s.set_write_timeout(Some(CONNECT_TIMEOUT))?;
                s.set_nodelay(true).map(|()| s)
            })
            .map_err(|source| self.unreachable(source))?;
        hello(Connection::tls_client(
            tls.client_on(sock, *addr)?,
            self.to_string(),
        ))
    }

    fn unreachable(&self, source: io::Error) -> MigrationError {
        MigrationError::Connect {
            what: self.to_string(),
            source,
        }
    }

    /// Listens for a source that must speak TLS ([`tls::TlsServer`]).
    ///
    /// # Errors
    /// As [`listen`](Self::listen), and [`MigrationError::Tls`] for a Unix
    /// socket.
    pub fn listen_tls(&self, tls: tls::TlsServer) -> Result<Listener, MigrationError> {
        self.listen()?
            .with_tls(tls)
            .map_err(|_| MigrationError::Tls(format!("{self}: TLS is for tcp: addresses")))
    }

    /// Starts listening for a source. A Unix socket's path must be free, or
    /// hold a socket nobody listens on any more (left by a listener that
    /// died), which is replaced; the socket is removed when the listener is
    /// dropped.
    pub fn listen(&self) -> Result<Listener, MigrationError> {
        let listener = match self {
            Self::Unix(path) => claim_socket_path(path)
                .and_then(|()| UnixListener::bind(path))
                .and_then(|l| Ok(Listener::unix(l, BoundPath::new(path)?))),
            Self::Tcp(addr) => TcpListener::bind(addr).map(Listener::tcp),
        };
        listener.map_err(|source| MigrationError::Listen {
            what: self.to_string(),
            source,
        })
    }
}

/// Binds a Unix socket at `path` as [`Address::listen`] does (a stale
/// socket replaced, anything else left alone), for another protocol (the
/// binary's control socket): the socket goes when the [`BoundPath`] does.
pub fn bind_unix(path: &Path) -> io::Result<(UnixListener, BoundPath)> {
    claim_socket_path(path)?;
    let listener = UnixListener::bind(path)?;
    Ok((listener, BoundPath::new(path)?))
}

/// A source's first exchange on a new connection ([`handover`]): its
/// stream's header out, TAKEN (or a refusal) back; then the stream's own
/// timeouts.
fn hello(mut connection: Connection) -> Result<Connection, MigrationError> {
    let sent = connection
        .write_all(&stream::header())
        .and_then(|()| connection.flush())
        .map_err(MigrationError::NotTaken);
    match sent.and_then(|()| handover::read_taken(&mut connection)) {
        Err(MigrationError::NotTaken(e)) if connection.is_tls() => Err(MigrationError::Tls(
            tls::handshake_failure(&e, "the destination"),
        )),
        Err(e) => Err(e),
        Ok(()) => connection
            .set_timeouts(Some(PEER_TIMEOUT))
            .map(|()| connection)
            .map_err(MigrationError::NotTaken),
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

// The README's examples are doctests too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;

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
        // The second one's probe was no source (logged, refused): the
        // first still takes one.
        let source = std::thread::spawn({
            let address = address.clone();
            move || {
                let mut c = address.connect().unwrap();
                c.write_all(b"x").unwrap();
                c
            }
        });
        let mut log = Vec::new();
        let limits = AcceptLimits::default();
        let mut taken = first
            .accept_source(&limits, &mut |line| log.push(line.to_owned()))
            .unwrap();
        let mut byte = [0u8];
        std::io::Read::read_exact(taken.get_mut(), &mut byte).unwrap();
        assert_eq!(byte, *b"x");
        // The probe's handshake ends first, or the source's does and the
        // probe is dropped: either way it is logged, as the first connection.
        assert_eq!(log.len(), 1, "{log:?}");
        let probe = format!("unix:{} (connection 0): ", path.display());
        assert!(
            log[0] == format!("dropped {probe}the destination has its source")
                || log[0].starts_with(&format!("refused {probe}the stream ended before")),
            "{log:?}"
        );
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
    fn the_backends_and_progress_parse_by_name_and_others_are_refused_with_the_list() {
        for &d in DirtyLogBackend::ALL {
            assert_eq!(d.to_string().parse::<DirtyLogBackend>(), Ok(d));
        }
        for &p in Progress::ALL {
            assert_eq!(p.to_string().parse::<Progress>(), Ok(p));
        }
        let err = "log".parse::<DirtyLogBackend>().unwrap_err().to_string();
        assert_eq!(
            err,
            "--dirty-log \"log\" is not one of: bitmap, manual, ring"
        );
    }
}
