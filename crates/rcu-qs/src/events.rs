//! Metrics: what a domain reports about its grace periods and reclamation.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// One finished grace period.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GracePeriod {
    /// Time from starting the grace period to its end.
    pub wait: Duration,
    /// Online readers that had not yet passed a quiescent state when it started.
    pub readers_waited_on: usize,
    /// Whether the writer had to block (it spun first).
    pub blocked: bool,
}

/// Receives a domain's metrics. Every method has an empty default.
///
/// Called from writer-side paths only (the end of a grace period, deferral and
/// reclamation), never from a reader's fast path.
pub trait RcuEvents: Send + Sync {
    /// A grace period ended.
    fn grace_period(&self, _gp: &GracePeriod) {}

    /// The bytes of deferred values waiting for reclamation are now `bytes`.
    fn pending_reclaim(&self, _bytes: usize) {}
}

/// Metrics that go nowhere: the default, at no cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoEvents;

impl RcuEvents for NoEvents {}

impl<E: RcuEvents + ?Sized> RcuEvents for Arc<E> {
    fn grace_period(&self, gp: &GracePeriod) {
        (**self).grace_period(gp)
    }

    fn pending_reclaim(&self, bytes: usize) {
        (**self).pending_reclaim(bytes)
    }
}

/// Counters a VMM can read at any time, e.g. for its own metrics endpoint.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct RcuCounters {
    /// Grace periods completed.
    pub grace_periods: AtomicU64,
    /// Grace periods in which the writer blocked.
    pub blocked_grace_periods: AtomicU64,
    /// Total time spent in grace periods, in nanoseconds.
    pub wait_ns: AtomicU64,
    /// Longest grace period, in nanoseconds.
    pub max_wait_ns: AtomicU64,
    /// Sum of readers waited on over all grace periods.
    pub readers_waited_on: AtomicU64,
    /// Bytes of deferred values waiting for reclamation, as last reported.
    pub pending_reclaim_bytes: AtomicU64,
}

impl RcuEvents for RcuCounters {
    fn grace_period(&self, gp: &GracePeriod) {
        let ns = u64::try_from(gp.wait.as_nanos()).unwrap_or(u64::MAX);
        self.grace_periods.fetch_add(1, Ordering::Relaxed);
        self.blocked_grace_periods
            .fetch_add(u64::from(gp.blocked), Ordering::Relaxed);
        self.wait_ns.fetch_add(ns, Ordering::Relaxed);
        self.max_wait_ns.fetch_max(ns, Ordering::Relaxed);
        self.readers_waited_on
            .fetch_add(gp.readers_waited_on as u64, Ordering::Relaxed);
    }

    fn pending_reclaim(&self, bytes: usize) {
        self.pending_reclaim_bytes
            .store(bytes as u64, Ordering::Relaxed);
    }
}
