//! Many reader threads going online and offline while a writer replaces values:
//! every read checks a canary, so a value read after it was freed is caught.
#![cfg(not(loom))] // these use real threads and time; tests/loom.rs models the protocol

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::thread;

use rcu_qs::{Domain, RcuCell};

const ALIVE: u64 = 0xa11c_e000_a11c_e000;
const DEAD: u64 = 0xdead_beef_dead_beef;

/// A value with a canary and a checksum of its sequence number.
struct Value {
    seq: u64,
    check: u64,
    canary: u64,
}

impl Value {
    fn new(seq: u64) -> Self {
        Self {
            seq,
            check: !seq,
            canary: ALIVE,
        }
    }

    fn verify(&self) -> u64 {
        assert_eq!(
            self.canary, ALIVE,
            "use after free: value {} was reclaimed",
            self.seq
        );
        assert_eq!(self.check, !self.seq, "torn or reused value");
        self.seq
    }
}

impl Drop for Value {
    fn drop(&mut self) {
        self.verify();
        self.canary = DEAD;
    }
}

#[test]
fn readers_never_see_a_reclaimed_or_older_value() {
    const READERS: usize = 6;
    const UPDATES: u64 = 20_000;
    let domain = Domain::new();
    let cell = Arc::new(RcuCell::new(&domain, Value::new(0)));
    let stop = Arc::new(AtomicBool::new(false));
    // The writer starts once every reader is registered, however late a
    // busy machine runs their threads.
    let registered = Arc::new(Barrier::new(READERS + 1));
    let readers: Vec<_> = (0..READERS)
        .map(|id| {
            let (domain, cell, stop) = (domain.clone(), cell.clone(), stop.clone());
            let registered = registered.clone();
            thread::spawn(move || {
                let mut reader = domain.register_reader();
                registered.wait();
                let (mut last, mut reads) = (0, 0u64);
                while !stop.load(Ordering::Relaxed) {
                    for _ in 0..64 {
                        let seq = cell.read(&reader).verify();
                        assert!(seq >= last, "went back from {last} to {seq}");
                        last = seq;
                        reads += 1;
                    }
                    match (reads / 64 + id as u64) % 4 {
                        0 => reader.offline_while(thread::yield_now),
                        1 => {
                            reader.offline();
                            reader.online();
                        }
                        _ => reader.quiescent(),
                    }
                }
                reads
            })
        })
        .collect();
    registered.wait();
    for seq in 1..=UPDATES {
        if seq % 10 == 0 {
            cell.replace(Value::new(seq)).unwrap().verify();
        } else {
            cell.store(Value::new(seq));
        }
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(
        reads >= READERS as u64 * 64,
        "every reader read at least once"
    );
    assert_eq!(cell.read(&domain.register_reader()).verify(), UPDATES);
    domain.barrier().unwrap();
    assert_eq!(domain.pending_reclaim_bytes(), 0);
}
