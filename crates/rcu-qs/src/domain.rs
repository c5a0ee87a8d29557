//! The RCU domain: what readers register with, writers wait on, and
//! retired values wait in (the protocol is in `grace_period`).

#[cfg(not(loom))]
use std::mem;
use std::sync::atomic::AtomicU64 as StdAtomicU64;
use std::time::Duration;

use crate::error::RcuError;
use crate::events::{NoEvents, RcuEvents};
use crate::grace_period::GpState;
use crate::sync::Arc;

/// How long a writer spins re-checking the readers before it blocks, by default.
///
/// Long enough to catch readers that note a quiescent state every few tens of
/// microseconds without a sleep/wake round trip (tens of microseconds on a busy
/// host), short enough not to matter next to a vCPU's time slice.
#[cfg(not(loom))]
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);
/// Under loom there is no time: block at once.
#[cfg(loom)]
pub const DEFAULT_SPIN: Duration = Duration::ZERO;

/// Default bound on the bytes of values waiting for reclamation.
pub const DEFAULT_MAX_PENDING_BYTES: usize = 64 << 20;

/// An RCU domain: readers register with it, writers wait for its grace periods,
/// and its reclaim thread frees what writers retire.
///
/// Cheap to clone: clones are handles to the same domain. The reclaim thread
/// starts with the first deferred value, and finishes every pending reclamation
/// before the last handle (domain, reader or cell) is gone.
#[derive(Clone)]
pub struct Domain {
    pub(crate) inner: Arc<DomainInner>,
}

pub(crate) struct DomainInner {
    pub(crate) gp: std::sync::Arc<GpState>,
    /// Identifies the domain, so a cell can tell its readers from others'.
    pub(crate) id: u64,
    #[cfg(not(loom))]
    pub(crate) reclaim: crate::reclaim::Reclaimer,
}

/// How to build a [`Domain`].
#[derive(Clone)]
pub struct DomainBuilder {
    spin: Duration,
    max_pending_bytes: usize,
    events: std::sync::Arc<dyn RcuEvents>,
}

impl std::fmt::Debug for DomainBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DomainBuilder")
            .field("spin", &self.spin)
            .field("max_pending_bytes", &self.max_pending_bytes)
            .finish_non_exhaustive()
    }
}

impl Default for DomainBuilder {
    fn default() -> Self {
        Self {
            spin: DEFAULT_SPIN,
            max_pending_bytes: DEFAULT_MAX_PENDING_BYTES,
            events: std::sync::Arc::new(NoEvents),
        }
    }
}

impl DomainBuilder {
    /// How long a writer spins before blocking ([`DEFAULT_SPIN`]).
    pub fn spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Bound on bytes of deferred values not yet reclaimed
    /// ([`DEFAULT_MAX_PENDING_BYTES`]); beyond it, deferring waits.
    pub fn max_pending_bytes(mut self, bytes: usize) -> Self {
        self.max_pending_bytes = bytes;
        self
    }

    /// Where metrics go (none by default).
    pub fn events(mut self, events: std::sync::Arc<dyn RcuEvents>) -> Self {
        self.events = events;
        self
    }

    /// The domain.
    pub fn build(self) -> Domain {
        static NEXT_ID: StdAtomicU64 = StdAtomicU64::new(1);
        let gp = std::sync::Arc::new(GpState::new(self.spin, self.events));
        #[cfg(not(loom))]
        let reclaim = crate::reclaim::Reclaimer::new(gp.clone(), self.max_pending_bytes);
        #[cfg(loom)]
        let _ = self.max_pending_bytes;
        let inner = DomainInner {
            gp,
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            #[cfg(not(loom))]
            reclaim,
        };
        Domain {
            inner: Arc::new(inner),
        }
    }
}

impl Default for Domain {
    fn default() -> Self {
        Self::new()
    }
}

impl Domain {
    /// A domain with the default settings.
    pub fn new() -> Self {
        DomainBuilder::default().build()
    }

    /// Settings for a new domain.
    pub fn builder() -> DomainBuilder {
        DomainBuilder::default()
    }

    /// Waits until every reader online when the call began has passed a quiescent
    /// state; offline readers never delay it. Concurrent callers share one grace
    /// period. The writer spins for a while, then blocks until readers wake it.
    ///
    /// # Errors
    /// [`RcuError::OnlineReader`] if the calling thread has an online reader of
    /// this domain: the grace period would wait for the caller itself. Use
    /// `Reader::synchronize` from reader threads.
    pub fn synchronize(&self) -> Result<(), RcuError> {
        if self.inner.gp.caller_is_online() {
            return Err(RcuError::OnlineReader);
        }
        self.inner.gp.wait_for_grace_period();
        Ok(())
    }
}

// Reclamation, where this build has a reclaim thread (not under loom).
#[cfg(not(loom))]
impl Domain {
    /// Drops `value` after a grace period, on the domain's reclaim thread.
    ///
    /// Returns at once unless more than the domain's
    /// [`max_pending_bytes`](crate::DomainBuilder::max_pending_bytes) are waiting:
    /// then it waits for reclamation to catch up, except on a thread with an
    /// online reader of this domain (which that reclamation would wait for).
    pub fn defer<T: Send + 'static>(&self, value: T) {
        self.inner
            .reclaim
            .enqueue(mem::size_of::<T>(), Box::new(move || drop(value)));
    }

    /// Drops a boxed value after a grace period, accounting for its heap size.
    pub fn defer_box<T: Send + 'static>(&self, value: Box<T>) {
        self.inner
            .reclaim
            .enqueue(mem::size_of::<T>(), Box::new(move || drop(value)));
    }

    /// Runs `callback` after a grace period, on the reclaim thread (`call_rcu`).
    /// Back-pressure as for [`defer`](Domain::defer).
    pub fn call(&self, callback: impl FnOnce() + Send + 'static) {
        let bytes = mem::size_of_val(&callback);
        self.inner.reclaim.enqueue(bytes, Box::new(callback));
    }

    /// Waits until every value deferred and every callback queued before this call
    /// has been reclaimed (`rcu_barrier`).
    ///
    /// # Errors
    /// [`RcuError::OnlineReader`] if the calling thread has an online reader of
    /// this domain, which the reclamation would wait for.
    pub fn barrier(&self) -> Result<(), RcuError> {
        if self.inner.gp.caller_is_online() {
            return Err(RcuError::OnlineReader);
        }
        self.inner.reclaim.barrier();
        Ok(())
    }

    /// Bytes deferred and not yet reclaimed.
    pub fn pending_reclaim_bytes(&self) -> usize {
        self.inner.reclaim.pending_bytes()
    }
}

impl std::fmt::Debug for Domain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let readers = self.inner.gp.readers();
        f.debug_struct("Domain")
            .field("id", &self.inner.id)
            .field("gp", &self.inner.gp.counter())
            .field("readers", &readers)
            .finish()
    }
}
