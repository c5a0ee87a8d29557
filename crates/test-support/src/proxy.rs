//! A TCP proxy between a migration's source and its destination that
//! breaks the link on cue: cuts every connection once so many bytes have
//! gone from the source, and takes no new one for a while; or holds the
//! source's bytes once the destination has answered so many.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::SeqCst};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// What the proxy does to the link.
#[derive(Clone, Copy, Debug)]
pub enum Plan {
    /// Once the destination has sent `answers` bytes back and then
    /// `bytes` more have gone from the source (over every connection),
    /// cuts the connection (both ways), then closes every new one at once
    /// for `down`: the link is down for that long. It cuts once.
    CutAt {
        /// Bytes from the destination before the source's are counted.
        answers: u64,
        /// Bytes from the source, counted, before the cut.
        bytes: u64,
        /// How long the link stays down.
        down: Duration,
    },
    /// Forwards the source's bytes until the destination has sent
    /// `answers` bytes back, then holds the source's bytes (the
    /// destination waits on them for ever).
    HoldAfter {
        /// Bytes from the destination before the hold.
        answers: u64,
    },
}

/// The proxy, listening on loopback; it stops when dropped.
#[derive(Debug)]
pub struct LinkProxy {
    address: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

#[derive(Debug)]
struct Shared {
    to: SocketAddr,
    plan: Plan,
    from_source: AtomicU64,
    from_destination: AtomicU64,
    cuts: AtomicU32,
    connections: AtomicU32,
    /// Nanoseconds since `start` until which the link is down.
    down_until_ns: AtomicU64,
    start: Instant,
    stop: AtomicBool,
}

impl LinkProxy {
    /// Listens on a loopback port for sources, forwarding each to `to`.
    pub fn start(to: SocketAddr, plan: Plan) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            to,
            plan,
            from_source: AtomicU64::new(0),
            from_destination: AtomicU64::new(0),
            cuts: AtomicU32::new(0),
            connections: AtomicU32::new(0),
            down_until_ns: AtomicU64::new(0),
            start: Instant::now(),
            stop: AtomicBool::new(false),
        });
        let address = listener.local_addr()?;
        let acceptor = thread::spawn({
            let shared = shared.clone();
            move || accept(&listener, &shared)
        });
        Ok(Self {
            address,
            shared,
            acceptor: Some(acceptor),
        })
    }

    /// Where sources connect.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// How many times it cut the link.
    pub fn cuts(&self) -> u32 {
        self.shared.cuts.load(SeqCst)
    }

    /// Connections it forwarded (those closed while the link was down
    /// not counted).
    pub fn connections(&self) -> u32 {
        self.shared.connections.load(SeqCst)
    }
}

impl Drop for LinkProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, SeqCst);
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
    }
}

impl Shared {
    fn down(&self) -> bool {
        (self.start.elapsed().as_nanos() as u64) < self.down_until_ns.load(SeqCst)
    }
}

fn accept(listener: &TcpListener, shared: &Arc<Shared>) {
    while !shared.stop.load(SeqCst) {
        match listener.accept() {
            Ok((source, _)) if shared.down() => drop(source),
            Ok((source, _)) => {
                let _ = source.set_nonblocking(false);
                if let Ok(destination) = TcpStream::connect(shared.to) {
                    shared.connections.fetch_add(1, SeqCst);
                    forward(source, destination, shared.clone());
                }
            }
            Err(_) => thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// Pumps both ways on two threads, each ending both sockets when it ends.
fn forward(source: TcpStream, destination: TcpStream, shared: Arc<Shared>) {
    let (Ok(s2), Ok(d2)) = (source.try_clone(), destination.try_clone()) else {
        return;
    };
    let back = shared.clone();
    thread::spawn(move || pump(s2, d2, &shared, true));
    thread::spawn(move || pump(destination, source, &back, false));
}

fn pump(mut from: TcpStream, mut to: TcpStream, shared: &Shared, from_source: bool) {
    let mut buf = vec![0u8; 64 << 10];
    while let Ok(n @ 1..) = from.read(&mut buf) {
        let allowed = match (shared.plan, from_source) {
            (Plan::CutAt { answers, bytes, .. }, true)
                if shared.cuts.load(SeqCst) == 0
                    && shared.from_destination.load(SeqCst) >= answers =>
            {
                let before = shared.from_source.fetch_add(n as u64, SeqCst);
                bytes.saturating_sub(before).min(n as u64) as usize
            }
            (Plan::HoldAfter { answers }, true)
                if shared.from_destination.load(SeqCst) >= answers =>
            {
                // Held: the destination never gets these.
                let _ = io::copy(&mut from, &mut io::sink());
                break;
            }
            _ => n,
        };
        if !from_source {
            shared.from_destination.fetch_add(n as u64, SeqCst);
        }
        if to.write_all(&buf[..allowed]).is_err() {
            break;
        }
        if allowed < n {
            if let Plan::CutAt { down, .. } = shared.plan {
                let until = shared.start.elapsed() + down;
                shared.down_until_ns.store(until.as_nanos() as u64, SeqCst);
                shared.cuts.fetch_add(1, SeqCst);
            }
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}
