//! The command line's bounds against a guest that pushes on them, on real
//! `/dev/kvm`: a run ends at its timeout or at SIGTERM whatever its output
//! does; and it writes a guest as an image and boots it.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::kvm_available;

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

#[test]
fn the_command_line_writes_an_image_and_boots_it() {
    if !kvm_available("the_command_line_writes_an_image_and_boots_it") {
        return;
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-hello.elf");
    let vmm = env!("CARGO_BIN_EXE_reference-vmm");
    let out = Command::new(vmm)
        .args(["image", "--guest", "hello", "--vcpus", "2", "--out"])
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("-kernel") && stdout.contains("run --image"),
        "{stdout}"
    );
    let run = Command::new(vmm)
        .arg("run")
        .arg("--image")
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{run:?}");
    assert!(stdout.contains("hello from vcpu 1"), "{stdout}");
    assert!(stdout.contains("apic_id"), "{stdout}");

    std::fs::write(&path, b"not an image").unwrap();
    let bad = Command::new(vmm)
        .arg("run")
        .arg("--image")
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(1), "{bad:?}");
    assert!(stderr.contains("not a bootable ELF image"), "{stderr}");
    let both = Command::new(vmm)
        .args(["run", "--guest", "hello", "--image"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(both.status.code(), Some(2), "{both:?}");
}
