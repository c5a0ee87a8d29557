//! A reader and a writer of an RCU cell, with a custom quiescent-state reporter.
use rcu_qs::{Domain, QsReporter, RcuCell};

/// Counts the quiescent states it reports.
struct Counting(u64);

impl QsReporter for Counting {
    fn quiescent(&mut self) {
        self.0 += 1;
    }
    fn offline(&mut self) {}
    fn online(&mut self) {}
}

fn main() {
    let domain = Domain::new();
    let cell = RcuCell::new(&domain, 1u32);
    let reader = domain.register_reader();
    assert_eq!(*cell.read(&reader), 1);
    let mut qs = Counting(0);
    qs.quiescent();
    drop(reader);
    cell.store(2);
    println!("{} quiescent state(s) reported", qs.0);
}
