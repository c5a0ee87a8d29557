//! The host's real-time wake-up probe on this machine's CPUs.

#[path = "../../reference-vmm/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::time::Duration;

use reference_bench::wake_probe::WakeProbe;

#[test]
fn the_probe_reports_how_late_it_woke() {
    let test = "the_probe_reports_how_late_it_woke";
    let probe = match WakeProbe::start() {
        Ok(probe) => probe,
        Err(why) => {
            common::skip(test, &why);
            return;
        }
    };
    std::thread::sleep(Duration::from_millis(20));
    // Every wake-up comes at or after its deadline: after 20 periods the
    // latest is above 0 on a nanosecond clock.
    assert!(probe.take_latest() > Duration::ZERO);
    // Dropping joins every probe thread: one that did not stop would hang
    // the test here.
    drop(probe);
}
