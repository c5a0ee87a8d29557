//! `--irqchip kernel`: the same guest programs on KVM's in-kernel LAPIC, the
//! baseline the family is measured against. Every IPI arrives with no
//! interrupt passing through the VMM, and KVM's halt polling follows
//! `--halt-poll` and is counted from KVM's binary statistics. (Its timer is
//! checked with the userspace one's, in `scenarios.rs`.)

mod common;
mod program;

use std::sync::{Mutex, MutexGuard, PoisonError};

use common::kvm_available;
use reference_vmm::mechanisms::{HaltPoll, Irqchip, Mechanisms};

/// One test at a time: KVM polls only while nothing else waits for the CPU
/// (`single_task_running`), so vCPUs of another test would stop its polling.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(PoisonError::into_inner)
}

fn kernel(halt_poll: HaltPoll) -> Mechanisms {
    Mechanisms {
        irqchip: Irqchip::Kernel,
        halt_poll,
        ..Mechanisms::default()
    }
}

#[test]
fn every_ipi_around_a_ring_arrives_without_leaving_the_kernel() {
    if !kvm_available("every_ipi_around_a_ring_arrives_without_leaving_the_kernel") {
        return;
    }
    let _turn = one_at_a_time();
    // KVM's LAPIC drops a fixed IPI to an APIC not yet enabled: the guests'
    // start-up barrier must hold every sender back until all are.
    const ROUNDS: u64 = 5000;
    let (report, _) = program::run("ipi-ring", 4, kernel(HaltPoll::Kvm), &[ROUNDS, 0]).unwrap();
    for vcpu in 0..4 {
        assert_eq!(report.value(vcpu, "irqs"), Some(ROUNDS), "vCPU {vcpu}");
    }
    assert_eq!(report.stats.interrupts, 0, "none went through the VMM");
    assert!(
        report.vcpus.iter().all(|v| v.exits < 100),
        "only the guest's reports exit: {:?}",
        report.vcpus.iter().map(|v| v.exits).collect::<Vec<_>>()
    );
}

#[test]
fn kvms_halt_polling_follows_the_halt_poll_switch() {
    if !kvm_available("kvms_halt_polling_follows_the_halt_poll_switch") {
        return;
    }
    let _turn = one_at_a_time();
    const ROUNDS: u64 = 500;
    let (off, _) = program::run("pingpong", 2, kernel(HaltPoll::Off), &[ROUNDS]).unwrap();
    assert_eq!(off.value(1, "irqs"), Some(ROUNDS));
    assert_eq!(off.stats.polled_ns, 0, "{:?}", off.stats);
    assert!(off.stats.blocked_ns > 0, "{:?}", off.stats);
    let (always, _) = program::run("pingpong", 2, kernel(HaltPoll::Always), &[ROUNDS]).unwrap();
    assert_eq!(always.value(1, "irqs"), Some(ROUNDS));
    assert!(
        always.stats.polled_ns > 0 && always.stats.successful_polls > 0,
        "{:?}",
        always.stats
    );
}
