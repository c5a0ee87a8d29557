//! `reference-bench timer`: a guest cyclictest. The guest arms TSC-deadline timers,
//! halts until each fires, and records how late its interrupt entry ran; each
//! timer-advance policy in turn, then KVM's in-kernel LAPIC timer, then the
//! host's own timer wake-up with no guest, which every userspace timer starts
//! from, then the peer VMMs booting the same guest on KVM's LAPIC: QEMU,
//! Cloud Hypervisor, Firecracker.

use std::time::{Duration, Instant};

use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::timerfd::TimerFd;

use crate::Error;
use crate::peer::{Figure, PeerFigure, PeerKind, PeerVmm, Peers, goal_against_each, run_image};
use crate::peer_run::PeerError;
use crate::qemu::QemuApic;
use crate::{Cell, Measured, Options, Runs, Table, goal, measure, plot, ticks_per_us};
use reference_vmm::MAX_LEAD;
use reference_vmm::{Irqchip, KvmHaltPoll, TimerPlacement};
use reference_vmm_cli::presets::{Choices, HaltPoll, TimerAdvance};
use test_guests::layout::SAMPLES_ADDR;
use test_support::summary::quantile;

/// Timers per run, without `--quick`.
const SAMPLES: u64 = 2000;
/// Lateness histogram bucket bounds, µs.
const BUCKETS: [f64; 6] = [0.0, 5.0, 10.0, 20.0, 50.0, 100.0];

/// The variants, each named: the advance policies on the userspace APIC,
/// baseline first (the percentile advance also aimed at p99, the tail's
/// quantile, with a timer thread on the vCPU's CPU instead of the vCPU
/// thread's own signal timer, and with the halted vCPU polling), then
/// KVM's in-kernel LAPIC timer (its own adaptive advance), with KVM's halt
/// polling as configured (`halt_poll_ns`) and polling up to 10 ms. A
/// variant's runs are at its index (`variant as usize`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    None,
    Fixed,
    Kvm,
    Percentile,
    PercentileP99,
    /// The percentile advance with a timer thread on the vCPU's CPU.
    Thread,
    /// The percentile advance, the halted vCPU polling up to 10 ms (for
    /// its own deadline too), as KVM's LAPIC polls with `--halt-poll always`.
    PercentilePolling,
    Kernel,
    KernelPolling,
}

impl Variant {
    /// Every variant, in the table's order.
    const ALL: [Self; 9] = [
        Self::None,
        Self::Fixed,
        Self::Kvm,
        Self::Percentile,
        Self::PercentileP99,
        Self::Thread,
        Self::PercentilePolling,
        Self::Kernel,
        Self::KernelPolling,
    ];

    /// Its row name (the reference VMM's switches) and its choices.
    fn setup(self) -> (String, Choices) {
        let user = |timer_advance: TimerAdvance| {
            let choices = Choices::default().with_timer_advance(timer_advance);
            (format!("--timer-advance {timer_advance}"), choices)
        };
        let kernel = |halt_poll: HaltPoll| {
            let name = match halt_poll.kvm() {
                KvmHaltPoll::Window(_) => format!("--irqchip kernel --halt-poll {halt_poll}"),
                _ => "--irqchip kernel".into(),
            };
            (name, Choices::on(Irqchip::Kernel).with_halt_poll(halt_poll))
        };
        match self {
            Self::None => user(TimerAdvance::None),
            Self::Fixed => user(TimerAdvance::Fixed(Duration::from_micros(50))),
            Self::Kvm => user(TimerAdvance::Kvm),
            Self::Percentile => user(TimerAdvance::Percentile),
            Self::PercentileP99 => user(TimerAdvance::PercentileAt(99)),
            Self::Thread => (
                format!("--timer-advance percentile --timer-placement {THREAD_PLACEMENT}"),
                Choices::default().with_timer_placement(THREAD_PLACEMENT),
            ),
            Self::PercentilePolling => (
                "--timer-advance percentile --halt-poll always".into(),
                Choices::default().with_halt_poll(HaltPoll::Always),
            ),
            Self::Kernel => kernel(HaltPoll::Kvm),
            Self::KernelPolling => kernel(HaltPoll::Always),
        }
    }
}

/// Every variant's row name and choices, in order.
fn variants() -> [(String, Choices); 9] {
    Variant::ALL.map(Variant::setup)
}

const NONE: usize = Variant::None as usize;
const PERCENTILE: usize = Variant::Percentile as usize;
const THREAD: usize = Variant::Thread as usize;
const THREAD_PLACEMENT: TimerPlacement = TimerPlacement::VcpuCpu;
/// This VMM's two halt-polling settings with the percentile advance.
const OWN: [usize; 2] = [PERCENTILE, Variant::PercentilePolling as usize];
/// KVM's LAPIC, with its halt polling as configured and polling 10 ms.
const KERNEL: [usize; 2] = [Variant::Kernel as usize, Variant::KernelPolling as usize];
/// The host's row, after the variants.
const HOST: usize = Variant::ALL.len();

/// The row of the host's own timer wake-up, after the variants.
const HOST_ROW: &str = "host: a thread on a timerfd, no guest";
/// The peers' rows, after the host's, each on KVM's LAPIC.
const PEERS: [PeerKind; 3] = [
    PeerKind::Qemu(QemuApic::Kernel),
    PeerKind::CloudHypervisor,
    PeerKind::Firecracker,
];
/// Every row: the variants, the host's, the peers'.
const ROWS: usize = HOST + 1 + PEERS.len();
/// What the peers' timer does that this VMM's advance does not.
const PEERS_DO: &str = "What the peers do that this VMM's advance does not: their timer is KVM's in-kernel LAPIC timer, which fires, injects and takes the EOI without an exit to the VMM, and KVM's own lapic_timer_advance; this VMM's percentile advance delivers from userspace, where each timer costs the vCPU exits to the VMM (its HLT, the EOI and the next deadline's write, about 25 µs each on PVM), a large part of a 200 µs period. This VMM on KVM's LAPIC (--irqchip kernel) is the peers' mechanism: its ratio is beside each goal.";
/// Why QEMU's own APIC has no row.
const QEMU_OWN_APIC: &str = "qemu, its own APIC (kernel-irqchip=off): not run: QEMU offers the TSC-deadline timer this guest arms only with KVM's LAPIC (kernel-irqchip=on).";

/// One run of one variant.
struct Run {
    /// Each timer's lateness, µs.
    lateness: Vec<f64>,
    /// The userspace APIC's spin to its timers' targets per expiry, µs
    /// (`None` on KVM's LAPIC, which spins in the kernel).
    spin_us: Option<f64>,
    /// The halted vCPU's polling per timer, µs: halt-poll's, or KVM's on its
    /// LAPIC (`None` where not measured: the host's row, QEMU's).
    polling_us: Option<f64>,
    /// The userspace APIC's median delivery path, µs, from delivery start to
    /// the guest's interrupt entry (`None` elsewhere).
    delivery_us: Option<f64>,
    /// The 99th percentile of how late delivery started after its target
    /// (the advance's own miss), the upper edge of its power-of-two bucket,
    /// µs (`None` on KVM's LAPIC).
    start_p99_us: Option<f64>,
    /// The vCPU's exits to this VMM per timer (its HLT, EOI and deadline
    /// write, and whatever else; `None` where not measured).
    exits_per_timer: Option<f64>,
}

impl Run {
    /// A run of which only each timer's lateness is known (the host's row,
    /// QEMU's).
    fn of_lateness(lateness: Vec<f64>) -> Self {
        Self {
            lateness,
            spin_us: None,
            polling_us: None,
            delivery_us: None,
            start_p99_us: None,
            exits_per_timer: None,
        }
    }
}

/// Each variant's runs, by percentile: one value per run.
fn per_run(runs: &[Vec<Run>], q: f64) -> Vec<Runs> {
    runs.iter()
        .map(|r| Runs(r.iter().map(|run| quantile(&run.lateness, q)).collect()))
        .collect()
}

/// Runs the scenario at 1 ms and 200 µs periods.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let samples = opts.rounds(SAMPLES);
    let mut t = Table::new(
        "timer: guest cyclictest, TSC-deadline timer, lateness of the interrupt entry",
        &[
            "period",
            "variant",
            "min (µs)",
            "p50 (µs)",
            "p99 (µs)",
            "max (µs)",
            "early",
            "spin µs/expiry",
            "halt polling µs/timer",
            "p50 vs none",
            "histogram <0/5/10/20/50/100/more µs",
        ],
    );
    let (mut goals, mut peer_goals) = (Vec::new(), Vec::new());
    let found = Peers::find(opts);
    let mut peers = PEERS.map(|kind| Peer {
        kind,
        vmm: found.vmm(kind),
        failure: None,
    });
    for period_us in [1000u64, 200] {
        let runs = measure_period(opts, period_us, &mut peers, progress)?;
        let (p50, p99) = (per_run(&runs, 0.5), per_run(&runs, 0.99));
        let names = variants().map(|(name, _)| name);
        let peer_rows = PEERS.map(|kind| kind.row().to_owned());
        let rows = names.into_iter().chain([HOST_ROW.into()]).chain(peer_rows);
        let mut distributions = Vec::new();
        for (i, name) in rows.enumerate().filter(|(i, _)| !runs[*i].is_empty()) {
            // The percentiles of the run with the median p50.
            let median_run = runs[i]
                .iter()
                .find(|r| quantile(&r.lateness, 0.5) == p50[i].median());
            let lat = median_run.map_or(&[][..], |r| r.lateness.as_slice());
            distributions.push((name.clone(), lat.to_vec()));
            let early = runs[i].iter().map(|r| early(&r.lateness)).sum::<usize>();
            let spin = Runs(runs[i].iter().filter_map(|r| r.spin_us).collect());
            let polling = Runs(runs[i].iter().filter_map(|r| r.polling_us).collect());
            t.row(vec![
                Cell::text(format!("{period_us} µs")),
                Cell::text(name),
                Cell::num(quantile(lat, 0.0), 1),
                Cell::runs(&p50[i], 1),
                Cell::num(quantile(lat, 0.99), 1),
                Cell::num(quantile(lat, 1.0), 1),
                Cell::text(early.to_string()),
                match (i == HOST, spin.0.is_empty()) {
                    (true, _) => Cell::text("-"),
                    (false, true) => Cell::text("in kernel"),
                    (false, false) => Cell::runs(&spin, 1),
                },
                match polling.0.is_empty() {
                    true => Cell::text("-"),
                    false => Cell::runs(&polling, 1),
                },
                Cell::ratio(&p50[i].ratio_to(&p50[NONE])),
                Cell::text(histogram(lat)),
            ]);
        }
        let caption = format!(
            "timer, {period_us} µs period: lateness in the run with the median p50, per variant \
             (CDF)"
        );
        let name = format!("timer-{period_us}us-lateness");
        t.plot(plot::cdf(&name, &caption, "µs late", &distributions));
        // Per run, over this VMM's two halt-polling settings.
        let early_percentile: Vec<usize> = runs[OWN[0]]
            .iter()
            .zip(&runs[OWN[1]])
            .map(|(a, b)| early(&a.lateness) + early(&b.lateness))
            .collect();
        goals.push(timer_goal(period_us, &runs, &early_percentile));
        goals.push(tail_goal(period_us, &runs));
        goals.push(noise_line(period_us, &runs));
        goals.push(delivery_line(period_us, &runs));
        goals.push(host_floor(period_us, &p50, &p99));
        goals.push(placement_line(period_us, &p50, &p99, &runs));
        goals.push(catch_up_line(period_us, &runs));
        let figures: Vec<_> = (peers.iter().enumerate())
            .map(|(k, peer)| peer_figure(&p50, &p99, &runs, k, peer))
            .collect();
        let asks = format!(
            "at {period_us} µs, this VMM's percentile advance at most 0.5x each peer's p50 and \
             at most its p99, the peers on KVM's LAPIC"
        );
        peer_goals.push(goal_against_each(&asks, &figures));
    }
    t.better("lateness near 0 and never below it (an early timer is a bug: the early column counts them over every run), less spin per expiry (the CPU the advance costs) and less halt polling per timer (the CPU a waiting vCPU burns: with --halt-poll always most of the period), a lower p50 vs none; the percentiles are those of the run with the median p50, the spin the median over runs");
    t.note(format!(
        "{samples} timers per run, {} runs per variant, alternating; the guest halts between timers (the userspace APIC's vCPUs wait through halt-poll's predictive policy, which with an advance leaves the timer to the advance, or with --halt-poll always poll and fire the timer at its deadline; KVM's LAPIC halts in the kernel, with its halt polling and lapic_timer_advance).",
        opts.reps()
    ));
    for line in goals {
        t.note(line);
    }
    for line in peer_goals {
        t.peer_goal(line);
    }
    t.note(PEERS_DO);
    for peer in peers.iter().filter(|p| p.failure.is_some()) {
        let failure = peer.failure.as_deref().unwrap_or_default();
        t.note(format!(
            "{}: no result, not run again: {failure}",
            peer.kind.row()
        ));
    }
    t.note(QEMU_OWN_APIC);
    t.note(found.note());
    Ok(t)
}

/// A peer VMM for its row (`None`: not found), and why it stopped giving
/// results, if it did.
struct Peer<'a> {
    kind: PeerKind,
    vmm: Option<PeerVmm<'a>>,
    failure: Option<String>,
}

/// Every row's runs at one period, taking turns: the variants, the host's
/// wake-up, and each peer on KVM's LAPIC while it gives results (no runs:
/// not measured).
fn measure_period(
    opts: Options,
    period_us: u64,
    peers: &mut [Peer],
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Vec<Run>>, Error> {
    let samples = opts.rounds(SAMPLES);
    let period_ticks = (period_us as f64 * ticks_per_us()) as u64;
    let mut runs: Vec<Vec<Run>> = (0..ROWS).map(|_| Vec::new()).collect();
    for rep in 0..opts.reps() {
        for (i, (name, m)) in variants().into_iter().enumerate() {
            if !opts.runs(&name) {
                continue;
            }
            progress(&format!(
                "timer: {period_us} µs, {name} ({}/{})",
                rep + 1,
                opts.reps()
            ));
            runs[i].push(lateness(m, samples, period_ticks)?);
        }
        if opts.runs(HOST_ROW) {
            progress(&format!("timer: {period_us} µs, {HOST_ROW}"));
            runs[HOST].push(Run::of_lateness(host_wakeups(samples, period_us)?));
        }
        for (k, peer) in peers.iter_mut().enumerate() {
            let chosen = opts.runs(peer.kind.row());
            let Some(vmm) = peer.vmm.filter(|_| peer.failure.is_none() && chosen) else {
                continue;
            };
            progress(&format!("timer: {period_us} µs, {}", peer.kind.row()));
            match peer_lateness(vmm, samples, period_ticks, opts) {
                Ok(lateness) => runs[HOST + 1 + k].push(Run::of_lateness(lateness)),
                Err(e) => peer.failure = Some(e.to_string()),
            }
        }
    }
    Ok(runs)
}

/// The same guest booted by a peer on KVM's LAPIC, reporting each lateness.
fn peer_lateness(
    vmm: PeerVmm,
    samples: u64,
    period_ticks: u64,
    opts: Options,
) -> Result<Vec<f64>, Error> {
    let params = [samples, period_ticks, 1];
    let run = run_image(vmm, "cyclictest", 1, &params, opts)?;
    let us = ticks_per_us();
    let lateness: Vec<f64> = run
        .values(0, "lateness")
        .into_iter()
        .map(|ticks| ticks as i64 as f64 / us)
        .collect();
    if lateness.len() as u64 != samples {
        let what = format!(
            "cyclictest reported {} of its {samples} timers",
            lateness.len()
        );
        return Err(PeerError::Guest {
            vmm: vmm.name(),
            what,
        }
        .into());
    }
    Ok(lateness)
}

/// The goal against peer `k`: this VMM's percentile advance at most half
/// its p50 and at most its p99 (no timer early is the timer goal's);
/// this VMM on KVM's LAPIC beside it.
fn peer_figure(p50: &[Runs], p99: &[Runs], runs: &[Vec<Run>], k: usize, peer: &Peer) -> PeerFigure {
    let at = HOST + 1 + k;
    let vmm = peer.kind.vmm();
    if runs[at].is_empty() {
        let why = match &peer.vmm {
            None => peer.kind.absent(),
            Some(_) => format!("{} gave no result in this run (see below)", peer.kind.row()),
        };
        return PeerFigure {
            vmm,
            outcome: Err(why),
        };
    }
    let (p50_ratio, p99_ratio) = (
        p50[PERCENTILE].ratio_to(&p50[at]),
        p99[PERCENTILE].ratio_to(&p99[at]),
    );
    let meets = |p50: f64, p99: f64| p50 <= 0.5 && p99 <= 1.0;
    let runs_met: Vec<bool> = p50_ratio
        .0
        .iter()
        .zip(&p99_ratio.0)
        .map(|(&a, &b)| meets(a, b))
        .collect();
    let measured = format!(
        "p50 {}, p99 {} (this VMM on KVM's LAPIC, --irqchip kernel: p50 {})",
        p50_ratio.ratio_text(),
        p99_ratio.ratio_text(),
        p50[KERNEL[0]].ratio_to(&p50[at]).ratio_text(),
    );
    PeerFigure {
        vmm,
        outcome: Ok(Figure {
            measured,
            met: meets(p50_ratio.median(), p99_ratio.median()),
            runs_met,
        }),
    }
}

/// Timers whose interrupt entry ran before their deadline.
fn early(lateness: &[f64]) -> usize {
    lateness.iter().filter(|&&l| l < 0.0).count()
}

/// The goal at one period: percentile p50 and p99 both below the in-kernel
/// LAPIC timer's in the same bench run, each side at the better of its two
/// halt-polling settings, and no timer early.
///
/// Each row's timers are pooled over its runs. One run's p99 is its 20th
/// latest timer of 2000, and which timers are late is decided by the phase
/// of a periodic host event against the guest's period (here every 20th
/// timer at 200 µs, seen here: the 250 Hz tick), fixed within a run and drawn anew in
/// each: per-run p99s flip between runs whose pooled tails do not. Each
/// run's own verdict is still given.
fn timer_goal(period_us: u64, runs: &[Vec<Run>], early_percentile: &[usize]) -> String {
    let pooled = |row: usize, q: f64| pooled(runs, row, q);
    let best = |rows: [usize; 2], q: f64| pooled(rows[0], q).min(pooled(rows[1], q));
    let (own50, own99) = (best(OWN, 0.5), best(OWN, 0.99));
    let (kernel50, kernel99) = (best(KERNEL, 0.5), best(KERNEL, 0.99));
    let (p50, p99) = (per_run(runs, 0.5), per_run(runs, 0.99));
    let by_run = |q: &[Runs], rows: [usize; 2]| q[rows[0]].zip(&q[rows[1]], f64::min);
    let (run50, run99) = (by_run(&p50, OWN), by_run(&p99, OWN));
    let (kernel_run50, kernel_run99) = (by_run(&p50, KERNEL), by_run(&p99, KERNEL));
    let runs_met = (0..run50.0.len())
        .filter(|&i| {
            run50.0[i] < kernel_run50.0[i]
                && run99.0[i] < kernel_run99.0[i]
                && early_percentile[i] == 0
        })
        .count();
    let early: usize = early_percentile.iter().sum();
    goal(
        &format!(
            "at {period_us} µs, percentile p50 and p99 both below the in-kernel LAPIC timer's in the same run (--irqchip kernel: the same guest on KVM's LAPIC), each side at the better of its two halt-polling settings (KVM's window or always; predictive or always), each row's timers pooled over its runs, and no timer early"
        ),
        &format!(
            "percentile p50 {own50:.1} µs against {kernel50:.1} µs ({:.2}x), p99 {own99:.1} µs against {kernel99:.1} µs ({:.2}x), {early} early; {runs_met} of {} runs met it alone (per-run p99 ratios {})",
            own50 / kernel50,
            own99 / kernel99,
            run50.0.len(),
            run99.ratio_to(&kernel_run99).ratio_text(),
        ),
        own50 < kernel50 && own99 < kernel99 && early == 0,
        &[],
    )
}

/// Most a userspace timer's p99 may be above the in-kernel timer's: its
/// expiry starts with a host wake-up and ends in exits KVM's LAPIC does not
/// take, which at 200 µs costs tens of µs (the delivery line below).
const TAIL_BOUND: f64 = 3.0;

/// The percentile row's p99 against KVM's LAPIC's, run by run: every run
/// must hold the bound, as a tail of milliseconds in one run is a guest that
/// fell behind its timers.
fn tail_goal(period_us: u64, runs: &[Vec<Run>]) -> String {
    let p99 = per_run(runs, 0.99);
    let ratio = p99[PERCENTILE].ratio_to(&p99[KERNEL[0]]);
    let each = ratio.each(|r| r <= TAIL_BOUND);
    let listed: Vec<String> = ratio.0.iter().map(|r| format!("{r:.2}x")).collect();
    goal(
        &format!(
            "at {period_us} µs, the percentile row's p99 at most {TAIL_BOUND}x KVM's LAPIC's (--irqchip kernel) in every run"
        ),
        &format!("per run {}", listed.join(", ")),
        !each.is_empty() && each.iter().all(|&m| m),
        &[],
    )
}

/// The `q` quantile of one row's timers over all its runs.
fn pooled(runs: &[Vec<Run>], row: usize, q: f64) -> f64 {
    let all: Vec<f64> = runs[row]
        .iter()
        .flat_map(|r| r.lateness.iter().copied())
        .collect();
    quantile(&all, q)
}

/// How far apart two p99s of one thing land on this host: KVM's two
/// halt-polling settings, where they polled alike (within 10 %: at a period
/// below KVM's window both poll through every halt), are an A/A pair, and
/// their p99 ratio is the noise any p99 comparison here carries.
fn noise_line(period_us: u64, runs: &[Vec<Run>]) -> String {
    let polling = |row: usize| Runs(runs[row].iter().filter_map(|r| r.polling_us).collect());
    let (a, b) = (polling(KERNEL[0]).median(), polling(KERNEL[1]).median());
    let alike = (a - b).abs() <= 0.1 * a.max(b);
    if !alike {
        return format!(
            "At {period_us} µs, KVM's two halt-polling settings polled {a:.1} and {b:.1} µs per timer: no A/A pair to show this host's p99 noise."
        );
    }
    let p99 = per_run(runs, 0.99);
    let (p99_a, p99_b) = (pooled(runs, KERNEL[0], 0.99), pooled(runs, KERNEL[1], 0.99));
    format!(
        "At {period_us} µs, KVM's two halt-polling settings polled alike ({a:.1} and {b:.1} µs per timer), so they are one thing measured twice: pooled p99 {p99_a:.1} against {p99_b:.1} µs ({:.2}x), per run {}. A p99 difference within that is this host's noise, not a difference between timers.",
        p99_a / p99_b,
        p99[KERNEL[0]].ratio_to(&p99[KERNEL[1]]).ratio_text(),
    )
}

/// Where this VMM's lateness comes from, run by run: the delivery path from
/// `KVM_INTERRUPT` to the guest's interrupt entry, of which the lead covers
/// at most [`MAX_LEAD`] (more could make a guest see its timer early when
/// the path is fast again); the rest is lateness no advance removes.
fn delivery_line(period_us: u64, runs: &[Vec<Run>]) -> String {
    let pairs: Vec<String> = OWN
        .iter()
        .flat_map(|&row| &runs[row])
        .filter_map(|r| {
            Some(format!(
                "{:.1}/{:.0}/{:.1}/{:.1}",
                r.exits_per_timer?,
                r.delivery_us?,
                r.start_p99_us?,
                quantile(&r.lateness, 0.5)
            ))
        })
        .collect();
    format!(
        "At {period_us} µs, where this VMM's lateness comes from, per run of the percentile rows: the vCPU's exits to this VMM per timer / the delivery path's median (KVM_INTERRUPT, KVM_RUN and the guest's emulated interrupt entry) / the advance's own p99 miss (delivery starting after its target; at most, a power-of-two bucket) / the guest's p50 lateness, in µs: {}. The lead covers at most {} µs of the path, so that a guest never sees its timer early when the path turns fast again; KVM's LAPIC delivers from inside KVM_RUN.",
        pairs.join(", "),
        MAX_LEAD.as_micros()
    )
}

/// What the host's timer wake-up allows: a userspace timer's expiry starts
/// with a thread the host wakes (KVM's LAPIC needs none when it polls), so
/// the tail of that wake-up beyond the in-kernel timer's is what an advance
/// must cover, by spinning.
fn host_floor(period_us: u64, p50: &[Runs], p99: &[Runs]) -> String {
    let kernel99 = p99[KERNEL[0]].zip(&p99[KERNEL[1]], f64::min).median();
    let (host50, host99) = (p50[HOST].median(), p99[HOST].median());
    let advance = (host99 - kernel99).max(0.0);
    format!(
        "The host's own timer at {period_us} µs (a thread on a timerfd, no guest, same run): p50 {host50:.1} µs, p99 {host99:.1} µs, against the in-kernel timer's p99 {kernel99:.1} µs. \
         A userspace timer's expiry starts with such a wake-up, so its p99 goes below the in-kernel timer's only with an advance of at least {advance:.1} µs, \
         spun back on every expiry whose wake-up came on time (about {:.0} % of a CPU at this period if the wake-up is at its p50).",
        100.0 * (advance - host50).max(0.0) / period_us as f64
    )
}

/// What the vCPU thread's own signal timer does, against a timer thread on
/// its CPU that wakes and kicks it, with the percentile advance.
fn placement_line(period_us: u64, p50: &[Runs], p99: &[Runs], runs: &[Vec<Run>]) -> String {
    let stalls = |i: usize| {
        let behind = runs[i]
            .iter()
            .filter(|r| stalls_in(&r.lateness, period_us as f64) > 0);
        format!("{} of {}", behind.count(), runs[i].len())
    };
    format!(
        "At {period_us} µs, the percentile advance with each vCPU thread's own signal timer (the default, as KVM's hrtimer kicks its vCPU: no thread to wake) against a timer thread on its vCPU's CPU (--timer-placement {THREAD_PLACEMENT}): p50 {}, p99 {}; runs with a timer over two periods late: {} against {}.",
        p50[PERCENTILE].ratio_to(&p50[THREAD]).ratio_text(),
        p99[PERCENTILE].ratio_to(&p99[THREAD]).ratio_text(),
        stalls(PERCENTILE),
        stalls(THREAD),
    )
}

/// How fast a guest that fell behind catches up. After a stall of the host
/// longer than a period, every deadline the guest arms (the last plus the
/// period) is due already, so each timer comes `period - work` less late than
/// the one before, `work` being the guest's and the VMM's time per timer: the
/// tail a stall leaves is its length over that. No advance shortens it, as
/// a deadline due when armed fires at once.
fn catch_up_line(period_us: u64, runs: &[Vec<Run>]) -> String {
    let period = period_us as f64;
    let pooled = |rows: &[usize]| {
        let runs = rows.iter().flat_map(|&i| &runs[i]);
        let (mut stalls, mut drops) = (0, Vec::new());
        for run in runs {
            stalls += stalls_in(&run.lateness, period);
            drops.extend(catch_up(&run.lateness, period));
        }
        (stalls, Runs(drops).median())
    };
    let (own_stalls, own) = pooled(&[PERCENTILE]);
    let (kernel_stalls, kernel) = pooled(&KERNEL);
    let rate = |stalls: usize, drop: f64| match (stalls, drop.is_nan()) {
        (0, _) => "no timer over two periods late".to_string(),
        (n, true) => format!(
            "{n} stall(s) (a timer over two periods late), none caught up from: at this period this host does not serve the timer, and the p99 is the backlog, not a timer's lateness"
        ),
        (n, false) => format!(
            "{n} stall(s) (a timer over two periods late), then each timer {drop:.1} µs less late than the one before (so {:.1} µs of work per timer, {:.0} % of the period, and {:.0} late timers per ms of stall, which a p99 counts as lateness)",
            period - drop,
            100.0 * (period - drop) / period,
            1000.0 / drop
        ),
    };
    format!(
        "Catching up after a host stall at {period_us} µs (each deadline the last plus the period, so due when armed until the guest is back): percentile advance: {}; KVM's LAPIC: {}. This VMM's APIC takes the guest's HLT, EOI and TSC-deadline write as exits to userspace, KVM's in the kernel; no advance shortens a catch-up.",
        rate(own_stalls, own),
        rate(kernel_stalls, kernel),
    )
}

/// Stalls in a run: the times a timer came over two periods late after one
/// that did not.
fn stalls_in(lateness: &[f64], period_us: f64) -> usize {
    let behind = |l: f64| l > 2.0 * period_us;
    let first = usize::from(lateness.first().is_some_and(|&l| behind(l)));
    first
        + lateness
            .windows(2)
            .filter(|w| !behind(w[0]) && behind(w[1]))
            .count()
}

/// While a run is behind (a timer over two periods late, and the next still
/// over one: its deadline was due when armed), how much less late each next
/// timer came, µs.
fn catch_up(lateness: &[f64], period_us: f64) -> Vec<f64> {
    lateness
        .windows(2)
        .filter(|w| w[0] > 2.0 * period_us && w[1] > period_us && w[1] < w[0])
        .map(|w| w[0] - w[1])
        .collect()
}

/// The host's own timer wake-up: a thread on a periodic timerfd, no guest;
/// each wake-up's lateness, µs.
fn host_wakeups(samples: u64, period_us: u64) -> Result<Vec<f64>, Error> {
    let failed = |e: vmm_sys_util::errno::Error| Error::HostTimer(e.into());
    let period = Duration::from_micros(period_us);
    let mut timer = TimerFd::new().map_err(failed)?;
    let start = Instant::now();
    timer.reset(period, Some(period)).map_err(failed)?;
    let mut fired = 0u32;
    let mut lateness = Vec::with_capacity(samples as usize);
    while (lateness.len() as u64) < samples {
        let expired = u32::try_from(timer.wait().map_err(failed)?).unwrap_or(u32::MAX);
        fired = fired.saturating_add(expired);
        let due = start + period * fired;
        lateness.push(Instant::now().saturating_duration_since(due).as_secs_f64() * 1e6);
    }
    Ok(lateness)
}

/// One run: the lateness of each timer, and the spin per expiry.
fn lateness(m: Choices, samples: u64, period_ticks: u64) -> Result<Run, Error> {
    let (run, lateness) = cyclictest(m, samples, period_ticks)?;
    let stats = &run.report.stats;
    Ok(Run {
        lateness,
        spin_us: (m.irqchip == Irqchip::User)
            .then(|| stats.timer_spin_ns as f64 / 1000.0 / stats.timer_expiries.max(1) as f64),
        polling_us: Some(stats.polled_ns as f64 / 1000.0 / samples.max(1) as f64),
        delivery_us: stats.timer_delivery_p50_us.map(|us| us as f64),
        start_p99_us: stats.timer_start_p99_ns.map(|ns| ns as f64 / 1000.0),
        exits_per_timer: run
            .report
            .vcpus
            .first()
            .map(|v| v.exits as f64 / samples.max(1) as f64),
    })
}

/// Runs the `cyclictest` guest on one vCPU: `samples` TSC deadlines
/// `period_ticks` apart, halting between. Returns the run and each timer's
/// lateness, µs.
pub fn cyclictest(
    m: Choices,
    samples: u64,
    period_ticks: u64,
) -> Result<(Measured, Vec<f64>), Error> {
    let run = measure("cyclictest", 1, m, &[samples, period_ticks], |_| {})?;
    let n = run.report.value(0, "samples").unwrap_or(0).min(samples) as usize;
    let mut bytes = vec![0u8; n * 8];
    run.memory
        .read_slice(&mut bytes, GuestAddress(SAMPLES_ADDR))
        .map_err(|source| Error::ReadMemory {
            what: "the samples",
            source,
        })?;
    let us = ticks_per_us();
    let lateness = bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()) as f64 / us)
        .collect();
    Ok((run, lateness))
}

/// Counts per bucket: below 0, then up to each bound, then above the last.
fn histogram(values: &[f64]) -> String {
    let mut counts = [0usize; BUCKETS.len() + 1];
    for &v in values {
        let bucket = BUCKETS.iter().position(|&b| v < b).unwrap_or(BUCKETS.len());
        counts[bucket] += 1;
    }
    counts.map(|c| c.to_string()).join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_and_early_count() {
        let v = [-1.0, 3.0, 7.0, 12.0, 30.0, 70.0, 200.0];
        assert_eq!(histogram(&v), "1/1/1/1/1/1/1");
        assert_eq!(early(&v), 1);
    }

    #[test]
    fn a_stall_and_its_catch_up_are_found_in_the_lateness_series() {
        // 200 µs period: a 1 ms stall, then 80 µs less late per timer.
        let lateness = [30.0, 25.0, 1000.0, 920.0, 840.0, 760.0, 35.0, 500.0, 30.0];
        assert_eq!(stalls_in(&lateness, 200.0), 2);
        assert_eq!(catch_up(&lateness, 200.0), vec![80.0, 80.0, 80.0]);
        assert_eq!(stalls_in(&[900.0, 20.0], 200.0), 1, "behind from the start");
        assert!(catch_up(&[20.0, 30.0, 25.0], 200.0).is_empty());
        let run = |lateness: &[f64]| Run::of_lateness(lateness.to_vec());
        let mut runs: Vec<Vec<Run>> = (0..ROWS).map(|_| Vec::new()).collect();
        runs[PERCENTILE].push(run(&lateness));
        runs[KERNEL[0]].push(run(&[30.0, 900.0]));
        let line = catch_up_line(200, &runs);
        assert!(line.contains("percentile advance: 2 stall(s)"), "{line}");
        assert!(line.contains("80.0 µs less late"), "{line}");
        assert!(
            line.contains("120.0 µs of work per timer, 60 % of the period"),
            "{line}"
        );
        assert!(
            line.contains(
                "KVM's LAPIC: 1 stall(s) (a timer over two periods late), none caught up from: at this period this host does not serve the timer"
            ),
            "{line}"
        );
        assert!(!line.contains("NaN"), "{line}");
    }

    #[test]
    fn the_tail_goal_holds_only_if_every_run_is_within_the_bound() {
        let run = |p99: f64| Run::of_lateness(vec![p99; 10]);
        let mut runs: Vec<Vec<Run>> = (0..ROWS).map(|_| Vec::new()).collect();
        runs[KERNEL[0]] = vec![run(30.0), run(30.0)];
        runs[PERCENTILE] = vec![run(60.0), run(89.0)];
        let line = tail_goal(200, &runs);
        assert!(line.contains("per run 2.00x, 2.97x: met."), "{line}");
        runs[PERCENTILE][1] = run(3000.0);
        let line = tail_goal(200, &runs);
        assert!(line.contains("per run 2.00x, 100.00x: not met."), "{line}");
        runs[PERCENTILE].clear();
        assert!(
            tail_goal(200, &runs).ends_with(": not met."),
            "no runs, no verdict of met"
        );
    }

    #[test]
    fn the_placement_line_compares_the_percentile_rows_and_counts_stalled_runs() {
        let run = |lateness: &[f64]| Run::of_lateness(lateness.to_vec());
        let mut runs: Vec<Vec<Run>> = (0..ROWS).map(|_| Vec::new()).collect();
        runs[PERCENTILE] = vec![run(&[10.0, 20.0, 30.0]), run(&[10.0, 20.0, 30.0])];
        runs[THREAD] = vec![run(&[20.0, 40.0, 900.0]), run(&[20.0, 40.0, 60.0])];
        let (p50, p99) = (per_run(&runs, 0.5), per_run(&runs, 0.99));
        let line = placement_line(200, &p50, &p99, &runs);
        assert!(line.contains("p50 0.50x"), "{line}");
        assert!(
            line.contains("timer over two periods late: 0 of 2 against 1 of 2"),
            "{line}"
        );
        assert!(line.contains("--timer-placement vcpu-cpu"), "{line}");
    }

    #[test]
    fn the_noise_line_compares_kvms_settings_only_where_they_polled_alike() {
        let run = |tail: f64, polling: f64| Run {
            polling_us: Some(polling),
            ..Run::of_lateness((0..100).map(|i| if i < 2 { tail } else { 18.0 }).collect())
        };
        let mut runs: Vec<Vec<Run>> = (0..ROWS).map(|_| Vec::new()).collect();
        runs[KERNEL[0]] = vec![run(30.0, 115.0), run(40.0, 116.0)];
        runs[KERNEL[1]] = vec![run(20.0, 113.0), run(40.0, 114.0)];
        let line = noise_line(200, &runs);
        assert!(
            line.contains("pooled p99 30.0 against 20.0 µs (1.50x)"),
            "{line}"
        );
        assert!(line.contains("per run 1.50x (1.00-1.50x)"), "{line}");
        runs[KERNEL[1]]
            .iter_mut()
            .for_each(|r| r.polling_us = Some(900.0));
        let line = noise_line(1000, &runs);
        assert!(line.contains("no A/A pair"), "{line}");
    }

    #[test]
    fn the_delivery_line_pairs_each_runs_path_with_its_lateness() {
        let run = |delivery: f64, p50: f64| Run {
            delivery_us: Some(delivery),
            start_p99_us: Some(4.096),
            exits_per_timer: Some(3.0),
            ..Run::of_lateness(vec![p50; 5])
        };
        let mut runs: Vec<Vec<Run>> = (0..ROWS).map(|_| Vec::new()).collect();
        runs[PERCENTILE] = vec![run(19.0, 6.0), run(29.0, 16.0)];
        runs[OWN[1]] = vec![run(20.0, 7.0)];
        runs[KERNEL[0]] = vec![run(99.0, 99.0)];
        let line = delivery_line(200, &runs);
        assert!(
            line.contains(": 3.0/19/4.1/6.0, 3.0/29/4.1/16.0, 3.0/20/4.1/7.0."),
            "{line}"
        );
        assert!(line.contains("at most 13 µs"), "{line}");
    }

    #[test]
    fn the_goal_pools_each_rows_timers_and_needs_nothing_early() {
        // Rows: none, fixed, kvm, percentile, percentile:99, percentile on a
        // timer thread, percentile + polling, kernel, kernel + polling.
        assert_eq!(variants().len(), 9);
        let run = Run::of_lateness;
        // 100 timers a run at `at` µs, `late` of them at `tail` µs: a run's
        // p99 is its 2nd latest, the pooled p99 of two runs their 3rd.
        let series = |at: f64, late: usize, tail: f64| {
            let mut v = vec![at; 100];
            v[..late].iter_mut().for_each(|l| *l = tail);
            v
        };
        let mut runs: Vec<Vec<Run>> = (0..ROWS).map(|_| Vec::new()).collect();
        // Two runs each. The percentile row's tail is in its first run only,
        // the kernel's in both: per run the p99s flip, pooled ours is lower.
        runs[PERCENTILE] = vec![run(series(5.0, 2, 60.0)), run(series(5.0, 0, 0.0))];
        runs[OWN[1]] = vec![run(series(6.0, 2, 70.0)), run(series(6.0, 0, 0.0))];
        for k in KERNEL {
            runs[k] = vec![run(series(18.0, 2, 40.0)), run(series(18.0, 2, 40.0))];
        }
        let line = timer_goal(200, &runs, &[0, 0]);
        assert!(line.contains("p50 5.0 µs against 18.0 µs"), "{line}");
        assert!(line.contains("p99 5.0 µs against 40.0 µs"), "{line}");
        assert!(line.contains("1 of 2 runs met it alone"), "{line}");
        assert!(line.ends_with(": met."), "{line}");
        assert!(timer_goal(200, &runs, &[0, 1]).ends_with(": not met."));
        // A tail in every run of ours: pooled p99 above the kernel's.
        runs[PERCENTILE][1] = run(series(5.0, 2, 60.0));
        runs[OWN[1]][1] = run(series(6.0, 2, 70.0));
        let line = timer_goal(200, &runs, &[0, 0]);
        assert!(line.ends_with(": not met."), "{line}");
        assert!(line.contains("0 of 2 runs"), "{line}");
    }
}
