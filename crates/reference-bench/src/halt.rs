//! `reference-bench halt`: the halt-poll policies on a suite of workloads where no
//! fixed policy wins everywhere: short halts (an IPI ping-pong), long ones
//! (an idle 1 ms timer), bursts of short ones between idle gaps, a mix drawn
//! at random from a short and a long mode, and the ping-pong beside a CPU
//! hog. On this VMM's APIC each policy waits for the halted vCPUs; on KVM's
//! LAPIC (`--irqchip kernel`) KVM polls, under its default window, none, or
//! the window halt-poll's `WindowTuner` sets (`--halt-poll tuned`, or
//! `budget:0.05` and `budget:0.2`: the widest within a share of each vCPU).
//! Cloud Hypervisor and Firecracker boot the same guests from image files on
//! KVM's LAPIC; the ping-pong also runs through the xAPIC page beside QEMU,
//! with its own local APIC and with KVM's.

use std::process::{Child, Command, Stdio};

use crate::peer::{
    Figure, PeerFigure, PeerKind, PeerSeen, PeerVmm, Peers, goal_against_each, goal_against_qemu,
    run_image,
};
use crate::peer_run::{PeerError, PeerRun};
use crate::timer::cyclictest;
use halt_poll::kvm::TunerConfig;

use crate::Error;
use crate::qemu::QemuApic;
use crate::{Cell, Options, Runs, Table, goal, measure, plot, ticks_per_us};
use reference_vmm::{CpuShare, Irqchip, RunReport};
use reference_vmm_cli::presets::{Choices, HaltPoll, TimerAdvance};
use test_guests::layout::PARAMS;

/// Round trips per ping-pong run, without `--quick`.
const ROUNDS: u64 = 2000;
/// Timers per idle-timer run, without `--quick`.
const TIMERS: u64 = 1000;
/// The idle timer's period, µs.
const TIMER_PERIOD_US: u64 = 1000;
/// The bursty workload: a gap of this many µs before every `BURST`-th round trip.
const BURST_GAP_US: u64 = 3000;
const BURST: u64 = 10;
/// The bimodal workload: a gap of this many µs before half the round trips,
/// drawn at random.
const BIMODAL_GAP_US: u64 = 500;

/// What the guest does between halts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Workload {
    PingPong,
    IdleTimer,
    Bursty,
    Bimodal,
    Contended,
    /// The ping-pong through the xAPIC page, which QEMU's own APIC has.
    XapicPingPong,
    /// The same with receivers that spin for the IPI instead of halting:
    /// interrupt delivery to a running vCPU alone.
    XapicSpinning,
}

const WORKLOADS: [Workload; 7] = [
    Workload::PingPong,
    Workload::IdleTimer,
    Workload::Bursty,
    Workload::Bimodal,
    Workload::Contended,
    Workload::XapicPingPong,
    Workload::XapicSpinning,
];

/// One run of a workload, per wake-up (round trip or timer).
pub(crate) struct Sample {
    /// The guest's latency: the mean round trip, or the median timer lateness, µs.
    pub(crate) latency_us: f64,
    /// Time the halted vCPUs spent polling, µs (NaN: not known, QEMU).
    polling_us: f64,
    /// Of which in polls that failed (the vCPU blocked after them), µs.
    failed_us: f64,
    /// Process CPU, µs.
    pub(crate) cpu_us: f64,
    /// The run's polling as a share of each vCPU's time (NaN: not known).
    polling_share: f64,
    /// KVM windows the tuner set per second (NaN: not tuned).
    changes_per_s: f64,
    /// Each timer's lateness, µs (the idle timer's; empty for the others).
    lateness_us: Vec<f64>,
}

impl Sample {
    /// The polling share and window changes of a run of this VMM.
    fn of_vmm(report: &RunReport) -> (f64, f64) {
        let secs = report.elapsed.as_secs_f64();
        let vcpus = report.vcpus.len() as f64;
        let changes = match report.stats.tuned_window_ns {
            Some(_) => report.stats.tuned_window_changes as f64 / secs,
            None => f64::NAN,
        };
        (
            report.stats.polled_ns as f64 / 1e9 / (secs * vcpus),
            changes,
        )
    }
}

impl Workload {
    pub(crate) fn name(self) -> String {
        match self {
            Self::PingPong => "ping-pong".into(),
            Self::IdleTimer => format!("idle timer ({TIMER_PERIOD_US} µs)"),
            Self::Bursty => format!("bursty ({BURST} round trips, {BURST_GAP_US} µs idle)"),
            Self::Bimodal => format!("bimodal (half after {BIMODAL_GAP_US} µs idle)"),
            Self::Contended => "ping-pong beside a CPU hog".into(),
            Self::XapicPingPong => "ping-pong through the xAPIC page".into(),
            Self::XapicSpinning => {
                "ping-pong through the xAPIC page, receivers spinning (no halts)".into()
            }
        }
    }

    /// What the latency column means for it.
    fn latency(self) -> &'static str {
        match self {
            Self::IdleTimer => "median timer lateness",
            _ => "mean round trip",
        }
    }

    /// Its guest program, vCPUs, and round trips or timers per run.
    fn guest(self, opts: Options) -> (&'static str, u32, u64) {
        match self {
            Self::IdleTimer => ("cyclictest", 1, opts.rounds(TIMERS)),
            _ => ("pingpong", 2, opts.rounds(ROUNDS)),
        }
    }

    /// Its guest's parameters for `rounds` round trips or timers
    /// (`guest_poll`: the ping-pong's guest-side polling).
    fn params(self, rounds: u64, guest_poll: bool) -> Vec<u64> {
        let ticks = |us: u64| (us as f64 * ticks_per_us()) as u64;
        match self {
            Self::IdleTimer => vec![rounds, ticks(TIMER_PERIOD_US)],
            Self::PingPong | Self::Contended => vec![rounds, u64::from(guest_poll)],
            Self::Bursty => vec![rounds, 0, ticks(BURST_GAP_US), BURST, 0],
            Self::Bimodal => vec![rounds, 0, ticks(BIMODAL_GAP_US), 2, 1],
            Self::XapicPingPong | Self::XapicSpinning => self.xapic_params(rounds).to_vec(),
        }
    }

    /// Runs it once under `m`.
    fn run(self, m: Choices, opts: Options) -> Result<Sample, Error> {
        let (_, _, rounds) = self.guest(opts);
        if self == Self::IdleTimer {
            return idle_timer(m, rounds);
        }
        let params = |rounds| self.params(rounds, m.presets.guest_poll);
        let start_up = measure("pingpong", 2, m, &params(1), |_| {})?.cpu;
        let hog = (self == Self::Contended).then(Hog::start).transpose()?;
        let run = measure("pingpong", 2, m, &params(rounds), |_| {})?;
        drop(hog);
        let per_round = |v: f64| v / rounds as f64;
        let (polling_share, changes_per_s) = Sample::of_vmm(&run.report);
        Ok(Sample {
            latency_us: per_round(
                run.report.value(0, "ticks").unwrap_or(0) as f64 / ticks_per_us(),
            ),
            polling_us: per_round(run.report.stats.polled_ns as f64 / 1e3),
            failed_us: per_round(run.report.stats.failed_poll_ns as f64 / 1e3),
            cpu_us: per_round(run.cpu.saturating_sub(start_up).as_secs_f64() * 1e6),
            polling_share,
            changes_per_s,
            lateness_us: Vec::new(),
        })
    }
}

impl Workload {
    /// Whether its vCPUs halt (all but the spinning ping-pong's).
    fn halts(self) -> bool {
        self != Self::XapicSpinning
    }

    /// Whether it runs through the xAPIC page, beside QEMU.
    fn is_xapic(self) -> bool {
        matches!(self, Self::XapicPingPong | Self::XapicSpinning)
    }

    /// The ping-pong's parameters through the xAPIC page.
    fn xapic_params(self, rounds: u64) -> [u64; PARAMS] {
        let mut params = [0; PARAMS];
        params[0] = rounds;
        params[5] = 1;
        params[6] = u64::from(self == Self::XapicSpinning);
        params
    }
}

/// `workload` under a peer VMM: the guest's latency, and the VMM's process
/// CPU per wake-up beyond what its start-up alone costs (the same image with
/// one round trip or timer; a peer's firmware and the guest's CPL0 start-up
/// are emulated here). The idle timer's lateness comes from a third run
/// that reports each timer's (on COM1, after the last: not in the CPU run).
pub(crate) fn peer_run(vmm: PeerVmm, workload: Workload, opts: Options) -> Result<Sample, Error> {
    let (program, vcpus, rounds) = workload.guest(opts);
    let run = |rounds, extra: &[u64]| {
        let params = [workload.params(rounds, false).as_slice(), extra].concat();
        run_image(vmm, program, vcpus, &params, opts)
    };
    let start_up = run(1, &[])?;
    let hog = (workload == Workload::Contended)
        .then(Hog::start)
        .transpose()?;
    let measured = run(rounds, &[])?;
    drop(hog);
    let per_round = |v: f64| v / rounds as f64;
    let (latency_us, lateness_us) = match workload {
        Workload::IdleTimer => {
            let lateness = peer_lateness(vmm, &run(rounds, &[1])?, rounds)?;
            (Runs(lateness.clone()).median(), lateness)
        }
        _ => (
            per_round(measured.value(0, "ticks").unwrap_or(0) as f64 / ticks_per_us()),
            Vec::new(),
        ),
    };
    let cpu = measured.cpu_time.saturating_sub(start_up.cpu_time);
    Ok(Sample {
        latency_us,
        polling_us: f64::NAN,
        failed_us: f64::NAN,
        cpu_us: per_round(cpu.as_secs_f64() * 1e6),
        polling_share: f64::NAN,
        changes_per_s: f64::NAN,
        lateness_us,
    })
}

/// The `timers` latenesses a peer's cyclictest reported, µs.
fn peer_lateness(vmm: PeerVmm, run: &PeerRun, timers: u64) -> Result<Vec<f64>, Error> {
    let lateness = run.values(0, "lateness");
    if lateness.len() as u64 != timers {
        let what = format!(
            "cyclictest reported {} of its {timers} timers",
            lateness.len()
        );
        let vmm = vmm.name();
        return Err(PeerError::Guest { vmm, what }.into());
    }
    let us = ticks_per_us();
    Ok(lateness.into_iter().map(|t| t as i64 as f64 / us).collect())
}

/// The idle timer: one vCPU, a TSC deadline every period, halting between.
/// The userspace APIC runs it without a timer advance, so that the halt-poll
/// policy, not the advance, meets each wake-up.
fn idle_timer(m: Choices, timers: u64) -> Result<Sample, Error> {
    let m = m.with_timer_advance(TimerAdvance::None);
    let period = (TIMER_PERIOD_US as f64 * ticks_per_us()) as u64;
    let start_up = cyclictest(m, 1, period)?.0.cpu;
    let (run, lateness) = cyclictest(m, timers, period)?;
    let per_timer = |v: f64| v / timers as f64;
    let (polling_share, changes_per_s) = Sample::of_vmm(&run.report);
    Ok(Sample {
        latency_us: Runs(lateness.clone()).median(),
        polling_us: per_timer(run.report.stats.polled_ns as f64 / 1e3),
        failed_us: per_timer(run.report.stats.failed_poll_ns as f64 / 1e3),
        cpu_us: per_timer(run.cpu.saturating_sub(start_up).as_secs_f64() * 1e6),
        polling_share,
        changes_per_s,
        lateness_us: lateness,
    })
}

/// A CPU hog in a child process, so that its CPU is not the VMM's.
struct Hog(Child);

impl Hog {
    fn start() -> Result<Self, Error> {
        Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .stdin(Stdio::null())
            .spawn()
            .map(Self)
            .map_err(|source| Error::Spawn {
                thread: "CPU hog",
                source,
            })
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One way to wait for a wake-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// This VMM's APIC, the vCPU threads polling with this policy.
    Vmm(HaltPoll),
    /// This VMM's APIC, the guest polling its mailbox for predictive's window.
    GuestSide,
    /// KVM's LAPIC with this in-kernel halt polling (kvm: its default window).
    Kernel(HaltPoll),
    /// A peer VMM booting the same guest from an image file.
    Peer(PeerKind),
}

/// QEMU's two rows.
const QEMU_USER: Variant = Variant::Peer(PeerKind::Qemu(QemuApic::User));
const QEMU_KERNEL: Variant = Variant::Peer(PeerKind::Qemu(QemuApic::Kernel));

/// The polling budgets on KVM's LAPIC, as shares of a vCPU: 5 % and 20 %.
const BUDGETS: [HaltPoll; 2] = [budget(50_000), budget(200_000)];

/// `--halt-poll budget:` `ppm` parts per million.
const fn budget(ppm: u32) -> HaltPoll {
    match CpuShare::from_ppm(ppm) {
        Some(share) => HaltPoll::Budget(share),
        None => panic!("a budget is 1 to 1 000 000 ppm"),
    }
}

/// Every workload's variants, in table order (the budgets run on every
/// workload).
const VARIANTS: [Variant; 16] = [
    Variant::Vmm(HaltPoll::Off),
    Variant::Vmm(HaltPoll::Always),
    Variant::Vmm(HaltPoll::Kvm),
    Variant::Vmm(HaltPoll::Haltpoll),
    Variant::Vmm(HaltPoll::Aio),
    Variant::Vmm(HaltPoll::Predictive),
    Variant::GuestSide,
    Variant::Kernel(HaltPoll::Kvm),
    Variant::Kernel(HaltPoll::Off),
    Variant::Kernel(HaltPoll::Tuned),
    Variant::Kernel(BUDGETS[0]),
    Variant::Kernel(BUDGETS[1]),
    QEMU_USER,
    QEMU_KERNEL,
    Variant::Peer(PeerKind::CloudHypervisor),
    Variant::Peer(PeerKind::Firecracker),
];
/// The variants of the spinning xAPIC ping-pong: no halts, so one policy.
const SPINNING_VARIANTS: [Variant; 4] = [
    Variant::Vmm(HaltPoll::Predictive),
    Variant::Kernel(HaltPoll::Kvm),
    QEMU_USER,
    QEMU_KERNEL,
];
/// The variants of the xAPIC ping-pong: this VMM's APIC blocking at once
/// and with its default policy, KVM's LAPIC, and QEMU with either.
const XAPIC_VARIANTS: [Variant; 5] = [
    Variant::Vmm(HaltPoll::Off),
    Variant::Vmm(HaltPoll::Predictive),
    Variant::Kernel(HaltPoll::Kvm),
    QEMU_USER,
    QEMU_KERNEL,
];
/// The named presets of the crate (KVM's, the guest governor's, QEMU's).
const PRESETS: [HaltPoll; 3] = [HaltPoll::Kvm, HaltPoll::Haltpoll, HaltPoll::Aio];

impl Variant {
    fn name(self) -> String {
        match self {
            Self::Vmm(HaltPoll::Off) => "off (block-only)".into(),
            Self::Vmm(HaltPoll::Always) => "always (poll 10 ms)".into(),
            Self::Vmm(p) => p.to_string(),
            Self::GuestSide => "guest-side polling, predictive window".into(),
            Self::Kernel(HaltPoll::Kvm) => "--irqchip kernel, KVM's default window".into(),
            Self::Kernel(p) => format!("--irqchip kernel --halt-poll {p}"),
            Self::Peer(kind) => kind.row().into(),
        }
    }

    /// Whether `workload` runs it (guest-side polling is the ping-pong's;
    /// the xAPIC ping-pong has its own few, QEMU's among them; Cloud
    /// Hypervisor and Firecracker run the others).
    fn runs_on(self, workload: Workload) -> bool {
        if let Self::Kernel(HaltPoll::Budget(_)) = self {
            return true;
        }
        match workload {
            Workload::XapicPingPong => XAPIC_VARIANTS.contains(&self),
            Workload::XapicSpinning => SPINNING_VARIANTS.contains(&self),
            Workload::PingPong => !matches!(self, QEMU_USER | QEMU_KERNEL),
            _ => !matches!(self, QEMU_USER | QEMU_KERNEL | Self::GuestSide),
        }
    }

    fn choices(self) -> Choices {
        match self {
            Self::Vmm(halt_poll) => Choices::default().with_halt_poll(halt_poll),
            Self::GuestSide => Choices::default().with_guest_poll(),
            Self::Kernel(halt_poll) => Choices::on(Irqchip::Kernel).with_halt_poll(halt_poll),
            Self::Peer(_) => Choices::default(),
        }
    }

    /// Runs `workload` once this way (`None`: a peer that was not found).
    fn run(
        self,
        workload: Workload,
        peers: &Peers,
        opts: Options,
    ) -> Option<Result<Sample, Error>> {
        match self {
            Self::Peer(kind) => peers
                .vmm_for(kind, workload.halts())
                .map(|vmm| peer_run(vmm, workload, opts)),
            _ => Some(workload.run(self.choices(), opts)),
        }
    }
}

/// Each measure of one workload, per variant (in [`VARIANTS`] order).
#[derive(Clone, Default)]
struct Cells {
    latency: Vec<Runs>,
    polling: Vec<Runs>,
    failed: Vec<Runs>,
    cpu: Vec<Runs>,
    share: Vec<Runs>,
    changes: Vec<Runs>,
    /// Every timer's lateness over the runs, µs (the idle timer's).
    lateness: Vec<Vec<f64>>,
}

impl Cells {
    fn new() -> Self {
        let runs = vec![Runs::new(); VARIANTS.len()];
        Self {
            latency: runs.clone(),
            polling: runs.clone(),
            failed: runs.clone(),
            cpu: runs.clone(),
            share: runs.clone(),
            changes: runs,
            lateness: vec![Vec::new(); VARIANTS.len()],
        }
    }

    fn push(&mut self, i: usize, s: Sample) {
        self.latency[i].push(s.latency_us);
        self.polling[i].push(s.polling_us);
        self.failed[i].push(s.failed_us);
        self.cpu[i].push(s.cpu_us);
        self.share[i].push(s.polling_share);
        self.changes[i].push(s.changes_per_s);
        self.lateness[i].extend(s.lateness_us);
    }

    fn of(&self, v: Variant) -> (&Runs, &Runs) {
        let i = index(v);
        (&self.latency[i], &self.polling[i])
    }

    /// The runs of the preset with the lowest median latency. (Not the
    /// lowest of the presets run by run: that minimum of noisy samples beats
    /// every single preset, the best one included.)
    fn best_preset_latency(&self) -> &Runs {
        PRESETS
            .iter()
            .map(|&p| self.of(Variant::Vmm(p)).0)
            .min_by(|a, b| a.median().total_cmp(&b.median()))
            .unwrap_or(&self.latency[index(Variant::Vmm(HaltPoll::Kvm))])
    }
}

fn index(v: Variant) -> usize {
    VARIANTS.iter().position(|&x| x == v).unwrap_or(0)
}

/// Runs the suite; `progress` hears about each run.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let peers = Peers::find(opts);
    let mut cells = vec![Cells::new(); WORKLOADS.len()];
    let mut peer_failures: Vec<(Workload, Variant, String)> = Vec::new();
    for rep in 0..opts.reps() {
        for (w, workload) in WORKLOADS.into_iter().enumerate() {
            for (i, variant) in VARIANTS.into_iter().enumerate() {
                let failed =
                    |&(fw, fv, _): &(Workload, Variant, String)| (fw, fv) == (workload, variant);
                let chosen = opts.runs(&variant.name());
                if !variant.runs_on(workload) || peer_failures.iter().any(failed) || !chosen {
                    continue;
                }
                let what = format!("{}, {}", workload.name(), variant.name());
                progress(&format!("halt: {what} ({}/{})", rep + 1, opts.reps()));
                match variant.run(workload, &peers, opts) {
                    Some(Ok(sample)) => cells[w].push(i, sample),
                    // The peer's failure is a finding, not the bench's.
                    Some(Err(Error::Peer(e))) => {
                        peer_failures.push((workload, variant, e.to_string()))
                    }
                    Some(Err(e)) => return Err(e),
                    None => {}
                }
            }
        }
    }
    let mut t = Table::new(
        "halt: the halt-poll policies on five workloads beside Cloud Hypervisor and Firecracker, and QEMU beside this VMM on the ping-pong through the xAPIC page",
        &[
            "workload",
            "variant",
            "latency (µs)",
            "latency vs baseline",
            "polling per wake-up (µs)",
            "polling vs baseline",
            "of it failed (µs)",
            "process CPU per wake-up (µs)",
            "polling (% of a vCPU)",
            "window changes per s",
        ],
    );
    for (workload, c) in WORKLOADS.into_iter().zip(&cells) {
        rows(&mut t, workload, c);
        plots(&mut t, workload, c);
    }
    let peer = |workload: Workload, kind: PeerKind| {
        let failure = peer_failures
            .iter()
            .find(|&&(w, v, _)| (w, v) == (workload, Variant::Peer(kind)));
        peers.seen(kind, failure.map(|(_, _, e)| e.as_str()), workload.halts())
    };
    notes(&mut t, opts, &cells, &peer);
    t.note(peers.note());
    for (workload, variant, failure) in &peer_failures {
        t.note(format!(
            "{}, {}: no result, not run again: {failure}",
            workload.name(),
            variant.name()
        ));
    }
    Ok(t)
}

/// A workload's plots: each run's latency against its polling, per
/// variant that polls here; for the idle timer, every timer's lateness.
fn plots(t: &mut Table, workload: Workload, c: &Cells) {
    let name = plot::file_name(&workload.name());
    if workload == Workload::IdleTimer {
        let series: Vec<_> = VARIANTS
            .iter()
            .zip(&c.lateness)
            .map(|(v, l)| (v.name(), l.clone()))
            .collect();
        let caption = "halt, idle timer: every timer's lateness, all runs (CDF)";
        t.plot(plot::cdf(
            &format!("halt-{name}-lateness"),
            caption,
            "µs late",
            &series,
        ));
    }
    if workload.is_xapic() {
        return;
    }
    let series: Vec<_> = VARIANTS
        .iter()
        .enumerate()
        .map(|(i, v)| {
            (
                v.name(),
                c.polling[i]
                    .0
                    .iter()
                    .copied()
                    .zip(c.latency[i].0.iter().copied())
                    .collect(),
            )
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| p.iter().any(|(x, _)| x.is_finite()))
        .collect();
    let axes = plot::Axes::linear("polling per wake-up (µs)", "latency (µs)");
    let caption = format!(
        "halt, {}: latency against polling, one point per run",
        workload.name()
    );
    let file = format!("halt-{name}-latency-vs-polling");
    t.plot(plot::points(&file, &caption, axes, &series));
}

/// A workload's rows. On this VMM's APIC the latency baseline is the best
/// preset's and the polling baseline KVM's preset; on KVM's LAPIC both are
/// KVM's default window.
fn rows(t: &mut Table, workload: Workload, c: &Cells) {
    let best_preset = c.best_preset_latency();
    let (kernel_latency, kernel_polling) = c.of(Variant::Kernel(HaltPoll::Kvm));
    let (_, kvm_polling) = c.of(Variant::Vmm(HaltPoll::Kvm));
    let (qemu_latency, _) = c.of(QEMU_USER);
    for (i, variant) in VARIANTS.into_iter().enumerate() {
        if !variant.runs_on(workload) || c.latency[i].0.is_empty() {
            continue;
        }
        let (latency_base, polling_base) = match variant {
            _ if workload.is_xapic() => (qemu_latency, kernel_polling),
            Variant::Kernel(_) | Variant::Peer(_) => (kernel_latency, kernel_polling),
            _ => (best_preset, kvm_polling),
        };
        let known = |runs: &Runs, cell: Cell| match runs.median().is_nan() {
            true => Cell::text("-"),
            false => cell,
        };
        t.row(vec![
            Cell::text(workload.name()),
            Cell::text(variant.name()),
            Cell::runs(&c.latency[i], 1),
            known(
                latency_base,
                Cell::ratio(&c.latency[i].ratio_to(latency_base)),
            ),
            known(&c.polling[i], Cell::runs(&c.polling[i], 2)),
            known(&c.polling[i], polling_ratio(&c.polling[i], polling_base)),
            known(&c.failed[i], Cell::runs(&c.failed[i], 2)),
            Cell::runs(&c.cpu[i], 1),
            known(&c.share[i], Cell::num(100.0 * c.share[i].median(), 2)),
            known(&c.changes[i], Cell::runs(&c.changes[i], 1)),
        ]);
    }
}

/// Polling against a baseline, or "-" where the baseline hardly polled in
/// some run (a ratio to nothing says nothing).
fn polling_ratio(polling: &Runs, base: &Runs) -> Cell {
    if base.0.iter().any(|&b| b < NO_POLLING_US) {
        Cell::text("-")
    } else {
        Cell::ratio(&polling.ratio_to(base))
    }
}

/// Polling per wake-up below this, µs, is none.
const NO_POLLING_US: f64 = 0.005;

fn notes<'a>(
    t: &mut Table,
    opts: Options,
    cells: &[Cells],
    peer: &dyn Fn(Workload, PeerKind) -> PeerSeen<'a>,
) {
    t.better("lower latency, less polling, less process CPU");
    t.note(format!(
        "{} runs per cell, alternating over workloads and variants; {} round trips or {} timers per run. Latency: {}; {}. Polling: the halted vCPU threads' (halt-poll's, or KVM's for --irqchip kernel: halt_poll_success_ns + halt_poll_fail_ns); failed: the polls after which the vCPU blocked (halt_poll_fail_ns). Process CPU also counts the guest's own CPU (its CPL0 code, too, where KVM emulates it) and the VMM's exits; the hog runs in a child process, outside it. Process CPU per wake-up is that of a run less that of the same guest with one round trip or timer (its start-up), a peer's its own from wait4; a peer's polling is inside it, which is all a peer tells; its idle-timer lateness comes from a third run that reports each timer's.",
        opts.reps(),
        opts.rounds(ROUNDS),
        opts.rounds(TIMERS),
        WORKLOADS.map(|w| format!("{}: {}", w.name(), w.latency())).join("; "),
        "the idle timer runs without a timer advance, so the policy meets each wake-up"
    ));
    t.note(format!(
        "Baselines: on this VMM's APIC, latency against the preset ({}) with the lowest median latency and polling against KVM's preset; on KVM's LAPIC both against KVM's default window (halt_poll_ns {}). \"-\": the baseline did not poll.",
        PRESETS.map(|p| p.to_string()).join(", "),
        kvm_halt_poll_ns()
    ));
    t.note(user_goal(cells));
    t.note(kernel_goal(cells));
    t.note(kernel_cost_goal(cells));
    t.note(budget_goal(cells));
    for workload in [Workload::XapicPingPong, Workload::XapicSpinning] {
        t.peer_goal(peer_goal(
            peer(workload, PeerKind::Qemu(QemuApic::User)),
            workload,
            &cells[index_of(workload)],
        ));
    }
    let figures = PeerKind::RUST.map(|kind| best_against_peer(kind, cells, peer));
    t.peer_goal(goal_against_each(
        "on every workload, this VMM's best (the lowest latency of --irqchip kernel with the \
         budget tuner, tuned, budget:0.05 or budget:0.2, and of guest-side polling where the \
         workload has it) at most each peer's latency, at no more process CPU per wake-up, the \
         peers on KVM's LAPIC",
        &figures,
    ));
    t.note("Cloud Hypervisor and Firecracker halt on KVM's LAPIC with KVM's own halt polling and its default window (halt_poll_ns), the mechanism this VMM's --irqchip kernel rows run and the budget tuner sets; guest-side polling, the family's own, keeps the ping-pong's wake-ups in the guest.");
    let pingpong = &cells[0];
    let speedup = pingpong
        .of(Variant::Vmm(HaltPoll::Off))
        .0
        .ratio_to(pingpong.of(Variant::GuestSide).0);
    t.note(goal(
        "guest-side polling at least 3x faster than block-only on the ping-pong, as in the guest halt-polling series (its polling is the guest's, at CPL3, outside the VMM's accounting)",
        &format!("{} faster", speedup.ratio_text()),
        speedup.median() >= 3.0,
        &speedup.each(|s| s >= 3.0),
    ));
}

fn index_of(workload: Workload) -> usize {
    WORKLOADS.iter().position(|&w| w == workload).unwrap_or(0)
}

/// This VMM's APIC against QEMU's on the same guest, through the same
/// xAPIC page: the faster of block-only and predictive, run by run (the
/// spinning receivers do not halt: predictive alone).
fn peer_goal(seen: PeerSeen, workload: Workload, c: &Cells) -> String {
    let (off, _) = c.of(Variant::Vmm(HaltPoll::Off));
    let (predictive, _) = c.of(Variant::Vmm(HaltPoll::Predictive));
    let ours = match workload {
        Workload::XapicSpinning => predictive.clone(),
        _ => off.zip(predictive, f64::min),
    };
    goal_against_qemu(
        seen,
        &format!(
            "on the {}, this VMM's APIC at most 0.7x QEMU's own APIC's round trip",
            workload.name()
        ),
        &ours,
        c.of(QEMU_USER).0,
        c.of(QEMU_KERNEL).0,
        |r| r <= 0.7,
    )
}

/// The workloads Cloud Hypervisor and Firecracker run, in goal order.
const PEER_WORKLOADS: [Workload; 5] = [
    Workload::PingPong,
    Workload::IdleTimer,
    Workload::Bursty,
    Workload::Bimodal,
    Workload::Contended,
];

/// This VMM's candidates for its best against a peer: KVM's LAPIC with the
/// budget tuner's windows, and guest-side polling where the workload has it.
const BEST: [Variant; 4] = [
    Variant::Kernel(HaltPoll::Tuned),
    Variant::Kernel(BUDGETS[0]),
    Variant::Kernel(BUDGETS[1]),
    Variant::GuestSide,
];

/// This VMM's best on `workload` (of [`BEST`], the lowest median latency).
fn best_of(workload: Workload, c: &Cells) -> Option<Variant> {
    BEST.into_iter()
        .filter(|&v| v.runs_on(workload) && !c.latency[index(v)].0.is_empty())
        .min_by(|&a, &b| {
            let median = |v| c.latency[index(v)].median();
            median(a).total_cmp(&median(b))
        })
}

/// Against peer `kind` on every workload it runs: this VMM's best at most
/// the peer's latency, at no more process CPU per wake-up (the peer's
/// polling is inside its process CPU, which is all it tells).
fn best_against_peer<'a>(
    kind: PeerKind,
    cells: &[Cells],
    peer: &dyn Fn(Workload, PeerKind) -> PeerSeen<'a>,
) -> PeerFigure {
    let vmm = kind.vmm();
    if !peer(PEER_WORKLOADS[0], kind).found {
        return PeerFigure {
            vmm,
            outcome: Err(kind.absent()),
        };
    }
    let theirs = index(Variant::Peer(kind));
    let (mut parts, mut unmeasured) = (Vec::new(), Vec::new());
    let (mut met, mut each): (bool, Option<Vec<bool>>) = (true, None);
    for workload in PEER_WORKLOADS {
        let c = &cells[index_of(workload)];
        let best = best_of(workload, c);
        let (Some(best), false) = (best, c.latency[theirs].0.is_empty()) else {
            unmeasured.push(format!(
                "{}: {}",
                workload.name(),
                peer(workload, kind).why()
            ));
            continue;
        };
        let ours = index(best);
        let latency = c.latency[ours].ratio_to(&c.latency[theirs]);
        let cpu = c.cpu[ours].ratio_to(&c.cpu[theirs]);
        met &= latency.median() <= 1.0 && cpu.median() <= 1.0;
        let runs = latency
            .0
            .iter()
            .zip(&cpu.0)
            .map(|(&l, &c)| l <= 1.0 && c <= 1.0);
        each = Some(match each {
            None => runs.collect(),
            Some(e) => e.iter().zip(runs).map(|(&a, b)| a && b).collect(),
        });
        parts.push(format!(
            "{}: {}, latency {}, CPU {}",
            workload.name(),
            best.name(),
            latency.ratio_text(),
            cpu.ratio_text()
        ));
    }
    if parts.is_empty() {
        return PeerFigure {
            vmm,
            outcome: Err(unmeasured.join("; ")),
        };
    }
    let mut measured = parts.join("; ");
    if !unmeasured.is_empty() {
        measured += &format!(" (no figure for {})", unmeasured.join("; "));
    }
    PeerFigure {
        vmm,
        outcome: Ok(Figure {
            measured,
            met,
            runs_met: each.unwrap_or_default(),
        }),
    }
}

/// Predictive against the presets, on every workload that runs them.
fn user_goal(cells: &[Cells]) -> String {
    let mut measured = Vec::new();
    let mut met = true;
    for (workload, c) in WORKLOADS.into_iter().zip(cells) {
        if workload.is_xapic() {
            continue;
        }
        let (latency, polling) = c.of(Variant::Vmm(HaltPoll::Predictive));
        let vs_best = latency.ratio_to(c.best_preset_latency()).median();
        let beaten_by: Vec<String> = PRESETS
            .iter()
            .filter(|&&p| {
                let (l, q) = c.of(Variant::Vmm(p));
                l.median() * 1.1 < latency.median() && q.median() * 1.1 < polling.median()
            })
            .map(|p| p.to_string())
            .collect();
        let mut ok = vs_best <= 1.1 && beaten_by.is_empty();
        let mut text = format!(
            "{}: {} the best preset's latency",
            workload.name(),
            runs_ratio(vs_best)
        );
        if workload == Workload::IdleTimer {
            let (_, kvm) = c.of(Variant::Vmm(HaltPoll::Kvm));
            ok &= polling.median() <= 0.1 * kvm.median();
            text += &match kvm.median() > 0.0 {
                true => format!(
                    ", polling {} of KVM's preset's",
                    runs_ratio(polling.median() / kvm.median())
                ),
                false => format!(
                    ", polling {:.2} µs per wake-up where KVM's preset polled none",
                    polling.median()
                ),
            };
        }
        if !beaten_by.is_empty() {
            text += &format!(", beaten on both by {}", beaten_by.join(", "));
        }
        met &= ok;
        measured.push(text);
    }
    goal(
        "on this VMM's APIC, predictive within 1.1x of the best preset's latency on every workload, polling at most 10 % of KVM's preset's on the idle timer, and no preset more than 10 % better on both latency and polling anywhere",
        &measured.join("; "),
        met,
        &[],
    )
}

/// The tuned window against KVM's default on the idle, bursty and ping-pong workloads.
fn kernel_goal(cells: &[Cells]) -> String {
    let mut measured = Vec::new();
    let mut met = true;
    for (workload, c) in WORKLOADS.into_iter().zip(cells) {
        let bound_polling = matches!(workload, Workload::IdleTimer | Workload::Bursty);
        if !bound_polling && workload != Workload::PingPong {
            continue;
        }
        let (latency, polling) = c.of(Variant::Kernel(HaltPoll::Tuned));
        let (default_latency, default_polling) = c.of(Variant::Kernel(HaltPoll::Kvm));
        let latency_ratio = latency.ratio_to(default_latency).median();
        // What all of the default's polling bought: the latency without it.
        let unpolled = c.of(Variant::Kernel(HaltPoll::Off)).0;
        let mut text = format!(
            "{}: latency {} (with no polling at all {}{})",
            workload.name(),
            runs_ratio(latency_ratio),
            runs_ratio(unpolled.ratio_to(default_latency).median()),
            polling_bought(unpolled, default_latency, default_polling)
        );
        met &= latency_ratio <= 1.1;
        if bound_polling {
            let (p, d) = (polling.median(), default_polling.median());
            met &= p <= 0.5 * d;
            let caught = d - c.failed[index(Variant::Kernel(HaltPoll::Kvm))].median();
            text += &format!(
                ", polling {p:.2} µs against {d:.2} µs, of which {caught:.2} µs caught wake-ups"
            );
        }
        measured.push(text);
    }
    goal(
        "on KVM's LAPIC, the tuned window at most half the default window's polling on the idle timer and bursty workloads at a latency within 1.1x of the default's, and within 1.1x on the ping-pong (a window can only save the failed polls at no cost in latency: the default's polling that caught wake-ups is its floor; below it, a window gives up catches, which a rule that reads only KVM's halt statistics weighs alike on every workload, while the latency without any polling says what they were worth to each)",
        &measured.join("; "),
        met,
        &[],
    )
}

/// What each µs of the default window's polling bought: the latency it saved
/// against no polling at all, per µs polled per wake-up, run by run (each
/// run beside the unpolled one measured next to it).
fn polling_bought(unpolled: &Runs, latency: &Runs, polling: &Runs) -> String {
    if polling.median() < NO_POLLING_US {
        return String::new();
    }
    let saved = unpolled.zip(latency, |u, l| u - l);
    let bought = saved.zip(polling, |s, p| s / p.max(NO_POLLING_US));
    let (min, max) = bought.range();
    format!(
        "; each µs of the default's polling per wake-up bought {:.2} µs of latency ({min:.2} to {max:.2} over the runs)",
        bought.median()
    )
}

/// Latency plus polling per wake-up weighed as the tuner weighs it.
fn cost(latency: &Runs, polling: &Runs) -> Runs {
    let weight = TunerConfig::default().cpu_weight;
    latency.zip(polling, |l, p| l + weight * p)
}

/// The tuned window against the default on the measure the tuner minimises,
/// on every workload that runs both: what it changes, it changes for the
/// better by its own weighing of latency against CPU.
fn kernel_cost_goal(cells: &[Cells]) -> String {
    let (mut measured, mut met) = (Vec::new(), true);
    for (workload, c) in WORKLOADS.into_iter().zip(cells) {
        let (latency, polling) = c.of(Variant::Kernel(HaltPoll::Tuned));
        let (default_latency, default_polling) = c.of(Variant::Kernel(HaltPoll::Kvm));
        if latency.0.is_empty() || default_latency.0.is_empty() {
            continue;
        }
        let ratio = cost(latency, polling).ratio_to(&cost(default_latency, default_polling));
        met &= ratio.median() <= 1.1;
        measured.push(format!("{}: {}", workload.name(), ratio.ratio_text()));
    }
    goal(
        &format!(
            "on KVM's LAPIC, the tuned window's cost, latency + {} × polling per wake-up (the tuner's own weighing), within 1.1x of the default window's on every workload",
            TunerConfig::default().cpu_weight
        ),
        &measured.join("; "),
        met,
        &[],
    )
}

/// Each budget against KVM's default window on every workload: its polling
/// share within the budget in every run, and its latency within 1.1x of the
/// default's wherever the default's own polling fit the budget.
fn budget_goal(cells: &[Cells]) -> String {
    let (mut measured, mut met) = (Vec::new(), true);
    for budget in BUDGETS {
        let HaltPoll::Budget(share) = budget else {
            continue;
        };
        let i = index(Variant::Kernel(budget));
        let default = index(Variant::Kernel(HaltPoll::Kvm));
        for (workload, c) in WORKLOADS.into_iter().zip(cells) {
            let (polling, latency) = (&c.share[i], &c.latency[i]);
            if latency.0.is_empty() || c.latency[default].0.is_empty() {
                continue;
            }
            let within = polling.each(|p| p <= share.get());
            let (_, most) = polling.range();
            let mut ok = within.iter().all(|&w| w);
            let mut text = format!(
                "{budget}, {}: polling at most {:.2} %",
                workload.name(),
                100.0 * most
            );
            if c.share[default].median() <= share.get() {
                let ratio = latency.ratio_to(&c.latency[default]);
                ok &= ratio.median() <= 1.1;
                text += &format!(", latency {} the default's", ratio.ratio_text());
            }
            met &= ok;
            measured.push(text);
        }
    }
    goal(
        "on KVM's LAPIC, each budget's polling share within the budget on every workload in every run, and its latency within 1.1x of KVM's default window's wherever the default's own polling fits the budget",
        &measured.join("; "),
        met,
        &[],
    )
}

fn runs_ratio(v: f64) -> String {
    format!("{}x", crate::runs::ratio(v))
}

/// KVM's module-wide halt-polling window, as the kernel reports it.
fn kvm_halt_poll_ns() -> String {
    std::fs::read_to_string("/sys/module/kvm/parameters/halt_poll_ns")
        .map(|ns| format!("{} ns here", ns.trim()))
        .unwrap_or_else(|_| "not readable here".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_goal_against_a_peer_takes_this_vmms_best_where_both_ran() {
        let sample = |latency_us, cpu_us| Sample {
            latency_us,
            polling_us: f64::NAN,
            failed_us: f64::NAN,
            cpu_us,
            polling_share: f64::NAN,
            changes_per_s: f64::NAN,
            lateness_us: Vec::new(),
        };
        let mut cells = vec![Cells::new(); WORKLOADS.len()];
        let ch = Variant::Peer(PeerKind::CloudHypervisor);
        cells[0].push(index(Variant::GuestSide), sample(1.0, 2.0));
        cells[0].push(
            index(Variant::Kernel(HaltPoll::Tuned)),
            sample(100.0, 200.0),
        );
        cells[0].push(index(ch), sample(120.0, 240.0));
        let seen = |found| {
            move |_, kind| PeerSeen {
                kind,
                found,
                failure: Some("it stopped"),
            }
        };
        let figure = best_against_peer(PeerKind::CloudHypervisor, &cells, &seen(true));
        let line = goal_against_each("best", &[figure]);
        assert!(
            line.contains("ping-pong: guest-side polling, predictive window, latency 0.0083x"),
            "{line}"
        );
        assert!(line.contains("(no figure for idle timer"), "{line}");
        assert!(line.ends_with("(met): met."), "{line}");
        assert!(
            line.contains("Cloud Hypervisor failed in this run: it stopped"),
            "{line}"
        );
        let absent = best_against_peer(PeerKind::Firecracker, &cells, &seen(false));
        let absent = goal_against_each("best", &[absent]);
        assert!(
            absent.contains("Not measured: Firecracker: no firecracker was found"),
            "{absent}"
        );
    }

    #[test]
    fn the_kernel_goal_says_what_the_default_polling_bought() {
        let mut cells = vec![Cells::new(); WORKLOADS.len()];
        for c in &mut cells {
            for (v, latency, polling) in [
                (HaltPoll::Kvm, 100.0, 10.0),
                (HaltPoll::Off, 104.0, 0.0),
                (HaltPoll::Tuned, 101.0, 4.0),
            ] {
                let i = index(Variant::Kernel(v));
                c.latency[i] = Runs(vec![latency]);
                c.polling[i] = Runs(vec![polling]);
                c.failed[i] = Runs(vec![polling / 2.0]);
            }
        }
        let line = kernel_goal(&cells);
        assert!(
            line.contains("latency 1.01x (with no polling at all 1.04x; each µs of the default's polling per wake-up bought 0.40 µs of latency (0.40 to 0.40 over the runs))"),
            "{line}"
        );
        let tuned = index(Variant::Kernel(HaltPoll::Tuned));
        cells[index_of(Workload::XapicPingPong)].latency[tuned] = Runs::new();
        let cost = kernel_cost_goal(&cells);
        // (101 + 0.1 × 4) / (100 + 0.1 × 10) on every workload that runs both.
        assert!(cost.contains("ping-pong: 1.00x;"), "{cost}");
        assert!(!cost.contains("xAPIC page:"), "{cost}");
        assert!(cost.ends_with(": met."), "{cost}");
        assert!(line.contains("polling 4.00 µs against 10.00 µs"), "{line}");
        assert!(line.ends_with(": met."), "{line}");
        let i = index(Variant::Kernel(HaltPoll::Tuned));
        cells[index_of(Workload::Bursty)].polling[i] = Runs(vec![6.0]);
        assert!(kernel_goal(&cells).ends_with(": not met."));
    }

    #[test]
    fn the_budget_goal_asks_every_run_within_the_budget() {
        let mut cells = vec![Cells::new(); WORKLOADS.len()];
        let default = index(Variant::Kernel(HaltPoll::Kvm));
        for c in &mut cells {
            // The default polls 10 % of a vCPU: within 20 %, not 5 %.
            c.latency[default] = Runs(vec![100.0, 100.0]);
            c.share[default] = Runs(vec![0.1, 0.1]);
            for (budget, share, latency) in [(0, 0.04, 150.0), (1, 0.15, 105.0)] {
                let i = index(Variant::Kernel(BUDGETS[budget]));
                c.latency[i] = Runs(vec![latency, latency]);
                c.share[i] = Runs(vec![share, share]);
            }
        }
        let line = budget_goal(&cells);
        assert!(
            line.contains("budget:0.05, ping-pong: polling at most 4.00 %;"),
            "{line}"
        );
        assert!(
            line.contains("budget:0.2, ping-pong: polling at most 15.00 %, latency 1.05x"),
            "{line}"
        );
        assert!(line.ends_with(": met."), "{line}");
        // One run over the budget, anywhere: not met.
        cells[index_of(Workload::Bursty)].share[index(Variant::Kernel(BUDGETS[0]))] =
            Runs(vec![0.04, 0.06]);
        assert!(budget_goal(&cells).ends_with(": not met."));
        // Where the default fits, the latency counts.
        let i = index(Variant::Kernel(BUDGETS[1]));
        cells[0].share[i] = Runs(vec![0.1, 0.1]);
        for c in &mut cells {
            c.latency[i] = Runs(vec![120.0, 120.0]);
        }
        assert!(budget_goal(&cells).contains("latency 1.20x the default's"));
    }

    #[test]
    fn the_best_preset_is_the_one_with_the_lowest_median_not_a_per_run_minimum() {
        let mut c = Cells::new();
        let runs = [
            (HaltPoll::Kvm, [100.0, 130.0, 110.0]),
            (HaltPoll::Haltpoll, [120.0, 100.0, 125.0]),
            (HaltPoll::Aio, [105.0, 108.0, 130.0]),
        ];
        for (preset, latencies) in runs {
            c.latency[index(Variant::Vmm(preset))] = Runs(latencies.to_vec());
        }
        assert_eq!(c.best_preset_latency(), &Runs(vec![105.0, 108.0, 130.0]));
    }
}
