//! What the levers a boost policy can pull cost on this host, next to what a
//! wake-up costs: they bound what any policy can gain. Prints ns per
//! operation, median of 5 runs:
//! - a park/unpark (futex) round trip between two threads on one CPU, and
//!   between two threads on different CPUs (the wake-up a vCPU IPI becomes);
//! - boosting a blocked thread to `SCHED_FIFO` and restoring it (`FifoBoost`);
//! - moving a blocked thread to one CPU and back (`pin`), the userspace way to
//!   hand a thread one's own CPU;
//! - `sched_yield` with nothing else to run.
//!
//! `cargo run --release -p vcpu-sched --example host_costs`

#[path = "support/summary.rs"]
mod summary;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use vcpu_sched::thread::{current_tid, online_cpus, pin};
use vcpu_sched::{FifoBoost, ThreadControl, Tid};

const RUNS: usize = 5;
const ITERATIONS: u32 = 5000;

/// A flag one thread sets and the other parks on until it is set.
#[derive(Default)]
struct Mailbox(AtomicBool);

impl Mailbox {
    fn send(&self, to: &Thread) {
        self.0.store(true, SeqCst);
        to.unpark();
    }
    fn wait(&self) {
        while !self.0.swap(false, SeqCst) {
            thread::park();
        }
    }
}

/// Park/unpark round trips between a thread on `here` and one on `there`.
fn ping_pong(here: usize, there: usize) -> Duration {
    let (ping, pong) = (Arc::new(Mailbox::default()), Arc::new(Mailbox::default()));
    let me = thread::current();
    let (ping2, pong2) = (ping.clone(), pong.clone());
    let echo = thread::spawn(move || {
        pin(0, &[there]).expect("pin the echo thread");
        for _ in 0..ITERATIONS {
            ping2.wait();
            pong2.send(&me);
        }
    });
    pin(0, &[here]).expect("pin the caller");
    let start = Instant::now();
    for _ in 0..ITERATIONS {
        ping.send(echo.thread());
        pong.wait();
    }
    let elapsed = start.elapsed();
    echo.join().expect("echo thread");
    elapsed / ITERATIONS
}

/// Times `op` on a thread that stays parked meanwhile.
fn on_parked_thread(op: impl Fn(Tid)) -> Duration {
    let (tx, rx) = std::sync::mpsc::channel();
    let done = Arc::new(AtomicBool::new(false));
    let done2 = done.clone();
    let parked = thread::spawn(move || {
        tx.send(current_tid()).expect("send tid");
        while !done2.load(SeqCst) {
            thread::park();
        }
    });
    let tid = rx.recv().expect("parked thread's tid");
    thread::sleep(Duration::from_millis(1)); // let it block
    let start = Instant::now();
    for _ in 0..ITERATIONS {
        op(tid);
    }
    let elapsed = start.elapsed();
    done.store(true, SeqCst);
    parked.thread().unpark();
    parked.join().expect("parked thread");
    elapsed / ITERATIONS
}

fn median_ns(f: impl Fn() -> Duration) -> u128 {
    summary::median((0..RUNS).map(|_| f().as_nanos() as f64)) as u128
}

fn main() {
    let cpus = online_cpus().unwrap_or_else(|e| {
        eprintln!("host_costs: cannot list the online CPUs: {e}");
        std::process::exit(1);
    });
    let fifo = FifoBoost::default();
    if let Err(e) = fifo.check() {
        eprintln!("host_costs: {e}; the boost row needs it");
        std::process::exit(1);
    }
    let (first, last) = (cpus[0], cpus[cpus.len() - 1]);
    println!("| operation | ns |\n|---|---|");
    let row = |name: &str, ns: u128| println!("| {name} | {ns} |");
    row(
        "park/unpark round trip, both threads on one CPU",
        median_ns(|| ping_pong(first, first)),
    );
    if first == last {
        println!("(one online CPU: no cross-CPU round trip)");
    } else {
        row(
            "park/unpark round trip, threads on two CPUs",
            median_ns(|| ping_pong(first, last)),
        );
    }
    row(
        "SCHED_FIFO boost + restore of a blocked thread",
        median_ns(|| {
            on_parked_thread(|tid| {
                fifo.boost(tid).expect("boost");
                fifo.restore(tid).expect("restore");
            })
        }),
    );
    row(
        "pin a blocked thread to one CPU + back to all",
        median_ns(|| {
            on_parked_thread(|tid| {
                pin(tid, &[first]).expect("pin");
                pin(tid, &cpus).expect("unpin");
            })
        }),
    );
    row(
        "sched_yield, nothing else runnable",
        median_ns(|| on_parked_thread(|_| fifo.yield_now())),
    );
}
