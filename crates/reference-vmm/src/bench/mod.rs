//! `reference-vmm bench`: each mechanism measured end to end on real KVM,
//! against its baseline, in one process run.
//!
//! Every scenario runs its guest program once per variant (and, without
//! `--quick`, several times, alternating, reporting medians), and returns a
//! [`Table`] with ratios to the baseline measured in the same run.

pub mod dirty;
pub mod halt;
pub mod host;
pub mod migrate;
pub mod peer;
pub mod rcu;
pub mod runs;
pub mod sched;
pub mod table;
pub mod timer;

use std::path::Path;
use std::time::{Duration, Instant};

use crate::vm::VmMemory;

pub use host::HostLoad;
pub use runs::{Runs, goal};
pub use table::{Cell, Table};

use crate::error::Error;
use crate::mechanisms::Mechanisms;
use crate::qemu::Qemu;
use crate::vm::{RunReport, Vm, VmConfig};
use crate::{guest, layout::PARAMS};

/// How much to measure, and with which peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Options<'a> {
    /// Few rounds, one repetition: a check that everything runs, in seconds.
    pub quick: bool,
    /// The QEMU binary for the peer rows; `None`: `qemu-system-x86_64` on
    /// `PATH`, if there is one.
    pub qemu: Option<&'a Path>,
}

impl Options<'_> {
    /// QEMU for the peer rows: the binary given, else the one on `PATH`;
    /// without either the rows are skipped, with a note saying how to
    /// install it.
    pub fn qemu(&self) -> Option<Qemu> {
        self.qemu.map(Qemu::at).or_else(Qemu::find)
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

/// Runs `program` on `vcpus` vCPUs with `mechanisms` and `params`.
pub fn measure(
    program: &str,
    vcpus: u32,
    mechanisms: Mechanisms,
    params: &[u64],
    prepare: impl FnOnce(&mut Vm),
) -> Result<Measured, Error> {
    let mut config = VmConfig {
        vcpus,
        timeout: Some(Duration::from_secs(300)),
        mechanisms,
        ..VmConfig::default()
    };
    config.params[..params.len().min(PARAMS)].copy_from_slice(&params[..params.len().min(PARAMS)]);
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
/// host was, and every table.
pub fn report(tables: &[Table], command: &str, took: Duration, host: &str) -> String {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mut out = format!(
        "# Benchmarks\n\nEvery mechanism of the workspace measured end to end on real KVM by the \
         reference VMM, each against its baseline in the same run.\n\n\
         Command: `{command}` ({:.0} s).\n\n\
         Machine: {cores} cores; KVM is PVM (software virtualization with a shadow MMU, itself \
         nested in a microVM), where guest CPL0 code is emulated one instruction at a time, so \
         every interrupt handler, EOI and halt costs tens of microseconds and guest hot loops run at \
         CPL3. The machine is shared: runs alternate between variants, and ratios compare \
         variants of the same run.\n\n{host}\n\n",
        took.as_secs_f64()
    );
    for t in tables {
        out.push_str(&t.markdown());
        out.push('\n');
    }
    out
}
