//! `bench migrate`'s Cloud Hypervisor rows: the same `migrate` guest moved
//! between two Cloud Hypervisor processes, with the same downtime target and
//! the same bound on pre-copy as this VMM's rows (past it, both stop the
//! guest and copy what is left): pre-copy and post-copy over the Unix
//! socket, and pre-copy over the 1 Gbit/s link, at both dirtying rates.

use std::time::Duration;

use super::{Cells, Links, MAX_PRECOPY, RATES, Variant, WRITERS, guest_config};
use crate::Error;
use crate::cloud_hypervisor::CloudHypervisor;
use crate::cloud_hypervisor_api::{MoveLink, MoveRequest, PeerMove};
use crate::peer::{ImageFile, PeerKind, Peers, goal_against_peer};
use crate::peer_run::PeerError;
use crate::peer_run::PeerRun;
use crate::{Cell, Options, Runs, Table, goal, ticks_per_us};
use test_support::hosts;

/// The downtime both VMMs aim for.
const DOWNTIME: Duration = Duration::from_millis(20);
/// How long after the guest starts its move begins (Cloud Hypervisor's
/// boot takes longer than this VMM's, so the first pages are written).
const AFTER: Duration = Duration::from_millis(500);
/// How long the guest runs: past the slowest move, over the link (with
/// `--quick`, a tenth of the memory: a third of the time).
const RUN_UNIX: Duration = Duration::from_secs(6);
const RUN_LINK: Duration = Duration::from_secs(12);
/// The port the destination listens on, over the link.
const PORT: u16 = 46_789;

/// One row's way of moving the guest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    Precopy,
    Postcopy,
    PrecopyOverLink,
}

const HOWS: [How; 3] = [How::Precopy, How::Postcopy, How::PrecopyOverLink];

impl How {
    fn label(self) -> &'static str {
        match self {
            Self::Precopy => "cloud-hypervisor pre-copy",
            Self::Postcopy => "cloud-hypervisor post-copy",
            Self::PrecopyOverLink => "cloud-hypervisor pre-copy, link",
        }
    }

    fn run_time(self, opts: Options) -> Duration {
        let full = match self {
            Self::PrecopyOverLink => RUN_LINK,
            _ => RUN_UNIX,
        };
        if opts.quick { full / 3 } else { full }
    }

    fn link(self, links: &Links) -> MoveLink {
        match (self, &links.hosts) {
            (Self::PrecopyOverLink, Ok(two)) => MoveLink::Tcp {
                source: Some(two.source.clone()),
                destination: Some(two.destination.clone()),
                ip: hosts::DESTINATION_IP.into(),
                port: PORT,
            },
            (Self::PrecopyOverLink, Err(_)) => MoveLink::Tcp {
                source: None,
                destination: None,
                ip: "127.0.0.1".into(),
                port: PORT,
            },
            _ => MoveLink::Unix(
                std::env::temp_dir().join(format!("rb-chm-{}.sock", std::process::id())),
            ),
        }
    }

    fn request(self) -> MoveRequest {
        MoveRequest {
            after: AFTER,
            downtime: DOWNTIME,
            timeout: MAX_PRECOPY,
            postcopy: self == Self::Postcopy,
        }
    }
}

/// Cloud Hypervisor's runs of one way at one rate.
#[derive(Default)]
pub(crate) struct PeerCells {
    total_ms: Runs,
    downtime_ms: Runs,
    pub(crate) stall_ms: Runs,
    moved: usize,
    pub(crate) converged: usize,
    failed: usize,
}

impl PeerCells {
    /// Whether each run moved the guest (`false`: it failed and stayed),
    /// in no particular order.
    pub(crate) fn moved_each(&self) -> Vec<bool> {
        let moved = std::iter::repeat_n(true, self.moved);
        moved
            .chain(std::iter::repeat_n(false, self.failed))
            .collect()
    }

    pub(crate) fn add(&mut self, moved: PeerMove) {
        match moved {
            PeerMove::Moved {
                total,
                downtime,
                converged,
                destination,
            } => {
                self.moved += 1;
                self.converged += usize::from(converged);
                self.total_ms.push(total.as_secs_f64() * 1e3);
                if let Some(d) = downtime {
                    self.downtime_ms.push(d.as_secs_f64() * 1e3);
                }
                self.stall_ms.push(stall_ms(&destination));
            }
            PeerMove::Failed { .. } => self.failed += 1,
        }
    }
}

/// The longest stall any vCPU of a peer's guest saw, ms.
fn stall_ms(run: &PeerRun) -> f64 {
    (0..WRITERS)
        .flat_map(|v| run.values(v, "max_stall_ticks"))
        .max()
        .unwrap_or(0) as f64
        / ticks_per_us()
        / 1000.0
}

/// Cloud Hypervisor's cells, by way then rate, and why it stopped giving
/// results, if it did.
pub(super) struct PeerRows {
    cells: Vec<[PeerCells; 2]>,
    failure: Option<String>,
}

impl PeerRows {
    /// Its cells moving the guest `how` at the lower rate and flat out.
    fn of(&self, how: How) -> &[PeerCells; 2] {
        &self.cells[HOWS.iter().position(|&h| h == how).unwrap_or(0)]
    }
}

/// Moves the guest every way at every rate, `opts.reps()` times each,
/// alternating, and adds a row for each.
pub(super) fn measure(
    t: &mut Table,
    opts: Options,
    progress: &mut dyn FnMut(&str),
    (mem_mib, pages): (u64, u64),
    ch: Option<&CloudHypervisor>,
    links: &Links,
) -> Result<PeerRows, Error> {
    let mut rows = PeerRows {
        cells: HOWS.iter().map(|_| Default::default()).collect(),
        failure: None,
    };
    let Some(ch) = ch else {
        return Ok(rows);
    };
    'runs: for rep in 1..=opts.reps() {
        for (h, how) in HOWS.into_iter().enumerate() {
            for (r, (rate, rate_us)) in RATES.into_iter().enumerate() {
                progress(&format!("migrate: {rate}, {}, run {rep}", how.label()));
                let link = how.link(links);
                match move_once(ch, how, (mem_mib, pages), rate_us, &link, opts)? {
                    Ok(moved) => rows.cells[h][r].add(moved),
                    // The peer's failure is a finding, not the bench's.
                    Err(e) => {
                        rows.failure = Some(e.to_string());
                        break 'runs;
                    }
                }
            }
        }
    }
    for (how, cells) in HOWS.into_iter().zip(&rows.cells) {
        for ((rate, _), c) in RATES.into_iter().zip(cells) {
            t.row(row(how.label(), rate, c, opts.reps()));
        }
    }
    Ok(rows)
}

/// One move of the `migrate` guest (`mem_mib`, `pages` per vCPU, a page
/// every `rate_us`) by `ch`, `how`, over `link`: the bench's error where
/// the image cannot be written, else the move or the peer's failure.
fn move_once(
    ch: &CloudHypervisor,
    how: How,
    guest: (u64, u64),
    rate_us: u64,
    link: &MoveLink,
    opts: Options,
) -> Result<Result<PeerMove, PeerError>, Error> {
    let run = how.run_time(opts);
    move_with(ch, guest, rate_us, link, run, how.request())
}

/// One move of the `migrate` guest running `run`, as `request` asks.
fn move_with(
    ch: &CloudHypervisor,
    (mem_mib, pages): (u64, u64),
    rate_us: u64,
    link: &MoveLink,
    run: Duration,
    request: MoveRequest,
) -> Result<Result<PeerMove, PeerError>, Error> {
    let mut config = guest_config(mem_mib, pages, rate_us, run);
    // No stall reports: under a peer each is a line on its serial port.
    config.params[6] = 0;
    let image = ImageFile::write("migrate", WRITERS, mem_mib, &config.params)?;
    let timeout = run + Duration::from_secs(30);
    let vm = (WRITERS, mem_mib);
    Ok(ch.migrate(image.path(), vm, request, link, timeout))
}

/// The dirtying rates a move runs at, as [`precopy_once`] takes them.
pub(crate) fn rates() -> [(&'static str, u64); 2] {
    RATES
}

/// One pre-copy over the Unix socket by `ch` at `rate_us`, as the migrate
/// scenario's Cloud Hypervisor rows move the guest: for `bench
/// integrations`, a patched build beside the release one.
pub(crate) fn precopy_once(
    ch: &CloudHypervisor,
    rate_us: u64,
    opts: Options,
) -> Result<Result<PeerMove, PeerError>, Error> {
    let link =
        MoveLink::Unix(std::env::temp_dir().join(format!("rb-chi-{}.sock", std::process::id())));
    move_once(ch, How::Precopy, super::memory(opts), rate_us, &link, opts)
}

/// [`flat_out_over_link`]'s bound on pre-copy: the first copy of the
/// 512 MiB guest alone takes 4.3 s at 1 Gbit/s, past the migrate
/// scenario's bound, so a guest whose writes fit the link gets the time to
/// converge.
pub(crate) const LINK_PRECOPY: Duration = Duration::from_secs(15);

/// One pre-copy of the flat-out writer by `ch` over the 1 Gbit/s link
/// between `hosts` (loopback without them), pre-copy bounded by
/// [`LINK_PRECOPY`] (a third with `--quick`): whether a writer faster than
/// the link converges.
pub(crate) fn flat_out_over_link(
    ch: &CloudHypervisor,
    hosts: Option<&hosts::TwoHosts>,
    opts: Options,
) -> Result<Result<PeerMove, PeerError>, Error> {
    let link = MoveLink::Tcp {
        source: hosts.map(|h| h.source.clone()),
        destination: hosts.map(|h| h.destination.clone()),
        ip: match hosts {
            Some(_) => hosts::DESTINATION_IP.into(),
            None => "127.0.0.1".into(),
        },
        port: PORT,
    };
    // With --quick, a tenth of the memory: a third of the bound, and a run
    // that outlasts it (the guest must still be running when it moves).
    let scale = if opts.quick { 3 } else { 1 };
    let request = MoveRequest {
        timeout: LINK_PRECOPY / scale,
        ..How::Precopy.request()
    };
    let run = (LINK_PRECOPY + RUN_LINK - MAX_PRECOPY) / scale;
    move_with(ch, super::memory(opts), RATES[1].1, &link, run, request)
}

/// A row of `label`'s moves at `rate`, `reps` of them.
pub(crate) fn row(label: &str, rate: &str, c: &PeerCells, reps: usize) -> Vec<Cell> {
    let [converged, total, downtime, stall] = measured(c, reps);
    vec![
        Cell::text(label),
        Cell::text(rate),
        Cell::text("-"),
        converged,
        Cell::text("-"),
        total,
        downtime,
        stall,
        Cell::text("-"),
        Cell::text("-"),
        Cell::text("- (the guest checks every page)"),
    ]
}

/// What `reps` moves measured: how many converged (and failed), and the
/// medians of their total time, downtime and longest guest stall (ms).
pub(crate) fn measured(c: &PeerCells, reps: usize) -> [Cell; 4] {
    let median = |runs: &Runs, decimals| match runs.0.is_empty() {
        true => Cell::text("-"),
        false => Cell::runs(runs, decimals),
    };
    let converged = match c.failed {
        0 => format!("{} of {reps}", c.converged),
        n => format!("{} of {reps}; {n} failed, the guest stayed", c.converged),
    };
    [
        Cell::text(converged),
        median(&c.total_ms, 1),
        median(&c.downtime_ms, 2),
        median(&c.stall_ms, 2),
    ]
}

/// The notes and goals against Cloud Hypervisor: at the lower rate over
/// the Unix socket, this VMM's better of manual protect and the ring
/// (`ours`) against its pre-copy; flat out over the link, this VMM's
/// backends with the dirty limit (`limited`) against its pre-copy there.
pub(super) fn notes(
    t: &mut Table,
    peers: &Peers,
    rows: &PeerRows,
    ours: &Cells,
    limited: (&[Variant], &[Cells]),
    reps: usize,
) {
    t.note(format!(
        "Cloud Hypervisor: the same guest moved between two of its processes (ch-remote \
         receive-migration, then send-migration with downtime_ms={}, timeout_s={}, \
         timeout_strategy=ignore: this VMM's downtime target and pre-copy bound, past which \
         both stop the guest and copy what is left; \"converged\": runs whose source did not \
         log that it stopped the guest past its timeout), {} ms after it starts, running {} s \
         ({} s over the link); post-copy with memory_mode=postcopy on both sides. Total: from \
         send-migration until the destination's receive-migration returned; downtime: as its \
         source logged it; the guest's longest stall from the destination's reports, where the \
         guest checked every page. Both processes keep their seccomp filters on. This host \
         needed a patch that takes PVM's EINVAL for KVM_GET_NESTED_STATE as no nested state \
         (../shared/peers/README.md).",
        DOWNTIME.as_millis(),
        MAX_PRECOPY.as_secs(),
        AFTER.as_millis(),
        RUN_UNIX.as_secs(),
        RUN_LINK.as_secs(),
    ));
    let seen = peers.seen(PeerKind::CloudHypervisor, rows.failure.as_deref(), false);
    let precopy = rows.of(How::Precopy);
    t.peer_goal(goal_against_peer(
        seen,
        "at the lower rate over the Unix socket, this VMM's longest guest stall (manual protect \
         or the ring, the better) at most 0.5x Cloud Hypervisor's pre-copy's, with 0 differing \
         bytes",
        &ours.stall_ms,
        &precopy[0].stall_ms,
        |r| r <= 0.5,
    ));
    t.peer_goal(flat_out_goal(seen.why(), rows, limited, reps));
    if let Some(failure) = &rows.failure {
        t.note(format!(
            "cloud-hypervisor: no result, not run again: {failure}"
        ));
    }
}

/// Flat out over the link: this VMM with the dirty limit converges in
/// every run, each backend, where Cloud Hypervisor within the same limits
/// has to stop the guest short of its target.
fn flat_out_goal(
    why_not: String,
    rows: &PeerRows,
    (variants, cells): (&[Variant], &[Cells]),
    reps: usize,
) -> String {
    let asks = "flat out over the link, this VMM with the dirty limit converges in every run \
                with each backend, where Cloud Hypervisor with the same downtime target and \
                pre-copy bound does not";
    let theirs = &rows.of(How::PrecopyOverLink)[1];
    if theirs.moved + theirs.failed == 0 {
        return format!("Goal: {asks}. Not measured: {why_not}.");
    }
    let limited: Vec<(&str, usize)> = variants
        .iter()
        .zip(cells)
        .filter(|(v, _)| v.dirty_limit)
        .map(|(v, c)| (v.label, c.converged))
        .collect();
    let ours_met = limited.iter().all(|&(_, n)| n == reps);
    let measured = format!(
        "{}; Cloud Hypervisor converged in {} of {} (longest stall {:.1} ms)",
        limited
            .iter()
            .map(|(label, n)| format!("{label}: {n} of {reps}"))
            .collect::<Vec<_>>()
            .join(", "),
        theirs.converged,
        theirs.moved + theirs.failed,
        theirs.stall_ms.median(),
    );
    goal(asks, &measured, ours_met && theirs.converged == 0, &[])
}

#[cfg(test)]
mod tests {
    use super::super::LINKED;
    use super::*;

    fn run(stall_ms: f64) -> PeerRun {
        let value = (stall_ms * 1000.0 * ticks_per_us()) as u64;
        let name = "max_stall_ticks".to_owned();
        PeerRun {
            serial: String::new(),
            reports: vec![(1, test_guests::Report { name, value })],
            elapsed: Duration::from_secs(1),
            cpu_time: Duration::ZERO,
        }
    }

    fn moved(stall_ms: f64, converged: bool) -> PeerMove {
        PeerMove::Moved {
            total: Duration::from_millis(600),
            downtime: Some(Duration::from_millis(7)),
            converged,
            destination: run(stall_ms),
        }
    }

    #[test]
    fn a_row_counts_what_converged_and_what_failed() {
        let mut c = PeerCells::default();
        c.add(moved(12.0, true));
        c.add(PeerMove::Failed {
            why: "Timeout reached".into(),
            source: run(300.0),
        });
        let cells = row(How::Precopy.label(), "flat out", &c, 2);
        assert_eq!(cells[3].text, "1 of 2; 1 failed, the guest stayed");
        assert_eq!(cells[5].text, "600.0");
        assert_eq!(cells[7].text, "12.00", "the moved run's stall alone");
    }

    #[test]
    fn the_flat_out_goal_needs_every_limited_backend_converged_and_the_peer_not() {
        let peer = |converged| {
            let mut flat_out = PeerCells::default();
            flat_out.add(moved(1100.0, converged));
            PeerRows {
                cells: vec![
                    Default::default(),
                    Default::default(),
                    [PeerCells::default(), flat_out],
                ],
                failure: None,
            }
        };
        let ours = |n| -> Vec<Cells> {
            LINKED
                .iter()
                .map(|_| Cells {
                    converged: n,
                    ..Cells::default()
                })
                .collect()
        };
        let goal = |rows: &PeerRows, cells: &[Cells]| {
            flat_out_goal("absent".into(), rows, (&LINKED, cells), 1)
        };
        assert!(goal(&peer(false), &ours(1)).ends_with(": met."));
        assert!(goal(&peer(true), &ours(1)).contains("not met"));
        assert!(goal(&peer(false), &ours(0)).contains("not met"));
        let none = PeerRows {
            cells: HOWS.iter().map(|_| Default::default()).collect(),
            failure: None,
        };
        assert!(goal(&none, &ours(1)).contains("Not measured: absent."));
    }
}
