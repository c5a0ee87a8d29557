//! `dirty_log_perf_test`'s measurement, for any VM: enable logging, run
//! iterations of guest writes with a harvest after each, disable; time each
//! step and the longest single ioctl. The VM and how one iteration runs are
//! the caller's (the `perf` example's writer VM, the reference VMM's guest).
//!
//! Not part of the supported API (hidden from the docs): the benchmark
//! machinery behind the `perf` example and `reference-bench dirty`.

use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use crate::KvmBitmap;
use crate::error::Error;
use crate::events::DirtyStats;
use crate::log::{DirtyLog, DirtySet};
use crate::manual::{KvmManualProtect, ManualConfig};
use crate::precopy::copy_round_pipelined;
use crate::ring::{KvmDirtyRing, RingFull};
use crate::slots::Slots;

/// The ring size the measurement uses: 65536 entries.
pub const RING_BYTES: u32 = 1 << 20;

/// A way to track dirty pages, as measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Mode {
    /// `KVM_GET_DIRTY_LOG`.
    Bitmap,
    /// Manual protect, one CLEAR per slot (no chunking).
    ManualWholeSlot,
    /// Manual protect with INITIALLY_SET, 256 KiB CLEARs on a worker thread.
    ManualChunked,
    /// The dirty ring ([`RING_BYTES`] per vCPU).
    Ring,
}

impl Mode {
    /// Every mode, baseline first.
    pub const ALL: [Mode; 4] = [
        Self::Bitmap,
        Self::ManualWholeSlot,
        Self::ManualChunked,
        Self::Ring,
    ];

    /// What the tables call it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bitmap => "bitmap (GET)",
            Self::ManualWholeSlot => "manual protect, whole-slot CLEAR",
            Self::ManualChunked => "manual + INITIALLY_SET, 256 KiB CLEARs off-thread",
            Self::Ring => "dirty ring (64Ki entries)",
        }
    }
}

/// A tracker of one [`Mode`].
pub enum Tracker {
    /// Harvested through [`DirtyLog::harvest`].
    Log(Box<dyn DirtyLog + Send>),
    /// Harvested with [`copy_round_pipelined`].
    Pipelined(KvmManualProtect<Arc<DirtyStats>>),
}

/// Names the variant: a `Box<dyn DirtyLog>` has no `Debug`.
impl std::fmt::Debug for Tracker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Log(_) => "Tracker::Log",
            Self::Pipelined(_) => "Tracker::Pipelined",
        })
    }
}

impl Tracker {
    /// A tracker of `mode` for `slots` of `vm`, reporting to `stats`. For the
    /// ring, `vcpus` are attached (the ring must have been enabled with
    /// [`crate::enable_dirty_ring`] and [`RING_BYTES`] before they were
    /// created) and their full-ring handler comes back.
    pub fn new<F: AsRawFd>(
        mode: Mode,
        vm: &impl AsRawFd,
        slots: Slots,
        stats: Arc<DirtyStats>,
        vcpus: &[&F],
    ) -> Result<(Self, Option<RingFull>), Error> {
        let bytes: u64 = slots
            .as_slice()
            .iter()
            .map(|s| s.pages * crate::PAGE_SIZE)
            .sum();
        let whole_slot = ManualConfig {
            initially_set: false,
            chunk_bytes: bytes.next_multiple_of(256 << 10),
            max_stall: Duration::MAX,
        };
        Ok(match mode {
            Mode::Bitmap => (
                Self::Log(Box::new(KvmBitmap::with_events(vm, slots, stats)?)),
                None,
            ),
            Mode::ManualWholeSlot => (
                Self::Log(Box::new(KvmManualProtect::with_events(
                    vm, slots, whole_slot, stats,
                )?)),
                None,
            ),
            Mode::ManualChunked => (
                Self::Pipelined(KvmManualProtect::with_events(
                    vm,
                    slots,
                    ManualConfig::default(),
                    stats,
                )?),
                None,
            ),
            Mode::Ring => {
                let ring = KvmDirtyRing::with_events(vm, slots, RING_BYTES, stats)?;
                for (i, v) in vcpus.iter().enumerate() {
                    ring.attach(i, *v)?;
                }
                let full = ring.full_handler();
                (Self::Log(Box::new(ring)), Some(full))
            }
        })
    }

    fn log(&mut self) -> &mut dyn DirtyLog {
        match self {
            Self::Log(l) => l.as_mut(),
            Self::Pipelined(l) => l,
        }
    }

    fn harvest(&mut self) -> Result<(), Error> {
        match self {
            Self::Log(l) => l.harvest(&mut DirtySet::for_slots(l.slots())),
            Self::Pipelined(l) => copy_round_pipelined(l, |_| Ok(())).map(|_| ()),
        }
    }
}

/// One mode's measurement: `dirty_log_perf_test`'s columns.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Row {
    /// The first pass over memory, before logging.
    pub populate: Duration,
    /// Enabling logging.
    pub enable: Duration,
    /// Iteration 1's dirty memory time.
    pub first: Duration,
    /// The mean of iterations 2 to N.
    pub rest: Duration,
    /// Total time getting dirty pages (GET; for the ring, collecting entries).
    pub get: Duration,
    /// Total time clearing (CLEAR; for the ring, `KVM_RESET_DIRTY_RINGS`).
    pub clear: Duration,
    /// Disabling logging.
    pub disable: Duration,
    /// The longest single ioctl.
    pub worst_ioctl: Duration,
}

/// The table's column headings, for [`Row::cells`].
pub const COLUMNS: [&str; 10] = [
    "mode",
    "populate",
    "enable",
    "iteration 1",
    "iteration N",
    "1/N",
    "get (total)",
    "clear (total)",
    "disable",
    "longest ioctl",
];

impl Row {
    /// The row's cells, formatted, `mode`'s name first.
    pub fn cells(&self, mode: Mode) -> [String; 10] {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        [
            mode.name().to_string(),
            format!("{:.1} ms", ms(self.populate)),
            format!("{:.3} ms", ms(self.enable)),
            format!("{:.1} ms", ms(self.first)),
            format!("{:.1} ms", ms(self.rest)),
            format!("{:.2}", self.first.as_secs_f64() / self.rest.as_secs_f64()),
            format!("{:.2} ms", ms(self.get)),
            format!("{:.2} ms", ms(self.clear)),
            format!("{:.3} ms", ms(self.disable)),
            format!("{:.0} µs", self.worst_ioctl.as_secs_f64() * 1e6),
        ]
    }
}

/// Measures `mode` through `tracker` (reporting to `stats`): `iterate` runs
/// one pass of guest writes on every vCPU and returns its wall time; it is
/// called once before logging (populate) and `iterations` (2 or more) times
/// after, with a harvest after each.
pub fn measure(
    mode: Mode,
    tracker: &mut Tracker,
    stats: &DirtyStats,
    iterations: usize,
    mut iterate: impl FnMut() -> Result<Duration, Error>,
) -> Result<Row, Error> {
    if iterations < 2 {
        return Err(Error::Config(format!(
            "{iterations} iterations: want 2 or more"
        )));
    }
    let populate = iterate()?;
    let start = Instant::now();
    tracker.log().enable()?;
    let enable = start.elapsed();
    let mut times = Vec::with_capacity(iterations);
    for _ in 0..iterations {
        times.push(iterate()?);
        tracker.harvest()?;
    }
    let start = Instant::now();
    tracker.log().disable()?;
    let disable = start.elapsed();
    let ns = |a: &AtomicU64| Duration::from_nanos(a.load(Relaxed));
    let ring = u32::from(mode == Mode::Ring);
    Ok(Row {
        populate,
        enable,
        first: times[0],
        rest: times[1..].iter().sum::<Duration>() / (times.len() - 1) as u32,
        get: ns(&stats.get_ns) + ns(&stats.harvest_ns).saturating_sub(ns(&stats.reset_ns)) * ring,
        clear: ns(&stats.clear_ns) + ns(&stats.reset_ns),
        disable,
        worst_ioctl: ns(&stats.worst_ioctl_ns),
    })
}
