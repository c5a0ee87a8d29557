//! Manual protect (`KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2`): `KVM_GET_DIRTY_LOG`
//! only copies the bitmap, and `KVM_CLEAR_DIRTY_LOG` re-protects exactly the
//! pages asked for, in chunks small enough that no single call holds KVM's
//! MMU lock (which a faulting vCPU waits for) for long.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use kvm_bindings::{KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE};

use crate::bitmap::DirtyBitmap;
use crate::error::{Error, kvm};
use crate::events::{DirtyEvents, Ioctl, NoEvents};
use crate::ioctls::{MANUAL_PROTECT_INITIALLY_SET, check_extension, clear_dirty_log, enable_cap};
use crate::log::{DirtyLog, DirtySet};
use crate::slots::{PAGE_SIZE, Slot, Slots, Tracked};

/// Pages `KVM_CLEAR_DIRTY_LOG` ranges are aligned to.
pub const CLEAR_ALIGN_PAGES: u64 = 64;

/// How manual protect clears.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ManualConfig {
    /// Start with every page dirty and unprotected (`INITIALLY_SET`):
    /// enabling is O(1), and the first harvest's CLEAR protects lazily.
    pub initially_set: bool,
    /// Largest range one `KVM_CLEAR_DIRTY_LOG` covers: a multiple of 256 KiB
    /// (64 pages). QEMU's smallest `x-clear-bitmap-shift` is the default.
    pub chunk_bytes: u64,
    /// A CLEAR that takes longer halves the chunk (down to 64 pages); one that
    /// takes under a quarter of it doubles the chunk back (up to `chunk_bytes`).
    pub max_stall: Duration,
}

impl Default for ManualConfig {
    fn default() -> Self {
        Self {
            initially_set: true,
            chunk_bytes: 256 << 10,
            max_stall: Duration::from_micros(100),
        }
    }
}

impl ManualConfig {
    fn chunk_pages(&self) -> Result<u64, Error> {
        if self.max_stall.is_zero() {
            return Err(Error::Config(
                "max_stall of 0: no CLEAR is that fast, so every chunk would shrink to the least"
                    .into(),
            ));
        }
        let pages = self.chunk_bytes / PAGE_SIZE;
        if self.chunk_bytes % (CLEAR_ALIGN_PAGES * PAGE_SIZE) != 0 || pages == 0 {
            return Err(Error::Config(format!(
                "chunk of {} bytes: want a non-zero multiple of 256 KiB",
                self.chunk_bytes
            )));
        }
        Ok(pages)
    }
}

/// The manual-protect backend.
#[derive(Debug)]
pub struct KvmManualProtect<E: DirtyEvents = NoEvents> {
    tracked: Tracked<E>,
    config: ManualConfig,
    /// The chunk size now, in pages, adapted to `max_stall`.
    chunk_pages: AtomicU64,
}

impl KvmManualProtect {
    /// Tracks `slots` of the VM whose fd is `vm` with `config`.
    pub fn new(vm: &impl AsRawFd, slots: Slots, config: ManualConfig) -> Result<Self, Error> {
        Self::with_events(vm, slots, config, NoEvents)
    }
}

impl<E: DirtyEvents> KvmManualProtect<E> {
    /// Tracks `slots` of `vm` with `config`, reporting to `events`.
    pub fn with_events(
        vm: &impl AsRawFd,
        slots: Slots,
        config: ManualConfig,
        events: E,
    ) -> Result<Self, Error> {
        let chunk = config.chunk_pages()?;
        Ok(Self {
            tracked: Tracked::new(vm, slots, events)?,
            config,
            chunk_pages: AtomicU64::new(chunk),
        })
    }

    /// `KVM_GET_DIRTY_LOG` of the slot at position `index`: the pages dirtied
    /// since they were last cleared. Nothing is re-protected until
    /// [`clear`](Self::clear); every get must be followed by a clear of what it
    /// returned, before those pages are copied.
    pub fn get(&self, index: usize) -> Result<DirtyBitmap, Error> {
        let slot = self.slot(index)?;
        let words = self.tracked.get_dirty_log(index)?;
        Ok(DirtyBitmap::from_kvm_words(slot.pages, words)?)
    }

    /// Re-protects the pages set in `dirty` of the slot at position `index`,
    /// chunk by chunk in page order, skipping clean chunks; after each chunk
    /// `progress` gets the first page not yet cleared.
    pub fn clear(
        &self,
        index: usize,
        dirty: &DirtyBitmap,
        mut progress: impl FnMut(u64),
    ) -> Result<(), Error> {
        let slot = self.slot(index)?;
        if dirty.pages() != slot.pages {
            return Err(Error::Config(format!(
                "a bitmap of {} pages for slot {} of {}",
                dirty.pages(),
                slot.id,
                slot.pages
            )));
        }
        let mut page = 0;
        while page < slot.pages {
            let n = self.chunk_pages.load(Relaxed).min(slot.pages - page);
            let words = &dirty.kvm_words_from(page)[..n.div_ceil(64) as usize];
            if words.iter().any(|&w| w != 0) {
                self.clear_chunk(slot, page, n, words)?;
            }
            page += n;
            progress(page);
        }
        Ok(())
    }

    fn clear_chunk(&self, slot: Slot, first: u64, pages: u64, words: &[u64]) -> Result<(), Error> {
        let num = u32::try_from(pages).map_err(|_| Error::Config("chunk too large".into()))?;
        let start = Instant::now();
        self.tracked
            .timed(Ioctl::ClearDirtyLog, || {
                clear_dirty_log(&*self.tracked.vm, slot.id, first, num, words)
            })
            .map_err(kvm("KVM_CLEAR_DIRTY_LOG"))?;
        let took = start.elapsed();
        self.adapt(took);
        let count = words.iter().map(|w| u64::from(w.count_ones())).sum();
        self.tracked.events.cleared(count, took);
        Ok(())
    }

    /// Halves the chunk after a slow CLEAR, doubles it back after a fast one.
    fn adapt(&self, took: Duration) {
        let now = self.chunk_pages.load(Relaxed);
        let max = self.config.chunk_bytes / PAGE_SIZE;
        let next = if took > self.config.max_stall {
            (now / 2).max(CLEAR_ALIGN_PAGES) / CLEAR_ALIGN_PAGES * CLEAR_ALIGN_PAGES
        } else if took < self.config.max_stall / 4 {
            (now * 2).min(max)
        } else {
            now
        };
        self.chunk_pages.store(next, Relaxed);
    }

    /// The current chunk size in pages.
    pub fn chunk_pages(&self) -> u64 {
        self.chunk_pages.load(Relaxed)
    }

    fn slot(&self, index: usize) -> Result<Slot, Error> {
        if !self.tracked.enabled {
            return Err(Error::Enabled(false));
        }
        self.slots()
            .get(index)
            .copied()
            .ok_or_else(|| Error::Config(format!("no slot at position {index}")))
    }

    /// Merges the VMM's own writes into `into`.
    pub fn merge_vmm_writes(&self, into: &mut DirtySet) -> Result<(), Error> {
        self.tracked.slots.merge_vmm_writes(into)
    }

    /// The events.
    pub fn events(&self) -> &E {
        &self.tracked.events
    }
}

impl<E: DirtyEvents> DirtyLog for KvmManualProtect<E> {
    fn slots(&self) -> &[Slot] {
        self.tracked.slots.as_slice()
    }

    fn enable(&mut self) -> Result<(), Error> {
        let vm = &*self.tracked.vm;
        let supported = check_extension(vm, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2) as u64;
        let mut flags = u64::from(KVM_DIRTY_LOG_MANUAL_PROTECT_ENABLE);
        if self.config.initially_set {
            flags |= MANUAL_PROTECT_INITIALLY_SET;
        }
        if supported & flags != flags {
            return Err(Error::Unsupported(
                "KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2 with these flags",
            ));
        }
        enable_cap(vm, KVM_CAP_MANUAL_DIRTY_LOG_PROTECT2, flags)
            .map_err(kvm("KVM_ENABLE_CAP(MANUAL_DIRTY_LOG_PROTECT2)"))?;
        self.tracked.set_logging(true)
    }

    /// One GET and the matching chunked CLEAR per slot, then the VMM's writes.
    fn harvest(&mut self, into: &mut DirtySet) -> Result<(), Error> {
        let start = Instant::now();
        let mut found = 0;
        for i in 0..self.slots().len() {
            let dirty = self.get(i)?;
            self.clear(i, &dirty, |_| {})?;
            found += dirty.count();
            into.bitmap_mut(i).merge(&dirty)?;
        }
        self.merge_vmm_writes(into)?;
        self.tracked.events.harvested(found, start.elapsed());
        Ok(())
    }

    fn disable(&mut self) -> Result<(), Error> {
        self.tracked.set_logging(false)
    }
}
