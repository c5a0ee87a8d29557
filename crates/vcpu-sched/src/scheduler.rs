//! One VM's vCPU scheduling in one place: the run states, the booster, the
//! boost policy, where the last directed yield went, and the guest view, with
//! one method per event a VMM's vCPUs have.

use std::io;
use std::sync::atomic::AtomicUsize;

use arc_swap::ArcSwapOption;

use crate::boost::Booster;
use crate::directed_yield::{GuestView, NoGuestView};
use crate::events::SchedEvents;
use crate::policy::{Boost, BoostPolicy, Ctx};
use crate::probe::{ThreadProbe, ThreadSeen};
use crate::state::{RunState, VcpuState};
use crate::thread::{FifoBoost, ThreadControl, Tid};

/// A VM's vCPU scheduling: a VMM creates one per VM, shares it with every
/// vCPU thread (it is `Sync`), and calls a method for each event:
///
/// | event | method | what the policy sees |
/// |---|---|---|
/// | a vCPU is about to enter the guest | [`entering_guest`](Self::entering_guest) | (its run state) |
/// | it left the guest (any exit) | [`left_guest`](Self::left_guest) | [`BoostPolicy::on_run`] |
/// | an interrupt was delivered to it | [`delivered`](Self::delivered) | [`BoostPolicy::on_delivery`] |
/// | it waits on other vCPUs (a pause-loop exit) | [`waiting`](Self::waiting) | [`BoostPolicy::on_wait`] |
/// | it polls with nothing to wait for | [`idle`](Self::idle) | [`BoostPolicy::on_idle`] |
/// | it halted, or was woken | [`halted`](Self::halted), [`woken`](Self::woken) | (its run state) |
/// | a device thread raises an interrupt KVM delivers (irqfd, `KVM_SIGNAL_MSI`) | [`deliver`](Self::deliver) (or [`delivering`](Self::delivering) after it) | [`BoostPolicy::on_delivery`], if the vCPU waits for a CPU |
/// | the VMM sees it run from outside (its next request to a device) | [`ran`](Self::ran) | [`BoostPolicy::on_run`] |
///
/// Indices at or past [`vcpus`](Self::vcpus) are ignored by the event
/// methods (a guest can name a vCPU that does not exist), and
/// [`state`](Self::state) panics on them as slice indexing does.
///
/// Generic over its [`BoostPolicy`] as `HaltPoller` is over its poll policy:
/// a VMM that picks the policy at run time names `Box<dyn BoostPolicy>`.
pub struct Scheduler<
    P: BoostPolicy = Box<dyn BoostPolicy>,
    B: Boost = Booster<FifoBoost>,
    G: GuestView = NoGuestView,
> {
    states: Box<[VcpuState]>,
    booster: B,
    policy: P,
    last_boosted: AtomicUsize,
    guest: G,
    /// Each vCPU thread's probe, for [`Self::delivering`].
    threads: Box<[ArcSwapOption<ThreadProbe>]>,
}

/// What [`Scheduler::delivering`] found the target vCPU's thread doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delivery {
    /// Waiting for a CPU: handed to the policy, which boosted it or not.
    Preempted {
        /// Whether the thread is boosted now.
        boosted: bool,
    },
    /// On a CPU (in the guest, or halt polling in KVM): left alone.
    Running,
    /// Asleep: halted in KVM with the interrupt not (yet) waking it, or
    /// stopped. Left alone, as KVM's `ready` rule leaves a blocked vCPU.
    Blocked,
    /// No thread registered with [`Scheduler::register_thread`], its
    /// thread gone, or no such vCPU.
    Unknown,
}

impl<P: BoostPolicy, B: Boost, G: GuestView> Scheduler<P, B, G> {
    /// Scheduling for `vcpus` vCPUs with `policy`, boosting through
    /// `booster`, and `guest` to tell which blocked vCPUs would run.
    pub fn new(vcpus: usize, policy: P, booster: B, guest: G) -> Self {
        Self {
            states: (0..vcpus).map(|_| VcpuState::new()).collect(),
            booster,
            policy,
            last_boosted: AtomicUsize::new(0),
            guest,
            threads: (0..vcpus).map(|_| ArcSwapOption::empty()).collect(),
        }
    }

    /// Says that thread `tid` runs vCPU `vcpu`: registers it with the
    /// booster and opens the probe [`delivering`](Self::delivering) reads
    /// (so a VMM with a seccomp filter calls this before installing it).
    /// A vCPU's thread may be registered again (a new thread replaces it);
    /// an unknown vCPU is ignored.
    ///
    /// # Errors
    /// The thread's `/proc/self/task/<tid>/stat` cannot be opened.
    pub fn register_thread(&self, vcpu: usize, tid: Tid) -> io::Result<()> {
        let Some(slot) = self.threads.get(vcpu) else {
            return Ok(());
        };
        slot.store(Some(ThreadProbe::new(tid)?.into()));
        self.booster.register(vcpu, tid);
        Ok(())
    }

    /// vCPU `vcpu`'s thread stopped running it for good (a hot-unplug):
    /// closes its probe and tells the booster, which ends its boost. Until
    /// [`register_thread`](Self::register_thread) gives it a thread again,
    /// the vCPU is [`Unknown`](Delivery::Unknown) and never boosted, even
    /// where a new thread reuses the old one's id.
    ///
    /// # Errors
    /// The booster's: the boosted thread could not be restored.
    pub fn unregister_thread(&self, vcpu: usize) -> io::Result<()> {
        if let Some(slot) = self.threads.get(vcpu) {
            slot.store(None);
        }
        self.booster.unregister(vcpu)
    }

    /// A device thread raised an interrupt that KVM's in-kernel irqchip
    /// delivers to `target` (through an irqfd or `KVM_SIGNAL_MSI`; which
    /// vCPU, [`crate::IrqTargets`] tells): call it right after the write or
    /// the ioctl, where [`deliver`](Self::deliver), which looks before it,
    /// cannot wrap them. KVM has woken a halted target by then, and the VMM never
    /// sees the vCPU leave `KVM_RUN`, so this looks at the thread itself, with
    /// KVM's `ready` rule: a thread waiting for a CPU (preempted, or just woken
    /// and not yet run) is marked ready and handed to the policy's
    /// [`on_delivery`](BoostPolicy::on_delivery), which may boost it within
    /// the booster's budget; one running, or still asleep, is left alone.
    ///
    /// KVM injects an MSI route's interrupt within the write, but a PIC or
    /// IOAPIC pin's from a work item, so a halted target may still be
    /// asleep when the write returns: then it is left to the host's wake-up.
    ///
    /// The boost ends when the vCPU next leaves the guest
    /// ([`left_guest`](Self::left_guest)), when the VMM sees it run
    /// ([`ran`](Self::ran): its next request to the device, say) or, since
    /// such a vCPU may stay in KVM for long, at the booster's `max_boost`: a
    /// short one (100 µs, the time to be scheduled in and take the
    /// interrupt) suits these boosts. A vCPU still boosted as it goes on to
    /// spin on a guest lock keeps the holder it preempted off the CPU.
    pub fn delivering(&self, target: usize) -> Delivery {
        self.act_on_delivery(target, self.thread_seen(target))
    }

    /// Raises an interrupt KVM's in-kernel irqchip delivers to `target` by
    /// calling `raise` (the irqfd write, or the `KVM_SIGNAL_MSI` ioctl), and
    /// applies KVM's `ready` rule to what `target`'s thread was doing just
    /// before: exactly KVM's rule, which [`delivering`](Self::delivering),
    /// looking after the write, can only approach. A target that was asleep
    /// (halted) is left to the host's wake-up even though the write has
    /// just made it runnable: boosting every vCPU its completion wakes
    /// preempts whatever runs, a guest's lock holder too. Returns what
    /// `raise` returned, and what the target was doing.
    pub fn deliver<T>(&self, target: usize, raise: impl FnOnce() -> T) -> (T, Delivery) {
        let seen = self.thread_seen(target);
        let raised = raise();
        (raised, self.act_on_delivery(target, seen))
    }

    /// KVM's `ready` rule for an interrupt delivered to `target`, whose
    /// thread was `seen` so.
    fn act_on_delivery(&self, target: usize, seen: Option<ThreadSeen>) -> Delivery {
        let (Some(state), Some(seen)) = (self.states.get(target), seen) else {
            return Delivery::Unknown;
        };
        match seen {
            ThreadSeen::Preempted => {
                state.set_preempted(true);
                self.policy.on_delivery(&self.ctx(), target);
                Delivery::Preempted {
                    boosted: self.booster.is_boosted(target),
                }
            }
            ThreadSeen::Running => Delivery::Running,
            ThreadSeen::Blocked => Delivery::Blocked,
        }
    }

    /// Where vCPU `vcpu`'s registered thread is now; `None` if none is
    /// registered, or it exited.
    pub fn thread_seen(&self, vcpu: usize) -> Option<ThreadSeen> {
        let probe = self.threads.get(vcpu)?.load_full()?;
        probe.seen().ok()
    }

    /// The number of vCPUs.
    pub fn vcpus(&self) -> usize {
        self.states.len()
    }

    /// vCPU `vcpu`'s run state and directed-yield flags, for the handshake
    /// of a VMM that delivers interrupts (post, then read the run state).
    ///
    /// # Panics
    /// If `vcpu` is not below [`vcpus`](Self::vcpus).
    pub fn state(&self, vcpu: usize) -> &VcpuState {
        &self.states[vcpu]
    }

    /// The booster, to register vCPU threads with and read.
    pub fn booster(&self) -> &B {
        &self.booster
    }

    /// The guest view.
    pub fn guest(&self) -> &G {
        &self.guest
    }

    /// What the policy gets: for calling [`crate::boost_ready`] or
    /// [`crate::pv_yield_to`] on this VM.
    pub fn ctx(&self) -> Ctx<'_> {
        Ctx::new(&self.states, &self.booster, &self.last_boosted, &self.guest)
    }

    /// vCPU `vcpu` is about to enter the guest: published before the VMM
    /// looks for work to inject (see [`VcpuState::entering_guest`]).
    pub fn entering_guest(&self, vcpu: usize) {
        if let Some(state) = self.states.get(vcpu) {
            state.entering_guest();
        }
    }

    /// vCPU `vcpu` left the guest: it is in the VMM, not ready any more, and
    /// the policy undoes what it did for it (a boost ends here).
    pub fn left_guest(&self, vcpu: usize) {
        if let Some(state) = self.states.get(vcpu) {
            state.left_guest();
            self.policy.on_run(&self.ctx(), vcpu);
        }
    }

    /// vCPU `vcpu` was seen running guest code from outside its thread (a
    /// device thread took its next request, say): it is not waiting for a
    /// CPU, and the policy undoes what it did for it (a delivery boost ends
    /// here, as at [`left_guest`](Self::left_guest), for a vCPU that on
    /// KVM's irqchip may not leave `KVM_RUN` for long).
    pub fn ran(&self, vcpu: usize) {
        if let Some(state) = self.states.get(vcpu) {
            state.set_preempted(false);
            self.policy.on_run(&self.ctx(), vcpu);
        }
    }

    /// An interrupt was just delivered to `target`.
    pub fn delivered(&self, target: usize) {
        if target < self.states.len() {
            self.policy.on_delivery(&self.ctx(), target);
        }
    }

    /// vCPU `vcpu` waits on others (a pause-loop exit).
    pub fn waiting(&self, vcpu: usize) {
        if vcpu < self.states.len() {
            self.policy.on_wait(&self.ctx(), vcpu);
        }
    }

    /// vCPU `vcpu` polls with nothing to wait for (in the guest or halt
    /// polling in the VMM); returns whether it should keep polling.
    pub fn idle(&self, vcpu: usize) -> bool {
        vcpu >= self.states.len() || self.policy.on_idle(&self.ctx(), vcpu)
    }

    /// vCPU `vcpu` halted: it blocks (or polls) until woken.
    pub fn halted(&self, vcpu: usize) {
        self.set(vcpu, RunState::Halted);
    }

    /// vCPU `vcpu` was woken from a halt, or stopped waiting: it is in the VMM.
    pub fn woken(&self, vcpu: usize) {
        self.set(vcpu, RunState::InVmm);
    }

    fn set(&self, vcpu: usize, state: RunState) {
        if let Some(s) = self.states.get(vcpu) {
            s.set_run_state(state);
        }
    }
}

impl<P: BoostPolicy, T: ThreadControl, E: SchedEvents, G: GuestView>
    Scheduler<P, Booster<T, E>, G>
{
    /// The booster's events: what it and the policy did.
    pub fn events(&self) -> &E {
        self.booster.events()
    }
}

impl<P: BoostPolicy, B: Boost + std::fmt::Debug, G: GuestView> std::fmt::Debug
    for Scheduler<P, B, G>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("states", &self.states)
            .field("booster", &self.booster)
            .field("last_boosted", &self.last_boosted)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::{FakeClock, FifoOnDelivery, KvmReady, SchedStats, Tid};
    use std::io;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};

    /// A thread control that only records whether it boosted.
    #[derive(Debug, Default)]
    struct Fake(AtomicBool);

    impl ThreadControl for Fake {
        fn boost(&self, _: Tid) -> io::Result<()> {
            self.0.store(true, SeqCst);
            Ok(())
        }
        fn restore(&self, _: Tid) -> io::Result<()> {
            self.0.store(false, SeqCst);
            Ok(())
        }
    }

    fn booster(stats: Arc<SchedStats>) -> Booster<Fake, Arc<SchedStats>> {
        let b = Booster::manual(3, Fake::default(), stats, FakeClock::default());
        (0..3).for_each(|v| b.register(v, 100 + v as Tid));
        b
    }

    #[test]
    fn each_event_reaches_the_policy_and_the_run_state() {
        let stats = Arc::new(SchedStats::default());
        let sched = Scheduler::new(3, FifoOnDelivery, booster(stats.clone()), NoGuestView);
        sched.delivered(2);
        assert!(sched.state(2).is_ready() && sched.booster().is_boosted(2));
        assert_eq!(sched.events().boosts.load(SeqCst), 1, "events handed back");
        sched.entering_guest(2);
        assert_eq!(sched.state(2).run_state(), RunState::InGuest);
        sched.left_guest(2);
        assert_eq!(sched.state(2).run_state(), RunState::InVmm);
        assert!(!sched.booster().is_boosted(2), "a boost ends when it runs");
        assert!(!sched.booster().control().0.load(SeqCst));
        sched.halted(1);
        assert_eq!(sched.state(1).run_state(), RunState::Halted);
        sched.woken(1);
        assert_eq!(sched.state(1).run_state(), RunState::InVmm);
    }

    #[test]
    fn an_unregistered_vcpu_is_unboosted_unknown_and_not_boosted_again() {
        let stats = Arc::new(SchedStats::default());
        let sched = Scheduler::new(3, FifoOnDelivery, booster(stats.clone()), NoGuestView);
        sched
            .register_thread(0, crate::thread::current_tid())
            .unwrap();
        assert_eq!(sched.delivering(0), Delivery::Running);
        sched.delivered(0);
        assert!(sched.booster().is_boosted(0));
        sched.unregister_thread(0).unwrap();
        assert!(!sched.booster().is_boosted(0), "its boost ended");
        assert!(!sched.booster().control().0.load(SeqCst), "restored");
        assert_eq!(sched.delivering(0), Delivery::Unknown, "its probe closed");
        sched.delivered(0);
        assert!(!sched.booster().is_boosted(0), "no thread to boost");
        assert_eq!(stats.boosts.load(SeqCst), 1);
    }

    #[test]
    fn a_waiter_yields_to_a_vcpu_with_an_interrupt_pending() {
        struct Pending(usize);
        impl GuestView for Pending {
            fn runnable(&self, vcpu: usize) -> bool {
                vcpu == self.0
            }
            fn in_kernel(&self, _: usize) -> bool {
                true
            }
        }
        let stats = Arc::new(SchedStats::default());
        let sched = Scheduler::new(3, KvmReady, booster(stats.clone()), Pending(2));
        sched.halted(1);
        sched.halted(2);
        sched.delivered(1);
        sched.delivered(2);
        sched.waiting(0);
        assert_eq!(
            stats.directed_yield_successful.load(SeqCst),
            1,
            "vCPU 1 is halted with nothing pending; vCPU 2 runnable"
        );
    }

    #[test]
    fn events_can_be_borrowed_and_are_handed_back() {
        let stats = SchedStats::default();
        let booster = Booster::manual(1, Fake::default(), &stats, FakeClock::default());
        booster.register(0, 100);
        let sched = Scheduler::new(1, FifoOnDelivery, booster, NoGuestView);
        sched.delivered(0);
        assert_eq!(sched.events().boosts.load(SeqCst), 1);
        drop(sched);
        assert_eq!(stats.boosts.load(SeqCst), 1, "the caller's own counters");
    }

    #[test]
    fn vcpus_that_do_not_exist_are_ignored() {
        let sched = Scheduler::new(2, FifoOnDelivery, booster(Arc::default()), NoGuestView);
        for v in [2, 7, usize::MAX] {
            sched.delivered(v);
            sched.waiting(v);
            sched.entering_guest(v);
            sched.left_guest(v);
            sched.halted(v);
            sched.woken(v);
            assert!(sched.idle(v));
        }
        assert_eq!(sched.vcpus(), 2);
        let quiet = Scheduler::new(1, KvmReady, booster(Arc::default()), NoGuestView);
        assert!(format!("{quiet:?}").starts_with("Scheduler"));
    }

    #[test]
    fn delivering_boosts_only_a_target_that_waits_for_a_cpu() {
        use crate::thread::{available_cpus, current_tid, pin};
        use std::sync::mpsc;
        let stats = Arc::new(SchedStats::default());
        let sched = Scheduler::new(3, FifoOnDelivery, booster(stats.clone()), NoGuestView);
        assert_eq!(
            sched.delivering(0),
            Delivery::Unknown,
            "no thread registered"
        );
        assert_eq!(sched.delivering(9), Delivery::Unknown, "no such vCPU");
        sched.register_thread(9, current_tid()).unwrap(); // ignored
        // vCPU 0 is this thread: it runs.
        sched.register_thread(0, current_tid()).unwrap();
        assert_eq!(sched.delivering(0), Delivery::Running);
        // vCPU 1 sleeps (a vCPU halted in KVM).
        let (wake, asleep) = mpsc::channel::<()>();
        let (tid_tx, tid_rx) = mpsc::channel();
        let sleeper = std::thread::spawn(move || {
            tid_tx.send(current_tid()).unwrap();
            asleep.recv().unwrap();
        });
        sched.register_thread(1, tid_rx.recv().unwrap()).unwrap();
        let blocked = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            sched.delivering(1) == Delivery::Blocked
        });
        assert!(
            blocked && !sched.booster().is_boosted(1),
            "a halted vCPU is left alone"
        );
        wake.send(()).unwrap();
        sleeper.join().unwrap();
        // Once the kernel has torn the joined thread down (a moment later).
        let gone = (0..1000).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            sched.delivering(1) == Delivery::Unknown
        });
        assert!(gone, "its thread exited");
        // vCPU 2 spins on a CPU it shares with two other spinners.
        let cpu = available_cpus().unwrap()[0];
        let stop = Arc::new(AtomicBool::new(false));
        let (tid_tx, tid_rx) = mpsc::channel();
        let spinners: Vec<_> = (0..3)
            .map(|_| {
                let (stop, tid_tx) = (stop.clone(), tid_tx.clone());
                std::thread::spawn(move || {
                    pin(0, &[cpu]).unwrap();
                    tid_tx.send(current_tid()).unwrap();
                    while !stop.load(SeqCst) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        sched.register_thread(2, tid_rx.recv().unwrap()).unwrap();
        let mut seen = Vec::new();
        while seen.len() < 2000 && !matches!(seen.last(), Some(Delivery::Preempted { .. })) {
            seen.push(sched.delivering(2));
        }
        stop.store(true, SeqCst);
        spinners.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(
            seen.last(),
            Some(&Delivery::Preempted { boosted: true }),
            "a spinner waiting for its CPU is boosted, after {} looks",
            seen.len()
        );
        assert!(sched.state(2).is_ready() && sched.state(2).is_preempted());
        assert_eq!(stats.boosts.load(SeqCst), 1, "only vCPU 2 was boosted");
        // The VMM sees it run: its boost, if the revoker left it, ends.
        sched.ran(2);
        assert!(!sched.state(2).is_preempted() && !sched.booster().is_boosted(2));
    }

    #[test]
    fn deliver_judges_the_target_as_it_was_before_the_interrupt() {
        use crate::thread::current_tid;
        use std::sync::mpsc;
        let stats = Arc::new(SchedStats::default());
        let sched = Scheduler::new(1, FifoOnDelivery, booster(stats.clone()), NoGuestView);
        // vCPU 0 sleeps until the interrupt wakes it (a halted vCPU).
        let (wake, asleep) = mpsc::channel::<()>();
        let (tid_tx, tid_rx) = mpsc::channel();
        let sleeper = std::thread::spawn(move || {
            tid_tx.send(current_tid()).unwrap();
            asleep.recv().unwrap();
        });
        sched.register_thread(0, tid_rx.recv().unwrap()).unwrap();
        while sched.thread_seen(0) != Some(ThreadSeen::Blocked) {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let (sent, delivery) = sched.deliver(0, || wake.send(()));
        sent.unwrap();
        assert_eq!(delivery, Delivery::Blocked, "asleep when it was raised");
        assert_eq!(stats.boosts.load(SeqCst), 0, "the host's wake-up, no boost");
        sleeper.join().unwrap();
        // No thread any more: nothing to judge, the raise still happens.
        let gone = (0..1000).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(1));
            sched.deliver(0, || 7) == (7, Delivery::Unknown)
        });
        assert!(gone);
    }
}
