//! A dirty bitmap: one bit per page of a memory slot.

/// Bits in one word of KVM's dirty bitmap.
const WORD_BITS: u64 = 64;

/// Why a bitmap operation was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BitmapError {
    /// A page number past the end of the slot.
    #[error("page {page} is outside a slot of {pages} pages")]
    PageOutOfRange {
        /// The page asked for.
        page: u64,
        /// Pages in the slot.
        pages: u64,
    },
    /// Word data whose length does not match the slot size.
    #[error("a slot of {pages} pages needs {expected} words, got {actual}")]
    WrongLength {
        /// Pages in the slot.
        pages: u64,
        /// Words needed.
        expected: usize,
        /// Words given.
        actual: usize,
    },
    /// Two bitmaps of different slot sizes.
    #[error("cannot merge a bitmap of {other} pages into one of {pages}")]
    SizeMismatch {
        /// Pages in this bitmap.
        pages: u64,
        /// Pages in the other.
        other: u64,
    },
}

/// One bit per page of a memory slot, bit `p % 64` of word `p / 64` for page `p`:
/// the layout of `KVM_GET_DIRTY_LOG`. Bits past the last page are always clear.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DirtyBitmap {
    pages: u64,
    words: Vec<u64>,
}

impl DirtyBitmap {
    /// An all-clean bitmap for a slot of `pages` pages.
    pub fn new(pages: u64) -> Self {
        Self {
            pages,
            words: vec![0; words_for(pages)],
        }
    }

    /// A bitmap from KVM's words; bits past the last page are ignored.
    pub fn from_kvm_words(pages: u64, words: Vec<u64>) -> Result<Self, BitmapError> {
        let expected = words_for(pages);
        if words.len() != expected {
            return Err(BitmapError::WrongLength {
                pages,
                expected,
                actual: words.len(),
            });
        }
        let mut bitmap = Self { pages, words };
        bitmap.clear_tail();
        Ok(bitmap)
    }

    /// Pages in the slot.
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Marks `page` dirty.
    pub fn set(&mut self, page: u64) -> Result<(), BitmapError> {
        self.check(page)?;
        self.words[(page / WORD_BITS) as usize] |= 1 << (page % WORD_BITS);
        Ok(())
    }

    /// Whether `page` is dirty; pages outside the slot are not.
    pub fn is_dirty(&self, page: u64) -> bool {
        self.check(page).is_ok()
            && self.words[(page / WORD_BITS) as usize] & (1 << (page % WORD_BITS)) != 0
    }

    /// Number of dirty pages.
    pub fn count(&self) -> u64 {
        self.words.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Adds every page dirty in `other` (same slot size) to this bitmap.
    pub fn merge(&mut self, other: &DirtyBitmap) -> Result<(), BitmapError> {
        if other.pages != self.pages {
            return Err(BitmapError::SizeMismatch {
                pages: self.pages,
                other: other.pages,
            });
        }
        self.words
            .iter_mut()
            .zip(&other.words)
            .for_each(|(a, b)| *a |= b);
        Ok(())
    }

    /// Adds the pages set in KVM-layout `words` (same slot size) to this
    /// bitmap; bits past the last page are ignored.
    pub fn merge_kvm_words(&mut self, words: &[u64]) -> Result<(), BitmapError> {
        if words.len() != self.words.len() {
            return Err(BitmapError::WrongLength {
                pages: self.pages,
                expected: self.words.len(),
                actual: words.len(),
            });
        }
        self.words.iter_mut().zip(words).for_each(|(a, b)| *a |= b);
        self.clear_tail();
        Ok(())
    }

    /// Marks every page dirty.
    pub fn set_all(&mut self) {
        self.words.fill(u64::MAX);
        self.clear_tail();
    }

    /// Marks every page clean.
    pub fn clear(&mut self) {
        self.words.fill(0);
    }

    /// Whether no page is dirty.
    pub fn is_clean(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The dirty runs (first page, length), in order, skipping clean words.
    pub fn runs(&self) -> Runs<'_> {
        Runs {
            words: &self.words,
            pages: self.pages,
            next: 0,
        }
    }

    /// The bitmap in KVM's layout.
    pub fn as_kvm_words(&self) -> &[u64] {
        &self.words
    }

    /// KVM-layout words for pages `first..first + 64 * n`, where `first` is a
    /// multiple of 64: what `KVM_CLEAR_DIRTY_LOG` takes for that range.
    pub fn kvm_words_from(&self, first: u64) -> &[u64] {
        self.words
            .get((first / WORD_BITS) as usize..)
            .unwrap_or(&[])
    }

    fn clear_tail(&mut self) {
        if let (Some(last), tail @ 1..) = (self.words.last_mut(), self.pages % WORD_BITS) {
            *last &= (1 << tail) - 1;
        }
    }

    fn check(&self, page: u64) -> Result<(), BitmapError> {
        if page < self.pages {
            Ok(())
        } else {
            Err(BitmapError::PageOutOfRange {
                page,
                pages: self.pages,
            })
        }
    }
}

/// Iterator over a bitmap's dirty runs: `(first page, pages)`.
#[derive(Clone, Debug)]
pub struct Runs<'a> {
    words: &'a [u64],
    pages: u64,
    next: u64,
}

impl Runs<'_> {
    /// The first dirty page at or after `page`, skipping clean words.
    fn next_dirty(&self, page: u64) -> Option<u64> {
        let mut word = (page / WORD_BITS) as usize;
        let mut bits = *self.words.get(word)? & (u64::MAX << (page % WORD_BITS));
        while bits == 0 {
            word += 1;
            bits = *self.words.get(word)?;
        }
        Some(word as u64 * WORD_BITS + u64::from(bits.trailing_zeros()))
    }

    /// The first clean page at or after `page` (the slot's end if none).
    fn next_clean(&self, page: u64) -> u64 {
        let mut word = (page / WORD_BITS) as usize;
        let Some(&first) = self.words.get(word) else {
            return self.pages;
        };
        let mut bits = !first & (u64::MAX << (page % WORD_BITS));
        while bits == 0 {
            word += 1;
            match self.words.get(word) {
                Some(&w) => bits = !w,
                None => return self.pages,
            }
        }
        (word as u64 * WORD_BITS + u64::from(bits.trailing_zeros())).min(self.pages)
    }
}

impl Iterator for Runs<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        let start = self.next_dirty(self.next)?;
        let end = self.next_clean(start);
        self.next = end;
        Some((start, end - start))
    }
}

fn words_for(pages: u64) -> usize {
    pages.div_ceil(WORD_BITS) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_map_to_kvm_bits() {
        let mut b = DirtyBitmap::new(130);
        for p in [0, 63, 64, 129] {
            b.set(p).unwrap();
        }
        assert_eq!(b.as_kvm_words(), &[1 | 1 << 63, 1, 1 << 1]);
        assert!(b.is_dirty(63) && !b.is_dirty(62) && !b.is_dirty(130));
        assert_eq!(b.count(), 4);
    }

    #[test]
    fn out_of_range_pages_are_errors_not_panics() {
        let mut b = DirtyBitmap::new(10);
        assert_eq!(
            b.set(10),
            Err(BitmapError::PageOutOfRange {
                page: 10,
                pages: 10
            })
        );
        assert_eq!(
            b.set(u64::MAX),
            Err(BitmapError::PageOutOfRange {
                page: u64::MAX,
                pages: 10
            })
        );
        assert!(!b.is_dirty(u64::MAX));
    }

    #[test]
    fn kvm_words_round_trip_and_bits_past_the_end_are_dropped() {
        let b = DirtyBitmap::from_kvm_words(70, vec![0xf0, u64::MAX]).unwrap();
        assert_eq!(b.as_kvm_words(), &[0xf0, 0x3f]);
        assert_eq!(b.count(), 4 + 6);
        let wrong = DirtyBitmap::from_kvm_words(70, vec![0]);
        assert_eq!(
            wrong,
            Err(BitmapError::WrongLength {
                pages: 70,
                expected: 2,
                actual: 1
            })
        );
        assert_eq!(
            DirtyBitmap::from_kvm_words(128, vec![1, 1])
                .unwrap()
                .count(),
            2
        );
    }

    #[test]
    fn runs_span_words_and_stop_at_the_slot_end() {
        let mut b = DirtyBitmap::new(200);
        for p in (60..70).chain([100]).chain(130..200) {
            b.set(p).unwrap();
        }
        assert_eq!(
            b.runs().collect::<Vec<_>>(),
            [(60, 10), (100, 1), (130, 70)]
        );
        b.set_all();
        assert_eq!(b.runs().collect::<Vec<_>>(), [(0, 200)]);
        assert_eq!(b.count(), 200);
        b.clear();
        assert!(b.is_clean() && b.runs().next().is_none());
    }

    #[test]
    fn kvm_words_merge_and_slice_by_page() {
        let mut b = DirtyBitmap::new(130);
        b.merge_kvm_words(&[1, 2, u64::MAX]).unwrap();
        assert_eq!(b.as_kvm_words(), &[1, 2, 3], "bits past page 129 dropped");
        assert_eq!(b.kvm_words_from(64), &[2, 3]);
        assert!(b.kvm_words_from(1 << 20).is_empty());
        assert!(b.merge_kvm_words(&[0]).is_err());
    }

    #[test]
    fn kvm_words_merged_into_a_word_keep_the_bits_already_set_in_it() {
        // A harvest ORs KVM's words and the VMM's writes into one bitmap:
        // pages 3 and 64 dirty already, KVM's words say 5 (word 0) and
        // nothing in word 1; all three stay dirty.
        let mut b = DirtyBitmap::new(130);
        b.set(3).unwrap();
        b.set(64).unwrap();
        b.merge_kvm_words(&[1 << 5, 0, 0]).unwrap();
        assert_eq!(
            b.as_kvm_words(),
            &[1 << 3 | 1 << 5, 1, 0],
            "a merge adds to each word, it does not overwrite it"
        );
        assert!(b.is_dirty(3) && b.is_dirty(5) && b.is_dirty(64));
        assert_eq!(b.count(), 3);
    }

    #[test]
    fn a_bitmap_merged_into_a_word_keeps_the_bits_already_set_in_it() {
        let mut a = DirtyBitmap::new(130);
        a.set(3).unwrap();
        a.set(64).unwrap();
        let mut b = DirtyBitmap::new(130);
        b.set(5).unwrap();
        a.merge(&b).unwrap();
        assert_eq!(
            a.as_kvm_words(),
            &[1 << 3 | 1 << 5, 1, 0],
            "a merge adds to each word, it does not overwrite it"
        );
        assert_eq!(a.count(), 3);
    }

    #[test]
    fn merge_is_a_union_of_equal_sized_slots() {
        let mut a = DirtyBitmap::new(100);
        let mut b = DirtyBitmap::new(100);
        a.set(1).unwrap();
        b.set(1).unwrap();
        b.set(99).unwrap();
        a.merge(&b).unwrap();
        assert_eq!(a.count(), 2);
        assert!(a.is_dirty(99));
        assert_eq!(
            a.merge(&DirtyBitmap::new(50)),
            Err(BitmapError::SizeMismatch {
                pages: 100,
                other: 50
            })
        );
    }
}
