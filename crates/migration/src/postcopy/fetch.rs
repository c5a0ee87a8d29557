//! The destination after a post-copy hand-over: the guest runs while one
//! thread asks the source for each page a fault waits on, fills each page
//! the source pushes (which wakes its waiters), fills here the pages it
//! knows to be zeros, and after a cut link takes its source back.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use reference_vmm::{StopHandle, StopReason, VmMemory};
use test_guests::layout::PAGE_SIZE;
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::pages::PageSet;
use super::{Note, percentiles};
use crate::stream::{Record, StreamError, StreamReader};
use crate::uffd::{self, Filled, Userfaultfd};
use crate::{AcceptLimits, Connection, Incoming, Listener, MigrationError, PEER_TIMEOUT};

/// How long the fetching thread waits on its source and its faults at a
/// time (it looks at both at once).
const TICK: Duration = Duration::from_millis(10);

/// The pages a post-copy destination's guest still lacks: unmapped and
/// registered with `userfaultfd(2)` before its guest runs, so that a touch
/// waits until the page is filled.
#[derive(Debug)]
pub struct PostcopyPages {
    id: u64,
    needed: PageSet,
    uffd: Userfaultfd,
    /// Keeps the mapping the fills go to.
    _memory: VmMemory,
    host: usize,
}

impl PostcopyPages {
    /// Unmaps `needed` in `memory` (what pre-copy wrote there is stale)
    /// and registers all of memory for missing-page faults.
    ///
    /// # Errors
    /// [`MigrationError::Userfaultfd`] where the kernel refuses it.
    pub(crate) fn prepare(
        memory: &VmMemory,
        id: u64,
        needed: PageSet,
    ) -> Result<Self, MigrationError> {
        let refused = MigrationError::Userfaultfd;
        let region = match memory.num_regions() {
            1 => memory.iter().next().expect("one region"),
            n => {
                return Err(refused(std::io::Error::other(format!(
                    "{n} memory regions, not one"
                ))));
            }
        };
        let host = memory.get_host_address(region.start_addr())? as usize;
        for (page, n) in needed.runs() {
            let at = (host + (page * PAGE_SIZE) as usize) as *mut libc::c_void;
            // SAFETY: the run lies inside guest memory's mapping (its pages
            // were checked against memory's size); the guest does not run.
            if unsafe { libc::madvise(at, (n * PAGE_SIZE) as usize, libc::MADV_DONTNEED) } != 0 {
                return Err(refused(std::io::Error::last_os_error()));
            }
        }
        let uffd = Userfaultfd::new().map_err(refused)?;
        uffd.register(host as *mut u8, region.len() as usize)
            .map_err(refused)?;
        Ok(Self {
            id,
            needed,
            uffd,
            _memory: memory.clone(),
            host,
        })
    }

    /// Pages still to come from the source.
    pub fn missing(&self) -> u64 {
        self.needed.len()
    }

    fn at(&self, page: u64) -> *mut u8 {
        (self.host + (page * PAGE_SIZE) as usize) as *mut u8
    }
}

/// Where a post-copy destination takes its source back after a cut link
/// (`receive --resume`).
pub struct Resume {
    /// The listener the source first came through, kept.
    pub listener: Listener,
    /// How it treats connections that are not the source.
    pub limits: AcceptLimits,
    /// How long the guest may wait for the source to come back; past it,
    /// the guest is lost.
    pub within: Duration,
    /// Gets a line for each connection dropped or taken back.
    pub log: fn(&str),
}

/// What a post-copy destination did, from the hand-over to its last page.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchReport {
    /// Pages filled from the source's records, pushed or asked for.
    pub filled: u64,
    /// Faults on pages it lacked: each asked the source.
    pub remote_faults: u64,
    /// Faults on pages it knew to be zeros (filled here).
    pub zero_faults: u64,
    /// The stall of a remote fault, from the fault's arrival to its page
    /// filled: the median, the 99th percentile and the longest.
    pub stall_p50: Duration,
    /// See `stall_p50`.
    pub stall_p99: Duration,
    /// See `stall_p50`.
    pub stall_max: Duration,
    /// Connections the source came back on after a cut link.
    pub reconnects: u32,
    /// From the start of fetching to the last page.
    pub took: Duration,
}

/// The thread fetching a post-copy destination's pages.
pub struct Fetching {
    thread: JoinHandle<Result<FetchReport, MigrationError>>,
}

impl Fetching {
    /// Waits until every page is here (or the guest is lost).
    ///
    /// # Errors
    /// [`MigrationError::GuestLost`] where the source went away for good:
    /// the VM was stopped.
    pub fn finish(self) -> Result<FetchReport, MigrationError> {
        self.thread
            .join()
            .map_err(|_| reference_vmm::Error::ThreadPanicked("post-copy"))?
    }
}

impl Incoming {
    /// Post-copy: starts fetching the pages the guest lacks from `input`
    /// (the connection it came on, past the hand-over), taking the source
    /// back through `resume` after a cut link; run the VM next. `None` for
    /// a guest that came whole (pre-copy).
    pub fn fetch(
        &mut self,
        input: StreamReader<Connection>,
        resume: Option<Resume>,
    ) -> Result<Option<Fetching>, MigrationError> {
        let Some(pages) = self.postcopy.take() else {
            return Ok(None);
        };
        let stop = self.vm.stop_handle();
        let fetcher = Fetcher::new(pages);
        let thread = thread::Builder::new()
            .name("postcopy".into())
            .spawn(move || {
                // The guest's vCPUs wait on this thread's fills.
                let _favoured = crate::favour::Favoured::realtime();
                fetcher.run(input, resume, &stop)
            })
            .map_err(|source| reference_vmm::Error::SpawnHelper {
                thread: "post-copy",
                source,
            })?;
        Ok(Some(Fetching { thread }))
    }
}

struct Fetcher {
    pages: PostcopyPages,
    /// Pages asked for and not yet filled: when each fault came.
    asked: HashMap<u64, Instant>,
    stalls: Vec<Duration>,
    report: FetchReport,
    faults: Vec<u64>,
}

impl Fetcher {
    fn new(pages: PostcopyPages) -> Self {
        Self {
            pages,
            asked: HashMap::new(),
            stalls: Vec::new(),
            report: FetchReport::default(),
            faults: Vec::new(),
        }
    }

    fn run(
        mut self,
        mut input: StreamReader<Connection>,
        resume: Option<Resume>,
        stop: &StopHandle,
    ) -> Result<FetchReport, MigrationError> {
        let start = Instant::now();
        input.pushes();
        while let Err(failed) = self.exchange(&mut input) {
            let back = match &resume {
                Some(resume) => self.take_back(resume),
                None => Err("this destination was not told to wait for it (--resume)".into()),
            };
            match back {
                Ok(next) => {
                    input = next;
                    self.report.reconnects += 1;
                }
                Err(why) => {
                    // The run ends; the fault thread's fd closes as this
                    // returns, which lets the vCPUs waiting on it leave.
                    stop.stop(StopReason::Requested);
                    return Err(MigrationError::GuestLost(format!(
                        "the source went away before every page was here ({failed}); {why}"
                    )));
                }
            }
        }
        [
            self.report.stall_p50,
            self.report.stall_p99,
            self.report.stall_max,
        ] = percentiles(&mut self.stalls);
        self.report.took = start.elapsed();
        Ok(self.report)
    }

    /// Serves faults and fills pages until the source's End, then says so;
    /// a source silent for [`PEER_TIMEOUT`] is gone.
    fn exchange(&mut self, input: &mut StreamReader<Connection>) -> Result<(), MigrationError> {
        let mut heard = Instant::now();
        loop {
            let connection = input.get_mut();
            let mut data = connection
                .wait_readable(Some(Duration::ZERO))
                .map_err(StreamError::Io)?;
            if !data {
                let fds = [self.pages.uffd.raw_fd(), connection.raw_fd()];
                data = uffd::wait_readable(&fds, TICK).map_err(StreamError::Io)?[1];
            }
            self.serve_faults(connection)?;
            if !data && heard.elapsed() < PEER_TIMEOUT {
                continue;
            }
            if !data {
                let silent = format!(
                    "nothing came from {} in {} s",
                    connection.peer(),
                    PEER_TIMEOUT.as_secs()
                );
                return Err(StreamError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    silent,
                ))
                .into());
            }
            heard = Instant::now();
            match input.next_record()? {
                Record::Pages { gpa, data } => {
                    self.fill(gpa, Some(&data), data.len() as u64 / PAGE_SIZE)?
                }
                Record::Zero { gpa, pages } => self.fill(gpa, None, pages)?,
                Record::End if self.pages.needed.is_empty() => {
                    Note::HaveAll
                        .write(input.get_mut())
                        .map_err(StreamError::Io)?;
                    return Ok(());
                }
                Record::End => {
                    return Err(MigrationError::GuestLost(format!(
                        "the source ended its pushes with {} pages still missing",
                        self.pages.needed.len()
                    )));
                }
                _ => {
                    return Err(MigrationError::GuestLost(
                        "the source sent a record other than pages after the hand-over".into(),
                    ));
                }
            }
        }
    }

    /// Asks the source for each faulting page it lacks (once), and fills
    /// with zeros each one it knows to be zeros.
    fn serve_faults(&mut self, connection: &mut Connection) -> Result<(), MigrationError> {
        self.faults.clear();
        self.pages
            .uffd
            .read_faults(&mut self.faults)
            .map_err(MigrationError::Userfaultfd)?;
        for i in 0..self.faults.len() {
            let Some(page) = (self.faults[i] as usize).checked_sub(self.pages.host) else {
                continue;
            };
            let page = page as u64 / PAGE_SIZE;
            if self.pages.needed.contains(page) {
                if let Entry::Vacant(asked) = self.asked.entry(page) {
                    asked.insert(Instant::now());
                    self.report.remote_faults += 1;
                    Note::Ask(page * PAGE_SIZE)
                        .write(connection)
                        .map_err(StreamError::Io)?;
                }
            } else if page < self.pages.needed.capacity() {
                let filled = self
                    .pages
                    .uffd
                    .zero(self.pages.at(page), PAGE_SIZE as usize);
                if filled.map_err(MigrationError::Userfaultfd)? == Filled::Now {
                    self.report.zero_faults += 1;
                }
            }
        }
        Ok(())
    }

    /// Fills the pages of a run it still lacks: `data`'s, or zeros; each
    /// stretch of them with one call.
    fn fill(&mut self, gpa: u64, data: Option<&[u8]>, pages: u64) -> Result<(), MigrationError> {
        let first = gpa / PAGE_SIZE;
        let mut page = first;
        while page < first + pages {
            let start = page;
            while page < first + pages && self.pages.needed.remove(page) {
                page += 1;
            }
            if page > start {
                let bytes = |from: u64, n: u64| {
                    data.map(|d| {
                        &d[((from - first) * PAGE_SIZE) as usize..][..(n * PAGE_SIZE) as usize]
                    })
                };
                self.fill_stretch(start, page - start, bytes)?;
            }
            page += 1;
        }
        Ok(())
    }

    /// Fills `n` pages from `start` that it lacked (`bytes(from, n)`: their
    /// data, `None` for zeros): one call, or a call a page where another
    /// was there already.
    fn fill_stretch<'a>(
        &mut self,
        start: u64,
        n: u64,
        bytes: impl Fn(u64, u64) -> Option<&'a [u8]>,
    ) -> Result<(), MigrationError> {
        let uffd = &self.pages.uffd;
        let fill = |from: u64, n: u64| match bytes(from, n) {
            Some(data) => uffd.copy(self.pages.at(from), data),
            None => uffd.zero(self.pages.at(from), (n * PAGE_SIZE) as usize),
        };
        let whole = fill(start, n).map_err(MigrationError::Userfaultfd)?;
        if whole == Filled::Already && n > 1 {
            // The call stopped at a page there already: a page at a time.
            for page in start..start + n {
                fill(page, 1).map_err(MigrationError::Userfaultfd)?;
            }
        }
        self.report.filled += n;
        for page in start..start + n {
            if let Some(asked) = self.asked.remove(&page) {
                self.stalls.push(asked.elapsed());
            }
        }
        Ok(())
    }

    /// Waits, `resume.within` at most, for this move's source to come
    /// back; tells it the pages still lacked and asks again for those
    /// faults wait on.
    fn take_back(&mut self, resume: &Resume) -> Result<StreamReader<Connection>, String> {
        let deadline = Instant::now() + resume.within;
        let size = self.pages.needed.capacity() * PAGE_SIZE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "it did not come back within {} ms",
                    resume.within.as_millis()
                ));
            }
            let limits = AcceptLimits {
                wait: Some(left),
                ..resume.limits
            };
            let mut log = |line: &str| (resume.log)(line);
            let input = match resume.listener.accept_source(&limits, &mut log) {
                Ok(input) => input,
                Err(MigrationError::NoSource(_)) => continue,
                Err(e) => return Err(e.to_string()),
            };
            let mut input = StreamReader::resumed(input.into_inner(), size);
            let peer = input.get_mut().peer().to_owned();
            match input.next_record() {
                Ok(Record::Postcopy(id)) if id == self.pages.id => {}
                Ok(_) => {
                    (resume.log)(&format!("dropped {peer}: not this move's source"));
                    continue;
                }
                Err(e) => {
                    (resume.log)(&format!("dropped {peer}: {e}"));
                    continue;
                }
            }
            match self.tell_lacking(input.get_mut()) {
                Ok(()) => {
                    (resume.log)(&format!(
                        "post-copy: the source is back on {peer}, {} pages to go",
                        self.pages.needed.len()
                    ));
                    return Ok(input);
                }
                Err(e) => (resume.log)(&format!("dropped {peer}: {e}")),
            }
        }
    }

    fn tell_lacking(&self, connection: &mut Connection) -> std::io::Result<()> {
        Note::Needed(self.pages.needed.clone()).write(connection)?;
        for &page in self.asked.keys() {
            Note::Ask(page * PAGE_SIZE).write(connection)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::os::unix::net::UnixStream;

    use vm_memory::{Bytes, GuestAddress};

    use super::*;
    use crate::Address;
    use crate::stream::StreamWriter;

    const PAGES: u64 = 16;

    /// Guest memory of [`PAGES`] pages, page 1 holding what pre-copy sent
    /// (stale by the switch); post-copy lacking pages 1, 2 and 5. `None`
    /// (said) where userfaultfd is refused.
    fn lacking() -> Option<(VmMemory, PostcopyPages)> {
        let memory =
            VmMemory::from_ranges(&[(GuestAddress(0), (PAGES * PAGE_SIZE) as usize)]).unwrap();
        memory
            .write_slice(&[3; PAGE_SIZE as usize], GuestAddress(PAGE_SIZE))
            .unwrap();
        let mut needed = PageSet::new(PAGES);
        for page in [1, 2, 5] {
            needed.insert_run(page, 1);
        }
        match PostcopyPages::prepare(&memory, 7, needed) {
            Ok(pages) => Some((memory, pages)),
            Err(e) => {
                let why = format!("userfaultfd(2) is refused here: {e}");
                test_support::kvm::skip("migration", "postcopy::fetch::tests", &why);
                None
            }
        }
    }

    /// What a fetcher's thread ends with, and the VM's stop handle.
    type Fetched = JoinHandle<(Result<FetchReport, MigrationError>, StopHandle)>;

    /// A fetcher reading from one end of a socket pair; the other end.
    fn fetching(pages: PostcopyPages, resume: Option<Resume>) -> (UnixStream, Fetched) {
        let (source, destination) = UnixStream::pair().unwrap();
        let input = StreamReader::resumed(
            Connection::unix(destination, "unix:source".into()),
            PAGES * PAGE_SIZE,
        );
        let thread = thread::spawn(move || {
            let stop = StopHandle::default();
            (Fetcher::new(pages).run(input, resume, &stop), stop)
        });
        (source, thread)
    }

    #[test]
    fn pushed_pages_fill_what_was_lacked_and_the_end_is_answered_with_have_all() {
        let Some((memory, pages)) = lacking() else {
            return;
        };
        assert_eq!(pages.missing(), 3);
        let (source, fetcher) = fetching(pages, None);
        let mut out = StreamWriter::after_header(&source);
        out.pages(PAGE_SIZE, &[[8; 4096], [0; 4096]].concat())
            .unwrap();
        out.pages(5 * PAGE_SIZE, &[6; 4096]).unwrap();
        // A page it has (pushed twice) is left as it is.
        out.pages(PAGE_SIZE, &[9; 4096]).unwrap();
        out.end().unwrap();
        let said = Note::read(&mut &source, PAGES).unwrap();
        assert_eq!(said, Note::HaveAll);
        let (report, stop) = fetcher.join().unwrap();
        assert_eq!(report.unwrap().filled, 3);
        assert_eq!(stop.requested(), None);
        let page = |n: u64| {
            let mut bytes = [0u8; 4096];
            memory
                .read_slice(&mut bytes, GuestAddress(n * PAGE_SIZE))
                .unwrap();
            bytes
        };
        assert_eq!(
            (page(1)[0], page(2)[0], page(5)[0], page(3)[0]),
            (8, 0, 6, 0)
        );
    }

    #[test]
    fn a_source_that_ends_short_or_sends_a_stray_record_loses_the_guest_and_stops_the_vm() {
        for stray in [false, true] {
            let Some((_memory, pages)) = lacking() else {
                return;
            };
            let (source, fetcher) = fetching(pages, None);
            let mut out = StreamWriter::after_header(&source);
            match stray {
                true => out.postcopy(7).unwrap(),
                false => out.end().unwrap(),
            }
            (&source).flush().unwrap();
            let (report, stop) = fetcher.join().unwrap();
            let e = report.unwrap_err().to_string();
            let why = match stray {
                true => "a record other than pages",
                false => "with 3 pages still missing",
            };
            assert!(
                e.starts_with("the guest is lost: ") && e.contains(why),
                "{e}"
            );
            assert!(
                e.ends_with("this destination was not told to wait for it (--resume)"),
                "{e}"
            );
            assert_eq!(stop.requested(), Some(StopReason::Requested));
        }
    }

    #[test]
    fn a_source_that_does_not_come_back_in_time_loses_the_guest() {
        let Some((_memory, pages)) = lacking() else {
            return;
        };
        let path = std::env::temp_dir().join(format!("rvmm-resume-{}.sock", std::process::id()));
        let listener = Address::Unix(path).listen().unwrap();
        let resume = Resume {
            listener,
            limits: AcceptLimits::default(),
            within: Duration::from_millis(50),
            log: |_| {},
        };
        let (source, fetcher) = fetching(pages, Some(resume));
        drop(source);
        let (report, stop) = fetcher.join().unwrap();
        let e = report.unwrap_err().to_string();
        assert!(e.ends_with("it did not come back within 50 ms"), "{e}");
        assert_eq!(stop.requested(), Some(StopReason::Requested));
    }

    /// After a cut, only this move's source is taken back: a connection
    /// with another move's id, and one whose first record is damaged, are
    /// dropped; the source is told the pages still lacked and pushes them.
    #[test]
    fn after_a_cut_only_this_moves_source_is_taken_back() {
        let Some((memory, pages)) = lacking() else {
            return;
        };
        let path = std::env::temp_dir().join(format!("rvmm-back-{}.sock", std::process::id()));
        let address = Address::Unix(path);
        let resume = Resume {
            listener: address.listen().unwrap(),
            limits: AcceptLimits::default(),
            within: Duration::from_secs(30),
            log: |line| eprintln!("{line}"),
        };
        let (source, fetcher) = fetching(pages, Some(resume));
        drop(source);
        let dropped = |first: &dyn Fn(&mut Connection)| {
            let mut stranger = address.connect().unwrap();
            first(&mut stranger);
            stranger.flush().unwrap();
            let mut rest = Vec::new();
            let _ = std::io::Read::read_to_end(&mut stranger, &mut rest);
            assert!(rest.is_empty(), "a stranger was answered: {rest:?}");
        };
        dropped(&|c| StreamWriter::after_header(c).postcopy(99).unwrap());
        dropped(&|c| c.write_all(&[0xff; 21]).unwrap());
        let mut back = address.connect().unwrap();
        let mut out = StreamWriter::after_header(&mut back);
        out.postcopy(7).unwrap();
        out.get_mut().flush().unwrap();
        let Note::Needed(lacked) = Note::read(out.get_mut(), PAGES).unwrap() else {
            panic!("no list of the pages lacked")
        };
        assert_eq!(lacked.runs(), vec![(1, 2), (5, 1)]);
        out.pages(PAGE_SIZE, &[4; 8192]).unwrap();
        out.pages(5 * PAGE_SIZE, &[5; 4096]).unwrap();
        out.end().unwrap();
        assert_eq!(Note::read(&mut back, PAGES).unwrap(), Note::HaveAll);
        let report = fetcher.join().unwrap().0.unwrap();
        assert_eq!((report.reconnects, report.filled), (1, 3));
        let mut byte = [0u8];
        memory
            .read_slice(&mut byte, GuestAddress(2 * PAGE_SIZE))
            .unwrap();
        assert_eq!(byte[0], 4);
    }
}
