//! `reference-bench`: each mechanism of the vm-latency crates measured end to
//! end on KVM against its baseline, through the reference VMM.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use clap::Parser;
use reference_bench as bench;

/// Measure each mechanism end to end against its baseline, and write the report.
#[derive(Clone, Debug, Parser)]
#[command(version, about)]
struct BenchArgs {
    /// The scenario.
    #[arg(value_enum)]
    scenario: Scenario,
    /// Print the results as JSON instead of Markdown tables.
    #[arg(long)]
    json: bool,
    /// Few rounds and one repetition: checks that everything runs.
    #[arg(long)]
    quick: bool,
    /// Where to write the report (Markdown, or JSON with --json) [default:
    /// target/bench/<SCENARIO>.md or .json in the workspace].
    #[arg(long, value_name = "PATH")]
    out: Option<PathBuf>,
    /// With `all`: also rewrite the workspace's BENCHMARKS.md with this run's
    /// Markdown report (not with --quick).
    #[arg(long)]
    update_benchmarks_md: bool,
    /// The QEMU binary for the peer rows [default: qemu-system-x86_64 on
    /// PATH; without it those rows are skipped, saying how to install it].
    #[arg(long, value_name = "PATH")]
    qemu: Option<PathBuf>,
    /// The Cloud Hypervisor binary for its rows [default: cloud-hypervisor on
    /// PATH, else in the folder VM_LATENCY_PEERS names; without it those rows
    /// are skipped, saying how to get it].
    #[arg(long, value_name = "PATH")]
    cloud_hypervisor: Option<PathBuf>,
    /// The Firecracker binary for its rows [default: as Cloud Hypervisor's].
    #[arg(long, value_name = "PATH")]
    firecracker: Option<PathBuf>,
    /// Cloud Hypervisor built with integrations/cloud-hypervisor/apply.sh,
    /// for `ch-halt`, `ch-migrate` and `ch-boost` [without it their goals say how to
    /// build it].
    #[arg(long, value_name = "PATH")]
    patched_cloud_hypervisor: Option<PathBuf>,
    /// Firecracker built with integrations/firecracker/apply.sh, for
    /// `fc-snapshot` [without it its goal says how to build it].
    #[arg(long, value_name = "PATH")]
    patched_firecracker: Option<PathBuf>,
    /// Compare each figure with this earlier run's (the JSON the bench
    /// writes beside a Markdown report, or a --json report; BENCHMARKS.json
    /// is BENCHMARKS.md's) [default: the earlier report at --out, if any].
    #[arg(long, value_name = "FILE")]
    baseline: Option<PathBuf>,
    /// Run only the variants whose row's name holds NAME (any case), in
    /// halt, timer, sched, migrate and snapshot (with `all`: only those);
    /// the goals, which need other rows, are left out.
    #[arg(long, value_name = "NAME")]
    only: Option<String>,
}

impl BenchArgs {
    /// What a reader would type to rerun this, with the peers' folder
    /// where it was given (`peers_dir`: `VM_LATENCY_PEERS`).
    fn command(&self, peers_dir: Option<&std::ffi::OsStr>) -> String {
        let env = match peers_dir {
            Some(dir) => format!(
                "{}={} ",
                bench::peer_run::PEERS_DIR,
                Path::new(dir).display()
            ),
            None => String::new(),
        };
        format!(
            "{env}cargo run --release -p reference-bench -- {}{}{}{}",
            self.scenario.name(),
            if self.quick { " --quick" } else { "" },
            if self.update_benchmarks_md {
                " --update-benchmarks-md"
            } else {
                ""
            },
            [
                ("--qemu", &self.qemu),
                ("--cloud-hypervisor", &self.cloud_hypervisor),
                ("--firecracker", &self.firecracker),
                ("--patched-cloud-hypervisor", &self.patched_cloud_hypervisor),
                ("--patched-firecracker", &self.patched_firecracker),
                ("--baseline", &self.baseline),
            ]
            .into_iter()
            .filter_map(|(flag, path)| Some(format!(" {flag} {}", path.as_ref()?.display())))
            .chain(self.only.as_ref().map(|name| format!(" --only {name:?}")))
            .collect::<String>()
        )
    }

    /// Where the report goes.
    fn out(&self) -> PathBuf {
        self.out.clone().unwrap_or_else(|| {
            let ext = if self.json { "json" } else { "md" };
            workspace_root()
                .join("target/bench")
                .join(format!("{}.{ext}", self.scenario.name()))
        })
    }

    /// The earlier run to compare with: `--baseline`, else the last report
    /// written where this one goes (`None`, with why, if there is none).
    fn baseline(&self) -> Result<Result<bench::compare::Baseline, String>, String> {
        match &self.baseline {
            Some(path) => bench::compare::Baseline::load(path).map(Ok),
            None => {
                let earlier = bench::json_beside(&self.out());
                Ok(match earlier.is_file() {
                    true => bench::compare::Baseline::load(&earlier),
                    false => Err(format!(
                        "No earlier report at {} to compare with (--baseline FILE names one; \
                         BENCHMARKS.json is BENCHMARKS.md's).",
                        earlier.display()
                    )),
                })
            }
        }
    }

    fn check(&self) -> Result<(), String> {
        if self.update_benchmarks_md && self.scenario != Scenario::All {
            return Err("--update-benchmarks-md is for `all`, whose report it is".into());
        }
        if self.update_benchmarks_md && self.quick {
            return Err("--update-benchmarks-md takes a full run, not --quick".into());
        }
        if self.only.is_some() && !self.scenario.takes_only() {
            return Err(format!(
                "--only is for halt, timer, sched, migrate and snapshot; {} runs whole",
                self.scenario.name()
            ));
        }
        if self.only.is_some() && self.update_benchmarks_md {
            return Err("--update-benchmarks-md takes every variant, not --only".into());
        }
        for (flag, path) in [
            ("--qemu", &self.qemu),
            ("--cloud-hypervisor", &self.cloud_hypervisor),
            ("--firecracker", &self.firecracker),
            ("--patched-cloud-hypervisor", &self.patched_cloud_hypervisor),
            ("--patched-firecracker", &self.patched_firecracker),
        ] {
            if let Some(path) = path.as_ref().filter(|p| !p.is_file()) {
                return Err(format!("{flag} {}: no such file", path.display()));
            }
        }
        Ok(())
    }
}

/// The workspace this binary was built in, where `target/` and
/// `BENCHMARKS.md` are.
fn workspace_root() -> PathBuf {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    crate_dir
        .ancestors()
        .nth(2)
        .unwrap_or(crate_dir)
        .to_path_buf()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Scenario {
    /// IPI ping-pong between halting vCPUs, per halt-poll policy.
    Halt,
    /// A guest cyclictest on the TSC-deadline timer, per timer-advance policy.
    Timer,
    /// IPIs to overcommitted vCPUs beside a CPU hog, per boost policy.
    Sched,
    /// Device-bus reads per exit and writer grace periods, per RCU mode.
    Rcu,
    /// dirty_log_perf_test per dirty-log backend.
    Dirty,
    /// Live migration per dirty-log backend and dirtying rate.
    Migrate,
    /// Snapshots of a guest that rewrote a tenth of its memory, beside
    /// Firecracker's full and diff snapshots.
    Snapshot,
    /// Every scenario, in this order.
    All,
    /// halt-poll's tuner inside Cloud Hypervisor, stock against patched
    /// (not in `all`: it needs --patched-cloud-hypervisor).
    ChHalt,
    /// dirty-log under Cloud Hypervisor's live migration, stock against
    /// patched (not in `all`: it needs --patched-cloud-hypervisor).
    ChMigrate,
    /// vcpu-sched's delivery boost on Cloud Hypervisor's MSI routes, beside
    /// two CPU hogs, stock against patched (not in `all`: it needs
    /// --patched-cloud-hypervisor).
    ChBoost,
    /// ch-halt, ch-migrate and ch-boost: integrations/cloud-hypervisor/RESULTS.md.
    CloudHypervisor,
    /// Firecracker's diff snapshots from dirty-log, stock against patched
    /// (not in `all`: it needs --patched-firecracker).
    FcSnapshot,
}

impl Scenario {
    /// Whether its variants can be chosen with `--only`.
    fn takes_only(self) -> bool {
        matches!(
            self,
            Self::Halt | Self::Timer | Self::Sched | Self::Migrate | Self::Snapshot | Self::All
        )
    }

    /// As typed on the command line.
    fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map_or_else(String::new, |v| v.get_name().to_owned())
    }
}

fn main() -> ExitCode {
    match bench(BenchArgs::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("error: {}", failure.message);
            failure.status
        }
    }
}

/// Why the bench ended early, with its exit status.
struct Failure {
    status: ExitCode,
    message: String,
}

impl Failure {
    /// A command line that parses but cannot be run: clap's status, 2.
    fn usage(message: String) -> Self {
        Self {
            status: ExitCode::from(2),
            message,
        }
    }

    /// A run that failed.
    fn run(message: String) -> Self {
        Self {
            status: ExitCode::FAILURE,
            message,
        }
    }
}

/// What a run has to report so far: the scenarios that finished, their
/// times, and the one running.
struct Finished {
    tables: Vec<bench::Table>,
    times: Vec<(String, Duration)>,
    running: String,
    /// The earlier run its figures are compared with, or why there is none.
    baseline: Result<bench::compare::Baseline, String>,
}

/// The report of `finished` (Markdown, its plots in `plots`), and what
/// goes to stdout and the report file (that, or JSON with `--json`).
fn render(
    args: &BenchArgs,
    finished: &Finished,
    took: Duration,
    note: &str,
    plots: &Path,
) -> (String, String) {
    let folder = plots.file_name().unwrap_or_default().to_string_lossy();
    let compared = match &finished.baseline {
        Ok(baseline) => baseline.section(&finished.tables),
        Err(why) => format!("{why}\n\n"),
    };
    let markdown = bench::report(
        &finished.tables,
        &args.command(std::env::var_os(bench::peer_run::PEERS_DIR).as_deref()),
        took,
        note,
        &finished.times,
        &folder,
        &compared,
    );
    let output = if args.json {
        let items: Vec<_> = finished.tables.iter().map(bench::Table::json).collect();
        serde_json::to_string_pretty(&items).unwrap_or_default() + "\n"
    } else {
        markdown.clone()
    };
    (markdown, output)
}

/// On Ctrl-C or SIGTERM: once the run's child processes, namespaces and
/// temporary files are gone, writes the report of what finished and exits
/// with 128 + the signal.
fn stop_writing_what_finished(
    args: &BenchArgs,
    finished: Arc<Mutex<Finished>>,
    start: Instant,
) -> Result<(), Failure> {
    let args = args.clone();
    let stop = move |signal: i32| {
        let finished = finished.lock().unwrap_or_else(PoisonError::into_inner);
        let note = format!(
            "Stopped by {} during {} after {:.0} s: the tables below are the scenarios that \
             finished.",
            bench::stop::name(signal),
            finished.running,
            start.elapsed().as_secs_f64()
        );
        let path = args.out();
        let (_, output) = render(
            &args,
            &finished,
            start.elapsed(),
            &note,
            &bench::plots_folder(&path),
        );
        match write_report(&path, &output, &finished.tables) {
            Ok(()) => eprintln!("wrote {} (the scenarios that finished)", path.display()),
            Err(e) => eprintln!("cannot write {}: {e}", path.display()),
        }
        std::process::exit(128 + signal);
    };
    bench::stop::on_stop(stop).map_err(|e| Failure::run(format!("cannot watch for Ctrl-C: {e}")))
}

/// Runs the scenarios `args` names, prints the report and writes it.
fn bench(args: BenchArgs) -> Result<(), Failure> {
    args.check().map_err(Failure::usage)?;
    let opts = bench::Options {
        quick: args.quick,
        qemu: args.qemu.as_deref(),
        cloud_hypervisor: args.cloud_hypervisor.as_deref(),
        firecracker: args.firecracker.as_deref(),
        patched_cloud_hypervisor: args.patched_cloud_hypervisor.as_deref(),
        patched_firecracker: args.patched_firecracker.as_deref(),
        only: args.only.as_deref(),
    };
    let start = Instant::now();
    let whole_run = bench::HostLoad::start();
    let finished = Arc::new(Mutex::new(Finished {
        tables: Vec::new(),
        times: Vec::new(),
        running: String::new(),
        baseline: args.baseline().map_err(Failure::usage)?,
    }));
    stop_writing_what_finished(&args, finished.clone(), start)?;
    let lock = || finished.lock().unwrap_or_else(PoisonError::into_inner);
    let mut progress = |what: &str| eprintln!("[{:6.1} s] {what}", start.elapsed().as_secs_f64());
    let scenarios: &[Scenario] = match args.scenario {
        // Every scenario, in the order they are declared.
        Scenario::All => &<Scenario as clap::ValueEnum>::value_variants()[..Scenario::All as usize],
        Scenario::CloudHypervisor => &[Scenario::ChHalt, Scenario::ChMigrate, Scenario::ChBoost],
        _ => std::slice::from_ref(&args.scenario),
    };
    let chosen: Vec<Scenario> = scenarios
        .iter()
        .copied()
        .filter(|s| args.only.is_none() || s.takes_only())
        .collect();
    let scenarios = &chosen[..];
    let mut estimate = Estimate::from_benchmarks_md(scenarios, args.quick);
    eprintln!("{}", estimate.before());
    let mut failed = None;
    for (done, scenario) in scenarios.iter().enumerate() {
        let host = bench::HostLoad::start();
        let began = Instant::now();
        let name = scenario.name();
        lock().running = name.clone();
        let table = match scenario {
            Scenario::Halt => bench::halt::run(opts, &mut progress),
            Scenario::Timer => bench::timer::run(opts, &mut progress),
            Scenario::Sched => bench::sched::run(opts, &mut progress),
            Scenario::Rcu => bench::rcu::run(opts, &mut progress),
            Scenario::Dirty => bench::dirty::run(opts, &mut progress),
            Scenario::Migrate => bench::migrate::run(opts, &mut progress),
            Scenario::Snapshot => bench::snapshot::run(opts, &mut progress),
            Scenario::ChHalt => bench::integrations::ch_halt(opts, &mut progress),
            Scenario::ChMigrate => bench::integrations::ch_migrate(opts, &mut progress),
            Scenario::ChBoost => bench::integrations::ch_boost(opts, &mut progress),
            Scenario::FcSnapshot => bench::integrations::fc_snapshot(opts, &mut progress),
            Scenario::All | Scenario::CloudHypervisor => unreachable!("expanded above"),
        };
        match table {
            Ok(mut t) => {
                if let Some(only) = &args.only {
                    leave_out_goals(&mut t, only);
                }
                t.note(host.note());
                // The tables as each scenario finishes; the report at the end.
                eprintln!("\n{}", t.markdown());
                let mut finished = lock();
                finished.tables.push(t);
                finished.times.push((name.clone(), began.elapsed()));
                drop(finished);
                progress(&estimate.after(&name, began.elapsed(), &scenarios[done + 1..]));
            }
            Err(e) => {
                failed = Some(format!("bench {name}: {e}"));
                break;
            }
        }
    }
    let mut host_note = whole_run.note();
    if let Some(e) = &failed {
        host_note.push_str(&format!(
            "\n\nIncomplete: {e}; the tables below are the scenarios that finished before it."
        ));
    }
    // Held to the end: a signal from here on waits for this report.
    let finished = lock();
    let took = start.elapsed();
    // Each report links the plots beside it.
    let at = |path: &Path| {
        render(
            &args,
            &finished,
            took,
            &host_note,
            &bench::plots_folder(path),
        )
    };
    let out = args.out();
    let (_, output) = at(&out);
    let mut files = vec![(out, output.clone())];
    // BENCHMARKS.md is the report of a whole run.
    if args.update_benchmarks_md && failed.is_none() {
        let path = workspace_root().join("BENCHMARKS.md");
        files.push((path.clone(), at(&path).0));
    }
    for (path, text) in files {
        write_report(&path, &text, &finished.tables)
            .map_err(|e| Failure::run(format!("cannot write {}: {e}", path.display())))?;
        eprintln!("wrote {}", path.display());
    }
    let printed = io::stdout().lock().write_all(output.as_bytes());
    match (failed, printed) {
        (Some(e), _) => Err(Failure::run(format!(
            "{e} (the report has the scenarios that finished)"
        ))),
        // Nobody is reading (e.g. `| head`): not worth an error message.
        (None, Err(e)) if e.kind() != io::ErrorKind::BrokenPipe => {
            Err(Failure::run(format!("cannot write to stdout: {e}")))
        }
        (None, _) => Ok(()),
    }
}

/// A table of a run with `--only`: its goals, which need rows that did
/// not run, are left out, saying so.
fn leave_out_goals(t: &mut bench::Table, only: &str) {
    t.notes.retain(|n| !n.starts_with("Goal"));
    t.peer_goals.clear();
    t.note(format!(
        "Run with --only {only}: only the rows named so ran, and the goals, which need the \
         others, are left out."
    ));
}

/// How long a bench run should take: each scenario's time in the
/// workspace's BENCHMARKS.md, the last full run's, on an idle machine.
struct Estimate {
    times: Vec<(String, Duration)>,
    quick: bool,
    /// The scenarios finished so far that BENCHMARKS.md times: the time
    /// they took, and the time they were estimated to take.
    finished: (Duration, Duration),
}

impl Estimate {
    fn from_benchmarks_md(scenarios: &[Scenario], quick: bool) -> Self {
        let report = std::fs::read_to_string(workspace_root().join("BENCHMARKS.md"));
        let known = bench::scenario_times(&report.unwrap_or_default());
        let times = scenarios
            .iter()
            .filter_map(|s| known.iter().find(|(n, _)| *n == s.name()).cloned())
            .collect();
        Self {
            times,
            quick,
            finished: (Duration::ZERO, Duration::ZERO),
        }
    }

    /// The time a scenario took in BENCHMARKS.md's run.
    fn of(&self, name: &str) -> Option<Duration> {
        self.times.iter().find(|(n, _)| n == name).map(|(_, d)| *d)
    }

    /// The line printed before the run starts.
    fn before(&self) -> String {
        match (self.quick, self.times.is_empty()) {
            (true, _) => "estimate: none for --quick (BENCHMARKS.md times full runs)".into(),
            (false, true) => "estimate: none (BENCHMARKS.md gives no scenario times)".into(),
            (false, false) => {
                let total: Duration = self.times.iter().map(|(_, d)| *d).sum();
                let each: Vec<String> = self
                    .times
                    .iter()
                    .map(|(n, d)| format!("{n} {:.0} s", d.as_secs_f64()))
                    .collect();
                format!(
                    "estimate: about {:.0} s ({}), as BENCHMARKS.md's run took on an idle machine; \
                     a busy or slower one takes longer",
                    total.as_secs_f64(),
                    each.join(", ")
                )
            }
        }
    }

    /// The line printed once scenario `name` has taken `took`, with `left`
    /// to go: the time left by the estimate, scaled by how the finished
    /// scenarios ran against theirs (a busy machine runs them all slower).
    fn after(&mut self, name: &str, took: Duration, left: &[Scenario]) -> String {
        let estimated = self.of(name).filter(|_| !self.quick);
        let expected = match estimated {
            Some(d) => {
                self.finished.0 += took;
                self.finished.1 += d;
                format!(" (estimate {:.0} s)", d.as_secs_f64())
            }
            None => String::new(),
        };
        let remaining: Option<Duration> = left.iter().map(|s| self.of(&s.name())).sum();
        let (ran, planned) = self.finished;
        let scale = match planned.is_zero() {
            true => 1.0,
            false => ran.as_secs_f64() / planned.as_secs_f64(),
        };
        let rest = match (left.len(), remaining.filter(|_| !self.quick)) {
            (0, _) => "; that was the last".to_owned(),
            (n, Some(d)) if (scale - 1.0).abs() >= 0.05 => format!(
                "; {n} to go, about {:.0} s: the estimate's {:.0} s times {scale:.2}, as the \
                 finished ones ran",
                d.as_secs_f64() * scale,
                d.as_secs_f64()
            ),
            (n, Some(d)) => format!(
                "; {n} to go, about {:.0} s by the estimate",
                d.as_secs_f64()
            ),
            (n, None) => format!("; {n} to go"),
        };
        format!("{name} done in {:.0} s{expected}{rest}", took.as_secs_f64())
    }
}

/// Writes the report and, beside it, its tables' plots and (beside a
/// Markdown one) its tables as JSON, for the next run to compare with.
fn write_report(path: &Path, text: &str, tables: &[bench::Table]) -> io::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(path, text)?;
    let json = bench::json_beside(path);
    if json != path {
        let items: Vec<_> = tables.iter().map(bench::Table::json).collect();
        std::fs::write(
            json,
            serde_json::to_string_pretty(&items).unwrap_or_default() + "\n",
        )?;
    }
    bench::write_plots(&bench::plots_folder(path), tables)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_adds_up_benchmarks_md_times_and_says_what_is_left() {
        let secs = Duration::from_secs;
        let times = vec![
            ("halt".to_owned(), secs(150)),
            ("timer".to_owned(), secs(120)),
        ];
        let estimate = |quick| Estimate {
            times: times.clone(),
            quick,
            finished: (Duration::ZERO, Duration::ZERO),
        };
        let mut full = estimate(false);
        assert_eq!(
            full.before(),
            "estimate: about 270 s (halt 150 s, timer 120 s), as BENCHMARKS.md's run took on an \
             idle machine; a busy or slower one takes longer"
        );
        assert_eq!(
            full.after("halt", secs(153), &[Scenario::Timer]),
            "halt done in 153 s (estimate 150 s); 1 to go, about 120 s by the estimate"
        );
        assert_eq!(
            full.after("timer", secs(130), &[]),
            "timer done in 130 s (estimate 120 s); that was the last"
        );
        // A scenario that ran twice as long as its estimate doubles the rest.
        let mut slow = estimate(false);
        assert_eq!(
            slow.after("halt", secs(300), &[Scenario::Timer]),
            "halt done in 300 s (estimate 150 s); 1 to go, about 240 s: the estimate's 120 s \
             times 2.00, as the finished ones ran"
        );
        // A scenario BENCHMARKS.md does not time leaves the rest unestimated.
        assert_eq!(
            full.after("halt", secs(1), &[Scenario::Rcu]),
            "halt done in 1 s (estimate 150 s); 1 to go"
        );
        let mut quick = estimate(true);
        assert!(quick.before().starts_with("estimate: none for --quick"));
        assert_eq!(
            quick.after("halt", secs(3), &[Scenario::Timer]),
            "halt done in 3 s; 1 to go"
        );
        let none = Estimate {
            times: Vec::new(),
            quick: false,
            finished: (Duration::ZERO, Duration::ZERO),
        };
        assert!(
            none.before()
                .contains("BENCHMARKS.md gives no scenario times")
        );
    }

    #[test]
    fn the_command_is_what_reruns_it() {
        let args = BenchArgs::parse_from([
            "reference-bench",
            "sched",
            "--quick",
            "--qemu",
            "/bin/false",
        ]);
        assert_eq!(
            args.command(None),
            "cargo run --release -p reference-bench -- sched --quick --qemu /bin/false"
        );
        assert_eq!(
            args.command(Some("../shared/peers".as_ref())),
            "VM_LATENCY_PEERS=../shared/peers cargo run --release -p reference-bench -- sched \
             --quick --qemu /bin/false"
        );
        assert!(
            args.out().ends_with("target/bench/sched.md"),
            "{}",
            args.out().display()
        );
        let json = BenchArgs::parse_from(["reference-bench", "all", "--json"]);
        assert!(json.out().ends_with("target/bench/all.json"));
        let only = ["reference-bench", "halt", "--only", "kvm's lapic"];
        let only = BenchArgs::parse_from(only.into_iter().chain(["--baseline", "B.json"]));
        assert_eq!(
            only.command(None),
            "cargo run --release -p reference-bench -- halt --baseline B.json --only \"kvm's \
             lapic\""
        );
        assert!(only.check().is_ok());
        let rcu = BenchArgs::parse_from(["reference-bench", "rcu", "--only", "x"]);
        assert!(rcu.check().unwrap_err().contains("--only is for halt"));
    }
}
