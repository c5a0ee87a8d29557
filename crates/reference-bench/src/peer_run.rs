//! A peer VMM's run of an image file ([`test_guests::pvh`]): the VMM as a
//! child process, the guest's ucall lines on COM1 read back as reports, its
//! CPU time from `wait4`, and a timeout past which it is killed by its pid.
//! QEMU ([`crate::qemu`]), Cloud Hypervisor ([`crate::cloud_hypervisor`])
//! and Firecracker ([`crate::firecracker`]) differ only in their command
//! lines and how they end: the guest kit ends each through the exit it
//! honours ([`test_guests::abi`]'s debug exit).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use test_guests::Report;
use test_guests::ucall::{self, TEXT_TAG, Ucall, UcallError};

/// The folder of peer VMM binaries looked in after `PATH` (`.ci/run` sets it
/// to `../shared/peers`).
pub const PEERS_DIR: &str = "VM_LATENCY_PEERS";

/// `name` on `PATH`, else in the folder [`PEERS_DIR`] names, if either has
/// it.
pub fn find_binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(std::env::var_os(PEERS_DIR).map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}

/// Whether a VMM's API socket at `socket` takes connections: the file
/// appears at `bind(2)`, before the VMM listens, and a request sent then
/// is refused (seen beside CPU hogs).
pub fn accepting(socket: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(socket).is_ok()
}

/// A peer VMM's binary: where it is, found by its name.
pub trait PeerBinary: Sized {
    /// The binary's name.
    const NAME: &'static str;

    /// The binary at `path`.
    fn at(path: impl Into<PathBuf>) -> Self;

    /// Where it is.
    fn binary(&self) -> &Path;

    /// [`NAME`](Self::NAME) from `PATH`, else from the peers' folder
    /// ([`PEERS_DIR`]), if either has it.
    fn find() -> Option<Self> {
        find_binary(Self::NAME).map(Self::at)
    }
}

/// What a child given until a deadline left.
pub(crate) struct Waited {
    /// How it ended; `None`: it had to be killed at the deadline.
    pub status: Option<std::process::ExitStatus>,
    /// Its standard output and error.
    pub stdout: String,
    pub stderr: String,
}

/// Waits at most `timeout` for `child` to end, kills it past that, and
/// collects what it wrote.
pub(crate) fn wait_or_kill(
    mut child: std::process::Child,
    timeout: Duration,
) -> std::io::Result<Waited> {
    let deadline = Instant::now() + timeout;
    let mut status = child.try_wait().ok().flatten();
    while status.is_none() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(5));
        status = child.try_wait().ok().flatten();
    }
    let _ = child.kill();
    let out = child.wait_with_output()?;
    let text = |bytes: Vec<u8>| String::from_utf8_lossy(&bytes).into_owned();
    Ok(Waited {
        status,
        stdout: text(out.stdout),
        stderr: text(out.stderr),
    })
}

/// Environment variables a peer runs with beyond this process's: how an
/// integration patch (`integrations/`) takes its settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerEnv(Vec<(String, String)>);

impl PeerEnv {
    /// Sets `key` to `value`.
    pub fn set(&mut self, key: &str, value: &str) {
        self.0.push((key.into(), value.into()));
    }

    /// Gives them to `command`.
    pub fn apply(&self, command: &mut Command) {
        command.envs(self.0.iter().map(|(k, v)| (k, v)));
    }
}

/// What `binary --version` says (its first line naming a version), and
/// where it is, with the build notes beside it (a `README.md` in its
/// folder, as in `../shared/peers`) where there are some.
pub fn describe(binary: &Path) -> String {
    let version = version_of(binary).unwrap_or_else(|| "version unknown".into());
    let notes = binary.with_file_name("README.md");
    match notes.is_file() {
        true => format!(
            "{version} ({}; its source commit, build and what this host needed: {})",
            binary.display(),
            notes.display()
        ),
        false => format!("{version} ({})", binary.display()),
    }
}

/// The first line of `binary --version` that names a version, within 5 s.
fn version_of(binary: &Path) -> Option<String> {
    let mut child = Command::new(binary)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let out = read_in_background(child.stdout.take());
    let waited = wait_with_usage(child.id() as libc::pid_t, Duration::from_secs(5));
    let text = out.join().unwrap_or_default();
    waited.ok()??;
    text.lines()
        .map(str::trim)
        .find(|l| l.contains(" v") || l.contains("version"))
        .map(str::to_owned)
}

/// One peer VMM run's result.
#[derive(Clone, Debug, PartialEq)]
pub struct PeerRun {
    /// What the guest wrote on COM1 apart from ucall lines.
    pub serial: String,
    /// Named values, by vCPU, in the order reported.
    pub reports: Vec<(u32, Report)>,
    /// Wall-clock time from spawning the VMM to its exit.
    pub elapsed: Duration,
    /// CPU time the VMM used, user and system, all its threads.
    pub cpu_time: Duration,
}

impl PeerRun {
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

/// Why a peer VMM's run gave no result.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The VMM could not be started.
    #[error("cannot start {vmm} ({binary}): {source} ({hint})")]
    Spawn {
        /// Which VMM.
        vmm: &'static str,
        /// The binary tried.
        binary: PathBuf,
        /// How to get it.
        hint: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// A file the VMM needs could not be written.
    #[error("cannot write {path} for {vmm}: {source}")]
    Write {
        /// Which VMM.
        vmm: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Waiting for the VMM failed.
    #[error("cannot wait for {vmm}: {source}")]
    Wait {
        /// Which VMM.
        vmm: &'static str,
        /// Why.
        source: std::io::Error,
    },
    /// The VMM did not end in time and was killed.
    #[error("{vmm} did not finish within {timeout:?} and was killed; serial output: {serial:?}")]
    Timeout {
        /// Which VMM.
        vmm: &'static str,
        /// The limit.
        timeout: Duration,
        /// What the guest wrote until then.
        serial: String,
    },
    /// The VMM ended otherwise than through the guest's exit after every
    /// vCPU was done (an error of the VMM's).
    #[error(
        "{vmm} exited with status {status} before the guest finished ({done} of {vcpus} vCPUs done); its stderr: {stderr}"
    )]
    Exited {
        /// Which VMM.
        vmm: &'static str,
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
    #[error("the guest failed under {vmm}: {what}")]
    Guest {
        /// Which VMM.
        vmm: &'static str,
        /// What it reported.
        what: String,
    },
    /// A ucall line could not be decoded.
    #[error("the guest sent a malformed ucall line {line:?}: {source}")]
    BadUcall {
        /// The line.
        line: String,
        /// Why.
        source: UcallError,
    },
}

/// A peer VMM's command to run, and how it ends when the guest does.
pub(crate) struct Launch {
    /// Its name, in errors.
    pub vmm: &'static str,
    /// How to get it, where it cannot be started.
    pub hint: &'static str,
    /// The command line, booting the image.
    pub command: Command,
    /// Its exit status once the guest ended it after every vCPU was done.
    pub exit_status: i32,
    /// The guest's vCPUs.
    pub vcpus: u32,
    /// How long it may run.
    pub timeout: Duration,
}

/// Runs `launch` to the guest's end, at most its timeout.
pub(crate) fn run(launch: Launch) -> Result<PeerRun, PeerError> {
    let Launch {
        vmm,
        hint,
        mut command,
        exit_status,
        vcpus,
        timeout,
    } = launch;
    let start = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| PeerError::Spawn {
            vmm,
            binary: command.get_program().into(),
            hint,
            source,
        })?;
    let stdout = read_in_background(child.stdout.take());
    let stderr = read_in_background(child.stderr.take());
    let pid = child.id() as libc::pid_t;
    let waited = wait_with_usage(pid, timeout);
    let elapsed = start.elapsed();
    let serial = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    let (status, cpu_time) = match waited.map_err(|source| PeerError::Wait { vmm, source })? {
        Some(ended) => ended,
        None => {
            return Err(PeerError::Timeout {
                vmm,
                timeout,
                serial,
            });
        }
    };
    let ended = Ended {
        status,
        exit_status,
        stdout: serial,
        stderr,
        elapsed,
        cpu_time,
    };
    guest_run(vmm, ended, vcpus)
}

/// What a peer VMM left when it ended.
pub(crate) struct Ended {
    /// Its exit status (-1: a signal).
    pub status: i32,
    /// Its exit status at the guest's exit.
    pub exit_status: i32,
    /// Its standard output: the guest's COM1.
    pub stdout: String,
    /// Its standard error.
    pub stderr: String,
    /// Wall-clock time it ran.
    pub elapsed: Duration,
    /// CPU time it used (zero where not measured).
    pub cpu_time: Duration,
}

/// The guest's run from what the VMM `vmm` left, which ran `vcpus` vCPUs:
/// an error where the guest failed, or the VMM ended before every vCPU was
/// done.
pub(crate) fn guest_run(vmm: &'static str, ended: Ended, vcpus: u32) -> Result<PeerRun, PeerError> {
    let (serial, reports, failure, done) = split_output(&ended.stdout)?;
    if let Some(what) = failure {
        return Err(PeerError::Guest { vmm, what });
    }
    if ended.status != ended.exit_status || done < vcpus as usize {
        return Err(PeerError::Exited {
            vmm,
            status: ended.status,
            done,
            vcpus,
            stderr: ended.stderr,
        });
    }
    Ok(PeerRun {
        serial,
        reports,
        elapsed: ended.elapsed,
        cpu_time: ended.cpu_time,
    })
}

/// Reads a child's pipe to its end on a thread of its own, so that neither
/// pipe can fill and stall the VMM.
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

/// Splits a VMM's COM1 output into the program's own text, the values it
/// reported, and the first failure it reported, if any.
fn split_output(text: &str) -> Result<Output, PeerError> {
    let mut serial = String::new();
    let mut reports = Vec::new();
    let mut failure = None;
    let mut done = std::collections::BTreeSet::new();
    for line in text.split_inclusive('\n') {
        let Some(call) = line.trim_end().strip_prefix(TEXT_TAG) else {
            serial.push_str(line);
            continue;
        };
        let (vcpu, call) = ucall::decode_text(call).map_err(|source| PeerError::BadUcall {
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
            Err(PeerError::BadUcall { .. })
        ));
    }

    #[test]
    fn a_binary_is_described_by_its_version_line_and_its_build_notes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rb-describe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let vmm = dir.join("fakevmm");
        std::fs::write(
            &vmm,
            "#!/bin/sh\necho 'fakevmm v1.2.3'\necho 'Protocol 0'\n",
        )
        .unwrap();
        std::fs::set_permissions(&vmm, std::fs::Permissions::from_mode(0o755)).unwrap();
        let alone = describe(&vmm);
        std::fs::write(dir.join("README.md"), "built so").unwrap();
        let noted = describe(&vmm);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(alone, format!("fakevmm v1.2.3 ({})", vmm.display()));
        assert!(noted.ends_with("README.md)"), "{noted}");
        let missing = describe(Path::new("/nonexistent/vmm"));
        assert_eq!(missing, "version unknown (/nonexistent/vmm)");
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
