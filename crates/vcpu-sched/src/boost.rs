//! The booster: raises a vCPU thread's priority through a [`ThreadControl`],
//! and takes every boost back: when the vCPU has run, and at the latest once
//! it has been boosted for [`BoostBudget::max_boost`], even if the boosted
//! thread never comes back to the VMM; and never beyond a budget per period.
//!
//! # The bound, enforced from outside the boosted thread
//! A boosted vCPU thread that spins in the guest never returns to the VMM, so
//! nothing it runs can end its boost, and on its CPU it now preempts whoever
//! would. The booster therefore keeps a *revoker* thread, which the thread
//! control raises above every boost ([`ThreadControl::prepare_revoker`]:
//! `SCHED_FIFO` one priority higher with [`crate::FifoBoost`]). It sleeps until
//! the earliest boost deadline and takes back every boost past it, from
//! whichever CPU it wakes on.
//!
//! A boost is recorded *before* it is applied, so no thread is ever boosted
//! without a record for the revoker to find. The vCPU running (`ran`) and the
//! revoker race with the booster only through that record: while it is being
//! applied, `ran` leaves a note for the booster to undo it once applied, and a
//! revoker that finds it past its deadline restores the thread at once, ends
//! the boost's time there, and marks the record for the booster to restore
//! the thread again once applied (the boost may land after the revoker's
//! restore), or the revoker's next look if the booster stalls. Only the
//! caller that takes a published record restores the thread, so no boost is
//! lost, and the record goes only once the thread is restored: whenever a
//! thread is boosted, a record says so ([`Booster::is_boosted`]). Each boost
//! is accounted once, up to its first restore, however long the booster
//! stalls.

use std::io;
use std::sync::Arc;
use std::sync::atomic::AtomicBool as StdAtomicBool;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crossbeam_utils::CachePadded;

use crate::clock::{Clock, MonotonicClock};
use crate::events::{NoEvents, SchedEvents};
use crate::sync::{AtomicI32, AtomicU64, Ordering::SeqCst};
use crate::thread::{ThreadControl, Tid, current_tid};

/// How long and how much boosting is allowed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct BoostBudget {
    /// No boost lasts longer than this (plus the revoker's wake-up).
    pub max_boost: Duration,
    /// Boosted time allowed per vCPU per period.
    pub per_period: Duration,
    /// The budget period.
    pub period: Duration,
}

impl BoostBudget {
    /// Boosts of at most `max_boost`, and at most `per_period` of boost per
    /// vCPU in each `period`.
    pub const fn new(max_boost: Duration, per_period: Duration, period: Duration) -> Self {
        Self {
            max_boost,
            per_period,
            period,
        }
    }
}

impl Default for BoostBudget {
    /// At most 1 ms per boost, and 2 ms of boost per vCPU per 10 ms.
    fn default() -> Self {
        Self::new(
            Duration::from_millis(1),
            Duration::from_millis(2),
            Duration::from_millis(10),
        )
    }
}

/// A record's state bit: the booster is still applying the boost.
const APPLYING: u64 = 1 << 63;
/// A record's state bit: the vCPU ran while the boost was being applied.
const CANCELLED: u64 = 1 << 62;
/// A record's state bit: taken back, and the thread is being restored.
const RESTORING: u64 = 1 << 61;
/// A record's state bit: past its deadline while still being applied, the
/// thread was restored and the boost accounted by the revoker; whoever takes
/// the published record restores the thread once more and accounts nothing.
const EXPIRED: u64 = 1 << 60;
/// The rest of a record: when the boost began, ns on the booster's clock, +1.
const SINCE: u64 = EXPIRED - 1;

#[derive(Debug, Default)]
struct Slot {
    tid: AtomicI32,
    /// 0 if not boosted; else the boost's start and its state bits.
    record: AtomicU64,
    period_start: AtomicU64,
    used: AtomicU64,
    /// The thread's CPU time when its boost began, ns + 1; 0: none to report.
    cpu_at_boost: AtomicU64,
    /// When the boost whose CPU time is to report began, ns on the clock.
    began_ns: AtomicU64,
}

impl Slot {
    /// Clears `APPLYING`: the boost is applied. Returns the record as it was
    /// (a compare-exchange loop, not `fetch_and`: loom 0.7 lets a racing
    /// update slip inside other read-modify-writes, tokio-rs/loom#254).
    fn publish(&self) -> u64 {
        let mut record = self.record.load(SeqCst);
        loop {
            match self
                .record
                .compare_exchange(record, record & !APPLYING, SeqCst, SeqCst)
            {
                Ok(_) => return record,
                Err(now) => record = now,
            }
        }
    }
}

/// What the booster and its revoker thread share.
struct Shared<T, E> {
    control: T,
    events: E,
    max_boost_ns: AtomicU64,
    per_period_ns: AtomicU64,
    period_ns: AtomicU64,
    slots: Vec<CachePadded<Slot>>,
    clock: Box<dyn Clock>,
    /// When each revoker wakes next (ns on the clock); `u64::MAX` while it
    /// waits for a boost, 0 while it looks at the records.
    revoker_wakes_at: Vec<AtomicU64>,
}

/// Boosts vCPU threads and takes every boost back.
///
/// [`Booster::new`] and [`Booster::with_events`] start the revoker thread
/// that enforces [`BoostBudget::max_boost`]; [`Booster::manual`] leaves
/// revocation to the caller ([`Booster::revoke_expired`]), for tests in
/// simulated time.
pub struct Booster<T: ThreadControl, E: SchedEvents = NoEvents> {
    shared: Arc<Shared<T, E>>,
    revokers: Vec<Revoker>,
}

/// The revoker thread and its stop flag.
struct Revoker {
    stop: Arc<StdAtomicBool>,
    thread: JoinHandle<()>,
}

impl<T: ThreadControl + 'static> Booster<T> {
    /// A booster for `vcpus` vCPUs acting through `control`, with its revoker.
    ///
    /// # Panics
    /// If the revoker thread cannot be spawned (the system is out of threads).
    pub fn new(vcpus: usize, control: T) -> Self {
        Booster::with_events(vcpus, control, NoEvents)
    }
}

impl<T: ThreadControl + 'static, E: SchedEvents + 'static> Booster<T, E> {
    /// A booster reporting to `events`, with its revoker.
    ///
    /// # Panics
    /// If the revoker thread cannot be spawned (the system is out of threads).
    pub fn with_events(vcpus: usize, control: T, events: E) -> Self {
        let revokers = control.revokers().max(1);
        let mut booster = Booster::build(vcpus, control, events, MonotonicClock, revokers);
        for which in 0..revokers {
            let stop = Arc::new(StdAtomicBool::new(false));
            let (shared, flag) = (booster.shared.clone(), stop.clone());
            let (raised, is_raised) = std::sync::mpsc::sync_channel(1);
            let name = match which {
                0 => "boost-revoker".to_string(),
                n => format!("boost-revoker-{n}"),
            };
            let thread = thread::Builder::new()
                .name(name)
                .spawn(move || {
                    shared.raise_revoker(which);
                    let _ = raised.send(());
                    shared.revoke_until(which, &flag)
                })
                .expect("spawning a boost revoker thread");
            // No boost before the revoker is above the boosts: a boosted
            // thread on the CPU it starts on would keep it from getting there.
            let _ = is_raised.recv();
            booster.revokers.push(Revoker { stop, thread });
        }
        booster
    }
}

impl<T: ThreadControl, E: SchedEvents> Booster<T, E> {
    /// A booster on `clock` without a revoker thread: the caller calls
    /// [`Booster::revoke_expired`] at least every `max_boost` (every `boost`
    /// does too). For tests in simulated time, or a VMM whose own timer loop
    /// runs above every boosted thread.
    pub fn manual(vcpus: usize, control: T, events: E, clock: impl Clock + 'static) -> Self {
        Booster::build(vcpus, control, events, clock, 0)
    }

    /// A booster with room for `revokers` revoker threads, none started.
    fn build(
        vcpus: usize,
        control: T,
        events: E,
        clock: impl Clock + 'static,
        revokers: usize,
    ) -> Self {
        let budget = BoostBudget::default();
        let ns = |d: Duration| AtomicU64::new(d.as_nanos() as u64);
        Self {
            shared: Arc::new(Shared {
                control,
                events,
                max_boost_ns: ns(budget.max_boost),
                per_period_ns: ns(budget.per_period),
                period_ns: ns(budget.period),
                slots: (0..vcpus).map(|_| CachePadded::default()).collect(),
                clock: Box::new(clock),
                revoker_wakes_at: (0..revokers).map(|_| AtomicU64::new(0)).collect(),
            }),
            revokers: Vec::new(),
        }
    }

    /// The same booster with another budget.
    pub fn with_budget(self, budget: BoostBudget) -> Self {
        let s = &self.shared;
        s.max_boost_ns
            .store(budget.max_boost.as_nanos() as u64, SeqCst);
        s.per_period_ns
            .store(budget.per_period.as_nanos() as u64, SeqCst);
        s.period_ns.store(budget.period.as_nanos() as u64, SeqCst);
        self.wake_revoker();
        self
    }

    /// Says which host thread runs vCPU `vcpu` (ignored for an unknown vCPU).
    pub fn register(&self, vcpu: usize, tid: Tid) {
        if let Some(s) = self.shared.slots.get(vcpu) {
            s.tid.store(tid, SeqCst);
        }
    }

    /// vCPU `vcpu` has no thread any more (hot-unplugged): ends its boost,
    /// if any, and forgets its thread, so that no later boost reaches a
    /// thread that reuses its id. Call it once that thread has stopped
    /// running the vCPU: a boost racing with this call is left to that
    /// thread's end.
    ///
    /// # Errors
    /// The boosted thread could not be restored; it is forgotten all the same.
    pub fn unregister(&self, vcpu: usize) -> io::Result<()> {
        let ended = self.ran(vcpu);
        if let Some(s) = self.shared.slots.get(vcpu) {
            s.tid.store(0, SeqCst);
        }
        ended
    }

    /// The thread control, for yielding.
    pub fn control(&self) -> &T {
        &self.shared.control
    }

    /// The events the booster reports to.
    pub fn events(&self) -> &E {
        &self.shared.events
    }

    /// Boosts vCPU `vcpu`'s thread; `Ok(false)` if it is unregistered, already
    /// boosted, out of budget for this period, or ran while the boost was
    /// being applied (then the boost is already undone). A boost that
    /// outlived [`BoostBudget::max_boost`] while this call was kept from
    /// returning is `Ok(true)`, and already revoked.
    ///
    /// # Errors
    /// The thread control's error, e.g. `PermissionDenied` without `CAP_SYS_NICE`.
    pub fn boost(&self, vcpu: usize) -> io::Result<bool> {
        let s = &*self.shared;
        if self.revokers.is_empty() {
            let _ = s.revoke_expired_at(s.now_ns());
        }
        let Some(slot) = s.slots.get(vcpu) else {
            return Ok(false);
        };
        let tid = slot.tid.load(SeqCst);
        if tid == 0 || slot.record.load(SeqCst) != 0 {
            return Ok(false);
        }
        let now = s.now_ns();
        if now.saturating_sub(slot.period_start.load(SeqCst)) >= s.period_ns.load(SeqCst) {
            slot.period_start.store(now, SeqCst);
            slot.used.store(0, SeqCst);
        }
        if slot.used.load(SeqCst) >= s.per_period_ns.load(SeqCst) {
            return Ok(false);
        }
        // Recorded before it is applied: the revoker can always find it.
        let record = APPLYING | (now + 1).min(SINCE);
        if slot
            .record
            .compare_exchange(0, record, SeqCst, SeqCst)
            .is_err()
        {
            return Ok(false); // a concurrent caller boosts it; its record stands
        }
        self.wake_revoker_by(now.saturating_add(s.max_boost_ns.load(SeqCst)));
        if let Some(cpu) = s.control.cpu_time(tid) {
            slot.began_ns.store(now, SeqCst);
            slot.cpu_at_boost.store(cpu.as_nanos() as u64 + 1, SeqCst);
        }
        if let Err(e) = s.control.boost(tid) {
            slot.cpu_at_boost.store(0, SeqCst);
            slot.record.store(0, SeqCst);
            s.events.boost_failed(vcpu, &e);
            return Err(e);
        }
        s.events.boosted(vcpu);
        let record = slot.publish();
        if record & EXPIRED != 0 {
            s.take_expired(vcpu, slot, record & !APPLYING)?; // the revoker ended it
            return Ok(true);
        }
        if record & CANCELLED != 0 {
            s.unboost(vcpu, false)?; // it ran meanwhile
            return Ok(false);
        }
        Ok(true)
    }

    /// vCPU `vcpu` ran: undo its boost, if any.
    ///
    /// # Errors
    /// The thread control's error restoring the thread (also reported to the
    /// events).
    pub fn ran(&self, vcpu: usize) -> io::Result<()> {
        self.shared.unboost(vcpu, false)
    }

    /// Takes back every boost older than `max_boost` (the revoker does it at
    /// each deadline; with [`Booster::manual`], the caller does).
    pub fn revoke_expired(&self) {
        let s = &*self.shared;
        let _ = s.revoke_expired_at(s.now_ns());
    }

    /// Reports a directed-yield attempt to the events.
    pub fn report_directed_yield(&self, successful: bool) {
        self.shared.events.directed_yield(successful);
    }

    /// Whether vCPU `vcpu` is boosted now (or being boosted).
    pub fn is_boosted(&self, vcpu: usize) -> bool {
        self.shared
            .slots
            .get(vcpu)
            .is_some_and(|s| s.record.load(SeqCst) != 0)
    }

    /// Has the revokers look at the records again.
    fn wake_revoker(&self) {
        for r in &self.revokers {
            r.thread.thread().unpark();
        }
    }

    /// Makes sure every revoker wakes by `deadline`: each looks at the
    /// records after storing when it wakes next, and this reads that after
    /// recording the boost, so either it saw the record or this sees a
    /// wake-up to move.
    fn wake_revoker_by(&self, deadline: u64) {
        for (r, wakes_at) in self.revokers.iter().zip(&self.shared.revoker_wakes_at) {
            let wakes_at = wakes_at.load(SeqCst);
            if wakes_at == 0 || deadline < wakes_at {
                r.thread.thread().unpark();
            }
        }
    }
}

impl<T: ThreadControl, E: SchedEvents> Shared<T, E> {
    fn now_ns(&self) -> u64 {
        self.clock.now().as_nanos() as u64
    }

    /// Takes the record of vCPU `vcpu` and restores its thread; a record
    /// still being applied is only marked, for the booster to undo.
    fn unboost(&self, vcpu: usize, revoked: bool) -> io::Result<()> {
        let Some(slot) = self.slots.get(vcpu) else {
            return Ok(());
        };
        // Read with a read-modify-write, which sees the latest record: the
        // caller's run-state store and this read pair with the booster's
        // record and its read of the vCPU's state (`boost_ready`).
        let mut record = match slot.record.compare_exchange(0, 0, SeqCst, SeqCst) {
            Ok(_) => return Ok(()),
            Err(record) => record,
        };
        loop {
            if record == 0 || record & (RESTORING | EXPIRED) != 0 {
                return Ok(()); // not boosted, or someone else restores it
            }
            let (next, taken) = if record & APPLYING != 0 {
                (record | CANCELLED, false)
            } else {
                (record | RESTORING, true)
            };
            match slot.record.compare_exchange(record, next, SeqCst, SeqCst) {
                Ok(_) if taken => break,
                Ok(_) => return Ok(()),
                Err(now) => record = now,
            }
        }
        let started = (record & SINCE).saturating_sub(1);
        let held = self.now_ns().saturating_sub(started);
        slot.used.fetch_add(held, SeqCst);
        self.events
            .unboosted(vcpu, Duration::from_nanos(held), revoked);
        // The record goes only once the thread is back: whenever a thread
        // is boosted, a record says so.
        let restored = self.restore(vcpu, slot);
        slot.record.store(0, SeqCst);
        restored
    }

    /// Ends the time of boost `record`, still being applied past its
    /// deadline at `now`, where the revoker restored its thread: accounted
    /// now, and marked [`EXPIRED`] for whoever takes it once published.
    fn expire(&self, vcpu: usize, slot: &Slot, mut record: u64, now: u64) {
        while record & APPLYING != 0 && record & EXPIRED == 0 {
            match slot
                .record
                .compare_exchange(record, record | EXPIRED, SeqCst, SeqCst)
            {
                Ok(_) => {
                    let held = now.saturating_sub((record & SINCE).saturating_sub(1));
                    slot.used.fetch_add(held, SeqCst);
                    self.events
                        .unboosted(vcpu, Duration::from_nanos(held), true);
                    return;
                }
                Err(changed) => record = changed,
            }
        }
    }

    /// Takes the published [`EXPIRED`] `record`, if no one else did, and
    /// restores its thread once more: the boost may have landed after the
    /// revoker's restore.
    fn take_expired(&self, vcpu: usize, slot: &Slot, record: u64) -> io::Result<()> {
        if slot
            .record
            .compare_exchange(record, record | RESTORING, SeqCst, SeqCst)
            .is_err()
        {
            return Ok(()); // taken by the revoker's next look, or the booster
        }
        let restored = self.restore(vcpu, slot);
        slot.record.store(0, SeqCst);
        restored
    }

    /// Restores vCPU `vcpu`'s thread; the first restore of a boost reports
    /// the CPU time the thread ran since it began: read after the restore,
    /// at most the wall time from the boost to the restore (a restorer kept
    /// off its CPU between the two would count what the thread ran after).
    fn restore(&self, vcpu: usize, slot: &Slot) -> io::Result<()> {
        let tid = slot.tid.load(SeqCst);
        if tid == 0 {
            // Unregistered while boosted: no thread to restore (and a tid of
            // 0 would name the calling thread).
            slot.cpu_at_boost.store(0, SeqCst);
            return Ok(());
        }
        // Before the restore: a restorer kept off its CPU after it must not
        // widen the cap.
        let ended = (slot.cpu_at_boost.load(SeqCst) != 0).then(|| self.now_ns());
        let restored = self
            .control
            .restore(tid)
            .inspect_err(|e| self.events.restore_failed(vcpu, e));
        let at_boost = match slot.cpu_at_boost.load(SeqCst) {
            0 => 0,
            _ => slot.cpu_at_boost.swap(0, SeqCst),
        };
        if at_boost != 0 {
            if let Some(now) = self.control.cpu_time(tid) {
                let ran = (now.as_nanos() as u64).saturating_sub(at_boost - 1).min(
                    ended
                        .unwrap_or(u64::MAX)
                        .saturating_sub(slot.began_ns.load(SeqCst)),
                );
                self.events.boost_ran(vcpu, Duration::from_nanos(ran));
            }
        }
        restored
    }

    /// Takes back every boost past its deadline at `now`; returns the next
    /// deadline, if any boost is left, and whether it took any back.
    fn revoke_expired_at(&self, now: u64) -> (Option<u64>, bool) {
        let max = self.max_boost_ns.load(SeqCst);
        let mut next: Option<u64> = None;
        let mut revoked = false;
        for (vcpu, slot) in self.slots.iter().enumerate() {
            let record = slot.record.load(SeqCst);
            if record == 0 || record & RESTORING != 0 {
                continue;
            }
            if record & (EXPIRED | APPLYING) == EXPIRED {
                let _ = self.take_expired(vcpu, slot, record); // its booster stalled
                continue;
            }
            let deadline = (record & SINCE).saturating_sub(1).saturating_add(max);
            let wake = if now <= deadline {
                deadline + 1
            } else if record & APPLYING != 0 {
                // The booster stalled while applying it: the thread goes
                // back now (and at each look until the record is published),
                // and the booster takes the record once it is.
                let _ = self.restore(vcpu, slot);
                self.expire(vcpu, slot, record, now);
                revoked = true;
                now.saturating_add(max.max(1))
            } else {
                let _ = self.unboost(vcpu, true);
                revoked = true;
                continue;
            };
            next = Some(next.map_or(wake, |n| n.min(wake)));
        }
        (next, revoked)
    }

    /// Puts the calling thread, revoker `which`, above every boost.
    fn raise_revoker(&self, which: usize) {
        if let Err(e) = self.control.prepare_revoker(current_tid(), which) {
            self.events.revoker_failed(&e);
        }
    }

    /// The revoker thread: above every boost, sleeps until the next deadline
    /// and takes back what expired, until `stop`.
    fn revoke_until(&self, which: usize, stop: &StdAtomicBool) {
        let wakes_at = &self.revoker_wakes_at[which];
        // The deadline it last slept until.
        let mut slept_until = None;
        while !stop.load(SeqCst) {
            wakes_at.store(0, SeqCst);
            let now = self.now_ns();
            let (next, revoked) = self.revoke_expired_at(now);
            // How late the host woke it to take a boost back: at most what
            // that boost ran past its deadline (a new boost wakes it early).
            if let Some(at) = slept_until.take().filter(|&at| revoked && now > at) {
                self.events
                    .revoker_woke_late(Duration::from_nanos(now - at));
            }
            wakes_at.store(next.unwrap_or(u64::MAX), SeqCst);
            if stop.load(SeqCst) {
                break;
            }
            match next {
                None => thread::park(),
                Some(at) => {
                    thread::park_timeout(Duration::from_nanos(at.saturating_sub(self.now_ns())));
                    slept_until = Some(at);
                }
            }
        }
    }
}

impl<T: ThreadControl, E: SchedEvents> std::fmt::Debug for Booster<T, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ns = |a: &AtomicU64| Duration::from_nanos(a.load(SeqCst));
        let s = &self.shared;
        f.debug_struct("Booster")
            .field("vcpus", &s.slots.len())
            .field(
                "budget",
                &BoostBudget {
                    max_boost: ns(&s.max_boost_ns),
                    per_period: ns(&s.per_period_ns),
                    period: ns(&s.period_ns),
                },
            )
            .field("revokers", &self.revokers.len())
            .finish()
    }
}

impl<T: ThreadControl, E: SchedEvents> Drop for Booster<T, E> {
    /// The revoker stops, and nothing stays boosted.
    fn drop(&mut self) {
        for r in self.revokers.drain(..) {
            r.stop.store(true, SeqCst);
            r.thread.thread().unpark();
            let _ = r.thread.join();
        }
        for vcpu in 0..self.shared.slots.len() {
            let _ = self.shared.unboost(vcpu, false);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::clock::FakeClock;
    use crate::events::SchedStats;
    use std::sync::Mutex;
    use std::sync::atomic::Ordering::Relaxed;

    type Hook = Box<dyn Fn() + Send + Sync>;

    /// Records boosts and restores, can refuse either, and can run a hook in
    /// the middle of a boost (what another thread does meanwhile).
    #[derive(Default)]
    struct Fake {
        calls: Mutex<Vec<(&'static str, Tid)>>,
        refuse: bool,
        refuse_restore: bool,
        during_boost: Mutex<Option<Hook>>,
        /// Revoker threads wanted (0: the default, 1).
        revokers: usize,
        /// The revokers raised, by index.
        raised: Mutex<Vec<usize>>,
        /// The CPU time every thread has run (`None`: cannot tell).
        cpu: Mutex<Option<Duration>>,
    }

    impl ThreadControl for Fake {
        fn boost(&self, tid: Tid) -> io::Result<()> {
            if self.refuse {
                return Err(io::Error::from(io::ErrorKind::PermissionDenied));
            }
            self.calls.lock().unwrap().push(("boost", tid));
            if let Some(hook) = &*self.during_boost.lock().unwrap() {
                hook();
            }
            Ok(())
        }
        fn restore(&self, tid: Tid) -> io::Result<()> {
            self.calls.lock().unwrap().push(("restore", tid));
            if self.refuse_restore {
                return Err(io::Error::from(io::ErrorKind::PermissionDenied));
            }
            Ok(())
        }
        fn revokers(&self) -> usize {
            self.revokers.max(1)
        }
        fn prepare_revoker(&self, _tid: Tid, revoker: usize) -> io::Result<()> {
            self.raised.lock().unwrap().push(revoker);
            Ok(())
        }
        fn cpu_time(&self, _tid: Tid) -> Option<Duration> {
            *self.cpu.lock().unwrap()
        }
    }

    const MAX: Duration = Duration::from_millis(1);

    type Tested = Booster<Arc<Fake>, Arc<SchedStats>>;

    /// A booster in simulated time, with its clock and its statistics.
    fn booster(fake: Fake) -> (Arc<Tested>, Arc<FakeClock>, Arc<SchedStats>) {
        let clock = Arc::new(FakeClock::default());
        let stats = Arc::new(SchedStats::default());
        let b = Booster::manual(2, Arc::new(fake), stats.clone(), clock.clone());
        b.register(0, 100);
        b.register(1, 101);
        (Arc::new(b), clock, stats)
    }

    fn calls(b: &Tested) -> Vec<(&'static str, Tid)> {
        b.control().calls.lock().unwrap().clone()
    }

    #[test]
    fn a_boost_is_undone_when_the_vcpu_runs_and_only_once() {
        let (b, ..) = booster(Fake::default());
        assert!(b.boost(1).unwrap());
        assert!(!b.boost(1).unwrap(), "already boosted");
        b.ran(1).unwrap();
        b.ran(1).unwrap();
        assert_eq!(calls(&b), [("boost", 101), ("restore", 101)]);
        assert!(!b.is_boosted(1));
    }

    #[test]
    fn an_unregistered_vcpu_s_boost_ends_and_no_later_boost_reaches_its_thread() {
        let (b, ..) = booster(Fake::default());
        assert!(b.boost(1).unwrap());
        b.unregister(1).unwrap();
        assert!(!b.is_boosted(1));
        assert!(!b.boost(1).unwrap(), "no thread to boost");
        b.register(1, 102);
        assert!(b.boost(1).unwrap(), "plugged again");
        assert_eq!(
            calls(&b),
            [("boost", 101), ("restore", 101), ("boost", 102)]
        );
    }

    #[test]
    fn a_boost_whose_vcpu_was_unregistered_meanwhile_restores_no_thread() {
        // A delivery's boost raced with the unplug: its end must not restore
        // tid 0, the calling thread.
        let (b, ..) = booster(Fake::default());
        let weak = Arc::downgrade(&b);
        *b.control().during_boost.lock().unwrap() = Some(Box::new(move || {
            weak.upgrade().unwrap().unregister(0).unwrap();
        }));
        assert!(!b.boost(0).unwrap(), "ended by the unplug");
        assert_eq!(calls(&b), [("boost", 100)]);
        assert!(!b.is_boosted(0));
    }

    #[test]
    fn a_boost_is_recorded_before_it_is_applied_and_a_run_meanwhile_undoes_it() {
        // The target runs while the booster applies its boost (it preempted
        // the booster): it finds the record, and the boost is undone as soon
        // as it is applied, not left behind.
        let (b, _, stats) = booster(Fake::default());
        let seen = Arc::new(Mutex::new(None));
        let (weak, saw) = (Arc::downgrade(&b), seen.clone());
        *b.control().during_boost.lock().unwrap() = Some(Box::new(move || {
            let b = weak.upgrade().unwrap();
            *saw.lock().unwrap() = Some(b.is_boosted(0));
            b.ran(0).unwrap();
        }));
        assert!(!b.boost(0).unwrap(), "undone: the vCPU ran");
        assert_eq!(*seen.lock().unwrap(), Some(true), "recorded while applied");
        assert_eq!(calls(&b), [("boost", 100), ("restore", 100)]);
        assert!(!b.is_boosted(0));
        assert_eq!(stats.boosts.load(Relaxed), 1);
    }

    #[test]
    fn each_boost_reports_the_cpu_time_its_thread_ran_once() {
        let (b, clock, stats) = booster(Fake::default());
        let most_cpu = || Duration::from_nanos(stats.most_boost_cpu_ns.load(Relaxed));
        let set_cpu = |us| *b.control().cpu.lock().unwrap() = Some(Duration::from_micros(us));
        // Ended by the vCPU's run.
        set_cpu(10);
        assert!(b.boost(0).unwrap());
        set_cpu(45);
        clock.advance(Duration::from_micros(50));
        b.ran(0).unwrap();
        assert_eq!(most_cpu(), Duration::from_micros(35));
        // Taken back by the revoker.
        assert!(b.boost(1).unwrap());
        set_cpu(145);
        clock.advance(MAX + Duration::from_nanos(1));
        b.revoke_expired();
        assert_eq!(most_cpu(), Duration::from_micros(100));
        // A booster stalled past the deadline while applying: the revoker's
        // restore reports; the booster's second restore adds nothing.
        let (weak, clock2) = (Arc::downgrade(&b), clock.clone());
        *b.control().during_boost.lock().unwrap() = Some(Box::new(move || {
            let b = weak.upgrade().unwrap();
            clock2.advance(MAX + Duration::from_nanos(1));
            *b.control().cpu.lock().unwrap() = Some(Duration::from_micros(265));
            b.revoke_expired();
            *b.control().cpu.lock().unwrap() = Some(Duration::from_micros(900));
        }));
        assert!(b.boost(0).unwrap(), "revoked while applied");
        assert!(!b.is_boosted(0));
        assert_eq!(most_cpu(), Duration::from_micros(120));
    }

    #[test]
    fn a_boost_s_cpu_time_is_at_most_its_wall_time() {
        // The thread's clock read after the restore also counts what it ran
        // since, where the restorer was kept off its CPU in between: 500 µs
        // of CPU in a boost of 100 µs reports 100 µs.
        let (b, clock, stats) = booster(Fake::default());
        *b.control().cpu.lock().unwrap() = Some(Duration::from_micros(10));
        assert!(b.boost(0).unwrap());
        clock.advance(Duration::from_micros(100));
        *b.control().cpu.lock().unwrap() = Some(Duration::from_micros(510));
        b.ran(0).unwrap();
        assert_eq!(stats.most_boost_cpu_ns.load(Relaxed), 100_000);
    }

    #[test]
    fn a_boost_past_max_boost_is_revoked_and_not_before() {
        let (b, clock, stats) = booster(Fake::default());
        assert!(b.boost(0).unwrap());
        clock.advance(MAX);
        b.revoke_expired();
        assert!(b.is_boosted(0), "at max_boost exactly: not yet");
        clock.advance(Duration::from_nanos(1));
        b.revoke_expired();
        assert!(!b.is_boosted(0));
        assert_eq!(calls(&b), [("boost", 100), ("restore", 100)]);
        assert_eq!(stats.boosts_revoked.load(Relaxed), 1);
        assert_eq!(stats.boost_ns.load(Relaxed), 1_000_001);
        assert!(b.boost(0).unwrap());
        clock.advance(Duration::from_micros(10));
        b.ran(0).unwrap();
        assert_eq!(
            stats.longest_boost_ns.load(Relaxed),
            1_000_001,
            "the longest of the two boosts"
        );
    }

    #[test]
    fn a_boost_that_stalls_while_applied_is_restored_and_accounted_at_its_deadline() {
        // The booster is kept off the CPU between applying the boost and
        // publishing it, past the deadline and long after: the revoker
        // restores the thread and ends the boost's time then; the booster
        // restores it again once it publishes (its boost may have landed
        // after the revoker's restore) and takes the record.
        let (b, clock, stats) = booster(Fake::default());
        let (weak, stalled) = (Arc::downgrade(&b), clock.clone());
        *b.control().during_boost.lock().unwrap() = Some(Box::new(move || {
            stalled.advance(2 * MAX);
            let b = weak.upgrade().unwrap();
            b.revoke_expired();
            assert_eq!(calls(&b), [("boost", 100), ("restore", 100)], "at once");
            assert!(b.is_boosted(0), "the record stays until published");
            stalled.advance(50 * MAX);
            b.revoke_expired();
        }));
        assert!(b.boost(0).unwrap(), "boosted, and revoked while applied");
        assert_eq!(
            calls(&b),
            [
                ("boost", 100),
                ("restore", 100),
                ("restore", 100),
                ("restore", 100)
            ],
            "at each look, and once published"
        );
        assert!(!b.is_boosted(0));
        let get = |a: &AtomicU64| a.load(Relaxed);
        assert_eq!(
            (get(&stats.boosts_revoked), get(&stats.longest_boost_ns)),
            (1, 2_000_000),
            "once, to the revoker's restore, not the booster's return"
        );
        assert_eq!(b.shared.slots[0].used.load(SeqCst), 2_000_000);
        b.revoke_expired();
        assert_eq!(calls(&b).len(), 4, "nothing left for the revoker");
    }

    #[test]
    fn an_expired_record_its_booster_has_not_taken_is_taken_by_the_revokers_next_look() {
        let (b, clock, stats) = booster(Fake::default());
        let slot = &b.shared.slots[1];
        // As left by a booster that stalled past its deadline, was expired,
        // then published and stalled again before taking it.
        slot.record.store(APPLYING | 1, SeqCst);
        clock.advance(2 * MAX);
        b.revoke_expired();
        assert_eq!(slot.publish() & EXPIRED, EXPIRED);
        b.ran(1).unwrap();
        assert!(b.is_boosted(1), "running leaves it to the one taking it");
        b.revoke_expired();
        assert!(!b.is_boosted(1));
        assert_eq!(calls(&b), [("restore", 101), ("restore", 101)]);
        assert_eq!(stats.boosts_revoked.load(Relaxed), 1, "accounted once");
    }

    #[test]
    fn the_budget_per_period_is_enforced() {
        let (b, clock, _) = booster(Fake::default());
        let b = Arc::into_inner(b).unwrap().with_budget(BoostBudget {
            per_period: Duration::from_nanos(1),
            period: Duration::from_secs(60),
            ..Default::default()
        });
        assert!(b.boost(0).unwrap());
        clock.advance(Duration::from_micros(10));
        b.ran(0).unwrap();
        assert!(!b.boost(0).unwrap(), "the budget for this period is spent");
        assert!(b.boost(1).unwrap(), "budgets are per vCPU");
        clock.advance(Duration::from_secs(60));
        b.ran(1).unwrap();
        assert!(b.boost(0).unwrap(), "a new period");
    }

    #[test]
    fn a_budget_spent_to_the_nanosecond_refuses_a_boost_until_the_next_period() {
        // The budget is spent once `used >= per_period`: spent exactly, no
        // further boost in this period; 1 ns short, one more; and the next
        // period grants again.
        const PERIOD: Duration = Duration::from_millis(10);
        let (b, clock, _) = booster(Fake::default());
        let b = Arc::into_inner(b).unwrap().with_budget(BoostBudget::new(
            MAX,
            Duration::from_micros(10),
            PERIOD,
        ));
        let used = |vcpu: usize| b.shared.slots[vcpu].used.load(SeqCst);
        // vCPU 0 spends 4 µs + 6 µs in two boosts; vCPU 1 1 ns less in one.
        assert!(b.boost(0).unwrap());
        assert!(b.boost(1).unwrap());
        clock.advance(Duration::from_micros(4));
        b.ran(0).unwrap();
        assert!(b.boost(0).unwrap(), "4 of 10 µs spent");
        clock.advance(Duration::from_nanos(5_999));
        b.ran(1).unwrap();
        clock.advance(Duration::from_nanos(1));
        b.ran(0).unwrap();
        assert_eq!((used(0), used(1)), (10_000, 9_999));
        assert!(
            !b.boost(0).unwrap(),
            "a budget spent to the nanosecond grants no boost in this period"
        );
        assert!(!b.is_boosted(0));
        assert!(b.boost(1).unwrap(), "1 ns of budget left: one more boost");
        b.ran(1).unwrap();
        // The last nanosecond of the period is still this period.
        clock.set(PERIOD - Duration::from_nanos(1));
        assert!(!b.boost(0).unwrap(), "still spent in this period");
        clock.advance(Duration::from_nanos(1));
        assert!(b.boost(0).unwrap(), "a new period grants a boost again");
        assert_eq!(used(0), 0, "a new period starts unspent");
        b.ran(0).unwrap();
        assert_eq!(
            calls(&b),
            [
                ("boost", 100),
                ("boost", 101),
                ("restore", 100),
                ("boost", 100),
                ("restore", 101),
                ("restore", 100),
                ("boost", 101),
                ("restore", 101),
                ("boost", 100),
                ("restore", 100),
            ],
            "no thread boosted while its budget was spent"
        );
    }

    #[test]
    fn unknown_and_unregistered_vcpus_are_not_boosted() {
        let b = Booster::manual(2, Fake::default(), NoEvents, FakeClock::default());
        assert!(!b.boost(0).unwrap(), "no thread registered");
        assert!(!b.boost(9).unwrap());
        b.ran(9).unwrap();
        b.register(9, 1);
    }

    #[test]
    fn a_refused_boost_is_an_error_counted_and_leaves_nothing_behind() {
        let (b, _, stats) = booster(Fake {
            refuse: true,
            ..Default::default()
        });
        assert_eq!(
            b.boost(0).unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
        assert!(!b.is_boosted(0));
        let sched = crate::Scheduler::new(1, crate::NoBoost, &*b, crate::NoGuestView);
        assert!(
            !sched.ctx().boost(0),
            "through a policy: refused, and counted"
        );
        assert_eq!(stats.boost_errors.load(Relaxed), 2);
    }

    #[test]
    fn a_failed_restore_is_an_error_and_reported() {
        let (b, clock, stats) = booster(Fake {
            refuse_restore: true,
            ..Default::default()
        });
        b.boost(0).unwrap();
        assert!(b.ran(0).is_err());
        b.boost(1).unwrap();
        clock.advance(2 * MAX);
        b.revoke_expired();
        assert_eq!(
            stats.restore_errors.load(Relaxed),
            2,
            "by run and by revocation"
        );
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
    fn the_revoker_thread_takes_a_boost_back_without_anyone_asking() {
        let fake = Arc::new(Fake::default());
        let stats = Arc::new(SchedStats::default());
        let b = Booster::with_events(1, fake.clone(), stats.clone());
        b.register(0, 7);
        assert!(b.boost(0).unwrap());
        // A hang detector, not a bound: the revoker's timing is measured by
        // the `boost_bound` example.
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        while b.is_boosted(0) && std::time::Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(!b.is_boosted(0), "never revoked");
        assert_eq!(fake.calls.lock().unwrap().last(), Some(&("restore", 7)));
        assert_eq!(stats.boosts_revoked.load(Relaxed), 1);
    }

    #[test]
    fn with_two_revokers_both_are_raised_and_each_boost_is_taken_back_once() {
        let fake = Arc::new(Fake {
            revokers: 2,
            ..Fake::default()
        });
        let stats = Arc::new(SchedStats::default());
        let b = Booster::with_events(1, fake.clone(), stats.clone());
        let mut raised = fake.raised.lock().unwrap().clone();
        raised.sort_unstable();
        assert_eq!(
            raised,
            [0, 1],
            "each revoker raised, before the booster exists"
        );
        b.register(0, 7);
        for _ in 0..20 {
            assert!(b.boost(0).unwrap());
            let give_up = std::time::Instant::now() + Duration::from_secs(10);
            while b.is_boosted(0) && std::time::Instant::now() < give_up {
                std::thread::sleep(Duration::from_micros(200));
            }
            assert!(!b.is_boosted(0), "never revoked");
            // Nothing used, so the budget per period never refuses.
            b.shared.slots[0].used.store(0, SeqCst);
        }
        // Each boost is taken back once (a restore may come twice, as the
        // contract allows, when a revoker finds a boost still being applied).
        let calls = fake.calls.lock().unwrap().clone();
        let restores = calls.iter().filter(|c| c.0 == "restore").count();
        assert!(restores >= 20, "every boost restored: {calls:?}");
        assert_eq!(stats.boosts_revoked.load(Relaxed), 20);
        assert_eq!(stats.boosts.load(Relaxed), 20);
        drop(b);
    }

    /// A thread pinned to `cpu` that spins until stopped: a vCPU spinning
    /// in guest mode, which never comes back to ask for its boost to end.
    struct Spinner {
        tid: Tid,
        stop: Arc<StdAtomicBool>,
        thread: std::thread::JoinHandle<()>,
    }

    impl Spinner {
        fn on(cpu: usize) -> Self {
            let (tx, rx) = std::sync::mpsc::channel();
            let stop = Arc::new(StdAtomicBool::new(false));
            let spin = stop.clone();
            let thread = std::thread::spawn(move || {
                crate::thread::pin(0, &[cpu]).unwrap();
                tx.send(current_tid()).unwrap();
                while !spin.load(std::sync::atomic::Ordering::Relaxed) {
                    std::hint::spin_loop();
                }
            });
            let tid = rx.recv().unwrap();
            Self { tid, stop, thread }
        }

        fn stop(self) {
            self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
            self.thread.join().unwrap();
        }
    }

    /// Boosts vCPU 0 (thread `tid`) and waits (a hang detector, not a
    /// bound) until the boost is gone; `None` (printed) without
    /// `CAP_SYS_NICE`.
    fn boost_and_wait(
        b: &Booster<crate::FifoBoost, Arc<SchedStats>>,
        tid: Tid,
        test: &str,
    ) -> Option<()> {
        b.register(0, tid);
        let boosted = b.boost(0);
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        while b.is_boosted(0) && std::time::Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
        match boosted {
            Ok(true) => Some(()),
            Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {
                eprintln!("SKIPPED {test}: no CAP_SYS_NICE: {e}");
                None
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_real_thread_that_spins_once_boosted_is_restored_by_the_revoker() {
        // The target spins on the booster's CPU at SCHED_FIFO. Only the
        // revoker, above it, can end its boost.
        let target = Spinner::on(crate::thread::available_cpus().unwrap()[0]);
        let before = crate::thread::get_attr(target.tid).unwrap();
        let stats = Arc::new(SchedStats::default());
        let b = Booster::with_events(1, crate::FifoBoost::default(), stats.clone());
        let done = boost_and_wait(
            &b,
            target.tid,
            "a_real_thread_that_spins_once_boosted_is_restored_by_the_revoker",
        );
        let after = crate::thread::get_attr(target.tid).unwrap();
        target.stop();
        if done.is_none() {
            return;
        }
        assert_eq!(after, before, "restored");
        assert_eq!(stats.boosts_revoked.load(Relaxed), 1);
        assert_eq!(stats.revoker_errors.load(Relaxed), 0);
        // It took the boost back after sleeping until a deadline, which
        // the host woke it past: how late is reported. (Only an upper
        // bound on the boost's overrun: under qemu-user a revoker woke
        // 10.9 ms late for a boost held 2.0 ms, so no tighter check.)
        let late = stats.latest_revoker_wake_ns.load(Relaxed);
        assert!(late > 0, "the revoker's wake-up was reported");
        // The CPU time the spinner ran while boosted, from its own clock:
        // some, and no more than the boost lasted (which is read just
        // before the restore; the margin is for the restore itself).
        let cpu = Duration::from_nanos(stats.most_boost_cpu_ns.load(Relaxed));
        let held = Duration::from_nanos(stats.longest_boost_ns.load(Relaxed));
        let no_clock = crate::thread::thread_cpu_time(current_tid()).is_err();
        if (cpu == Duration::ZERO && no_clock) || cfg!(target_arch = "aarch64") {
            // qemu-user (.ci/run's aarch64 step) reads another thread's CPU
            // clock as none at all or as more than the wall time between
            // two reads (5.7 ms in a boost held 1.2 ms): no bound holds.
            let why = "no trustworthy thread CPU clock here: the boost's CPU time is not checked";
            eprintln!("SKIPPED (in part): {why}");
            if let Some(log) = std::env::var_os("SKIPPED_TESTS_LOG") {
                let line = format!("vcpu-sched::a_real_thread_that_spins_once_boosted: {why}\n");
                let _ = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
            }
            return;
        }
        assert!(
            cpu > Duration::ZERO && cpu <= held + Duration::from_millis(1),
            "ran {cpu:?} in a boost held {held:?}"
        );
    }

    #[test]
    fn a_boost_on_the_boosters_own_cpu_right_after_new_is_revoked_in_time() {
        // The booster, its target and (by inheritance) its revoker start on
        // one CPU, and the first boost comes at once: a revoker that had not
        // yet raised itself would wait behind the target until the kernel's
        // fair server ran it, most of a second later.
        let cpu = crate::thread::available_cpus().unwrap()[0];
        crate::thread::pin(0, &[cpu]).unwrap();
        let target = Spinner::on(cpu);
        let stats = Arc::new(SchedStats::default());
        let b = Booster::with_events(1, crate::FifoBoost::default(), stats.clone());
        let done = boost_and_wait(
            &b,
            target.tid,
            "a_boost_on_the_boosters_own_cpu_right_after_new_is_revoked_in_time",
        );
        target.stop();
        if done.is_none() {
            return;
        }
        // The budget is 1 ms; the margin is for a loaded host, far below
        // the fair server's wait.
        let held = Duration::from_nanos(stats.longest_boost_ns.load(Relaxed));
        assert!(held < Duration::from_millis(100), "held {held:?}");
        assert_eq!(stats.boosts_revoked.load(Relaxed), 1);
    }
}
