//! The booster's bound against threads that never give a boost back: three
//! "vCPU" threads busy-loop for ever, on the booster's own CPU, so a boosted
//! one (`SCHED_FIFO`) keeps the booster off that CPU and never returns to ask
//! for its boost to end. Only the revoker can end each boost. A sampler
//! thread, above everything and on another CPU, reads each target's
//! scheduling policy from outside (`sched_getattr`) every 20 µs.
//!
//! `cargo run --release -p vcpu-sched --example boost_bound [-- --json] [--seconds N] [--runs N]`
//!
//! Prints `boosts`, `revoked_by_deadline`, `budget_us` (`max_boost`),
//! `max_boost_us` (the longest time a target was seen real-time, from the
//! last sample before to the first sample after), `max_boost_cpu_us` (the
//! most CPU time a target ran in one such stretch, from its `schedstat`),
//! and `unrecorded_fifo_samples` (samples of a real-time target while the
//! booster had no record of boosting it). Goal: `max_boost_us` at most
//! `budget_us` + 1000, and no unrecorded sample. The CPU time tells why a
//! stretch was long: much less CPU than wall time means the target's CPU ran
//! nothing of ours (the host took it, which delays the revoker's timer on
//! that CPU too); as much CPU means the target really kept it. A stretch during which the sampler
//! itself was off its CPU for over 1 ms cannot be measured: it is counted
//! apart (`unwatched_stretches`, with `max_sampler_gap_us`).
//!
//! `--runs N` repeats the run N times (default 1). The runs' table also goes
//! to the crate's RESULTS.md, section "boost bound".

// The workspace's RESULTS.md writer (test-support's), a copy of which ships with the crate.
#[path = "support/results.rs"]
mod results;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::thread;
use std::time::{Duration, Instant};

use vcpu_sched::thread::{available_cpus, current_tid, get_attr, pin, set_attr};
use vcpu_sched::{BoostBudget, Booster, FifoBoost, SchedAttr, SchedEvents, SchedStats, Tid};

const TARGETS: usize = 3;
const SAMPLE_EVERY: Duration = Duration::from_micros(20);

/// Counts boosts per target (to tell a boost that came and went between two
/// samples from one that was never recorded), and everything else as
/// `SchedStats` does.
#[derive(Default)]
struct Events {
    stats: SchedStats,
    boosts: [AtomicU64; TARGETS],
}

impl SchedEvents for Events {
    fn boosted(&self, vcpu: usize) {
        self.stats.boosted(vcpu);
        self.boosts[vcpu].fetch_add(1, SeqCst);
    }
    fn unboosted(&self, vcpu: usize, held: Duration, revoked: bool) {
        self.stats.unboosted(vcpu, held, revoked);
    }
    fn boost_failed(&self, vcpu: usize, error: &std::io::Error) {
        self.stats.boost_failed(vcpu, error);
    }
    fn restore_failed(&self, vcpu: usize, error: &std::io::Error) {
        self.stats.restore_failed(vcpu, error);
    }
    fn revoker_failed(&self, error: &std::io::Error) {
        self.stats.revoker_failed(error);
    }
}

struct Args {
    json: bool,
    seconds: u64,
    runs: u64,
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        json: false,
        seconds: 10,
        runs: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--json" => args.json = true,
            "--seconds" | "--runs" => {
                let n = it.next().ok_or(format!("{arg} needs a number"))?;
                let n = n
                    .parse()
                    .ok()
                    .filter(|&s| s > 0)
                    .ok_or(format!("{arg} {n:?}: a whole number, at least 1"))?;
                *if arg == "--runs" {
                    &mut args.runs
                } else {
                    &mut args.seconds
                } = n;
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}; use [--json] [--seconds N] [--runs N]"
                ));
            }
        }
    }
    Ok(args)
}

/// What the sampler saw.
#[derive(Default)]
struct Seen {
    samples: u64,
    /// The longest real-time stretch the sampler watched throughout.
    max_fifo: Duration,
    /// The most CPU time a target ran in one watched real-time stretch.
    max_fifo_cpu: Duration,
    /// Real-time samples with no record around them.
    unrecorded: u64,
    /// Real-time stretches during which the sampler itself was off its CPU
    /// for over `UNWATCHED` (the machine stalled): not measurable.
    unwatched: u64,
    /// The sampler's longest gap between two passes.
    max_gap: Duration,
}

/// A gap between two sampling passes beyond this means the sampler, above
/// everything on its CPU, did not run: the machine, not the booster, stalled.
const UNWATCHED: Duration = Duration::from_millis(1);

fn is_fifo(tid: Tid) -> bool {
    get_attr(tid).is_ok_and(|a| a.policy == libc::SCHED_FIFO as u32)
}

/// The CPU time thread `tid` of this process has run (the first field of
/// its `schedstat`, in ns; 0 if unreadable).
fn cpu_time(tid: Tid) -> Duration {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

/// Samples every target until `stop`: the longest real-time stretch of each
/// (bounded by the samples around it), the CPU time it ran in it (from the
/// first sample inside to the first after, so within a sampling pass of the
/// truth), and real-time samples that no record covers (no record before,
/// none after, and no boost in between).
fn sample(
    tids: &[Tid],
    booster: &Booster<FifoBoost, Arc<Events>>,
    events: &Events,
    stop: &AtomicBool,
) -> Seen {
    let mut seen = Seen::default();
    let start = Instant::now();
    // Per target: the last sample that saw it not real-time, its CPU time at
    // the first sample that saw it real-time, and whether a stall of the
    // sampler happened since.
    let mut last_other = vec![start; tids.len()];
    let mut cpu_at_start = vec![Duration::ZERO; tids.len()];
    let mut in_fifo = vec![false; tids.len()];
    let mut stalled = vec![false; tids.len()];
    let mut last_pass = start;
    while !stop.load(SeqCst) {
        let gap = last_pass.elapsed();
        seen.max_gap = seen.max_gap.max(gap);
        if gap > UNWATCHED {
            stalled.iter_mut().for_each(|s| *s = true);
        }
        last_pass = Instant::now();
        for (v, &tid) in tids.iter().enumerate() {
            let boosts = events.boosts[v].load(SeqCst);
            let recorded_before = booster.is_boosted(v);
            let fifo = is_fifo(tid);
            let recorded_after = booster.is_boosted(v);
            let unchanged = events.boosts[v].load(SeqCst) == boosts;
            let now = Instant::now();
            seen.samples += 1;
            if fifo {
                seen.unrecorded += u64::from(!recorded_before && !recorded_after && unchanged);
                if !in_fifo[v] {
                    cpu_at_start[v] = cpu_time(tid);
                }
                in_fifo[v] = true;
                continue;
            }
            if in_fifo[v] && stalled[v] {
                seen.unwatched += 1;
            } else if in_fifo[v] {
                let ran = cpu_time(tid).saturating_sub(cpu_at_start[v]);
                seen.max_fifo = seen.max_fifo.max(now - last_other[v]);
                seen.max_fifo_cpu = seen.max_fifo_cpu.max(ran);
            }
            (in_fifo[v], stalled[v], last_other[v]) = (false, false, now);
        }
        thread::sleep(SAMPLE_EVERY);
    }
    seen
}

fn main() {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let cpus = available_cpus().expect("sched_getaffinity");
    let (shared_cpu, sampler_cpu) = (cpus[0], *cpus.last().expect("one CPU at least"));
    pin(0, &[shared_cpu]).expect("pin the booster");
    if let Err(e) = FifoBoost::default().check() {
        eprintln!("error: this example boosts threads to SCHED_FIFO: {e}");
        std::process::exit(1);
    }
    let budget = BoostBudget::default();
    let mut table = format!(
        "{} s per run, {TARGETS} targets busy-looping on the booster's CPU, max_boost {} µs; \
         goal: seen real-time at most max_boost + 1000 µs, and no real-time sample without a record\n\n\
         | run | boosts | revoked by deadline | longest seen real-time µs | most CPU in one boost µs | unrecorded samples | unwatched stretches | goal |\n\
         |---|---|---|---|---|---|---|---|\n",
        args.seconds,
        budget.max_boost.as_micros()
    );
    for run in 1..=args.runs {
        let (events, seen) = run_once(&args, budget, shared_cpu, sampler_cpu);
        table.push_str(&report(&args, run, &events.stats, budget, &seen));
    }
    let command = results::command("cargo run --release -p vcpu-sched --example boost_bound");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    results::write_section(&path, "vcpu-sched", "boost bound", &command, &table);
}

/// One run: boosts the targets for `args.seconds` while the sampler watches.
fn run_once(
    args: &Args,
    budget: BoostBudget,
    shared_cpu: usize,
    sampler_cpu: usize,
) -> (Arc<Events>, Seen) {
    let fifo = FifoBoost::default();
    let stop = Arc::new(AtomicBool::new(false));
    let (tx, rx) = std::sync::mpsc::channel();
    let targets: Vec<_> = (0..TARGETS)
        .map(|_| {
            let (stop, tx) = (stop.clone(), tx.clone());
            thread::spawn(move || {
                pin(0, &[shared_cpu]).expect("pin a target");
                tx.send(current_tid()).expect("main waits");
                while !stop.load(SeqCst) {
                    std::hint::spin_loop(); // a guest spinning in guest mode
                }
            })
        })
        .collect();
    let tids: Vec<Tid> = (0..TARGETS).map(|_| rx.recv().expect("a target")).collect();
    let events = Arc::new(Events::default());
    let booster = Booster::with_events(TARGETS, fifo, events.clone()).with_budget(budget);
    for (v, &tid) in tids.iter().enumerate() {
        booster.register(v, tid);
    }
    let sampling = AtomicBool::new(false);
    let seen = thread::scope(|s| {
        let sampler = s.spawn(|| {
            pin(0, &[sampler_cpu]).expect("pin the sampler");
            let top = SchedAttr {
                policy: libc::SCHED_FIFO as u32,
                priority: 90,
                ..Default::default()
            };
            set_attr(0, &top).expect("the sampler above everything");
            sample(&tids, &booster, &events, &sampling)
        });
        let end = Instant::now() + Duration::from_secs(args.seconds);
        while Instant::now() < end {
            for v in 0..TARGETS {
                // Boosting a target on this CPU stops this loop until the
                // revoker takes the boost back.
                let _ = booster.boost(v);
            }
            thread::yield_now();
        }
        sampling.store(true, SeqCst);
        sampler.join().expect("the sampler")
    });
    drop(booster);
    stop.store(true, SeqCst);
    for t in targets {
        t.join().expect("a target");
    }
    (events, seen)
}

/// Prints one run's result; returns its row of the RESULTS.md table.
fn report(args: &Args, run: u64, stats: &SchedStats, budget: BoostBudget, seen: &Seen) -> String {
    let get = |a: &AtomicU64| a.load(SeqCst);
    let budget_us = budget.max_boost.as_micros();
    let max_us = seen.max_fifo.as_micros();
    let max_cpu_us = seen.max_fifo_cpu.as_micros();
    let met = max_us <= budget_us + 1000 && seen.unrecorded == 0;
    if args.json {
        println!(
            "{{\"seconds\": {}, \"boosts\": {}, \"revoked_by_deadline\": {}, \"budget_us\": {budget_us}, \"max_boost_us\": {max_us}, \"max_boost_cpu_us\": {max_cpu_us}, \"unrecorded_fifo_samples\": {}, \"samples\": {}, \"unwatched_stretches\": {}, \"max_sampler_gap_us\": {}, \"restore_errors\": {}, \"revoker_errors\": {}, \"goal_met\": {met}}}",
            args.seconds,
            get(&stats.boosts),
            get(&stats.boosts_revoked),
            seen.unrecorded,
            seen.samples,
            seen.unwatched,
            seen.max_gap.as_micros(),
            get(&stats.restore_errors),
            get(&stats.revoker_errors),
        );
    } else {
        println!(
            "{} boosts in {} s, {} revoked by their deadline; the most CPU a target ran \
             real-time in one boost: {max_cpu_us} µs, the longest it was seen real-time: \
             {max_us} µs (max_boost {budget_us} µs; {} stretches not watched throughout, \
             the sampler's longest gap {} µs); {} of {} samples saw a real-time target with \
             no record; goal (seen at most {} µs, no such sample): {}",
            get(&stats.boosts),
            args.seconds,
            get(&stats.boosts_revoked),
            seen.unwatched,
            seen.max_gap.as_micros(),
            seen.unrecorded,
            seen.samples,
            budget_us + 1000,
            if met { "met" } else { "not met" }
        );
    }
    format!(
        "| {run} | {} | {} | {max_us} | {max_cpu_us} | {} | {} | {} |\n",
        get(&stats.boosts),
        get(&stats.boosts_revoked),
        seen.unrecorded,
        seen.unwatched,
        if met { "met" } else { "not met" }
    )
}
