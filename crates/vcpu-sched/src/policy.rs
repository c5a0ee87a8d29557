//! Boost policies: what to do when an interrupt is delivered to a vCPU, when a
//! vCPU waits on others, and when a vCPU runs.

use std::io;
use std::sync::atomic::AtomicUsize;

use crate::directed_yield::{GuestView, YieldResult, on_spin};
use crate::host_load::{Crowding, LoadSource, RunnableThreads};
use crate::state::VcpuState;

/// What a policy sees and can do for one event: the vCPUs' states, the
/// booster, and directed yield over the guest view. A [`crate::Scheduler`]
/// hands it to its policy; its parts are the scheduler's.
pub struct Ctx<'a> {
    vcpus: &'a [VcpuState],
    booster: &'a dyn Boost,
    /// Where the last directed yield went (KVM's `last_boosted_vcpu`).
    last_boosted: &'a AtomicUsize,
    guest: &'a dyn GuestView,
}

impl<'a> Ctx<'a> {
    pub(crate) fn new(
        vcpus: &'a [VcpuState],
        booster: &'a dyn Boost,
        last_boosted: &'a AtomicUsize,
        guest: &'a dyn GuestView,
    ) -> Self {
        Self {
            vcpus,
            booster,
            last_boosted,
            guest,
        }
    }

    /// Every vCPU's state.
    pub fn vcpus(&self) -> &'a [VcpuState] {
        self.vcpus
    }

    /// What the VMM knows of the guest (pending interrupts, guest mode).
    pub fn guest(&self) -> &'a dyn GuestView {
        self.guest
    }

    /// Marks `target` ready (an interrupt was delivered to it); false if
    /// there is no such vCPU.
    pub fn mark_ready(&self, target: usize) -> bool {
        self.vcpus.get(target).map(VcpuState::delivered).is_some()
    }

    /// Boosts `vcpu`'s thread; false if it was not (see [`Boost::boost`]).
    /// A failed boost (no `CAP_SYS_NICE`, say) counts as refused: the policy
    /// goes on without it, and the booster's events see the error
    /// ([`crate::SchedEvents::boost_failed`], `SchedStats::boost_errors`).
    /// Check at start-up with [`crate::FifoBoost::check`] to fail early instead.
    pub fn boost(&self, vcpu: usize) -> bool {
        self.booster.boost(vcpu).unwrap_or(false)
    }

    /// Whether `vcpu`'s thread is boosted now.
    pub fn is_boosted(&self, vcpu: usize) -> bool {
        self.booster.is_boosted(vcpu)
    }

    /// `vcpu` ran: undo its boost. A failed restore is the booster's events'
    /// to report ([`crate::SchedEvents::restore_failed`]).
    pub fn ran(&self, vcpu: usize) {
        let _ = self.booster.ran(vcpu);
    }

    /// Gives up the calling thread's CPU.
    pub fn yield_now(&self) {
        self.booster.yield_now()
    }

    /// Reports a directed-yield attempt to the booster's events.
    pub fn report_directed_yield(&self, successful: bool) {
        self.booster.directed_yield(successful)
    }

    /// KVM's `kvm_vcpu_on_spin` for spinning vCPU `me` ([`on_spin`]), over
    /// this VM's states, guest view and last-boosted index: offers candidates
    /// to `yield_to` in KVM's order; returns the one it yielded to.
    pub fn on_spin(&self, me: usize, yield_to: impl FnMut(usize) -> YieldResult) -> Option<usize> {
        on_spin(
            me,
            self.vcpus,
            self.last_boosted,
            false,
            self.guest,
            yield_to,
        )
    }
}

impl std::fmt::Debug for Ctx<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ctx")
            .field("vcpus", &self.vcpus.len())
            .field("last_boosted", &self.last_boosted)
            .finish_non_exhaustive()
    }
}

/// The booster, as a [`Scheduler`](crate::Scheduler) drives it:
/// [`crate::Booster`], or one's own.
pub trait Boost {
    /// Boosts vCPU `vcpu`'s thread; `Ok(false)` if it was not (already
    /// boosted, out of budget, unregistered).
    ///
    /// # Errors
    /// The boost was refused (no `CAP_SYS_NICE`, say).
    fn boost(&self, vcpu: usize) -> io::Result<bool>;
    /// Whether vCPU `vcpu`'s thread is boosted now.
    fn is_boosted(&self, vcpu: usize) -> bool;
    /// vCPU `vcpu` ran: undo its boost.
    ///
    /// # Errors
    /// The thread could not be restored.
    fn ran(&self, vcpu: usize) -> io::Result<()>;
    /// Gives up the calling thread's CPU.
    fn yield_now(&self);
    /// Reports a directed-yield attempt.
    fn directed_yield(&self, successful: bool);
    /// Says which host thread runs vCPU `vcpu` (the default ignores it: a
    /// booster that needs no thread ids).
    fn register(&self, _vcpu: usize, _tid: crate::Tid) {}
    /// vCPU `vcpu` has no thread any more (hot-unplugged), once that thread
    /// stopped running it: the default ends its boost.
    ///
    /// # Errors
    /// The boosted thread could not be restored.
    fn unregister(&self, vcpu: usize) -> io::Result<()> {
        self.ran(vcpu)
    }
}

macro_rules! forward_boost {
    ($($ty:ty),*) => {$(
        impl<B: Boost + ?Sized> Boost for $ty {
            fn boost(&self, vcpu: usize) -> io::Result<bool> {
                (**self).boost(vcpu)
            }
            fn is_boosted(&self, vcpu: usize) -> bool {
                (**self).is_boosted(vcpu)
            }
            fn ran(&self, vcpu: usize) -> io::Result<()> {
                (**self).ran(vcpu)
            }
            fn yield_now(&self) {
                (**self).yield_now()
            }
            fn directed_yield(&self, successful: bool) {
                (**self).directed_yield(successful)
            }
            fn register(&self, vcpu: usize, tid: crate::Tid) {
                (**self).register(vcpu, tid)
            }
            fn unregister(&self, vcpu: usize) -> io::Result<()> {
                (**self).unregister(vcpu)
            }
        }
    )*};
}

// A booster shared with the code that registers threads, or borrowed.
forward_boost!(&B, std::sync::Arc<B>);

impl<T: crate::ThreadControl, E: crate::SchedEvents> Boost for crate::Booster<T, E> {
    fn boost(&self, vcpu: usize) -> io::Result<bool> {
        crate::Booster::boost(self, vcpu)
    }
    fn is_boosted(&self, vcpu: usize) -> bool {
        crate::Booster::is_boosted(self, vcpu)
    }
    fn ran(&self, vcpu: usize) -> io::Result<()> {
        crate::Booster::ran(self, vcpu)
    }
    fn yield_now(&self) {
        self.control().yield_now();
    }
    fn directed_yield(&self, successful: bool) {
        self.report_directed_yield(successful);
    }
    fn register(&self, vcpu: usize, tid: crate::Tid) {
        crate::Booster::register(self, vcpu, tid);
    }
    fn unregister(&self, vcpu: usize) -> io::Result<()> {
        crate::Booster::unregister(self, vcpu)
    }
}

/// Decides how a VMM helps vCPUs that other vCPUs wait for.
pub trait BoostPolicy: Send + Sync {
    /// An interrupt (an IPI, a wake-up) was just delivered to `target`.
    fn on_delivery(&self, ctx: &Ctx, target: usize);
    /// `me` is waiting on other vCPUs (spinning, as on an IPI's completion).
    fn on_wait(&self, ctx: &Ctx, me: usize);
    /// `me` spins with nothing to wait for (idle polling in the guest, or
    /// halt polling in the VMM). Returns whether it should keep spinning;
    /// false asks it to block now. A pause-loop exit cannot tell this from
    /// `on_wait`, so by default it is the same, and spinning goes on.
    fn on_idle(&self, ctx: &Ctx, me: usize) -> bool {
        self.on_wait(ctx, me);
        true
    }
    /// `vcpu` runs (entered the guest, or handled its interrupt).
    fn on_run(&self, ctx: &Ctx, vcpu: usize);
}

macro_rules! forward_policy {
    ($($ty:ty),*) => {$(
        impl<P: BoostPolicy + ?Sized> BoostPolicy for $ty {
            fn on_delivery(&self, ctx: &Ctx, target: usize) {
                (**self).on_delivery(ctx, target)
            }
            fn on_wait(&self, ctx: &Ctx, me: usize) {
                (**self).on_wait(ctx, me)
            }
            fn on_idle(&self, ctx: &Ctx, me: usize) -> bool {
                (**self).on_idle(ctx, me)
            }
            fn on_run(&self, ctx: &Ctx, vcpu: usize) {
                (**self).on_run(ctx, vcpu)
            }
        }
    )*};
}

// A policy chosen at run time (boxed), or shared between VMs.
forward_policy!(Box<P>, std::sync::Arc<P>);

/// Do nothing: the host scheduler alone decides.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoBoost;

impl BoostPolicy for NoBoost {
    fn on_delivery(&self, _: &Ctx, _: usize) {}
    fn on_wait(&self, _: &Ctx, _: usize) {}
    fn on_run(&self, _: &Ctx, _: usize) {}
}

/// The seed: mark the target ready on delivery, so a waiting vCPU's directed
/// yield picks it; no priority change. Userspace has no `yield_to(task)`, so
/// the yield is a plain `sched_yield` once a candidate is found.
#[derive(Clone, Copy, Debug, Default)]
pub struct KvmReady;

impl BoostPolicy for KvmReady {
    fn on_delivery(&self, ctx: &Ctx, target: usize) {
        ctx.mark_ready(target);
    }

    fn on_wait(&self, ctx: &Ctx, me: usize) {
        let got = ctx.on_spin(me, |_| {
            ctx.yield_now();
            YieldResult::Yielded
        });
        ctx.report_directed_yield(got.is_some());
    }

    fn on_run(&self, _: &Ctx, _: usize) {}
}

/// Boost every target as its interrupt is delivered (`SCHED_FIFO` through the
/// booster); the target undoes its boost when it runs.
#[derive(Clone, Copy, Debug, Default)]
pub struct FifoOnDelivery;

impl BoostPolicy for FifoOnDelivery {
    fn on_delivery(&self, ctx: &Ctx, target: usize) {
        if ctx.mark_ready(target) {
            ctx.boost(target);
        }
    }

    fn on_wait(&self, _: &Ctx, _: usize) {}

    fn on_run(&self, ctx: &Ctx, vcpu: usize) {
        ctx.ran(vcpu);
    }
}

/// This crate's own: a directed yield that picks *how* to give the CPU by who
/// else wants it.
///
/// Delivery marks the target ready (as KVM's delivery boost does). A vCPU that waits picks a
/// target as `kvm_vcpu_on_spin` does. Userspace has no `yield_to(task)`, so:
/// - when the only runnable threads on the host are this VM's own vCPUs, a
///   plain `sched_yield` can only go to one of them: it yields, which is cheap
///   and also lets idle-spinning vCPUs make room;
/// - when no vCPU is ready on an uncrowded host, it yields anyway: a sibling
///   in the guest may be kept off the CPU by this spinner, which KVM would see
///   as preempted and userspace cannot tell;
/// - when other threads compete (other tenants), a plain yield would hand them
///   the CPU, so it boosts the target instead (`SCHED_FIFO` through the
///   booster): a real-time wake-up preempts whatever runs on the target's CPU,
///   which is the waiter itself when they share one, the kernel's `yield_to`.
///   The boost is undone as soon as the target runs (`on_run`) and never
///   outlives the booster's budget. With no one to boost (or the boost
///   refused) it does not yield there: the CPU would go to another tenant,
///   and under EEVDF every `sched_yield` pushes the yielder's deadline back
///   by a slice, so a waiter yielding at every pause-loop exit starves.
///
/// "Other threads compete" is [`Crowding`]'s verdict: the host's runnable
/// threads (`/proc/loadavg`) against the VM's vCPUs that are not halted.
/// When a vCPU spins idle ([`BoostPolicy::on_idle`]) on a crowded host with
/// no vCPU to help, it is asked to stop spinning and block: polling there
/// takes from the other tenants, which is the halt-poll crate's contention
/// rule for the same reason.
#[derive(Debug)]
pub struct DirectedYield<L: LoadSource = RunnableThreads> {
    crowding: Crowding<L>,
}

impl DirectedYield {
    /// The policy, sampling `/proc/loadavg`.
    pub fn new() -> Self {
        Self::with_crowding(Crowding::new())
    }
}

impl Default for DirectedYield {
    fn default() -> Self {
        Self::new()
    }
}

impl<L: LoadSource> DirectedYield<L> {
    /// The policy, deciding whether the host is crowded with `crowding`.
    pub fn with_crowding(crowding: Crowding<L>) -> Self {
        Self { crowding }
    }
}

impl<L: LoadSource> DirectedYield<L> {
    /// Helps a ready vCPU run: a plain yield on an uncrowded host, a boost on
    /// a crowded one. Returns whether one was helped.
    fn give_way(&self, ctx: &Ctx, me: usize) -> bool {
        let crowded = self.crowding.crowded(ctx.vcpus());
        let got = ctx.on_spin(me, |idx| {
            if !crowded {
                ctx.yield_now();
                YieldResult::Yielded
            } else if ctx.is_boosted(idx) || boost_ready(ctx, idx) {
                YieldResult::Yielded
            } else {
                YieldResult::Failed
            }
        });
        ctx.report_directed_yield(got.is_some());
        if got.is_none() && !crowded {
            // No one to help directly: a sibling may still be kept off the
            // CPU by this spinner (KVM would see it preempted; userspace
            // cannot tell which), and spinning on only delays it. Not on a
            // crowded host: there the yield goes to other tenants, and
            // EEVDF moves a yielder's deadline a whole slice back each time,
            // so a waiter that yields every pause-loop exit starves (measured:
            // sender and targets down to 3-10 % of a CPU, 0.42x the rounds).
            ctx.yield_now();
        }
        got.is_some()
    }
}

impl<L: LoadSource> BoostPolicy for DirectedYield<L> {
    fn on_delivery(&self, ctx: &Ctx, target: usize) {
        ctx.mark_ready(target);
    }

    fn on_wait(&self, ctx: &Ctx, me: usize) {
        self.give_way(ctx, me);
    }

    /// An idle spinner on a crowded host stops spinning once no vCPU needs
    /// its help: polling there takes from the other tenants (the halt-poll
    /// crate's contention rule, for the same reason).
    fn on_idle(&self, ctx: &Ctx, me: usize) -> bool {
        self.give_way(ctx, me) || !self.crowding.crowded(ctx.vcpus())
    }

    fn on_run(&self, ctx: &Ctx, vcpu: usize) {
        ctx.ran(vcpu);
    }
}

/// Boosts `target` for as long as it is ready (delivered to, not yet run):
/// a target that ran between the check and the boost would otherwise keep a
/// boost it no longer needs until the budget takes it back. Returns whether
/// the boost stands.
pub fn boost_ready(ctx: &Ctx, target: usize) -> bool {
    let Some(state) = ctx.vcpus().get(target) else {
        return false;
    };
    if !ctx.boost(target) {
        return false;
    }
    if state.is_ready() {
        return true;
    }
    ctx.ran(target); // it ran meanwhile: undo what it may have missed
    false
}

/// A paravirtual "yield to vCPU `target`" from vCPU `me` (KVM's hypercall 11):
/// boost the target's thread and give it this CPU. The boost is undone when
/// the target runs (`Boost::ran`) or by the booster's limits. Returns whether
/// the target was boosted.
pub fn pv_yield_to(ctx: &Ctx, me: usize, target: usize) -> bool {
    if me == target || target >= ctx.vcpus().len() {
        return false;
    }
    let boosted = ctx.boost(target);
    ctx.yield_now();
    ctx.report_directed_yield(boosted);
    boosted
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Records what a policy asks for.
    #[derive(Default)]
    struct Recorder {
        calls: RefCell<Vec<String>>,
        grant: bool,
    }

    impl Recorder {
        fn granting() -> Self {
            Self {
                grant: true,
                ..Default::default()
            }
        }
    }

    fn states(n: usize) -> Vec<VcpuState> {
        (0..n).map(|_| VcpuState::new()).collect()
    }

    impl Boost for Recorder {
        fn boost(&self, vcpu: usize) -> io::Result<bool> {
            self.calls.borrow_mut().push(format!("boost {vcpu}"));
            Ok(self.grant)
        }
        fn is_boosted(&self, _: usize) -> bool {
            false
        }
        fn ran(&self, vcpu: usize) -> io::Result<()> {
            self.calls.borrow_mut().push(format!("ran {vcpu}"));
            Ok(())
        }
        fn yield_now(&self) {
            self.calls.borrow_mut().push("yield".into());
        }
        fn directed_yield(&self, ok: bool) {
            self.calls.borrow_mut().push(format!("dy {ok}"));
        }
    }

    fn run(policy: &dyn BoostPolicy, grant: bool) -> Vec<String> {
        let vcpus = states(3);
        let rec = Recorder {
            grant,
            ..Default::default()
        };
        let last = AtomicUsize::new(0);
        let ctx = ctx_for(&vcpus, &rec, &last);
        policy.on_delivery(&ctx, 2);
        assert!(
            vcpus[2].is_ready(),
            "every policy but NoBoost marks the target ready"
        );
        policy.on_wait(&ctx, 0);
        policy.on_run(&ctx, 2);
        rec.calls.take()
    }

    fn ctx_for<'a>(vcpus: &'a [VcpuState], rec: &'a dyn Boost, last: &'a AtomicUsize) -> Ctx<'a> {
        Ctx::new(vcpus, rec, last, &crate::NoGuestView)
    }

    /// A load source with a fixed count.
    struct Load(usize);

    impl LoadSource for Load {
        fn runnable(&self) -> std::io::Result<usize> {
            Ok(self.0)
        }
    }

    fn own(runnable: usize) -> DirectedYield<Load> {
        DirectedYield::with_crowding(Crowding::with_source(
            Some(Load(runnable)),
            std::time::Duration::ZERO,
        ))
    }

    #[test]
    fn each_preset_does_what_it_says() {
        assert_eq!(run(&KvmReady, true), ["yield", "dy true"]);
        assert_eq!(run(&FifoOnDelivery, true), ["boost 2", "ran 2"]);
    }

    #[test]
    fn own_policy_yields_on_a_quiet_host_and_boosts_on_a_crowded_one() {
        assert_eq!(run(&own(0), true), ["yield", "dy true", "ran 2"]);
        assert_eq!(run(&own(99), true), ["boost 2", "dy true", "ran 2"]);
        assert_eq!(
            run(&own(99), false),
            ["boost 2", "dy false", "ran 2"],
            "a refused boost is a failed directed yield, and no plain one: \
             on a crowded host that would go to another tenant"
        );
    }

    #[test]
    fn with_no_one_ready_a_waiter_yields_only_on_an_uncrowded_host() {
        let vcpus = states(3);
        let (rec, last) = (Recorder::granting(), AtomicUsize::new(0));
        let ctx = ctx_for(&vcpus, &rec, &last);
        own(0).on_wait(&ctx, 0);
        assert_eq!(rec.calls.take(), ["dy false", "yield"]);
        own(99).on_wait(&ctx, 0);
        assert_eq!(
            rec.calls.take(),
            ["dy false"],
            "crowded: the yield would go to another tenant"
        );
    }

    #[test]
    fn an_idle_spinner_stops_only_on_a_crowded_host_with_no_one_to_help() {
        let vcpus = states(3);
        let (rec, last) = (Recorder::granting(), AtomicUsize::new(0));
        let ctx = ctx_for(&vcpus, &rec, &last);
        assert!(own(0).on_idle(&ctx, 0), "quiet host: keep polling");
        assert!(!own(99).on_idle(&ctx, 0), "crowded, nothing ready: block");
        vcpus[1].delivered();
        assert!(own(99).on_idle(&ctx, 0), "crowded, but it boosted vCPU 1");
        assert!(KvmReady.on_idle(&ctx, 0), "the presets always keep polling");
    }

    /// A booster during whose boost the target runs.
    struct TargetRunsDuringBoost<'a> {
        rec: Recorder,
        target: &'a VcpuState,
    }

    impl Boost for TargetRunsDuringBoost<'_> {
        fn boost(&self, vcpu: usize) -> io::Result<bool> {
            self.target.entering_guest();
            self.rec.boost(vcpu)
        }
        fn is_boosted(&self, _: usize) -> bool {
            false
        }
        fn ran(&self, vcpu: usize) -> io::Result<()> {
            self.rec.ran(vcpu)
        }
        fn yield_now(&self) {}
        fn directed_yield(&self, _: bool) {}
    }

    #[test]
    fn a_boost_that_comes_after_the_target_ran_is_undone() {
        let vcpus = states(2);
        vcpus[1].delivered();
        let booster = TargetRunsDuringBoost {
            rec: Recorder {
                grant: true,
                ..Default::default()
            },
            target: &vcpus[1],
        };
        let last = AtomicUsize::new(0);
        let ctx = ctx_for(&vcpus, &booster, &last);
        assert!(!boost_ready(&ctx, 1));
        assert_eq!(booster.rec.calls.take(), ["boost 1", "ran 1"]);
        assert!(!boost_ready(&ctx, 7), "no such vCPU");
    }

    #[test]
    fn pv_yield_to_boosts_the_target_and_yields() {
        let vcpus = states(3);
        let (rec, last) = (Recorder::granting(), AtomicUsize::new(0));
        let ctx = ctx_for(&vcpus, &rec, &last);
        assert!(pv_yield_to(&ctx, 0, 2));
        assert_eq!(rec.calls.take(), ["boost 2", "yield", "dy true"]);
        assert!(!pv_yield_to(&ctx, 1, 1), "not to itself");
        assert!(
            !pv_yield_to(&ctx, 0, 9),
            "not to a vCPU that does not exist"
        );
    }

    #[test]
    fn no_boost_does_nothing() {
        let vcpus = states(2);
        let rec = Recorder::default();
        let last = AtomicUsize::new(0);
        let ctx = ctx_for(&vcpus, &rec, &last);
        NoBoost.on_delivery(&ctx, 1);
        NoBoost.on_wait(&ctx, 0);
        NoBoost.on_run(&ctx, 1);
        assert!(rec.calls.borrow().is_empty());
        assert!(!vcpus[1].is_ready());
    }
}
