//! A custom boost policy on a Scheduler.
use vcpu_sched::{BoostPolicy, Booster, Ctx, FifoBoost, NoGuestView, Scheduler};

/// Marks the target ready and nothing else.
struct MarkOnly;

impl BoostPolicy for MarkOnly {
    fn on_delivery(&self, ctx: &Ctx, target: usize) {
        ctx.mark_ready(target);
    }
    fn on_wait(&self, _: &Ctx, _: usize) {}
    fn on_run(&self, _: &Ctx, _: usize) {}
}

fn main() {
    let sched = Scheduler::new(
        2,
        MarkOnly,
        Booster::new(2, FifoBoost::default()),
        NoGuestView,
    );
    sched.delivered(1);
    assert!(sched.state(1).is_ready());
    println!("vCPU 1 ready: {}", sched.state(1).is_ready());
}
