//! Metrics of dirty logging, through a trait with a no-op default.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// The KVM ioctls the backends issue.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Ioctl {
    /// `KVM_GET_DIRTY_LOG`.
    GetDirtyLog,
    /// `KVM_CLEAR_DIRTY_LOG`.
    ClearDirtyLog,
    /// `KVM_RESET_DIRTY_RINGS`.
    ResetDirtyRings,
    /// `KVM_SET_USER_MEMORY_REGION` (turning logging on or off for a slot).
    SetMemoryRegion,
}

/// Receives what the backends do. Every method has an empty default.
pub trait DirtyEvents: Send + Sync {
    /// An ioctl took `took`.
    fn ioctl(&self, _op: Ioctl, _took: Duration) {}
    /// A harvest found `pages` dirty pages (before merging) in `took`.
    fn harvested(&self, _pages: u64, _took: Duration) {}
    /// `pages` pages were cleared (re-protected) in `took`.
    fn cleared(&self, _pages: u64, _took: Duration) {}
}

/// No metrics, at no cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoEvents;

impl DirtyEvents for NoEvents {}

impl<E: DirtyEvents + ?Sized> DirtyEvents for std::sync::Arc<E> {
    fn ioctl(&self, op: Ioctl, took: Duration) {
        (**self).ioctl(op, took)
    }
    fn harvested(&self, pages: u64, took: Duration) {
        (**self).harvested(pages, took)
    }
    fn cleared(&self, pages: u64, took: Duration) {
        (**self).cleared(pages, took)
    }
}

/// Counters a VMM can read at any time.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct DirtyStats {
    /// Dirty pages found by harvests.
    pub pages_harvested: AtomicU64,
    /// Time spent harvesting, ns.
    pub harvest_ns: AtomicU64,
    /// Pages cleared (re-protected).
    pub pages_cleared: AtomicU64,
    /// Time spent clearing, ns.
    pub clear_ns: AtomicU64,
    /// `KVM_GET_DIRTY_LOG` calls.
    pub get_calls: AtomicU64,
    /// Time in `KVM_GET_DIRTY_LOG`, ns.
    pub get_ns: AtomicU64,
    /// `KVM_CLEAR_DIRTY_LOG` calls.
    pub clear_calls: AtomicU64,
    /// `KVM_RESET_DIRTY_RINGS` calls.
    pub reset_calls: AtomicU64,
    /// Time in `KVM_RESET_DIRTY_RINGS`, ns.
    pub reset_ns: AtomicU64,
    /// The longest single ioctl, ns: how long one call may have stalled a
    /// vCPU waiting for KVM's MMU lock.
    pub worst_ioctl_ns: AtomicU64,
}

impl DirtyEvents for DirtyStats {
    fn ioctl(&self, op: Ioctl, took: Duration) {
        let (calls, time) = match op {
            Ioctl::GetDirtyLog => (&self.get_calls, Some(&self.get_ns)),
            Ioctl::ClearDirtyLog => (&self.clear_calls, None), // timed by `cleared`
            Ioctl::ResetDirtyRings => (&self.reset_calls, Some(&self.reset_ns)),
            Ioctl::SetMemoryRegion => return,
        };
        calls.fetch_add(1, Relaxed);
        if let Some(time) = time {
            time.fetch_add(nanos(took), Relaxed);
        }
        self.worst_ioctl_ns.fetch_max(nanos(took), Relaxed);
    }

    fn harvested(&self, pages: u64, took: Duration) {
        self.pages_harvested.fetch_add(pages, Relaxed);
        self.harvest_ns.fetch_add(nanos(took), Relaxed);
    }

    fn cleared(&self, pages: u64, took: Duration) {
        self.pages_cleared.fetch_add(pages, Relaxed);
        self.clear_ns.fetch_add(nanos(took), Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_count_calls_and_keep_the_worst_ioctl() {
        let s = DirtyStats::default();
        s.ioctl(Ioctl::GetDirtyLog, Duration::from_micros(5));
        s.ioctl(Ioctl::ClearDirtyLog, Duration::from_micros(9));
        s.ioctl(Ioctl::ClearDirtyLog, Duration::from_micros(2));
        s.ioctl(Ioctl::ResetDirtyRings, Duration::from_micros(1));
        s.ioctl(Ioctl::SetMemoryRegion, Duration::from_secs(1));
        s.harvested(10, Duration::from_micros(3));
        s.cleared(64, Duration::from_micros(4));
        let get = |a: &AtomicU64| a.load(Relaxed);
        assert_eq!(
            (get(&s.get_calls), get(&s.clear_calls), get(&s.reset_calls)),
            (1, 2, 1)
        );
        assert_eq!(
            get(&s.worst_ioctl_ns),
            9000,
            "memory-region changes are not timed as stalls"
        );
        assert_eq!((get(&s.pages_harvested), get(&s.harvest_ns)), (10, 3000));
        assert_eq!((get(&s.pages_cleared), get(&s.clear_ns)), (64, 4000));
    }
}
