//! `reference-bench snapshot`: snapshots of a guest that filled its memory
//! and then rewrote a tenth of it. This VMM writes a full one once the
//! memory is filled and an incremental one after the tenth (the migration
//! crate's, from dirty-log's manual protect), and so does Firecracker,
//! booting the same guest, its diff from KVM's dirty log
//! (`track_dirty_pages`) or, without it, from `mincore(2)`. This VMM also
//! writes a full one after the tenth (`run --snapshot-to`), as Cloud
//! Hypervisor does, whose snapshots are full only. Each last snapshot is
//! restored (this VMM's chain, Firecracker's diff onto its full one) and
//! the guest checks every page against its generation.

use std::fs::File;
use std::io::BufReader;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cloud_hypervisor::CloudHypervisor;
use crate::firecracker::Firecracker;
use crate::firecracker_api::{FirecrackerApi, rebase};
use crate::peer::{ImageFile, PeerFigure, PeerKind, Peers, figure_against, goal_against_each};
use crate::peer_run::PeerRun;
use crate::{Cell, Error, Options, Runs, Table, ticks_per_us};
use migration::{
    MigrateOptions, Migration, MigrationError, Mover, SnapshotKind, StreamReader, Target,
    receive_chain,
};
use reference_vmm::RunControl;
use reference_vmm::{RunReport, Vm, VmConfig};
use test_guests::programs as guest;

/// The guest's vCPUs, its memory, and the pages each vCPU rewrites in it
/// (without `--quick`: 219 of its 256 MiB).
const VCPUS: u32 = 2;
const MEM_MIB: u64 = 256;
const PAGES_PER_VCPU: u64 = 28_000;
/// µs between one vCPU's page writes: it fills its pages in
/// `PAGES_PER_VCPU` of them, and rewrites a tenth in a tenth of that.
const WRITE_US: u64 = 100;
/// Firecracker's start, before the guest writes its first page.
const BOOT: Duration = Duration::from_millis(300);
/// How long the guest runs on after its last snapshot.
const AFTER_LAST: Duration = Duration::from_secs(2);

/// One row: who snapshots, and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// This VMM's full snapshot, at the point of Firecracker's diff.
    Full,
    /// This VMM's full snapshot once the memory is filled, then its
    /// incremental one after the tenth (dirty-log's manual protect).
    Incremental,
    /// Cloud Hypervisor's full snapshot, at the same point.
    CloudHypervisor,
    /// Firecracker's full snapshot once the memory is filled, then its diff
    /// after the tenth: from KVM's dirty log, or from mincore.
    Firecracker { dirty_log: bool },
}

const VARIANTS: [Variant; 5] = [
    Variant::Full,
    Variant::Incremental,
    Variant::CloudHypervisor,
    Variant::Firecracker { dirty_log: true },
    Variant::Firecracker { dirty_log: false },
];

/// A snapshot's size and the pause it took.
#[derive(Clone, Copy, Debug)]
struct Taken {
    /// Bytes its files hold on disk (a sparse diff holds only its pages).
    bytes: u64,
    pause: Duration,
}

/// One run of a variant: its snapshots (Firecracker: the full one, then
/// the diff), and the pages the restored guest checked.
struct Sample {
    snapshots: Vec<Taken>,
    pages_checked: u64,
}

/// The guest's size: `(pages per vCPU, MiB)`.
fn size(opts: Options) -> (u64, u64) {
    match opts.quick {
        true => (PAGES_PER_VCPU / 10, 64),
        false => (PAGES_PER_VCPU, MEM_MIB),
    }
}

/// How long filling the pages takes, and rewriting a tenth of them.
fn phases(pages: u64) -> (Duration, Duration) {
    let fill = Duration::from_micros(pages * WRITE_US);
    (fill, fill / 10)
}

/// The `migrate` guest's parameters: `pages` per vCPU rewritten `WRITE_US`
/// apart for `run`, a 1 ms timer on vCPU 0.
fn params(pages: u64, run: Duration) -> Vec<u64> {
    let ticks = ticks_per_us();
    let us = |d: Duration| (d.as_secs_f64() * 1e6 * ticks) as u64;
    vec![
        pages,
        us(run),
        (WRITE_US as f64 * ticks) as u64,
        us(Duration::from_millis(1)),
    ]
}

/// Bytes `path` holds on disk.
fn on_disk(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.blocks() * 512)
}

/// A folder of its own for one run's files, removed after.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Result<Self, Error> {
        let dir = std::env::temp_dir().join(format!("rb-snap-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|source| Error::WriteImage {
            path: dir.clone(),
            source,
        })?;
        Ok(Self(dir))
    }

    fn file(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `migrate` guest's VM: `pages` per vCPU in `mem_mib`, running until
/// `AFTER_LAST` after the tenth.
fn guest_config(pages: u64, mem_mib: u64) -> VmConfig {
    let (fill, tenth) = phases(pages);
    let mut config = VmConfig {
        vcpus: VCPUS,
        mem_mib,
        timeout: Some(Duration::from_secs(300)),
        ..VmConfig::default()
    };
    let p = params(pages, fill + tenth + AFTER_LAST);
    config.params[..p.len()].copy_from_slice(&p);
    config
}

/// This VMM's full snapshot of the guest after it filled its pages and
/// rewrote a tenth (`run --snapshot-to`), then its restore, to the guest's
/// end.
fn full(pages: u64, mem_mib: u64) -> Result<Sample, Error> {
    let (fill, tenth) = phases(pages);
    let config = guest_config(pages, mem_mib);
    let scratch = Scratch::new("full")?;
    let path = scratch.file("vm.snap");
    let options = MigrateOptions {
        after: fill + tenth,
        ..MigrateOptions::default()
    };
    let mut vm = Vm::new(&config)?;
    let moving = Migration::prepare(&mut vm, Target::File(path.clone()), options)?;
    let (tx, taken) = std::sync::mpsc::channel();
    vm.on_start(Box::new(move |control| {
        let _ = tx.send(moving.run(control));
    }));
    vm.run(program(), Box::new(std::io::sink()))?;
    let report = taken
        .recv()
        .map_err(|_| Error::ThreadPanicked("snapshot"))??;
    Ok(Sample {
        snapshots: vec![Taken {
            bytes: on_disk(&path),
            pause: report.downtime,
        }],
        pages_checked: restored_checked(&[path], &config)?,
    })
}

/// This VMM's full snapshot once the guest filled its pages, its
/// incremental one after the tenth, then the chain's restore, to the
/// guest's end.
fn incremental(pages: u64, mem_mib: u64) -> Result<Sample, Error> {
    let (fill, tenth) = phases(pages);
    let config = guest_config(pages, mem_mib);
    let scratch = Scratch::new("incremental")?;
    let files = [scratch.file("base.snap"), scratch.file("increment.snap")];
    let mut vm = Vm::new(&config)?;
    let mut mover = Mover::prepare(&mut vm, MigrateOptions::default())?;
    let (tx, taken) = std::sync::mpsc::channel();
    let chain = files.clone();
    vm.on_start(Box::new(move |control| {
        std::thread::sleep(fill);
        let base = snapshot(&mut mover, control, &chain[0], SnapshotKind::Full);
        std::thread::sleep(tenth);
        let increment = snapshot(&mut mover, control, &chain[1], SnapshotKind::Incremental);
        let _ = tx.send(base.and_then(|base| Ok([base, increment?])));
    }));
    vm.run(program(), Box::new(std::io::sink()))?;
    let pauses = taken
        .recv()
        .map_err(|_| Error::ThreadPanicked("snapshot"))??;
    Ok(Sample {
        snapshots: files
            .iter()
            .zip(pauses)
            .map(|(path, pause)| Taken {
                bytes: on_disk(path),
                pause,
            })
            .collect(),
        pages_checked: restored_checked(&files, &config)?,
    })
}

/// Restores the snapshot chain in `files` with `config`'s mechanisms and
/// runs it to the guest's end: the pages its vCPUs checked.
fn restored_checked(files: &[PathBuf], config: &VmConfig) -> Result<u64, Error> {
    let mut inputs = Vec::new();
    for path in files {
        let file = File::open(path).map_err(|source| Error::WriteImage {
            path: path.clone(),
            source,
        })?;
        inputs.push(StreamReader::new(BufReader::new(file)).map_err(MigrationError::from)?);
    }
    let incoming = receive_chain(&mut inputs, config)?;
    let restored = incoming
        .vm
        .run(incoming.program, Box::new(std::io::sink()))?;
    Ok(checked(&restored))
}

/// A `kind` snapshot of the running guest to `path`: the pause, from the
/// vCPUs' pause to their resume (the file's sync follows it).
fn snapshot(
    mover: &mut Mover,
    control: &RunControl,
    path: &Path,
    kind: SnapshotKind,
) -> Result<Duration, MigrationError> {
    mover
        .snapshot(control, path, kind)
        .map(|report| report.downtime)
}

/// Pages every vCPU of this VMM's restored guest checked.
fn checked(report: &RunReport) -> u64 {
    (0..VCPUS)
        .filter_map(|v| report.value(v, "pages_checked"))
        .sum()
}

/// Pages every vCPU of a peer's restored guest checked.
fn peer_checked(run: &PeerRun) -> u64 {
    (0..VCPUS)
        .filter_map(|v| run.value(v, "pages_checked"))
        .sum()
}

/// Cloud Hypervisor's full snapshot of the guest after it filled its pages
/// and rewrote a tenth, then its restore, to the guest's end.
fn cloud_hypervisor(ch: &CloudHypervisor, pages: u64, mem_mib: u64) -> Result<Sample, Error> {
    let (fill, tenth) = phases(pages);
    let run = fill + tenth + AFTER_LAST;
    let image = ImageFile::write("migrate", VCPUS, mem_mib, &params(pages, run))?;
    let after = BOOT + fill + tenth;
    let timeout = run + Duration::from_secs(30);
    let taken = ch.snapshot_and_restore(image.path(), (VCPUS, mem_mib), after, timeout)?;
    Ok(Sample {
        snapshots: vec![Taken {
            bytes: taken.bytes,
            pause: taken.pause,
        }],
        pages_checked: peer_checked(&taken.restored),
    })
}

/// What one of Firecracker's diff snapshots took: its size on disk and
/// pause, and the pages the guest checked after the diff, rebased onto the
/// full snapshot, was restored.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FirecrackerDiff {
    pub(crate) bytes: u64,
    pub(crate) pause: Duration,
    pub(crate) pages_checked: u64,
    /// The pages the guest wrote, which it checks.
    pub(crate) pages: u64,
}

/// Firecracker `fc`'s full snapshot of the scenario's guest, then its diff
/// (`track_dirty_pages`: KVM's dirty log, else its own choice: mincore, or
/// what an integration patch does), restored and checked: for `bench
/// fc-snapshot`, a patched build beside the release one.
pub(crate) fn firecracker_diff(
    fc: &Firecracker,
    opts: Options,
    track_dirty_pages: bool,
) -> Result<FirecrackerDiff, Error> {
    let (pages, mem_mib) = size(opts);
    let sample = firecracker(fc, pages, mem_mib, track_dirty_pages)?;
    // `firecracker` takes the full snapshot, then the diff.
    let diff = sample.snapshots[1];
    Ok(FirecrackerDiff {
        bytes: diff.bytes,
        pause: diff.pause,
        pages_checked: sample.pages_checked,
        pages: pages * u64::from(VCPUS),
    })
}

/// Firecracker's full snapshot once the guest filled its pages, its diff
/// after the tenth (`dirty_log`: KVM's, else mincore), then the diff
/// rebased onto the full one and restored, to the guest's end.
fn firecracker(
    fc: &Firecracker,
    pages: u64,
    mem_mib: u64,
    dirty_log: bool,
) -> Result<Sample, Error> {
    let (fill, tenth) = phases(pages);
    let run = fill + tenth + AFTER_LAST;
    let image = ImageFile::write("migrate", VCPUS, mem_mib, &params(pages, run))?;
    let scratch = Scratch::new(if dirty_log { "fc-dirty" } else { "fc-mincore" })?;
    let (base, base_state) = (scratch.file("base.mem"), scratch.file("base.snap"));
    let (diff, diff_state) = (scratch.file("diff.mem"), scratch.file("diff.snap"));
    let mut source = FirecrackerApi::start(fc, &scratch.file("source.sock"))?;
    source.boot(image.path(), (VCPUS, mem_mib), dirty_log)?;
    std::thread::sleep(BOOT + fill);
    let full_pause = source.snapshot("Full", &base_state, &base)?;
    let full = Taken {
        bytes: on_disk(&base) + on_disk(&base_state),
        pause: full_pause,
    };
    std::thread::sleep(tenth);
    let diff_pause = source.snapshot("Diff", &diff_state, &diff)?;
    let diff_taken = Taken {
        bytes: on_disk(&diff) + on_disk(&diff_state),
        pause: diff_pause,
    };
    drop(source);
    rebase(&diff, &base)?;
    let mut restored = FirecrackerApi::start(fc, &scratch.file("restored.sock"))?;
    restored.load(&diff_state, &base)?;
    let run = restored.wait(VCPUS, run + Duration::from_secs(30))?;
    Ok(Sample {
        snapshots: vec![full, diff_taken],
        pages_checked: peer_checked(&run),
    })
}

/// Each variant's runs: the snapshots' bytes and pauses, by snapshot.
#[derive(Default)]
struct Cells {
    bytes: Vec<Runs>,
    pause_ms: Vec<Runs>,
    checked: Vec<u64>,
}

impl Cells {
    fn add(&mut self, sample: Sample) {
        for (i, taken) in sample.snapshots.iter().enumerate() {
            if self.bytes.len() <= i {
                self.bytes.push(Runs::new());
                self.pause_ms.push(Runs::new());
            }
            self.bytes[i].push(taken.bytes as f64);
            self.pause_ms[i].push(taken.pause.as_secs_f64() * 1e3);
        }
        self.checked.push(sample.pages_checked);
    }
}

/// Runs the scenario.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let (pages, mem_mib) = size(opts);
    let peers = Peers::find(opts);
    let mut cells: Vec<Cells> = VARIANTS.iter().map(|_| Cells::default()).collect();
    let mut failures: Vec<(PeerKind, String)> = Vec::new();
    for rep in 1..=opts.reps() {
        for (i, variant) in VARIANTS.into_iter().enumerate() {
            let kind = match variant {
                Variant::Full | Variant::Incremental => None,
                Variant::CloudHypervisor => Some(PeerKind::CloudHypervisor),
                Variant::Firecracker { .. } => Some(PeerKind::Firecracker),
            };
            if kind.is_some_and(|k| failures.iter().any(|(f, _)| *f == k))
                || !opts.runs(name(variant))
            {
                continue;
            }
            let mut announce = || progress(&format!("snapshot: {}, run {rep}", name(variant)));
            let sample = match (variant, peers.cloud_hypervisor(), peers.firecracker()) {
                (Variant::Full, ..) => {
                    announce();
                    full(pages, mem_mib)
                }
                (Variant::Incremental, ..) => {
                    announce();
                    incremental(pages, mem_mib)
                }
                (Variant::CloudHypervisor, Some(ch), _) => {
                    announce();
                    cloud_hypervisor(ch, pages, mem_mib)
                }
                (Variant::Firecracker { dirty_log }, _, Some(fc)) => {
                    announce();
                    firecracker(fc, pages, mem_mib, dirty_log)
                }
                _ => continue,
            };
            match (sample, kind) {
                (Ok(sample), _) => cells[i].add(sample),
                // The peer's failure is a finding, not the bench's.
                (Err(Error::Peer(e)), Some(kind)) => failures.push((kind, e.to_string())),
                (Err(e), _) => return Err(e),
            }
        }
    }
    let mut t = Table::new(
        format!(
            "snapshot: {VCPUS} vCPUs, {mem_mib} MiB, the guest filling {} MiB of it, then \
             rewriting a tenth",
            (pages * u64::from(VCPUS) * 4096) >> 20
        ),
        &[
            "variant",
            "snapshot",
            "on disk (MiB)",
            "of the memory",
            "pause (ms)",
            "restored: pages the guest checked",
        ],
    );
    let expected = pages * u64::from(VCPUS);
    for (variant, c) in VARIANTS.into_iter().zip(&cells) {
        rows(&mut t, variant, c, mem_mib, expected);
    }
    notes(&mut t, opts, &peers, &cells, &failures);
    t.note(peers.note());
    Ok(t)
}

fn name(variant: Variant) -> &'static str {
    match variant {
        Variant::Full => "reference-vmm, full",
        Variant::Incremental => "reference-vmm, incremental (dirty-log's manual protect)",
        Variant::CloudHypervisor => "cloud-hypervisor, full (its only kind)",
        Variant::Firecracker { dirty_log: true } => {
            "firecracker, track_dirty_pages (KVM's dirty log)"
        }
        Variant::Firecracker { dirty_log: false } => "firecracker, mincore (no dirty tracking)",
    }
}

fn rows(t: &mut Table, variant: Variant, c: &Cells, mem_mib: u64, expected: u64) {
    let kinds: &[&str] = match variant {
        Variant::Full | Variant::CloudHypervisor => &["full, after the tenth"],
        Variant::Incremental => &["full, once filled", "incremental, after the tenth"],
        Variant::Firecracker { .. } => &["full, once filled", "diff, after the tenth"],
    };
    for (i, kind) in kinds.iter().enumerate().filter(|(i, _)| *i < c.bytes.len()) {
        let bytes = c.bytes[i].median();
        let restored = match i + 1 == kinds.len() {
            true => format!(
                "{} of {expected} (every run)",
                c.checked.iter().min().copied().unwrap_or(0)
            ),
            false => "-".into(),
        };
        t.row(vec![
            Cell::text(name(variant)),
            Cell::text(*kind),
            Cell::num(bytes / 1048576.0, 1),
            Cell::text(format!(
                "{:.0} %",
                100.0 * bytes / (mem_mib as f64 * 1048576.0)
            )),
            Cell::runs(&c.pause_ms[i], 1),
            Cell::text(restored),
        ]);
    }
}

fn notes(
    t: &mut Table,
    opts: Options,
    peers: &Peers,
    cells: &[Cells],
    failures: &[(PeerKind, String)],
) {
    let (pages, _) = size(opts);
    let (fill, tenth) = phases(pages);
    t.better("fewer bytes on disk and a shorter pause, every page checked after the restore");
    t.note(format!(
        "Medians of {} runs per variant, alternating. The guest (migrate) rewrites its pages in \
         turn, one every {WRITE_US} µs per vCPU: it fills them in {} ms and rewrites a tenth in \
         {} ms. Firecracker takes its full snapshot {} ms after InstanceStart (its start, then \
         the fill) and its diff a tenth later; this VMM, incremental, its full one once filled \
         and its incremental one a tenth later; this VMM's and Cloud Hypervisor's full \
         snapshots come at the diff's point (Cloud Hypervisor: ch-remote pause, snapshot, \
         resume, then --restore in a fresh process). \
         On disk: the snapshot files' allocated blocks (a diff's memory file is sparse; an \
         increment is a stream of the dirty page runs). Pause: from the pause to the resume's \
         answer (Firecracker), to the file's sync (this VMM, full: `run --snapshot-to`), or to \
         the resume, before the file's sync (this VMM, incremental: the control socket's way). \
         Restored: Firecracker's diff copied onto its full snapshot's memory (the data regions \
         of the sparse file, as its snapshot-editor's rebase does) and loaded into a fresh \
         process; this VMM's full snapshot with `restore`, and its chain with `restore BASE \
         INCREMENT`; the guest then runs to its end and checks every page against its \
         generation.",
        opts.reps(),
        fill.as_millis(),
        tenth.as_millis(),
        (BOOT + fill).as_millis(),
    ));
    let failure = |kind| {
        let found = failures.iter().find(|(k, _)| *k == kind);
        peers.seen(kind, found.map(|(_, e)| e.as_str()), false)
    };
    let (ch, fc_tracked, fc_mincore) = (2, 3, 4);
    let first = |runs: &[Runs]| runs.first().cloned().unwrap_or_default();
    let diff = |i: usize| cells[i].bytes.get(1).cloned().unwrap_or_default();
    let pause = |i: usize| cells[i].pause_ms.get(1).cloned().unwrap_or_default();
    let (ours, chain) = (&cells[0], &cells[1]);
    let fc = failure(PeerKind::Firecracker);
    let increment = |runs: &[Runs]| runs.get(1).cloned().unwrap_or_default();
    let incremental = [
        ("bytes", &chain.bytes, diff(fc_tracked), 1.0),
        ("pause", &chain.pause_ms, pause(fc_tracked), 1.0),
        ("bytes against mincore", &chain.bytes, diff(fc_mincore), 0.2),
    ]
    .map(|(what, ours, theirs, at_most)| PeerFigure {
        vmm: what,
        ..figure_against(fc, &increment(ours), &theirs, |r| r <= at_most)
    });
    t.peer_goal(goal_against_each(
        "for a guest that filled its memory and then rewrote a tenth of it, this VMM's \
         incremental snapshot at most Firecracker's dirty-tracked diff in bytes and pause, and \
         at most 0.2x the bytes of its mincore diff",
        &incremental,
    ));
    let figures = [
        (PeerKind::CloudHypervisor, ch),
        (PeerKind::Firecracker, fc_tracked),
    ]
    .map(|(kind, at)| {
        let theirs = first(&cells[at].pause_ms);
        figure_against(failure(kind), &first(&ours.pause_ms), &theirs, |r| r <= 1.0)
    });
    t.peer_goal(goal_against_each(
        "this VMM's full snapshot's pause at most each peer's full snapshot's",
        &figures,
    ));
    for (kind, failure) in failures {
        t.note(format!(
            "{}: no result, not run again: {failure}",
            kind.row()
        ));
    }
}

fn program() -> &'static guest::GuestProgram {
    guest::find("migrate").expect("built in")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(bytes: &[u64], pause_ms: u64, pages_checked: u64) -> Sample {
        let snapshots = bytes
            .iter()
            .map(|&bytes| Taken {
                bytes,
                pause: Duration::from_millis(pause_ms),
            })
            .collect();
        Sample {
            snapshots,
            pages_checked,
        }
    }

    #[test]
    fn the_rows_give_each_snapshot_and_the_pages_the_restored_guest_checked() {
        let mut fc = Cells::default();
        fc.add(sample(&[64 << 20, 4 << 20], 100, 5600));
        fc.add(sample(&[64 << 20, 2 << 20], 80, 5599));
        let mut t = Table::new("snapshot", &["a", "b", "c", "d", "e", "f"]);
        rows(
            &mut t,
            Variant::Firecracker { dirty_log: true },
            &fc,
            64,
            5600,
        );
        assert_eq!(t.rows.len(), 2);
        assert_eq!(t.rows[0][2].text, "64.0");
        assert_eq!(t.rows[0][5].text, "-");
        assert_eq!(t.rows[1][3].text, "6 %", "the median of 4 and 2 MiB of 64");
        assert_eq!(
            t.rows[1][5].text, "5599 of 5600 (every run)",
            "the fewest checked"
        );
    }

    #[test]
    fn without_a_peers_runs_its_goals_say_why() {
        let none = Peers::find(Options {
            quick: true,
            qemu: Some(Path::new("/nonexistent")),
            cloud_hypervisor: Some(Path::new("/nonexistent")),
            firecracker: Some(Path::new("/nonexistent")),
            patched_cloud_hypervisor: None,
            patched_firecracker: None,
            only: None,
        });
        let mut ours = Cells::default();
        ours.add(sample(&[20 << 20], 30, 5600));
        let mut chain = Cells::default();
        chain.add(sample(&[60 << 20, 6 << 20], 30, 5600));
        let cells = vec![
            ours,
            chain,
            Cells::default(),
            Cells::default(),
            Cells::default(),
        ];
        let failures = vec![(PeerKind::CloudHypervisor, "it failed".to_owned())];
        let mut t = Table::new("snapshot", &[]);
        notes(
            &mut t,
            Options {
                quick: true,
                qemu: None,
                cloud_hypervisor: None,
                firecracker: None,
                patched_cloud_hypervisor: None,
                patched_firecracker: None,
                only: None,
            },
            &none,
            &cells,
            &failures,
        );
        assert_eq!(
            t.peer_goals.len(),
            2,
            "the incremental one, the pause against each peer"
        );
        assert!(
            t.peer_goals[0].contains("Not measured: bytes: Firecracker "),
            "{}",
            t.peer_goals[0]
        );
        assert!(
            t.peer_goals[1].contains("Not measured: Cloud Hypervisor: Cloud Hypervisor failed in this run: it failed; Firecracker: "),
            "{}",
            t.peer_goals[1]
        );
        assert!(
            t.notes
                .iter()
                .any(|n| n.ends_with("no result, not run again: it failed"))
        );
    }
}
