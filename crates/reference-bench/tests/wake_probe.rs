//! The host's real-time wake-up probe on this machine's CPUs.

#[path = "../../reference-vmm/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::time::{Duration, Instant};

use reference_bench::wake_probe::WakeProbe;

#[test]
fn the_probe_reports_how_late_it_woke_and_stops_when_dropped() {
    let test = "the_probe_reports_how_late_it_woke_and_stops_when_dropped";
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
    let stopping = Instant::now();
    drop(probe);
    assert!(
        stopping.elapsed() < Duration::from_secs(1),
        "the probe threads stopped"
    );
}
