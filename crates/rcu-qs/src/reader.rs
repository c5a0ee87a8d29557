//! A reader: one thread's registration with a domain.

use std::cell::Cell;
use std::marker::PhantomData;

use crate::domain::Domain;
use crate::error::RcuError;
use crate::grace_period::{GpState, OFFLINE, ReaderSlot};
use crate::reporter::QsReporter;
use crate::sync::{Arc, current_thread};

/// A thread's registration with a [`Domain`]: the handle through which it reads
/// RCU-protected data and announces quiescent states.
///
/// A reader is online from registration until [`offline`](Reader::offline), and
/// again after [`online`](Reader::online). While online it may hold references
/// obtained through it (e.g. [`RcuCell::read`](crate::RcuCell::read)); those
/// borrow the reader, so the borrow checker rejects any that would live across
/// [`quiescent`](Reader::quiescent), [`offline`](Reader::offline) or drop.
///
/// A reader belongs to the thread that registered it (it is neither `Send` nor
/// `Sync`). Dropping it, online or not, unregisters it. If it is leaked instead
/// (`mem::forget`), it goes offline for good when its thread exits.
pub struct Reader {
    /// The domain's grace-period state, one pointer away for the fast paths.
    gp: std::sync::Arc<GpState>,
    domain: Domain,
    slot: Arc<ReaderSlot>,
    /// This thread's copy of the slot, so the fast paths need no atomic access.
    ctr: Cell<u64>,
    /// The domain's id while online, 0 while offline: a read checks both with
    /// one compare.
    online_in: Cell<u64>,
    _not_send: PhantomData<*const ()>,
}

impl Domain {
    /// Registers the calling thread as a reader; the reader starts online.
    pub fn register_reader(&self) -> Reader {
        Reader::register(self.clone())
    }
}

impl Reader {
    pub(crate) fn register(domain: Domain) -> Self {
        let slot = Arc::new(ReaderSlot::new(current_thread().id()));
        domain.inner.gp.register(slot.clone());
        #[cfg(not(loom))]
        exit_guard::watch(&slot, &domain.inner.gp);
        let reader = Self {
            gp: domain.inner.gp.clone(),
            domain,
            slot,
            ctr: Cell::new(OFFLINE),
            online_in: Cell::new(0),
            _not_send: PhantomData,
        };
        reader.ensure_online();
        reader
    }

    /// The domain this reader belongs to.
    pub fn domain(&self) -> &Domain {
        &self.domain
    }

    /// Whether the reader is online.
    pub fn is_online(&self) -> bool {
        self.ctr.get() != OFFLINE
    }

    /// Announces a quiescent state: this thread holds no reference obtained
    /// through this reader. With no grace period waiting, this is one load and a
    /// compare. Does nothing while offline.
    #[inline]
    pub fn quiescent(&mut self) {
        let gp = self.gp.counter();
        if gp != self.ctr.get() && self.ctr.get() != OFFLINE {
            self.publish(gp);
        }
    }

    /// Enters an extended quiescent state (around `KVM_RUN`, around a blocking
    /// wait): grace periods stop waiting for this thread until [`online`](Reader::online).
    #[inline]
    pub fn offline(&mut self) {
        if self.ctr.get() != OFFLINE {
            self.publish(OFFLINE);
        }
    }

    /// Leaves the extended quiescent state; references may be taken again.
    #[inline]
    pub fn online(&mut self) {
        self.ensure_online();
    }

    /// Offline until the guard is dropped, then back to the state before (online
    /// or not): for a blocking call or `KVM_RUN`.
    pub fn offline_guard(&mut self) -> OfflineGuard<'_> {
        let was_online = self.is_online();
        self.offline();
        OfflineGuard {
            reader: self,
            was_online,
        }
    }

    /// Runs `f` offline, then returns to the state before.
    pub fn offline_while<R>(&mut self, f: impl FnOnce() -> R) -> R {
        let _guard = self.offline_guard();
        f()
    }

    /// Waits for a grace period from a reader thread: offline while waiting.
    ///
    /// # Errors
    /// [`RcuError::OnlineReader`] if this thread has *another* online reader of
    /// the same domain, which the grace period would wait for.
    pub fn synchronize(&mut self) -> Result<(), RcuError> {
        let domain = self.domain.clone();
        self.offline_while(|| domain.synchronize())
    }

    /// Readies the reader for a read of data protected by domain `domain_id`:
    /// one compare when it is online in that domain.
    ///
    /// # Panics
    /// If the reader belongs to another domain, whose quiescent states would not
    /// protect the data.
    #[inline]
    pub(crate) fn enter_read(&self, domain_id: u64) {
        if self.online_in.get() != domain_id {
            self.enter_read_slow(domain_id);
        }
    }

    #[cold]
    fn enter_read_slow(&self, domain_id: u64) {
        assert!(
            self.domain.inner.id == domain_id,
            "RcuCell::read through a Reader of another Domain"
        );
        self.ensure_online();
    }

    /// Brings the reader online if it is not; `&self`, because a read through an
    /// offline reader must come online first to be safe.
    fn ensure_online(&self) {
        if self.ctr.get() == OFFLINE {
            self.publish(self.gp.counter());
        }
    }

    fn publish(&self, ctr: u64) {
        self.ctr.set(ctr);
        self.online_in.set(if ctr == OFFLINE {
            0
        } else {
            self.domain.inner.id
        });
        if self.slot.publish(ctr) {
            self.gp.wake_writer();
        }
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.offline();
        self.gp.unregister(&self.slot);
    }
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("online", &self.is_online())
            .finish_non_exhaustive()
    }
}

impl QsReporter for Reader {
    fn quiescent(&mut self) {
        Reader::quiescent(self)
    }

    fn offline(&mut self) {
        Reader::offline(self)
    }

    fn online(&mut self) {
        Reader::online(self)
    }
}

/// Keeps a reader offline while it lives; see [`Reader::offline_guard`].
#[derive(Debug)]
pub struct OfflineGuard<'r> {
    reader: &'r mut Reader,
    was_online: bool,
}

impl Drop for OfflineGuard<'_> {
    fn drop(&mut self) {
        if self.was_online {
            self.reader.online();
        }
    }
}

/// Takes leaked readers offline when their thread exits, so a forgotten reader
/// cannot hold up grace periods after its thread is gone.
#[cfg(not(loom))]
mod exit_guard {
    use std::cell::RefCell;
    use std::sync::{Arc, Weak};

    use crate::grace_period::{GpState, OFFLINE, ReaderSlot};

    #[derive(Default)]
    struct ThreadReaders(Vec<(Weak<ReaderSlot>, Weak<GpState>)>);

    impl Drop for ThreadReaders {
        fn drop(&mut self) {
            for (slot, gp) in &self.0 {
                if let (Some(slot), Some(gp)) = (slot.upgrade(), gp.upgrade()) {
                    if slot.is_online() {
                        slot.publish(OFFLINE);
                        gp.wake_writer();
                    }
                }
            }
        }
    }

    thread_local! {
        static READERS: RefCell<ThreadReaders> = RefCell::default();
    }

    pub(super) fn watch(slot: &Arc<ReaderSlot>, gp: &Arc<GpState>) {
        // During thread teardown the list may be gone: then nothing is left to watch for.
        let _ = READERS.try_with(|r| {
            let mut r = r.borrow_mut();
            r.0.retain(|(s, _)| s.strong_count() > 0);
            r.0.push((Arc::downgrade(slot), Arc::downgrade(gp)));
        });
    }
}
