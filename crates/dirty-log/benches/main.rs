//! Bitmap operations over a 1 GiB slot (262144 pages) at 0.1 %, 10 % and
//! 100 % dirty, beside a page-by-page baseline measured in the same run.
//!
//! `cargo bench -p dirty-log --bench main` (add `-- --quick` for a fast pass).

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use dirty_log::DirtyBitmap;

const PAGES: u64 = (1 << 30) / 4096;

/// A bitmap with about `per_mille` / 1000 of its pages dirty, spread
/// pseudo-randomly (xorshift), as a guest's scattered writes are.
fn bitmap(per_mille: u64) -> DirtyBitmap {
    let mut b = DirtyBitmap::new(PAGES);
    if per_mille >= 1000 {
        b.set_all();
        return b;
    }
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for _ in 0..PAGES * per_mille / 1000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        b.set(x % PAGES).unwrap();
    }
    b
}

fn runs(c: &mut Criterion) {
    for (name, per_mille) in [("0.1%", 1), ("10%", 100), ("100%", 1000)] {
        let b = bitmap(per_mille);
        let mut group = c.benchmark_group(format!("1 GiB at {name} dirty"));
        group.bench_function("runs()", |bench| {
            bench.iter(|| black_box(&b).runs().map(|(_, n)| n).sum::<u64>())
        });
        group.bench_function("page by page (baseline)", |bench| {
            bench.iter(|| (0..PAGES).filter(|&p| black_box(&b).is_dirty(p)).count())
        });
        group.bench_function("count()", |bench| bench.iter(|| black_box(&b).count()));
        let other = bitmap(per_mille);
        group.bench_function("merge()", |bench| {
            let mut a = b.clone();
            bench.iter(|| a.merge(black_box(&other)).unwrap())
        });
        group.bench_function("from_kvm_words()", |bench| {
            bench.iter(|| {
                DirtyBitmap::from_kvm_words(PAGES, black_box(b.as_kvm_words()).to_vec()).unwrap()
            })
        });
        group.finish();
    }
}

criterion_group!(benches, runs);
criterion_main!(benches);
