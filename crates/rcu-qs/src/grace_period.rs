//! Grace periods: the global grace-period counter, each reader's published
//! slot, the registry of readers, and the wait for a grace period. A
//! [`Domain`](crate::Domain) owns one [`GpState`], shared with its readers
//! and its reclaim thread.
//!
//! # Protocol (liburcu's QSBR flavour)
//! The domain's counter `gp` is odd and grows by 2 per grace period. Each reader
//! has a slot holding either [`OFFLINE`] (0) or the value of `gp` it last saw. A
//! grace period increments `gp` and waits until every slot is [`OFFLINE`] or
//! equal to the new value. A reader publishes `gp` in a quiescent state, or
//! [`OFFLINE`] for an extended one.
//!
//! Memory ordering:
//! - A reader publishes its slot with Release, and a writer reads slots with
//!   Acquire: a writer that sees a reader quiescent or offline also sees that
//!   the reader's earlier reads are over.
//! - A writer publishes a new pointer, runs a SeqCst fence, then advances `gp`;
//!   a reader loads `gp`, stores the value in its slot, then runs the SeqCst
//!   fence in [`ReaderSlot::publish`]. When the reader's load returns the new
//!   value, the writer's fence (a release fence before the `fetch_add`)
//!   synchronizes with the reader's (an acquire fence after the load): once its
//!   slot says it saw the new grace period, it also sees the new pointer. The
//!   fence pair carries the ordering, so `gp` is Relaxed on both sides. The
//!   writer's fence must stay before the `fetch_add`: after it, a reader could
//!   see the new `gp`, publish it with its own fence first in the SeqCst order,
//!   and still load the old pointer, which the writer frees once it sees that
//!   slot. Loom cannot catch that misplacement: a fence is no scheduling point
//!   in loom, so it runs together with the `fetch_add` before it, and loom
//!   orders SeqCst fences as they run; the argument here is the check.
//! - Two store-then-load handshakes need a SeqCst fence on each side (Dekker): a
//!   reader coming online stores its slot then loads pointers, while a writer
//!   stores a pointer then loads the slots (either the writer sees the reader
//!   online or the reader sees the new pointer); and a reader storing its slot
//!   then loading its `waiting` flag, while a blocking writer stores `waiting`
//!   then re-reads the slot (no lost wake-up).
//!
//! Fences rather than SeqCst accesses, because loom models SeqCst fences (at
//! least as strongly as C11, above) but treats SeqCst accesses as AcqRel: the
//! code loom checks is the code that runs. The quiescent-state fast path is one
//! Relaxed load (a plain load) and a compare.

use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::events::{GracePeriod, RcuEvents};
use crate::sync::Ordering::{Acquire, Relaxed, Release, SeqCst};
use crate::sync::{
    Arc, AtomicBool, AtomicU64, Condvar, Mutex, ThreadId, current_thread, fence, lock, spin_hint,
    wait,
};

/// A slot value meaning "this reader is in an extended quiescent state".
pub(crate) const OFFLINE: u64 = 0;
/// The first value of the grace-period counter (odd, so never [`OFFLINE`]).
const GP_START: u64 = 1;
/// How much each grace period adds to the counter.
const GP_STEP: u64 = 2;

/// One reader's published state, on its own cache line.
#[derive(Debug)]
pub(crate) struct ReaderSlot {
    state: CachePadded<SlotState>,
    /// The thread that registered the reader.
    pub(crate) owner: ThreadId,
}

#[derive(Debug)]
struct SlotState {
    ctr: AtomicU64,
    /// Set by a writer about to block on this reader.
    waiting: AtomicBool,
}

impl ReaderSlot {
    pub(crate) fn new(owner: ThreadId) -> Self {
        let state = SlotState {
            ctr: AtomicU64::new(OFFLINE),
            waiting: AtomicBool::new(false),
        };
        Self {
            state: CachePadded::new(state),
            owner,
        }
    }

    pub(crate) fn is_online(&self) -> bool {
        self.state.ctr.load(Acquire) != OFFLINE
    }

    /// Publishes `ctr`; returns whether a blocked writer must be woken.
    ///
    /// The fence orders the store before the caller's next loads: the `waiting`
    /// flag here, and RCU-protected pointers after coming online. It is also
    /// the acquire side for the counter the caller loaded and publishes: it
    /// synchronizes with the writer's fence before that value's `fetch_add`.
    pub(crate) fn publish(&self, ctr: u64) -> bool {
        self.state.ctr.store(ctr, Release);
        fence(SeqCst);
        self.state.waiting.load(Relaxed) && self.state.waiting.swap(false, Relaxed)
    }

    /// Whether this reader has no reference from before grace period `gp`.
    fn passed(&self, gp: u64) -> bool {
        let ctr = self.state.ctr.load(Acquire);
        ctr == OFFLINE || ctr == gp
    }
}

/// Grace periods requested and finished, to batch concurrent callers.
#[derive(Debug, Default)]
struct GpSequence {
    started: u64,
    completed: u64,
}

/// Everything grace periods need; shared with the reclaim thread.
pub(crate) struct GpState {
    gp: CachePadded<AtomicU64>,
    registry: Mutex<Vec<Arc<ReaderSlot>>>,
    sequence: Mutex<GpSequence>,
    sequence_done: Condvar,
    /// A writer waiting for readers blocks here; readers wake it.
    writer: Mutex<()>,
    writer_wake: Condvar,
    spin: Duration,
    pub(crate) events: std::sync::Arc<dyn RcuEvents>,
}

impl GpState {
    /// No readers, the counter at its start; a writer spins `spin` before it
    /// blocks, and grace periods are reported to `events`.
    pub(crate) fn new(spin: Duration, events: std::sync::Arc<dyn RcuEvents>) -> Self {
        Self {
            gp: CachePadded::new(AtomicU64::new(GP_START)),
            registry: Mutex::new(Vec::new()),
            sequence: Mutex::new(GpSequence::default()),
            sequence_done: Condvar::new(),
            writer: Mutex::new(()),
            writer_wake: Condvar::new(),
            spin,
            events,
        }
    }

    /// The current grace-period counter. Relaxed, because the load carries no
    /// ordering of its own: a reader acts on a new value only by publishing it,
    /// and the fence in [`ReaderSlot::publish`] after that store synchronizes
    /// with the fence the writer ran before advancing the counter (see the
    /// module docs). A value equal to the reader's own copy was published, fence
    /// included, when the reader first saw it.
    pub(crate) fn counter(&self) -> u64 {
        self.gp.load(Relaxed)
    }

    /// How many readers are registered.
    pub(crate) fn readers(&self) -> usize {
        lock(&self.registry).len()
    }

    pub(crate) fn register(&self, slot: Arc<ReaderSlot>) {
        lock(&self.registry).push(slot);
    }

    pub(crate) fn unregister(&self, slot: &Arc<ReaderSlot>) {
        lock(&self.registry).retain(|s| !Arc::ptr_eq(s, slot));
    }

    /// Wakes a writer blocked in a grace period.
    pub(crate) fn wake_writer(&self) {
        let _guard = lock(&self.writer);
        self.writer_wake.notify_all();
    }

    /// Whether the calling thread has an online reader in this domain.
    pub(crate) fn caller_is_online(&self) -> bool {
        let me = current_thread().id();
        lock(&self.registry)
            .iter()
            .any(|s| s.owner == me && s.is_online())
    }

    /// Waits for a grace period that starts after this call, sharing it with
    /// concurrent callers. The caller must not be an online reader.
    pub(crate) fn wait_for_grace_period(&self) {
        let mut seq = lock(&self.sequence);
        // A grace period already running may have started before this call.
        let needed = seq.started + 1;
        while seq.completed < needed {
            if seq.started == seq.completed {
                seq.started += 1;
                let this = seq.started;
                drop(seq);
                let gp = self.run_grace_period();
                self.events.grace_period(&gp);
                seq = lock(&self.sequence);
                seq.completed = this;
                self.sequence_done.notify_all();
            } else {
                seq = wait(&self.sequence_done, seq);
            }
        }
    }

    /// Advances the counter and waits until every reader passed a quiescent state.
    fn run_grace_period(&self) -> GracePeriod {
        let start = Instant::now();
        let readers = lock(&self.registry).clone();
        // Pairs with the fence in `ReaderSlot::publish`, twice (see the module
        // docs): before the slot loads, for a reader coming online; before the
        // counter's advance, for a reader that publishes the new value.
        fence(SeqCst);
        let gp = self.gp.fetch_add(GP_STEP, Relaxed) + GP_STEP;
        let mut active: Vec<&ReaderSlot> = readers
            .iter()
            .map(|s| &**s)
            .filter(|s| !s.passed(gp))
            .collect();
        let readers_waited_on = active.len();
        let mut blocked = false;
        while !active.is_empty() {
            if start.elapsed() < self.spin {
                spin_hint();
            } else {
                blocked = true;
                self.block_until_progress(&active, gp);
            }
            active.retain(|s| !s.passed(gp));
        }
        GracePeriod {
            wait: start.elapsed(),
            readers_waited_on,
            blocked,
        }
    }

    /// Blocks until one of `active` may have passed a quiescent state.
    fn block_until_progress(&self, active: &[&ReaderSlot], gp: u64) {
        let guard = lock(&self.writer);
        for s in active {
            s.state.waiting.store(true, Relaxed);
        }
        // Pairs with the fence in `publish`: a reader that published before
        // seeing `waiting` is seen here.
        fence(SeqCst);
        if active.iter().any(|s| s.passed(gp)) {
            return;
        }
        drop(wait(&self.writer_wake, guard));
    }
}
