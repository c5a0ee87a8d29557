//! `--irqchip kernel`: the same guest programs on KVM's in-kernel LAPIC, the
//! baseline the family is measured against. Every IPI arrives with no
//! interrupt passing through the VMM, and KVM's halt polling stops with
//! `--halt-poll off` and is counted from KVM's binary statistics. (Its timer is
//! checked with the userspace one's, in `scenarios.rs`.)

mod common;
mod program;

use std::sync::{Mutex, MutexGuard, PoisonError};

use common::kvm_available;
use reference_vmm::Irqchip;
use reference_vmm_cli::presets::{Boost, Choices, HaltPoll};

/// One test at a time: KVM polls only while nothing else waits for the CPU
/// (`single_task_running`), so vCPUs of another test would stop its polling.
fn one_at_a_time() -> MutexGuard<'static, ()> {
    static TURN: Mutex<()> = Mutex::new(());
    TURN.lock().unwrap_or_else(PoisonError::into_inner)
}

fn kernel(halt_poll: HaltPoll) -> Choices {
    Choices::on(Irqchip::Kernel).with_halt_poll(halt_poll)
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
    program::assert_each(&report, 4, "irqs", ROUNDS, "ipi-ring");
    assert_eq!(report.stats.interrupts, 0, "none went through the VMM");
    assert!(
        report.vcpus.iter().all(|v| v.exits < 100),
        "only the guest's reports exit: {:?}",
        report.vcpus.iter().map(|v| v.exits).collect::<Vec<_>>()
    );
}

#[test]
fn kvm_stops_halt_polling_at_a_zero_window_and_its_halts_are_counted() {
    if !kvm_available("kvm_stops_halt_polling_at_a_zero_window_and_its_halts_are_counted") {
        return;
    }
    let _turn = one_at_a_time();
    const ROUNDS: u64 = 500;
    // A window of 0 is this VMM's to set and KVM's to obey on any host:
    // no halt polls. The halts are there in the statistics, blocked.
    let (off, _) = program::run("pingpong", 2, kernel(HaltPoll::Off), &[ROUNDS]).unwrap();
    assert_eq!(off.value(1, "irqs"), Some(ROUNDS));
    assert_eq!(off.stats.polled_ns, 0, "{:?}", off.stats);
    assert_eq!(off.stats.successful_polls, 0, "{:?}", off.stats);
    assert!(off.stats.blocked_ns > 0, "{:?}", off.stats);
    // With a 10 ms window KVM polls only while nothing else is runnable on
    // the CPU (`single_task_running`): whether it did depends on the host, so
    // it is reported, not asserted. That the halts were counted is asserted.
    let (always, _) = program::run("pingpong", 2, kernel(HaltPoll::Always), &[ROUNDS]).unwrap();
    assert_eq!(always.value(1, "irqs"), Some(ROUNDS));
    let st = &always.stats;
    assert!(st.polled_ns + st.blocked_ns > 0, "{st:?}");
    eprintln!(
        "KVM with a 10 ms window: {} halts ended while polling, {:.1} ms polling, \
         {:.1} ms blocked (fewer polls on a busy host)",
        st.successful_polls,
        st.polled_ns as f64 / 1e6,
        st.blocked_ns as f64 / 1e6
    );
}

#[test]
fn the_tuned_window_switches_kvm_polling_off_for_an_idle_timer() {
    if !kvm_available("the_tuned_window_switches_kvm_polling_off_for_an_idle_timer") {
        return;
    }
    let _turn = one_at_a_time();
    // Halts of about 1 ms between timers: polling never pays, so the tuner
    // (every 10 ms) sets a window of 0 once it has seen enough of them.
    let period = lapic_timer::TscClock::shared().tsc_khz();
    let (report, _) =
        program::run("cyclictest", 1, kernel(HaltPoll::Tuned), &[300, period]).unwrap();
    assert_eq!(report.value(0, "samples"), Some(300));
    assert_eq!(report.stats.tuned_window_ns, Some(0), "{:?}", report.stats);
    // Untuned, the report says so.
    let (report, _) = program::run("cyclictest", 1, kernel(HaltPoll::Kvm), &[20, period]).unwrap();
    assert_eq!(report.stats.tuned_window_ns, None);
}

#[test]
fn a_budget_keeps_kvms_polling_within_it_for_an_idle_timer() {
    if !kvm_available("a_budget_keeps_kvms_polling_within_it_for_an_idle_timer") {
        return;
    }
    let _turn = one_at_a_time();
    // Halts of about 1 ms: KVM's own window polls up to 200 µs of each, 20 %
    // of the vCPU; a 5 % budget allows a 32 µs window at most.
    let period = lapic_timer::TscClock::shared().tsc_khz();
    let budget = "budget:0.05".parse().unwrap();
    let (report, _) = program::run("cyclictest", 1, kernel(budget), &[300, period]).unwrap();
    assert_eq!(report.value(0, "samples"), Some(300));
    let st = &report.stats;
    let window = st.tuned_window_ns.expect("a window was set");
    assert!(window == 0 || window >= 10_000, "{st:?}");
    assert!(st.tuned_window_changes >= 1, "{st:?}");
    // The first 10 ms run under KVM's own window, before the tuner's first
    // look: the tolerance covers them.
    let share = st.polled_ns as f64 / report.elapsed.as_nanos() as f64;
    assert!(share <= 0.05 * 1.5, "polled {share:.3} of the vCPU: {st:?}");
}

#[test]
fn a_tuned_window_on_this_vmms_apic_is_a_configuration_error() {
    let config = reference_vmm::VmConfig {
        kvm_halt_poll: reference_vmm::KvmHaltPoll::Tuned,
        ..reference_vmm::VmConfig::default()
    };
    assert!(matches!(
        reference_vmm::Vm::new(&config),
        Err(reference_vmm::Error::Config(
            reference_vmm::ConfigError::KvmHaltPollNeedsKernelIrqchip
        ))
    ));
}

#[test]
fn guest_requested_boosts_go_to_holders_that_ask_and_to_no_one_else() {
    if !kvm_available("guest_requested_boosts_go_to_holders_that_ask_and_to_no_one_else") {
        return;
    }
    let _turn = one_at_a_time();
    // Four vCPUs contending a guest spinlock on this machine's two CPUs,
    // with no exits: holders are preempted while they hold it.
    const ROUNDS: u64 = 2000;
    let run = |guest_boost: bool, ask: u64| {
        let mut m = kernel(HaltPoll::Kvm);
        if guest_boost {
            m = m.with_guest_boosts();
        }
        let (report, _) = program::run("lock-holders", 4, m, &[ROUNDS, 1000, 200, ask]).unwrap();
        assert!(
            (0..4).all(|v| report.value(v, "ticks").is_some()),
            "every vCPU finished its rounds: {report:?}"
        );
        report.stats
    };
    let granted = run(true, 1);
    assert!(
        granted.boosts > 0,
        "holders asked while preempted: {granted:?}"
    );
    eprintln!(
        "{} guest-requested boosts, the longest on the booster's record {} µs",
        granted.boosts,
        granted.longest_boost_ns / 1000
    );
    assert_eq!(run(true, 0).boosts, 0, "no vCPU asked");
    assert_eq!(run(false, 1).boosts, 0, "asked, but the VMM does not grant");
}

#[test]
fn every_io_is_completed_by_irqfd_to_its_submitter_and_its_target_told() {
    if !kvm_available("every_io_is_completed_by_irqfd_to_its_submitter_and_its_target_told") {
        return;
    }
    let _turn = one_at_a_time();
    const ROUNDS: u64 = 500;
    // The I/O after each round (halting for it), and during it (spinning).
    let io_modes = [[ROUNDS, 10, 10, 0, 1], [ROUNDS, 0, 10, 0, 2]];
    for (params, boost) in io_modes
        .iter()
        .flat_map(|p| [(p, Boost::None), (p, Boost::OnDelivery)])
    {
        let m = kernel(HaltPoll::Kvm).with_boost(boost);
        let (report, _) = program::run("lock-holders", 4, m, params).unwrap();
        // Each vCPU waits for its own completion: one interrupt per round.
        program::assert_each(&report, 4, "irqs", ROUNDS, "lock-holders");
        let st = &report.stats;
        assert_eq!(st.completions, 4 * ROUNDS, "{st:?}");
        assert_eq!(st.interrupts, 0, "none went through this VMM's APIC");
        assert!(st.completions_to_preempted <= st.completions);
        if boost == Boost::None {
            assert_eq!(st.boosts, 0, "{st:?}");
        }
        eprintln!(
            "I/O mode {}, --boost {boost}: {} of {} completions found their vCPU waiting for a CPU, {} boosts",
            params[4], st.completions_to_preempted, st.completions, st.boosts
        );
    }
}
