//! The host's real-time wake-up probe on this machine's CPUs.

#[path = "../../reference-vmm/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::time::Duration;

use reference_bench::wake_probe::WakeProbe;

/// The probe, or a visible skip where this host gives it no real-time
/// priority.
fn started(test: &str) -> Option<WakeProbe> {
    WakeProbe::start()
        .map_err(|why| common::skip(test, &why))
        .ok()
}

#[test]
fn the_probe_reports_how_late_it_woke() {
    let Some(probe) = started("the_probe_reports_how_late_it_woke") else {
        return;
    };
    std::thread::sleep(Duration::from_millis(20));
    // Every wake-up comes at or after its deadline: after 20 periods the
    // latest is above 0 on a nanosecond clock.
    assert!(probe.take().latest > Duration::ZERO);
    // Dropping joins every probe thread: one that did not stop would hang
    // the test here.
    drop(probe);
}
