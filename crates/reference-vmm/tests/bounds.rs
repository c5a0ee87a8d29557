//! The bounds the VMM keeps against a guest that pushes on them, each with a
//! guest that does just that, on real `/dev/kvm`: capped reports, a run that
//! ends whatever its output does, KVM's periodic-timer floor, masked timers
//! that cost nothing, and the xAPIC page's byte accesses.

mod common;
mod program;

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::kvm_available;
use lapic_timer::TscClock;
use reference_vmm::MAX_REPORTS;
use reference_vmm::presets::Choices;
use reference_vmm::{Error, GuestFault, Vm, VmConfig};

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

/// A pipe whose buffer is already full and that nobody reads: a write to it
/// blocks for ever. The read end must stay alive for that.
fn full_pipe() -> (File, Stdio) {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills `fds` with two new descriptors, which are owned
    // below; the result is checked.
    let made = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK) };
    assert_eq!(made, 0, "pipe2: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors are new and owned by nothing else.
    let (reader, mut writer) = unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) };
    // SAFETY: F_SETPIPE_SZ on a pipe this test owns; the result is checked.
    let size = unsafe { libc::fcntl(reader.as_raw_fd(), libc::F_SETPIPE_SZ, 4096) };
    assert!(
        size > 0,
        "F_SETPIPE_SZ: {}",
        std::io::Error::last_os_error()
    );
    while writer.write(&[b'.'; 512]).is_ok() {}
    // SAFETY: back to blocking, as a process's stdout is.
    unsafe { libc::fcntl(writer.as_raw_fd(), libc::F_SETFL, 0) };
    (reader, Stdio::from(writer))
}

fn serial_flood(timeout_ms: u64) -> (Child, File) {
    let (reader, stdout) = full_pipe();
    let child = Command::new(env!("CARGO_BIN_EXE_reference-vmm"))
        .args(["run", "--guest", "serial-flood", "--vcpus", "2"])
        .args(["--timeout-ms", &timeout_ms.to_string()])
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    (child, reader)
}

/// Waits up to `limit` for `child` to exit; kills it (and fails) if it does not.
fn exits_within(mut child: Child, limit: Duration) -> (std::process::ExitStatus, String) {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            child.kill().unwrap();
            panic!("still running {limit:?} after it should have stopped");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output().unwrap();
    eprintln!("exited {:?} after being due", start.elapsed());
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_timeout_ends_a_serial_flood_whose_stdout_nobody_reads() {
    if !kvm_available("the_timeout_ends_a_serial_flood_whose_stdout_nobody_reads") {
        return;
    }
    let timeout = Duration::from_millis(1500);
    let started = Instant::now();
    let (child, _reader) = serial_flood(timeout.as_millis() as u64);
    // Due when the timeout passes, counted from the spawn (which is earlier
    // than the VMM's own start, so this only shortens the second it gets).
    std::thread::sleep(timeout.saturating_sub(started.elapsed()));
    // A hang check: without the timeout the flood runs for ever. The limit
    // also covers the VMM's start and its coverage profile on a busy machine.
    let (status, stderr) = exits_within(child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("did not finish within 1.5s") && stderr.contains("vcpu 1:"),
        "the error and the partial report: {stderr}"
    );
    assert!(
        stderr.contains("byte(s) never written"),
        "the output that could not be written is counted: {stderr}"
    );
}

/// Waits (30 s at most) until process `pid`'s main thread blocks SIGTERM.
fn until_sigterm_blocked(pid: libc::pid_t) {
    let bit = 1u64 << (libc::SIGTERM - 1);
    let blocked = || {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & bit != 0)
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !blocked() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn sigterm_ends_a_serial_flood_whose_stdout_nobody_reads_with_its_partial_report() {
    if !kvm_available(
        "sigterm_ends_a_serial_flood_whose_stdout_nobody_reads_with_its_partial_report",
    ) {
        return;
    }
    let (child, _reader) = serial_flood(120_000);
    let pid = child.id() as libc::pid_t;
    // Before it blocks SIGTERM for its signal thread, the VMM would die of it.
    until_sigterm_blocked(pid);
    // Then the VM starts, and the pipe's writer is stuck at its first byte.
    std::thread::sleep(Duration::from_millis(200));
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let (status, stderr) = exits_within(child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    assert!(
        stderr.contains("terminated (SIGTERM)") && stderr.contains("vcpu 0:"),
        "the reason and the partial report: {stderr}"
    );
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
