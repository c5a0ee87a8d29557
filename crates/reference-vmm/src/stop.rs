//! How a run ends when its guest does not finish: the watchdog, a stop asked
//! for from outside (a signal), and how long the vCPU threads get to obey.

use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

/// The watchdog of a run given no timeout: no guest program here takes
/// longer, and a guest that spins for ever is stopped after it.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How long stopped vCPU threads get to leave `KVM_RUN` and report: a kick
/// takes microseconds, so a thread still busy after this is stuck, and the
/// run ends without it.
pub const STOP_GRACE: Duration = Duration::from_millis(500);

/// How long the guest's buffered output may go without taking a byte at the
/// end of a run: a slow output is waited for, one nobody reads (a full pipe)
/// must not hold the run.
pub const OUTPUT_GRACE: Duration = Duration::from_millis(300);

/// Why a run was stopped before its guest finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The run's timeout (or the default watchdog) passed.
    Timeout(Duration),
    /// The VMM got this signal (SIGINT, SIGTERM).
    Signal(i32),
    /// A [`StopHandle`] asked.
    Requested,
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Timeout(t) => write!(f, "the guest did not finish within {t:?}"),
            Self::Signal(libc::SIGINT) => f.write_str("interrupted (SIGINT)"),
            Self::Signal(libc::SIGTERM) => f.write_str("terminated (SIGTERM)"),
            Self::Signal(n) => write!(f, "stopped by signal {n}"),
            Self::Requested => f.write_str("stopped on request"),
        }
    }
}

/// Stops a running VM from another thread: the run ends as at its timeout,
/// with what the guest reported so far ([`crate::Error::Stopped`]).
/// Get it from [`crate::Vm::stop_handle`] before [`crate::Vm::run`].
#[derive(Clone, Debug, Default)]
pub struct StopHandle(Arc<Mutex<Option<StopReason>>>);

impl StopHandle {
    /// Asks the run to stop; the first reason given is the one reported.
    pub fn stop(&self, reason: StopReason) {
        self.lock().get_or_insert(reason);
    }

    /// The reason a stop was asked for, if one was.
    pub fn requested(&self) -> Option<StopReason> {
        *self.lock()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<StopReason>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_reason_stands_and_each_reads_clearly() {
        let handle = StopHandle::default();
        assert_eq!(handle.requested(), None);
        handle.clone().stop(StopReason::Signal(libc::SIGTERM));
        handle.stop(StopReason::Requested);
        assert_eq!(handle.requested(), Some(StopReason::Signal(libc::SIGTERM)));
        assert_eq!(
            StopReason::Timeout(Duration::from_secs(3)).to_string(),
            "the guest did not finish within 3s"
        );
        assert_eq!(
            StopReason::Signal(libc::SIGINT).to_string(),
            "interrupted (SIGINT)"
        );
        assert_eq!(StopReason::Signal(1).to_string(), "stopped by signal 1");
    }
}
