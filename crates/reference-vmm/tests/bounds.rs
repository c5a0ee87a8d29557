//! The bounds the VMM keeps against a guest that pushes on them, each with a
//! guest that does just that, on real `/dev/kvm`: capped reports, KVM's
//! periodic-timer floor, masked timers that cost nothing, and the xAPIC
//! page's byte accesses. (A run that ends whatever its output does is the
//! command line's: `reference-vmm-cli`'s `tests/bounds.rs`.)

mod common;
mod program;

use std::time::Duration;

use common::kvm_available;
use lapic_timer::TscClock;
use reference_vmm::MAX_REPORTS;
use reference_vmm::{Error, GuestFault, Vm, VmConfig};
use reference_vmm_cli::presets::Choices;

#[test]
fn a_report_flood_ends_at_the_cap_with_a_clear_error() {
    if !kvm_available("a_report_flood_ends_at_the_cap_with_a_clear_error") {
        return;
    }
    let result = program::run("report-flood", 2, Choices::default(), &[]);
    match result {
        Err(Error::Guest {
            fault: GuestFault::TooManyReports { max },
            ..
        }) => assert_eq!(max, MAX_REPORTS),
        other => panic!("expected too many reports, got {other:?}"),
    }
}

fn periodic(
    initial_count: u64,
    interrupts: u64,
    masked: bool,
    floor: Duration,
) -> (u64, u64, reference_vmm::RunReport) {
    let mut config = VmConfig {
        timeout: Some(Duration::from_secs(60)),
        min_timer_period: floor,
        ..VmConfig::default()
    };
    config.params[..3].copy_from_slice(&[initial_count, interrupts, u64::from(masked)]);
    let report = Vm::new(&config)
        .unwrap()
        .run(
            test_guests::find("periodic-timer").unwrap(),
            Box::new(std::io::sink()),
        )
        .unwrap();
    let value = |name| report.value(0, name).unwrap();
    (value("irqs"), value("ticks"), report)
}

#[test]
fn a_30_us_periodic_timer_runs_at_the_floor_without_livelock() {
    if !kvm_available("a_30_us_periodic_timer_runs_at_the_floor_without_livelock") {
        return;
    }
    let tsc_per_us = TscClock::shared().tsc_khz() as f64 / 1000.0;
    for floor_us in [200, 500] {
        let floor = Duration::from_micros(floor_us);
        let (irqs, ticks, report) = periodic(30_000, 50, false, floor);
        assert!(irqs >= 50, "floor {floor_us} µs: {irqs} interrupts");
        // The 50th tick of a timer armed at 0 comes at 50 periods; 1 % for
        // the TSC frequency's calibration.
        let us = ticks as f64 / tsc_per_us;
        assert!(
            us >= 0.99 * 50.0 * floor_us as f64,
            "floor {floor_us} µs: 50 interrupts in {us:.0} µs"
        );
        // A livelocked vCPU exits in a tight loop; one at the floor a few
        // times per interrupt (the kick or injection, the EOI).
        let exits = report.vcpus[0].exits;
        assert!(
            exits < 20 * irqs + 200,
            "{exits} exits for {irqs} interrupts"
        );
    }
}

#[test]
fn a_masked_periodic_timer_delivers_nothing_and_never_kicks() {
    if !kvm_available("a_masked_periodic_timer_delivers_nothing_and_never_kicks") {
        return;
    }
    let (irqs, ticks, report) = periodic(20_000, 1000, true, Duration::ZERO);
    let tsc_per_us = TscClock::shared().tsc_khz() as f64 / 1000.0;
    assert_eq!(irqs, 0);
    assert_eq!(
        report.stats.kicks,
        0,
        "a masked 20 µs timer over {:.0} µs",
        ticks as f64 / tsc_per_us
    );
}

#[test]
fn byte_and_quadword_xapic_accesses_get_the_apics_answer() {
    if !kvm_available("byte_and_quadword_xapic_accesses_get_the_apics_answer") {
        return;
    }
    let (report, _) = program::run("xapic-bytes", 1, Choices::default(), &[]).unwrap();
    let value = |name| report.value(0, name);
    assert_eq!(value("id_byte"), Some(0), "vCPU 0's APIC ID");
    assert_eq!(value("version_word"), Some(0x14), "the version");
    assert_eq!(
        value("version_qword"),
        Some(0),
        "past the register: nothing"
    );
    assert_eq!(
        value("tpr_after_byte_store"),
        Some(0),
        "a byte store is dropped"
    );
    assert_eq!(value("tpr_after_dword_store"), Some(0x40));
}
