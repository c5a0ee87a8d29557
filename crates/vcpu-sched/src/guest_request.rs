//! Boosts a guest asks for: it marks, in memory it shares with the host,
//! that a vCPU is in a critical section (holds a spinlock, runs an interrupt
//! handler), and the host boosts that vCPU's thread if it is kept off its
//! CPU meanwhile, so that its siblings do not spin on a lock whose holder
//! waits behind other tenants (the paravirt scheduling RFC's shared page;
//! ChromeOS caps such a boost at 3 ms per critical section).
//!
//! The guest controls the page, so the bound never depends on what it
//! says: a boost lasts at most the booster's [`max_boost`](crate::BoostBudget::max_boost),
//! the boosts of one request (one [`BoostRequest::sequence`]) span at most
//! [`RequestLimits::per_request`] from the first, and a vCPU gets at most the
//! booster's [`per_period`](crate::BoostBudget::per_period) in every period,
//! however often it flips the mark.
//!
//! # The page
//! One 8-byte word per vCPU, little-endian, at an address the VMM and the
//! guest agree on (an MSR the guest writes, say); the VMM reads it with
//! [`RequestWords`] (an impl over its guest memory):
//!
//! | bits | field | written by |
//! |---|---|---|
//! | 31:0 | `sequence`: incremented on each entry into a critical section | guest |
//! | 32 | `active`: in a critical section now | guest |
//! | 63:33 | reserved, ignored | |
//!
//! ```
//! # fn main() -> std::io::Result<()> {
//! use std::sync::Arc;
//! use std::sync::atomic::AtomicU64;
//! use std::time::Duration;
//! use vcpu_sched::thread::current_tid;
//! use vcpu_sched::{Booster, FifoBoost, GuestBoosts, NoBoost, NoGuestView};
//! use vcpu_sched::{RequestLimits, RequestWatcher, Scheduler};
//!
//! let booster = Booster::new(2, FifoBoost::default());
//! let sched = Arc::new(Scheduler::new(2, NoBoost, booster, NoGuestView));
//! sched.register_thread(0, current_tid())?; // each vCPU thread
//! // Each vCPU's word: here the VMM's own; a VMM reads guest memory.
//! let words: Arc<[AtomicU64]> = (0..2).map(|_| AtomicU64::new(0)).collect();
//! let requests = Arc::new(GuestBoosts::new(2, words, RequestLimits::default()));
//! let watcher = RequestWatcher::spawn(requests, sched.clone(), Duration::from_micros(500))?;
//! drop(watcher); // stops it
//! # Ok(())
//! # }
//! ```

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::clock::{Clock, MonotonicClock};
use crate::directed_yield::GuestView;
use crate::policy::{Boost, BoostPolicy, Ctx};
use crate::probe::ThreadSeen;
use crate::scheduler::Scheduler;
use std::sync::atomic::Ordering::SeqCst;

/// One vCPU's request word, decoded; every word decodes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BoostRequest {
    /// Which critical section: a new value is a new request.
    pub sequence: u32,
    /// The vCPU is in it now.
    pub active: bool,
}

/// The `active` bit of a request word.
const ACTIVE: u64 = 1 << 32;

impl BoostRequest {
    /// Decodes a word as the guest wrote it (reserved bits ignored).
    pub const fn decode(word: u64) -> Self {
        Self {
            sequence: word as u32,
            active: word & ACTIVE != 0,
        }
    }

    /// The word a guest writes for this request.
    pub const fn encode(self) -> u64 {
        self.sequence as u64 | if self.active { ACTIVE } else { 0 }
    }
}

/// Where the VMM reads each vCPU's request word: its guest memory (with a
/// volatile or atomic read: the guest writes it concurrently).
pub trait RequestWords: Send + Sync {
    /// vCPU `vcpu`'s word now; `None` if it has none (not set up, or out of
    /// guest memory).
    fn read(&self, vcpu: usize) -> Option<u64>;
}

/// Words the VMM keeps itself (and tests).
impl RequestWords for [AtomicU64] {
    fn read(&self, vcpu: usize) -> Option<u64> {
        self.get(vcpu)
            .map(|w| w.load(std::sync::atomic::Ordering::Acquire))
    }
}

impl<R: RequestWords + ?Sized> RequestWords for Arc<R> {
    fn read(&self, vcpu: usize) -> Option<u64> {
        (**self).read(vcpu)
    }
}

impl<R: RequestWords + ?Sized> RequestWords for Box<R> {
    fn read(&self, vcpu: usize) -> Option<u64> {
        (**self).read(vcpu)
    }
}

/// How much boost one request may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RequestLimits {
    /// The boosts of one request end within this of its first (ChromeOS's
    /// 3 ms per kernel critical section).
    pub per_request: Duration,
    /// The booster's `max_boost`: a boost is granted only if it ends,
    /// revoked at the latest, within `per_request`.
    pub max_boost: Duration,
}

impl RequestLimits {
    /// Requests of at most `per_request`, through a booster whose boosts
    /// last at most `max_boost`.
    pub const fn new(per_request: Duration, max_boost: Duration) -> Self {
        Self {
            per_request,
            max_boost,
        }
    }
}

impl Default for RequestLimits {
    /// 3 ms per request, through the default booster's 1 ms boosts.
    fn default() -> Self {
        Self::new(Duration::from_millis(3), Duration::from_millis(1))
    }
}

/// What [`GuestBoosts::check`] did for a vCPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RequestOutcome {
    /// No request: nothing to do.
    Idle,
    /// A request, and the thread was waiting for a CPU: boosted.
    Boosted,
    /// A request, but the thread runs (or sleeps): nothing needed.
    NotPreempted,
    /// Already boosted for this request.
    StillBoosted,
    /// The request has had its `per_request`: no more boosts for it.
    Exhausted,
    /// The booster refused (its budget per period, an unregistered thread,
    /// no permission).
    Refused,
    /// The request ended while its boost stood: undone.
    Ended,
    /// No such vCPU, or it has no request word or no probed thread.
    Unknown,
}

/// One vCPU's request as the host last saw it.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    sequence: u32,
    /// When the current request's first boost began (ns on the clock).
    first_boost: Option<u64>,
    /// Whether this module holds a boost of the vCPU now.
    boosted: bool,
}

/// Grants the boosts guests ask for, within bounds; see the [module docs](self).
pub struct GuestBoosts<R: RequestWords> {
    words: R,
    limits: RequestLimits,
    seen: Box<[Mutex<Seen>]>,
    clock: Box<dyn Clock>,
}

impl<R: RequestWords> GuestBoosts<R> {
    /// Requests of `vcpus` vCPUs, read from `words`, on `CLOCK_MONOTONIC`.
    pub fn new(vcpus: usize, words: R, limits: RequestLimits) -> Self {
        Self::with_clock(vcpus, words, limits, MonotonicClock)
    }

    /// The same on another clock (a [`crate::FakeClock`] in tests: the
    /// booster's own).
    pub fn with_clock(
        vcpus: usize,
        words: R,
        limits: RequestLimits,
        clock: impl Clock + 'static,
    ) -> Self {
        Self {
            words,
            limits,
            seen: (0..vcpus).map(|_| Mutex::default()).collect(),
            clock: Box::new(clock),
        }
    }

    /// The request words.
    pub fn words(&self) -> &R {
        &self.words
    }

    /// Looks at vCPU `vcpu`'s request and its thread (through the
    /// scheduler's probe, [`Scheduler::register_thread`]) and boosts or
    /// undoes through the scheduler's booster.
    pub fn check<P: BoostPolicy, B: Boost, G: GuestView>(
        &self,
        sched: &Scheduler<P, B, G>,
        vcpu: usize,
    ) -> RequestOutcome {
        match sched.thread_seen(vcpu) {
            Some(seen) => self.check_seen(&sched.ctx(), vcpu, seen),
            None => RequestOutcome::Unknown,
        }
    }

    /// [`check`](Self::check) with the thread's state as the caller saw it.
    pub fn check_seen(&self, ctx: &Ctx, vcpu: usize, thread: ThreadSeen) -> RequestOutcome {
        let (Some(slot), Some(word)) = (self.seen.get(vcpu), self.words.read(vcpu)) else {
            return RequestOutcome::Unknown;
        };
        let request = BoostRequest::decode(word);
        let mut seen = slot.lock().unwrap_or_else(|e| e.into_inner());
        if seen.boosted && !ctx.is_boosted(vcpu) {
            seen.boosted = false; // revoked, or ended by the vCPU running
        }
        let new_request = request.sequence != seen.sequence;
        if seen.boosted && (!request.active || new_request) {
            ctx.ran(vcpu);
            seen.boosted = false;
            if !request.active {
                return RequestOutcome::Ended;
            }
        }
        if new_request {
            *seen = Seen {
                sequence: request.sequence,
                ..Seen::default()
            };
        }
        if !request.active {
            return RequestOutcome::Idle;
        }
        if seen.boosted {
            return RequestOutcome::StillBoosted;
        }
        if thread != ThreadSeen::Preempted {
            return RequestOutcome::NotPreempted;
        }
        let now = self.clock.now_ns();
        let first = seen.first_boost.unwrap_or(now);
        let ends_by = first.saturating_add(self.limits.per_request.as_nanos() as u64);
        if now.saturating_add(self.limits.max_boost.as_nanos() as u64) > ends_by {
            return RequestOutcome::Exhausted;
        }
        if !ctx.boost(vcpu) {
            return RequestOutcome::Refused;
        }
        seen.first_boost = Some(first);
        seen.boosted = true;
        RequestOutcome::Boosted
    }

    /// [`check`](Self::check)s every vCPU; returns how many it boosted.
    pub fn check_all<P: BoostPolicy, B: Boost, G: GuestView>(
        &self,
        sched: &Scheduler<P, B, G>,
    ) -> usize {
        (0..self.seen.len())
            .filter(|&v| self.check(sched, v) == RequestOutcome::Boosted)
            .count()
    }
}

impl<R: RequestWords> std::fmt::Debug for GuestBoosts<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestBoosts")
            .field("vcpus", &self.seen.len())
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

/// A thread that checks every vCPU's request at an interval, until dropped.
/// A VMM on KVM's in-kernel irqchip sees no exit when a lock holder is
/// preempted, so something must look; a VMM that sees its vCPUs' pause-loop
/// or spin-wait exits can instead call [`GuestBoosts::check_all`] there.
#[derive(Debug)]
pub struct RequestWatcher {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl RequestWatcher {
    /// Checks `requests` against `sched` every `interval` on a thread of
    /// its own (named `vcpu-sched-requests`).
    ///
    /// # Errors
    /// The thread cannot be spawned.
    pub fn spawn<R, P, B, G>(
        requests: Arc<GuestBoosts<R>>,
        sched: Arc<Scheduler<P, B, G>>,
        interval: Duration,
    ) -> std::io::Result<Self>
    where
        R: RequestWords + 'static,
        P: BoostPolicy + 'static,
        B: Boost + Send + Sync + 'static,
        G: GuestView + Send + Sync + 'static,
    {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = thread::Builder::new()
            .name("vcpu-sched-requests".into())
            .spawn(move || {
                while !stopped.load(SeqCst) {
                    requests.check_all(&sched);
                    thread::sleep(interval);
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for RequestWatcher {
    fn drop(&mut self) {
        self.stop.store(true, SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{Booster, FakeClock, FifoOnDelivery, NoGuestView, SchedStats, ThreadControl, Tid};
    use std::io;

    #[derive(Debug, Default)]
    struct Fake;
    impl ThreadControl for Fake {
        fn boost(&self, _: Tid) -> io::Result<()> {
            Ok(())
        }
        fn restore(&self, _: Tid) -> io::Result<()> {
            Ok(())
        }
    }

    const MS: Duration = Duration::from_millis(1);
    const US: Duration = Duration::from_micros(1);

    struct Rig {
        clock: Arc<FakeClock>,
        stats: Arc<SchedStats>,
        sched: Scheduler<FifoOnDelivery, Booster<Fake, Arc<SchedStats>>>,
        requests: GuestBoosts<Box<[AtomicU64]>>,
    }

    impl Rig {
        fn new() -> Self {
            let clock = Arc::new(FakeClock::default());
            let stats = Arc::new(SchedStats::default());
            let booster = Booster::manual(2, Fake, stats.clone(), clock.clone());
            (0..2).for_each(|v| booster.register(v, 100 + v as Tid));
            let words: Box<[AtomicU64]> = (0..2).map(|_| AtomicU64::new(0)).collect();
            Self {
                requests: GuestBoosts::with_clock(
                    2,
                    words,
                    RequestLimits::default(),
                    clock.clone(),
                ),
                sched: Scheduler::new(2, FifoOnDelivery, booster, NoGuestView),
                clock,
                stats,
            }
        }
        fn write(&self, vcpu: usize, sequence: u32, active: bool) {
            self.requests.words()[vcpu].store(BoostRequest { sequence, active }.encode(), SeqCst);
        }
        fn check(&self, vcpu: usize, thread: ThreadSeen) -> RequestOutcome {
            self.requests.check_seen(&self.sched.ctx(), vcpu, thread)
        }
        fn advance(&self, by: Duration) {
            self.clock.advance(by);
            self.sched.booster().revoke_expired();
        }
    }

    #[test]
    fn words_decode_whatever_the_guest_wrote() {
        let r = BoostRequest::decode(0xffff_fffe_0000_0007);
        assert_eq!(
            r,
            BoostRequest {
                sequence: 7,
                active: false
            }
        );
        assert_eq!(
            BoostRequest::decode(u64::MAX),
            BoostRequest {
                sequence: u32::MAX,
                active: true
            }
        );
        let r = BoostRequest {
            sequence: 9,
            active: true,
        };
        assert_eq!(BoostRequest::decode(r.encode()), r);
    }

    #[test]
    fn a_preempted_vcpu_in_a_critical_section_is_boosted_until_it_leaves_it() {
        let rig = Rig::new();
        assert_eq!(rig.check(0, ThreadSeen::Preempted), RequestOutcome::Idle);
        rig.write(0, 1, true);
        assert_eq!(
            rig.check(0, ThreadSeen::Running),
            RequestOutcome::NotPreempted
        );
        assert_eq!(rig.check(0, ThreadSeen::Preempted), RequestOutcome::Boosted);
        assert!(rig.sched.booster().is_boosted(0));
        assert_eq!(
            rig.check(0, ThreadSeen::Running),
            RequestOutcome::StillBoosted
        );
        rig.write(0, 1, false);
        assert_eq!(rig.check(0, ThreadSeen::Running), RequestOutcome::Ended);
        assert!(!rig.sched.booster().is_boosted(0));
        assert_eq!(rig.check(9, ThreadSeen::Preempted), RequestOutcome::Unknown);
    }

    #[test]
    fn a_request_held_forever_gets_boosts_within_its_limit_only() {
        let rig = Rig::new();
        rig.write(1, 5, true);
        let mut boosted = Duration::ZERO;
        for _ in 0..1000 {
            if rig.check(1, ThreadSeen::Preempted) == RequestOutcome::Boosted {
                boosted += MS; // each lasts until revoked at max_boost
            }
            rig.advance(100 * US);
        }
        // Boosts start within the first per_request - max_boost = 2 ms, and
        // each is revoked at 1 ms: two boosts span at most the 3 ms.
        assert_eq!(boosted, 2 * MS);
        assert_eq!(
            rig.check(1, ThreadSeen::Preempted),
            RequestOutcome::Exhausted
        );
        let held = Duration::from_nanos(rig.stats.boost_ns.load(SeqCst));
        assert!(held <= 3 * MS, "{held:?}");
    }

    #[test]
    fn a_guest_flipping_the_mark_is_held_to_the_budget_per_period() {
        let rig = Rig::new();
        let mut boosts = 0;
        for sequence in 0..1000u32 {
            rig.write(0, sequence, sequence % 2 == 1);
            if rig.check(0, ThreadSeen::Preempted) == RequestOutcome::Boosted {
                boosts += 1;
            }
            rig.advance(50 * US);
        }
        // 50 ms: five 10 ms periods of at most 2 ms (plus the boost that
        // began just under it) of boost each.
        let held = Duration::from_nanos(rig.stats.boost_ns.load(SeqCst));
        assert!(
            held <= 5 * (2 * MS + 100 * US),
            "{held:?} in {boosts} boosts"
        );
        assert!(boosts > 0);
    }
}
