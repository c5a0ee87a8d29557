//! `DirtyBitmap` against a naive model (a set of page numbers), for arbitrary
//! slot sizes and operation sequences.

use std::collections::BTreeSet;

use dirty_log::DirtyBitmap;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Set(u64),
    MergeWords(Vec<u64>),
    MergeBitmap(Vec<u64>),
    SetAll,
    Clear,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<u64>().prop_map(Op::Set),
        2 => proptest::collection::vec(any::<u64>(), 0..12).prop_map(Op::MergeWords),
        2 => proptest::collection::vec(any::<u64>(), 0..40).prop_map(Op::MergeBitmap),
        1 => Just(Op::SetAll),
        1 => Just(Op::Clear),
    ]
}

/// The model's KVM words: bit p % 64 of word p / 64.
fn words_of(model: &BTreeSet<u64>, pages: u64) -> Vec<u64> {
    let mut words = vec![0u64; pages.div_ceil(64) as usize];
    for &p in model {
        words[(p / 64) as usize] |= 1 << (p % 64);
    }
    words
}

fn runs_of(model: &BTreeSet<u64>) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for &p in model {
        match runs.last_mut() {
            Some((first, n)) if *first + *n == p => *n += 1,
            _ => runs.push((p, 1)),
        }
    }
    runs
}

proptest! {
    #[test]
    fn bitmap_matches_a_set_of_pages(pages in 0u64..700, ops in proptest::collection::vec(op(), 0..40)) {
        let mut bitmap = DirtyBitmap::new(pages);
        let mut model = BTreeSet::new();
        for op in ops {
            match op {
                Op::Set(p) => {
                    let p = p % (pages + 2); // sometimes out of range
                    prop_assert_eq!(bitmap.set(p).is_ok(), p < pages);
                    if p < pages {
                        model.insert(p);
                    }
                }
                Op::MergeWords(words) => {
                    let fits = words.len() == pages.div_ceil(64) as usize;
                    prop_assert_eq!(bitmap.merge_kvm_words(&words).is_ok(), fits);
                    if fits {
                        model.extend((0..pages).filter(|p| words[(p / 64) as usize] >> (p % 64) & 1 == 1));
                    }
                }
                Op::MergeBitmap(picks) => {
                    let mut other = DirtyBitmap::new(pages);
                    for p in picks.iter().filter(|&&p| p < pages) {
                        other.set(*p).unwrap();
                        model.insert(*p);
                    }
                    bitmap.merge(&other).unwrap();
                }
                Op::SetAll => {
                    bitmap.set_all();
                    model.extend(0..pages);
                }
                Op::Clear => {
                    bitmap.clear();
                    model.clear();
                }
            }
            prop_assert_eq!(bitmap.count(), model.len() as u64);
            prop_assert_eq!(bitmap.is_clean(), model.is_empty());
        }
        prop_assert_eq!(bitmap.as_kvm_words(), &words_of(&model, pages)[..]);
        prop_assert_eq!(bitmap.runs().collect::<Vec<_>>(), runs_of(&model));
        for p in [0, pages / 2, pages.saturating_sub(1), pages, u64::MAX] {
            prop_assert_eq!(bitmap.is_dirty(p), model.contains(&p));
        }
        let round_trip = DirtyBitmap::from_kvm_words(pages, bitmap.as_kvm_words().to_vec()).unwrap();
        prop_assert_eq!(round_trip, bitmap);
    }
}
