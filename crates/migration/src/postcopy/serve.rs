//! The source after a post-copy hand-over: its guest stopped for good, its
//! memory kept until the destination has every page. It answers each page
//! the destination asks for at once and pushes the rest in small records
//! between, keeping its socket's queue short so that an answer never waits
//! behind it; after a cut link it connects again where told to.

use std::io::{BufWriter, Write};
use std::thread;
use std::time::{Duration, Instant};

use reference_vmm::VmMemory;
use test_guests::layout::PAGE_SIZE;

use super::pages::PageSet;
use super::{Note, PUSH_PAGES, PUSH_WINDOW, QUEUE_BYTES};
use crate::stream::{StreamError, StreamWriter, is_zero, send_pages};
use crate::{Connection, MigrationError, PEER_TIMEOUT};
use vm_memory::{Bytes, GuestAddress};

/// The stream to the destination, continued after the hand-over.
pub(crate) type Out = StreamWriter<BufWriter<Connection>>;

/// How long a source waits between tries to reach its destination again.
const RETRY: Duration = Duration::from_millis(100);

/// What the source did after the hand-over.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Served {
    /// Pages sent, pushed or asked for.
    pub pages: u64,
    /// Pages the destination asked for.
    pub asked: u64,
    /// New connections after a cut link.
    pub reconnects: u32,
}

/// How a source reaches its destination again after a cut link, and for
/// how long it tries.
pub(crate) struct Reconnect<'a> {
    pub connect: &'a dyn Fn() -> Result<Connection, MigrationError>,
    pub within: Duration,
}

/// Serves the destination until it has every page of `needed`, `limit`
/// at most; connects again through `reconnect` after a failure, where
/// given.
///
/// # Errors
/// [`MigrationError::GuestLost`]: the destination went away (or broke the
/// protocol) without every page, and could not be reached again; or the
/// limit passed.
pub(crate) fn serve(
    mut out: Out,
    memory: &VmMemory,
    (mut needed, id): (PageSet, u64),
    reconnect: Option<Reconnect<'_>>,
    limit: Duration,
) -> Result<Served, MigrationError> {
    let mut served = Served::default();
    let deadline = Instant::now() + limit;
    loop {
        let failed = match serve_on(&mut out, memory, &mut needed, &mut served, deadline) {
            Ok(()) => return Ok(served),
            Err(e @ MigrationError::GuestLost(_)) => return Err(e),
            Err(e) => e,
        };
        let Some(reconnect) = &reconnect else {
            return Err(lost(
                &failed,
                "the source was not told to reconnect (--migrate-resume)",
            ));
        };
        out = connect_again(reconnect, id, &mut needed).map_err(|why| lost(&failed, &why))?;
        served.reconnects += 1;
    }
}

fn lost(failed: &MigrationError, after: &str) -> MigrationError {
    MigrationError::GuestLost(format!(
        "the destination ran it and went away before it had every page ({failed}); {after}"
    ))
}

/// One connection's share: asked pages first, pushes between, End once
/// all are sent, until the destination says it has them all.
fn serve_on(
    out: &mut Out,
    memory: &VmMemory,
    needed: &mut PageSet,
    served: &mut Served,
    deadline: Instant,
) -> Result<(), MigrationError> {
    let pages = needed.capacity();
    let mut buf = Vec::new();
    let mut ended = false;
    loop {
        if Instant::now() >= deadline {
            return Err(MigrationError::GuestLost(format!(
                "post-copy ran past its time limit (--migrate-timeout-ms) with {} pages still at \
                 the source",
                needed.len()
            )));
        }
        let connection = out.get_mut().get_mut();
        let queued = connection.unsent().map_err(StreamError::Io)? > QUEUE_BYTES;
        let wait = match (ended, queued) {
            (true, _) => PEER_TIMEOUT.min(deadline.saturating_duration_since(Instant::now())),
            (false, true) => Duration::from_micros(200),
            (false, false) => Duration::ZERO,
        };
        if connection
            .wait_readable(Some(wait))
            .map_err(StreamError::Io)?
        {
            match Note::read(connection, pages).map_err(StreamError::Io)? {
                Note::Ask(gpa) => {
                    served.asked += 1;
                    // A page already sent is ahead of the answer in the
                    // stream: the destination fills it from there, and may
                    // have every page and be gone by the time an answer
                    // would reach it.
                    if needed.remove(gpa / PAGE_SIZE) {
                        send_pages(memory, out, gpa, PAGE_SIZE, &mut buf)?;
                        out.get_mut().flush().map_err(StreamError::Io)?;
                        served.pages += 1;
                    }
                }
                Note::HaveAll => return Ok(()),
                Note::Needed(_) => return Err(protocol("a list of pages on a running connection")),
            }
            continue;
        }
        if ended {
            return Err(protocol(
                "no word that it has every page within the peer timeout",
            ));
        }
        if queued {
            continue;
        }
        match needed.take_run(PUSH_WINDOW) {
            Some((page, n)) => {
                served.pages += push(out, memory, needed, (page, n), &mut buf)?;
                out.get_mut().flush().map_err(StreamError::Io)?;
            }
            None => {
                out.end()?;
                ended = true;
            }
        }
    }
}

/// Pushes the start of the run `(page, n)`: its pages up to the
/// [`PUSH_PAGES`]th that holds data (zero pages go as one record each
/// stretch, for nothing); the rest goes back to `needed`, first in line.
/// Returns the pages sent.
fn push(
    out: &mut Out,
    memory: &VmMemory,
    needed: &mut PageSet,
    (page, n): (u64, u64),
    buf: &mut Vec<u8>,
) -> Result<u64, MigrationError> {
    let page_bytes = PAGE_SIZE as usize;
    // Read a push's worth at a time, until the data fills one.
    let (mut read, mut data) = (0, 0);
    buf.clear();
    while read < n && data < PUSH_PAGES {
        let k = (n - read).min(PUSH_PAGES);
        buf.resize((read + k) as usize * page_bytes, 0);
        let chunk = &mut buf[read as usize * page_bytes..];
        memory.read_slice(chunk, GuestAddress((page + read) * PAGE_SIZE))?;
        data += chunk.chunks(page_bytes).filter(|p| !is_zero(p)).count() as u64;
        read += k;
    }
    let mut data = 0;
    let sent = buf
        .chunks(page_bytes)
        .take_while(|p| {
            let before = data;
            data += u64::from(!is_zero(p));
            before < PUSH_PAGES
        })
        .count() as u64;
    out.pages(page * PAGE_SIZE, &buf[..sent as usize * page_bytes])?;
    if sent < n {
        needed.put_back(page + sent, n - sent);
    }
    Ok(sent)
}

fn protocol(what: &str) -> MigrationError {
    MigrationError::Stream(StreamError::Io(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!("the destination sent {what}"),
    )))
}

/// Connects to the destination again, within `reconnect.within`: the
/// move's id out, the pages it still lacks back (they replace `needed`).
fn connect_again(reconnect: &Reconnect<'_>, id: u64, needed: &mut PageSet) -> Result<Out, String> {
    let deadline = Instant::now() + reconnect.within;
    let mut last = String::from("no try");
    while Instant::now() < deadline {
        match (reconnect.connect)().and_then(|c| resume_on(c, id, needed.capacity())) {
            Ok((out, lacking)) => {
                *needed = lacking;
                return Ok(out);
            }
            Err(e) => last = e.to_string(),
        }
        thread::sleep(RETRY);
    }
    Err(format!(
        "it could not be reached again within {} ms (last: {last}): the guest is lost, and never \
         runs here again",
        reconnect.within.as_millis()
    ))
}

fn resume_on(
    connection: Connection,
    id: u64,
    pages: u64,
) -> Result<(Out, PageSet), MigrationError> {
    let mut out = StreamWriter::after_header(BufWriter::new(connection));
    out.postcopy(id)?;
    out.get_mut().flush().map_err(StreamError::Io)?;
    match Note::read(out.get_mut().get_mut(), pages).map_err(StreamError::Io)? {
        Note::Needed(lacking) => Ok((out, lacking)),
        _ => Err(protocol(
            "something else than the pages it lacks on a new connection",
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixStream;
    use std::thread;

    use super::*;
    use crate::stream::{Record, StreamReader};

    const PAGES: u64 = 32;

    /// Guest memory whose page `n` holds `n` (page 0 zeros).
    fn memory() -> VmMemory {
        let memory =
            VmMemory::from_ranges(&[(GuestAddress(0), (PAGES * PAGE_SIZE) as usize)]).unwrap();
        for n in 1..PAGES {
            memory
                .write_slice(&[n as u8; 4096], GuestAddress(n * PAGE_SIZE))
                .unwrap();
        }
        memory
    }

    fn pair() -> (Out, UnixStream) {
        let (source, destination) = UnixStream::pair().unwrap();
        let out =
            StreamWriter::after_header(BufWriter::new(Connection::unix(source, "unix:d".into())));
        (out, destination)
    }

    /// Reads pushes to the End, the first page of each record in order
    /// (a zero run's as 0), then says HAVE_ALL.
    fn read_pushes(sock: &UnixStream, input: &mut StreamReader<&UnixStream>) -> Vec<(u64, u8)> {
        let mut seen = Vec::new();
        loop {
            match input.next_record().unwrap() {
                Record::Pages { gpa, data } => seen.push((gpa / PAGE_SIZE, data[0])),
                Record::Zero { gpa, .. } => seen.push((gpa / PAGE_SIZE, 0)),
                Record::End => break,
                other => panic!("{other:?}"),
            }
        }
        Note::HaveAll.write(&mut &*sock).unwrap();
        seen
    }

    /// [`read_pushes`] on its own thread.
    fn destination(sock: UnixStream) -> thread::JoinHandle<Vec<(u64, u8)>> {
        thread::spawn(move || {
            let mut input = StreamReader::resumed(&sock, PAGES * PAGE_SIZE);
            read_pushes(&sock, &mut input)
        })
    }

    #[test]
    fn an_asked_page_goes_first_then_the_pushes_until_the_destination_has_all() {
        let (out, sock) = pair();
        Note::Ask(20 * PAGE_SIZE).write(&mut &sock).unwrap();
        let seen = destination(sock);
        let served = serve(out, &memory(), (PageSet::all(PAGES), 9), None, PEER_TIMEOUT).unwrap();
        let seen = seen.join().unwrap();
        assert_eq!(seen[0], (20, 20), "the asked page first: {seen:?}");
        assert_eq!(
            (served.asked, served.pages, served.reconnects),
            (1, PAGES, 0)
        );
        // Zero page 0 and data pages 1..8 in the first push: 8 pages of
        // data at most, the rest back first in line.
        assert_eq!(&seen[1..4], &[(0, 0), (1, 1), (9, 9)], "{seen:?}");
    }

    /// The destination asked for a page the source had pushed already, got
    /// it from the push, had every page and went: the source answers
    /// nothing (the destination is gone) and the move has succeeded.
    #[test]
    fn an_ask_for_a_page_already_pushed_gets_no_second_copy() {
        let (out, sock) = pair();
        let seen = thread::spawn(move || {
            let mut input = StreamReader::resumed(&sock, PAGES * PAGE_SIZE);
            let mut seen = Vec::new();
            while let Record::Pages { gpa, .. } | Record::Zero { gpa, .. } =
                input.next_record().unwrap()
            {
                seen.push(gpa / PAGE_SIZE);
            }
            Note::Ask(5 * PAGE_SIZE).write(&mut &sock).unwrap();
            Note::HaveAll.write(&mut &sock).unwrap();
            seen
        });
        let served = serve(out, &memory(), (PageSet::all(PAGES), 9), None, PEER_TIMEOUT).unwrap();
        assert!(seen.join().unwrap().contains(&0));
        assert_eq!(
            (served.asked, served.pages, served.reconnects),
            (1, PAGES, 0)
        );
    }

    #[test]
    fn a_destination_that_breaks_the_protocol_or_outlasts_the_limit_loses_the_guest() {
        let (out, sock) = pair();
        Note::Needed(PageSet::all(PAGES)).write(&mut &sock).unwrap();
        let e = serve(out, &memory(), (PageSet::all(PAGES), 9), None, PEER_TIMEOUT).unwrap_err();
        let e = e.to_string();
        assert!(e.contains("a list of pages on a running connection"), "{e}");
        assert!(e.ends_with("(--migrate-resume)"), "{e}");
        let (out, _sock) = pair();
        let e = serve(
            out,
            &memory(),
            (PageSet::all(PAGES), 9),
            None,
            Duration::ZERO,
        )
        .unwrap_err();
        assert!(e.to_string().contains("ran past its time limit"), "{e}");
    }

    /// After a cut, the source connects again: the move's id out, the
    /// pages lacked back, and only those pushed; a destination it cannot
    /// reach again within the window loses the guest.
    #[test]
    fn a_source_told_to_reconnect_goes_on_with_the_pages_lacked_or_gives_up_in_time() {
        let (out, sock) = pair();
        drop(sock);
        // The first destination that answers says something else than the
        // pages it lacks: the source tries again.
        let (confused, confused_peer) = UnixStream::pair().unwrap();
        Note::HaveAll.write(&mut &confused_peer).unwrap();
        let (again, peer) = UnixStream::pair().unwrap();
        let again = std::sync::Mutex::new(vec![again, confused]);
        let connect = || {
            let sock = again.lock().unwrap().pop().ok_or(MigrationError::Stopped)?;
            Ok(Connection::unix(sock, "unix:again".into()))
        };
        let back = thread::spawn(move || {
            let mut input = StreamReader::resumed(&peer, PAGES * PAGE_SIZE);
            assert!(matches!(input.next_record(), Ok(Record::Postcopy(9))));
            let mut lacked = PageSet::new(PAGES);
            lacked.insert_run(30, 2);
            Note::Needed(lacked).write(&mut &peer).unwrap();
            read_pushes(&peer, &mut input)
        });
        let reconnect = Reconnect {
            connect: &connect,
            within: Duration::from_secs(10),
        };
        let served = serve(
            out,
            &memory(),
            (PageSet::all(PAGES), 9),
            Some(reconnect),
            PEER_TIMEOUT,
        )
        .unwrap();
        assert_eq!(back.join().unwrap(), vec![(30, 30)]);
        assert_eq!(served.reconnects, 1);

        let (out, sock) = pair();
        drop(sock);
        let never = || Err(MigrationError::Stopped);
        let reconnect = Reconnect {
            connect: &never,
            within: Duration::from_millis(50),
        };
        let e = serve(
            out,
            &memory(),
            (PageSet::all(PAGES), 9),
            Some(reconnect),
            PEER_TIMEOUT,
        )
        .unwrap_err();
        assert!(
            e.to_string()
                .contains("could not be reached again within 50 ms"),
            "{e}"
        );
    }
}
