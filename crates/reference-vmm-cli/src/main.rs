//! `reference-vmm`: runs built-in guest programs on KVM.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::str::FromStr;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use apic_conformance::{self as conformance, DEFAULT_OPS};
use clap::{Parser, Subcommand};
use migration::{
    self, AcceptLimits, Address, DirtyLogBackend, Fetching, HANDSHAKE_TIMEOUT, MAX_HANDSHAKES,
    MigrateOptions, Migration, MigrationError, MigrationReport, Mover, Postcopy, Progress, Resume,
    StreamReader, Target,
};
use reference_vmm::{Boot, CpuFeatures, Error, MAX_REPORTS, StopHandle, StopReason, Vm, VmConfig};
use reference_vmm::{Irqchip, TimerPlacement};
use reference_vmm_cli::presets::{Boost, Choices, HaltPoll, Presets, TimerAdvance};
use test_guests::ProgramError;
use test_guests::apic_script::{MAX_OPS, Mode};
use test_guests::layout::{MAX_VCPUS, PARAMS};
use test_guests::layout::{check_mem_mib, check_vcpus};
use test_guests::programs::{self as guest, GuestProgram, PROGRAMS};
use test_guests::pvh::{Image, ImageError};

mod control;

/// A reference VMM on real KVM for the vm-latency crates.
#[derive(Debug, Parser)]
#[command(
    name = "reference-vmm",
    version,
    about = "A thin VMM on real KVM that composes the vm-latency crates and benchmarks each mechanism end to end",
    disable_help_subcommand = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a built-in guest program on every vCPU.
    Run(Box<RunArgs>),
    /// Receive a VM from `run --migrate-to` and run it on.
    Receive(ReceiveArgs),
    /// Run on a VM saved by `run --snapshot-to`.
    Restore(RestoreArgs),
    /// Send one command to a running VM's control socket (`run --control`)
    /// and print its answer, a JSON object; exit 1 if it failed.
    Control(ControlArgs),
    /// Write a guest program as an ELF image with a PVH entry, which QEMU
    /// boots with -kernel and `run --image` boots here.
    Image(ImageArgs),
    /// List the built-in guest programs.
    Guests,
    /// Print the CPU features this host's KVM offers a guest, as a
    /// baseline file for `run --cpu-baseline`.
    CpuFeatures,
    /// Run the conformance guest's local-APIC sequences on this VMM's APIC
    /// and on KVM's, and print the first difference (exit 1) or none.
    Conformance(ConformanceArgs),
    /// Print this message or the help of the given subcommand.
    Help(HelpArgs),
}

#[derive(Debug, clap::Args)]
struct HelpArgs {
    /// The subcommand to explain.
    #[arg(value_parser = ["run", "receive", "restore", "control", "image", "guests", "cpu-features", "conformance"])]
    command: Option<String>,
}

#[derive(Debug, clap::Args)]
struct ControlArgs {
    /// The control socket (`run --control PATH`).
    socket: PathBuf,
    /// status, stats, pause, resume, snapshot (with path=FILE, and
    /// kind=incremental for the pages written since the last snapshot) or
    /// migrate (with to=unix:PATH or to=tcp:IP:PORT).
    command: String,
    /// The command's fields, as NAME=VALUE.
    #[arg(value_name = "NAME=VALUE", value_parser = parse_field)]
    fields: Vec<(String, String)>,
    /// How long to wait for the answer (a migration's takes as long as it
    /// does).
    #[arg(long, value_name = "MS", default_value_t = 600_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: u64,
}

fn parse_field(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, value)) if !name.is_empty() => Ok((name.into(), value.into())),
        _ => Err(format!("{s:?} is not NAME=VALUE")),
    }
}

#[derive(Debug, clap::Args)]
struct ConformanceArgs {
    /// How many seeds, each one sequence of operations
    #[arg(long, default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// The first seed
    #[arg(long, default_value_t = 0)]
    first_seed: u64,
    /// Random operations per sequence
    #[arg(long, default_value_t = DEFAULT_OPS, value_parser = clap::value_parser!(u64).range(1..=MAX_OPS))]
    ops: u64,
    /// Through x2APIC MSRs, the xAPIC page, or both
    #[arg(long, default_value = "both", value_parser = ["x2apic", "xapic", "both"])]
    mode: String,
    /// Run every seed and list each operation that differed first in some
    /// seed, with how many and one example, instead of stopping at the first
    #[arg(long)]
    summary: bool,
    /// Instead, run the register accesses of each input in DIR (the
    /// `local_apic` fuzz target's corpus) on KVM's LAPIC and print their
    /// answers, for fuzz-corpus/local_apic.kvm
    #[arg(long, value_name = "DIR")]
    record_fuzz_corpus: Option<std::path::PathBuf>,
}

/// Clap's own `help` subcommand takes no options (`help --help` is an
/// error there); this one is an ordinary subcommand.
fn help(args: HelpArgs) -> ExitCode {
    let mut cli = <Cli as clap::CommandFactory>::command();
    cli.build(); // names each subcommand's usage after the binary
    let printed = match args
        .command
        .as_deref()
        .and_then(|c| cli.find_subcommand_mut(c))
    {
        Some(sub) => sub.print_long_help(),
        None => cli.print_long_help(),
    };
    match printed {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&format!("cannot write to stdout: {e}")),
    }
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    #[command(flatten)]
    program: ProgramArgs,
    /// Boot an image file (from `reference-vmm image`) through its PVH entry
    /// instead; its program, vCPUs, memory and parameters come from it.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["guest", "vcpus", "mem_mib", "params"])]
    image: Option<PathBuf>,
    #[command(flatten)]
    output: OutputArgs,
    #[command(flatten)]
    migrate: MigrateArgs,
    /// The floor on a periodic LAPIC timer's period, as KVM's
    /// `min_timer_period_us` (the userspace APIC only).
    #[arg(long, value_name = "US", default_value_t = 200)]
    min_timer_period_us: u64,
    /// Give the guest only the CPU features every one of these hosts has
    /// (files from `reference-vmm cpu-features` on each), so that it can
    /// move among them; a feature this host lacks is an error
    #[arg(long, value_name = "FILE")]
    cpu_baseline: Vec<PathBuf>,
    #[command(flatten)]
    mechanisms: MechanismArgs,
}

/// Where the guest's output goes and how long it may run.
#[derive(Debug, clap::Args)]
struct OutputArgs {
    /// Write the guest's serial output to this file instead of stdout.
    #[arg(long, value_name = "PATH")]
    serial_out: Option<PathBuf>,
    /// Stop every vCPU and fail if the guest has not finished after this long
    /// [default: a 600 s watchdog; programs that run until stopped need one given].
    /// SIGINT and SIGTERM stop the run the same way; either prints what the
    /// guest reported until then.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: Option<u64>,
    /// The most named values one vCPU may report; one more ends the run
    /// with an error (a bound on a guest that reports in a loop)
    #[arg(long, value_name = "N", default_value_t = MAX_REPORTS, value_parser = parse_max_reports)]
    max_reports: usize,
}

impl OutputArgs {
    fn serial_out(&self) -> Result<Box<dyn Write + Send>, String> {
        match &self.serial_out {
            Some(path) => File::create(path)
                .map(|f| Box::new(f) as Box<dyn Write + Send>)
                .map_err(|e| format!("cannot create {}: {e}", path.display())),
            None => Ok(Box::new(io::stdout())),
        }
    }

    fn timeout(&self) -> Option<Duration> {
        self.timeout_ms.map(Duration::from_millis)
    }

    /// What a received VM runs with beyond what its stream says: this
    /// host's default mechanisms, and the timeout.
    fn destination(&self) -> VmConfig {
        VmConfig {
            timeout: self.timeout(),
            max_reports: self.max_reports,
            ..VmConfig::default()
        }
    }
}

/// Live migration and snapshots of a running guest.
#[derive(Debug, clap::Args)]
#[command(group = clap::ArgGroup::new("moving").args(["migrate_to", "snapshot_to"]))]
#[command(group = clap::ArgGroup::new("live").args(["migrate_to", "control"]))]
struct MigrateArgs {
    /// Take commands on a Unix socket at PATH while the guest runs: one
    /// JSON object a line (`{"command": "status"}`; stats, pause, resume,
    /// `snapshot` with "path" and "kind", `migrate` with "to"), one answer
    /// a line.
    /// The migration options below apply to its migrations
    #[arg(long, value_name = "PATH", conflicts_with = "moving")]
    control: Option<PathBuf>,
    /// Migrate the running guest to a `reference-vmm receive` listening at
    /// unix:<path> or tcp:<ip>:<port>; this process exits 0 once the
    /// destination has it, and runs it on if the migration fails.
    #[arg(long, value_name = "ADDR", value_parser = <Address as FromStr>::from_str)]
    migrate_to: Option<Address>,
    #[command(flatten)]
    tls: TlsArgs,
    /// The name the destination's certificate must be for [default: the
    /// IP address of --migrate-to]
    #[arg(long, value_name = "NAME", requires = "tls_cert")]
    tls_server_name: Option<String>,
    /// Save the running guest to this file (pausing it, then ending it here);
    /// `reference-vmm restore` runs it on.
    #[arg(long, value_name = "PATH", conflicts_with = "migrate_to")]
    snapshot_to: Option<PathBuf>,
    /// How pre-copy tracks dirty pages: bitmap (KVM_GET_DIRTY_LOG), manual
    /// (manual protect, INITIALLY_SET, chunked clears), ring (the dirty ring).
    #[arg(long, default_value = "manual", requires = "live",
          value_parser = <DirtyLogBackend as FromStr>::from_str)]
    dirty_log: DirtyLogBackend,
    /// Start the migration or snapshot this long after the guest starts.
    #[arg(long, value_name = "MS", default_value_t = 200, requires = "moving")]
    migrate_after_ms: u64,
    /// Pre-copy ends once a round takes no longer than this.
    #[arg(long, value_name = "MS", default_value_t = 20, requires = "live")]
    downtime_ms: u64,
    /// Pre-copy ends after this many rounds (the full pass counts).
    #[arg(long, value_name = "N", default_value_t = 30, requires = "live",
          value_parser = clap::value_parser!(u32).range(1..))]
    max_rounds: u32,
    /// Pre-copy ends after this long, the full pass included, whatever the
    /// rounds left.
    #[arg(long, value_name = "MS", default_value_t = 60_000, requires = "live")]
    max_precopy_ms: u64,
    /// Past --max-rounds or --max-precopy-ms, stop and copy at once rather
    /// than go on under a dirty limit (with the ring on the writing vCPUs,
    /// with a bitmap on all)
    #[arg(long, requires = "live")]
    no_dirty_limit: bool,
    /// Give up the migration after this long, the guest running on here
    /// (post-copy: its pages after the hand-over get this long again, and
    /// past it the guest is lost)
    #[arg(long, value_name = "MS", default_value_t = 300_000, requires = "live",
          value_parser = clap::value_parser!(u64).range(1..))]
    migrate_timeout_ms: u64,
    /// Print each pre-copy round on stderr: pages, bandwidth, dirty rate,
    /// limit, the downtime a stop would take; text, or json (a JSON object
    /// per line, the outcome last)
    #[arg(long, value_name = "FORMAT", default_value = "off", default_missing_value = "text",
          num_args = 0..=1, requires = "live",
          value_parser = <Progress as FromStr>::from_str)]
    migrate_progress: Progress,
    /// Post-copy: run the guest at the destination before all its memory
    /// is there, the rest fetched as it faults and pushed meanwhile:
    /// hybrid (after pre-copy rounds, once one fits the downtime or gains
    /// nothing; no dirty limit) or immediate (at once). From the hand-over on, the guest
    /// needs both hosts: losing the source (or the link past
    /// --migrate-resume) loses it
    #[arg(long, value_name = "WHEN", default_value = "off", requires = "live",
          value_parser = <Postcopy as FromStr>::from_str)]
    postcopy: Postcopy,
    /// Post-copy: after a cut link, connect to the destination again (the
    /// same address, within --migrate-timeout-ms) and go on where it
    /// stopped; the destination must run `receive --resume`
    #[arg(long, requires = "live")]
    migrate_resume: bool,
}

impl MigrateArgs {
    /// Where the guest goes, if anywhere: TLS files are read here, so a bad
    /// one is an error before the guest starts.
    fn target(&self) -> Result<Option<Target>, String> {
        let tls = self.tls.files();
        match (&self.migrate_to, &self.snapshot_to) {
            (Some(address), _) => self.peer(address).map(Some),
            _ if self.control.is_some() => Ok(None),
            _ if tls.is_some() || self.tls.insecure => {
                Err("--tls-cert and --insecure are for --migrate-to and --control".into())
            }
            (None, Some(path)) => Ok(Some(Target::File(path.clone()))),
            (None, None) => Ok(None),
        }
    }

    /// The destination at `address`, in TLS if the TLS options say so.
    fn peer(&self, address: &Address) -> Result<Target, String> {
        self.tls.check(address)?;
        let Some(files) = self.tls.files() else {
            return Ok(Target::Peer(address.clone()));
        };
        let mut client = files.client().map_err(|e| e.to_string())?;
        if let Some(name) = &self.tls_server_name {
            client = client.with_server_name(name).map_err(|e| e.to_string())?;
        }
        Ok(Target::TlsPeer(address.clone(), client))
    }

    /// What turns a control socket's `migrate` into a target.
    fn targets(self) -> control::Targets {
        Box::new(move |to| {
            let address = Address::from_str(to).map_err(|e| format!("\"to\": {e}"))?;
            self.peer(&address)
        })
    }

    fn options(&self) -> MigrateOptions {
        MigrateOptions {
            backend: self.dirty_log,
            after: Duration::from_millis(self.migrate_after_ms),
            downtime: Duration::from_millis(self.downtime_ms),
            max_rounds: self.max_rounds,
            max_precopy: Duration::from_millis(self.max_precopy_ms),
            dirty_limit: !self.no_dirty_limit,
            timeout: Duration::from_millis(self.migrate_timeout_ms),
            progress: self.migrate_progress,
            postcopy: self.postcopy,
            resume: self.migrate_resume,
        }
    }
}

#[derive(Debug, clap::Args)]
struct ReceiveArgs {
    /// Where to listen: unix:<path> or tcp:<ip>:<port> (port 0: one the
    /// kernel picks; the address is printed on stderr either way).
    #[arg(long, value_name = "ADDR", value_parser = <Address as FromStr>::from_str)]
    listen: Address,
    #[command(flatten)]
    tls: TlsArgs,
    /// Take only sources whose certificate is for this name (DNS name or IP
    /// address; repeat for more); with --tls-cert
    #[arg(long, value_name = "NAME", requires = "tls_cert")]
    tls_allow: Vec<String>,
    /// How long to wait for a source to connect and begin its stream
    /// [default: until one does; SIGINT or SIGTERM ends the wait]
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    wait_ms: Option<u64>,
    /// How long each connection has for its TLS handshake and the stream's
    /// header before it is dropped; each connection runs its own, beside
    /// the others
    #[arg(long, value_name = "MS", default_value_t = HANDSHAKE_TIMEOUT.as_millis() as u64,
          value_parser = clap::value_parser!(u64).range(1..))]
    handshake_timeout_ms: u64,
    /// Connections in handshake at once; one more drops the oldest
    #[arg(long, value_name = "N", default_value_t = MAX_HANDSHAKES,
          value_parser = parse_max_handshakes)]
    max_handshakes: usize,
    /// Post-copy: after a cut link, keep listening for the source to come
    /// back (its `run --migrate-resume`) and go on where it stopped; the
    /// guest's faulting vCPUs wait meanwhile
    #[arg(long)]
    resume: bool,
    /// With --resume: how long the guest may wait for its source to come
    /// back; past it the guest is lost and this process fails
    #[arg(long, value_name = "MS", default_value_t = 60_000, requires = "resume",
          value_parser = clap::value_parser!(u64).range(1..))]
    resume_timeout_ms: u64,
    #[command(flatten)]
    output: OutputArgs,
}

impl ReceiveArgs {
    fn limits(&self) -> AcceptLimits {
        AcceptLimits {
            handshake_timeout: Duration::from_millis(self.handshake_timeout_ms),
            max_handshakes: self.max_handshakes,
            wait: self.wait_ms.map(Duration::from_millis),
        }
    }
}

fn parse_max_reports(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=16_777_216) => Ok(n),
        Ok(n) => Err(format!("{n} is not within 1..=16777216")),
        Err(e) => Err(format!("{s:?} is not a number: {e}")),
    }
}

fn parse_max_handshakes(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=4096) => Ok(n),
        Ok(n) => Err(format!("{n} is not within 1..=4096")),
        Err(e) => Err(format!("{s:?} is not a number: {e}")),
    }
}

/// The migration stream's TLS (TCP only): this side's certificate and key,
/// the CA of the other side's; or, knowingly, none.
#[derive(Debug, clap::Args)]
struct TlsArgs {
    /// This side's certificate (PEM) for a tcp: migration in TLS 1.3
    #[arg(long, value_name = "PATH", requires_all = ["tls_key", "tls_ca"], conflicts_with = "insecure")]
    tls_cert: Option<PathBuf>,
    /// Its private key (PEM)
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// The CA certificate (PEM) the other side's certificate must chain to
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// A tcp: migration in plain text, which anyone who reaches it can
    /// read or feed a VM of their own making
    #[arg(long)]
    insecure: bool,
}

impl TlsArgs {
    /// The files, if given.
    fn files(&self) -> Option<migration::tls::TlsFiles> {
        Some(migration::tls::TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            ca: self.tls_ca.clone()?,
        })
    }

    /// Whether `address` may go on as asked: TLS for tcp:, unless
    /// --insecure (which warns); plain text for unix:.
    fn check(&self, address: &Address) -> Result<(), String> {
        match (address, self.files(), self.insecure) {
            (Address::Unix(_), Some(_), _) => {
                Err("--tls-cert is for tcp: addresses; unix: sockets stay plain text".into())
            }
            (Address::Tcp(_), None, false) => Err(format!(
                "{address} needs --tls-cert, --tls-key and --tls-ca (or --insecure, for a \
                 stream anyone on the network can read or forge)"
            )),
            (Address::Tcp(_), None, true) => {
                eprintln!(
                    "warning: the migration stream on {address} is neither encrypted nor \
                     authenticated (--insecure)"
                );
                Ok(())
            }
            _ => Ok(()),
        }
    }
}

#[derive(Debug, clap::Args)]
struct RestoreArgs {
    /// The snapshot file; after a full one, the incremental snapshots taken
    /// after it, in order.
    #[arg(value_name = "PATH", required = true)]
    snapshots: Vec<PathBuf>,
    #[command(flatten)]
    output: OutputArgs,
}

/// The guest program and what it runs on.
#[derive(Debug, clap::Args)]
struct ProgramArgs {
    /// Guest program to run (see `reference-vmm guests`); not with --image.
    #[arg(long, value_parser = parse_guest)]
    guest: Option<&'static GuestProgram>,
    /// Number of vCPUs, each on its own thread.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = parse_vcpus)]
    vcpus: u32,
    /// Guest memory in MiB (even).
    #[arg(long, default_value_t = 64, value_name = "M", value_parser = parse_mem_mib)]
    mem_mib: u64,
    /// The guest program's parameters, comma-separated (e.g. rounds for pingpong).
    #[arg(long, value_name = "N,N,...", value_parser = parse_params, default_value = "")]
    params: Params,
}

#[derive(Debug, clap::Args)]
struct ImageArgs {
    #[command(flatten)]
    program: ProgramArgs,
    /// Where to write the image.
    #[arg(long, value_name = "PATH")]
    out: PathBuf,
}

/// The mechanism switches, each with its baseline. Those left out take the
/// default; with `--irqchip kernel`, a switch that KVM's LAPIC leaves
/// nothing to act on is an error when given.
#[derive(Debug, clap::Args)]
struct MechanismArgs {
    /// How a halted vCPU waits: kvm, haltpoll, aio, predictive, off, always,
    /// tuned, budget:SHARE [default: predictive; with --irqchip kernel, KVM's
    /// own polling, and only kvm, off (window 0), always (window 10 ms), tuned
    /// (the window halt-poll's WindowTuner sets) or budget:SHARE (the widest
    /// window whose polling stays within SHARE of each vCPU, e.g. 0.05) may
    /// be given; tuned and budget need it].
    #[arg(long, value_parser = <HaltPoll as FromStr>::from_str)]
    halt_poll: Option<HaltPoll>,
    /// How early a guest timer's host timer fires: none, fixed:NS, kvm,
    /// percentile, percentile:Q (aimed at the Q-th percentile of the host's
    /// wake-up lateness, 50 to 99; percentile aims at the 91st)
    /// [default: percentile].
    #[arg(long)]
    timer_advance: Option<TimerAdvance>,
    /// Where each vCPU's host timer expires: vcpu-thread (a POSIX timer
    /// signals the vCPU thread itself, as KVM's hrtimer kicks its vCPU), or a
    /// timer thread on vcpu-cpu (its vCPU thread's CPU, following it) or
    /// anywhere (where the host's scheduler puts it) [default: vcpu-thread].
    #[arg(long, value_parser = <TimerPlacement as FromStr>::from_str)]
    timer_placement: Option<TimerPlacement>,
    /// What interrupt delivery does for the target's thread: none, ready,
    /// directed-yield, on-delivery (boost every target waiting for a CPU; on
    /// KVM's irqchip, the completion device's targets) [default:
    /// directed-yield].
    #[arg(long, value_parser = <Boost as FromStr>::from_str)]
    boost: Option<Boost>,
    /// Keep vCPU threads RCU-online in the guest (they note a quiescent state
    /// at each exit instead of being offline while in the guest).
    #[arg(long)]
    no_extended_qs: bool,
    /// Let the guest poll its mailbox (for the window the halt-poll policy
    /// publishes) before it halts; the VMM then blocks at once.
    #[arg(long)]
    guest_poll: bool,
    /// Boost a vCPU whose guest asks for it (its boost-request word says it
    /// is in a critical section) while its thread waits for a CPU: at most
    /// 3 ms per request and within the booster's budget (on either irqchip).
    #[arg(long)]
    guest_boost: bool,
    /// Where the local APICs live: user (this VMM's, with the crates on their
    /// paths) or kernel (KVM's in-kernel LAPIC, timer and halt polling: the
    /// baseline; --timer-advance and --guest-poll have nothing to act on
    /// there, and --boost acts on the completion device's interrupts only).
    #[arg(long, default_value = "user", value_parser = <Irqchip as FromStr>::from_str)]
    irqchip: Irqchip,
}

impl MechanismArgs {
    fn choices(&self) -> Result<Choices, String> {
        match self.irqchip {
            Irqchip::Kernel => self.check_kernel()?,
            Irqchip::User if self.halt_poll.is_some_and(HaltPoll::kernel_only) => {
                let name = self.halt_poll.map(HaltPoll::name).unwrap_or_default();
                return Err(format!(
                    "--halt-poll {name} sets KVM's in-kernel halt-polling window: it needs \
                     --irqchip kernel"
                ));
            }
            Irqchip::User => {}
        }
        let defaults = Choices::on(self.irqchip);
        Ok(Choices {
            presets: Presets {
                halt_poll: self.halt_poll.unwrap_or(defaults.presets.halt_poll),
                timer_advance: self.timer_advance.unwrap_or_default(),
                boost: self.boost.unwrap_or_default(),
                guest_poll: self.guest_poll,
            },
            timer_placement: self.timer_placement.unwrap_or_default(),
            extended_qs: !self.no_extended_qs,
            irqchip: self.irqchip,
            guest_boosts: self.guest_boost,
        })
    }

    /// KVM's LAPIC takes the timer, the interrupts and the halts: the
    /// switches for what this VMM would do there have nothing to act on.
    fn check_kernel(&self) -> Result<(), String> {
        let unused = [
            ("--timer-advance", self.timer_advance.is_some()),
            ("--timer-placement", self.timer_placement.is_some()),
            ("--guest-poll", self.guest_poll),
            (
                "--halt-poll haltpoll|aio|predictive",
                self.halt_poll.is_some_and(|p| !p.in_kernel()),
            ),
        ];
        match unused.iter().find(|(_, given)| *given) {
            Some((switch, _)) => Err(format!(
                "{switch} has nothing to act on with --irqchip kernel: KVM's LAPIC handles the \
                 timer, interrupt delivery and halts (its halt polling takes --halt-poll kvm, \
                 off, always, tuned or budget:SHARE; --boost acts on the completion device's \
                 interrupts)"
            )),
            None => Ok(()),
        }
    }
}

/// Program parameters, as given.
#[derive(Clone, Debug)]
struct Params([u64; PARAMS]);

fn parse_params(s: &str) -> Result<Params, String> {
    let mut params = [0; PARAMS];
    let values: Vec<&str> = s.split(',').filter(|v| !v.is_empty()).collect();
    if values.len() > PARAMS {
        return Err(format!("at most {PARAMS} parameters, got {}", values.len()));
    }
    for (slot, v) in params.iter_mut().zip(values) {
        *slot = v
            .trim()
            .parse()
            .map_err(|e| format!("{v:?} is not a number: {e}"))?;
    }
    Ok(Params(params))
}

fn parse_guest(name: &str) -> Result<&'static GuestProgram, test_guests::ProgramError> {
    guest::named(name)
}

/// `e`, with the option that would mend it.
fn with_flag(e: &ProgramError) -> String {
    let flag = match e {
        ProgramError::Param { .. } => "--params",
        ProgramError::TooFewVcpus { .. } => "--vcpus",
        ProgramError::TooLittleMemory { .. } => "--mem-mib, or smaller --params",
        ProgramError::NeedsMigration { .. } => "--migrate-to or --snapshot-to",
        ProgramError::NeedsTimeout { .. } => "--timeout-ms",
        ProgramError::Unknown { .. } => "--guest",
    };
    format!("{e} ({flag})")
}

fn parse_vcpus(s: &str) -> Result<u32, String> {
    let n = s
        .parse::<u32>()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    check_vcpus(n, MAX_VCPUS).map_err(|e| e.to_string())
}

fn parse_mem_mib(s: &str) -> Result<u64, String> {
    let n = s
        .parse::<u64>()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    check_mem_mib(n).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run(args) => run(*args),
        Command::Receive(args) => receive(args),
        Command::Restore(args) => restore(args),
        Command::Image(args) => image(args),
        Command::Control(args) => send_command(args),
        Command::Help(args) => help(args),
        Command::Conformance(args) => conformance(args),
        Command::CpuFeatures => match CpuFeatures::of_this_host() {
            Ok(features) => print_or_fail(&features.to_string()),
            Err(e) => fail(&e.to_string()),
        },
        Command::Guests => {
            let lines: String = PROGRAMS
                .iter()
                .map(|p| format!("{:<14} {}\n", p.name, p.about))
                .collect();
            print_or_fail(&lines)
        }
    }
}

fn conformance(args: ConformanceArgs) -> ExitCode {
    if let Some(dir) = &args.record_fuzz_corpus {
        return record_fuzz_corpus(dir);
    }
    let modes: &[Mode] = match args.mode.as_str() {
        "x2apic" => &[Mode::X2apic],
        "xapic" => &[Mode::Xapic],
        _ => &[Mode::X2apic, Mode::Xapic],
    };
    for &mode in modes {
        if args.summary {
            match conformance::differences(args.first_seed, args.seeds, mode, args.ops as usize) {
                Ok(found) => print!("{}", conformance::summary(&found)),
                Err(e) => return fail(&e.to_string()),
            }
            continue;
        }
        match conformance::compare(args.first_seed, args.seeds, mode, args.ops as usize) {
            Ok(None) => println!(
                "{mode:?}: seeds {}..{}, {} operations each: this VMM's APIC answered as KVM's",
                args.first_seed,
                args.first_seed.saturating_add(args.seeds),
                args.ops
            ),
            Ok(Some(difference)) => {
                println!("{difference}");
                return ExitCode::FAILURE;
            }
            Err(e) => return fail(&e.to_string()),
        }
    }
    ExitCode::SUCCESS
}

/// The features every baseline file has (none given: no baseline).
fn cpu_baseline(files: &[PathBuf]) -> Result<Option<CpuFeatures>, String> {
    let mut baseline: Option<CpuFeatures> = None;
    for file in files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("--cpu-baseline {}: {e}", file.display()))?;
        let host: CpuFeatures = text
            .parse()
            .map_err(|e| format!("--cpu-baseline {}: {e}", file.display()))?;
        baseline = Some(baseline.map_or(host, |b| b.intersection(&host)));
    }
    Ok(baseline)
}

/// Prints KVM's answers for each input in `dir`.
fn record_fuzz_corpus(dir: &std::path::Path) -> ExitCode {
    let read = |entry: std::io::Result<std::fs::DirEntry>| {
        let path = entry?.path();
        let name = path
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        Ok::<_, std::io::Error>((name, std::fs::read(&path)?))
    };
    let inputs =
        match std::fs::read_dir(dir).and_then(|d| d.map(read).collect::<Result<Vec<_>, _>>()) {
            Ok(inputs) => inputs,
            Err(e) => return fail(&format!("cannot read the corpus {}: {e}", dir.display())),
        };
    match conformance::fuzz_corpus::record(&inputs) {
        Ok(text) => print_or_fail(&text),
        Err(e) => fail(&e.to_string()),
    }
}

fn run(args: RunArgs) -> ExitCode {
    let serial_out = match args.output.serial_out() {
        Ok(out) => out,
        Err(e) => return fail(&e),
    };
    let choices = match args.mechanisms.choices() {
        Ok(c) => c,
        Err(e) => return usage_error(&e),
    };
    let timeout = args.output.timeout();
    let p = &args.program;
    let (program, params, (vcpus, mem_mib), boot) = match (&args.image, p.guest) {
        (Some(path), _) => match read_image(path) {
            Ok(image) => (
                image.program(),
                image.params(),
                (image.vcpus(), image.mem_mib()),
                Boot::Image(Arc::new(image)),
            ),
            Err(e) => return fail(&e),
        },
        (None, Some(guest)) => (guest, p.params.0, (p.vcpus, p.mem_mib), Boot::Direct),
        (None, None) => return usage_error("--guest or --image is needed"),
    };
    let target = match args.migrate.target() {
        Ok(target) => target,
        Err(e) => return usage_error(&e),
    };
    let migrating = target.is_some() || args.migrate.control.is_some();
    if let Err(e) = program.check_run(&params, vcpus, mem_mib, timeout, migrating) {
        return usage_error(&with_flag(&e));
    }
    let cpu_features = match cpu_baseline(&args.cpu_baseline) {
        Ok(features) => features,
        Err(e) => return usage_error(&e),
    };
    let config = choices.config(VmConfig {
        cpu_features,
        vcpus: p.vcpus,
        mem_mib: p.mem_mib,
        params,
        boot,
        timeout,
        dirty_ring: args.migrate.options().dirty_ring(),
        min_timer_period: Duration::from_micros(args.min_timer_period_us),
        max_reports: args.output.max_reports,
        ..VmConfig::default()
    });
    let mut vm = match Vm::new(&config) {
        Ok(vm) => vm,
        Err(e) => return fail(&e.to_string()),
    };
    if args.migrate.control.is_some() {
        return match controlled(&mut vm, args.migrate) {
            Ok(()) => run_vm(vm, program, serial_out, None),
            Err(e) => fail(&e),
        };
    }
    let migration = match target {
        Some(target) => match Migration::prepare(&mut vm, target, args.migrate.options()) {
            Ok(migration) => Some(migration),
            Err(e) => return fail(&format!("cannot set up the migration: {e}")),
        },
        None => None,
    };
    let migrated = migration.map(|migration| {
        let (tx, rx) = mpsc::channel();
        vm.on_start(Box::new(move |control| {
            let _ = tx.send(migration.run(control));
        }));
        rx
    });
    run_vm(vm, program, serial_out, migrated)
}

/// Binds the control socket and makes its server `vm`'s controller: a
/// socket that cannot be bound is an error before the guest starts.
fn controlled(vm: &mut Vm, migrate: MigrateArgs) -> Result<(), String> {
    let path = migrate.control.clone().unwrap_or_default();
    let (listener, bound) = migration::bind_unix(&path)
        .and_then(|bound| {
            // Whoever can connect can move the guest: its owner alone.
            let owner_only = std::os::unix::fs::PermissionsExt::from_mode(0o600);
            std::fs::set_permissions(&path, owner_only).map(|()| bound)
        })
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    let mover = Mover::prepare(vm, migrate.options())
        .map_err(|e| format!("cannot set up migrations: {e}"))?;
    let server = control::Server::new(listener, mover, migrate.targets())
        .map_err(|e| format!("cannot serve {}: {e}", path.display()))?;
    eprintln!("control: listening on {}", path.display());
    vm.on_start(Box::new(move |control| {
        server.serve(control);
        drop(bound);
    }));
    Ok(())
}

/// What a migration beside a run sends back when it ends.
type Migrated = mpsc::Receiver<Result<MigrationReport, MigrationError>>;

/// Runs `vm` and prints its report, and the migration's result if there was one.
fn run_vm(
    vm: Vm,
    program: &'static GuestProgram,
    serial_out: Box<dyn Write + Send>,
    migrated: Option<Migrated>,
) -> ExitCode {
    if let Err(e) = stop_on_signals(vm.stop_handle()) {
        return fail(&format!("cannot handle SIGINT and SIGTERM: {e}"));
    }
    let result = vm.run(program, serial_out);
    // The run waits for its controller: the result is in the channel.
    let migration = migrated.and_then(|rx| rx.try_recv().ok());
    let handed_over = match &result {
        Ok(report) => report.handed_over,
        Err(Error::Stopped { partial, .. }) => partial.handed_over,
        Err(_) => false,
    };
    match &migration {
        Some(Err(e)) if handed_over => eprintln!("error: migration: {e}"),
        Some(Err(e)) => eprintln!("error: migration failed: {e}; the guest ran on here"),
        _ => {}
    }
    let failed = matches!(migration, Some(Err(_)));
    match (result, migration) {
        (Ok(report), Some(Ok(m))) => print_or_fail(&format!("{report}\n{m}\n")),
        (Ok(report), _) => match (print_or_fail(&format!("{report}\n")), failed) {
            (_, true) => ExitCode::FAILURE,
            (printed, false) => printed,
        },
        // A signal's conventional status: 128 + its number.
        (
            Err(
                e @ Error::Stopped {
                    reason: StopReason::Signal(n),
                    ..
                },
            ),
            _,
        ) => {
            eprintln!("error: {e}");
            ExitCode::from(128u8.saturating_add(u8::try_from(n).unwrap_or(0)))
        }
        (Err(e), _) => fail(&e.to_string()),
    }
}

fn receive(args: ReceiveArgs) -> ExitCode {
    let serial_out = match args.output.serial_out() {
        Ok(out) => out,
        Err(e) => return fail(&e),
    };
    if let Err(e) = args.tls.check(&args.listen) {
        return usage_error(&e);
    }
    let listening = match args.tls.files() {
        Some(files) => files
            .server(&args.tls_allow)
            .and_then(|tls| args.listen.listen_tls(tls)),
        None => args.listen.listen(),
    };
    let listener = match listening {
        Ok(l) => l,
        Err(e) => return fail(&e.to_string()),
    };
    // With port 0, the port the kernel picked: the source needs it.
    let address = listener
        .address()
        .map_or(args.listen.to_string(), |a| a.to_string());
    eprintln!("listening on {address}");
    let mut input = match listener.accept_source(&args.limits(), &mut |line| eprintln!("{line}")) {
        Ok(input) => input,
        Err(e) => return fail(&format!("the migration stream: {e}")),
    };
    eprintln!("receiving from {}", input.get_mut().peer());
    // Nobody else is taken (but a source coming back, with --resume).
    let resume = args.resume.then(|| Resume {
        listener,
        limits: args.limits(),
        within: Duration::from_millis(args.resume_timeout_ms),
        log: |line| eprintln!("{line}"),
    });
    let start = std::time::Instant::now();
    let received = migration::receive_from(&mut input, &args.output.destination());
    // The VM runs only once the source has committed the hand-over.
    let mut incoming = match migration::hand_over(input.get_mut(), received) {
        Ok(incoming) => incoming,
        Err(e) => return fail(&format!("the migration failed: {e}")),
    };
    eprintln!(
        "received {} pages of {}: {} vCPU(s), restored in {:.1} ms",
        incoming.pages,
        incoming.program.name,
        incoming.vm.vcpu_fds().len(),
        start.elapsed().as_secs_f64() * 1e3
    );
    let missing = incoming.postcopy.as_ref().map_or(0, |p| p.missing());
    let fetching = match incoming.fetch(input, resume) {
        Ok(fetching) => fetching,
        Err(e) => return fail(&format!("post-copy: {e}")),
    };
    if fetching.is_some() {
        eprintln!("post-copy: the guest runs here; {missing} pages to come from the source");
    }
    let ran = run_vm(incoming.vm, incoming.program, serial_out, None);
    match fetching.map(Fetching::finish) {
        Some(Err(e)) => fail(&format!("post-copy: {e}")),
        Some(Ok(f)) => {
            eprintln!(
                "post-copy: every page here after {:.1} ms: {} filled from the source, {} remote \
                 faults (stall p50 {:.3} ms, p99 {:.3} ms, max {:.3} ms), {} reconnection(s)",
                f.took.as_secs_f64() * 1e3,
                f.filled,
                f.remote_faults,
                f.stall_p50.as_secs_f64() * 1e3,
                f.stall_p99.as_secs_f64() * 1e3,
                f.stall_max.as_secs_f64() * 1e3,
                f.reconnects
            );
            ran
        }
        None => ran,
    }
}

fn restore(args: RestoreArgs) -> ExitCode {
    let serial_out = match args.output.serial_out() {
        Ok(out) => out,
        Err(e) => return fail(&e),
    };
    let mut inputs = Vec::with_capacity(args.snapshots.len());
    for path in &args.snapshots {
        let opened = File::open(path)
            .map_err(|e| format!("cannot open {}: {e}", path.display()))
            .and_then(|file| {
                StreamReader::new(io::BufReader::new(file))
                    .map_err(|e| format!("{}: {e}", path.display()))
            });
        match opened {
            Ok(input) => inputs.push(input),
            Err(e) => return fail(&e),
        }
    }
    match migration::receive_chain(&mut inputs, &args.output.destination()) {
        Ok(incoming) => run_vm(incoming.vm, incoming.program, serial_out, None),
        Err(e) => fail(&format!("{}: {e}", names(&args.snapshots))),
    }
}

/// The snapshots' paths, for an error.
fn names(paths: &[PathBuf]) -> String {
    let names: Vec<_> = paths.iter().map(|p| p.display().to_string()).collect();
    names.join(" + ")
}

fn send_command(args: ControlArgs) -> ExitCode {
    let mut request = serde_json::Map::new();
    request.insert("command".into(), args.command.into());
    for (name, value) in args.fields {
        request.insert(name, value.into());
    }
    let timeout = Duration::from_millis(args.timeout_ms);
    match control::request(&args.socket, &request.into(), timeout) {
        Ok(answer) => match (print_or_fail(&format!("{answer}\n")), &answer["ok"]) {
            (printed, serde_json::Value::Bool(true)) => printed,
            _ => ExitCode::FAILURE,
        },
        Err(e) => fail(&format!("{}: {e}", args.socket.display())),
    }
}

fn read_image(path: &Path) -> Result<Image, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    Image::parse(bytes).map_err(|e| format!("{}: {e}", path.display()))
}

fn image(args: ImageArgs) -> ExitCode {
    let p = &args.program;
    let Some(guest) = p.guest else {
        return usage_error("--guest is needed");
    };
    let image = match Image::build(guest, p.vcpus, p.mem_mib, p.params.0) {
        Ok(image) => image,
        Err(ImageError::Program(e)) => return usage_error(&with_flag(&e)),
        Err(e) => return usage_error(&e.to_string()),
    };
    if let Err(e) = std::fs::write(&args.out, image.bytes()) {
        return fail(&format!("cannot write {}: {e}", args.out.display()));
    }
    let qemu = test_guests::pvh::qemu_args(&args.out, p.vcpus, p.mem_mib, false);
    let line: Vec<String> = std::iter::once("qemu-system-x86_64".into())
        .chain(qemu)
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    print_or_fail(&format!(
        "wrote {} ({} bytes): {} on {} vCPU(s), {} MiB\nboot it here: reference-vmm run --image {}\nor under QEMU: {}\n",
        args.out.display(),
        image.bytes().len(),
        guest.name,
        p.vcpus,
        p.mem_mib,
        args.out.display(),
        line.join(" ")
    ))
}

/// SIGINT and SIGTERM stop the run through `stop` (the vCPUs leave the guest
/// and the partial report is printed) instead of killing the process: they
/// are blocked in every thread (the vCPU threads, started later, inherit the
/// mask) and a thread takes them with `sigwait`. A second one kills.
fn stop_on_signals(stop: StopHandle) -> io::Result<()> {
    // SAFETY: sigemptyset/sigaddset initialise and fill a local sigset_t;
    // pthread_sigmask only reads it. Results are checked.
    let set = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        match libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) {
            0 => set,
            e => return Err(io::Error::from_raw_os_error(e)),
        }
    };
    std::thread::Builder::new()
        .name("signals".into())
        .spawn(move || {
            let mut signal = 0;
            // SAFETY: `set` is an initialised sigset_t and `signal` a valid
            // out-pointer for the call.
            if unsafe { libc::sigwait(&set, &mut signal) } == 0 {
                stop.stop(StopReason::Signal(signal));
                // SAFETY: as above. Unblocked in this thread, which stays
                // alive, the next one takes its default action: it kills.
                unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
                loop {
                    std::thread::park();
                }
            }
        })?;
    Ok(())
}

fn print_or_fail(text: &str) -> ExitCode {
    match io::stdout().lock().write_all(text.as_bytes()) {
        Ok(()) => ExitCode::SUCCESS,
        // Nobody is reading (e.g. `| head`): not worth an error message.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => fail(&format!("cannot write to stdout: {e}")),
    }
}

/// A command line that parses but cannot be run: clap's status, 2.
fn usage_error(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::from(2)
}

fn fail(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::FAILURE
}
