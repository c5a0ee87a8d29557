//! Firecracker driven through its API socket (HTTP/1.1 over a Unix socket):
//! a VM configured and started, paused, snapshotted (full, or diff: the
//! pages KVM's dirty log reports with `track_dirty_pages`, else those
//! `mincore(2)` finds resident) and resumed; a snapshot loaded into a fresh
//! process. The guest's COM1 is the process's standard output, as in
//! [`crate::firecracker`].

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::firecracker::{self, Firecracker};
use crate::peer_run::{self, Ended, PeerBinary, PeerError, PeerRun};

const VMM: &str = "Firecracker";

/// How long Firecracker may take to open its socket or answer a request.
const API_TIMEOUT: Duration = Duration::from_secs(30);

/// One Firecracker process with its API socket, killed when dropped.
pub struct FirecrackerApi {
    child: Option<Child>,
    socket: PathBuf,
    started: Instant,
}

impl FirecrackerApi {
    /// Starts `fc` with its API on `socket` (a short path: a socket's holds
    /// at most 107 bytes), and waits for the socket.
    pub fn start(fc: &Firecracker, socket: &Path) -> Result<Self, PeerError> {
        let _ = std::fs::remove_file(socket);
        let mut command = Command::new(fc.binary());
        fc.env().apply(&mut command);
        command
            .arg("--api-sock")
            .arg(socket)
            .args(["--log-path", "/dev/stderr"]);
        let child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| PeerError::Spawn {
                vmm: VMM,
                binary: fc.binary().into(),
                hint: firecracker::HINT,
                source,
            })?;
        let mut api = Self {
            child: Some(child),
            socket: socket.into(),
            started: Instant::now(),
        };
        let deadline = Instant::now() + API_TIMEOUT;
        while !peer_run::accepting(socket) {
            let exited = api.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
            if exited.is_some() || Instant::now() >= deadline {
                return Err(api.failed("it did not open its API socket"));
            }
            thread::sleep(Duration::from_millis(5));
        }
        Ok(api)
    }

    /// The VM booting `image` with `vcpus` vCPUs and `mem_mib` MiB, KVM's
    /// dirty log on where `track_dirty_pages`, started.
    pub fn boot(
        &mut self,
        image: &Path,
        (vcpus, mem_mib): (u32, u64),
        track_dirty_pages: bool,
    ) -> Result<(), PeerError> {
        self.request("PUT", "/boot-source", json!({ "kernel_image_path": image }))?;
        let machine = json!({
            "vcpu_count": vcpus,
            "mem_size_mib": mem_mib,
            "track_dirty_pages": track_dirty_pages,
        });
        self.request("PUT", "/machine-config", machine)?;
        self.request("PUT", "/actions", json!({ "action_type": "InstanceStart" }))
    }

    /// Pauses the VM, writes a snapshot of `kind` (`"Full"` or `"Diff"`) to
    /// `state` and `memory`, and resumes it: how long the guest was paused.
    pub fn snapshot(
        &mut self,
        kind: &str,
        state: &Path,
        memory: &Path,
    ) -> Result<Duration, PeerError> {
        let paused = Instant::now();
        self.request("PATCH", "/vm", json!({ "state": "Paused" }))?;
        let create = json!({
            "snapshot_type": kind,
            "snapshot_path": state,
            "mem_file_path": memory,
        });
        self.request("PUT", "/snapshot/create", create)?;
        self.request("PATCH", "/vm", json!({ "state": "Resumed" }))?;
        Ok(paused.elapsed())
    }

    /// Loads the snapshot `state` with its memory from `memory` and
    /// resumes the guest.
    pub fn load(&mut self, state: &Path, memory: &Path) -> Result<(), PeerError> {
        let load = json!({
            "snapshot_path": state,
            "mem_backend": { "backend_type": "File", "backend_path": memory },
            "resume_vm": true,
        });
        self.request("PUT", "/snapshot/load", load)
    }

    /// Waits at most `timeout` for the guest to end the VMM, and returns
    /// the guest's run (`vcpus` of them reporting done).
    pub fn wait(mut self, vcpus: u32, timeout: Duration) -> Result<PeerRun, PeerError> {
        let Some(child) = self.child.take() else {
            return Err(self.failed("it was gone"));
        };
        let waited = peer_run::wait_or_kill(child, timeout)
            .map_err(|source| PeerError::Wait { vmm: VMM, source })?;
        let Some(status) = waited.status else {
            return Err(PeerError::Timeout {
                vmm: VMM,
                timeout,
                serial: waited.stdout,
            });
        };
        let ended = Ended {
            status: status.code().unwrap_or(-1),
            exit_status: 0,
            stdout: waited.stdout,
            stderr: waited.stderr,
            elapsed: self.started.elapsed(),
            cpu_time: Duration::ZERO,
        };
        peer_run::guest_run(VMM, ended, vcpus)
    }

    /// One request with a JSON `body`; an error with Firecracker's answer
    /// unless it is 2xx.
    fn request(&mut self, method: &str, path: &str, body: Value) -> Result<(), PeerError> {
        let body = body.to_string();
        let answer = exchange(&self.socket, method, path, &body)
            .map_err(|e| self.failed(&format!("{method} {path}: {e}")))?;
        match answer.get(9..10) {
            Some("2") => Ok(()),
            _ => Err(self.failed(&format!("{method} {path} {body}: {}", answer.trim()))),
        }
    }

    /// Its error: `what` went wrong, with what Firecracker logged.
    fn failed(&mut self, what: &str) -> PeerError {
        let stderr = self
            .child
            .take()
            .and_then(|mut c| {
                let _ = c.kill();
                c.wait_with_output().ok()
            })
            .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            .unwrap_or_default();
        PeerError::Guest {
            vmm: VMM,
            what: format!("{what}; its log: {}", stderr.trim()),
        }
    }
}

impl Drop for FirecrackerApi {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Copies the pages of the diff snapshot's memory file `diff` (a sparse
/// file: its data regions) onto the memory file `onto` of the snapshot it
/// follows, as Firecracker's snapshot-editor's rebase does: `onto` then
/// holds the memory at the diff.
pub fn rebase(diff: &Path, onto: &Path) -> Result<(), PeerError> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let failed = |path: &Path| {
        let path = path.to_owned();
        move |source| PeerError::Write {
            vmm: VMM,
            path,
            source,
        }
    };
    let from = std::fs::File::open(diff).map_err(failed(diff))?;
    let to = std::fs::OpenOptions::new()
        .write(true)
        .open(onto)
        .map_err(failed(onto))?;
    let seek = |offset: u64, whence| {
        // SAFETY: lseek on a file this function holds open; it moves only
        // that file's offset, which nothing else here uses.
        let at = unsafe { libc::lseek(from.as_raw_fd(), offset as libc::off_t, whence) };
        u64::try_from(at).ok()
    };
    let mut chunk = vec![0u8; 1 << 20];
    let mut offset = 0;
    // Past the last data region, SEEK_DATA fails (ENXIO).
    while let Some(data) = seek(offset, libc::SEEK_DATA) {
        let hole = seek(data, libc::SEEK_HOLE).unwrap_or(data);
        let mut at = data;
        while at < hole {
            let n = chunk.len().min((hole - at) as usize);
            from.read_exact_at(&mut chunk[..n], at)
                .map_err(failed(diff))?;
            to.write_all_at(&chunk[..n], at).map_err(failed(onto))?;
            at += n as u64;
        }
        offset = hole.max(data + 1);
    }
    to.sync_all().map_err(failed(onto))
}

/// Sends one request on a fresh connection and reads the whole answer.
fn exchange(socket: &Path, method: &str, path: &str, body: &str) -> std::io::Result<String> {
    let mut api = UnixStream::connect(socket)?;
    api.set_read_timeout(Some(API_TIMEOUT))?;
    write!(
        api,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 4096];
    while !complete(&answer) {
        let n = api.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        answer.extend_from_slice(&chunk[..n]);
    }
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

/// Whether `answer` holds its headers and the body they announce.
fn complete(answer: &[u8]) -> bool {
    let text = String::from_utf8_lossy(answer);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        return false;
    };
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    body.len() >= length
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rebase_copies_the_diffs_pages_and_leaves_the_rest() {
        use std::os::unix::fs::FileExt;
        let dir = std::env::temp_dir().join(format!("rb-rebase-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (base, diff) = (dir.join("base"), dir.join("diff"));
        std::fs::write(&base, vec![1u8; 4 * 4096]).unwrap();
        // A sparse diff of the same size with its page 2 alone.
        let file = std::fs::File::create(&diff).unwrap();
        file.set_len(4 * 4096).unwrap();
        file.write_all_at(&[7u8; 4096], 2 * 4096).unwrap();
        rebase(&diff, &base).unwrap();
        let merged = std::fs::read(&base).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(merged[..2 * 4096].iter().all(|&b| b == 1));
        assert!(merged[2 * 4096..3 * 4096].iter().all(|&b| b == 7));
        assert!(merged[3 * 4096..].iter().all(|&b| b == 1));
    }

    #[test]
    fn a_request_to_a_socket_that_is_not_there_is_an_error() {
        let err = exchange(Path::new("/nonexistent.sock"), "GET", "/", "").unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
    }

    #[test]
    fn an_answer_is_complete_with_its_headers_and_announced_body() {
        assert!(!complete(b"HTTP/1.1 204 No Content\r\n"));
        assert!(complete(
            b"HTTP/1.1 204 No Content\r\nServer: Firecracker API\r\n\r\n"
        ));
        let partial = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 10\r\n\r\n{\"fault";
        assert!(!complete(partial));
        assert!(complete(
            b"HTTP/1.1 400 Bad Request\r\ncontent-length: 10\r\n\r\n{\"fault\":1"
        ));
    }
}
