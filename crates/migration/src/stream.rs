//! The migration stream: a header, then records, each length-prefixed,
//! numbered and checksummed, in an order the reader enforces.
//!
//! ```text
//! header:  "RVMMSTRM"  version: u32
//! record:  kind: u8  seq: u32  len: u32  payload: [u8; len]  crc32: u32
//!          (the CRC covers kind, seq, len and the payload; all little-endian)
//! order:   Config, [Chain], (Pages | Zero)*, Vcpu (one per vCPU, any order), End
//! ```
//!
//! A snapshot's `Chain` record names it and the snapshot it follows: a
//! full one (a base, parent 0), or an increment holding only the pages
//! written since its parent ([`crate::SnapshotKind`]). A live migration's
//! stream has none.
//!
//! A run of pages that hold only zeros travels as a `Zero` record (its
//! address and page count) rather than as bytes: most of a fresh guest's
//! memory is zeros, and on a real link those bytes are the first round's
//! whole cost.
//!
//! Everything in a stream is input from elsewhere (another host, a file):
//! the reader never trusts a length before checking it against
//! [`MAX_PAYLOAD`], a page run before checking it against the VM's memory,
//! or a vCPU index before checking it against the VM's vCPU count. A stream
//! that is cut, corrupted, oversized, reordered or incomplete is a
//! [`StreamError`] that says which and where; nothing is applied from a
//! record whose checksum failed.

use std::io::{self, Read, Write};
use std::ops::Range;

use super::state::Saved;
use crate::MigrationError;
use reference_vmm::VmMemory;
use reference_vmm::{VcpuState, VmDescription};
use test_guests::layout::PAGE_SIZE;
use vm_memory::{Bytes, GuestAddress};

/// The first bytes of every stream.
pub const MAGIC: [u8; 8] = *b"RVMMSTRM";
/// The format this code writes and reads.
pub const VERSION: u32 = 4;
/// Bytes of guest memory in one `Pages` record, at most.
pub const MAX_PAGES_BYTES: usize = 1 << 20;
/// The largest payload a reader accepts: a full `Pages` record and its
/// address (a vCPU's state is a few KiB).
pub const MAX_PAYLOAD: usize = MAX_PAGES_BYTES + 8;

/// What a record holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// The VM's description ([`VmDescription`]): always first.
    Config = 1,
    /// A run of guest pages: its guest address, then its bytes.
    Pages = 2,
    /// One vCPU's complete state ([`VcpuState`]), once the VM is paused.
    Vcpu = 3,
    /// The end: every vCPU's state has been sent.
    End = 4,
    /// A run of pages that hold only zeros: its guest address, then its
    /// page count.
    Zero = 5,
    /// A snapshot's place in its chain: its id, then its parent's (0: none).
    Chain = 6,
    /// Post-copy: the move's id (its first 8 bytes; 8 more, zero). Before
    /// the Missing runs; the first record of a stream that resumes one.
    Postcopy = 7,
    /// Post-copy: a run of pages the destination must fetch (the guest
    /// runs there without them): its guest address, then its page count.
    Missing = 8,
    /// A snapshot: a run of pages held in its memory image, past the End
    /// record ([`crate::image`]): its guest address, then its page count.
    Image = 9,
}

impl Kind {
    fn from_u8(kind: u8) -> Option<Self> {
        [
            Self::Config,
            Self::Pages,
            Self::Vcpu,
            Self::End,
            Self::Zero,
            Self::Chain,
            Self::Postcopy,
            Self::Missing,
            Self::Image,
        ]
        .into_iter()
        .find(|k| *k as u8 == kind)
    }
}

/// Why a stream could not be written or was rejected.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The connection or file failed.
    #[error("the stream failed: {0}")]
    Io(#[from] io::Error),
    /// It ended in the middle of the header or of a record.
    #[error("the stream was cut off in the middle of {0}")]
    Truncated(&'static str),
    /// It ended at a record boundary, before its `End` record.
    #[error("the stream ended before its End record: the source stopped sending")]
    Incomplete,
    /// Not a migration stream at all.
    #[error("not a reference-vmm migration stream (its first bytes are {0:02x?})")]
    Magic([u8; 8]),
    /// A format this code does not read.
    #[error("stream format version {found}, but this reference-vmm reads version {VERSION}")]
    Version {
        /// The stream's.
        found: u32,
    },
    /// A record whose length is over [`MAX_PAYLOAD`].
    #[error("record {seq} says it holds {len} bytes, more than the {MAX_PAYLOAD} allowed")]
    Oversized {
        /// Its number.
        seq: u32,
        /// The length it claimed.
        len: u32,
    },
    /// A record whose checksum does not match: corrupted on the way.
    #[error("record {seq} is corrupted (its CRC32 does not match)")]
    Checksum {
        /// Its number.
        seq: u32,
    },
    /// A record out of sequence: one was lost, repeated or reordered.
    #[error("record {found} came where record {expected} was due (lost, repeated or reordered)")]
    Sequence {
        /// The number due.
        expected: u32,
        /// The number found.
        found: u32,
    },
    /// A record kind this format does not have.
    #[error("record {seq} has unknown kind {kind}")]
    UnknownKind {
        /// Its number.
        seq: u32,
        /// The kind byte.
        kind: u8,
    },
    /// A record where the order does not allow it.
    #[error("record {seq} ({kind:?}) is out of order: {why}")]
    Order {
        /// Its number.
        seq: u32,
        /// Its kind.
        kind: Kind,
        /// The rule it broke.
        why: &'static str,
    },
    /// A record whose payload does not decode.
    #[error("record {seq} ({kind:?}) is malformed: {why}")]
    Payload {
        /// Its number.
        seq: u32,
        /// Its kind.
        kind: Kind,
        /// What is wrong with it.
        why: String,
    },
}

/// A decoded record after the Config record ([`StreamReader::config`]).
#[derive(Debug)]
pub enum Record {
    /// Guest memory at `gpa`: whole pages, inside the VM's memory.
    Pages {
        /// Guest physical address of the first page.
        gpa: u64,
        /// The pages' bytes.
        data: Vec<u8>,
    },
    /// `pages` pages at `gpa` that hold only zeros, inside the VM's memory.
    Zero {
        /// Guest physical address of the first page.
        gpa: u64,
        /// How many pages.
        pages: u64,
    },
    /// One vCPU's state.
    Vcpu(Box<VcpuState>),
    /// The end of the stream.
    End,
    /// A snapshot's place in its chain, right after the Config record.
    Chain(Link),
    /// The guest moves in post-copy; the move's id (never 0).
    Postcopy(u64),
    /// `pages` pages at `gpa` the destination must fetch after the
    /// hand-over, inside the VM's memory.
    Missing {
        /// Guest physical address of the first page.
        gpa: u64,
        /// How many pages.
        pages: u64,
    },
    /// `pages` pages at `gpa` held in the snapshot's memory image, after
    /// the End record; runs in ascending order, inside the VM's memory.
    Image {
        /// Guest physical address of the first page.
        gpa: u64,
        /// How many pages.
        pages: u64,
    },
}

/// A snapshot's place in its chain: an increment holds the pages written
/// since its parent, and restores only after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Link {
    /// The snapshot's id (never 0).
    pub id: u64,
    /// The id of the snapshot it follows; 0 for a full snapshot.
    pub parent: u64,
}

impl Link {
    /// Whether the snapshot holds every page (a base).
    pub fn is_full(&self) -> bool {
        self.parent == 0
    }
}

/// Writes a stream: the header at once, then one record per call.
#[derive(Debug)]
pub struct StreamWriter<W: Write> {
    out: W,
    seq: u32,
}

impl<W: Write> StreamWriter<W> {
    /// Starts a stream on `out` (writes the header).
    pub fn new(mut out: W) -> Result<Self, StreamError> {
        out.write_all(&header())?;
        Ok(Self::after_header(out))
    }

    /// Goes on with a stream on `out` whose header was written already (a
    /// source sends it when it connects: [`super::handover`]).
    pub fn after_header(out: W) -> Self {
        Self { out, seq: 0 }
    }

    /// The VM's description.
    pub fn config(&mut self, description: &VmDescription) -> Result<(), StreamError> {
        self.record(Kind::Config, &description.encode())
    }

    /// Guest pages at `gpa` (whole pages): each run of zero pages as one
    /// `Zero` record, the others' bytes in records of at most
    /// [`MAX_PAGES_BYTES`]. Returns the pages written.
    pub fn pages(&mut self, gpa: u64, data: &[u8]) -> Result<u64, StreamError> {
        for (zero, range) in stretches(data) {
            let at = gpa + range.start as u64;
            match zero {
                true => self.zero(at, range.len() as u64 / PAGE_SIZE)?,
                false => self.bytes(at, &data[range])?,
            }
        }
        Ok(data.len() as u64 / PAGE_SIZE)
    }

    /// `pages` pages at `gpa` that hold only zeros.
    pub fn zero(&mut self, gpa: u64, pages: u64) -> Result<(), StreamError> {
        self.two_words(Kind::Zero, gpa, pages)
    }

    /// A snapshot's run of `pages` pages at `gpa`, written to its memory
    /// image after the End record ([`crate::image`]).
    pub fn image(&mut self, gpa: u64, pages: u64) -> Result<(), StreamError> {
        self.two_words(Kind::Image, gpa, pages)
    }

    fn bytes(&mut self, gpa: u64, data: &[u8]) -> Result<(), StreamError> {
        for (i, chunk) in data.chunks(MAX_PAGES_BYTES).enumerate() {
            let mut payload = Vec::with_capacity(8 + chunk.len());
            payload.extend_from_slice(&(gpa + (i * MAX_PAGES_BYTES) as u64).to_le_bytes());
            payload.extend_from_slice(chunk);
            self.record(Kind::Pages, &payload)?;
        }
        Ok(())
    }

    /// A snapshot's place in its chain: right after the Config record.
    pub fn chain(&mut self, link: Link) -> Result<(), StreamError> {
        self.two_words(Kind::Chain, link.id, link.parent)
    }

    /// Post-copy's id: before the Missing runs, or first in a resumed
    /// stream ([`StreamReader::resumed`]).
    pub fn postcopy(&mut self, id: u64) -> Result<(), StreamError> {
        self.two_words(Kind::Postcopy, id, 0)
    }

    /// A run of pages the destination must fetch once the guest runs there.
    pub fn missing(&mut self, gpa: u64, pages: u64) -> Result<(), StreamError> {
        self.two_words(Kind::Missing, gpa, pages)
    }

    fn two_words(&mut self, kind: Kind, first: u64, second: u64) -> Result<(), StreamError> {
        let mut payload = [0u8; 16];
        payload[..8].copy_from_slice(&first.to_le_bytes());
        payload[8..].copy_from_slice(&second.to_le_bytes());
        self.record(kind, &payload)
    }

    /// One vCPU's state.
    pub fn vcpu(&mut self, state: &VcpuState) -> Result<(), StreamError> {
        self.record(Kind::Vcpu, &state.encode())
    }

    /// The end of the stream; flushes it.
    pub fn end(&mut self) -> Result<(), StreamError> {
        self.record(Kind::End, &[])?;
        Ok(self.out.flush()?)
    }

    /// The writer underneath.
    pub fn get_mut(&mut self) -> &mut W {
        &mut self.out
    }

    /// The writer underneath, the stream done with.
    pub fn into_inner(self) -> W {
        self.out
    }

    fn record(&mut self, kind: Kind, payload: &[u8]) -> Result<(), StreamError> {
        let mut head = [0u8; 9];
        head[0] = kind as u8;
        head[1..5].copy_from_slice(&self.seq.to_le_bytes());
        head[5..9].copy_from_slice(&(payload.len() as u32).to_le_bytes());
        let mut crc = crc32fast::Hasher::new();
        crc.update(&head);
        crc.update(payload);
        self.out.write_all(&head)?;
        self.out.write_all(payload)?;
        self.out.write_all(&crc.finalize().to_le_bytes())?;
        self.seq += 1;
        Ok(())
    }
}

/// Sends `len` bytes of guest memory at `gpa`, a record at a time.
pub(crate) fn send_pages<W: Write>(
    memory: &VmMemory,
    out: &mut StreamWriter<W>,
    gpa: u64,
    len: u64,
    buf: &mut Vec<u8>,
) -> Result<u64, MigrationError> {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_PAGES_BYTES as u64) as usize;
        buf.resize(n, 0);
        memory.read_slice(buf, GuestAddress(gpa + done))?;
        out.pages(gpa + done, buf)?;
        done += n as u64;
    }
    Ok(len / PAGE_SIZE)
}

/// An id for a snapshot or a post-copy move: 8 random bytes, never 0.
pub(crate) fn random_id() -> io::Result<u64> {
    let mut bytes = [0u8; 8];
    std::fs::File::open("/dev/urandom").and_then(|mut random| random.read_exact(&mut bytes))?;
    Ok(u64::from_le_bytes(bytes).max(1))
}

/// Whether `page` holds only zeros: an OR over words with no early exit,
/// which the compiler vectorizes.
pub(crate) fn is_zero(page: &[u8]) -> bool {
    let words = page.chunks_exact(8);
    let rest = words.remainder();
    words.fold(0, |acc, w| {
        acc | u64::from_ne_bytes(w.try_into().expect("8 bytes"))
    }) == 0
        && rest.iter().all(|&b| b == 0)
}

/// `data`'s stretches of whole pages (the last may be short): whether each
/// holds only zeros, and its byte range; neighbours differ.
pub(crate) fn stretches(data: &[u8]) -> impl Iterator<Item = (bool, Range<usize>)> + '_ {
    let page = PAGE_SIZE as usize;
    let mut start = 0;
    std::iter::from_fn(move || {
        if start == data.len() {
            return None;
        }
        let zero = is_zero(&data[start..(start + page).min(data.len())]);
        let len = data[start..]
            .chunks(page)
            .take_while(|p| is_zero(p) == zero)
            .map(<[u8]>::len)
            .sum::<usize>();
        start += len;
        Some((zero, start - len..start))
    })
}

/// Reads a stream record by record, checking each and the order.
#[derive(Debug)]
pub struct StreamReader<R: Read> {
    input: R,
    seq: u32,
    order: Order,
    /// Bytes read so far, the header's included.
    consumed: u64,
}

/// Where the reader is in the record order.
#[derive(Debug, Default)]
struct Order {
    /// The memory size and vCPU count, from the Config record.
    vm: Option<(u64, u32)>,
    /// Which vCPUs' states have arrived.
    vcpus: Vec<bool>,
    ended: bool,
    /// Whether a Postcopy record came.
    postcopy: bool,
    /// Where the last Image run ended: the next starts there or after.
    image_end: Option<u64>,
}

/// The first bytes of a stream: [`MAGIC`] and [`VERSION`].
pub fn header() -> [u8; 12] {
    let mut header = [0u8; 12];
    header[..8].copy_from_slice(&MAGIC);
    header[8..].copy_from_slice(&VERSION.to_le_bytes());
    header
}

/// Reads a stream's header from `input` and checks it.
pub fn read_header(input: &mut impl Read) -> Result<(), StreamError> {
    let mut header = [0u8; 12];
    read_exact(input, &mut header, "the header")?.ok_or(StreamError::Incomplete)?;
    let magic: [u8; 8] = header[..8].try_into().expect("8 bytes");
    if magic != MAGIC {
        return Err(StreamError::Magic(magic));
    }
    let found = u32::from_le_bytes(header[8..].try_into().expect("4 bytes"));
    if found != VERSION {
        return Err(StreamError::Version { found });
    }
    Ok(())
}

impl<R: Read> StreamReader<R> {
    /// Reads and checks the header.
    pub fn new(mut input: R) -> Result<Self, StreamError> {
        read_header(&mut input)?;
        Ok(Self::after_header(input))
    }

    /// Reads the records of a stream whose header was read already.
    pub fn after_header(input: R) -> Self {
        Self {
            input,
            seq: 0,
            consumed: header().len() as u64,
            order: Order::default(),
        }
    }

    /// Post-copy, past the End record: the source's pushes follow, page
    /// runs (each checked against memory as before) and a last End.
    pub fn pushes(&mut self) {
        self.order.vcpus.clear();
        self.order.ended = false;
    }

    /// A stream that resumes a post-copy move on a new connection (its
    /// header read): a Postcopy record, then pushes as [`Self::pushes`],
    /// for a VM of `mem_size` bytes.
    pub fn resumed(input: R, mem_size: u64) -> Self {
        let mut reader = Self::after_header(input);
        reader.order.vm = Some((mem_size, 0));
        reader
    }

    /// The first record, the VM's description, checked.
    pub fn config(&mut self) -> Result<VmDescription, StreamError> {
        let (kind, seq, payload) = self.read_raw()?;
        let order = |why| StreamError::Order { seq, kind, why };
        if self.order.vm.is_some() {
            return Err(order("a second Config record"));
        }
        if kind != Kind::Config {
            return Err(order("the Config record must come first"));
        }
        let description = VmDescription::decode(&payload).map_err(|why| StreamError::Payload {
            seq,
            kind,
            why,
        })?;
        self.order.vm = Some((description.mem_mib << 20, description.vcpus));
        self.order.vcpus = vec![false; description.vcpus as usize];
        Ok(description)
    }

    /// The next record after the Config record, checked: its length,
    /// checksum, number, payload and place in the order. After
    /// [`Record::End`] there is nothing more to read.
    pub fn next_record(&mut self) -> Result<Record, StreamError> {
        let (kind, seq, payload) = self.read_raw()?;
        let record = decode(kind, seq, &payload)?;
        self.order.check(seq, kind, &record)?;
        Ok(record)
    }

    /// How many records have been read.
    pub fn position(&self) -> u32 {
        self.seq
    }

    /// Bytes read so far, from the stream's first: where a snapshot's
    /// memory image begins, once rounded up to a page ([`crate::image`]).
    pub fn consumed(&self) -> u64 {
        self.consumed
    }

    /// The reader underneath (to answer the source on a connection).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.input
    }

    /// The reader underneath, the stream done with.
    pub fn into_inner(self) -> R {
        self.input
    }

    fn read_raw(&mut self) -> Result<(Kind, u32, Vec<u8>), StreamError> {
        let mut head = [0u8; 9];
        read_exact(&mut self.input, &mut head, "a record's header")?
            .ok_or(StreamError::Incomplete)?;
        let seq = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(head[5..9].try_into().expect("4 bytes"));
        if len as usize > MAX_PAYLOAD {
            return Err(StreamError::Oversized { seq, len });
        }
        let mut payload = vec![0u8; len as usize];
        let mut crc = [0u8; 4];
        read_exact(&mut self.input, &mut payload, "a record")?
            .ok_or(StreamError::Truncated("a record"))?;
        read_exact(&mut self.input, &mut crc, "a record's checksum")?
            .ok_or(StreamError::Truncated("a record's checksum"))?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&head);
        hasher.update(&payload);
        if hasher.finalize() != u32::from_le_bytes(crc) {
            return Err(StreamError::Checksum { seq });
        }
        if seq != self.seq {
            return Err(StreamError::Sequence {
                expected: self.seq,
                found: seq,
            });
        }
        self.seq += 1;
        self.consumed += (head.len() + payload.len() + crc.len()) as u64;
        let kind = Kind::from_u8(head[0]).ok_or(StreamError::UnknownKind { seq, kind: head[0] })?;
        Ok((kind, seq, payload))
    }
}

/// Fills `buf`; `None` if the input ended before its first byte, an error if
/// it ended part-way.
fn read_exact(
    input: &mut impl Read,
    buf: &mut [u8],
    what: &'static str,
) -> Result<Option<()>, StreamError> {
    let mut filled = 0;
    while filled < buf.len() {
        match input.read(&mut buf[filled..]) {
            Ok(0) if filled == 0 => return Ok(None),
            Ok(0) => return Err(StreamError::Truncated(what)),
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(Some(()))
}

fn decode(kind: Kind, seq: u32, payload: &[u8]) -> Result<Record, StreamError> {
    let malformed = |why: String| StreamError::Payload { seq, kind, why };
    Ok(match kind {
        Kind::Config => {
            return Err(StreamError::Order {
                seq,
                kind,
                why: "a Config record after the first record",
            });
        }
        Kind::Pages => {
            let (gpa, data) = payload
                .split_first_chunk::<8>()
                .ok_or_else(|| malformed("shorter than its address".into()))?;
            Record::Pages {
                gpa: u64::from_le_bytes(*gpa),
                data: data.to_vec(),
            }
        }
        Kind::Zero => {
            let (gpa, pages) = two_words(payload).map_err(malformed)?;
            Record::Zero { gpa, pages }
        }
        Kind::Chain => match two_words(payload).map_err(malformed)? {
            (0, _) => return Err(malformed("snapshot id 0".into())),
            (id, parent) => Record::Chain(Link { id, parent }),
        },
        Kind::Postcopy => match two_words(payload).map_err(malformed)? {
            (0, _) => return Err(malformed("post-copy id 0".into())),
            (id, 0) => Record::Postcopy(id),
            (_, extra) => return Err(malformed(format!("{extra:#x} where 0 is due"))),
        },
        Kind::Missing => {
            let (gpa, pages) = two_words(payload).map_err(malformed)?;
            Record::Missing { gpa, pages }
        }
        Kind::Image => {
            let (gpa, pages) = two_words(payload).map_err(malformed)?;
            Record::Image { gpa, pages }
        }
        Kind::Vcpu => Record::Vcpu(Box::new(VcpuState::decode(payload).map_err(malformed)?)),
        Kind::End if payload.is_empty() => Record::End,
        Kind::End => {
            return Err(malformed(format!(
                "{} bytes in an empty record",
                payload.len()
            )));
        }
    })
}

/// A 16-byte payload's two little-endian words.
fn two_words(payload: &[u8]) -> Result<(u64, u64), String> {
    let fields: &[u8; 16] = payload
        .try_into()
        .map_err(|_| format!("{} bytes, not 16", payload.len()))?;
    let (first, second) = fields.split_at(8);
    Ok((
        u64::from_le_bytes(first.try_into().expect("8 bytes")),
        u64::from_le_bytes(second.try_into().expect("8 bytes")),
    ))
}

impl Order {
    fn check(&mut self, seq: u32, kind: Kind, record: &Record) -> Result<(), StreamError> {
        let order = |why| StreamError::Order { seq, kind, why };
        if self.ended {
            return Err(order("a record after the End record"));
        }
        let Some((mem_size, vcpus)) = self.vm else {
            return Err(order("the Config record must come first"));
        };
        match record {
            // The Config record is record 0.
            Record::Chain(_) if seq == 1 => Ok(()),
            Record::Chain(_) => Err(order("a Chain record anywhere but right after the Config")),
            Record::Pages { .. }
            | Record::Zero { .. }
            | Record::Postcopy(_)
            | Record::Missing { .. }
            | Record::Image { .. }
                if self.vcpus.iter().any(|&v| v) =>
            {
                Err(order("guest pages after a vCPU's state"))
            }
            Record::Postcopy(_) if self.postcopy => Err(order("a second Postcopy record")),
            Record::Postcopy(_) if self.image_end.is_some() => {
                Err(order("a Postcopy record in a snapshot with a memory image"))
            }
            Record::Image { .. } if self.postcopy => {
                Err(order("an Image record in a post-copy stream"))
            }
            Record::Image { gpa, .. } if self.image_end.is_some_and(|end| *gpa < end) => {
                Err(order("an Image run below the one before it"))
            }
            Record::Postcopy(_) => {
                self.postcopy = true;
                Ok(())
            }
            Record::Missing { .. } if !self.postcopy => {
                Err(order("a Missing record before the Postcopy record"))
            }
            Record::Pages { gpa, data } => check_pages(*gpa, data.len() as u64, mem_size)
                .map_err(|why| StreamError::Payload { seq, kind, why }),
            Record::Zero { gpa, pages } | Record::Missing { gpa, pages } => {
                check_run(*gpa, *pages, mem_size).map_err(|why| StreamError::Payload {
                    seq,
                    kind,
                    why,
                })
            }
            Record::Image { gpa, pages } => {
                check_run(*gpa, *pages, mem_size).map_err(|why| StreamError::Payload {
                    seq,
                    kind,
                    why,
                })?;
                self.image_end = Some(gpa + pages * PAGE_SIZE);
                Ok(())
            }
            Record::Vcpu(state) => {
                let index = state.index;
                match self.vcpus.get_mut(index as usize) {
                    None => Err(StreamError::Payload {
                        seq,
                        kind,
                        why: format!("vCPU {index} in a VM of {vcpus}"),
                    }),
                    Some(true) => Err(order("a vCPU's state sent twice")),
                    Some(seen) => {
                        *seen = true;
                        Ok(())
                    }
                }
            }
            Record::End if self.vcpus.iter().all(|&v| v) => {
                self.ended = true;
                Ok(())
            }
            Record::End => Err(order("the End record before every vCPU's state")),
        }
    }
}

/// A run of `pages` pages at `gpa`: as [`check_pages`].
fn check_run(gpa: u64, pages: u64, mem_size: u64) -> Result<(), String> {
    pages
        .checked_mul(PAGE_SIZE)
        .ok_or_else(|| format!("{pages} pages at {gpa:#x} are more than any memory"))
        .and_then(|len| check_pages(gpa, len, mem_size))
}

/// A run of pages must be whole, aligned pages inside guest memory.
fn check_pages(gpa: u64, len: u64, mem_size: u64) -> Result<(), String> {
    let aligned = gpa % PAGE_SIZE == 0 && len % PAGE_SIZE == 0 && len > 0;
    let inside = gpa.checked_add(len).is_some_and(|end| end <= mem_size);
    match (aligned, inside) {
        (true, true) => Ok(()),
        (false, _) => Err(format!(
            "{len} bytes at {gpa:#x} are not whole, aligned pages"
        )),
        (true, false) => Err(format!(
            "{len} bytes at {gpa:#x} reach past the guest's {mem_size:#x} bytes of memory"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::{description, user_vcpu};

    /// A valid stream: 2 vCPUs, two page runs.
    fn stream() -> Vec<u8> {
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description(2)).unwrap();
        out.pages(0x1000, &[0xab; 8192]).unwrap();
        out.pages(0x20_0000, &[0xcd; 4096]).unwrap();
        out.vcpu(&user_vcpu(1)).unwrap();
        out.vcpu(&user_vcpu(0)).unwrap();
        out.end().unwrap();
        out.out
    }

    fn read_all(bytes: &[u8]) -> Result<(VmDescription, Vec<Record>), StreamError> {
        let mut input = StreamReader::new(bytes)?;
        let config = input.config()?;
        let mut records = Vec::new();
        loop {
            match input.next_record()? {
                Record::End => return Ok((config, records)),
                r => records.push(r),
            }
        }
    }

    /// Writes records of the given kinds, each a valid payload, in that order.
    fn with_kinds(kinds: &[Kind]) -> Vec<u8> {
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        for (i, kind) in kinds.iter().enumerate() {
            match kind {
                Kind::Config => out.config(&description(1)).unwrap(),
                Kind::Pages => {
                    out.pages(0, &[1; 4096]).unwrap();
                }
                Kind::Zero => {
                    out.pages(0, &[0; 4096]).unwrap();
                }
                Kind::Vcpu => out.vcpu(&user_vcpu(0)).unwrap(),
                Kind::End => out.end().unwrap(),
                Kind::Chain => out.chain(Link { id: 7, parent: 0 }).unwrap(),
                Kind::Postcopy => out.postcopy(5).unwrap(),
                Kind::Missing => out.missing(0, 1).unwrap(),
                Kind::Image => out.image(0, 1).unwrap(),
            }
            assert_eq!(out.seq, i as u32 + 1);
        }
        out.out
    }

    #[test]
    fn a_stream_reads_back_as_written() {
        let (config, records) = read_all(&stream()).unwrap();
        assert_eq!(config, description(2));
        assert_eq!(records.len(), 4);
        assert!(
            matches!(&records[0], Record::Pages { gpa: 0x1000, data } if data == &[0xab; 8192])
        );
        assert!(
            matches!(&records[1], Record::Pages { gpa: 0x20_0000, data } if data.len() == 4096)
        );
        let Record::Vcpu(v) = &records[2] else {
            panic!("{records:?}")
        };
        assert_eq!(v.encode(), user_vcpu(1).encode());
        // A record read before the Config record breaks the order too.
        let bytes = stream();
        let mut input = StreamReader::new(&bytes[..]).unwrap();
        let e = input.next_record().unwrap_err();
        assert_eq!(
            e.to_string(),
            "record 0 (Config) is out of order: a Config record after the first record"
        );
        assert_eq!(input.position(), 1);
    }

    #[test]
    fn large_page_runs_are_split_into_records_the_reader_accepts() {
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description(1)).unwrap();
        let run = vec![7u8; MAX_PAGES_BYTES * 2 + 4096];
        assert_eq!(out.pages(0, &run).unwrap(), run.len() as u64 / PAGE_SIZE);
        assert_eq!(out.seq, 4);
        let mut input = StreamReader::new(&out.out[..]).unwrap();
        input.config().unwrap();
        let mut next = 0;
        for _ in 0..3 {
            let Record::Pages { gpa, data } = input.next_record().unwrap() else {
                panic!("pages")
            };
            assert_eq!(gpa, next);
            next += data.len() as u64;
        }
        assert_eq!(next, run.len() as u64);
    }

    #[test]
    fn every_cut_is_an_error_that_says_so() {
        let bytes = stream();
        for len in 0..bytes.len() {
            match read_all(&bytes[..len]) {
                Err(StreamError::Truncated(_) | StreamError::Incomplete) => {}
                other => panic!("cut at {len}: {other:?}"),
            }
        }
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        let bytes = stream();
        for at in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[at] ^= 0x5a;
            assert!(read_all(&bad).is_err(), "byte {at} flipped was accepted");
        }
    }

    #[test]
    fn a_corrupted_payload_is_named_by_record() {
        let mut bytes = stream();
        // Inside the first Pages record's data (header 12, Config record before it).
        let at = bytes.len() / 3;
        bytes[at] ^= 1;
        let e = read_all(&bytes).unwrap_err();
        assert!(matches!(e, StreamError::Checksum { seq: 1 }), "{e}");
        assert_eq!(
            e.to_string(),
            "record 1 is corrupted (its CRC32 does not match)"
        );
    }

    #[test]
    fn oversized_records_are_refused_before_allocating() {
        let mut bytes = with_kinds(&[Kind::Config]);
        let mut head = vec![Kind::Pages as u8];
        head.extend_from_slice(&1u32.to_le_bytes());
        head.extend_from_slice(&u32::MAX.to_le_bytes());
        bytes.extend_from_slice(&head);
        let e = read_all(&bytes).unwrap_err();
        assert!(
            matches!(
                e,
                StreamError::Oversized {
                    seq: 1,
                    len: u32::MAX
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn bad_magic_and_versions_are_named() {
        let mut bytes = stream();
        bytes[0] = b'X';
        assert!(matches!(read_all(&bytes), Err(StreamError::Magic(_))));
        let mut bytes = stream();
        bytes[8] = 1;
        let e = read_all(&bytes).unwrap_err();
        assert_eq!(
            e.to_string(),
            "stream format version 1, but this reference-vmm reads version 4"
        );
    }

    #[test]
    fn records_out_of_order_are_refused_with_the_rule() {
        use Kind::*;
        let cases: &[(&[Kind], &str)] = &[
            (&[Pages], "the Config record must come first"),
            (&[Config, Config], "a Config record after the first record"),
            (&[Config, Vcpu, Pages], "guest pages after a vCPU's state"),
            (&[Config, Vcpu, Zero], "guest pages after a vCPU's state"),
            (&[Config, Vcpu, Vcpu], "a vCPU's state sent twice"),
            (&[Config, End], "the End record before every vCPU's state"),
            (
                &[Config, Pages, Chain],
                "a Chain record anywhere but right after the Config",
            ),
            (&[Config, Vcpu, Image], "guest pages after a vCPU's state"),
            (
                &[Config, Image, Image],
                "an Image run below the one before it",
            ),
            (
                &[Config, Postcopy, Image],
                "an Image record in a post-copy stream",
            ),
            (
                &[Config, Image, Postcopy],
                "a Postcopy record in a snapshot with a memory image",
            ),
        ];
        for (kinds, why) in cases {
            match read_all(&with_kinds(kinds)) {
                Err(StreamError::Order { why: w, .. }) => assert_eq!(w, *why, "{kinds:?}"),
                other => panic!("{kinds:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_snapshots_chain_record_reads_back_and_id_0_is_refused() {
        use Kind::*;
        let (_, records) = read_all(&with_kinds(&[Config, Chain, Pages, Vcpu, End])).unwrap();
        assert!(
            matches!(records[0], Record::Chain(l) if l == Link { id: 7, parent: 0 } && l.is_full())
        );
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description(1)).unwrap();
        out.chain(Link { id: 0, parent: 3 }).unwrap();
        let e = read_all(&out.out).unwrap_err().to_string();
        assert!(e.contains("snapshot id 0"), "{e}");
    }

    #[test]
    fn a_lost_or_repeated_record_breaks_the_sequence() {
        let bytes = with_kinds(&[Kind::Config, Kind::Pages, Kind::Pages]);
        let config_end = 12 + 9 + description(1).encode().len() + 4;
        let page_len = 9 + 8 + 4096 + 4;
        // Drop the first Pages record: record 2 comes where 1 was due.
        let mut lost = bytes[..config_end].to_vec();
        lost.extend_from_slice(&bytes[config_end + page_len..]);
        assert!(matches!(
            read_all(&lost),
            Err(StreamError::Sequence {
                expected: 1,
                found: 2
            })
        ));
    }

    #[test]
    fn pages_outside_memory_or_unaligned_are_refused() {
        let mem = description(1).mem_mib << 20;
        for (gpa, len) in [(mem, 4096), (mem - 4096, 8192), (100, 4096), (0, 100)] {
            let mut out = StreamWriter::new(Vec::new()).unwrap();
            out.config(&description(1)).unwrap();
            let mut payload = gpa.to_le_bytes().to_vec();
            payload.extend(std::iter::repeat_n(0, len));
            out.record(Kind::Pages, &payload).unwrap();
            match read_all(&out.out) {
                Err(StreamError::Payload {
                    kind: Kind::Pages, ..
                }) => {}
                other => panic!("{len} bytes at {gpa:#x}: {other:?}"),
            }
        }
    }

    #[test]
    fn zero_pages_travel_as_runs_and_read_back_in_place() {
        let page = PAGE_SIZE as usize;
        // zero, zero, data, zero, data with a single byte set at its end.
        let mut run = vec![0u8; 5 * page];
        run[2 * page..3 * page].fill(9);
        run[5 * page - 1] = 1;
        let write = |run: &[u8]| {
            let mut out = StreamWriter::new(Vec::new()).unwrap();
            out.config(&description(1)).unwrap();
            assert_eq!(out.pages(0x4000, run).unwrap(), run.len() as u64 / 4096);
            out.vcpu(&user_vcpu(0)).unwrap();
            out.end().unwrap();
            out.out
        };
        // Two of the five pages' bytes travel, not five.
        let (bytes, without) = (write(&run), write(&[]));
        assert!(
            bytes.len() - without.len() < 2 * page + 200,
            "{} bytes",
            bytes.len()
        );
        let (_, records) = read_all(&bytes).unwrap();
        let mut rebuilt = vec![0xffu8; 5 * page];
        for record in &records {
            let at = |gpa: u64| (gpa - 0x4000) as usize;
            match record {
                Record::Zero { gpa, pages } => {
                    rebuilt[at(*gpa)..][..*pages as usize * page].fill(0);
                }
                Record::Pages { gpa, data } => {
                    rebuilt[at(*gpa)..][..data.len()].copy_from_slice(data)
                }
                _ => {}
            }
        }
        assert_eq!(rebuilt, run);
        let kinds: Vec<_> = records
            .iter()
            .map(|r| match r {
                Record::Zero { pages, .. } => format!("zero {pages}"),
                Record::Pages { data, .. } => format!("pages {}", data.len() / page),
                _ => "vcpu".into(),
            })
            .collect();
        assert_eq!(kinds, ["zero 2", "pages 1", "zero 1", "pages 1", "vcpu"]);
    }

    #[test]
    fn zero_runs_outside_memory_or_malformed_are_refused() {
        let mem = description(1).mem_mib << 20;
        let cases: [(u64, u64); 5] = [(mem, 1), (mem - 4096, 2), (100, 1), (0, 0), (0, u64::MAX)];
        for (gpa, pages) in cases {
            let mut out = StreamWriter::new(Vec::new()).unwrap();
            out.config(&description(1)).unwrap();
            out.zero(gpa, pages).unwrap();
            match read_all(&out.out) {
                Err(StreamError::Payload {
                    kind: Kind::Zero, ..
                }) => {}
                other => panic!("{pages} pages at {gpa:#x}: {other:?}"),
            }
        }
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description(1)).unwrap();
        out.record(Kind::Zero, &[0; 15]).unwrap();
        let e = read_all(&out.out).unwrap_err();
        assert_eq!(
            e.to_string(),
            "record 1 (Zero) is malformed: 15 bytes, not 16"
        );
    }

    #[test]
    fn a_vcpu_index_past_the_vm_is_refused() {
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description(1)).unwrap();
        out.vcpu(&user_vcpu(3)).unwrap();
        let e = read_all(&out.out).unwrap_err();
        assert_eq!(
            e.to_string(),
            "record 1 (Vcpu) is malformed: vCPU 3 in a VM of 1"
        );
    }

    /// A post-copy stream: Postcopy once, before any vCPU's state, Missing
    /// only after it; past the End, pushes of pages and a last End; a
    /// resumed stream reads pushes against the memory it is given.
    #[test]
    fn postcopy_records_keep_their_order_and_pushes_follow_the_end() {
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description(1)).unwrap();
        out.postcopy(9).unwrap();
        out.missing(0x2000, 3).unwrap();
        out.vcpu(&user_vcpu(0)).unwrap();
        out.end().unwrap();
        out.pages(0x2000, &[5; 8192]).unwrap();
        out.end().unwrap();
        let mut input = StreamReader::new(&out.out[..]).unwrap();
        input.config().unwrap();
        assert!(matches!(input.next_record(), Ok(Record::Postcopy(9))));
        assert!(matches!(
            input.next_record(),
            Ok(Record::Missing {
                gpa: 0x2000,
                pages: 3
            })
        ));
        assert!(matches!(input.next_record(), Ok(Record::Vcpu(_))));
        assert!(matches!(input.next_record(), Ok(Record::End)));
        assert!(input.next_record().is_err(), "nothing after the End");
        let mut input = StreamReader::new(&out.out[..]).unwrap();
        input.config().unwrap();
        while !matches!(input.next_record(), Ok(Record::End)) {}
        input.pushes();
        assert!(matches!(
            input.next_record(),
            Ok(Record::Pages { gpa: 0x2000, .. })
        ));
        assert!(matches!(input.next_record(), Ok(Record::End)));

        for (kinds, why) in [
            (
                &[Kind::Config, Kind::Missing][..],
                "a Missing record before the Postcopy record",
            ),
            (
                &[Kind::Config, Kind::Postcopy, Kind::Postcopy],
                "a second Postcopy record",
            ),
            (
                &[Kind::Config, Kind::Postcopy, Kind::Vcpu, Kind::Missing],
                "guest pages after a vCPU's state",
            ),
        ] {
            let e = read_all(&with_kinds(kinds)).unwrap_err().to_string();
            assert!(e.ends_with(why), "{kinds:?}: {e}");
        }

        let mut resumed = StreamWriter::after_header(Vec::new());
        resumed.postcopy(9).unwrap();
        resumed.pages(16 * PAGE_SIZE, &[1; 4096]).unwrap();
        let mut input = StreamReader::resumed(&resumed.out[..], 16 * PAGE_SIZE);
        assert!(matches!(input.next_record(), Ok(Record::Postcopy(9))));
        assert!(matches!(
            input.next_record(),
            Err(StreamError::Payload {
                kind: Kind::Pages,
                ..
            })
        ));
    }
}
