//! The booster: raises a vCPU thread's priority through a [`ThreadControl`], and
//! makes sure every boost is undone: when the thread has run, or when it has
//! been boosted longer than allowed, and never beyond a budget per period, so a
//! guest cannot keep its vCPU boosted.

use std::io;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::events::{NoEvents, SchedEvents};
use crate::sync::{AtomicI32, AtomicU64, Ordering::SeqCst};
use crate::thread::{ThreadControl, Tid};

/// How long and how much boosting is allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BoostBudget {
    /// A boost older than this is taken back by [`Booster::revoke_expired`].
    pub max_boost: Duration,
    /// Boosted time allowed per vCPU per period.
    pub per_period: Duration,
    /// The budget period.
    pub period: Duration,
}

impl Default for BoostBudget {
    /// At most 1 ms per boost, and 2 ms of boost per vCPU per 10 ms.
    fn default() -> Self {
        Self {
            max_boost: Duration::from_millis(1),
            per_period: Duration::from_millis(2),
            period: Duration::from_millis(10),
        }
    }
}

#[derive(Debug, Default)]
struct Slot {
    tid: AtomicI32,
    /// When the boost began (ns since the booster's epoch, +1), 0 if not boosted.
    since: AtomicU64,
    period_start: AtomicU64,
    used: AtomicU64,
}

/// Boosts vCPU threads and undoes every boost.
///
/// `boost` and `ran` may race from different threads (the sender and the
/// target): the thread is boosted before the boost is published, and only
/// the caller that takes the published boost back restores it, so no boost is
/// lost and none is restored twice. A VMM should call [`Booster::revoke_expired`]
/// at least every `max_boost` (every `boost` runs it);
/// the kernel's real-time throttling is the backstop.
pub struct Booster<T: ThreadControl, E: SchedEvents = NoEvents> {
    control: T,
    events: E,
    budget: BoostBudget,
    slots: Vec<CachePadded<Slot>>,
    epoch: Instant,
}

impl<T: ThreadControl> Booster<T> {
    /// A booster for `vcpus` vCPUs acting through `control`.
    pub fn new(vcpus: usize, control: T) -> Self {
        Booster::with_events(vcpus, control, NoEvents)
    }
}

impl<T: ThreadControl, E: SchedEvents> Booster<T, E> {
    /// A booster reporting to `events`.
    pub fn with_events(vcpus: usize, control: T, events: E) -> Self {
        let slots = (0..vcpus).map(|_| CachePadded::default()).collect();
        Self {
            control,
            events,
            budget: BoostBudget::default(),
            slots,
            epoch: Instant::now(),
        }
    }

    /// The same booster with another budget.
    pub fn with_budget(mut self, budget: BoostBudget) -> Self {
        self.budget = budget;
        self
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64 + 1
    }

    /// Says which host thread runs vCPU `vcpu` (ignored for an unknown vCPU).
    pub fn register(&self, vcpu: usize, tid: Tid) {
        if let Some(s) = self.slots.get(vcpu) {
            s.tid.store(tid, SeqCst);
        }
    }

    /// The thread control, for yielding.
    pub fn control(&self) -> &T {
        &self.control
    }

    /// Boosts vCPU `vcpu`'s thread; `Ok(false)` if it is unregistered, already
    /// boosted, or out of budget for this period.
    ///
    /// # Errors
    /// The thread control's error, e.g. `PermissionDenied` without `CAP_SYS_NICE`.
    pub fn boost(&self, vcpu: usize) -> io::Result<bool> {
        self.revoke_expired();
        let Some(slot) = self.slots.get(vcpu) else {
            return Ok(false);
        };
        let tid = slot.tid.load(SeqCst);
        let now = self.now();
        if tid == 0 || slot.since.load(SeqCst) != 0 {
            return Ok(false);
        }
        let period = self.budget.period.as_nanos() as u64;
        if now.saturating_sub(slot.period_start.load(SeqCst)) >= period {
            slot.period_start.store(now, SeqCst);
            slot.used.store(0, SeqCst);
        }
        if slot.used.load(SeqCst) >= self.budget.per_period.as_nanos() as u64 {
            return Ok(false);
        }
        if let Err(e) = self.control.boost(tid) {
            self.events.boost_failed(vcpu, &e);
            return Err(e);
        }
        if slot.since.compare_exchange(0, now, SeqCst, SeqCst).is_err() {
            return Ok(false); // a concurrent caller boosted it too; its record stands
        }
        self.events.boosted(vcpu);
        Ok(true)
    }

    /// vCPU `vcpu` ran: undo its boost, if any.
    pub fn ran(&self, vcpu: usize) -> io::Result<()> {
        self.unboost(vcpu, false)
    }

    fn unboost(&self, vcpu: usize, revoked: bool) -> io::Result<()> {
        let Some(slot) = self.slots.get(vcpu) else {
            return Ok(());
        };
        let since = slot.since.swap(0, SeqCst);
        if since == 0 {
            return Ok(());
        }
        let held = self.now().saturating_sub(since);
        slot.used.fetch_add(held, SeqCst);
        self.events
            .unboosted(vcpu, Duration::from_nanos(held), revoked);
        self.control.restore(slot.tid.load(SeqCst))
    }

    /// Takes back every boost older than `max_boost`.
    pub fn revoke_expired(&self) {
        let now = self.now();
        let max = self.budget.max_boost.as_nanos() as u64;
        for (vcpu, slot) in self.slots.iter().enumerate() {
            let since = slot.since.load(SeqCst);
            if since != 0 && now.saturating_sub(since) > max {
                let _ = self.unboost(vcpu, true);
            }
        }
    }

    /// Reports a directed-yield attempt to the events.
    pub fn report_directed_yield(&self, successful: bool) {
        self.events.directed_yield(successful);
    }

    /// Whether vCPU `vcpu` is boosted now.
    pub fn is_boosted(&self, vcpu: usize) -> bool {
        self.slots
            .get(vcpu)
            .is_some_and(|s| s.since.load(SeqCst) != 0)
    }
}

impl<T: ThreadControl, E: SchedEvents> Drop for Booster<T, E> {
    /// Nothing stays boosted when the booster goes away.
    fn drop(&mut self) {
        for vcpu in 0..self.slots.len() {
            let _ = self.unboost(vcpu, false);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// Records boosts and restores, and can refuse.
    #[derive(Default)]
    struct Fake {
        calls: Mutex<Vec<(&'static str, Tid)>>,
        refuse: bool,
    }

    impl ThreadControl for Fake {
        fn boost(&self, tid: Tid) -> io::Result<()> {
            if self.refuse {
                return Err(io::Error::from(io::ErrorKind::PermissionDenied));
            }
            self.calls.lock().unwrap().push(("boost", tid));
            Ok(())
        }
        fn restore(&self, tid: Tid) -> io::Result<()> {
            self.calls.lock().unwrap().push(("restore", tid));
            Ok(())
        }
    }

    fn booster(budget: BoostBudget) -> Booster<Arc<Fake>> {
        let b = Booster::new(2, Arc::new(Fake::default())).with_budget(budget);
        b.register(0, 100);
        b.register(1, 101);
        b
    }

    #[test]
    fn a_boost_is_undone_when_the_vcpu_runs_and_only_once() {
        let b = booster(BoostBudget::default());
        assert!(b.boost(1).unwrap());
        assert!(!b.boost(1).unwrap(), "already boosted");
        b.ran(1).unwrap();
        b.ran(1).unwrap();
        assert_eq!(
            *b.control().calls.lock().unwrap(),
            [("boost", 101), ("restore", 101)]
        );
        assert!(!b.is_boosted(1));
    }

    #[test]
    fn an_old_boost_is_revoked() {
        let b = booster(BoostBudget {
            max_boost: Duration::ZERO,
            ..Default::default()
        });
        assert!(b.boost(0).unwrap());
        std::thread::sleep(Duration::from_millis(1));
        b.revoke_expired();
        assert!(!b.is_boosted(0));
        assert_eq!(
            b.control().calls.lock().unwrap().last(),
            Some(&("restore", 100))
        );
    }

    #[test]
    fn the_budget_per_period_is_enforced() {
        let budget = BoostBudget {
            per_period: Duration::from_nanos(1),
            period: Duration::from_secs(60),
            ..Default::default()
        };
        let b = booster(budget);
        assert!(b.boost(0).unwrap());
        std::thread::sleep(Duration::from_millis(1));
        b.ran(0).unwrap();
        assert!(!b.boost(0).unwrap(), "the budget for this period is spent");
        assert!(b.boost(1).unwrap(), "budgets are per vCPU");
    }

    #[test]
    fn unknown_and_unregistered_vcpus_are_not_boosted() {
        let b = Booster::new(2, Fake::default());
        assert!(!b.boost(0).unwrap(), "no thread registered");
        assert!(!b.boost(9).unwrap());
        b.ran(9).unwrap();
        b.register(9, 1);
    }

    #[test]
    fn a_refused_boost_is_an_error_counted_and_leaves_nothing_behind() {
        let stats = Arc::new(crate::SchedStats::default());
        let refusing = Fake {
            refuse: true,
            ..Default::default()
        };
        let b = Booster::with_events(1, refusing, stats.clone());
        b.register(0, 5);
        assert_eq!(
            b.boost(0).unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert!(!b.is_boosted(0));
        assert!(
            !crate::Boost::boost(&b, 0),
            "through a policy: refused, and counted"
        );
        let errors = stats
            .boost_errors
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(errors, 2);
    }

    #[test]
    fn a_real_boost_past_its_limit_restores_the_thread() {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let target = std::thread::spawn(move || {
            tx.send(crate::thread::current_tid()).unwrap();
            done_rx.recv().unwrap();
        });
        let tid = rx.recv().unwrap();
        let before = crate::thread::get_attr(tid).unwrap();
        let b = Booster::new(1, crate::FifoBoost::default()).with_budget(BoostBudget {
            max_boost: Duration::ZERO,
            ..Default::default()
        });
        b.register(0, tid);
        match b.boost(0) {
            Ok(boosted) => assert!(boosted),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                eprintln!("SKIPPED: no CAP_SYS_NICE: {e}");
                return;
            }
            Err(e) => panic!("{e}"),
        }
        let fifo = libc::SCHED_FIFO as u32;
        assert_eq!(crate::thread::get_attr(tid).unwrap().policy, fifo);
        std::thread::sleep(Duration::from_millis(1));
        b.revoke_expired();
        assert_eq!(crate::thread::get_attr(tid).unwrap(), before);
        done_tx.send(()).unwrap();
        target.join().unwrap();
    }

    #[test]
    fn dropping_the_booster_restores_what_is_still_boosted() {
        let fake = Arc::new(Fake::default());
        {
            let b = Booster::new(1, fake.clone());
            b.register(0, 7);
            b.boost(0).unwrap();
        }
        assert_eq!(fake.calls.lock().unwrap().last(), Some(&("restore", 7)));
    }

    #[test]
    fn events_see_boosts_and_revocations() {
        let stats = Arc::new(crate::SchedStats::default());
        let b = Booster::with_events(1, Fake::default(), stats.clone()).with_budget(BoostBudget {
            max_boost: Duration::ZERO,
            ..Default::default()
        });
        b.register(0, 100);
        b.boost(0).unwrap();
        std::thread::sleep(Duration::from_millis(1));
        b.revoke_expired();
        use std::sync::atomic::Ordering::Relaxed;
        assert_eq!(
            (
                stats.boosts.load(Relaxed),
                stats.boosts_revoked.load(Relaxed)
            ),
            (1, 1)
        );
        assert!(stats.boost_ns.load(Relaxed) > 0);
    }
}
