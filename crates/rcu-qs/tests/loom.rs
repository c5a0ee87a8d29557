//! Loom models of the QSBR protocol: every interleaving (within a preemption
//! bound) of readers noting quiescent states, going offline and online, and a
//! writer publishing a value and waiting for a grace period before reclaiming the
//! old one. A value reclaimed while a reader can still see it is a data race on
//! its canary, which loom reports.
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p rcu-qs --test loom --release`; the
//! preemption bound is 3 unless `LOOM_MAX_PREEMPTIONS` sets another.
#![cfg(loom)]

use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

use rcu_qs::{Domain, RcuCell};

const ALIVE: u64 = 1;
const DEAD: u64 = 2;

struct Value {
    seq: u64,
    canary: UnsafeCell<u64>,
}

// SAFETY: the canary is shared by readers (reads) and the writer (one write after
// the grace period); whether those are ordered is exactly what loom checks.
unsafe impl Sync for Value {}

impl Value {
    fn new(seq: u64) -> Self {
        Self {
            seq,
            canary: UnsafeCell::new(ALIVE),
        }
    }

    /// A read of the value: races with `retire` unless ordered before it.
    fn check(&self) -> u64 {
        // SAFETY: loom tracks this access; a race with `retire` fails the model.
        self.canary.with(|p| assert_eq!(unsafe { *p }, ALIVE));
        self.seq
    }

    /// What freeing does to the value, made visible to loom.
    fn retire(self) {
        // SAFETY: as for `check`.
        self.canary.with_mut(|p| unsafe { *p = DEAD });
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound.get_or_insert(3);
    builder.check(f);
}

/// Two readers (one noting quiescent states, one going offline and online) and a
/// writer replacing the value and retiring the old one after `replace`'s grace period.
#[test]
fn two_readers_and_a_writer() {
    model(|| {
        let domain = Domain::new();
        let cell = Arc::new(RcuCell::new(&domain, Value::new(0)));
        let quiescing = {
            let (domain, cell) = (domain.clone(), cell.clone());
            thread::spawn(move || {
                let mut reader = domain.register_reader();
                let first = cell.read(&reader).check();
                reader.quiescent();
                let second = cell.read(&reader).check();
                assert!(second >= first);
            })
        };
        let offlining = {
            let (domain, cell) = (domain.clone(), cell.clone());
            thread::spawn(move || {
                let mut reader = domain.register_reader();
                cell.read(&reader).check();
                reader.offline();
                reader.online();
                cell.read(&reader).check();
            })
        };
        cell.replace(Value::new(1)).unwrap().retire();
        quiescing.join().unwrap();
        offlining.join().unwrap();
    });
}

/// A reader that comes online after the writer published must see the new value
/// or be waited for: publication and reclamation across two replacements.
#[test]
fn publish_and_reclaim_twice() {
    model(|| {
        let domain = Domain::new();
        let cell = Arc::new(RcuCell::new(&domain, Value::new(0)));
        let reader = {
            let (domain, cell) = (domain.clone(), cell.clone());
            thread::spawn(move || {
                let mut reader = domain.register_reader();
                reader.offline();
                reader.online();
                let a = cell.read(&reader).check();
                reader.quiescent();
                let b = cell.read(&reader).check();
                assert!(b >= a);
            })
        };
        cell.replace(Value::new(1)).unwrap().retire();
        cell.replace(Value::new(2)).unwrap().retire();
        reader.join().unwrap();
    });
}

/// Two writers waiting at once share or chain grace periods; neither returns
/// while the reader may still see what it retires.
#[test]
fn concurrent_writers() {
    model(|| {
        let domain = Domain::new();
        let cell = Arc::new(RcuCell::new(&domain, Value::new(0)));
        let writer = {
            let cell = cell.clone();
            thread::spawn(move || cell.replace(Value::new(1)).unwrap().retire())
        };
        let mut reader = domain.register_reader();
        cell.read(&reader).check();
        reader.offline();
        domain.synchronize().unwrap();
        writer.join().unwrap();
        reader.online();
        assert_eq!(cell.read(&reader).check(), 1);
    });
}
