//! Errors.

use std::fmt;

/// Why a call that waits for a grace period was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RcuError {
    /// The calling thread has an online [`Reader`](crate::Reader) of this domain,
    /// so a grace period would wait for the caller itself: a deadlock.
    #[error(
        "the calling thread has an online reader of this RCU domain, so waiting for a grace \
         period would wait for itself; take the reader offline first (Reader::synchronize \
         or Reader::offline_while)"
    )]
    OnlineReader,
}

/// A value handed back because the operation was refused: nothing is lost.
pub struct Rejected<T> {
    /// The value the operation was given.
    pub value: T,
    /// Why it was refused.
    pub error: RcuError,
}

impl<T> fmt::Debug for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejected")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

impl<T> fmt::Display for Rejected<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl<T> std::error::Error for Rejected<T> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}
