//! Post-copy: the guest runs at the destination before all its memory is
//! there. The pages it lacks are registered with `userfaultfd(2)`
//! (`uffd.rs`); a vCPU (or a VMM thread) that touches one waits while
//! the destination asks the source for it ahead of everything else, and
//! the source pushes the rest meanwhile (`serve.rs`); the destination fills
//! each page as it comes, which wakes its waiters (`fetch.rs`,
//! [`Incoming::fetch`](crate::Incoming::fetch)).
//!
//! ```text
//! source                                         destination
//! (pre-copy rounds: hybrid only)
//! pause; Postcopy(id), Missing runs,  ─────────▶ the missing pages unmapped
//!   every Vcpu, End                              and registered
//!                                     ◀───────── READY
//! COMMIT                              ─────────▶ the guest runs
//!                                     ◀───────── RUNNING
//! pushes: page runs, asked pages first ────────▶ each page filled once
//!                                     ◀───────── ASK(gpa) per remote fault
//! End                                 ─────────▶
//!                                     ◀───────── HAVE_ALL: the source may go
//! ```
//!
//! **A cut link is survived** where both sides were told to
//! ([`MigrateOptions::resume`](crate::MigrateOptions::resume) at the
//! source, a [`Resume`] at the destination): the source keeps every page
//! until the destination has them all and connects again; the
//! destination's faulting vCPUs wait; on the new connection the source
//! sends the move's id, the destination the pages it still lacks, and the
//! pushes go on. **Only a lost source loses the guest** (or a link down
//! past the limits): from the commit on, the guest's memory is split
//! between the two, and neither can run it alone. The source then reports
//! the guest lost and never resumes it; the destination stops its VM.

pub(crate) mod fetch;
pub(crate) mod pages;
pub(crate) mod serve;

use std::io::{self, Read, Write};
use std::time::Duration;

pub use fetch::{FetchReport, Fetching, PostcopyPages, Resume};

use test_guests::layout::PAGE_SIZE;

use pages::PageSet;

/// Whether and when a migration switches to post-copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Postcopy {
    /// Pre-copy only.
    #[default]
    Off,
    /// Pre-copy rounds (QEMU's "postcopy after precopy") until one fits
    /// the downtime, or sends no fewer pages than the one before, or the
    /// round or time limit; then the guest moves with the pages dirtied
    /// since still at the source. No dirty limit.
    Hybrid,
    /// At once: the guest moves with no page; every page follows.
    Immediate,
}

reference_vmm::choice_names!(Postcopy, "--postcopy", [
    Off => "off", Hybrid => "hybrid", Immediate => "immediate",
]);

/// Whether this host lets this process use `userfaultfd(2)`, which a
/// post-copy destination needs; the error says why not.
pub fn userfaultfd_available() -> io::Result<()> {
    crate::uffd::Userfaultfd::new().map(drop)
}

/// Pages of data pushed at a time after the hand-over (32 KiB, a quarter
/// of a millisecond at 1 Gbit/s): an asked page waits behind at most this.
pub(crate) const PUSH_PAGES: u64 = 8;
/// Pages a push looks at (256 KiB): the zero pages among them go as one
/// record a stretch, which the destination fills with one call.
pub(crate) const PUSH_WINDOW: u64 = 64;
/// Bytes the source lets sit unsent in its socket before it pushes more,
/// so that an asked page is not queued behind a full socket buffer; more
/// than a 1 Gbit/s link holds in flight over a LAN.
pub(crate) const QUEUE_BYTES: usize = 32 << 10;

/// The destination asks for one page: its guest address follows.
const ASK: u8 = b'?';
/// The destination has every page: the source may end.
const HAVE_ALL: u8 = b'!';
/// On a new connection, the pages the destination still lacks: a run
/// count, then each run's first guest address and page count.
const NEEDED: u8 = b'N';

/// What a destination says to its source after the hand-over.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Note {
    /// Send this page (its guest address) first.
    Ask(u64),
    /// Every page is there.
    HaveAll,
    /// The pages still lacked, on a new connection.
    Needed(PageSet),
}

impl Note {
    pub(crate) fn write(&self, out: &mut impl Write) -> io::Result<()> {
        match self {
            Self::Ask(gpa) => {
                out.write_all(&[ASK])?;
                out.write_all(&gpa.to_le_bytes())?;
            }
            Self::HaveAll => out.write_all(&[HAVE_ALL])?,
            Self::Needed(set) => {
                let runs = set.runs();
                out.write_all(&[NEEDED])?;
                out.write_all(&(runs.len() as u64).to_le_bytes())?;
                for (page, n) in runs {
                    out.write_all(&(page * PAGE_SIZE).to_le_bytes())?;
                    out.write_all(&n.to_le_bytes())?;
                }
            }
        }
        out.flush()
    }

    /// Reads one, for a guest of `pages` pages: anything else (an address
    /// outside memory, an unknown tag, more runs than pages) is refused,
    /// saying what.
    pub(crate) fn read(input: &mut impl Read, pages: u64) -> io::Result<Self> {
        let refused = |why: String| io::Error::new(io::ErrorKind::InvalidData, why);
        let page = |gpa: u64| match gpa % PAGE_SIZE == 0 && gpa / PAGE_SIZE < pages {
            true => Ok(gpa / PAGE_SIZE),
            false => Err(refused(format!(
                "the destination named {gpa:#x}, not a page of the guest's"
            ))),
        };
        match read_word::<1>(input)?[0] {
            ASK => Ok(Self::Ask(
                page(u64::from_le_bytes(read_word(input)?))? * PAGE_SIZE,
            )),
            HAVE_ALL => Ok(Self::HaveAll),
            NEEDED => {
                let runs = u64::from_le_bytes(read_word(input)?);
                if runs > pages {
                    return Err(refused(format!(
                        "{runs} runs of pages in a guest of {pages}"
                    )));
                }
                let mut set = PageSet::new(pages);
                for _ in 0..runs {
                    let first = page(u64::from_le_bytes(read_word(input)?))?;
                    let n = u64::from_le_bytes(read_word(input)?);
                    if n == 0 || n > pages - first {
                        return Err(refused(format!("{n} pages from page {first} of {pages}")));
                    }
                    set.insert_run(first, n);
                }
                Ok(Self::Needed(set))
            }
            tag => Err(refused(format!(
                "the destination sent {tag:#04x}, which no reference-vmm sends"
            ))),
        }
    }
}

fn read_word<const N: usize>(input: &mut impl Read) -> io::Result<[u8; N]> {
    let mut word = [0u8; N];
    input.read_exact(&mut word)?;
    Ok(word)
}

/// The p50, p99 and largest of `samples` (zeros where there are none).
pub(crate) fn percentiles(samples: &mut [Duration]) -> [Duration; 3] {
    samples.sort_unstable();
    let at = |q: usize| match samples.len() {
        0 => Duration::ZERO,
        n => samples[((n - 1) * q).div_ceil(100)],
    };
    [at(50), at(99), at(100)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_read_back_and_hostile_ones_are_refused_by_what_they_name() {
        let mut set = PageSet::new(64);
        set.insert_run(3, 2);
        set.insert_run(40, 24);
        for note in [Note::Ask(5 * PAGE_SIZE), Note::HaveAll, Note::Needed(set)] {
            let mut wire = Vec::new();
            note.write(&mut wire).unwrap();
            assert_eq!(Note::read(&mut &wire[..], 64).unwrap(), note);
        }
        let refused = |wire: &[u8]| Note::read(&mut &wire[..], 64).unwrap_err().to_string();
        let mut ask = vec![ASK];
        ask.extend_from_slice(&(64 * PAGE_SIZE).to_le_bytes());
        assert!(
            refused(&ask).contains("not a page of the guest's"),
            "{}",
            refused(&ask)
        );
        ask[1] = 1;
        assert!(refused(&ask).contains("not a page"));
        let mut needed = vec![NEEDED];
        needed.extend_from_slice(&65u64.to_le_bytes());
        assert!(refused(&needed).contains("65 runs of pages in a guest of 64"));
        let mut needed = vec![NEEDED];
        needed.extend_from_slice(&1u64.to_le_bytes());
        needed.extend_from_slice(&(60 * PAGE_SIZE).to_le_bytes());
        needed.extend_from_slice(&5u64.to_le_bytes());
        assert!(refused(&needed).contains("5 pages from page 60 of 64"));
        assert!(refused(b"x").contains("0x78"));
        assert_eq!(
            Note::read(&mut &[ASK, 0][..], 64).unwrap_err().kind(),
            io::ErrorKind::UnexpectedEof
        );
    }

    #[test]
    fn percentiles_take_the_nearest_rank_above() {
        let mut samples: Vec<Duration> = (1..=200).rev().map(Duration::from_micros).collect();
        let [p50, p99, max] = percentiles(&mut samples);
        assert_eq!(
            (p50, p99, max),
            (
                Duration::from_micros(101),
                Duration::from_micros(199),
                Duration::from_micros(200)
            )
        );
        assert_eq!(percentiles(&mut []), [Duration::ZERO; 3]);
    }
}
