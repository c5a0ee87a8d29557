//! The family's crates inside a VMM users run, stock against patched
//! (`integrations/`): `reference-bench ch-halt`, Cloud Hypervisor with
//! halt-poll's budget tuner on its own vCPUs, on the halt scenario's
//! guests; `reference-bench ch-migrate`, its live migration with dirty-log's
//! manual protect, and with its ring alone and under the dirty limit, on the
//! migrate scenario's guest; `reference-bench
//! fc-snapshot`, Firecracker's diff snapshots from dirty-log against its
//! own (`mincore`, KVM's log); `reference-bench ch-boost` (its `boost` module),
//! vcpu-sched's delivery boost on Cloud Hypervisor's MSI routes.
//!
//! KVM's polling is counted inside the patched build, which reads its
//! vCPUs' statistics (`CH_HALT_POLL_METER=1` meters KVM's default window
//! without setting one): this host refuses KVM's debugfs, and a stats fd
//! opens only in the VM's own process, so the stock build's polling cannot
//! be read from outside.
//!
//! Not part of `all`: they need a patched build
//! (`integrations/*/apply.sh`), named by `--patched-cloud-hypervisor` or
//! `--patched-firecracker`.

mod boost;
mod builds;

pub use boost::ch_boost;
use builds::{LogFile, cloud_hypervisors};

use crate::cloud_hypervisor::CloudHypervisor;
use crate::firecracker::Firecracker;
use crate::halt::{Sample, Workload, peer_run};
use crate::migrate;
use crate::migrate::cloud_hypervisor::PeerCells;
use crate::peer::{PeerVmm, Peers};
use crate::peer_run::PeerBinary;
use crate::runs::{Runs, goal};
use crate::snapshot;
use crate::table::{Cell, Table};
use crate::{Error, Options};
use test_support::hosts::TwoHosts;

/// The budgets the patched build runs with: the halt scenario's.
const BUDGETS: [f64; 2] = [0.05, 0.2];

/// Short halts, bursts of them, and long ones.
const WORKLOADS: [Workload; 3] = [Workload::PingPong, Workload::Bursty, Workload::IdleTimer];

/// Which build runs, how.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    /// The release build, KVM's default window.
    Stock,
    /// The patched build metering KVM's default window, setting nothing.
    Metered,
    /// The patched build, its tuner at this budget.
    Tuned(f64),
}

const VARIANTS: [Variant; 4] = [
    Variant::Stock,
    Variant::Metered,
    Variant::Tuned(BUDGETS[0]),
    Variant::Tuned(BUDGETS[1]),
];

/// Where in [`VARIANTS`] the metered build is.
const METERED: usize = 1;

impl Variant {
    fn name(self) -> String {
        match self {
            Self::Stock => "stock".into(),
            Self::Metered => "patched, CH_HALT_POLL_METER=1 (KVM's window)".into(),
            Self::Tuned(budget) => format!("patched, CH_HALT_POLL_BUDGET={budget}"),
        }
    }

    /// The binary it runs, logging to `log` where it is the patched one.
    fn binary(
        self,
        stock: &CloudHypervisor,
        patched: &CloudHypervisor,
        log: &LogFile,
    ) -> CloudHypervisor {
        let logging = || log.onto(patched).with_env("CH_HALT_POLL_LOG_MS", "10");
        match self {
            Self::Stock => stock.clone(),
            Self::Metered => logging().with_env("CH_HALT_POLL_METER", "1"),
            Self::Tuned(budget) => logging().with_env("CH_HALT_POLL_BUDGET", &budget.to_string()),
        }
    }
}

/// The share of vCPU time KVM polled, from the patched build's last
/// `halt-poll: ... polled P ns of V ns` log line: NaN where it has none.
fn logged_share(log: &str) -> f64 {
    let last = log.lines().rev().find_map(|line| {
        let (_, rest) = line.split_once("polled ")?;
        let (polled, rest) = rest.split_once(" ns of ")?;
        let vcpu_time = rest.strip_suffix(" ns").unwrap_or(rest);
        Some((
            polled.parse::<f64>().ok()?,
            vcpu_time.trim().parse::<f64>().ok()?,
        ))
    });
    match last {
        Some((polled, vcpu_time)) if vcpu_time > 0.0 => polled / vcpu_time,
        _ => f64::NAN,
    }
}

/// Each variant's runs on one workload: latency, CPU and polling share.
#[derive(Clone, Default)]
struct Cells {
    latency: [Runs; 4],
    cpu: [Runs; 4],
    share: [Runs; 4],
}

impl Cells {
    fn push(&mut self, i: usize, s: &Sample, share: f64) {
        self.latency[i].push(s.latency_us);
        self.cpu[i].push(s.cpu_us);
        self.share[i].push(share);
    }
}

/// `ch-halt`'s rows; without both builds, says how to get them.
pub fn ch_halt(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let mut t = Table::new(
        "ch-halt: halt-poll's budget tuner inside Cloud Hypervisor, stock against patched",
        &[
            "workload",
            "build",
            "latency (µs)",
            "latency vs stock",
            "process CPU per wake-up (µs)",
            "CPU vs stock",
            "polling (% of a vCPU)",
        ],
    );
    let peers = Peers::find(opts);
    let asks =
        BUDGETS.map(|b| format!("Cloud Hypervisor with halt-poll's tuner at a budget of {b}"));
    let Some((stock, patched)) = cloud_hypervisors(opts, &peers, &mut t, &asks) else {
        return Ok(t);
    };
    let mut cells = vec![Cells::default(); WORKLOADS.len()];
    let log = LogFile::new();
    for rep in 0..opts.reps() {
        for (w, workload) in WORKLOADS.into_iter().enumerate() {
            for (i, variant) in VARIANTS.into_iter().enumerate() {
                let what = format!("{}, {}", workload.name(), variant.name());
                progress(&format!("ch-halt: {what} ({}/{})", rep + 1, opts.reps()));
                let binary = variant.binary(stock, &patched, &log);
                let sample = peer_run(PeerVmm::CloudHypervisor(&binary), workload, opts)?;
                let share = match variant {
                    Variant::Stock => f64::NAN,
                    _ => logged_share(&log.take()),
                };
                cells[w].push(i, &sample, share);
            }
        }
    }
    for (workload, c) in WORKLOADS.into_iter().zip(&cells) {
        rows(&mut t, workload, c);
    }
    for (i, budget) in BUDGETS.into_iter().enumerate() {
        t.peer_goal(budget_goal(budget, &cells, METERED + 1 + i));
    }
    t.better("lower latency and CPU; polling within the budget");
    t.note(format!(
        "Stock: {}. Patched: {}, built by integrations/cloud-hypervisor/apply.sh from the same \
         source with the patches there. Latency is the mean round trip (ping-pong, bursty) or \
         the median timer lateness (idle timer); CPU per wake-up is the process's, less a \
         one-round run's (its start-up). Polling is KVM's halt_poll_success_ns + \
         halt_poll_fail_ns as the patched build read them (WindowTuner::polling_total, logged \
         every 10 ms), over the vCPU time since its first read, in the last run of each \
         sample (the measured run; for the idle timer, the one that reports each lateness); \
         the stock build's cannot be read from outside its process here, and the metered \
         row is KVM's same default window.",
        crate::peer_run::describe(stock.binary()),
        crate::peer_run::describe(patched.binary()),
    ));
    Ok(t)
}

/// The dirty limit the patched build's ring runs under (`CH_DIRTY_LIMIT`,
/// MiB/s per vCPU): under the lower rate's 10k pages (39 MiB) per second.
const DIRTY_LIMIT_MIB: &str = "16";

/// `ch-migrate`'s rows: the migrate scenario's guest moved pre-copy over
/// the Unix socket by the release build (`KVM_GET_DIRTY_LOG`) and by the
/// patched one with `CH_DIRTY_LOG=manual`, `ring`, and `ring` under the
/// dirty limit, at both rates, alternating; without both builds, says how
/// to get them.
pub fn ch_migrate(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let mut t = Table::new(
        "ch-migrate: dirty-log under Cloud Hypervisor's live migration, stock against patched",
        &[
            "build",
            "rate",
            "converged",
            "total (ms)",
            "downtime (ms)",
            "longest guest stall (ms)",
        ],
    );
    let peers = Peers::find(opts);
    let asks = [MANUAL_ASKS, RING_ASKS].map(String::from);
    let Some((stock, patched)) = cloud_hypervisors(opts, &peers, &mut t, &asks) else {
        return Ok(t);
    };
    let limit = format!("patched, CH_DIRTY_LOG=ring, CH_DIRTY_LIMIT={DIRTY_LIMIT_MIB}");
    let builds = [
        ("stock (KVM_GET_DIRTY_LOG)".to_string(), stock.clone()),
        (
            "patched, CH_DIRTY_LOG=manual".into(),
            patched.clone().with_env("CH_DIRTY_LOG", "manual"),
        ),
        (
            "patched, CH_DIRTY_LOG=ring".into(),
            patched.clone().with_env("CH_DIRTY_LOG", "ring"),
        ),
        (
            limit,
            (patched.clone().with_env("CH_DIRTY_LOG", "ring"))
                .with_env("CH_DIRTY_LIMIT", DIRTY_LIMIT_MIB),
        ),
    ];
    let rates = migrate::cloud_hypervisor::rates();
    let mut cells: Vec<[PeerCells; 2]> = builds.iter().map(|_| Default::default()).collect();
    let mut failures = Vec::new();
    for rep in 1..=opts.reps() {
        for ((label, ch), cells) in builds.iter().zip(&mut cells) {
            for ((rate, rate_us), c) in rates.into_iter().zip(cells.iter_mut()) {
                progress(&format!("ch-migrate: {label}, {rate}, run {rep}"));
                match migrate::cloud_hypervisor::precopy_once(ch, rate_us, opts)? {
                    Ok(moved) => c.add(moved),
                    Err(e) => failures.push(format!("{label}, {rate}, run {rep}: {e}")),
                }
            }
        }
    }
    let hosts = TwoHosts::new("chi", migrate::LINK_RATE);
    let over_link = [0, 2, 3].map(|i| &builds[i]);
    let mut link_cells: Vec<PeerCells> = over_link.iter().map(|_| Default::default()).collect();
    for rep in 1..=opts.reps() {
        for ((label, ch), c) in over_link.iter().zip(&mut link_cells) {
            progress(&format!(
                "ch-migrate: {label}, flat out over the link, run {rep}"
            ));
            let hosts = hosts.as_ref().ok();
            match migrate::cloud_hypervisor::flat_out_over_link(ch, hosts, opts)? {
                Ok(moved) => c.add(moved),
                Err(e) => failures.push(format!("{label}, over the link, run {rep}: {e}")),
            }
        }
    }
    for ((label, _), cells) in builds.iter().zip(&cells) {
        for ((rate, _), c) in rates.into_iter().zip(cells) {
            t.row(measured_row(label, rate, c, opts.reps()));
        }
    }
    let link_rate = format!("flat out, over the {}/s link", migrate::LINK_RATE);
    for ((label, _), c) in over_link.iter().zip(&link_cells) {
        t.row(measured_row(label, &link_rate, c, opts.reps()));
    }
    let rates: Vec<&str> = rates.iter().map(|(rate, _)| *rate).collect();
    t.peer_goal(manual_goal(&rates, &cells, opts.reps()));
    t.peer_goal(ring_goal(&rates, &cells, &link_cells, opts.reps()));
    t.better("converged in every run, a shorter stall and downtime");
    t.note(format!(
        "Stock: {}. Patched: {}, built by integrations/cloud-hypervisor/apply.sh. Both move the \
         guest as the migrate scenario's Cloud Hypervisor pre-copy rows do (its limits, the \
         Unix socket, seccomp on, this host's nested-state workaround); the guest checks \
         every page on the destination, so a moved run lost no write. CH_DIRTY_LIMIT={} \
         engages the patched build's dirty limit ({} MiB/s of writes per vCPU, each vCPU \
         pausing at most 50 ms at each full ring of one page) once two rounds each dirtied \
         more than half of what the round before sent, as QEMU's dirty-limit does.",
        crate::peer_run::describe(stock.binary()),
        crate::peer_run::describe(patched.binary()),
        DIRTY_LIMIT_MIB,
        DIRTY_LIMIT_MIB,
    ));
    t.note(match &hosts {
        Ok(_) => format!(
            "Over the link: TCP between two network namespaces joined by a veth pair limited to \
             {}/s, pre-copy bounded by {} s, where the first copy alone takes 4.3 s.",
            migrate::LINK_RATE,
            migrate::cloud_hypervisor::LINK_PRECOPY.as_secs()
        ),
        Err(why) => format!("Over the link: loopback, unlimited, since {why}."),
    });
    for failure in failures {
        t.note(format!("no result: {failure}"));
    }
    Ok(t)
}

/// What `ch-migrate`'s manual protect is to show.
const MANUAL_ASKS: &str = "Cloud Hypervisor's live migration with dirty-log's manual protect: \
                           the guest moves in every run at both rates and checks every page on \
                           the destination";

/// What `ch-migrate`'s ring under the dirty limit is to show.
const RING_ASKS: &str = "Cloud Hypervisor's live migration with dirty-log's ring under the \
                         dirty limit: the guest moves in every run at both rates and checks \
                         every page on the destination, and the flat-out writer, faster than \
                         the 1 Gbit/s link, converges over it in every run";

/// `ch-migrate`'s build at position `i` of `cells`: at each rate, how many
/// moves of `reps` moved and converged, and its longest stall against
/// stock's.
fn moves_text(rates: &[&str], cells: &[[PeerCells; 2]], i: usize, reps: usize) -> String {
    let each = rates.iter().zip(cells[i].iter().zip(&cells[0]));
    let texts: Vec<String> = each
        .map(|(rate, (ours, theirs))| {
            let ratio = ours.stall_ms.ratio_to(&theirs.stall_ms).ratio_text();
            let moved = ours.moved_each().iter().filter(|&&m| m).count();
            format!(
                "{rate}: moved {moved} of {reps}, converged {} (stock {}), longest stall {ratio} of \
                 stock",
                ours.converged, theirs.converged
            )
        })
        .collect();
    texts.join("; ")
}

/// Whether manual protect (`cells[1]`) moved the guest in every run.
fn manual_goal(rates: &[&str], cells: &[[PeerCells; 2]], reps: usize) -> String {
    let moved: Vec<bool> = cells[1].iter().flat_map(|c| c.moved_each()).collect();
    let all = moved.len() == 2 * reps && moved.iter().all(|&m| m);
    goal(MANUAL_ASKS, &moves_text(rates, cells, 1, reps), all, &moved)
}

/// Whether the ring under the dirty limit (`cells[3]`, `link[2]`) moved
/// the guest in every run and the flat-out writer converged over the link
/// (`link`: stock, the ring, the ring under the limit) in every run.
fn ring_goal(rates: &[&str], cells: &[[PeerCells; 2]], link: &[PeerCells], reps: usize) -> String {
    let mut met: Vec<bool> = cells[3].iter().flat_map(|c| c.moved_each()).collect();
    met.extend(link[2].moved_each());
    met.extend((0..reps).map(|run| run < link[2].converged));
    let all = met.len() == 4 * reps && met.iter().all(|&m| m);
    let stall = link[2].stall_ms.ratio_to(&link[0].stall_ms).ratio_text();
    let measured = format!(
        "{}; flat out over the link: converged {} of {reps} (the ring alone {}, stock {}), \
         longest stall {stall} of stock",
        moves_text(rates, cells, 3, reps),
        link[2].converged,
        link[1].converged,
        link[0].converged,
    );
    goal(RING_ASKS, &measured, all, &met)
}

/// A row of `label`'s moves at `rate`, `reps` of them.
fn measured_row(label: &str, rate: &str, c: &PeerCells, reps: usize) -> Vec<Cell> {
    let mut row = vec![Cell::text(label), Cell::text(rate)];
    row.extend(migrate::cloud_hypervisor::measured(c, reps));
    row
}

/// A Firecracker build and how its diff snapshots find their pages.
struct FcBuild {
    label: &'static str,
    fc: Firecracker,
    track_dirty_pages: bool,
}

/// `fc-snapshot`'s rows: the snapshot scenario's guest (it fills its
/// pages, is snapshotted in full, rewrites a tenth, is snapshotted as a
/// diff) on the release build, its diff from `mincore` and from KVM's log
/// (`track_dirty_pages`), and on the patched build with each dirty-log
/// backend (`FC_DIRTY_LOG`); each diff rebased onto its full snapshot,
/// restored, and checked by the guest.
pub fn fc_snapshot(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let mut t = Table::new(
        "fc-snapshot: dirty-log for Firecracker's diff snapshots, stock against patched",
        &[
            "build",
            "diff on disk (MiB)",
            "vs mincore",
            "diff pause (ms)",
            "vs mincore",
            "restored: pages the guest checked",
        ],
    );
    let asks = "Firecracker's diff snapshot from dirty-log (each backend): at most 0.2x the \
                bytes and the pause of its mincore diff, every page checked after a restore";
    let peers = Peers::find(opts);
    let patched = opts.patched_firecracker.map(Firecracker::at);
    let (Some(stock), Some(patched)) = (peers.firecracker(), patched) else {
        let how = "build the patched one with integrations/firecracker/apply.sh and name it \
                   with --patched-firecracker";
        let why = match peers.firecracker() {
            Some(_) => how.to_string(),
            None => format!(
                "no stock Firecracker ({}); and {how}",
                crate::firecracker::HINT
            ),
        };
        t.peer_goal(format!("Goal: {asks}. Not measured: {why}."));
        return Ok(t);
    };
    let mut builds = vec![
        FcBuild {
            label: "stock, mincore",
            fc: stock.clone(),
            track_dirty_pages: false,
        },
        FcBuild {
            label: "stock, KVM's log (track_dirty_pages)",
            fc: stock.clone(),
            track_dirty_pages: true,
        },
    ];
    for (label, mode) in [
        ("patched, FC_DIRTY_LOG=manual", "manual"),
        ("patched, FC_DIRTY_LOG=ring", "ring"),
        ("patched, FC_DIRTY_LOG=bitmap", "bitmap"),
    ] {
        let fc = patched.clone().with_env("FC_DIRTY_LOG", mode);
        builds.push(FcBuild {
            label,
            fc,
            track_dirty_pages: false,
        });
    }
    let mut bytes = vec![Runs::new(); builds.len()];
    let mut pause = vec![Runs::new(); builds.len()];
    let mut checked = vec![Vec::new(); builds.len()];
    for rep in 1..=opts.reps() {
        for (i, build) in builds.iter().enumerate() {
            progress(&format!("fc-snapshot: {}, run {rep}", build.label));
            let diff = snapshot::firecracker_diff(&build.fc, opts, build.track_dirty_pages)?;
            bytes[i].push(diff.bytes as f64 / f64::from(1 << 20));
            pause[i].push(diff.pause.as_secs_f64() * 1e3);
            checked[i].push((diff.pages_checked, diff.pages));
        }
    }
    for (i, build) in builds.iter().enumerate() {
        let all: Vec<String> = checked[i]
            .iter()
            .map(|(c, p)| format!("{c} of {p}"))
            .collect();
        t.row(vec![
            Cell::text(build.label),
            Cell::runs(&bytes[i], 1),
            Cell::ratio(&bytes[i].ratio_to(&bytes[0])),
            Cell::runs(&pause[i], 1),
            Cell::ratio(&pause[i].ratio_to(&pause[0])),
            Cell::text(all.join(", ")),
        ]);
    }
    let ours = 2..builds.len();
    let meets: Vec<bool> = ours
        .clone()
        .flat_map(|i| {
            let small = bytes[i].ratio_to(&bytes[0]).each(|r| r <= 0.2);
            let quick = pause[i].ratio_to(&pause[0]).each(|r| r <= 0.2);
            let whole = checked[i].iter().map(|(c, p)| c == p);
            small
                .into_iter()
                .zip(quick)
                .zip(whole)
                .map(|((s, q), w)| s && q && w)
                .collect::<Vec<_>>()
        })
        .collect();
    let measured: Vec<String> = ours
        .map(|i| {
            format!(
                "{}: bytes {}, pause {}",
                builds[i].label,
                bytes[i].ratio_to(&bytes[0]).ratio_text(),
                pause[i].ratio_to(&pause[0]).ratio_text()
            )
        })
        .collect();
    let median_meets = (2..builds.len()).all(|i| {
        let whole = checked[i].iter().all(|(c, p)| c == p);
        let small = bytes[i].ratio_to(&bytes[0]).median() <= 0.2;
        whole && small && pause[i].ratio_to(&pause[0]).median() <= 0.2
    });
    t.peer_goal(goal(asks, &measured.join("; "), median_meets, &meets));
    t.better("a smaller diff and a shorter pause, every page checked");
    t.note(format!(
        "Stock: {}. Patched: {}, built by integrations/firecracker/apply.sh. The guest and the \
         steps are the snapshot scenario's; the patched build keeps its own write bitmap on \
         (Firecracker's writes, ORed into every diff) and registers its slots without \
         KVM_MEM_LOG_DIRTY_PAGES, which dirty-log then switches.",
        crate::peer_run::describe(stock.binary()),
        crate::peer_run::describe(patched.binary()),
    ));
    Ok(t)
}

fn rows(t: &mut Table, workload: Workload, c: &Cells) {
    for (i, variant) in VARIANTS.into_iter().enumerate() {
        let vs_stock = |runs: &[Runs; 4]| match variant {
            Variant::Stock => Cell::text("1"),
            _ => Cell::ratio(&runs[i].ratio_to(&runs[0])),
        };
        t.row(vec![
            Cell::text(workload.name()),
            Cell::text(variant.name()),
            Cell::runs(&c.latency[i], 1),
            vs_stock(&c.latency),
            Cell::runs(&c.cpu[i], 1),
            vs_stock(&c.cpu),
            match variant {
                Variant::Stock => Cell::text("as metered"),
                _ => Cell::num(100.0 * c.share[i].median(), 2),
            },
        ]);
    }
}

/// Whether the variant at position `i` kept its polling within `budget` in
/// every run of every workload, with its latency against stock.
fn budget_goal(budget: f64, cells: &[Cells], i: usize) -> String {
    let within: Vec<bool> = cells
        .iter()
        .flat_map(|c| c.share[i].each(|s| s <= budget))
        .collect();
    let shares: Vec<String> = WORKLOADS
        .iter()
        .zip(cells)
        .map(|(w, c)| {
            let (lo, hi) = c.share[i].range();
            let latency = c.latency[i].ratio_to(&c.latency[0]).ratio_text();
            format!(
                "{} {:.1}–{:.1} % (latency {latency} of stock)",
                w.name(),
                100.0 * lo,
                100.0 * hi
            )
        })
        .collect();
    goal(
        &format!(
            "Cloud Hypervisor with halt-poll's tuner at a budget of {budget}: KVM's polling within \
             {:.0} % of each vCPU in every run",
            100.0 * budget
        ),
        &shares.join("; "),
        within.iter().all(|&w| w),
        &within,
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;

    #[test]
    fn the_share_is_the_last_logged_polling_over_its_vcpu_time() {
        let log = "x: halt-poll: window Some(1µs), polled 10 ns of 100 ns\n\
                   noise\n\
                   x: halt-poll: window None, polled 30 ns of 200 ns\n";
        assert_eq!(logged_share(log), 0.15);
        assert!(logged_share("no such line").is_nan());
        assert!(logged_share("polled 5 ns of 0 ns").is_nan());
    }

    #[test]
    fn without_a_patched_build_each_goal_says_how_to_get_it() {
        let opts = Options {
            quick: true,
            qemu: None,
            cloud_hypervisor: Some(Path::new("/nonexistent")),
            firecracker: None,
            patched_cloud_hypervisor: None,
            patched_firecracker: None,
            only: None,
        };
        let t = ch_halt(opts, &mut |_| {}).unwrap();
        assert_eq!(t.peer_goals.len(), BUDGETS.len());
        assert!(t.peer_goals[0].contains("apply.sh"), "{}", t.peer_goals[0]);
        let t = ch_migrate(opts, &mut |_| {}).unwrap();
        assert_eq!(t.peer_goals.len(), 2, "manual protect, the ring");
        assert!(t.peer_goals.iter().all(|g| g.contains("apply.sh")), "{t:?}");
    }
}
