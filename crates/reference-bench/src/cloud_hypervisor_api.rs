//! Cloud Hypervisor driven through its API socket with `ch-remote`: a bench
//! guest moved live between two of its processes (`receive-migration` on the
//! destination, then `send-migration` on the source), over a Unix socket or
//! over TCP between two network namespaces; and a snapshot of a running
//! guest (`pause`, `snapshot`, `resume`) restored in a fresh process
//! (`--restore`). The guest reports from the COM1 of the process it ends in;
//! a move that Cloud Hypervisor gives up leaves the guest running on at the
//! source, which says so.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crate::cloud_hypervisor::{self, CloudHypervisor};
use crate::peer_run::{self, Ended, PeerBinary, PeerError, PeerRun};

/// The name of Cloud Hypervisor's control client.
pub const CH_REMOTE: &str = "ch-remote";

/// Where the stream goes.
#[derive(Clone, Debug)]
pub enum MoveLink {
    /// A Unix socket at this path.
    Unix(PathBuf),
    /// TCP to `ip:port`, the source in namespace `source` and the
    /// destination in `destination` where given.
    Tcp {
        /// The source's network namespace.
        source: Option<String>,
        /// The destination's network namespace.
        destination: Option<String>,
        /// The destination's address in its namespace.
        ip: String,
        /// The port it listens on.
        port: u16,
    },
}

/// A Unix socket's path, removed when dropped: the destination makes it.
struct UnixSocket(Option<PathBuf>);

impl UnixSocket {
    fn remove(&self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Drop for UnixSocket {
    fn drop(&mut self) {
        self.remove();
    }
}

impl MoveLink {
    /// Its Unix socket, if it is one, without what a former move left.
    fn unix_socket(&self) -> UnixSocket {
        let socket = UnixSocket(match self {
            Self::Unix(path) => Some(path.clone()),
            Self::Tcp { .. } => None,
        });
        socket.remove();
        socket
    }

    /// The URL both `ch-remote` commands take.
    fn url(&self) -> String {
        match self {
            Self::Unix(path) => format!("unix:{}", path.display()),
            Self::Tcp { ip, port, .. } => format!("tcp:{ip}:{port}"),
        }
    }

    /// The namespaces of the source and the destination, if any.
    fn namespaces(&self) -> (Option<&str>, Option<&str>) {
        match self {
            Self::Unix(_) => (None, None),
            Self::Tcp {
                source,
                destination,
                ..
            } => (source.as_deref(), destination.as_deref()),
        }
    }
}

/// How the move is asked for: when, how, and within which limits of Cloud
/// Hypervisor's own (`send-migration`'s `downtime_ms` and `timeout_s`; past
/// the timeout it stops the guest and copies what is left, as this VMM's
/// pre-copy does past its own bound: `timeout_strategy=ignore`).
#[derive(Clone, Copy, Debug)]
pub struct MoveRequest {
    /// How long after the source starts the move begins.
    pub after: Duration,
    /// The downtime Cloud Hypervisor aims for.
    pub downtime: Duration,
    /// How long pre-copy may take before Cloud Hypervisor stops the guest.
    pub timeout: Duration,
    /// Post-copy (`memory_mode=postcopy`): the destination runs the guest at
    /// once and asks the source for each page it touches first.
    pub postcopy: bool,
}

impl MoveRequest {
    /// `send-migration`'s configuration, to `url`.
    fn send(&self, url: &str) -> String {
        format!(
            "destination_url={url},downtime_ms={},timeout_s={},timeout_strategy=ignore{}",
            self.downtime.as_millis().max(1),
            self.timeout.as_secs().max(1),
            self.memory_mode()
        )
    }

    /// `receive-migration`'s configuration, at `url`.
    fn receive(&self, url: &str) -> String {
        format!("receiver_url={url}{}", self.memory_mode())
    }

    fn memory_mode(&self) -> &'static str {
        match self.postcopy {
            true => ",memory_mode=postcopy",
            false => "",
        }
    }
}

/// One move's result.
#[derive(Debug)]
pub enum PeerMove {
    /// The guest moved and ended on the destination.
    Moved {
        /// From `send-migration` until the destination said it had the VM.
        total: Duration,
        /// The downtime the source logged, if it did.
        downtime: Option<Duration>,
        /// Whether pre-copy met the downtime target (the source did not log
        /// that it stopped the guest past its timeout instead).
        converged: bool,
        /// The guest's run, its reports from the destination.
        destination: PeerRun,
    },
    /// The move failed; the guest ended on the source.
    Failed {
        /// What the destination's `receive-migration` said.
        why: String,
        /// The guest's run on the source.
        source: PeerRun,
    },
}

/// The downtime in a Cloud Hypervisor source's log ("Migration completed
/// after 1.8s with a downtime of 15ms"), if it has it.
fn logged_downtime(log: &str) -> Option<Duration> {
    let (_, after) = log.rsplit_once("with a downtime of ")?;
    let ms = after.split("ms").next()?.trim().parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// Whether a source's log says it stopped the guest past its timeout,
/// short of its downtime target.
fn forced_stop(log: &str) -> bool {
    log.contains("ignoring target downtime")
}

/// The files of one move: the two API sockets, in a short folder of their
/// own (a socket's path holds at most 107 bytes), removed after.
struct Sockets(PathBuf);

impl Sockets {
    fn new() -> Result<Self, PeerError> {
        static MOVES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = MOVES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("rb-chm-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|source| PeerError::Write {
            vmm: VMM,
            path: dir.clone(),
            source,
        })?;
        Ok(Self(dir))
    }

    fn api(&self, side: &str) -> PathBuf {
        self.0.join(format!("{side}.sock"))
    }
}

impl Drop for Sockets {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const VMM: &str = "Cloud Hypervisor";

/// How long a Cloud Hypervisor may take to open its API socket.
const API_TIMEOUT: Duration = Duration::from_secs(10);

/// `program` run in network namespace `ns`, where given.
fn in_namespace(ns: Option<&str>, program: &Path) -> Command {
    match ns {
        Some(ns) => {
            let mut command = Command::new("ip");
            command.args(["netns", "exec", ns]).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// A VMM process, killed and reaped if it is dropped still running.
struct Vmm(Option<Child>);

impl Vmm {
    fn spawn(mut command: Command) -> Result<Self, PeerError> {
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map(|child| Self(Some(child)))
            .map_err(|source| PeerError::Spawn {
                vmm: VMM,
                binary: command.get_program().into(),
                hint: cloud_hypervisor::HINT,
                source,
            })
    }

    /// Waits for its API socket `path` to take connections.
    fn wait_for(&mut self, path: &Path) -> Result<(), PeerError> {
        let deadline = Instant::now() + API_TIMEOUT;
        while !peer_run::accepting(path) {
            let exited = self.0.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() >= deadline {
                let ended = self.finish(Duration::ZERO, Instant::now());
                return Err(PeerError::Exited {
                    vmm: VMM,
                    status: ended.as_ref().map_or(-1, |e| e.status),
                    done: 0,
                    vcpus: 0,
                    stderr: ended.map(|e| e.stderr).unwrap_or_default(),
                });
            }
            thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Waits at most `timeout` for it to end, kills it past that, and
    /// returns what it left (`None`: it had to be killed, or was gone).
    fn finish(&mut self, timeout: Duration, started: Instant) -> Option<Ended> {
        let waited = peer_run::wait_or_kill(self.0.take()?, timeout).ok()?;
        Some(Ended {
            status: waited.status.map(|s| s.code().unwrap_or(-1))?,
            exit_status: 0,
            stdout: waited.stdout,
            stderr: waited.stderr,
            elapsed: started.elapsed(),
            cpu_time: Duration::ZERO,
        })
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        self.finish(Duration::ZERO, Instant::now());
    }
}

/// Runs `ch-remote` on the API socket `api`; an error with what it said.
fn remote(binary: &Path, api: &Path, args: &[String]) -> Result<(), String> {
    let out = Command::new(binary)
        .arg("--api-socket")
        .arg(api)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", binary.display()))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "{} {}: {}",
            CH_REMOTE,
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

impl CloudHypervisor {
    /// Its control client, `ch-remote`: beside it, else found as it was.
    pub fn ch_remote(&self) -> Option<PathBuf> {
        let beside = self.binary().with_file_name(CH_REMOTE);
        match beside.is_file() {
            true => Some(beside),
            false => peer_run::find_binary(CH_REMOTE),
        }
    }

    /// Boots `image` (`vcpus`, `mem_mib`) on a source process and moves it
    /// to a destination process over `link` as `request` says; the guest
    /// then ends where it runs, at most `timeout` after the move.
    pub fn migrate(
        &self,
        image: &Path,
        (vcpus, mem_mib): (u32, u64),
        request: MoveRequest,
        link: &MoveLink,
        timeout: Duration,
    ) -> Result<PeerMove, PeerError> {
        let ch_remote = self.ch_remote().ok_or_else(|| no_ch_remote(self))?;
        let sockets = Sockets::new()?;
        let _unix_socket = link.unix_socket();
        let (source_ns, destination_ns) = link.namespaces();
        let mut destination = in_namespace(destination_ns, self.binary());
        self.env().apply(&mut destination);
        destination
            .arg("--api-socket")
            .arg(sockets.api("destination"));
        let mut destination = Vmm::spawn(destination)?;
        let mut source = in_namespace(source_ns, self.binary());
        self.env().apply(&mut source);
        source
            .args(cloud_hypervisor::boot_args(image, vcpus, mem_mib))
            .arg("--api-socket")
            .arg(sockets.api("source"))
            // Its log at info level: the downtime it saw.
            .arg("-v");
        let mut source = Vmm::spawn(source)?;
        destination.wait_for(&sockets.api("destination"))?;
        source.wait_for(&sockets.api("source"))?;
        let url = link.url();
        let receiving = {
            let (ch_remote, api) = (ch_remote.clone(), sockets.api("destination"));
            let args = vec!["receive-migration".into(), request.receive(&url)];
            thread::spawn(move || remote(&ch_remote, &api, &args))
        };
        thread::sleep(request.after);
        let started = Instant::now();
        let send = vec!["send-migration".into(), request.send(&url)];
        // It answers at once; the destination's receive-migration returns
        // when the move has ended, or failed.
        let received = remote(&ch_remote, &sockets.api("source"), &send).and_then(|()| {
            receiving
                .join()
                .unwrap_or_else(|_| Err("the receiving thread panicked".into()))
        });
        let total = started.elapsed();
        let ended = |vmm: &mut Vmm| {
            vmm.finish(timeout, started)
                .ok_or_else(|| timed_out(timeout))
        };
        match received {
            Ok(()) => {
                let destination = peer_run::guest_run(VMM, ended(&mut destination)?, vcpus)?;
                // Done at the hand-over, or once post-copy's last page went.
                let log = ended(&mut source).map(|e| e.stderr).unwrap_or_default();
                Ok(PeerMove::Moved {
                    total,
                    downtime: logged_downtime(&log),
                    converged: !forced_stop(&log),
                    destination,
                })
            }
            Err(why) => {
                let source = peer_run::guest_run(VMM, ended(&mut source)?, vcpus)?;
                Ok(PeerMove::Failed { why, source })
            }
        }
    }
}

/// A snapshot of a running guest and its restore.
#[derive(Debug)]
pub struct SnapshotRun {
    /// From the pause to the resume's answer.
    pub pause: Duration,
    /// Bytes the snapshot's files hold on disk.
    pub bytes: u64,
    /// The restored guest's run, to its end.
    pub restored: PeerRun,
}

/// How long a restored Cloud Hypervisor may take to accept its `resume`.
const RESTORE_TIMEOUT: Duration = Duration::from_secs(10);

impl CloudHypervisor {
    /// Boots `image` (`vcpus`, `mem_mib`), snapshots the guest `after` it
    /// starts (paused, written to a folder, resumed), lets that guest end,
    /// then restores the snapshot in a fresh process and runs the guest to
    /// its end there, each end at most `timeout` away.
    pub fn snapshot_and_restore(
        &self,
        image: &Path,
        (vcpus, mem_mib): (u32, u64),
        after: Duration,
        timeout: Duration,
    ) -> Result<SnapshotRun, PeerError> {
        let ch_remote = self.ch_remote().ok_or_else(|| no_ch_remote(self))?;
        let sockets = Sockets::new()?;
        let mut source = Command::new(self.binary());
        source
            .args(cloud_hypervisor::boot_args(image, vcpus, mem_mib))
            .arg("--api-socket")
            .arg(sockets.api("source"));
        let mut source = Vmm::spawn(source)?;
        source.wait_for(&sockets.api("source"))?;
        thread::sleep(after);
        let folder = sockets.0.join("snapshot");
        let failed = |what| PeerError::Guest { vmm: VMM, what };
        std::fs::create_dir_all(&folder)
            .map_err(|e| failed(format!("{}: {e}", folder.display())))?;
        let api = |args: &[String]| remote(&ch_remote, &sockets.api("source"), args);
        let url = format!("file://{}", folder.display());
        let paused = Instant::now();
        api(&["pause".into()])
            .and_then(|()| api(&["snapshot".into(), url.clone()]))
            .and_then(|()| api(&["resume".into()]))
            .map_err(failed)?;
        let pause = paused.elapsed();
        let bytes = on_disk(&folder);
        let started = Instant::now();
        let ended = source.finish(timeout, started);
        peer_run::guest_run(VMM, ended.ok_or_else(|| timed_out(timeout))?, vcpus)?;
        let mut restore = Command::new(self.binary());
        restore
            .arg("--api-socket")
            .arg(sockets.api("restored"))
            .arg("--restore")
            .arg(format!("source_url={url}"));
        let mut restored = Vmm::spawn(restore)?;
        restored.wait_for(&sockets.api("restored"))?;
        // It accepts the resume once the VM is restored.
        let deadline = Instant::now() + RESTORE_TIMEOUT;
        while let Err(e) = remote(&ch_remote, &sockets.api("restored"), &["resume".into()]) {
            if Instant::now() >= deadline {
                return Err(failed(e));
            }
            thread::sleep(Duration::from_millis(20));
        }
        let started = Instant::now();
        let ended = restored.finish(timeout, started);
        let restored = peer_run::guest_run(VMM, ended.ok_or_else(|| timed_out(timeout))?, vcpus)?;
        Ok(SnapshotRun {
            pause,
            bytes,
            restored,
        })
    }
}

/// Bytes the files of `folder` hold on disk.
fn on_disk(folder: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(folder)
        .into_iter()
        .flatten()
        .filter_map(|entry| entry.ok()?.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

fn timed_out(timeout: Duration) -> PeerError {
    PeerError::Timeout {
        vmm: VMM,
        timeout,
        serial: String::new(),
    }
}

fn no_ch_remote(ch: &CloudHypervisor) -> PeerError {
    PeerError::Guest {
        vmm: VMM,
        what: format!("no {CH_REMOTE} beside {}", ch.binary().display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_names_the_limits_and_the_mode_on_both_sides() {
        let mut request = MoveRequest {
            after: Duration::ZERO,
            downtime: Duration::from_millis(20),
            timeout: Duration::from_secs(2),
            postcopy: false,
        };
        let url = MoveLink::Unix("/tmp/m.sock".into()).url();
        assert_eq!(
            request.send(&url),
            "destination_url=unix:/tmp/m.sock,downtime_ms=20,timeout_s=2,timeout_strategy=ignore"
        );
        assert_eq!(request.receive(&url), "receiver_url=unix:/tmp/m.sock");
        request.postcopy = true;
        assert!(request.send(&url).ends_with(",memory_mode=postcopy"));
        assert!(request.receive(&url).ends_with(",memory_mode=postcopy"));
    }

    #[test]
    fn a_failed_ch_remote_says_what_it_ran_and_what_it_said() {
        let api = Path::new("/nonexistent.sock");
        let err = remote(Path::new("/bin/false"), api, &["resume".into()]).unwrap_err();
        assert_eq!(err, "ch-remote resume: ");
        let err = remote(Path::new("/nonexistent/ch-remote"), api, &[]).unwrap_err();
        assert!(
            err.starts_with("cannot run /nonexistent/ch-remote"),
            "{err}"
        );
    }

    #[test]
    fn a_vmm_past_its_time_is_killed_and_gives_no_run() {
        let mut sleeping = Command::new("sleep");
        sleeping.arg("10");
        let mut vmm = Vmm::spawn(sleeping).unwrap();
        let started = Instant::now();
        assert!(vmm.finish(Duration::from_millis(50), started).is_none());
        assert!(started.elapsed() < Duration::from_secs(5));
        let mut done = Vmm::spawn(Command::new("true")).unwrap();
        let ended = done.finish(Duration::from_secs(5), Instant::now()).unwrap();
        assert_eq!((ended.status, ended.exit_status), (0, 0));
        assert!(
            timed_out(Duration::from_secs(1))
                .to_string()
                .contains("did not finish")
        );
    }

    #[test]
    fn the_source_log_gives_the_downtime_and_whether_it_was_forced() {
        let log = "x Precopy: Pausing VM, ignoring target downtime (1ms) due to timeout (1s)\n\
                   y Migration completed after 2.4s with a downtime of 26ms (goal was 1ms)\n";
        assert_eq!(logged_downtime(log), Some(Duration::from_millis(26)));
        assert!(forced_stop(log));
        assert_eq!(logged_downtime("Migration failed"), None);
        assert!(!forced_stop(
            "Migration completed after 1.8s with a downtime of 15ms"
        ));
    }
}
