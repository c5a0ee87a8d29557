//! Interrupts posted while their target vCPU is on its way into the guest,
//! on a host whose CPUs other tenants keep busy: guests that spin without a
//! single exit must still get every timer interrupt and every IPI, so a post
//! that misses the vCPU's entry (no kick sent, interrupt left pending) hangs
//! the guest and the run's timeout fails the test. The timeout only detects
//! hangs: each run's work is bounded and takes seconds even beside the hogs.
//!
//! This is the handshake of `reference_vmm::irq` checked on real KVM; with
//! the look for work moved before the run state is published (the order that
//! loses posts) the timer guest hangs in most runs, idle or busy.

mod common;
mod program;

use common::kvm_available;
use reference_vmm::TimerPlacement;
use reference_vmm_cli::presets::Choices;
use test_support::Hogs;

/// Two CPU hogs: as many as this project's machines have cores.
const HOGS: usize = 2;

#[test]
fn spinning_guests_get_every_timer_and_ipi_beside_cpu_hogs() {
    if !kvm_available("spinning_guests_get_every_timer_and_ipi_beside_cpu_hogs") {
        return;
    }
    let _hogs = Hogs::start(HOGS);
    // Each deadline is armed by an MSR exit and fires about when the vCPU is
    // back on its way in; the distances cover a range of exit costs. The
    // vCPU thread's own signal timer, and a timer thread that kicks it.
    const DEADLINES: u64 = 500;
    for timer_placement in [TimerPlacement::VcpuThread, TimerPlacement::VcpuCpu] {
        let m = Choices::default().with_timer_placement(timer_placement);
        for distance in (100_000..=400_000).step_by(50_000) {
            let what = format!("timer-spin, {timer_placement}, {distance} ticks");
            let report = program::run("timer-spin", 2, m, &[DEADLINES, distance])
                .unwrap_or_else(|e| panic!("{what}: {e}"))
                .0;
            program::assert_each(&report, 2, "irqs", DEADLINES, &what);
        }
    }
    // Each vCPU IPIs the next and spins, with no pause exits, until it was
    // taken: only a kick gets an IPI to a vCPU in that loop.
    const ROUNDS: u64 = 1000;
    let report = program::run("ipi-ring", 3, Choices::default(), &[ROUNDS, 0])
        .unwrap_or_else(|e| panic!("ipi-ring: {e}"))
        .0;
    program::assert_each(&report, 3, "irqs", ROUNDS, "ipi-ring");
}
