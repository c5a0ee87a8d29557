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
    Boost, Booster, Ctx, NoGuestView, RunState, ThreadControl, Tid, VcpuState, boost_ready,
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

struct Vm {
    vcpus: Vec<VcpuState>,
    booster: Booster<Fake>,
    last_boosted: std::sync::atomic::AtomicUsize,
}

impl Vm {
    fn new() -> Arc<Self> {
        let booster = Booster::new(2, Fake::default());
        booster.register(1, 101);
        Arc::new(Self {
            vcpus: (0..2).map(|_| VcpuState::new()).collect(),
            booster,
            last_boosted: Default::default(),
        })
    }

    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            vcpus: &self.vcpus,
            booster: &self.booster,
            last_boosted: &self.last_boosted,
            guest: &NoGuestView,
        }
    }
}

/// vCPU 0 boosts vCPU 1, which was delivered to, while vCPU 1 runs and
/// undoes any boost: whatever the order, vCPU 1 is not left boosted.
#[test]
fn a_boost_racing_with_the_target_running_is_never_left_behind() {
    loom::model(|| {
        let vm = Vm::new();
        vm.vcpus[1].delivered();
        let waiter = {
            let vm = vm.clone();
            thread::spawn(move || {
                boost_ready(&vm.ctx(), 1);
            })
        };
        vm.vcpus[1].entering_guest();
        Boost::ran(&vm.booster, 1);
        waiter.join().unwrap();
        assert!(
            !vm.booster.control().boosted.load(SeqCst),
            "thread left boosted"
        );
        assert!(!vm.booster.is_boosted(1), "boost record left behind");
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
                let _ = vm.booster.boost(1);
            })
        };
        let _ = vm.booster.boost(1);
        other.join().unwrap();
        assert!(vm.booster.is_boosted(1));
        vm.booster.ran(1).unwrap();
        assert!(!vm.booster.control().boosted.load(SeqCst));
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
