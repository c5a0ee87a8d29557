//! The host's real-time wake-up probe on this machine's CPUs.

#[path = "../../reference-vmm/tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::time::{Duration, Instant};

use reference_bench::wake_probe::{HELD, WakeProbe};

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

#[test]
fn a_cpu_held_from_the_probe_is_counted() {
    let Some(probe) = started("a_cpu_held_from_the_probe_is_counted") else {
        return;
    };
    probe.take();
    // A thread at the probe's own priority, pinned to one CPU, spins for
    // 5 ms: the probe thread there cannot preempt it, so it wakes about
    // 4 ms late, as it would where the host held that CPU.
    std::thread::spawn(|| {
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = unsafe { libc::sched_getcpu() };
        // SAFETY: a zeroed cpu_set_t is a valid, empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `cpu` is this thread's CPU, below CPU_SETSIZE.
        unsafe { libc::CPU_SET(cpu as usize, &mut set) };
        // SAFETY: sets this thread's affinity and policy from valid values.
        unsafe {
            assert_eq!(
                libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set),
                0
            );
            let param = libc::sched_param { sched_priority: 99 };
            assert_eq!(libc::sched_setscheduler(0, libc::SCHED_FIFO, &param), 0);
        }
        let start = Instant::now();
        while start.elapsed() < Duration::from_millis(5) {
            std::hint::spin_loop();
        }
    })
    .join()
    .unwrap();
    let seen = probe.take();
    assert!(seen.held >= 1, "{seen:?}");
    assert!(seen.latest >= 3 * HELD, "{seen:?}");
}
