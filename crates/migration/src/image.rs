//! A snapshot's memory image: past the stream's End record, from the next
//! page boundary, each page the snapshot holds sits at its guest address,
//! and every other page is a hole. The file is sparse, as Firecracker's
//! diff snapshots are: it takes disk space for the pages it holds alone,
//! and a tool can read it as a memory image. The stream names the runs the
//! image holds (`Image` records) and the zero pages (`Zero`, which stay
//! holes), so a restore reads exactly those, whether or not the file
//! system keeps holes.

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::FileExt;

use reference_vmm::VmMemory;
use test_guests::layout::PAGE_SIZE;
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use crate::MigrationError;
use crate::stream::{MAX_PAGES_BYTES, StreamError, StreamReader, StreamWriter, stretches};

/// A run of guest memory: its guest address and length in bytes.
pub type Run = (u64, u64);

/// Where the memory image starts in a snapshot whose stream is
/// `stream_len` bytes long: the next page boundary.
pub fn image_start(stream_len: u64) -> u64 {
    stream_len.next_multiple_of(PAGE_SIZE)
}

/// Every run of `memory`: a full snapshot's.
pub(crate) fn all_of(memory: &VmMemory) -> Vec<Run> {
    memory.iter().map(|r| (r.start_addr().0, r.len())).collect()
}

/// Names `runs` in the stream: their zero pages as `Zero` records, the
/// others as `Image` runs, which it returns for [`write_image`].
pub(crate) fn name_runs<W: io::Write>(
    memory: &VmMemory,
    out: &mut StreamWriter<W>,
    runs: &[Run],
) -> Result<Vec<Run>, MigrationError> {
    let mut image = Vec::new();
    let mut buf = vec![0u8; MAX_PAGES_BYTES];
    for chunk in chunks(runs) {
        let data = &mut buf[..chunk.1 as usize];
        memory.read_slice(data, GuestAddress(chunk.0))?;
        for (zero, range) in stretches(data) {
            let (gpa, len) = (chunk.0 + range.start as u64, range.len() as u64);
            match zero {
                true => out.zero(gpa, len / PAGE_SIZE)?,
                false => {
                    out.image(gpa, len / PAGE_SIZE)?;
                    image.push((gpa, len));
                }
            }
        }
    }
    Ok(image)
}

/// Writes `image`'s pages from `memory` into `file` at `start` plus their
/// guest address, and sizes the file to the whole image: holes elsewhere.
pub(crate) fn write_image(
    memory: &VmMemory,
    file: &File,
    start: u64,
    image: &[Run],
) -> Result<(), MigrationError> {
    let mut buf = vec![0u8; MAX_PAGES_BYTES];
    for (gpa, len) in chunks(image) {
        let data = &mut buf[..len as usize];
        memory.read_slice(data, GuestAddress(gpa))?;
        file.write_all_at(data, start + gpa)
            .map_err(StreamError::Io)?;
    }
    let size = memory.last_addr().0 + 1;
    file.set_len(start + size).map_err(StreamError::Io)?;
    Ok(())
}

/// Reads the memory image after `input`'s End record: each of `image`'s
/// runs (ascending, as the stream's order requires) handed to `write`
/// with its guest address, in pieces of at most [`MAX_PAGES_BYTES`]; the
/// holes between them skipped.
///
/// # Errors
/// The image ends before a run does ([`StreamError::Truncated`]), the
/// input fails, or `write` does.
pub fn read_image<R: Read, E: From<StreamError>>(
    input: &mut StreamReader<R>,
    image: &[Run],
    mut write: impl FnMut(u64, &[u8]) -> Result<(), E>,
) -> Result<(), E> {
    let start = image_start(input.consumed());
    let mut at = input.consumed();
    let mut buf = vec![0u8; MAX_PAGES_BYTES];
    for (gpa, len) in chunks(image) {
        let reader = input.get_mut();
        let out_of_order = || {
            StreamError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "memory image runs out of order or past any file",
            ))
        };
        let offset = start.checked_add(gpa).ok_or_else(out_of_order)?;
        let hole = offset.checked_sub(at).ok_or_else(out_of_order)?;
        if io::copy(&mut reader.take(hole), &mut io::sink()).map_err(StreamError::Io)? < hole {
            return Err(StreamError::Truncated("the memory image").into());
        }
        let data = &mut buf[..len as usize];
        reader.read_exact(data).map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => StreamError::Truncated("the memory image"),
            _ => StreamError::Io(e),
        })?;
        at = offset + len;
        write(gpa, data)?;
    }
    Ok(())
}

/// `runs` cut into pieces of at most [`MAX_PAGES_BYTES`].
fn chunks(runs: &[Run]) -> impl Iterator<Item = Run> + '_ {
    let most = MAX_PAGES_BYTES as u64;
    runs.iter().flat_map(move |&(gpa, len)| {
        (0..len.div_ceil(most))
            .map(move |i| (gpa.saturating_add(i * most), most.min(len - i * most)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::{description, user_vcpu};
    use crate::stream::Record;

    /// A snapshot in memory: a stream naming `image`, then its image, each
    /// page filled with its page number's low byte plus one.
    fn snapshot(image: &[Run]) -> Vec<u8> {
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description(1)).unwrap();
        for &(gpa, len) in image {
            out.image(gpa, len / PAGE_SIZE).unwrap();
        }
        out.vcpu(&user_vcpu(0)).unwrap();
        out.end().unwrap();
        let mut bytes = out.into_inner();
        let start = image_start(bytes.len() as u64);
        for &(gpa, len) in image {
            let at = (start + gpa) as usize;
            bytes.resize(at + len as usize, 0);
            for page in 0..len / PAGE_SIZE {
                let first = at + (page * PAGE_SIZE) as usize;
                let fill = ((gpa / PAGE_SIZE + page) as u8).wrapping_add(1);
                bytes[first..first + PAGE_SIZE as usize].fill(fill);
            }
        }
        bytes
    }

    /// The stream's Image runs, and the reader past its End.
    fn runs_of(bytes: &[u8]) -> (StreamReader<&[u8]>, Vec<Run>) {
        let mut input = StreamReader::new(bytes).unwrap();
        input.config().unwrap();
        let mut runs = Vec::new();
        loop {
            match input.next_record().unwrap() {
                Record::Image { gpa, pages } => runs.push((gpa, pages * PAGE_SIZE)),
                Record::End => return (input, runs),
                _ => {}
            }
        }
    }

    #[test]
    fn the_image_reads_back_each_run_at_its_address_and_skips_the_holes() {
        let image = [
            (0, PAGE_SIZE),
            (0x5000, 3 * PAGE_SIZE),
            (0x20_0000, 300 * PAGE_SIZE),
        ];
        let bytes = snapshot(&image);
        let (mut input, runs) = runs_of(&bytes);
        assert_eq!(runs, image);
        let mut pages = Vec::new();
        read_image(&mut input, &runs, |gpa, data| {
            for (i, page) in data.chunks(PAGE_SIZE as usize).enumerate() {
                let number = gpa / PAGE_SIZE + i as u64;
                assert!(page.iter().all(|&b| b == (number as u8).wrapping_add(1)));
                pages.push(number);
            }
            Ok::<_, StreamError>(())
        })
        .unwrap();
        let want: Vec<u64> = image
            .iter()
            .flat_map(|&(gpa, len)| gpa / PAGE_SIZE..(gpa + len) / PAGE_SIZE)
            .collect();
        assert_eq!(pages, want);
    }

    #[test]
    fn a_cut_image_or_runs_out_of_order_are_errors() {
        let image = [(0x1000, 2 * PAGE_SIZE)];
        let bytes = snapshot(&image);
        let (mut input, runs) = runs_of(&bytes[..bytes.len() - 1]);
        let cut = read_image(&mut input, &runs, |_, _| Ok::<_, StreamError>(()));
        assert!(
            matches!(cut, Err(StreamError::Truncated("the memory image"))),
            "{cut:?}"
        );
        let (mut input, _) = runs_of(&bytes);
        let backwards = [(0x2000, PAGE_SIZE), (0x1000, PAGE_SIZE)];
        let e = read_image(&mut input, &backwards, |_, _| Ok::<_, StreamError>(())).unwrap_err();
        assert!(e.to_string().contains("out of order"), "{e}");
        let (mut input, _) = runs_of(&bytes);
        let past = [(u64::MAX - PAGE_SIZE + 1, PAGE_SIZE)];
        let e = read_image(&mut input, &past, |_, _| Ok::<_, StreamError>(())).unwrap_err();
        assert!(e.to_string().contains("past any file"), "{e}");
    }

    #[test]
    fn runs_are_cut_into_pieces_a_record_holds() {
        let most = MAX_PAGES_BYTES as u64;
        let pieces: Vec<Run> = chunks(&[(0, 2 * most + PAGE_SIZE), (1 << 30, PAGE_SIZE)]).collect();
        assert_eq!(
            pieces,
            [
                (0, most),
                (most, most),
                (2 * most, PAGE_SIZE),
                (1 << 30, PAGE_SIZE)
            ]
        );
        assert_eq!(image_start(0), 0);
        assert_eq!(image_start(1), PAGE_SIZE);
        assert_eq!(image_start(PAGE_SIZE), PAGE_SIZE);
    }
}
