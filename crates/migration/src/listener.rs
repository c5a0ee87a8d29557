//! A destination's listening socket, and how it picks its source among the
//! connections that reach it: each connection's handshake (TLS, then the
//! stream's header) runs on a thread of its own under a deadline, so that
//! a connection that sends nothing, or sends slowly, holds up nobody; at
//! most [`AcceptLimits::max_handshakes`] at once, the oldest dropped past
//! that; each refusal and drop logged with the peer's address.

use std::collections::VecDeque;
use std::io;
use std::net::TcpListener;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use super::connection::{Connection, Cutter};
use super::stream::{StreamError, StreamReader, read_header};
use super::{Address, BoundPath, MigrationError, PEER_TIMEOUT, handover, tls};

/// How long a connection has, from its accept, for its TLS handshake and
/// the stream's header.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Connections in handshake at once, by default.
pub const MAX_HANDSHAKES: usize = 128;
/// How often the accepting thread looks at its handshakes' results and
/// deadlines while no connection comes.
const TICK: Duration = Duration::from_millis(10);
/// A handshake thread's stack: rustls and aws-lc need far less.
const HANDSHAKE_STACK: usize = 512 << 10;

/// How a listener treats the connections it has not taken as its source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AcceptLimits {
    /// How long a connection has, from its accept, to finish its TLS
    /// handshake and send the stream's header; it is dropped then.
    pub handshake_timeout: Duration,
    /// Connections in handshake at once; a new one past it drops the
    /// oldest (a flood of silent connections cannot keep a source out for
    /// longer than it takes to open this many).
    pub max_handshakes: usize,
    /// How long to wait, from the start, for a source to connect and then
    /// begin its stream (a source connects before its guest starts, and
    /// sends its first record once its migration starts); `None`: as long
    /// as it takes.
    pub wait: Option<Duration>,
}

impl Default for AcceptLimits {
    fn default() -> Self {
        Self {
            handshake_timeout: HANDSHAKE_TIMEOUT,
            max_handshakes: MAX_HANDSHAKES,
            wait: None,
        }
    }
}

/// A destination listening for its source.
#[derive(Debug)]
pub struct Listener {
    socket: Socket,
    tls: Option<tls::TlsServer>,
    /// A Unix socket's path, removed with the listener.
    _bound: Option<BoundPath>,
}

#[derive(Debug)]
enum Socket {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// A connection accepted, before its handshake.
enum Accepted {
    Unix(std::os::unix::net::UnixStream),
    Tcp(std::net::TcpStream),
}

/// A connection in handshake: who, until when, and what drops it.
struct Pending {
    id: u64,
    peer: String,
    deadline: Instant,
    cutter: Cutter,
}

impl Pending {
    fn drop_because(self, log: &mut dyn FnMut(&str), why: &str) {
        self.cutter.cut();
        log(&format!("dropped {}: {why}", self.peer));
    }
}

impl Listener {
    pub(super) fn unix(listener: UnixListener, bound: BoundPath) -> Self {
        Self {
            socket: Socket::Unix(listener),
            tls: None,
            _bound: Some(bound),
        }
    }

    pub(super) fn tcp(listener: TcpListener) -> Self {
        Self {
            socket: Socket::Tcp(listener),
            tls: None,
            _bound: None,
        }
    }

    /// The same, taking only TLS sources that `tls` allows; TCP only.
    pub(super) fn with_tls(self, tls: tls::TlsServer) -> Result<Self, Self> {
        match self.socket {
            Socket::Tcp(_) => Ok(Self {
                tls: Some(tls),
                ..self
            }),
            Socket::Unix(_) => Err(self),
        }
    }

    /// Where it listens (the port the kernel picked, for `tcp:<ip>:0`).
    pub fn address(&self) -> io::Result<Address> {
        match &self.socket {
            Socket::Unix(l) => l
                .local_addr()?
                .as_pathname()
                .map(|p| Address::Unix(p.to_owned()))
                .ok_or_else(|| io::Error::other("an unnamed Unix socket")),
            Socket::Tcp(l) => l.local_addr().map(Address::Tcp),
        }
    }

    fn fd(&self) -> RawFd {
        match &self.socket {
            Socket::Unix(l) => l.as_raw_fd(),
            Socket::Tcp(l) => l.as_raw_fd(),
        }
    }

    fn set_nonblocking(&self, nonblocking: bool) -> io::Result<()> {
        match &self.socket {
            Socket::Unix(l) => l.set_nonblocking(nonblocking),
            Socket::Tcp(l) => l.set_nonblocking(nonblocking),
        }
    }

    /// The next connection and its peer's name (`None`: none waiting, on
    /// a non-blocking listener).
    fn next(&self, count: u64) -> io::Result<Option<(Accepted, String)>> {
        let accepted = match &self.socket {
            Socket::Unix(l) => l.accept().map(|(s, _)| {
                let peer = self.address().map_or("unix:?".into(), |a| a.to_string());
                (Accepted::Unix(s), format!("{peer} (connection {count})"))
            }),
            Socket::Tcp(l) => l
                .accept()
                .map(|(s, peer)| (Accepted::Tcp(s), format!("tcp:{peer}"))),
        };
        match accepted {
            Ok(accepted) => Ok(Some(accepted)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Takes the next connection as the source, whoever it is: its
    /// handshake on this thread, within [`HANDSHAKE_TIMEOUT`] per step.
    /// For tests and peers on a trusted link; a destination others can
    /// reach uses [`accept_source`](Self::accept_source).
    ///
    /// # Errors
    /// [`MigrationError::Tls`] for a refused TLS peer,
    /// [`MigrationError::Stream`] for one that sent no valid header.
    pub fn accept(&self) -> Result<StreamReader<Connection>, MigrationError> {
        let connect_error = |source| MigrationError::Connect {
            what: "the source".into(),
            source,
        };
        self.set_nonblocking(false).map_err(connect_error)?;
        let (accepted, peer) = self
            .next(0)
            .map_err(connect_error)?
            .ok_or_else(|| connect_error(io::ErrorKind::WouldBlock.into()))?;
        tell_taken(handshake(
            accepted,
            peer,
            self.tls.as_ref(),
            HANDSHAKE_TIMEOUT,
        )?)
    }

    /// Waits for a source and takes it: each connection's handshake (TLS,
    /// the stream's header) on its own thread within
    /// `limits.handshake_timeout`, the first to finish taken (and told so),
    /// every other dropped; then waits, within `limits.wait` of the start,
    /// for its first record. `log` gets a line for each connection refused
    /// or dropped, with its peer's address.
    ///
    /// # Errors
    /// [`MigrationError::NoSource`] once `limits.wait` has passed;
    /// [`MigrationError::Listen`] if the listening socket fails.
    pub fn accept_source(
        &self,
        limits: &AcceptLimits,
        log: &mut dyn FnMut(&str),
    ) -> Result<StreamReader<Connection>, MigrationError> {
        let deadline = limits.wait.map(|w| Instant::now() + w);
        let mut source = self.take_one(limits, deadline, log)?;
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        match source.get_mut().wait_readable(left) {
            Ok(true) => Ok(source),
            Ok(false) => Err(MigrationError::NoSource(limits.wait.unwrap_or_default())),
            Err(e) => Err(StreamError::Io(e).into()),
        }
    }

    /// Runs handshakes until one succeeds, and tells its source it is
    /// taken.
    fn take_one(
        &self,
        limits: &AcceptLimits,
        deadline: Option<Instant>,
        log: &mut dyn FnMut(&str),
    ) -> Result<StreamReader<Connection>, MigrationError> {
        let listen_error = |source| MigrationError::Listen {
            what: self
                .address()
                .map_or("the listener".into(), |a| a.to_string()),
            source,
        };
        self.set_nonblocking(true).map_err(listen_error)?;
        let (done_tx, done) = mpsc::channel();
        let mut pending = VecDeque::<Pending>::new();
        let mut count = 0;
        let result = loop {
            if let Some(source) = first_taken(&done, &mut pending, log) {
                break Ok(source);
            }
            let now = Instant::now();
            while pending.front().is_some_and(|p| p.deadline <= now) {
                let late = pending.pop_front().expect("a pending handshake");
                let ms = limits.handshake_timeout.as_millis();
                late.drop_because(
                    log,
                    &format!("no handshake and stream header within {ms} ms"),
                );
            }
            if deadline.is_some_and(|d| now >= d) {
                break Err(MigrationError::NoSource(limits.wait.unwrap_or_default()));
            }
            let next = pending
                .front()
                .map(|p| p.deadline)
                .into_iter()
                .chain(deadline)
                .min();
            let tick = next.map_or(TICK, |n| n.saturating_duration_since(now).min(TICK));
            wait_for_connection(self.fd(), tick).map_err(listen_error)?;
            while let Some((accepted, peer)) = self.next(count).map_err(listen_error)? {
                count += 1;
                if pending.len() >= limits.max_handshakes.max(1) {
                    let oldest = pending.pop_front().expect("a pending handshake");
                    let cap = limits.max_handshakes;
                    oldest.drop_because(log, &format!("more than {cap} connections in handshake"));
                }
                match self.start_handshake(count, accepted, &peer, limits, done_tx.clone()) {
                    Ok(started) => pending.push_back(started),
                    Err(e) => log(&format!("dropped {peer}: {e}")),
                }
            }
        };
        for other in pending {
            other.drop_because(log, "the destination has its source");
        }
        result
    }

    /// Runs `accepted`'s handshake on a thread of its own, which reports on
    /// `done`.
    fn start_handshake(
        &self,
        id: u64,
        accepted: Accepted,
        peer: &str,
        limits: &AcceptLimits,
        done: mpsc::Sender<Handshaken>,
    ) -> io::Result<Pending> {
        let cutter = match &accepted {
            Accepted::Unix(s) => Cutter::unix(s)?,
            Accepted::Tcp(s) => Cutter::tcp(s)?,
        };
        let (tls, name) = (self.tls.clone(), peer.to_owned());
        // Its own timeouts come after the deadline: the deadline's drop,
        // logged by the accepting thread, ends it first.
        let step = limits.handshake_timeout + Duration::from_secs(1);
        thread::Builder::new()
            .name("handshake".into())
            .stack_size(HANDSHAKE_STACK)
            .spawn(move || {
                let _ = done.send((id, handshake(accepted, name, tls.as_ref(), step)));
            })?;
        Ok(Pending {
            id,
            peer: peer.to_owned(),
            deadline: Instant::now() + limits.handshake_timeout,
            cutter,
        })
    }
}

/// A handshake's end: its connection's number, and the source or why not.
type Handshaken = (u64, Result<StreamReader<Connection>, MigrationError>);

/// The first handshake reported done that succeeded, told it is taken and
/// removed from `pending`; the failures before it logged.
fn first_taken(
    done: &mpsc::Receiver<Handshaken>,
    pending: &mut VecDeque<Pending>,
    log: &mut dyn FnMut(&str),
) -> Option<StreamReader<Connection>> {
    while let Ok((id, result)) = done.try_recv() {
        // One dropped already (its deadline, or the cap) was logged then.
        let Some(at) = pending.iter().position(|p| p.id == id) else {
            continue;
        };
        let peer = pending.remove(at).map(|p| p.peer).unwrap_or_default();
        match result.and_then(tell_taken) {
            Ok(source) => return Some(source),
            Err(e) => log(&format!("refused {peer}: {e}")),
        }
    }
    None
}

/// Tells `source` it is taken: its guest may start.
fn tell_taken(
    mut source: StreamReader<Connection>,
) -> Result<StreamReader<Connection>, MigrationError> {
    handover::take(source.get_mut()).map_err(StreamError::Io)?;
    Ok(source)
}

/// Waits up to `tick` for a connection on the listening socket `fd`.
fn wait_for_connection(fd: RawFd, tick: Duration) -> io::Result<()> {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = tick.as_millis().clamp(1, 1000) as libc::c_int;
    // SAFETY: one pollfd, a local, for a socket the caller owns.
    match unsafe { libc::poll(&raw mut poll, 1, ms) } {
        -1 => match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            e => Err(e),
        },
        _ => Ok(()),
    }
}

/// A connection's handshake: TLS where the listener takes TLS, then the
/// stream's header (a peer that sends anything else is told why). Each
/// step is bounded by `step`.
fn handshake(
    accepted: Accepted,
    peer: String,
    tls: Option<&tls::TlsServer>,
    step: Duration,
) -> Result<StreamReader<Connection>, MigrationError> {
    let mut connection = match (accepted, tls) {
        (Accepted::Tcp(sock), Some(tls)) => {
            sock.set_read_timeout(Some(step))
                .and_then(|()| sock.set_write_timeout(Some(step)))
                .map_err(StreamError::Io)?;
            Connection::tls_server(tls.handshake(sock)?, peer)
        }
        (Accepted::Tcp(sock), None) => Connection::tcp(sock, peer),
        (Accepted::Unix(sock), _) => Connection::unix(sock, peer),
    };
    connection
        .set_timeouts(Some(step))
        .map_err(StreamError::Io)?;
    if let Err(e) = read_header(&mut connection) {
        let _ = handover::turn_away(&mut connection, &e.to_string());
        return Err(e.into());
    }
    connection
        .set_timeouts(Some(PEER_TIMEOUT))
        .map_err(StreamError::Io)?;
    Ok(StreamReader::after_header(connection))
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::net::TcpStream;

    use super::*;

    fn tcp_listener() -> (Listener, std::net::SocketAddr) {
        let listener = "tcp:127.0.0.1:0"
            .parse::<Address>()
            .unwrap()
            .listen()
            .unwrap();
        let Ok(Address::Tcp(at)) = listener.address() else {
            panic!("a TCP listener")
        };
        (listener, at)
    }

    /// What `listener` logged until it gave up, `limits.wait` in.
    fn log_until_it_gives_up(listener: &Listener, limits: &AcceptLimits) -> Vec<String> {
        let mut log = Vec::new();
        let e = listener
            .accept_source(limits, &mut |l| log.push(l.to_owned()))
            .unwrap_err();
        let wait = limits.wait.unwrap().as_millis();
        assert_eq!(
            e.to_string(),
            format!("no source began its stream within {wait} ms")
        );
        log
    }

    /// `n` connections that never send a byte.
    fn silent(at: std::net::SocketAddr, n: usize) -> Vec<TcpStream> {
        (0..n).map(|_| TcpStream::connect(at).unwrap()).collect()
    }

    #[test]
    fn silent_connections_hold_up_no_source_and_are_dropped_once_it_is_taken() {
        let (listener, at) = tcp_listener();
        let held = silent(at, 100);
        let source = thread::spawn(move || {
            let mut c = Address::Tcp(at).connect().unwrap();
            std::io::Write::write_all(&mut c, b"first record").unwrap();
            c
        });
        let mut log = Vec::new();
        let mut taken = listener
            .accept_source(&AcceptLimits::default(), &mut |l| log.push(l.to_owned()))
            .unwrap();
        let mut first = [0u8; 12];
        taken.get_mut().read_exact(&mut first).unwrap();
        assert_eq!(&first, b"first record");
        let dropped: Vec<_> = log
            .iter()
            .filter(|l| l.ends_with(": the destination has its source"))
            .collect();
        assert_eq!(dropped.len(), 100, "{log:?}");
        for (line, conn) in dropped.iter().zip(&held) {
            let peer = conn.local_addr().unwrap();
            assert!(line.starts_with("dropped tcp:127.0.0.1:"), "{line}");
            assert!(
                log.iter().any(|l| l.contains(&format!("tcp:{peer}:"))),
                "{peer}"
            );
        }
        // Each silent connection was closed by the destination.
        for mut conn in held {
            assert_eq!(conn.read(&mut [0u8]).unwrap_or(0), 0);
        }
        drop(source.join().unwrap());
    }

    #[test]
    fn a_connection_silent_past_its_deadline_is_dropped_and_logged() {
        let (listener, at) = tcp_listener();
        let held = silent(at, 3);
        let limits = AcceptLimits {
            handshake_timeout: Duration::from_millis(100),
            wait: Some(Duration::from_millis(400)),
            ..AcceptLimits::default()
        };
        let log = log_until_it_gives_up(&listener, &limits);
        assert_eq!(log.len(), 3, "{log:?}");
        for (line, conn) in log.iter().zip(&held) {
            let peer = conn.local_addr().unwrap();
            assert_eq!(
                line,
                &format!("dropped tcp:{peer}: no handshake and stream header within 100 ms")
            );
        }
    }

    #[test]
    fn past_the_cap_the_oldest_handshake_goes() {
        let (listener, at) = tcp_listener();
        let held = silent(at, 6);
        let limits = AcceptLimits {
            max_handshakes: 4,
            wait: Some(Duration::from_millis(300)),
            ..AcceptLimits::default()
        };
        let log = log_until_it_gives_up(&listener, &limits);
        let capped: Vec<_> = log
            .iter()
            .filter(|l| l.ends_with("more than 4 connections in handshake"))
            .collect();
        let oldest = [&held[0], &held[1]].map(|c| c.local_addr().unwrap());
        assert_eq!(capped.len(), 2, "{log:?}");
        for (line, peer) in capped.iter().zip(oldest) {
            assert!(line.starts_with(&format!("dropped tcp:{peer}:")), "{line}");
        }
    }

    #[test]
    fn a_peer_that_sends_no_stream_header_is_told_why_and_logged() {
        let (listener, at) = tcp_listener();
        let mut stranger = TcpStream::connect(at).unwrap();
        std::io::Write::write_all(&mut stranger, b"GET / HTTP/1.1\r\n\r\n").unwrap();
        let limits = AcceptLimits {
            wait: Some(Duration::from_millis(300)),
            ..AcceptLimits::default()
        };
        let log = log_until_it_gives_up(&listener, &limits);
        let peer = stranger.local_addr().unwrap();
        assert_eq!(log.len(), 1, "{log:?}");
        assert!(
            log[0].starts_with(&format!(
                "refused tcp:{peer}: not a reference-vmm migration stream"
            )),
            "{log:?}"
        );
        let mut reply = Vec::new();
        let _ = stranger.read_to_end(&mut reply);
        assert!(
            String::from_utf8_lossy(&reply).contains("not a reference-vmm migration stream"),
            "{reply:?}"
        );
    }
}
