//! A host cyclictest: periodic deadlines delivered through `TimerThread`, for
//! each advance policy in the same run, at 1 ms and 200 µs periods. Lateness is
//! measured where delivery starts (after the spin to the target), so it is the
//! host side of what a guest would see.
//!
//! `cargo run --release -p lapic-timer --example cyclictest -- [SECONDS_PER_POLICY [TRACE_FILE]]
//! [--period-us P] [--policy none|kvm|percentile] [--stall-every N --stall-ms M] [--json]`
//!
//! With TRACE_FILE, the wake lateness of the first run without advance at 1 ms
//! is recorded there (up to 20 000 expiries) for `--example simulate-timer`.
//!
//! Each policy runs SECONDS_PER_POLICY (default 1) per period in each of three
//! rounds; the table gives the median of the rounds. Score = mean lateness +
//! λ·mean spin per expiry (λ = 0.1, `Percentile`'s default), the quantity
//! `Percentile` minimises; the Fixed rows are the sweep it is compared with.
//!
//! `--stall-every N --stall-ms M`: the process runs on one CPU, and every N
//! expiries a `SCHED_FIFO` thread takes that CPU for M ms, halfway through a
//! period, as a host stall would. Each policy also runs without stalls in the
//! same rounds, and the report gives the ratio of the p50s; without
//! `--policy`, it runs none, KvmAdaptive and Percentile (not the Fixed sweep).
//! `--json` prints one JSON object per policy and period instead of tables.
//!
//! With `--update-results`, the tables of a run of every policy (no
//! `--policy`) also go to the crate's RESULTS.md, section "cyclictest" (or "cyclictest with stalls").

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

// The workspace's RESULTS.md writer (test-support's), a copy of which ships with the crate.
#[path = "support/results.rs"]
mod results;

use std::fmt::Write as _;

#[path = "support/affinity.rs"]
mod affinity;
#[path = "../sim/mod.rs"]
mod sim;
#[path = "support/summary.rs"]
mod summary;
use lapic_timer::{
    AdvancePolicy, Clock, Expiry, Fixed, KvmAdaptive, MonotonicClock, NoAdvance, Percentile, Spin,
    SpinAt, TimerEvents, TimerSink, TimerStats, TimerThread, TscClock, Wakeup,
};
use sim::TraceRecorder;

const ROUNDS: usize = 3;
const SPIN_WEIGHT: f64 = 0.1;
const USAGE: &str = "usage: cyclictest [SECONDS_PER_POLICY [TRACE_FILE]] [--period-us P] \
                     [--policy none|kvm|percentile] [--stall-every N --stall-ms M] [--json]";

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
            "Percentile".into(),
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

/// What the command line asked for.
struct Opts {
    secs: f64,
    trace: Option<String>,
    periods: Vec<Duration>,
    /// Index into `policies()`, or all of them.
    policy: Option<usize>,
    stall: Option<Stall>,
    json: bool,
}

/// Every `every` expiries, the CPU is taken for `length`.
#[derive(Clone, Copy)]
struct Stall {
    every: u64,
    length: Duration,
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        secs: 1.0,
        trace: None,
        periods: vec![Duration::from_millis(1), Duration::from_micros(200)],
        policy: None,
        stall: None,
        json: false,
    };
    let (mut every, mut ms) = (None, None);
    let mut positional = 0;
    let mut args = results::args();
    while let Some(arg) = args.next() {
        let mut value = |name: &str| {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            v.parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or(format!("{name} {v:?}: a whole number above 0"))
        };
        match arg.as_str() {
            "--json" => o.json = true,
            "--period-us" => o.periods = vec![Duration::from_micros(value("--period-us")?)],
            "--stall-every" => every = Some(value("--stall-every")?),
            "--stall-ms" => ms = Some(value("--stall-ms")?),
            "--policy" => {
                let name = args.next().ok_or("--policy needs a value")?;
                let index = ["none", "kvm", "percentile"]
                    .iter()
                    .position(|&n| n == name);
                o.policy =
                    Some(index.ok_or(format!("--policy {name:?}: none, kvm or percentile"))?);
            }
            _ if arg.starts_with("--") => return Err(format!("unknown option {arg:?}")),
            _ if positional == 0 => {
                o.secs = arg
                    .parse()
                    .ok()
                    .filter(|&s: &f64| s > 0.0)
                    .ok_or(format!("SECONDS_PER_POLICY {arg:?}: a number above 0"))?;
                positional += 1;
            }
            _ if positional == 1 => {
                o.trace = Some(arg);
                positional += 1;
            }
            _ => return Err(format!("unexpected argument {arg:?}")),
        }
    }
    o.stall = match (every, ms) {
        (Some(every), Some(ms)) => Some(Stall {
            every,
            length: Duration::from_millis(ms),
        }),
        (None, None) => None,
        _ => return Err("--stall-every and --stall-ms go together".into()),
    };
    if let Some(p) = o.periods.iter().find(|p| o.secs < 10.0 * p.as_secs_f64()) {
        return Err(format!(
            "{} s per policy is under 10 periods of {p:?}: nothing left to measure after the warm-up",
            o.secs
        ));
    }
    Ok(o)
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
    advance_final: f64,
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
    fn spun(&self, spin: Spin) {
        self.0.spun(spin)
    }
    fn delivered(&self, lateness_ns: i64) {
        self.0.delivered(lateness_ns)
    }
}

/// A `SCHED_FIFO` thread on the process's CPU that busy-loops for a stall's
/// length from each time it is sent (host ns), keeping every other thread of
/// the process off the CPU meanwhile.
struct Staller(mpsc::Sender<u64>);

impl Staller {
    fn start(length: Duration) -> Result<Self, String> {
        let (tx, rx) = mpsc::channel::<u64>();
        let (ready_tx, ready_rx) = mpsc::channel();
        thread::spawn(move || {
            let fifo = libc::sched_param { sched_priority: 50 };
            // SAFETY: sets the calling thread's policy from a valid sched_param.
            let ret = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &fifo) };
            let _ = ready_tx.send(
                (ret == 0)
                    .then_some(())
                    .ok_or(std::io::Error::last_os_error()),
            );
            for at in rx {
                thread::sleep(Duration::from_nanos(
                    at.saturating_sub(MonotonicClock.now_ns()),
                ));
                let end = Instant::now() + length;
                while Instant::now() < end {
                    std::hint::spin_loop();
                }
            }
        });
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(Self(tx)),
            Ok(Err(e)) => Err(format!("the staller cannot be SCHED_FIFO: {e}")),
            Err(_) => Err("the staller thread died".into()),
        }
    }
}

/// Runs the whole process on its first allowed CPU, so that a stall there
/// stalls the timer thread.
fn share_one_cpu() -> std::io::Result<()> {
    let first = affinity::allowed_cpus()?.first().copied().unwrap_or(0);
    affinity::pin_to(first)
}

fn run(
    policy: Box<dyn AdvancePolicy + Send>,
    period: Duration,
    secs: f64,
    record: Option<Arc<TraceRecorder>>,
    stall: Option<(Stall, &Staller)>,
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
        let deadline = start + k * period.as_nanos() as u64;
        if let Some((_, staller)) = stall.filter(|(s, _)| k % s.every == 0) {
            let _ = staller.0.send(deadline - period.as_nanos() as u64 / 2);
        }
        timer.arm(deadline, k).unwrap();
        lateness.push(rx.recv().unwrap() as f64 / 1000.0);
    }
    let wall = wall.elapsed();
    let advance_final = timer.advance().as_nanos() as f64 / 1000.0;
    drop(timer);
    // The first tenth is warm-up for the learning policies.
    let mut sorted: Vec<f64> = lateness[count / 10..].to_vec();
    sorted.sort_by(f64::total_cmp);
    let q = |p: f64| sorted[((sorted.len() - 1) as f64 * p) as usize];
    let spin_us = stats.spin_cpu_ns.load(Relaxed) as f64 / 1000.0;
    Row {
        min: q(0.0),
        p50: q(0.5),
        p99: q(0.99),
        max: q(1.0),
        mean: sorted.iter().map(|l| l.max(0.0)).sum::<f64>() / sorted.len() as f64,
        spin_percent: 100.0 * spin_us / (wall.as_secs_f64() * 1e6),
        spin_per_expiry: spin_us / count as f64,
        early: stats.early.load(Relaxed),
        advance_final,
    }
}

fn median(rows: &[Row], key: impl Fn(&Row) -> f64) -> f64 {
    summary::median(rows.iter().map(key))
}

fn main() {
    let o = parse().unwrap_or_else(|e| {
        eprintln!("error: {e}\n{USAGE}");
        std::process::exit(2);
    });
    let staller = o.stall.map(|s| {
        let started = share_one_cpu()
            .map_err(|e| format!("cannot pin the process to one CPU: {e}"))
            .and_then(|()| Staller::start(s.length));
        (
            s,
            started.unwrap_or_else(|e| {
                eprintln!("error: {e}");
                std::process::exit(1);
            }),
        )
    });
    let recorder = Arc::new(TraceRecorder::new(20_000));
    let chosen: Vec<usize> = match (o.policy, o.stall) {
        (Some(i), _) => vec![i],
        (None, Some(_)) => vec![0, 1, 2],
        (None, None) => (0..policies().len()).collect(),
    };
    let mut out = String::new();
    for &period in &o.periods {
        let names: Vec<String> = policies().into_iter().map(|(n, _)| n).collect();
        let mut rows: Vec<Vec<Row>> = vec![Vec::new(); names.len()];
        let mut calm: Vec<Vec<Row>> = vec![Vec::new(); names.len()];
        for round in 0..ROUNDS {
            for (i, (_, make)) in policies().into_iter().enumerate() {
                if !chosen.contains(&i) {
                    continue;
                }
                let record = (round == 0 && i == 0 && period == Duration::from_millis(1))
                    .then(|| recorder.clone());
                let stall = staller.as_ref().map(|(s, st)| (*s, st));
                rows[i].push(run(make(), period, o.secs, record, stall));
                if stall.is_some() {
                    calm[i].push(run(make(), period, o.secs, None, None));
                }
            }
        }
        if o.json {
            print_json(&o, period, &names, &rows, &calm);
        } else {
            let table = table(&o, period, &names, &rows, &calm);
            print!("{table}");
            out.push_str(&table);
        }
    }
    if !o.json && o.policy.is_none() {
        let section = if o.stall.is_some() {
            "cyclictest with stalls"
        } else {
            "cyclictest"
        };
        let command = results::command("cargo run --release -p lapic-timer --example cyclictest");
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
        results::write_section_if_asked(&path, "lapic-timer", section, &command, &out);
    }
    if let Some(path) = o.trace {
        let trace = recorder.trace("timerfd wake lateness, 1 ms period (recorded)");
        match trace.save(std::path::Path::new(&path)) {
            Ok(()) => println!("\nrecorded {} wake-ups to {path}", trace.lateness.len()),
            Err(e) => eprintln!("error: cannot write {path}: {e}"),
        }
    }
}

/// The median p50 with stalls over the median p50 without, if stalled.
fn p50_ratio(rows: &[Row], calm: &[Row]) -> Option<f64> {
    (!calm.is_empty()).then(|| median(rows, |r| r.p50) / median(calm, |r| r.p50))
}

fn print_json(o: &Opts, period: Duration, names: &[String], rows: &[Vec<Row>], calm: &[Vec<Row>]) {
    for ((name, r), c) in names.iter().zip(rows).zip(calm) {
        if r.is_empty() {
            continue;
        }
        let m = |f: fn(&Row) -> f64| median(r, f);
        let ns = |us: f64| (us * 1000.0).round() as i64;
        let (every, ms) = o
            .stall
            .map_or((0, 0), |s| (s.every, s.length.as_millis() as u64));
        let ratio = p50_ratio(r, c).map_or("null".into(), |x| format!("{x:.2}"));
        println!(
            "{{\"policy\": \"{name}\", \"period_ns\": {}, \"seconds\": {}, \"rounds\": {ROUNDS}, \"stall_every\": {every}, \"stall_ms\": {ms}, \"p50_ns\": {}, \"p99_ns\": {}, \"max_ns\": {}, \"early\": {}, \"spin_cpu_fraction\": {:.4}, \"advance_ns_final\": {}, \"p50_over_no_stall\": {ratio}}}",
            period.as_nanos(),
            o.secs,
            ns(m(|r| r.p50)),
            ns(m(|r| r.p99)),
            ns(m(|r| r.max)),
            r.iter().map(|r| r.early).sum::<u64>(),
            m(|r| r.spin_percent) / 100.0,
            ns(m(|r| r.advance_final)),
        );
    }
}

/// The markdown table of one period.
fn table(
    o: &Opts,
    period: Duration,
    names: &[String],
    rows: &[Vec<Row>],
    calm: &[Vec<Row>],
) -> String {
    let stalled = o.stall.map_or(String::new(), |s| {
        format!(", a {:?} stall every {} expiries", s.length, s.every)
    });
    let mut t = format!(
        "\n**period {period:?}**, {} s per policy{stalled}, median of {ROUNDS} rounds (lateness in µs at delivery)\n\n\
         | policy | min | p50 | p99 | max | mean | spin CPU | spin µs/expiry | score | early | p50 / no stall |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
        o.secs
    );
    for ((name, r), c) in names.iter().zip(rows).zip(calm) {
        if r.is_empty() {
            continue;
        }
        let m = |f: fn(&Row) -> f64| median(r, f);
        let _ = writeln!(
            t,
            "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.2} | {:.2}% | {:.2} | {:.2} | {} | {} |",
            m(|r| r.min),
            m(|r| r.p50),
            m(|r| r.p99),
            m(|r| r.max),
            m(|r| r.mean),
            m(|r| r.spin_percent),
            m(|r| r.spin_per_expiry),
            m(Row::score),
            r.iter().map(|r| r.early).sum::<u64>(),
            p50_ratio(r, c).map_or("-".into(), |x| format!("{x:.2}x")),
        );
    }
    if rows.len() < 4 || rows[2].is_empty() || rows[3].is_empty() {
        return t;
    }
    let percentile = median(&rows[2], Row::score);
    let best_fixed = (3..names.len())
        .map(|i| (median(&rows[i], Row::score), &names[i]))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap();
    let _ = writeln!(
        t,
        "\nPercentile score {percentile:.2} vs best Fixed ({}) {:.2}: {:.0}%",
        best_fixed.1,
        best_fixed.0,
        100.0 * percentile / best_fixed.0
    );
    t
}
