//! Drives bitmap decoding and dirty-ring harvesting with arbitrary input (a
//! buggy or hostile kernel's words and ring entries) and panics if an
//! invariant breaks: nothing panics, every entry that names a tracked page is
//! harvested, anything else is an error that loses no page. The fuzz target
//! (`fuzz/`) feeds it random bytes; `cargo test` replays the corpus.

use std::ptr::NonNull;

use crate::bitmap::DirtyBitmap;
use crate::ioctls::{DIRTY_GFN_F_DIRTY, DIRTY_GFN_F_RESET, DirtyGfn};
use crate::log::DirtySet;
use crate::ring::{EntryError, collect_entries, decode, place};
use crate::slots::Slot;

fn u64_at(data: &[u8], i: usize) -> u64 {
    (0..8).fold(0, |v, k| {
        v | u64::from(data.get(i + k).copied().unwrap_or(0)) << (8 * k)
    })
}

/// Runs every check on `data`.
pub fn run(data: &[u8]) {
    let slots: Vec<Slot> = (0..3)
        .map(|i| Slot {
            id: u32::from(data.get(i).copied().unwrap_or(0) % 4),
            guest_addr: 0,
            pages: u64_at(data, 3 + 2 * i) % 300,
            host_addr: 0,
        })
        .collect();
    bitmaps(&slots, data.get(16..).unwrap_or(&[]));
    ring(&slots, data.get(16..).unwrap_or(&[]));
}

/// Arbitrary words as a slot's bitmap: accepted exactly when the length fits,
/// and then its runs cover exactly its dirty pages, all inside the slot.
fn bitmaps(slots: &[Slot], data: &[u8]) {
    for slot in slots {
        let words: Vec<u64> = data.chunks(8).map(|c| u64_at(c, 0)).collect();
        let fits = words.len() == slot.pages.div_ceil(64) as usize;
        match DirtyBitmap::from_kvm_words(slot.pages, words) {
            Ok(b) => {
                assert!(fits);
                let runs: Vec<_> = b.runs().collect();
                assert_eq!(runs.iter().map(|r| r.1).sum::<u64>(), b.count());
                assert!(
                    runs.iter()
                        .all(|&(first, n)| n > 0 && first + n <= slot.pages)
                );
            }
            Err(_) => assert!(!fits),
        }
    }
}

/// Arbitrary entries in a ring: every published entry up to the first
/// unpublished one is taken and reset, nothing else is touched, tracked
/// pages are set, and an entry for a known slot with a bad offset marks the
/// whole slot.
fn ring(slots: &[Slot], data: &[u8]) {
    let mut entries: Vec<DirtyGfn> = data
        .chunks(13)
        .map(|c| DirtyGfn {
            flags: u32::from(c[0] % 4),
            slot: u32::from(c.get(1).copied().unwrap_or(0) % 5)
                | u32::from(c.get(2).copied().unwrap_or(0) / 250) << 16,
            offset: u64_at(c, 3) % 400,
        })
        .collect();
    let Some(ptr) = NonNull::new(entries.as_mut_ptr()) else {
        return;
    };
    let len = entries.len() as u32;
    let before = entries.clone();
    let mut pending = DirtySet::for_slots(slots);
    let mut bad = None;
    let mut next = 0;
    // SAFETY: `ptr` points to `len` entries owned by this function.
    let taken = unsafe {
        collect_entries(ptr, len, &mut next, |gfn, index| {
            place(&mut pending, &mut bad, slots, 0, gfn, index);
        })
    };
    let published = before
        .iter()
        .take_while(|e| e.flags & DIRTY_GFN_F_DIRTY != 0)
        .count();
    assert_eq!(taken as usize, published);
    for (i, (after, was)) in entries.iter().zip(&before).enumerate() {
        if i < published {
            assert_eq!(after.flags, DIRTY_GFN_F_RESET, "taken entries are reset");
            match decode(was, slots) {
                Ok((slot, page)) => assert!(bitmap(&pending, slots, slot).is_dirty(page)),
                Err(EntryError::OffsetBeyondSlot(slot)) => {
                    let b = bitmap(&pending, slots, slot);
                    assert_eq!(b.count(), slots[slot].pages, "a bad offset marks the slot");
                }
                Err(_) => {}
            }
        } else {
            assert_eq!(
                after, was,
                "entries past the first unpublished are untouched"
            );
        }
    }
    let any_bad = before[..published]
        .iter()
        .any(|e| decode(e, slots).is_err());
    assert_eq!(bad.is_some(), any_bad);
}

fn bitmap<'a>(set: &'a DirtySet, slots: &[Slot], index: usize) -> &'a DirtyBitmap {
    set.get(slots[index].id).expect("every slot has a bitmap")
}

#[cfg(test)]
mod tests {
    #[test]
    fn hand_made_inputs_hold() {
        super::run(&[]);
        super::run(&[
            1, 2, 3, 10, 0, 100, 0, 200, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 5, 0, 0,
        ]);
        super::run(&[0u8; 64]);
        super::run(&[0xff; 200]);
    }

    /// Replays every input committed under `fuzz-corpus/decode/`.
    #[test]
    fn replays_the_fuzz_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-corpus/decode");
        let mut inputs = 0;
        for entry in std::fs::read_dir(dir).expect("the corpus is committed") {
            super::run(&std::fs::read(entry.unwrap().path()).unwrap());
            inputs += 1;
        }
        assert!(inputs >= 8, "the corpus has only {inputs} inputs");
    }
}
