//! One connection between a source and its destination: a Unix or TCP
//! socket, maybe in TLS, whose every wait on the peer is bounded and named,
//! and which another thread can cut ([`Cutter`]) to end a wait at once.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::time::{Duration, Instant};

/// A connection between source and destination.
pub struct Connection {
    transport: Transport,
    /// The peer, as the logs name it (`tcp:<ip>:<port>`, `unix:<path>`).
    peer: String,
    /// Set when a [`Cutter`] cut it: its errors from then on are the cut's.
    cut: Arc<AtomicBool>,
}

/// The socket underneath, maybe in TLS.
enum Transport {
    Unix(UnixStream),
    Tcp(TcpStream),
    TlsClient(Box<rustls::StreamOwned<rustls::ClientConnection, TcpStream>>),
    TlsServer(Box<rustls::StreamOwned<rustls::ServerConnection, TcpStream>>),
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.transport {
            Transport::Unix(_) => "unix",
            Transport::Tcp(_) => "tcp",
            Transport::TlsClient(_) => "tls client",
            Transport::TlsServer(_) => "tls server",
        };
        f.debug_struct("Connection")
            .field("transport", &kind)
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl Connection {
    pub(crate) fn unix(sock: UnixStream, peer: String) -> Self {
        Self::new(Transport::Unix(sock), peer)
    }

    pub(crate) fn tcp(sock: TcpStream, peer: String) -> Self {
        Self::new(Transport::Tcp(sock), peer)
    }

    pub(crate) fn tls_client(
        stream: rustls::StreamOwned<rustls::ClientConnection, TcpStream>,
        peer: String,
    ) -> Self {
        Self::new(Transport::TlsClient(Box::new(stream)), peer)
    }

    pub(crate) fn tls_server(
        stream: rustls::StreamOwned<rustls::ServerConnection, TcpStream>,
        peer: String,
    ) -> Self {
        Self::new(Transport::TlsServer(Box::new(stream)), peer)
    }

    fn new(transport: Transport, peer: String) -> Self {
        Self {
            transport,
            peer,
            cut: Arc::new(AtomicBool::new(false)),
        }
    }

    /// The peer: `tcp:<ip>:<port>`, or `unix:` and the socket's path.
    pub fn peer(&self) -> &str {
        &self.peer
    }

    /// Whether it speaks TLS.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(
            self.transport,
            Transport::TlsClient(_) | Transport::TlsServer(_)
        )
    }

    /// The socket's fd, to wait on beside others.
    pub(crate) fn raw_fd(&self) -> RawFd {
        match &self.transport {
            Transport::Unix(s) => s.as_raw_fd(),
            Transport::Tcp(s) => s.as_raw_fd(),
            Transport::TlsClient(s) => s.sock.as_raw_fd(),
            Transport::TlsServer(s) => s.sock.as_raw_fd(),
        }
    }

    /// Bounds each read and each write on the socket by `limit` (`None`:
    /// unbounded); one that runs past it fails as [`io::ErrorKind::TimedOut`],
    /// saying how long it waited.
    pub(crate) fn set_timeouts(&self, limit: Option<Duration>) -> io::Result<()> {
        match &self.transport {
            Transport::Unix(s) => {
                s.set_read_timeout(limit)?;
                s.set_write_timeout(limit)
            }
            Transport::Tcp(s) => set_tcp_timeouts(s, limit),
            Transport::TlsClient(s) => set_tcp_timeouts(&s.sock, limit),
            Transport::TlsServer(s) => set_tcp_timeouts(&s.sock, limit),
        }
    }

    /// What cuts this connection from another thread.
    pub(crate) fn cutter(&self) -> io::Result<Cutter> {
        let socket = match &self.transport {
            Transport::Unix(s) => Socket::Unix(s.try_clone()?),
            Transport::Tcp(s) => Socket::Tcp(s.try_clone()?),
            Transport::TlsClient(s) => Socket::Tcp(s.sock.try_clone()?),
            Transport::TlsServer(s) => Socket::Tcp(s.sock.try_clone()?),
        };
        Ok(Cutter {
            socket,
            cut: self.cut.clone(),
        })
    }

    /// Whether a [`Cutter`] cut it.
    pub(crate) fn was_cut(&self) -> bool {
        self.cut.load(SeqCst)
    }

    /// Bytes written to the socket that the peer has not taken yet (for
    /// TCP, not acknowledged yet: still in this host's queues or on the
    /// wire).
    pub(crate) fn unsent(&self) -> io::Result<usize> {
        let mut bytes: libc::c_int = 0;
        // SAFETY: SIOCOUTQ writes one int, into a local, about a socket
        // this connection owns.
        match unsafe { libc::ioctl(self.raw_fd(), libc::TIOCOUTQ, &raw mut bytes) } {
            0 => Ok(usize::try_from(bytes).unwrap_or(0)),
            _ => Err(io::Error::last_os_error()),
        }
    }

    /// Waits, until `deadline` at most, for the peer to have taken all
    /// that was written to the socket: a pre-copy round's time is then the
    /// time its pages took to arrive, not to fill the queues on the way.
    /// A cut ends the wait with an error.
    pub(crate) fn wait_delivered(&self, deadline: Instant) -> io::Result<()> {
        while self.unsent()? > 0 && Instant::now() < deadline {
            if self.was_cut() {
                return Err(io::Error::new(io::ErrorKind::ConnectionAborted, "cut"));
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Waits, `within` at most (`None`: for ever), until something can be
    /// read: true, or false at the limit. A peer that closes has something
    /// to read (its end).
    pub(crate) fn wait_readable(&mut self, within: Option<Duration>) -> io::Result<bool> {
        let tls = match &mut self.transport {
            Transport::TlsServer(s) => Some(s.conn.process_new_packets()),
            Transport::TlsClient(s) => Some(s.conn.process_new_packets()),
            _ => None,
        };
        if let Some(state) = tls.transpose().map_err(io::Error::other)? {
            if state.plaintext_bytes_to_read() > 0 || state.peer_has_closed() {
                return Ok(true);
            }
        }
        let deadline = within.map(|w| Instant::now() + w);
        loop {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            // Rounded up: a wait of less than a millisecond is not a spin.
            let ms = left.map_or(-1, |l| {
                l.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32
            });
            let mut poll = libc::pollfd {
                fd: self.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one pollfd, a local, for a socket this connection owns.
            match unsafe { libc::poll(&raw mut poll, 1, ms) } {
                1.. => return Ok(true),
                0 if left.is_some_and(|l| l.is_zero()) => return Ok(false),
                0 => continue,
                _ => match io::Error::last_os_error() {
                    e if e.kind() == io::ErrorKind::Interrupted => continue,
                    e => return Err(e),
                },
            }
        }
    }

    /// `e` from a read or write on the socket, named: a timeout says how
    /// long it waited, and anything after a cut is the cut.
    fn named(&self, e: io::Error, waiting_for: &str) -> io::Error {
        if self.was_cut() {
            return io::Error::new(io::ErrorKind::ConnectionAborted, "the connection was cut");
        }
        if !matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        ) {
            return e;
        }
        let limit = match &self.transport {
            Transport::Unix(s) => s.read_timeout(),
            Transport::Tcp(s) => s.read_timeout(),
            Transport::TlsClient(s) => s.sock.read_timeout(),
            Transport::TlsServer(s) => s.sock.read_timeout(),
        };
        let after = limit
            .ok()
            .flatten()
            .map_or(String::new(), |l| format!(" in {} ms", l.as_millis()));
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("timed out: {waiting_for} {}{after}", self.peer),
        )
    }
}

fn set_tcp_timeouts(s: &TcpStream, limit: Option<Duration>) -> io::Result<()> {
    s.set_read_timeout(limit)?;
    s.set_write_timeout(limit)?;
    s.set_nodelay(true)
}

/// A socket, maybe in TLS, to read and write.
trait Stream: Read + Write {}

impl<T: Read + Write> Stream for T {}

impl Transport {
    fn stream(&mut self) -> &mut dyn Stream {
        match self {
            Self::Unix(s) => s,
            Self::Tcp(s) => s,
            Self::TlsClient(s) => s.as_mut(),
            Self::TlsServer(s) => s.as_mut(),
        }
    }
}

impl Read for Connection {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let read = self.transport.stream().read(buf);
        read.map_err(|e| self.named(e, "nothing came from"))
    }
}

impl Write for Connection {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let written = self.transport.stream().write(buf);
        written.map_err(|e| self.named(e, "nothing was taken by"))
    }

    fn flush(&mut self) -> io::Result<()> {
        let flushed = self.transport.stream().flush();
        flushed.map_err(|e| self.named(e, "nothing was taken by"))
    }
}

/// A second handle on a connection's socket, which shuts it down: the
/// thread blocked on it (reading, writing, in a handshake) returns at once
/// with an error, and what was written before still reaches the peer.
#[derive(Debug)]
pub(crate) struct Cutter {
    socket: Socket,
    cut: Arc<AtomicBool>,
}

#[derive(Debug)]
enum Socket {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Cutter {
    /// What cuts a Unix socket not yet made a connection.
    pub fn unix(sock: &UnixStream) -> io::Result<Self> {
        Ok(Self {
            socket: Socket::Unix(sock.try_clone()?),
            cut: Arc::default(),
        })
    }

    /// What cuts a TCP socket not yet made a connection.
    pub fn tcp(sock: &TcpStream) -> io::Result<Self> {
        Ok(Self {
            socket: Socket::Tcp(sock.try_clone()?),
            cut: Arc::default(),
        })
    }

    /// Shuts the connection down both ways.
    pub fn cut(&self) {
        self.cut.store(true, SeqCst);
        let _ = match &self.socket {
            Socket::Unix(s) => s.shutdown(Shutdown::Both),
            Socket::Tcp(s) => s.shutdown(Shutdown::Both),
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Connection, Connection) {
        let (a, b) = UnixStream::pair().unwrap();
        (
            Connection::unix(a, "unix:a".into()),
            Connection::unix(b, "unix:b".into()),
        )
    }

    #[test]
    fn a_timeout_says_how_long_it_waited_and_for_whom() {
        let (mut a, _b) = pair();
        a.set_timeouts(Some(Duration::from_millis(20))).unwrap();
        let e = a.read(&mut [0u8]).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        assert_eq!(
            e.to_string(),
            "timed out: nothing came from unix:a in 20 ms"
        );
    }

    #[test]
    fn a_cut_ends_a_blocked_read_at_once_and_names_what_follows() {
        let (mut a, _b) = pair();
        let cutter = a.cutter().unwrap();
        let reader = std::thread::spawn(move || {
            let read = a.read(&mut [0u8]).map_err(|e| e.to_string());
            (read, a.write(b"x").map_err(|e| e.to_string()))
        });
        std::thread::sleep(Duration::from_millis(20));
        cutter.cut();
        // A read on a socket shut down returns its end (0) or an error,
        // never blocks: the thread ends; a write after it names the cut.
        let (read, written) = reader.join().unwrap();
        assert!(matches!(read, Ok(0)) || read.is_err(), "{read:?}");
        assert_eq!(written, Err("the connection was cut".to_owned()));
    }

    #[test]
    fn wait_readable_sees_data_or_the_end_and_stops_at_its_limit() {
        let (mut a, mut b) = pair();
        assert!(!a.wait_readable(Some(Duration::from_millis(10))).unwrap());
        b.write_all(b"x").unwrap();
        assert!(a.wait_readable(Some(Duration::ZERO)).unwrap());
        let mut byte = [0u8];
        a.read_exact(&mut byte).unwrap();
        drop(b);
        assert!(a.wait_readable(None).unwrap(), "a peer's end is readable");
    }
}
