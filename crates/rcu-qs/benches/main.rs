//! Reader-side and writer-side costs of rcu-qs beside the usual alternatives.
//!
//! `cargo bench -p rcu-qs --bench main` (add `-- --quick` for a fast pass).
//! "2 threads": a second thread does the same operation on the same object in a
//! loop while the first is measured. A run of every benchmark also writes
//! criterion's medians, as ratios and against the goals, into the crate's
//! RESULTS.md, section "bench".

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::thread;
use std::time::{Duration, Instant};

// The workspace's RESULTS.md writer and criterion reader (test-support's),
// copies of which ship with the crate.
#[path = "support/criterion_medians.rs"]
mod criterion_medians;
// `cargo bench` is run to measure, so it always writes RESULTS.md; the
// examples' `--update-results` helpers go unused here.
#[path = "support/results.rs"]
#[allow(dead_code)]
mod results;

use std::fmt::Write as _;

use arc_swap::ArcSwap;
use criterion::{Criterion, criterion_group};
use crossbeam_epoch as epoch;
use rcu_qs::{Domain, RcuCell};

/// A table a vCPU thread might look up on an exit.
type Table = [u64; 4];

/// Runs `op` on a second thread until the returned guard is dropped.
fn background(op: impl Fn() + Send + 'static) -> impl Drop {
    struct Stop(Arc<AtomicBool>, Option<thread::JoinHandle<()>>);
    impl Drop for Stop {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
            self.1.take().map(|t| t.join());
        }
    }
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let t = thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            for _ in 0..1000 {
                op();
            }
        }
    });
    Stop(stop, Some(t))
}

fn reads(c: &mut Criterion) {
    for threads in [1, 2] {
        let mut g = c.benchmark_group(format!("read/{threads} thread(s)"));

        let domain = Domain::new();
        let cell = Arc::new(RcuCell::new(&domain, [1u64; 4]));
        let _bg = (threads == 2).then(|| {
            let (d, cell) = (domain.clone(), cell.clone());
            background(move || {
                thread_local!(static R: std::cell::OnceCell<rcu_qs::Reader> = const { std::cell::OnceCell::new() });
                R.with(|r| black_box(cell.read(r.get_or_init(|| d.register_reader()))[0]));
            })
        });
        let reader = domain.register_reader();
        g.bench_function("RcuCell::read", |b| {
            b.iter(|| black_box(cell.read(&reader)[0]))
        });
        drop(_bg);

        let swap = Arc::new(ArcSwap::<Table>::from_pointee([1; 4]));
        let s = swap.clone();
        let _bg = (threads == 2).then(|| {
            background(move || {
                black_box(s.load()[0]);
            })
        });
        g.bench_function("ArcSwap::load", |b| b.iter(|| black_box(swap.load()[0])));
        drop(_bg);

        let lock = Arc::new(RwLock::new([1u64; 4]));
        let l = lock.clone();
        let _bg = (threads == 2).then(|| {
            background(move || {
                black_box(l.read().unwrap()[0]);
            })
        });
        g.bench_function("RwLock::read", |b| {
            b.iter(|| black_box(lock.read().unwrap()[0]))
        });
        drop(_bg);

        let mutex = Arc::new(Mutex::new([1u64; 4]));
        let m = mutex.clone();
        let _bg = (threads == 2).then(|| {
            background(move || {
                black_box(m.lock().unwrap()[0]);
            })
        });
        g.bench_function("Mutex::lock", |b| {
            b.iter(|| black_box(mutex.lock().unwrap()[0]))
        });
        drop(_bg);

        let atomic = Arc::new(epoch::Atomic::new([1u64; 4]));
        let epoch_read = |a: &epoch::Atomic<Table>| {
            let guard = epoch::pin();
            // SAFETY: the value is never retired while the benchmark runs.
            black_box(unsafe { a.load(Ordering::Acquire, &guard).deref() }[0])
        };
        let a = atomic.clone();
        let _bg = (threads == 2).then(|| {
            background(move || {
                epoch_read(&a);
            })
        });
        g.bench_function("crossbeam-epoch pin+load", |b| {
            b.iter(|| epoch_read(&atomic))
        });
        drop(_bg);
        g.finish();
    }
}

fn reader_transitions(c: &mut Criterion) {
    let mut g = c.benchmark_group("reader");
    let domain = Domain::new();
    let mut reader = domain.register_reader();
    g.bench_function("quiescent, no grace period pending", |b| {
        b.iter(|| reader.quiescent())
    });
    g.bench_function("offline + online", |b| {
        b.iter(|| {
            reader.offline();
            reader.online();
        })
    });
    g.finish();
}

/// Reader threads that each note a quiescent state every `period`, until dropped.
fn periodic_readers(domain: &Domain, count: usize, period: Duration) -> Vec<impl Drop> {
    (0..count)
        .map(|_| {
            let d = domain.clone();
            let stop = Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            let t = thread::spawn(move || {
                let mut reader = d.register_reader();
                while !s.load(Ordering::Relaxed) {
                    let start = Instant::now();
                    while start.elapsed() < period {
                        std::hint::spin_loop();
                    }
                    reader.quiescent();
                }
            });
            struct Join(Arc<AtomicBool>, Option<thread::JoinHandle<()>>);
            impl Drop for Join {
                fn drop(&mut self) {
                    self.0.store(true, Ordering::Relaxed);
                    self.1.take().map(|t| t.join());
                }
            }
            Join(stop, Some(t))
        })
        .collect()
}

fn synchronize(c: &mut Criterion) {
    let mut g = c.benchmark_group("synchronize");
    let domain = Domain::new();
    let offline: Vec<_> = (0..4)
        .map(|_| {
            let mut r = domain.register_reader();
            r.offline();
            r
        })
        .collect();
    g.bench_function("4 readers, all offline", |b| {
        b.iter(|| domain.synchronize().unwrap())
    });
    drop(offline);

    let domain = Domain::new();
    let _readers = periodic_readers(&domain, 1, Duration::from_micros(10));
    g.bench_function("1 reader noting a QS every 10 us", |b| {
        b.iter(|| domain.synchronize().unwrap())
    });
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(50)
}

criterion_group! { name = benches; config = config(); targets = reads, reader_transitions, synchronize }

fn main() {
    benches();
    Criterion::default().configure_from_args().final_summary();
    if criterion_medians::measures_everything() {
        match tables() {
            Some(t) => {
                let command = results::command("cargo bench -p rcu-qs --bench main");
                let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
                results::write_section(&path, "rcu-qs", "bench", &command, &t);
            }
            None => {
                eprintln!("a median is missing from criterion's output: RESULTS.md not written")
            }
        }
    }
}

const READS: [&str; 5] = [
    "RcuCell::read",
    "ArcSwap::load",
    "RwLock::read",
    "Mutex::lock",
    "crossbeam-epoch pin+load",
];

/// Criterion's medians: reads against `RcuCell::read`'s, and the reader and
/// writer costs against their goals.
fn tables() -> Option<String> {
    let median = criterion_medians::median_ns;
    let mut t = String::from(
        "Criterion's medians.\n\n\
         | read of a 32-byte table | 1 thread | 2 threads |\n|---|---|---|\n",
    );
    let base = [
        median("read/1 thread(s)", READS[0])?,
        median("read/2 thread(s)", READS[0])?,
    ];
    for id in READS {
        let ns = [
            median("read/1 thread(s)", id)?,
            median("read/2 thread(s)", id)?,
        ];
        let _ = writeln!(
            t,
            "| `{id}` | {:.2} ns ({:.1}x) | {:.2} ns ({:.1}x) |",
            ns[0],
            ns[0] / base[0],
            ns[1],
            ns[1] / base[1]
        );
    }
    t.push_str("\n| operation | time | goal |\n|---|---|---|\n");
    for (group, id, goal_ns, goal) in [
        (
            "reader",
            "quiescent, no grace period pending",
            2.0,
            "≤ 2 ns",
        ),
        (
            "reader",
            "offline + online",
            25.0,
            "≤ 25 ns (KVM's exit-side QS, \"Note an RCU quiescent state on guest exit\": 33-42 cycles)",
        ),
        ("synchronize", "4 readers, all offline", 5_000.0, "< 5 µs"),
        (
            "synchronize",
            "1 reader noting a QS every 10 us",
            30_000.0,
            "< 30 µs (3 periods)",
        ),
    ] {
        let ns = median(group, id)?;
        let verdict = if ns <= goal_ns { "met" } else { "not met" };
        let _ = writeln!(t, "| `{id}` | {} | {goal}: {verdict} |", time(ns));
    }
    Some(t)
}

fn time(ns: f64) -> String {
    if ns < 1000.0 {
        format!("{ns:.2} ns")
    } else {
        format!("{:.1} µs", ns / 1000.0)
    }
}
