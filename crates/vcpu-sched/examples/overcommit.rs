//! The pattern of "KVM: Boost vCPUs that are delivering interrupts" (2019)
//! on host threads, under overcommit: N "vCPU" threads and H CPU-hog threads
//! (the other tenants) on this machine's cores. vCPU 0
//! repeatedly sends an "IPI" to all others and spins until all acknowledge
//! (`smp_call_function_many`); the others spin for a window waiting for the
//! next IPI, then block. Every 2 µs of spinning, as a pause-loop exit would,
//! the sender calls the policy's `on_wait` and the others its `on_idle` (which
//! may end their spin early). For each policy in the same run, taking turns:
//! rounds per second and the hogs' iterations per second, as ratios to `NoBoost`,
//! and the CPUs the VM's own threads used (CPU seconds per second).
//! `DirectedYield, 10x budget` is `DirectedYield` under ten times the default
//! `BoostBudget` (10 ms per boost): the gap between the two is what the
//! bound costs.
//!
//! `cargo run --release -p vcpu-sched --example overcommit [-- SECONDS_PER_RUN [VCPUS HOGS SPIN_US]]`:
//! the whole table, or the one configuration named. With `--update-results`
//! the whole table also goes to the crate's RESULTS.md, section "overcommit".

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

// The workspace's CPU hogs (test-support's), a copy of which ships with the crate.
#[path = "support/hogs.rs"]
mod hogs;
#[path = "support/results.rs"]
mod results;
#[path = "support/summary.rs"]
mod summary;
use hogs::Hogs;
use summary::median;

use crossbeam_utils::CachePadded;
use vcpu_sched::thread::current_tid;
use vcpu_sched::{
    BoostBudget, BoostPolicy, Booster, DirectedYield, FifoBoost, FifoOnDelivery, KvmReady, NoBoost,
    RunState, SchedStats, Scheduler,
};

const ROUNDS: usize = 5;
/// How often a spinning sender "exits" to the policy.
const PLE_WINDOW: Duration = Duration::from_micros(2);

/// Ten times the default budget: what the bound costs shows as the gap
/// between `DirectedYield` under it and under this.
const LOOSE: BoostBudget = BoostBudget::new(
    Duration::from_millis(10),
    Duration::from_millis(20),
    Duration::from_millis(10),
);

fn policies() -> Vec<(&'static str, Arc<dyn BoostPolicy>, BoostBudget)> {
    let default = BoostBudget::default();
    vec![
        ("NoBoost", Arc::new(NoBoost), default),
        ("KvmReady", Arc::new(KvmReady), default),
        ("FifoOnDelivery", Arc::new(FifoOnDelivery), default),
        ("DirectedYield", Arc::new(DirectedYield::default()), default),
        (
            "DirectedYield, 10x budget",
            Arc::new(DirectedYield::default()),
            LOOSE,
        ),
    ]
}

/// The policy under test (chosen per run), real boosts counted, and the
/// pending interrupts as the guest view.
type VmScheduler =
    Scheduler<Arc<dyn BoostPolicy>, Booster<FifoBoost, Arc<SchedStats>>, Arc<Pending>>;

struct Vm {
    sched: VmScheduler,
    pending: Arc<Pending>,
    acks: AtomicUsize,
    stop: AtomicBool,
}

/// Each target's IPI, pending until it answers.
struct Pending(Vec<CachePadded<AtomicBool>>);

impl vcpu_sched::GuestView for Pending {
    /// A halted target with its IPI pending would run if woken.
    fn runnable(&self, vcpu: usize) -> bool {
        self.0[vcpu].load(SeqCst)
    }
    fn in_kernel(&self, _: usize) -> bool {
        true
    }
}

impl Vm {
    /// A target waits for its IPI: spin `window` (exiting to the policy every
    /// PLE window, as a guest's pause loop would), then block.
    fn wait_for_ipi(&self, me: usize, window: Duration) {
        let state = self.sched.state(me);
        state.set_run_state(RunState::InGuest);
        let (start, mut exit) = (Instant::now(), Instant::now());
        while !self.pending.0[me].load(SeqCst) && start.elapsed() < window {
            std::hint::spin_loop();
            if exit.elapsed() >= PLE_WINDOW {
                if !self.sched.idle(me) {
                    break;
                }
                exit = Instant::now();
            }
        }
        state.set_run_state(RunState::Halted);
        while !self.pending.0[me].load(SeqCst) {
            thread::park();
        }
    }

    /// Answers IPIs until stopped; returns the CPU time it used.
    fn target(&self, me: usize, window: Duration) -> Duration {
        self.sched.booster().register(me, current_tid());
        loop {
            self.wait_for_ipi(me, window);
            if self.stop.load(SeqCst) {
                return thread_cpu();
            }
            // It runs and answers: a boost, if any, ends.
            self.sched.entering_guest(me);
            self.sched.left_guest(me);
            self.pending.0[me].store(false, SeqCst);
            self.acks.fetch_add(1, SeqCst);
        }
    }

    /// One smp_call_function_many: IPI everyone, spin until all acknowledge.
    fn round(&self, threads: &[Thread]) {
        let n = self.sched.vcpus();
        self.acks.store(0, SeqCst);
        for t in 1..n {
            self.sched.delivered(t);
            self.pending.0[t].store(true, SeqCst);
            if self.sched.state(t).run_state() == RunState::Halted {
                threads[t - 1].unpark();
            }
        }
        let mut exit = Instant::now();
        while self.acks.load(SeqCst) < n - 1 {
            std::hint::spin_loop();
            if exit.elapsed() >= PLE_WINDOW {
                self.sched.waiting(0);
                exit = Instant::now();
            }
        }
    }
}

#[derive(Clone, Copy)]
struct Run {
    rounds_per_s: f64,
    hog_rate: f64,
    revoked: u64,
    boosted_ms_per_s: f64,
    /// CPU time of the VM's threads (sender and targets) per second.
    vm_cpus: f64,
}

/// The calling thread's CPU time so far (`/proc/thread-self/schedstat`).
fn thread_cpu() -> Duration {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let ns = text.split_whitespace().next().and_then(|f| f.parse().ok());
    Duration::from_nanos(ns.unwrap_or(0))
}

fn run(
    policy: Arc<dyn BoostPolicy>,
    budget: BoostBudget,
    n: usize,
    window: Duration,
    secs: f64,
    hogs: &Hogs,
) -> Run {
    let stats = Arc::new(SchedStats::default());
    let pending = Arc::new(Pending(
        (0..n)
            .map(|_| CachePadded::new(AtomicBool::new(false)))
            .collect(),
    ));
    let booster = Booster::with_events(n, FifoBoost::default(), stats.clone()).with_budget(budget);
    let vm = Arc::new(Vm {
        sched: Scheduler::new(n, policy, booster, pending.clone()),
        pending,
        acks: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
    });
    let handles: Vec<_> = (1..n)
        .map(|t| {
            let vm = vm.clone();
            thread::spawn(move || vm.target(t, window))
        })
        .collect();
    let threads: Vec<Thread> = handles.iter().map(|h| h.thread().clone()).collect();
    vm.sched.booster().register(0, current_tid());
    let hog_start = hogs.iterations();
    let sender_start = thread_cpu();
    let (start, mut rounds) = (Instant::now(), 0u64);
    while start.elapsed().as_secs_f64() < secs {
        vm.round(&threads);
        rounds += 1;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let hog_iterations = hogs.iterations() - hog_start;
    vm.stop.store(true, SeqCst);
    for (t, th) in threads.iter().enumerate() {
        vm.pending.0[t + 1].store(true, SeqCst);
        th.unpark();
    }
    let sender_cpu = thread_cpu() - sender_start;
    let targets_cpu: Duration = handles.into_iter().map(|h| h.join().unwrap()).sum();
    Run {
        rounds_per_s: rounds as f64 / elapsed,
        hog_rate: hog_iterations as f64 / elapsed / 1e6,
        revoked: stats.boosts_revoked.load(SeqCst),
        boosted_ms_per_s: stats.boost_ns.load(SeqCst) as f64 / 1e6 / elapsed,
        vm_cpus: (sender_cpu + targets_cpu).as_secs_f64() / elapsed,
    }
}

/// A configuration: vCPUs, hog threads, spin window in µs.
type Config = (usize, usize, u64);

const USAGE: &str = "usage: overcommit [SECONDS_PER_RUN [VCPUS HOGS SPIN_US]]";

/// The seconds per run, and the configurations: every one of the README's
/// table, or the one named on the command line.
fn parse_args(args: &[String], cores: usize) -> Result<(f64, Vec<Config>), String> {
    let secs = match args.first().map(|s| s.parse::<f64>()) {
        None => 0.5,
        Some(Ok(s)) if s > 0.0 => s,
        Some(_) => {
            return Err(format!(
                "SECONDS_PER_RUN must be a positive number\n{USAGE}"
            ));
        }
    };
    let number = |i: usize, what: &str| {
        args[i]
            .parse::<u64>()
            .map_err(|_| format!("{what} must be a whole number, got {:?}\n{USAGE}", args[i]))
    };
    let configs = match args.len() {
        0 | 1 => {
            let mut all = Vec::new();
            for n in [4, 8] {
                for h in [0, cores] {
                    all.extend([0, 50, 500].map(|w| (n, h, w)));
                }
            }
            all
        }
        4 => {
            let n = number(1, "VCPUS")? as usize;
            if n < 2 {
                return Err(format!(
                    "VCPUS must be at least 2 (a sender and a target)\n{USAGE}"
                ));
            }
            vec![(n, number(2, "HOGS")? as usize, number(3, "SPIN_US")?)]
        }
        _ => return Err(USAGE.to_string()),
    };
    Ok((secs, configs))
}

fn main() {
    let cores = thread::available_parallelism().map_or(2, |n| n.get());
    let args: Vec<String> = results::args().collect();
    let (secs, configs) = parse_args(&args, cores).unwrap_or_else(|e| {
        eprintln!("overcommit: {e}");
        std::process::exit(2);
    });
    if let Err(e) = FifoBoost::default().check() {
        eprintln!("overcommit: {e}; the boosting policies need it");
        std::process::exit(1);
    }
    let whole_table = args.len() <= 1;
    let mut out = format!(
        "{cores} cores, {secs} s per run, median of {ROUNDS} rounds taking turns between policies\n\n\
         | vCPUs | hogs | spin window | policy | rounds/s | vs NoBoost | hog M it/s | hogs vs NoBoost | VM CPUs | boosted ms/s | boosts revoked |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    print!("{out}");
    for config in configs {
        let rows = rows(config, secs);
        print!("{rows}");
        out.push_str(&rows);
    }
    if whole_table {
        write_results(&out);
    }
}

/// The whole table goes to the crate's RESULTS.md, section "overcommit",
/// with the command and the machine.
fn write_results(table: &str) {
    let command = results::command("cargo run --release -p vcpu-sched --example overcommit");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    results::write_section_if_asked(&path, "vcpu-sched", "overcommit", &command, table);
}

/// Runs every policy in turn on one configuration; returns its table rows.
fn rows((n, h, window_us): Config, secs: f64) -> String {
    let window = Duration::from_micros(window_us);
    let hogs = Hogs::start(h);
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); policies().len()];
    for _ in 0..ROUNDS {
        for (i, (_, p, budget)) in policies().into_iter().enumerate() {
            runs[i].push(run(p, budget, n, window, secs, &hogs));
        }
    }
    drop(hogs);
    let base_rounds = median(runs[0].iter().map(|r| r.rounds_per_s));
    let base_hogs = median(runs[0].iter().map(|r| r.hog_rate));
    let mut out = String::new();
    for ((name, _, _), r) in policies().into_iter().zip(&runs) {
        let rounds = median(r.iter().map(|r| r.rounds_per_s));
        let hog = median(r.iter().map(|r| r.hog_rate));
        let hog_ratio = if h == 0 {
            "-".to_string()
        } else {
            format!("{:.2}x", hog / base_hogs)
        };
        let boosted = median(r.iter().map(|r| r.boosted_ms_per_s));
        let vm_cpus = median(r.iter().map(|r| r.vm_cpus));
        out.push_str(&format!(
            "| {n} | {h} | {window_us} µs | {name} | {rounds:.0} | {:.2}x | {hog:.0} | {hog_ratio} | {vm_cpus:.2} | {boosted:.1} | {} |\n",
            rounds / base_rounds,
            r.iter().map(|r| r.revoked).sum::<u64>()
        ));
    }
    out
}
