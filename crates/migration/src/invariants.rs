//! Drives the migration stream's reader, where a peer's input lands, with
//! arbitrary input, and panics if an invariant breaks. The fuzz target
//! (`fuzz/`) feeds it random bytes; `cargo test` replays the committed
//! corpus (`fuzz-corpus/migration_stream/`).

use test_guests::layout::PAGE_SIZE;

use crate::stream::{MAGIC, Record, StreamReader, VERSION};

/// Migration stream: arbitrary bytes after a valid header. Checks: the
/// reader ends in an error or at the End record, without a panic; every page
/// run it hands out (bytes or zeros) is whole pages inside the memory the
/// Config record described, a snapshot image's runs in ascending order;
/// every vCPU state has an index below the described count and
/// comes once; the End record comes only after every vCPU's, and nothing
/// is read after it.
pub fn migration_stream(data: &[u8]) {
    let mut bytes = MAGIC.to_vec();
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(data);
    let mut input = StreamReader::new(&bytes[..]).expect("a valid header");
    let Ok(described) = input.config() else {
        return;
    };
    let mem = described.mem_mib << 20;
    let mut seen = vec![false; described.vcpus as usize];
    let mut image_end = 0;
    while let Ok(record) = input.next_record() {
        match record {
            Record::Pages { gpa, data } => {
                let len = data.len() as u64;
                assert!(gpa % PAGE_SIZE == 0 && len % PAGE_SIZE == 0 && len > 0);
                assert!(gpa + len <= mem, "{len} bytes at {gpa:#x} past {mem:#x}");
            }
            Record::Zero { gpa, pages } | Record::Missing { gpa, pages } => {
                assert!(gpa % PAGE_SIZE == 0 && pages > 0);
                assert!(gpa + pages * PAGE_SIZE <= mem, "{pages} pages at {gpa:#x}");
            }
            Record::Image { gpa, pages } => {
                assert!(gpa % PAGE_SIZE == 0 && pages > 0 && gpa >= image_end);
                image_end = gpa + pages * PAGE_SIZE;
                assert!(image_end <= mem, "{pages} image pages at {gpa:#x}");
            }
            Record::Vcpu(state) => {
                let slot = &mut seen[state.index as usize];
                assert!(!std::mem::replace(slot, true), "vCPU {} twice", state.index);
            }
            Record::Chain(link) => assert!(link.id != 0, "snapshot id 0"),
            Record::Postcopy(id) => assert!(id != 0, "post-copy id 0"),
            Record::End => {
                assert!(seen.iter().all(|&s| s));
                assert!(input.next_record().is_err());
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::state::tests::{description, user_vcpu};
    use crate::stream::{Link, StreamWriter};

    /// A whole snapshot's records, a Chain among them, keep every invariant.
    #[test]
    fn a_whole_stream_keeps_every_invariant() {
        let mut out = StreamWriter::after_header(Vec::new());
        out.config(&description(2)).unwrap();
        out.chain(Link { id: 9, parent: 4 }).unwrap();
        out.pages(0x1000, &[[7u8; 4096], [0; 4096]].concat())
            .unwrap();
        out.image(0x4000, 2).unwrap();
        out.image(0x6000, 1).unwrap();
        out.vcpu(&user_vcpu(1)).unwrap();
        out.vcpu(&user_vcpu(0)).unwrap();
        out.end().unwrap();
        super::migration_stream(&out.into_inner());
    }

    #[test]
    fn replays_the_migration_stream_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-corpus/migration_stream");
        let inputs = std::fs::read_dir(dir).expect("the corpus is committed");
        let replayed = inputs
            .map(|input| super::migration_stream(&std::fs::read(input.unwrap().path()).unwrap()))
            .count();
        assert!(replayed >= 8, "{dir} has only {replayed} inputs");
    }
}
