//! Metrics of boosting and directed yield, with KVM's stat names where KVM has them.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

/// Receives what the booster and the policies do. Every method has an empty default.
pub trait SchedEvents: Send + Sync {
    /// vCPU `vcpu`'s thread was boosted.
    fn boosted(&self, _vcpu: usize) {}
    /// Its boost was undone after `held`; `revoked` if it had to be taken back
    /// (the thread did not run within the limit).
    fn unboosted(&self, _vcpu: usize, _held: Duration, _revoked: bool) {}
    /// A directed yield was attempted; `successful` if the CPU went to a target.
    fn directed_yield(&self, _successful: bool) {}
    /// Boosting vCPU `vcpu` failed (e.g. no `CAP_SYS_NICE`): the policy goes
    /// on as if the boost had been refused.
    fn boost_failed(&self, _vcpu: usize, _error: &std::io::Error) {}
    /// Restoring vCPU `vcpu`'s thread after a boost failed: it may still be
    /// boosted, and nothing else will try again.
    fn restore_failed(&self, _vcpu: usize, _error: &std::io::Error) {}
    /// The revoker thread could not be raised above the boosts
    /// ([`crate::ThreadControl::prepare_revoker`]): it may wait behind a
    /// boosted thread on a crowded CPU, so boosts can outlast `max_boost`.
    fn revoker_failed(&self, _error: &std::io::Error) {}
    /// A revoker that took a boost back woke `late` past the deadline it
    /// slept until: the host's timer and wake-up latency, which that boost
    /// outlasted `max_boost` by at most.
    fn revoker_woke_late(&self, _late: Duration) {}
    /// vCPU `vcpu`'s thread ran `cpu` of CPU time while boosted, from its
    /// boost to its first restore, by the thread control's
    /// [`crate::ThreadControl::cpu_time`] (not reported where it has none),
    /// at most the wall time from the boost to the restore.
    fn boost_ran(&self, _vcpu: usize, _cpu: Duration) {}
}

/// No metrics, at no cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoEvents;

impl SchedEvents for NoEvents {}

macro_rules! forward_events {
    ($($ty:ty),*) => {$(
        impl<E: SchedEvents + ?Sized> SchedEvents for $ty {
            fn boosted(&self, vcpu: usize) {
                (**self).boosted(vcpu)
            }
            fn unboosted(&self, vcpu: usize, held: Duration, revoked: bool) {
                (**self).unboosted(vcpu, held, revoked)
            }
            fn directed_yield(&self, successful: bool) {
                (**self).directed_yield(successful)
            }
            fn boost_failed(&self, vcpu: usize, error: &std::io::Error) {
                (**self).boost_failed(vcpu, error)
            }
            fn restore_failed(&self, vcpu: usize, error: &std::io::Error) {
                (**self).restore_failed(vcpu, error)
            }
            fn revoker_failed(&self, error: &std::io::Error) {
                (**self).revoker_failed(error)
            }
            fn revoker_woke_late(&self, late: Duration) {
                (**self).revoker_woke_late(late)
            }
            fn boost_ran(&self, vcpu: usize, cpu: Duration) {
                (**self).boost_ran(vcpu, cpu)
            }
        }
    )*};
}

// Events shared with whoever reads them, or borrowed.
forward_events!(&E, std::sync::Arc<E>);

/// Counters a VMM can read at any time.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct SchedStats {
    /// Boosts applied.
    pub boosts: AtomicU64,
    /// Total time threads stayed boosted, ns.
    pub boost_ns: AtomicU64,
    /// The longest single boost, ns (from the booster's record to the first
    /// restore, however long a stalled booster takes to return).
    pub longest_boost_ns: AtomicU64,
    /// Boosts taken back because the thread did not run in time.
    pub boosts_revoked: AtomicU64,
    /// KVM's `directed_yield_attempted`.
    pub directed_yield_attempted: AtomicU64,
    /// KVM's `directed_yield_successful`.
    pub directed_yield_successful: AtomicU64,
    /// Boosts that failed (the thread control refused, e.g. no `CAP_SYS_NICE`).
    pub boost_errors: AtomicU64,
    /// Restores that failed after a boost.
    pub restore_errors: AtomicU64,
    /// Revoker threads that could not be raised above the boosts.
    pub revoker_errors: AtomicU64,
    /// The latest a revoker that took a boost back woke past the deadline
    /// it slept until, ns: the host's wake-up latency, the most it let that
    /// boost run past `max_boost`.
    pub latest_revoker_wake_ns: AtomicU64,
    /// The most CPU time a thread ran in one boost, ns: what a boost took
    /// from other threads. A boost can last longer than it runs, where the
    /// host takes the CPU away (which also delays the revoker).
    pub most_boost_cpu_ns: AtomicU64,
}

impl SchedEvents for SchedStats {
    fn boosted(&self, _: usize) {
        self.boosts.fetch_add(1, Relaxed);
    }

    fn unboosted(&self, _: usize, held: Duration, revoked: bool) {
        let ns = held.as_nanos() as u64;
        self.boost_ns.fetch_add(ns, Relaxed);
        self.longest_boost_ns.fetch_max(ns, Relaxed);
        self.boosts_revoked.fetch_add(u64::from(revoked), Relaxed);
    }

    fn directed_yield(&self, successful: bool) {
        self.directed_yield_attempted.fetch_add(1, Relaxed);
        self.directed_yield_successful
            .fetch_add(u64::from(successful), Relaxed);
    }

    fn boost_failed(&self, _: usize, _: &std::io::Error) {
        self.boost_errors.fetch_add(1, Relaxed);
    }

    fn restore_failed(&self, _: usize, _: &std::io::Error) {
        self.restore_errors.fetch_add(1, Relaxed);
    }

    fn revoker_failed(&self, _: &std::io::Error) {
        self.revoker_errors.fetch_add(1, Relaxed);
    }

    fn revoker_woke_late(&self, late: Duration) {
        self.latest_revoker_wake_ns
            .fetch_max(late.as_nanos() as u64, Relaxed);
    }

    fn boost_ran(&self, _: usize, cpu: Duration) {
        self.most_boost_cpu_ns
            .fetch_max(cpu.as_nanos() as u64, Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_count_with_kvms_names() {
        let s = SchedStats::default();
        s.boosted(1);
        s.unboosted(1, Duration::from_micros(3), true);
        s.directed_yield(true);
        s.directed_yield(false);
        s.boost_failed(1, &std::io::Error::other("refused"));
        s.restore_failed(1, &std::io::Error::other("refused"));
        s.revoker_failed(&std::io::Error::other("refused"));
        s.revoker_woke_late(Duration::from_micros(40));
        s.revoker_woke_late(Duration::from_micros(7));
        s.boost_ran(1, Duration::from_micros(90));
        s.boost_ran(2, Duration::from_micros(30));
        let get = |a: &AtomicU64| a.load(Relaxed);
        assert_eq!(get(&s.latest_revoker_wake_ns), 40_000);
        assert_eq!(get(&s.most_boost_cpu_ns), 90_000);
        assert_eq!((get(&s.restore_errors), get(&s.revoker_errors)), (1, 1));
        assert_eq!(
            (get(&s.boosts), get(&s.boost_ns), get(&s.boosts_revoked)),
            (1, 3000, 1)
        );
        assert_eq!(get(&s.boost_errors), 1);
        assert_eq!(
            (
                get(&s.directed_yield_attempted),
                get(&s.directed_yield_successful)
            ),
            (2, 1)
        );
    }
}
