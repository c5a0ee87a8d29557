//! The source side: dirty tracking set up before the run, pre-copy rounds
//! beside the running guest, then the pause, the stop-and-copy and the
//! hand-over (or, on any failure, the guest resumed).

use std::fmt;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::thread;
use std::time::{Duration, Instant};

use dirty_log::perf::RING_BYTES;
use dirty_log::{
    CopyRun, DirtyLog, DirtySet, KvmBitmap, KvmDirtyRing, KvmManualProtect, ManualConfig,
    copy_round, copy_round_pipelined,
};
use vm_memory::{GuestMemoryBackend, GuestMemoryRegion};

use super::postcopy::Postcopy;
use super::postcopy::pages::PageSet;
use super::postcopy::serve::{self, Out, Reconnect, Served};
use super::stream::{MAX_PAGES_BYTES, StreamError, StreamWriter, random_id, send_pages};
use super::throttle::{Counts, Throttle, kick_paused};
use super::watch::{Limit, Watch, watching};
use super::{Address, Connection, HANDOVER_MARGIN, MigrationError, handover};
use reference_vmm::VcpuState;
use reference_vmm::VmMemory;
use reference_vmm::{RunControl, Vm};
use test_guests::abi::note_migration_ended;
use test_guests::layout::PAGE_SIZE;

/// How long the vCPUs may take to park.
pub(crate) const PAUSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the stream goes.
#[derive(Clone, Debug)]
pub enum Target {
    /// A destination process (`receive --listen`): live migration.
    Peer(Address),
    /// The same, in TLS ([`super::tls`]; TCP only).
    TlsPeer(Address, super::tls::TlsClient),
    /// A file (`restore` reads it): a snapshot, taken with the guest paused.
    File(PathBuf),
}

/// The dirty-log backend that tracks the guest's writes during pre-copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirtyLogBackend {
    /// `KVM_GET_DIRTY_LOG`, which clears and re-protects the whole slot
    /// (what Cloud Hypervisor and Firecracker use).
    Bitmap,
    /// Manual protect with `INITIALLY_SET`, cleared in chunks on a worker.
    #[default]
    Manual,
    /// The per-vCPU dirty ring (the VM must be created with
    /// [`MigrateOptions::dirty_ring`]).
    Ring,
}

reference_vmm::choice_names!(DirtyLogBackend, "--dirty-log", [
    Bitmap => "bitmap", Manual => "manual", Ring => "ring",
]);

/// What a migration prints on stderr as it goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Progress {
    /// Nothing.
    #[default]
    Off,
    /// A line of text per pre-copy round.
    Text,
    /// A JSON object per line: one per pre-copy round (`"event":
    /// "round"`), then the outcome (`"migrated"` with the report, or
    /// `"failed"` with the error).
    Json,
}

reference_vmm::choice_names!(Progress, "--migrate-progress", [
    Off => "off", Text => "text", Json => "json",
]);

/// How a migration runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MigrateOptions {
    /// The dirty-log backend.
    pub backend: DirtyLogBackend,
    /// How long the guest runs before the migration starts.
    pub after: Duration,
    /// Pre-copy stops once a round's pages would take no longer than this
    /// to send at the bandwidth measured; and the guest stands paused at
    /// most this plus [`HANDOVER_MARGIN`] waiting for the destination's
    /// answer, then runs on here.
    pub downtime: Duration,
    /// Pre-copy stops after this many rounds (the full pass counts as one).
    pub max_rounds: u32,
    /// Pre-copy stops once it has run this long (the full pass included),
    /// whatever the rounds left: a guest that dirties faster than the copy
    /// would otherwise keep it going for every round allowed.
    pub max_precopy: Duration,
    /// Once pre-copy reaches `max_rounds` or `max_precopy` without fitting
    /// the downtime, go on with a dirty limit (dirty-log's `DirtyLimit`:
    /// a vCPU above its share pauses after each 20 ms it runs, a strong
    /// pause as sleeps of at most 10 ms between shorter runs), halving its
    /// target each round until a round fits. With the ring only the vCPUs
    /// that write pause; with a bitmap every vCPU does (auto-converge).
    /// Without this, the stop-and-copy starts there.
    pub dirty_limit: bool,
    /// The migration gives up after this long (unless it has committed the
    /// hand-over), the guest running on here. Post-copy's pages after the
    /// hand-over get this long again: past it the guest is lost.
    pub timeout: Duration,
    /// Print each pre-copy round on stderr: its pages, the bandwidth, the
    /// dirty rate, the limit and the downtime a stop now would take.
    pub progress: Progress,
    /// Whether and when the guest moves before all its memory
    /// ([`Postcopy`]); with post-copy there is no dirty limit.
    pub postcopy: Postcopy,
    /// Post-copy: after a cut link, connect to the destination again
    /// (within `timeout`) and go on where it stopped; the destination must
    /// wait for it ([`Resume`](crate::Resume)). Without, a link cut after
    /// the hand-over loses the guest.
    pub resume: bool,
}

impl Default for MigrateOptions {
    fn default() -> Self {
        Self {
            backend: DirtyLogBackend::default(),
            after: Duration::from_millis(200),
            downtime: Duration::from_millis(20),
            max_rounds: 30,
            max_precopy: Duration::from_secs(60),
            dirty_limit: true,
            timeout: Duration::from_secs(300),
            progress: Progress::Off,
            postcopy: Postcopy::Off,
            resume: false,
        }
    }
}

/// The ring under a dirty limit: 4096 entries, so that a writer's ring
/// fills, and it exits where a pause due is taken, every 16 MiB it
/// writes (QEMU's dirty-limit also wants a small ring).
const LIMIT_RING_BYTES: u32 = 64 << 10;

impl MigrateOptions {
    /// The `VmConfig::dirty_ring` the backend needs (the ring must exist
    /// before the vCPUs): smaller with the dirty limit on.
    pub fn dirty_ring(&self) -> Option<u32> {
        let bytes = match self.dirty_limit {
            true => LIMIT_RING_BYTES,
            false => RING_BYTES,
        };
        (self.backend == DirtyLogBackend::Ring).then_some(bytes)
    }
}

/// What a migration did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MigrationReport {
    /// Pre-copy rounds, the full pass included.
    pub rounds: u32,
    /// Pages sent in all, the final round's included.
    pub pages_sent: u64,
    /// Pages sent with the guest paused.
    pub final_pages: u64,
    /// vCPUs that were halted when the guest paused.
    pub halted: usize,
    /// Whether pre-copy stopped because a round fit the downtime target
    /// (not at its round or time limit).
    pub converged: bool,
    /// Pre-copy rounds run under the dirty limit.
    pub limited_rounds: u32,
    /// How many times the dirty limit, as it engaged or after a round under
    /// it, found the guest dirtying memory at 1.5 times its target or more:
    /// each time it gave the vCPUs furthest above their share a pause. Zero
    /// where the limit never had to pause anyone (the guest, slowed by a
    /// busy host, kept under it).
    pub limit_exceeded: u32,
    /// The guest's dirty rate at the last pre-copy round, pages per second
    /// (the ring's per-vCPU counts, else the round's pages over its time).
    pub dirty_rate: u64,
    /// Whether it was a snapshot (no pre-copy: every page written with the
    /// guest paused).
    pub snapshot: bool,
    /// Whether the guest moved in post-copy: it ran at the destination
    /// before all its memory was there.
    pub postcopy: bool,
    /// Post-copy: pages sent after the hand-over, pushed or asked for.
    pub postcopy_pages: u64,
    /// Post-copy: pages the destination asked for (its remote faults).
    pub asked_pages: u64,
    /// Post-copy: new connections after a cut link.
    pub reconnects: u32,
    /// From the first byte sent to the hand-over.
    pub total: Duration,
    /// From the pause to the destination's answer (or the file's sync).
    pub downtime: Duration,
}

impl fmt::Display for MigrationReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.snapshot {
            return write!(
                f,
                "snapshot: {} pages written with the guest paused ({} vCPU(s) halted), {:.1} ms \
                 in all, the file synced",
                self.final_pages,
                self.halted,
                self.total.as_secs_f64() * 1e3
            );
        }
        write!(
            f,
            "migration: {} round(s){}{}, {} pages sent ({} with the guest paused, {} vCPU(s) \
             halted), dirtied at {} pages/s, {:.1} ms in all, downtime {:.3} ms",
            self.rounds,
            match (self.limited_rounds, self.limit_exceeded) {
                (0, _) => String::new(),
                (n, 0) => format!(" ({n} under the dirty limit)"),
                (n, e) => format!(" ({n} under the dirty limit, exceeded {e} time(s))"),
            },
            match (self.converged, self.postcopy) {
                (true, _) => "",
                (false, true) => " (then post-copy)",
                (false, false) => " (pre-copy stopped at its limit)",
            },
            self.pages_sent,
            self.final_pages,
            self.halted,
            self.dirty_rate,
            self.total.as_secs_f64() * 1e3,
            self.downtime.as_secs_f64() * 1e3
        )?;
        if self.postcopy {
            write!(
                f,
                "; post-copy: {} pages after the hand-over, {} asked for, {} reconnection(s)",
                self.postcopy_pages, self.asked_pages, self.reconnects
            )?;
        }
        Ok(())
    }
}

/// A dirty log of any backend, driven one round at a time.
pub(crate) enum Log {
    /// Harvested, then copied.
    Plain(Box<dyn DirtyLog + Send>),
    /// Manual protect: cleared chunk by chunk beside the copy.
    Manual(KvmManualProtect),
}

impl Log {
    pub(crate) fn enable(&mut self) -> Result<(), dirty_log::Error> {
        match self {
            Self::Plain(log) => log.enable(),
            Self::Manual(log) => log.enable(),
        }
    }

    pub(crate) fn disable(&mut self) {
        let _ = match self {
            Self::Plain(log) => log.disable(),
            Self::Manual(log) => log.disable(),
        };
    }

    /// Whether its first round reports every page (`INITIALLY_SET`).
    pub(crate) fn first_round_is_full(&self) -> bool {
        matches!(self, Self::Manual(_))
    }

    pub(crate) fn round(
        &mut self,
        copy: impl FnMut(CopyRun) -> Result<(), dirty_log::Error>,
    ) -> Result<u64, dirty_log::Error> {
        match self {
            Self::Plain(log) => copy_round(log.as_mut(), copy),
            Self::Manual(log) => copy_round_pipelined(log, copy),
        }
    }

    /// The pages dirtied since the last round (the VMM's writes too), into
    /// `set`, a page per guest page. Manual protect's pages are not
    /// re-protected: the guest runs here no more, and clearing a
    /// flat-out writer's pages would lengthen post-copy's pause.
    pub(crate) fn last_round(&mut self, set: &mut PageSet) -> Result<(), dirty_log::Error> {
        let Self::Manual(log) = self else {
            let mut add = |run: CopyRun| {
                set.insert_run(run.guest_addr() / PAGE_SIZE, run.pages);
                Ok(())
            };
            return self.round(&mut add).map(drop);
        };
        let slots = log.slots().to_vec();
        let mut vmm = DirtySet::for_slots(&slots);
        log.merge_vmm_writes(&mut vmm)?;
        for (i, (slot, (_, vmm_dirty))) in slots.iter().zip(vmm.iter()).enumerate() {
            let mut dirty = log.get(i)?;
            dirty.merge(vmm_dirty)?;
            for (first, pages) in dirty.runs() {
                set.insert_run(slot.guest_addr / PAGE_SIZE + first, pages);
            }
        }
        Ok(())
    }
}

/// Where a prepared migration's stream goes: reached before the guest runs.
enum Opened {
    /// A destination that accepted the connection.
    Peer(Connection),
    /// A snapshot file, created (and removed if the snapshot fails).
    File(File, PathBuf),
}

impl Target {
    /// Connects to the destination or creates the file, so that a bad
    /// target fails before the guest starts.
    fn open(&self) -> Result<Opened, MigrationError> {
        match self {
            Self::Peer(address) => address.connect().map(Opened::Peer),
            Self::TlsPeer(address, tls) => address.connect_tls(tls).map(Opened::Peer),
            Self::File(path) => open_snapshot(path).map(|f| Opened::File(f, path.clone())),
        }
    }
}

/// [`create_snapshot`], its error naming `path`.
pub(crate) fn open_snapshot(path: &std::path::Path) -> Result<File, MigrationError> {
    create_snapshot(path).map_err(|source| MigrationError::CreateSnapshot {
        path: path.to_path_buf(),
        source,
    })
}

/// The snapshot file, readable and writable by its owner alone (it holds
/// all guest memory), and never opened through a symbolic link: a link
/// planted where the snapshot goes cannot redirect the write.
fn create_snapshot(path: &std::path::Path) -> std::io::Result<File> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) => std::io::Error::new(
                e.kind(),
                "it is a symbolic link, and a snapshot is never written through one",
            ),
            _ => e,
        })?;
    // An existing file keeps its mode on open.
    file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    Ok(file)
}

/// A migration of one VM, set up before it runs and driven beside it.
pub struct Migration {
    mover: Mover,
    target: Opened,
    /// Where post-copy connects again after a cut link.
    to: Target,
}

impl Migration {
    /// Sets up dirty tracking for `vm` (before it runs: the ring attaches
    /// to the vCPUs, and their threads drain it when it is full), and
    /// connects to the destination or creates the snapshot file: a target
    /// that cannot be reached is an error before any vCPU starts.
    pub fn prepare(
        vm: &mut Vm,
        target: Target,
        options: MigrateOptions,
    ) -> Result<Self, MigrationError> {
        check_postcopy(&target, &options)?;
        let opened = target.open()?;
        let mover = Mover::track(vm, options)?;
        Ok(Self {
            mover,
            target: opened,
            to: target,
        })
    }

    /// Runs the migration beside the guest: waits `after`, sends the VM,
    /// and hands it over. On failure the guest runs on here, without
    /// dirty logging; except [`MigrationError::Unconfirmed`], where the
    /// hand-over was committed and the guest no longer runs here. The
    /// guest's end or a stop ends it at once.
    pub fn run(self, control: &RunControl) -> Result<MigrationReport, MigrationError> {
        let Self {
            mut mover,
            target,
            to,
        } = self;
        mover.move_to(control, target, &to)
    }
}

/// Dirty tracking set up before a VM runs, for the migrations and
/// snapshots a controller decides on while it runs (a control socket):
/// each starts at once, and after one that failed (the guest running on
/// here) another may follow.
pub struct Mover {
    pub(crate) copier: Copier,
    /// The last snapshot's id, while the dirty log tracks the writes since
    /// it: an incremental snapshot follows it.
    pub(crate) chain: Option<u64>,
}

impl fmt::Debug for Mover {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mover")
            .field("options", &self.copier.options)
            .finish_non_exhaustive()
    }
}

impl Mover {
    /// Sets up dirty tracking for `vm` with `options` (before it runs, as
    /// [`Migration::prepare`] does); `options.after` is not used: each
    /// move starts when it is asked for.
    pub fn prepare(vm: &mut Vm, options: MigrateOptions) -> Result<Self, MigrationError> {
        let options = MigrateOptions {
            after: Duration::ZERO,
            ..options
        };
        Self::track(vm, options)
    }

    fn track(vm: &mut Vm, options: MigrateOptions) -> Result<Self, MigrationError> {
        let memory = vm.memory();
        let slots = vm.dirty_slots()?;
        let mut counts = Counts::Rounds(0);
        let log = match options.backend {
            DirtyLogBackend::Bitmap => Log::Plain(Box::new(KvmBitmap::new(&*vm.vm_fd(), slots)?)),
            DirtyLogBackend::Manual => Log::Manual(KvmManualProtect::new(
                &*vm.vm_fd(),
                slots,
                ManualConfig::default(),
            )?),
            DirtyLogBackend::Ring => {
                let bytes = vm.dirty_ring_bytes().unwrap_or(RING_BYTES);
                let ring = KvmDirtyRing::new(&*vm.vm_fd(), slots, bytes)?;
                for (i, fd) in vm.vcpu_fds().iter().enumerate() {
                    ring.attach(i, fd)?;
                }
                vm.set_ring_full(ring.full_handler());
                counts = Counts::Ring(ring.full_handler());
                Log::Plain(Box::new(ring))
            }
        };
        let throttle = Throttle::new(counts, vm.dirty_pauses());
        Ok(Self {
            copier: Copier {
                log,
                options,
                memory,
                throttle,
            },
            chain: None,
        })
    }

    /// Moves the running guest to `target` now, as [`Migration::run`]
    /// does; a snapshot file ends the guest here once written.
    pub fn migrate(
        &mut self,
        control: &RunControl,
        target: &Target,
    ) -> Result<MigrationReport, MigrationError> {
        check_postcopy(target, &self.copier.options)?;
        let opened = target.open()?;
        self.move_to(control, opened, target)
    }

    fn move_to(
        &mut self,
        control: &RunControl,
        target: Opened,
        to: &Target,
    ) -> Result<MigrationReport, MigrationError> {
        if self.chain.take().is_some() {
            // Tracking since a snapshot: the move starts its own from a
            // clean log (manual protect's first round must be every page).
            self.copier.log.disable();
        }
        let copier = &mut self.copier;
        let moved = copier.move_vm(control, target, to);
        copier.throttle.release();
        if copier.options.progress == Progress::Json {
            eprintln!("{}", outcome_json(&moved));
        }
        if moved.is_err() {
            copier.log.disable();
            // The guest runs on here; one that waits for the move may go on.
            let _ = note_migration_ended(&copier.memory);
        }
        moved
    }
}

/// What sends the VM: its dirty log, its memory and the options.
pub(crate) struct Copier {
    pub(crate) log: Log,
    options: MigrateOptions,
    pub(crate) memory: VmMemory,
    /// The dirty rate per vCPU and the limit.
    throttle: Throttle,
}

impl Copier {
    fn move_vm(
        &mut self,
        control: &RunControl,
        target: Opened,
        to: &Target,
    ) -> Result<MigrationReport, MigrationError> {
        if control.wait_for_end(self.options.after) {
            if let Opened::File(_, path) = &target {
                let _ = std::fs::remove_file(path);
            }
            return Err(reference_vmm::PauseError::Ended(control.ended_vcpu()).into());
        }
        let start = Instant::now();
        let mut report = match target {
            Opened::Peer(connection) => {
                let cutter = connection.cutter().map_err(StreamError::Io)?;
                let deadline = start + self.options.timeout;
                let limit = Limit::Migration(self.options.timeout);
                let (mut report, switched) = watching(control, cutter, deadline, limit, |watch| {
                    self.hand_over(control, connection, deadline, watch)
                })?;
                if let Some((out, switch)) = switched {
                    let served = self.serve(out, switch, to)?;
                    report.postcopy_pages = served.pages;
                    report.pages_sent += served.pages;
                    report.asked_pages = served.asked;
                    report.reconnects = served.reconnects;
                }
                report
            }
            Opened::File(file, path) => {
                let saved = self.save(control, file);
                if !matches!(saved, Ok((_, _, Ok(())))) {
                    let _ = std::fs::remove_file(&path);
                }
                let (mut report, paused, synced) = saved?;
                if let Err(e) = synced {
                    control.resume();
                    return Err(e);
                }
                control.hand_over();
                report.downtime = paused.elapsed();
                report
            }
        };
        report.total = start.elapsed();
        Ok(report)
    }

    /// Sends the VM to the destination and hands it over ([`handover`]):
    /// until the commit is sent any failure resumes the guest here; after
    /// it, nothing does. In post-copy, the stream goes on with the pages
    /// still to send.
    fn hand_over(
        &mut self,
        control: &RunControl,
        connection: Connection,
        deadline: Instant,
        watch: &Watch,
    ) -> Result<(MigrationReport, Option<(Out, Switch)>), MigrationError> {
        let mut out =
            StreamWriter::after_header(BufWriter::with_capacity(MAX_PAGES_BYTES, connection));
        let (mut report, paused, switched) = self
            .send(control, &mut out, Some((deadline, watch)))
            .map_err(|e| watch.explain(e))?;
        // Post-copy's answer and commit end the guest's pause (see `send`).
        let _favoured = report.postcopy.then(super::favour::Favoured::this_thread);
        let connection = out.get_mut().get_mut();
        let committed = handover::read_answer(connection)
            .and_then(|()| handover::commit(connection).map_err(MigrationError::NoAnswer));
        if let Err(e) = committed {
            handover::abort(connection);
            control.resume();
            return Err(watch.explain(e));
        }
        report.downtime = paused.elapsed();
        watch.committed();
        control.hand_over();
        handover::read_running(connection).map_err(|e| match watch.explain(e) {
            e @ MigrationError::Unconfirmed(_) => e,
            other => MigrationError::Unconfirmed(other.to_string()),
        })?;
        Ok((report, switched.map(|switch| (out, switch))))
    }

    /// Post-copy after the hand-over: the destination's pages, until it
    /// has them all; connecting to `to` again after a cut link, where the
    /// options say so.
    fn serve(&self, out: Out, switch: Switch, to: &Target) -> Result<Served, MigrationError> {
        let connect = || match to.open()? {
            Opened::Peer(connection) => Ok(connection),
            Opened::File(..) => Err(MigrationError::PostcopyToFile),
        };
        let reconnect = self.options.resume.then_some(Reconnect {
            connect: &connect,
            within: self.options.timeout,
        });
        // The guest waits on these pages at the destination: this thread
        // must not wait behind the host's other tenants.
        let _favoured = super::favour::Favoured::realtime();
        let limit = self.options.timeout;
        serve::serve(
            out,
            &self.memory,
            (switch.needed, switch.id),
            reconnect,
            limit,
        )
    }

    /// Writes a snapshot to `file`: the guest paused, then all its memory
    /// and state; the last item is whether the file reached the disk.
    fn save(
        &mut self,
        control: &RunControl,
        file: File,
    ) -> Result<(MigrationReport, Instant, Result<(), MigrationError>), MigrationError> {
        let mut out = StreamWriter::new(BufWriter::with_capacity(MAX_PAGES_BYTES, file))?;
        let (mut report, paused, _) = self.send(control, &mut out, None)?;
        report.snapshot = true;
        let synced = out.get_mut().get_ref().sync_all().map_err(StreamError::Io);
        Ok((report, paused, synced.map_err(MigrationError::from)))
    }

    /// Sends the whole stream, pre-copy first if given its deadline and
    /// watch (whose deadline the pause then brings forward to the downtime
    /// limit and [`HANDOVER_MARGIN`]); returns with the guest paused, or
    /// resumed and an error. In post-copy the stream holds the pages
    /// still to send in place of their bytes, and those pages come back.
    fn send<W: Deliver>(
        &mut self,
        control: &RunControl,
        out: &mut StreamWriter<W>,
        precopy: Option<(Instant, &Watch)>,
    ) -> Result<(MigrationReport, Instant, Option<Switch>), MigrationError> {
        out.config(control.description())?;
        let mut report = MigrationReport::default();
        let postcopy = self.options.postcopy;
        report.postcopy = precopy.is_some() && postcopy != Postcopy::Off;
        let id = match report.postcopy {
            true => random_id().map_err(StreamError::Io)?,
            false => 0,
        };
        if report.postcopy {
            out.postcopy(id)?;
        }
        if let Some((deadline, _)) = precopy.filter(|_| postcopy != Postcopy::Immediate) {
            self.log.enable()?;
            self.precopy_kicking(control, out, &mut report, deadline)?;
        }
        if report.postcopy {
            // The destination's VM is made before the guest pauses here.
            out.get_mut().made()?;
        }
        // Post-copy's pause is this thread's and the destination's few
        // records: it must not wait behind the host's other tenants.
        let _favoured = report.postcopy.then(super::favour::Favoured::this_thread);
        let states = control.pause(PAUSE_TIMEOUT)?;
        let paused = Instant::now();
        if let Some((_, watch)) = precopy {
            let downtime = self.options.downtime;
            watch.tighten(paused + downtime + HANDOVER_MARGIN, Limit::Pause(downtime));
        }
        let precopy = precopy.is_some();
        report.halted = states.iter().filter(|s| s.is_halted()).count();
        let sent = match report.postcopy {
            true => self
                .switch(out, &states, id)
                .map(|switch| (0, Some(switch))),
            false => self
                .stop_and_copy(out, &states, precopy)
                .map(|pages| (pages, None)),
        };
        match sent {
            Ok((pages, switch)) => {
                report.final_pages = pages;
                report.pages_sent += pages;
                Ok((report, paused, switch))
            }
            Err(e) => {
                control.resume();
                Err(e)
            }
        }
    }

    /// Post-copy's stop: every vCPU's state and, in place of the pages
    /// dirtied since the last round (every page, where no pre-copy ran),
    /// their runs, which the destination will fetch.
    fn switch<W: Write>(
        &mut self,
        out: &mut StreamWriter<W>,
        states: &[VcpuState],
        id: u64,
    ) -> Result<Switch, MigrationError> {
        let pages = (self.memory.last_addr().0 + 1) / PAGE_SIZE;
        let needed = match self.options.postcopy {
            Postcopy::Immediate => PageSet::all(pages),
            _ => {
                let mut needed = PageSet::new(pages);
                self.log.last_round(&mut needed)?;
                needed
            }
        };
        for (page, n) in needed.runs() {
            out.missing(page * PAGE_SIZE, n)?;
        }
        for state in states {
            out.vcpu(state)?;
        }
        out.end()?;
        Ok(Switch { needed, id })
    }

    /// [`Self::precopy`] beside a thread that kicks the vCPUs while the
    /// dirty limit gives any a pause ([`kick_paused`]); the pauses end with
    /// it.
    fn precopy_kicking<W: Deliver>(
        &mut self,
        control: &RunControl,
        out: &mut StreamWriter<W>,
        report: &mut MigrationReport,
        deadline: Instant,
    ) -> Result<(), MigrationError> {
        let pauses = self.throttle.pauses();
        let stop = AtomicBool::new(false);
        thread::scope(|scope| {
            let kicker = scope.spawn(|| kick_paused(&pauses, control, &stop));
            let done = self.precopy(out, report, deadline);
            self.throttle.release();
            stop.store(true, Relaxed);
            kicker.thread().unpark();
            done
        })
    }

    /// Rounds while the guest runs, until one fits the downtime; past the
    /// round or time limit, under a tightening dirty limit where there is
    /// one; an error at `deadline`.
    fn precopy<W: Deliver>(
        &mut self,
        out: &mut StreamWriter<W>,
        report: &mut MigrationReport,
        deadline: Instant,
    ) -> Result<(), MigrationError> {
        let began = Instant::now();
        let hybrid = self.options.postcopy == Postcopy::Hybrid;
        let mut before = None;
        if !self.log.first_round_is_full() {
            let pages = self.send_all(out)?;
            out.get_mut().deliver(deadline)?;
            report.pages_sent += pages;
            report.rounds += 1;
            before = Some(pages);
        }
        loop {
            if Instant::now() >= deadline {
                return Err(MigrationError::TimedOut(self.options.timeout));
            }
            let limited = report.rounds >= self.options.max_rounds
                || began.elapsed() >= self.options.max_precopy;
            if limited && (hybrid || !self.options.dirty_limit) {
                return Ok(());
            }
            if limited {
                self.throttle.tighten();
                report.limit_exceeded = self.throttle.exceeded();
            }
            let under_limit = self.throttle.target().is_some();
            let start = Instant::now();
            let pages = self.dirty_round(out)?;
            out.get_mut().deliver(deadline)?;
            let took = start.elapsed();
            report.rounds += 1;
            report.pages_sent += pages;
            report.limited_rounds += u32::from(under_limit);
            report.dirty_rate = self.throttle.observe(pages) as u64;
            report.limit_exceeded = self.throttle.exceeded();
            self.print_round(report, pages, took);
            // The final round, with the guest paused, will be about as big
            // as this one: once this one fit the downtime, so will that.
            if pages == 0 || took <= self.options.downtime {
                report.converged = true;
                return Ok(());
            }
            // Hybrid: a round that sent no fewer pages than the one before
            // gained nothing; post-copy takes over.
            if hybrid && before.is_some_and(|b| pages >= b) {
                return Ok(());
            }
            before = Some(pages);
        }
    }

    /// A pre-copy round on stderr, with `progress`.
    fn print_round(&self, report: &MigrationReport, pages: u64, took: Duration) {
        let ms = took.as_secs_f64() * 1e3;
        // Pages a second sent, and the time a stop now would take: the
        // pages dirtied at the current rate over a round like this one,
        // at this round's bandwidth.
        let bandwidth = pages as f64 / took.as_secs_f64().max(1e-9);
        let estimate_ms = match pages {
            0 => 0.0,
            _ => report.dirty_rate as f64 * took.as_secs_f64() / bandwidth * 1e3,
        };
        let limit = self.throttle.target();
        match self.options.progress {
            Progress::Off => {}
            Progress::Text => eprintln!(
                "round {}: {pages} pages in {ms:.1} ms ({:.0} MiB/s), dirtied at {} pages/s{}, \
                 downtime now about {estimate_ms:.1} ms",
                report.rounds,
                bandwidth * PAGE_SIZE as f64 / f64::from(1 << 20),
                report.dirty_rate,
                limit.map_or(String::new(), |t| format!(", dirty limit {t:.0} pages/s")),
            ),
            Progress::Json => eprintln!(
                "{}",
                serde_json::json!({
                    "event": "round",
                    "round": report.rounds,
                    "pages": pages,
                    "ms": ms,
                    "bandwidth_pages_per_s": bandwidth.round(),
                    "dirty_rate_pages_per_s": report.dirty_rate,
                    "dirty_limit_pages_per_s": limit.map(f64::round),
                    "downtime_estimate_ms": estimate_ms,
                })
            ),
        }
    }

    /// The last dirty pages (all memory for a snapshot) and every vCPU's state.
    pub(crate) fn stop_and_copy<W: Write>(
        &mut self,
        out: &mut StreamWriter<W>,
        states: &[VcpuState],
        precopy: bool,
    ) -> Result<u64, MigrationError> {
        let pages = match precopy {
            true => self.dirty_round(out)?,
            false => self.send_all(out)?,
        };
        for state in states {
            out.vcpu(state)?;
        }
        out.end()?;
        Ok(pages)
    }

    /// One harvest, and every dirty run sent.
    pub(crate) fn dirty_round<W: Write>(
        &mut self,
        out: &mut StreamWriter<W>,
    ) -> Result<u64, MigrationError> {
        let memory = &self.memory;
        let mut buf = Vec::new();
        let mut failed = None;
        let pages = self.log.round(|run| {
            match send_pages(memory, out, run.guest_addr(), run.len() as u64, &mut buf) {
                Ok(_) => Ok(()),
                Err(e) => {
                    failed = Some(e);
                    Err(dirty_log::Error::Worker(
                        "the migration stream failed".into(),
                    ))
                }
            }
        });
        match (failed, pages) {
            (Some(e), _) => Err(e),
            (None, pages) => Ok(pages?),
        }
    }

    /// One harvest: the dirty runs, sent nowhere.
    pub(crate) fn dirty_runs(&mut self) -> Result<Vec<crate::image::Run>, MigrationError> {
        let mut runs = Vec::new();
        self.log.round(|run| {
            runs.push((run.guest_addr(), run.len() as u64));
            Ok(())
        })?;
        Ok(runs)
    }

    /// Every page of guest memory.
    pub(crate) fn send_all<W: Write>(
        &mut self,
        out: &mut StreamWriter<W>,
    ) -> Result<u64, MigrationError> {
        let mut buf = Vec::new();
        let mut pages = 0;
        for region in self.memory.iter() {
            let (start, len) = (region.start_addr().0, region.len());
            pages += send_pages(&self.memory, out, start, len, &mut buf)?;
        }
        Ok(pages)
    }
}

/// Post-copy's switch: the pages the destination lacks, and the move's id.
struct Switch {
    needed: PageSet,
    id: u64,
}

/// Post-copy needs a destination process: a file target is refused.
fn check_postcopy(target: &Target, options: &MigrateOptions) -> Result<(), MigrationError> {
    match (target, options.postcopy) {
        (Target::File(_), Postcopy::Hybrid | Postcopy::Immediate) => {
            Err(MigrationError::PostcopyToFile)
        }
        _ => Ok(()),
    }
}

/// Where a stream goes, able to say when the other end has it all.
trait Deliver: Write {
    /// Flushes, then waits (until `deadline` at most) until the other end
    /// has taken everything.
    fn deliver(&mut self, deadline: Instant) -> Result<(), StreamError>;

    /// Post-copy: flushes, then waits for the destination to say its VM
    /// is made.
    fn made(&mut self) -> Result<(), MigrationError>;
}

impl Deliver for BufWriter<Connection> {
    fn deliver(&mut self, deadline: Instant) -> Result<(), StreamError> {
        self.flush()?;
        Ok(self.get_ref().wait_delivered(deadline)?)
    }

    fn made(&mut self) -> Result<(), MigrationError> {
        self.flush().map_err(StreamError::Io)?;
        handover::read_made(self.get_mut())
    }
}

impl Deliver for BufWriter<File> {
    fn deliver(&mut self, _: Instant) -> Result<(), StreamError> {
        Ok(self.flush()?)
    }

    fn made(&mut self) -> Result<(), MigrationError> {
        Err(MigrationError::PostcopyToFile)
    }
}

/// A migration's outcome as one JSON object.
fn outcome_json(moved: &Result<MigrationReport, MigrationError>) -> serde_json::Value {
    match moved {
        Ok(r) => serde_json::json!({
            "event": "migrated",
            "rounds": r.rounds,
            "limited_rounds": r.limited_rounds,
            "limit_exceeded": r.limit_exceeded,
            "converged": r.converged,
            "pages_sent": r.pages_sent,
            "final_pages": r.final_pages,
            "halted_vcpus": r.halted,
            "dirty_rate_pages_per_s": r.dirty_rate,
            "total_ms": r.total.as_secs_f64() * 1e3,
            "downtime_ms": r.downtime.as_secs_f64() * 1e3,
            "postcopy": r.postcopy,
            "postcopy_pages": r.postcopy_pages,
            "asked_pages": r.asked_pages,
            "reconnects": r.reconnects,
        }),
        Err(e) => serde_json::json!({ "event": "failed", "error": e.to_string() }),
    }
}
