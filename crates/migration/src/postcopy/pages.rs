//! A set of guest pages by index: the pages a post-copy destination still
//! lacks, which the source takes runs from to push.

/// Guest pages, a bit each, with a cursor that runs over them in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PageSet {
    bits: Vec<u64>,
    pages: u64,
    len: u64,
    /// Where the next run is looked for.
    cursor: u64,
}

impl PageSet {
    /// No page of `pages`.
    pub(crate) fn new(pages: u64) -> Self {
        Self {
            bits: vec![0; pages.div_ceil(64) as usize],
            pages,
            len: 0,
            cursor: 0,
        }
    }

    /// Every page of `pages`.
    pub(crate) fn all(pages: u64) -> Self {
        let mut set = Self::new(pages);
        set.insert_run(0, pages);
        set
    }

    /// How many pages the guest has.
    pub(crate) fn capacity(&self) -> u64 {
        self.pages
    }

    /// Pages in the set.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds `n` pages from `first` (inside the guest's: callers check).
    pub(crate) fn insert_run(&mut self, first: u64, n: u64) {
        for page in first..first + n {
            let (word, bit) = Self::at(page);
            if self.bits[word] & bit == 0 {
                self.bits[word] |= bit;
                self.len += 1;
            }
        }
    }

    pub(crate) fn contains(&self, page: u64) -> bool {
        let (word, bit) = Self::at(page);
        page < self.pages && self.bits[word] & bit != 0
    }

    /// Takes `page` out; whether it was in.
    pub(crate) fn remove(&mut self, page: u64) -> bool {
        if !self.contains(page) {
            return false;
        }
        let (word, bit) = Self::at(page);
        self.bits[word] &= !bit;
        self.len -= 1;
        true
    }

    /// Takes out the next run of at most `max` pages from the cursor on
    /// (from the start again once past the end): its first page and length.
    pub(crate) fn take_run(&mut self, max: u64) -> Option<(u64, u64)> {
        let first = self.next_from(self.cursor).or_else(|| self.next_from(0))?;
        let mut n = 0;
        while n < max && self.remove(first + n) {
            n += 1;
        }
        self.cursor = first + n;
        Some((first, n))
    }

    /// Puts `n` pages from `first` back, the cursor on them: the next
    /// run taken starts there.
    pub(crate) fn put_back(&mut self, first: u64, n: u64) {
        self.insert_run(first, n);
        self.cursor = first;
    }

    /// Every run in the set, in order: first page and length.
    pub(crate) fn runs(&self) -> Vec<(u64, u64)> {
        let mut runs = Vec::new();
        let mut page = 0;
        while let Some(first) = self.next_from(page) {
            let mut end = first + 1;
            while self.contains(end) {
                end += 1;
            }
            runs.push((first, end - first));
            page = end;
        }
        runs
    }

    /// The first page in the set at `from` or after.
    fn next_from(&self, from: u64) -> Option<u64> {
        let (mut word, _) = Self::at(from);
        let mut bits = *self.bits.get(word)? & (!0u64 << (from % 64));
        loop {
            if bits != 0 {
                return Some(word as u64 * 64 + u64::from(bits.trailing_zeros()));
            }
            word += 1;
            bits = *self.bits.get(word)?;
        }
    }

    fn at(page: u64) -> (usize, u64) {
        ((page / 64) as usize, 1 << (page % 64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_come_out_in_order_from_the_cursor_and_wrap_once_past_the_end() {
        let mut set = PageSet::new(200);
        set.insert_run(3, 5);
        set.insert_run(63, 3);
        set.insert_run(199, 1);
        assert_eq!(set.len(), 9);
        assert_eq!(set.runs(), vec![(3, 5), (63, 3), (199, 1)]);
        assert_eq!(set.take_run(2), Some((3, 2)));
        // An asked page taken out of the middle of the next run splits it.
        assert!(set.remove(6) && !set.remove(6));
        assert_eq!(set.take_run(16), Some((5, 1)));
        assert_eq!(set.take_run(16), Some((7, 1)));
        assert_eq!(set.take_run(16), Some((63, 3)));
        set.put_back(64, 2);
        assert_eq!(
            set.take_run(16),
            Some((64, 2)),
            "what was put back comes next"
        );
        set.insert_run(0, 1);
        assert_eq!(set.take_run(16), Some((199, 1)));
        assert_eq!(
            set.take_run(16),
            Some((0, 1)),
            "past the end: from the start"
        );
        assert!(set.is_empty());
        assert_eq!(set.take_run(16), None);
        assert!(!set.contains(500));
        assert_eq!(PageSet::all(130).runs(), vec![(0, 130)]);
    }
}
