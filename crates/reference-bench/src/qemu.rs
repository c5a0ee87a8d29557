//! QEMU, the peer VMM: boots an image file ([`test_guests::pvh`]) under QEMU on
//! the same KVM and collects what the guest reported, so that this VMM's
//! figures can stand beside QEMU's for the same guest code.
//!
//! QEMU runs with the arguments of [`qemu_args`]. The guest reports in ucall
//! text lines on COM1 and ends QEMU through the debug-exit port at
//! [`DEBUG_EXIT_PORT`](test_guests::abi::DEBUG_EXIT_PORT); a QEMU that has not ended by the timeout is killed by
//! its pid (on an emulation failure QEMU pauses instead of exiting).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use test_guests::Report;
use test_guests::pvh::qemu_args;
use test_guests::ucall::{self, TEXT_TAG, Ucall, UcallError};

/// The QEMU binary looked for on `PATH`.
pub const QEMU_BINARY: &str = "qemu-system-x86_64";

/// How to install QEMU where it is missing (Debian).
pub const INSTALL_HINT: &str = "apt-get install -y --no-install-recommends qemu-system-x86";

/// Where QEMU's local APICs live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QemuApic {
    /// QEMU's own, in userspace (`kernel-irqchip=off`): the same job as this
    /// VMM's `--irqchip user`.
    User,
    /// KVM's in-kernel LAPIC (`kernel-irqchip=on`), for reference.
    Kernel,
}

/// One QEMU run's result.
#[derive(Clone, Debug, PartialEq)]
pub struct QemuRun {
    /// What the guest wrote on COM1 apart from ucall lines.
    pub serial: String,
    /// Named values, by vCPU, in the order reported.
    pub reports: Vec<(u32, Report)>,
    /// Wall-clock time from spawning QEMU to its exit.
    pub elapsed: Duration,
    /// CPU time QEMU used, user and system, all its threads.
    pub cpu_time: Duration,
}

impl QemuRun {
    /// Every value vCPU `vcpu` reported under `name`, in order.
    pub fn values(&self, vcpu: u32, name: &str) -> Vec<u64> {
        self.reports
            .iter()
            .filter(|(v, r)| *v == vcpu && r.name == name)
            .map(|(_, r)| r.value)
            .collect()
    }

    /// The value vCPU `vcpu` reported under `name`, if any.
    pub fn value(&self, vcpu: u32, name: &str) -> Option<u64> {
        self.reports
            .iter()
            .find(|(v, r)| *v == vcpu && r.name == name)
            .map(|(_, r)| r.value)
    }
}

/// Why a QEMU run gave no result.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    /// QEMU could not be started.
    #[error("cannot start {binary}: {source} (install QEMU with `{INSTALL_HINT}`)")]
    Spawn {
        /// The binary tried.
        binary: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Waiting for QEMU failed.
    #[error("cannot wait for QEMU: {0}")]
    Wait(#[source] std::io::Error),
    /// QEMU did not end in time and was killed.
    #[error("QEMU did not finish within {timeout:?} and was killed; serial output: {serial:?}")]
    Timeout {
        /// The limit.
        timeout: Duration,
        /// What the guest wrote until then.
        serial: String,
    },
    /// QEMU ended without the guest's debug-exit after every vCPU was done
    /// (a QEMU error).
    #[error(
        "QEMU exited with status {status} before the guest finished ({done} of {vcpus} vCPUs done); its stderr: {stderr}"
    )]
    Exited {
        /// Its exit status (-1: killed by a signal).
        status: i32,
        /// The vCPUs that said they were done.
        done: usize,
        /// The vCPUs the guest had.
        vcpus: u32,
        /// Its standard error.
        stderr: String,
    },
    /// The guest failed: an assertion, an exception, or a malformed ucall line.
    #[error("the guest failed under QEMU: {0}")]
    Guest(String),
    /// A ucall line could not be decoded.
    #[error("the guest sent a malformed ucall line {line:?}: {source}")]
    BadUcall {
        /// The line.
        line: String,
        /// Why.
        source: UcallError,
    },
}

/// A QEMU binary to run images with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qemu {
    binary: PathBuf,
}

impl Qemu {
    /// `qemu-system-x86_64` from `PATH`, if it is there.
    pub fn find() -> Option<Self> {
        let path = std::env::var_os("PATH").unwrap_or_default();
        std::env::split_paths(&path)
            .map(|dir| dir.join(QEMU_BINARY))
            .find(|candidate| candidate.is_file())
            .map(Self::at)
    }

    /// The QEMU binary at `binary`.
    pub fn at(binary: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
        }
    }

    /// The command line that boots `image` (with `vcpus` vCPUs and `mem_mib`
    /// MiB) under QEMU with `apic`.
    pub fn command(&self, image: &Path, vcpus: u32, mem_mib: u64, apic: QemuApic) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.args(qemu_args(image, vcpus, mem_mib, apic == QemuApic::Kernel));
        cmd
    }

    /// Boots `image` and waits for the guest to finish, at most `timeout`.
    pub fn run(
        &self,
        image: &Path,
        vcpus: u32,
        mem_mib: u64,
        apic: QemuApic,
        timeout: Duration,
    ) -> Result<QemuRun, QemuError> {
        let start = Instant::now();
        let mut child = self
            .command(image, vcpus, mem_mib, apic)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| QemuError::Spawn {
                binary: self.binary.clone(),
                source,
            })?;
        let stdout = read_in_background(child.stdout.take());
        let stderr = read_in_background(child.stderr.take());
        let pid = child.id() as libc::pid_t;
        let waited = wait_with_usage(pid, timeout);
        let elapsed = start.elapsed();
        let serial = stdout.join().unwrap_or_default();
        let stderr = stderr.join().unwrap_or_default();
        let (status, cpu_time) = match waited.map_err(QemuError::Wait)? {
            Some(ended) => ended,
            None => return Err(QemuError::Timeout { timeout, serial }),
        };
        let (serial, reports, failure, done) = split_output(&serial)?;
        if let Some(failure) = failure {
            return Err(QemuError::Guest(failure));
        }
        // isa-debug-exit with 0: status 1, after every vCPU said it was
        // done. Anything else is QEMU's own end (or not QEMU at all).
        if status != 1 || done < vcpus as usize {
            return Err(QemuError::Exited {
                status,
                done,
                vcpus,
                stderr,
            });
        }
        Ok(QemuRun {
            serial,
            reports,
            elapsed,
            cpu_time,
        })
    }
}

/// Reads a child's pipe to its end on a thread of its own, so that neither
/// pipe can fill and stall QEMU.
fn read_in_background(pipe: Option<impl Read + Send + 'static>) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut text = Vec::new();
        if let Some(mut pipe) = pipe {
            pipe.read_to_end(&mut text).unwrap_or(0);
        }
        String::from_utf8_lossy(&text).into_owned()
    })
}

/// How often the child is looked at while it runs.
const WAIT_POLL: Duration = Duration::from_millis(5);

/// Waits for child `pid` for at most `timeout`, reaping it with `wait4` to
/// learn its CPU time; kills and reaps it at the timeout (`Ok(None)`).
/// Returns its exit status (-1 if a signal ended it) and CPU time.
fn wait_with_usage(
    pid: libc::pid_t,
    timeout: Duration,
) -> std::io::Result<Option<(i32, Duration)>> {
    let deadline = Instant::now() + timeout;
    loop {
        let expired = Instant::now() >= deadline;
        if expired {
            // SAFETY: kill(2) on our own unreaped child's pid: it cannot
            // have been reused, since only this function reaps it.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value for wait4 to fill.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        let flags = if expired { 0 } else { libc::WNOHANG };
        // SAFETY: wait4 writes only to the two valid out-pointers given.
        let reaped = unsafe { libc::wait4(pid, &mut status, flags, &mut usage) };
        if reaped < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if reaped == pid {
            if expired {
                return Ok(None);
            }
            let code = if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else {
                -1
            };
            let time = |t: libc::timeval| {
                Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
            };
            return Ok(Some((code, time(usage.ru_utime) + time(usage.ru_stime))));
        }
        thread::sleep(WAIT_POLL.min(deadline.saturating_duration_since(Instant::now())));
    }
}

/// The program's own text, the values it reported, its first failure, and
/// how many vCPUs said they were done.
type Output = (String, Vec<(u32, Report)>, Option<String>, usize);

/// Splits QEMU's COM1 output into the program's own text, the values it
/// reported, and the first failure it reported, if any.
fn split_output(text: &str) -> Result<Output, QemuError> {
    let mut serial = String::new();
    let mut reports = Vec::new();
    let mut failure = None;
    let mut done = std::collections::BTreeSet::new();
    for line in text.split_inclusive('\n') {
        let Some(call) = line.trim_end().strip_prefix(TEXT_TAG) else {
            serial.push_str(line);
            continue;
        };
        let (vcpu, call) = ucall::decode_text(call).map_err(|source| QemuError::BadUcall {
            line: line.trim_end().to_owned(),
            source,
        })?;
        match call {
            Ucall::Report { name, value } => reports.push((vcpu, Report { name, value })),
            Ucall::Done => {
                done.insert(vcpu);
            }
            other => {
                failure.get_or_insert(format!("vCPU {vcpu}: {other:?}"));
            }
        }
    }
    Ok((serial, reports, failure, done.len()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_splits_into_serial_reports_and_failures() {
        let text = "hello from vcpu 0\n@ucall 0 1 4096 7 0 0 tsc\n@ucall 0 3 0 0 0 0\n";
        let (serial, reports, failure, done) = split_output(text).unwrap();
        assert_eq!(done, 1);
        assert_eq!(serial, "hello from vcpu 0\n");
        assert_eq!(
            reports,
            vec![(
                0,
                Report {
                    name: "tsc".into(),
                    value: 7
                }
            )]
        );
        assert_eq!(failure, None);
        let (_, _, failure, done) = split_output("@ucall 1 4 13 0 4096 0\n").unwrap();
        assert_eq!(done, 0);
        assert!(failure.unwrap().starts_with("vCPU 1: Exception"));
        assert!(matches!(
            split_output("@ucall 1 zz\n"),
            Err(QemuError::BadUcall { .. })
        ));
    }

    #[test]
    fn the_command_line_names_the_apic_and_the_image() {
        let cmd = Qemu::at("/usr/bin/qemu").command(Path::new("g.elf"), 1, 64, QemuApic::User);
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let line = args.join(" ");
        assert!(line.contains("-accel kvm,kernel-irqchip=off"), "{line}");
        assert!(line.contains("isa-debug-exit,iobase=0xf4"), "{line}");
        assert!(line.ends_with("-kernel g.elf"), "{line}");
    }

    #[test]
    fn a_missing_binary_is_a_clear_error() {
        let err = Qemu::at("/nonexistent/qemu")
            .run(
                Path::new("x"),
                1,
                64,
                QemuApic::User,
                Duration::from_secs(1),
            )
            .unwrap_err();
        assert!(err.to_string().contains("apt-get install"), "{err}");
    }

    #[test]
    fn a_child_past_its_timeout_is_killed() {
        let mut child = Command::new("sleep").arg("10").spawn().unwrap();
        let waited = wait_with_usage(child.id() as libc::pid_t, Duration::from_millis(50));
        assert_eq!(waited.unwrap(), None);
        // Reaped already: there is nothing left to wait for.
        assert!(child.wait().is_err());
    }
}
