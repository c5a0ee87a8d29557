//! Loom models of the races between delivering to a vCPU, the vCPU's own
//! state changes, and boosting its thread: every interleaving (within a
//! preemption bound) must neither lose a wake-up nor leave a thread boosted.
//!
//! `RUSTFLAGS="--cfg loom" cargo test -p vcpu-sched --test loom --release`
#![cfg(loom)]

use std::io;

use loom::sync::Arc;
use loom::sync::atomic::{AtomicBool, Ordering::SeqCst};
use loom::thread;

use vcpu_sched::{
    Boost, BoostBudget, Booster, FakeClock, NoBoost, NoEvents, NoGuestView, RunState, SchedEvents,
    Scheduler, ThreadControl, Tid, VcpuState, boost_ready,
};

/// A thread control that remembers whether the thread is boosted.
#[derive(Default)]
struct Fake {
    boosted: AtomicBool,
}

impl ThreadControl for Fake {
    fn boost(&self, _: Tid) -> io::Result<()> {
        self.boosted.store(true, SeqCst);
        Ok(())
    }
    fn restore(&self, _: Tid) -> io::Result<()> {
        self.boosted.store(false, SeqCst);
        Ok(())
    }
}

/// Counts boosts and their ends: each boost must end exactly once.
#[derive(Default)]
struct Counts {
    boosted: std::sync::atomic::AtomicUsize,
    unboosted: std::sync::atomic::AtomicUsize,
}

impl SchedEvents for Counts {
    fn boosted(&self, _: usize) {
        self.boosted.fetch_add(1, SeqCst);
    }
    fn unboosted(&self, _: usize, _: std::time::Duration, _: bool) {
        self.unboosted.fetch_add(1, SeqCst);
    }
}

struct Vm {
    sched: Scheduler<NoBoost, Booster<Fake>>,
}

impl Vm {
    fn new() -> Arc<Self> {
        // No revoker thread (loom models the threads it spawns itself), and
        // time that stands still: the model must be deterministic.
        let booster = Booster::manual(2, Fake::default(), NoEvents, FakeClock::default());
        booster.register(1, 101);
        Arc::new(Self {
            sched: Scheduler::new(2, NoBoost, booster, NoGuestView),
        })
    }

    fn booster(&self) -> &Booster<Fake> {
        self.sched.booster()
    }
}

/// vCPU 0 boosts vCPU 1, which was delivered to, while vCPU 1 runs and
/// undoes any boost: whatever the order, vCPU 1 is not left boosted.
#[test]
fn a_boost_racing_with_the_target_running_is_never_left_behind() {
    loom::model(|| {
        let vm = Vm::new();
        vm.sched.state(1).delivered();
        let waiter = {
            let vm = vm.clone();
            thread::spawn(move || {
                boost_ready(&vm.sched.ctx(), 1);
            })
        };
        vm.sched.state(1).entering_guest();
        Boost::ran(vm.booster(), 1).unwrap();
        waiter.join().unwrap();
        assert!(
            !vm.booster().control().boosted.load(SeqCst),
            "thread left boosted"
        );
        assert!(!vm.booster().is_boosted(1), "boost record left behind");
    });
}

/// Two vCPUs boost the same target at once; when it runs, its one boost
/// record restores it.
#[test]
fn racing_boosts_leave_one_record_that_running_undoes() {
    loom::model(|| {
        let vm = Vm::new();
        let other = {
            let vm = vm.clone();
            thread::spawn(move || {
                let _ = vm.booster().boost(1);
            })
        };
        let _ = vm.booster().boost(1);
        other.join().unwrap();
        assert!(vm.booster().is_boosted(1));
        vm.booster().ran(1).unwrap();
        assert!(!vm.booster().control().boosted.load(SeqCst));
    });
}

/// The revoker looks at the records while vCPU 0 boosts vCPU 1 (the boost
/// already past its deadline): whatever the order, once the revoker has
/// looked again the thread is not boosted and no record is left, so no
/// thread is ever boosted where the revoker cannot see it; and the boost's
/// end is accounted once, whichever of them took the record.
#[test]
fn a_revocation_racing_with_a_boost_leaves_nothing_boosted() {
    loom::model(|| {
        let clock = std::sync::Arc::new(FakeClock::default());
        let booster = Arc::new(
            Booster::manual(2, Fake::default(), Counts::default(), clock.clone()).with_budget(
                BoostBudget::new(
                    std::time::Duration::ZERO,
                    BoostBudget::default().per_period,
                    BoostBudget::default().period,
                ),
            ),
        );
        booster.register(1, 101);
        clock.advance(std::time::Duration::from_micros(1));
        let revoker = {
            let (booster, clock) = (booster.clone(), clock.clone());
            thread::spawn(move || {
                clock.advance(std::time::Duration::from_micros(1));
                booster.revoke_expired();
            })
        };
        let _ = booster.boost(1);
        revoker.join().unwrap();
        clock.advance(std::time::Duration::from_micros(1));
        booster.revoke_expired(); // the revoker's next look
        assert!(!booster.is_boosted(1), "record left behind");
        assert!(
            !booster.control().boosted.load(SeqCst),
            "thread left boosted"
        );
        let counts = booster.events();
        assert_eq!(
            (counts.boosted.load(SeqCst), counts.unboosted.load(SeqCst)),
            (1, 1),
            "one boost, accounted once"
        );
    });
}

/// The vCPU publishes "halted" and then checks for work; the deliverer
/// publishes work and then checks for "halted". One of them must see the
/// other: the vCPU stays awake, or exactly the deliverer wakes it.
#[test]
fn delivery_racing_with_halt_never_loses_the_wake_up() {
    loom::model(|| {
        let state = Arc::new(VcpuState::new());
        let pending = Arc::new(AtomicBool::new(false));
        let deliverer = {
            let (state, pending) = (state.clone(), pending.clone());
            thread::spawn(move || {
                pending.store(true, SeqCst);
                state.delivered();
                state.transition(RunState::Halted, RunState::InVmm)
            })
        };
        state.set_run_state(RunState::Halted);
        let stayed_awake = pending.load(SeqCst);
        let woke = deliverer.join().unwrap();
        assert!(stayed_awake || woke, "the wake-up was lost");
        assert!(state.is_ready(), "delivery marks the vCPU ready");
    });
}

/// The order in which a vCPU thread publishes "in guest" and looks for
/// pending interrupts on its way into `KVM_RUN`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// Publish, then look: what a VMM must do (`reference-vmm`'s `irq` module).
    PublishThenLook,
    /// Look, then publish: the order that loses interrupts.
    LookThenPublish,
}

/// The entry handshake of a VMM that kicks vCPUs in the guest with a signal:
/// a poster sets an IRR bit, then kicks the vCPU if its run state says it is
/// in the guest. The kick is a signal blocked outside `KVM_RUN`, so it stays
/// pending (here: a flag) and makes the next `KVM_RUN` return at once. The
/// vCPU enters until a `KVM_RUN` does not return at once. When both are done,
/// the interrupt must have been injected, or a kick must be pending to bring
/// the vCPU out of the guest: anything else leaves a guest that spins without
/// exits with its interrupt pending for ever.
fn post_racing_with_entry(entry: Entry) {
    loom::model(move || {
        let state = Arc::new(VcpuState::new());
        let irr = Arc::new(AtomicBool::new(false));
        let kick = Arc::new(AtomicBool::new(false));
        let poster = {
            let (state, irr, kick) = (state.clone(), irr.clone(), kick.clone());
            thread::spawn(move || {
                irr.store(true, SeqCst);
                if state.run_state() == RunState::InGuest {
                    kick.store(true, SeqCst);
                }
            })
        };
        let mut injected = false;
        loop {
            if entry == Entry::PublishThenLook {
                state.entering_guest();
            }
            injected |= take(&irr);
            if entry == Entry::LookThenPublish {
                state.entering_guest();
            }
            // KVM_RUN: a pending kick makes it return at once (EINTR), and
            // consuming the signal clears it; otherwise the guest runs.
            if !take(&kick) {
                break;
            }
            state.left_guest();
        }
        poster.join().unwrap();
        let kicked_out_later = kick.load(SeqCst);
        assert!(
            injected || kicked_out_later,
            "interrupt lost: pending, and the vCPU in the guest with no kick"
        );
    });
}

/// Takes a flag: whether it was set. A compare-exchange, not a `swap`: loom
/// 0.7 lets a racing store slip inside a `swap` (tokio-rs/loom#254).
fn take(flag: &AtomicBool) -> bool {
    flag.compare_exchange(true, false, SeqCst, SeqCst).is_ok()
}

/// Publishing "in guest" before looking for work: every interleaving ends
/// with the interrupt injected or the vCPU kicked.
#[test]
fn a_post_racing_with_entry_is_injected_or_kicks() {
    post_racing_with_entry(Entry::PublishThenLook);
}

/// The model can fail: looking before publishing loses the interrupt when
/// the post lands in between (loom finds that interleaving).
#[test]
#[should_panic(expected = "interrupt lost")]
fn looking_for_work_before_publishing_loses_a_post() {
    post_racing_with_entry(Entry::LookThenPublish);
}
