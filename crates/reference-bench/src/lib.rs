//! Each mechanism of the vm-latency crates measured end to end on real KVM,
//! through the reference VMM, against its baseline, in one process run: the
//! scenarios of `reference-bench`.
//!
//! Every scenario runs its guest program once per variant (and, without
//! `--quick`, several times, alternating, reporting medians), and returns a
//! [`Table`] with ratios to the baseline measured in the same run.

#![deny(missing_docs)]
// A program's harness: its types hold runs and reports whose Debug output
// would say nothing; the Debug requirement is for the five published crates.
#![allow(missing_debug_implementations)]

pub mod cloud_hypervisor;
pub mod cloud_hypervisor_api;
pub mod compare;
pub mod dirty;
pub mod firecracker;
pub mod firecracker_api;
pub mod halt;
pub mod host;
pub mod integrations;
pub mod migrate;
pub mod peer;
pub mod peer_run;
pub mod plot;
pub mod qemu;
pub mod rcu;
pub mod runs;
pub mod sched;
pub mod snapshot;
pub mod stop;
pub mod summary;
pub mod table;
pub mod timer;
pub mod wake_probe;

use std::path::Path;
use std::time::{Duration, Instant};

use reference_vmm::VmMemory;

pub use host::HostLoad;
pub use runs::{Runs, goal};
pub use summary::summary;
pub use table::{Cell, Table};

/// Why a scenario gave no table.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The VMM failed a run.
    #[error(transparent)]
    Vm(#[from] reference_vmm::Error),
    /// A migration failed.
    #[error(transparent)]
    Migration(#[from] migration::MigrationError),
    /// A peer VMM gave no result.
    #[error(transparent)]
    Peer(#[from] peer_run::PeerError),
    /// An image file could not be built.
    #[error(transparent)]
    Image(#[from] test_guests::ImageError),
    /// An image file could not be written.
    #[error("cannot write the image file {path}: {source}")]
    WriteImage {
        /// Where.
        path: std::path::PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The host timer `timer` measures the host's wake-up with failed.
    #[error("the bench's host timer failed: {0}")]
    HostTimer(#[source] std::io::Error),
    /// Dirty logging failed (`dirty`).
    #[error("dirty logging: {0}")]
    DirtyLog(#[from] dirty_log::Error),
    /// Guest memory could not be read after a run.
    #[error("cannot read {what} from guest memory: {source}")]
    ReadMemory {
        /// What was being read.
        what: &'static str,
        /// Why it failed.
        #[source]
        source: vm_memory::GuestMemoryError,
    },
    /// The two hosts of `migrate`'s link could not be used (a namespace
    /// that cannot be entered, a thread that panicked).
    #[error("the migration link: {0}")]
    Link(String),
    /// A process or thread of the bench could not be started.
    #[error("cannot start the {thread}: {source}")]
    Spawn {
        /// Which.
        thread: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A thread of the bench panicked: a bug.
    #[error("the {0} thread panicked")]
    ThreadPanicked(&'static str),
}

use crate::cloud_hypervisor::CloudHypervisor;
use crate::firecracker::Firecracker;
use crate::peer_run::PeerBinary;
use crate::qemu::Qemu;
use reference_vmm::{RunReport, Vm, VmConfig};
use reference_vmm_cli::presets::Choices;
use test_guests::layout::PARAMS;
use test_guests::programs as guest;

/// How much to measure, and with which peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options<'a> {
    /// Few rounds, one repetition: a check that everything runs, in seconds.
    pub quick: bool,
    /// The QEMU binary for the peer rows; `None`: `qemu-system-x86_64` on
    /// `PATH`, if there is one.
    pub qemu: Option<&'a Path>,
    /// The Cloud Hypervisor binary for its rows; `None`: `cloud-hypervisor`
    /// on `PATH` or in the folder `VM_LATENCY_PEERS` names, if either has it.
    pub cloud_hypervisor: Option<&'a Path>,
    /// The Firecracker binary for its rows; `None`: as Cloud Hypervisor's.
    pub firecracker: Option<&'a Path>,
    /// Cloud Hypervisor built with the patches in
    /// `integrations/cloud-hypervisor/`, for the `integrations` rows.
    pub patched_cloud_hypervisor: Option<&'a Path>,
    /// Firecracker built with the patches in `integrations/firecracker/`,
    /// for the `fc-snapshot` rows.
    pub patched_firecracker: Option<&'a Path>,
    /// Run only the variants whose row's name holds this (any case):
    /// ratios and goals that need other rows then have no figure.
    pub only: Option<&'a str>,
}

impl Options<'_> {
    /// Whether the variant whose row is named `row` runs ([`Self::only`]).
    pub fn runs(&self, row: &str) -> bool {
        self.only
            .is_none_or(|only| row.to_lowercase().contains(&only.to_lowercase()))
    }

    /// QEMU for the peer rows: the binary given, else the one on `PATH`;
    /// without either the rows are skipped, with a note saying how to
    /// install it.
    pub fn qemu(&self) -> Option<Qemu> {
        self.qemu.map(Qemu::at).or_else(Qemu::find)
    }

    /// Cloud Hypervisor for its rows: the binary given, else one found;
    /// without either the rows are skipped, with a note saying how to get it.
    pub fn cloud_hypervisor(&self) -> Option<CloudHypervisor> {
        let given = self.cloud_hypervisor.map(CloudHypervisor::at);
        given.or_else(CloudHypervisor::find)
    }

    /// Firecracker for its rows, as [`cloud_hypervisor`](Self::cloud_hypervisor).
    pub fn firecracker(&self) -> Option<Firecracker> {
        self.firecracker
            .map(Firecracker::at)
            .or_else(Firecracker::find)
    }

    /// Repetitions of each variant.
    pub fn reps(&self) -> usize {
        if self.quick { 1 } else { 3 }
    }

    /// `full` rounds, or a tenth of them with `--quick`.
    pub fn rounds(&self, full: u64) -> u64 {
        if self.quick { (full / 10).max(1) } else { full }
    }
}

/// A guest program's run, with what it cost the host.
pub struct Measured {
    /// What the program reported.
    pub report: RunReport,
    /// Its memory after the run.
    pub memory: VmMemory,
    /// Host CPU time of the whole process during the run.
    pub cpu: Duration,
    /// Wall time of the run.
    pub wall: Duration,
}

/// Runs `program` on `vcpus` vCPUs with `choices` and `params`.
pub fn measure(
    program: &str,
    vcpus: u32,
    choices: Choices,
    params: &[u64],
    prepare: impl FnOnce(&mut Vm),
) -> Result<Measured, Error> {
    measure_config(program, config(vcpus, choices, params), prepare)
}

/// The configuration [`measure`] runs: a 300 s watchdog, `params` first.
pub fn config(vcpus: u32, choices: Choices, params: &[u64]) -> VmConfig {
    let mut config = choices.config(VmConfig {
        vcpus,
        timeout: Some(Duration::from_secs(300)),
        ..VmConfig::default()
    });
    let n = params.len().min(PARAMS);
    config.params[..n].copy_from_slice(&params[..n]);
    config
}

/// Runs `program` as `config` says.
pub fn measure_config(
    program: &str,
    config: VmConfig,
    prepare: impl FnOnce(&mut Vm),
) -> Result<Measured, Error> {
    let mut vm = Vm::new(&config)?;
    prepare(&mut vm);
    let memory = vm.memory();
    let program = guest::find(program).expect("bench programs are built in");
    let (cpu0, start) = (cpu_time(), Instant::now());
    let report = vm.run(program, Box::new(std::io::sink()))?;
    Ok(Measured {
        report,
        memory,
        cpu: cpu_time().saturating_sub(cpu0),
        wall: start.elapsed(),
    })
}

/// User plus system CPU time of this process so far.
pub fn cpu_time() -> Duration {
    rusage_time(libc::RUSAGE_SELF)
}

/// User plus system CPU time of `who` (`RUSAGE_SELF`, `RUSAGE_CHILDREN`).
fn rusage_time(who: libc::c_int) -> Duration {
    // SAFETY: rusage is plain data that getrusage fills.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid `who` and a pointer to a rusage we own.
    unsafe { libc::getrusage(who, &mut usage) };
    let tv = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// CPU time of this process and of the children it has waited for.
pub fn cpu_time_with_children() -> Duration {
    cpu_time() + rusage_time(libc::RUSAGE_CHILDREN)
}

/// Guest TSC ticks per µs.
pub fn ticks_per_us() -> f64 {
    lapic_timer::TscClock::shared().tsc_khz() as f64 / 1000.0
}

/// The Markdown report of a run: the command, the machine, how busy the
/// host was, how long each scenario took (`times`, by name: the next run's
/// estimate, [`scenario_times`]), the goals against the peer VMMs
/// ([`summary()`]), and every table with its plots (their files in the
/// folder `plots`, relative to the report).
pub fn report(
    tables: &[Table],
    command: &str,
    took: Duration,
    host: &str,
    times: &[(String, Duration)],
    plots: &str,
    compared: &str,
) -> String {
    let mut out = summary(tables);
    let how = format!(
        "The workspace's mechanisms measured end to end on real KVM, each against its baseline \
         in the same run: through the reference VMM, or inside a peer VMM the patches in \
         integrations/ put them in. Each goal above gives the median and its min-max over the \
         runs; the tables below have the figures. Command: `{command}` ({:.0} s). Machine: {}. \
         Runs alternate between variants, and ratios compare variants of the same run.",
        took.as_secs_f64(),
        host::machine(),
    );
    out.push_str(&format!(
        "{}\n\n{}\n\n{}\n\n",
        table::wrap(&how),
        table::wrap(host),
        times_line(times)
    ));
    out.push_str(compared);
    for t in tables {
        out.push_str(&t.markdown());
        out.push('\n');
        out.push_str(&t.plot_links(plots));
    }
    out
}

/// The JSON of a report's tables, beside it: `all.json` beside `all.md`
/// (a JSON report is its own).
pub fn json_beside(report: &std::path::Path) -> std::path::PathBuf {
    report.with_extension("json")
}

/// The folder of a report's plots, beside it: `all.md`'s are in
/// `all-plots/`.
pub fn plots_folder(report: &std::path::Path) -> std::path::PathBuf {
    let stem = report.file_stem().unwrap_or_default().to_string_lossy();
    report.with_file_name(format!("{stem}-plots"))
}

/// Writes each table's plots into `folder` (made afresh: plots of an
/// earlier run do not linger).
pub fn write_plots(folder: &std::path::Path, tables: &[Table]) -> std::io::Result<()> {
    if folder.is_dir() {
        std::fs::remove_dir_all(folder)?;
    }
    let plots: Vec<_> = tables.iter().flat_map(|t| &t.plots).collect();
    if plots.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(folder)?;
    for plot in plots {
        std::fs::write(folder.join(format!("{}.svg", plot.name)), &plot.svg)?;
    }
    Ok(())
}

/// How a report's line of scenario times begins.
const TIMES: &str = "Scenario times:";

/// `Scenario times: halt 120 s, timer 80 s.`
fn times_line(times: &[(String, Duration)]) -> String {
    let each: Vec<String> = times
        .iter()
        .map(|(name, took)| format!("{name} {:.0} s", took.as_secs_f64()))
        .collect();
    match each.is_empty() {
        true => format!("{TIMES} none finished."),
        false => format!("{TIMES} {}.", each.join(", ")),
    }
}

/// Each scenario's time in a [`report`], by name: what the next run can
/// expect of the same machine, idle. Empty where the report has none.
pub fn scenario_times(report: &str) -> Vec<(String, Duration)> {
    let Some(line) = report.lines().find_map(|l| l.strip_prefix(TIMES)) else {
        return Vec::new();
    };
    line.trim_end_matches('.')
        .split(',')
        .filter_map(|item| {
            let (name, secs) = item.trim().strip_suffix(" s")?.rsplit_once(' ')?;
            let secs = secs
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)?;
            Some((name.to_owned(), Duration::from_secs_f64(secs)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_gathers_its_goals_at_its_top() {
        let mut t = Table::new("timer: x", &["a"]);
        t.note("setup");
        t.peer_goal("Goal: g. Measured: 0.5x Firecracker's: met.");
        t.plot(crate::plot::cdf(
            "timer-x",
            "Lateness",
            "µs",
            &[("a".into(), vec![1.0])],
        ));
        t.plot(Err("nothing to plot".into()));
        let report = report(
            &[t.clone()],
            "bench",
            Duration::ZERO,
            "Host: -",
            &[],
            "all-plots",
            "",
        );
        let top = report.find("- timer, *met*: g. Measured: 0.5x Firecracker's: met.");
        let table = report.find("### timer: x");
        assert!(top.is_some() && top < table, "{report}");
        assert!(
            report.contains("![Lateness](all-plots/timer-x.svg)"),
            "{report}"
        );
        assert!(report.contains("No plot: nothing to plot."), "{report}");
        // Written beside the report, afresh each time.
        let dir = std::env::temp_dir().join(format!("bench-plots-{}", std::process::id()));
        let folder = plots_folder(&dir.join("all.md"));
        assert_eq!(folder, dir.join("all-plots"));
        std::fs::create_dir_all(&folder).unwrap();
        std::fs::write(folder.join("stale.svg"), "old").unwrap();
        write_plots(&folder, &[t]).unwrap();
        assert!(!folder.join("stale.svg").exists());
        let svg = std::fs::read_to_string(folder.join("timer-x.svg")).unwrap();
        assert!(svg.starts_with("<svg"));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_report_gives_each_scenarios_time_and_the_next_run_reads_it_back() {
        let times = vec![
            ("halt".to_owned(), Duration::from_secs(121)),
            ("migrate".to_owned(), Duration::from_millis(4_400)),
        ];
        let report = report(
            &[],
            "bench all",
            Duration::from_secs(126),
            "Host: -",
            &times,
            "all-plots",
            "",
        );
        assert!(
            report.contains("Scenario times: halt 121 s, migrate 4 s."),
            "{report}"
        );
        assert_eq!(
            scenario_times(&report),
            vec![
                ("halt".to_owned(), Duration::from_secs(121)),
                ("migrate".to_owned(), Duration::from_secs(4)),
            ]
        );
        assert!(scenario_times("# Benchmarks\nno times here").is_empty());
        let garbled = "Scenario times: halt x s, timer -3 s, rcu 7 s.";
        assert_eq!(
            scenario_times(garbled),
            vec![("rcu".to_owned(), Duration::from_secs(7))]
        );
    }
}
