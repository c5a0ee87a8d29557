//! Two threads ping-pong through `HaltPoller`s, as the contextswitch
//! benchmark of the guest halt-polling series ("x86/paravirt: Add
//! pv_idle_ops", 2017) does: round-trip time and CPU time per round trip for each policy,
//! with block-only as the baseline, on an idle machine and with one CPU-hog
//! thread per core, the latter once without and once with the poller's check
//! for threads waiting for the CPU (`yield_to_waiting_threads`).
//!
//! `cargo run --release -p halt-poll --example pingpong [-- SECONDS [TRACE_FILE]]`
//!
//! Each configuration runs SECONDS (default 5) per policy, in five rounds that
//! take turns between the policies (the machine is shared and noisy); the table
//! gives the median of the rounds. The hogs run for the whole configuration.
//! With TRACE_FILE, the halts of the "always poll" runs on the idle machine (the
//! first 20 000) are recorded there for `--example simulate`. With
//! `--update-results` the tables also go to the crate's RESULTS.md, section "pingpong".

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::thread;
use std::time::{Duration, Instant};

// The workspace's CPU hogs (test-support's), a copy of which ships with the crate.
#[path = "support/hogs.rs"]
mod hogs;
use hogs::Hogs;
// And its RESULTS.md writer.
#[path = "support/results.rs"]
mod results;
// And the simulator's trace recorder.
#[path = "../sim/mod.rs"]
mod sim;
#[path = "support/summary.rs"]
mod summary;
use sim::TraceRecorder;
use summary::median;

use std::fmt::Write as _;

use halt_poll::{
    AioPoll, Fixed, FutexWake, GuestHaltpoll, HaltEvents, HaltPoller, HaltStats, KvmGrowShrink,
    Never, NoEvents, PollPolicy, Predictive, set_timer_slack,
};

/// Makes a fresh policy for each thread of a run.
type MakePolicy = fn() -> Box<dyn PollPolicy + Send>;

fn policies() -> Vec<(&'static str, MakePolicy)> {
    vec![
        ("never (block only)", || Box::new(Never)),
        ("fixed 200 µs (always poll)", || {
            Box::new(Fixed(Duration::from_micros(200)))
        }),
        ("KvmGrowShrink", || Box::new(KvmGrowShrink::new())),
        ("GuestHaltpoll", || Box::new(GuestHaltpoll::new())),
        ("AioPoll", || Box::new(AioPoll::new())),
        ("Predictive", || Box::new(Predictive::default())),
    ]
}

const ROUNDS: usize = 5;

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we own.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

#[derive(Clone, Copy)]
struct Run {
    round_trip: Duration,
    cpu_per_round_trip: Duration,
    polled_percent: f64,
    hog_rate: f64,
}

/// Ping-pongs for `secs` with `make()` policies on both sides, beside `hogs`.
fn run(
    make: MakePolicy,
    secs: f64,
    hogs: &Hogs,
    probe: bool,
    events: Arc<dyn HaltEvents + Send + Sync>,
) -> Run {
    let (a, b) = (Arc::new(FutexWake::new()), Arc::new(FutexWake::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let stats = Arc::new(HaltStats::default());
    let responder = {
        let (a, b, stop, stats) = (a.clone(), b.clone(), stop.clone(), stats.clone());
        thread::spawn(move || {
            let _ = set_timer_slack(Duration::from_nanos(1));
            let cpu0 = thread_cpu();
            let mut poller = HaltPoller::new(b, make())
                .yield_to_waiting_threads(probe)
                .with_events(stats);
            loop {
                poller.halt();
                if stop.load(Relaxed) {
                    break;
                }
                a.wake(0);
            }
            thread_cpu() - cpu0
        })
    };
    let _ = set_timer_slack(Duration::from_nanos(1));
    let hog_start = hogs.iterations();
    let cpu0 = thread_cpu();
    let mut poller = HaltPoller::new(a, make())
        .yield_to_waiting_threads(probe)
        .with_events(events);
    let (start, mut rounds) = (Instant::now(), 0u64);
    let limit = Duration::from_secs_f64(secs);
    while start.elapsed() < limit {
        b.wake(0);
        poller.halt();
        rounds += 1;
    }
    let elapsed = start.elapsed();
    let cpu = thread_cpu() - cpu0;
    let hog_iterations = hogs.iterations() - hog_start;
    stop.store(true, Relaxed);
    b.wake(0);
    let cpu = cpu + responder.join().unwrap();
    let n = rounds.max(1);
    Run {
        round_trip: elapsed / n as u32,
        cpu_per_round_trip: cpu / n as u32,
        polled_percent: 100.0 * stats.halt_successful_poll.load(Relaxed) as f64 / n as f64,
        hog_rate: hog_iterations as f64 / elapsed.as_secs_f64() / 1e6,
    }
}

fn main() {
    let mut args = results::args();
    let secs: f64 = match args.next().map(|s| s.parse()) {
        None => 5.0,
        Some(Ok(s)) if s > 0.0 => s,
        Some(_) => {
            eprintln!("usage: pingpong [SECONDS [TRACE_FILE]]");
            std::process::exit(2);
        }
    };
    let record = args.next();
    let mut out = String::new();
    let cores = thread::available_parallelism().map_or(2, |n| n.get());
    let recorder = Arc::new(TraceRecorder::new(Duration::from_micros(30), 20_000));
    for (hogs, probe) in [(0, true), (cores, false), (cores, true)] {
        let mut runs: Vec<Vec<Run>> = vec![Vec::new(); policies().len()];
        let hog_threads = Hogs::start(hogs);
        for _ in 0..ROUNDS {
            for (i, (name, make)) in policies().into_iter().enumerate() {
                let events: Arc<dyn HaltEvents + Send + Sync> =
                    if hogs == 0 && name.starts_with("fixed") {
                        recorder.clone()
                    } else {
                        Arc::new(NoEvents)
                    };
                runs[i].push(run(make, secs / ROUNDS as f64, &hog_threads, probe, events));
            }
        }
        drop(hog_threads);
        let check = if probe { "on" } else { "off" };
        let mut table = format!(
            "\n**{hogs} CPU-hog thread(s), waiting-thread check {check}**, {cores} cores, {secs} s per policy (median of {ROUNDS} rounds)\n\n\
             | policy | round trip µs | vs block only | CPU µs per round trip | vs block only | responder woken polling | hog M iterations/s |\n\
             |---|---|---|---|---|---|---|\n"
        );
        let base_rt = median(runs[0].iter().map(|r| r.round_trip.as_secs_f64()));
        let base_cpu = median(runs[0].iter().map(|r| r.cpu_per_round_trip.as_secs_f64()));
        for ((name, _), r) in policies().into_iter().zip(&runs) {
            let rt = median(r.iter().map(|r| r.round_trip.as_secs_f64()));
            let cpu = median(r.iter().map(|r| r.cpu_per_round_trip.as_secs_f64()));
            let _ = writeln!(
                table,
                "| {name} | {:.2} | {:.2}x | {:.2} | {:.2}x | {:.1}% | {:.0} |",
                rt * 1e6,
                rt / base_rt,
                cpu * 1e6,
                cpu / base_cpu,
                median(r.iter().map(|r| r.polled_percent)),
                median(r.iter().map(|r| r.hog_rate)),
            );
        }
        print!("{table}");
        out.push_str(&table);
    }
    let command = results::command("cargo run --release -p halt-poll --example pingpong");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    results::write_section_if_asked(&path, "halt-poll", "pingpong", &command, &out);
    if let Some(path) = record {
        let trace = recorder.trace("pingpong (recorded)");
        match trace.save(std::path::Path::new(&path)) {
            Ok(()) => println!("\nrecorded {} halts to {path}", trace.wakes.len()),
            Err(e) => eprintln!("error: cannot write {path}: {e}"),
        }
    }
}
