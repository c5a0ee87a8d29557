//! A host cyclictest: periodic deadlines delivered through `TimerThread`, for
//! each advance policy in the same run, at 1 ms and 200 µs periods. Lateness is
//! measured where delivery starts (after the spin to the target), so it is the
//! host side of what a guest would see.
//!
//! `cargo run --release -p lapic-timer --example cyclictest [-- SECONDS_PER_POLICY [TRACE_FILE]]`
//!
//! With TRACE_FILE, the wake lateness of the first run without advance at 1 ms
//! is recorded there (up to 20 000 expiries) for `--example simulate-timer`.
//!
//! Each policy runs SECONDS_PER_POLICY (default 1) per period in each of three
//! rounds; the table gives the median of the rounds. Score = mean lateness +
//! λ·mean spin per expiry (λ = 0.1, the own policy's default), the quantity the
//! own policy minimises; the Fixed rows are the sweep it is compared with.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use lapic_timer::sim::TraceRecorder;
use lapic_timer::{
    AdvancePolicy, Clock, Expiry, Fixed, KvmAdaptive, MonotonicClock, NoAdvance, Percentile,
    SpinAt, TimerEvents, TimerSink, TimerStats, TimerThread, TscClock, Wakeup,
};

const ROUNDS: usize = 3;
const SPIN_WEIGHT: f64 = 0.1;

/// Sends each expiry's delivery lateness to the measuring thread.
struct Lateness(mpsc::Sender<i64>);

impl TimerSink for Lateness {
    fn expired(&self, e: Expiry) {
        let late = MonotonicClock.now_ns() as i64 - e.deadline_ns as i64;
        let _ = self.0.send(late);
    }
}

type MakePolicy = Box<dyn Fn() -> Box<dyn AdvancePolicy + Send>>;

fn policies() -> Vec<(String, MakePolicy)> {
    let tsc_khz = TscClock::shared().tsc_khz();
    let mut v: Vec<(String, MakePolicy)> = vec![
        ("none".into(), Box::new(|| Box::new(NoAdvance))),
        (
            "KvmAdaptive".into(),
            Box::new(move || Box::new(KvmAdaptive::new(tsc_khz))),
        ),
        (
            "Percentile (own)".into(),
            Box::new(|| Box::new(Percentile::default())),
        ),
    ];
    for us in (10..=100).step_by(10) {
        v.push((
            format!("Fixed {us} µs"),
            Box::new(move || Box::new(Fixed(Duration::from_micros(us)))),
        ));
    }
    v
}

#[derive(Clone, Copy, Default)]
struct Row {
    min: f64,
    p50: f64,
    p99: f64,
    max: f64,
    mean: f64,
    spin_percent: f64,
    spin_per_expiry: f64,
    early: u64,
}

impl Row {
    fn score(&self) -> f64 {
        self.mean + SPIN_WEIGHT * self.spin_per_expiry
    }
}

/// Both the statistics and, optionally, the trace recorder.
struct Events(Arc<TimerStats>, Option<Arc<TraceRecorder>>);

impl TimerEvents for Events {
    fn woke(&self, w: &Wakeup) {
        self.0.woke(w);
        if let Some(r) = &self.1 {
            r.woke(w);
        }
    }
    fn spun(&self, spin: Duration) {
        self.0.spun(spin)
    }
    fn delivered(&self, lateness_ns: i64) {
        self.0.delivered(lateness_ns)
    }
}

fn run(
    policy: Box<dyn AdvancePolicy + Send>,
    period: Duration,
    secs: f64,
    record: Option<Arc<TraceRecorder>>,
) -> Row {
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(TimerStats::default());
    let timer = TimerThread::start(
        policy,
        Lateness(tx),
        Events(stats.clone(), record),
        SpinAt::TimerThread,
    )
    .unwrap();
    let count = (secs / period.as_secs_f64()) as usize;
    let start = MonotonicClock.now_ns() + 1_000_000;
    let mut lateness = Vec::with_capacity(count);
    let wall = Instant::now();
    for k in 1..=count as u64 {
        timer.arm(start + k * period.as_nanos() as u64, k).unwrap();
        lateness.push(rx.recv().unwrap() as f64 / 1000.0);
    }
    let wall = wall.elapsed();
    drop(timer);
    // The first tenth is warm-up for the learning policies.
    let mut sorted: Vec<f64> = lateness[count / 10..].to_vec();
    sorted.sort_by(f64::total_cmp);
    let q = |p: f64| sorted[((sorted.len() - 1) as f64 * p) as usize];
    let spin_us = stats.spin_ns.load(Relaxed) as f64 / 1000.0;
    Row {
        min: q(0.0),
        p50: q(0.5),
        p99: q(0.99),
        max: q(1.0),
        mean: sorted.iter().map(|l| l.max(0.0)).sum::<f64>() / sorted.len() as f64,
        spin_percent: 100.0 * spin_us / (wall.as_secs_f64() * 1e6),
        spin_per_expiry: spin_us / count as f64,
        early: stats.early.load(Relaxed),
    }
}

fn median(rows: &[Row], key: impl Fn(&Row) -> f64) -> f64 {
    let mut v: Vec<f64> = rows.iter().map(key).collect();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let secs: f64 = match std::env::args().nth(1).map(|s| s.parse()) {
        None => 1.0,
        Some(Ok(s)) if s > 0.0 => s,
        Some(_) => {
            eprintln!("usage: cyclictest [SECONDS_PER_POLICY [TRACE_FILE]]");
            std::process::exit(2);
        }
    };
    let record_path = std::env::args().nth(2);
    let recorder = Arc::new(TraceRecorder::new(20_000));
    for period in [Duration::from_millis(1), Duration::from_micros(200)] {
        let names: Vec<String> = policies().into_iter().map(|(n, _)| n).collect();
        let mut rows: Vec<Vec<Row>> = vec![Vec::new(); names.len()];
        for round in 0..ROUNDS {
            for (i, (_, make)) in policies().into_iter().enumerate() {
                let record = (round == 0 && i == 0 && period == Duration::from_millis(1))
                    .then(|| recorder.clone());
                rows[i].push(run(make(), period, secs, record));
            }
        }
        println!(
            "\n**period {period:?}**, {secs} s per policy, median of {ROUNDS} rounds (lateness in µs at delivery)\n"
        );
        println!(
            "| policy | min | p50 | p99 | max | mean | spin CPU | spin µs/expiry | score | early |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (name, r) in names.iter().zip(&rows) {
            let m = |f: fn(&Row) -> f64| median(r, f);
            println!(
                "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2}% | {:.2} | {:.2} | {} |",
                m(|r| r.min),
                m(|r| r.p50),
                m(|r| r.p99),
                m(|r| r.max),
                m(|r| r.mean),
                m(|r| r.spin_percent),
                m(|r| r.spin_per_expiry),
                m(Row::score),
                r.iter().map(|r| r.early).sum::<u64>(),
            );
        }
        let own = median(&rows[2], Row::score);
        let best_fixed = (3..names.len())
            .map(|i| (median(&rows[i], Row::score), &names[i]))
            .min_by(|a, b| a.0.total_cmp(&b.0))
            .unwrap();
        println!(
            "\nown score {own:.2} vs best Fixed ({}) {:.2}: {:.0}%",
            best_fixed.1,
            best_fixed.0,
            100.0 * own / best_fixed.0
        );
    }
    if let Some(path) = record_path {
        let trace = recorder.trace("timerfd wake lateness, 1 ms period (recorded)");
        match trace.save(std::path::Path::new(&path)) {
            Ok(()) => println!("\nrecorded {} wake-ups to {path}", trace.lateness.len()),
            Err(e) => eprintln!("error: cannot write {path}: {e}"),
        }
    }
}
