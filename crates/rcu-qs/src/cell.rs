//! `RcuCell<T>`: a value readers see with no lock, no atomic read-modify-write and
//! no reference counting; writers replace it whole.

use std::marker::PhantomData;

use crate::domain::Domain;
use crate::error::{RcuError, Rejected};
use crate::reader::Reader;
use crate::sync::AtomicPtr;
use crate::sync::Ordering::{AcqRel, Acquire};

/// A read-mostly value protected by a [`Domain`]: the VMM's device bus, memory
/// map or interrupt routing, read on every exit.
///
/// A read is a load and a dereference. A write publishes a new value and retires
/// the old one, which is dropped after a grace period, once no reader can still
/// see it.
pub struct RcuCell<T> {
    ptr: AtomicPtr<T>,
    /// The domain's id, beside the pointer for the read fast path.
    domain_id: u64,
    domain: Domain,
    /// The cell owns a `T` (for drop check and auto traits).
    _owns: PhantomData<T>,
}

// SAFETY: the cell hands out `&T` to reader threads (T: Sync) and drops old
// values on the reclaim or writer thread (T: Send); the pointer itself is atomic.
unsafe impl<T: Send + Sync> Send for RcuCell<T> {}
// SAFETY: as for Send: shared access only reads `&T` or swaps the atomic pointer.
unsafe impl<T: Send + Sync> Sync for RcuCell<T> {}

impl<T: Send + Sync + 'static> RcuCell<T> {
    /// A cell in `domain` holding `value`.
    pub fn new(domain: &Domain, value: T) -> Self {
        Self {
            ptr: AtomicPtr::new(Box::into_raw(Box::new(value))),
            domain_id: domain.inner.id,
            domain: domain.clone(),
            _owns: PhantomData,
        }
    }

    /// The current value, valid while `reader` is borrowed: the borrow checker
    /// ends it before the reader's next quiescent state, offline period or drop.
    ///
    /// An offline reader is brought online first (reading offline would not
    /// protect the value).
    ///
    /// # Panics
    /// If `reader` belongs to another domain than the cell: its quiescent states
    /// would not protect this value.
    #[inline]
    pub fn read<'a>(&'a self, reader: &'a Reader) -> &'a T {
        reader.enter_read(self.domain_id);
        // `reader` is online (above) and stays so while 'a lasts, because
        // quiescent(), offline() and drop all need it mutably or by value.
        let ptr = self.ptr.load(Acquire);
        // SAFETY: `ptr` is from Box::into_raw, freed only after a grace period
        // that began after it was unpublished, which waits for `reader` (online
        // while 'a lasts, above): the value outlives 'a.
        unsafe { &*ptr }
    }

    /// Publishes the new value and swaps out the old one, returning the old
    /// pointer for the caller to retire.
    fn swap(&self, value: T) -> *mut T {
        self.ptr.swap(Box::into_raw(Box::new(value)), AcqRel)
    }

    /// Publishes `value`, waits for a grace period, and returns the old value.
    ///
    /// # Errors
    /// If the calling thread has an online reader of this domain, nothing is
    /// published and `value` comes back in the [`Rejected`] error.
    pub fn replace(&self, value: T) -> Result<T, Rejected<T>> {
        if self.domain.inner.gp.caller_is_online() {
            return Err(Rejected {
                value,
                error: RcuError::OnlineReader,
            });
        }
        let old = self.swap(value);
        self.domain.inner.gp.wait_for_grace_period();
        // SAFETY: `old` came from Box::into_raw, was unpublished by the swap, and
        // the grace period since means no reader can still hold it.
        Ok(*unsafe { Box::from_raw(old) })
    }

    /// Publishes `value`; the old value is dropped on the domain's reclaim thread
    /// after a grace period. Returns at once (see [`Domain::defer`] for the
    /// memory bound).
    #[cfg(not(loom))]
    pub fn store(&self, value: T) {
        let old = self.swap(value);
        // SAFETY: as in `replace`; the reclaim thread drops it after a grace period.
        self.domain.defer_box(unsafe { Box::from_raw(old) });
    }

    /// The current value, through exclusive access: no reader can hold it.
    pub fn get_mut(&mut self) -> &mut T {
        // SAFETY: `&mut self` excludes readers (they borrow the cell) and writers.
        unsafe { &mut *self.ptr.load(Acquire) }
    }
}

impl<T> Drop for RcuCell<T> {
    fn drop(&mut self) {
        // SAFETY: dropping needs `&mut self`, so no reader borrows the cell; the
        // pointer came from Box::into_raw and is dropped exactly once.
        drop(unsafe { Box::from_raw(self.ptr.load(Acquire)) });
    }
}

impl<T: std::fmt::Debug + Send + Sync + 'static> std::fmt::Debug for RcuCell<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RcuCell")
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}
