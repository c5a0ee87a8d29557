//! The control socket (`run --control PATH`) as a client drives it: pause,
//! snapshot, resume and migrate a running guest, each answered on its line;
//! what it refuses, and a paused guest that still ends on SIGTERM.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use cli::*;
use common::kvm_available;
use serde_json::{Value, json};

/// `run --guest migrate --control PATH` in the background, once its
/// socket is up.
fn controlled(name: &str) -> (Child, PathBuf) {
    let path = std::env::temp_dir().join(format!("rvmm-{}-{name}.ctl", std::process::id()));
    let params = migrate_params().map(|p| p.to_string()).join(",");
    let mut child = migrate_with(vmm(), &params)
        .arg("--control")
        .arg(&path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = Vec::new();
    let mut byte = [0u8];
    let stderr = child.stderr.as_mut().unwrap();
    while stderr.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
        line.push(byte[0]);
    }
    assert_eq!(
        text(&line),
        format!("control: listening on {}", path.display())
    );
    (child, path)
}

/// A client of the control socket at `path`.
struct Client {
    out: UnixStream,
    answers: BufReader<UnixStream>,
}

impl Client {
    fn connect(path: &Path) -> Self {
        let out = UnixStream::connect(path).unwrap();
        out.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let answers = BufReader::new(out.try_clone().unwrap());
        Self { out, answers }
    }

    fn send(&mut self, line: &str) -> Value {
        self.out.write_all(line.as_bytes()).unwrap();
        self.out.write_all(b"\n").unwrap();
        let mut answer = String::new();
        self.answers.read_line(&mut answer).unwrap();
        serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"))
    }

    fn command(&mut self, command: Value) -> Value {
        self.send(&command.to_string())
    }

    /// `command`, which must succeed.
    fn ok(&mut self, command: Value) -> Value {
        let answer = self.command(command.clone());
        assert_eq!(answer["ok"], true, "{command}: {answer}");
        answer
    }

    /// `command`, which must fail saying `why`.
    fn refused(&mut self, command: Value, why: &str) {
        let answer = self.command(command.clone());
        assert_eq!(answer["ok"], false, "{command}: {answer}");
        let error = answer["error"].as_str().unwrap();
        assert!(error.contains(why), "{command}: {error}");
    }
}

#[test]
fn a_client_pauses_snapshots_resumes_and_migrates_a_running_guest() {
    if !kvm_available("a_client_pauses_snapshots_resumes_and_migrates_a_running_guest") {
        return;
    }
    let mut destination = Background(
        vmm()
            .args(["receive", "--listen", &socket("control").to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let to = destination.listening_on();
    let (source, path) = controlled("moves");
    let snapshot = std::env::temp_dir().join(format!("rvmm-{}-control.snap", std::process::id()));
    let mut client = Client::connect(&path);

    let status = client.ok(json!({ "command": "status" }));
    assert_eq!(status["state"], "running", "{status}");
    assert_eq!(
        (status["guest"].as_str(), status["vcpus"].as_u64()),
        (Some("migrate"), Some(2))
    );
    client.ok(json!({ "command": "pause" }));
    client.refused(json!({ "command": "pause" }), "paused already");
    assert_eq!(client.ok(json!({ "command": "status" }))["state"], "paused");
    let increment = json!({ "command": "snapshot", "path": snapshot, "kind": "incremental" });
    client.refused(increment, "take a full one first");
    let kind = json!({ "command": "snapshot", "path": snapshot, "kind": "diff" });
    client.refused(kind, "\"diff\" is not one of: full, incremental");
    let written = client.ok(json!({ "command": "snapshot", "path": snapshot }));
    assert_eq!(
        written["state"], "paused",
        "a paused guest stays paused: {written}"
    );
    assert_eq!(written["pages_sent"], 64 * 256, "all 64 MiB: {written}");
    client.refused(json!({ "command": "migrate", "to": to }), "resume it first");
    client.ok(json!({ "command": "resume" }));
    client.refused(json!({ "command": "resume" }), "not paused");
    // The guest's 1 ms timer shows in the counters (on a busy host, soon).
    let counting = Instant::now();
    loop {
        let stats = client.ok(json!({ "command": "stats" }));
        if stats["timer_expiries"].as_u64() > Some(0) && stats["interrupts"].as_u64() > Some(0) {
            break;
        }
        assert!(counting.elapsed() < Duration::from_secs(5), "{stats}");
        std::thread::sleep(Duration::from_millis(10));
    }
    client.refused(json!({ "command": "reboot" }), "unknown command \"reboot\"");
    client.refused(json!({ "command": "snapshot" }), "needs \"path\"");
    client.refused(json!({ "command": "migrate", "to": "ftp:x" }), "\"to\"");
    let tcp = json!({ "command": "migrate", "to": "tcp:127.0.0.1:9" });
    client.refused(tcp, "needs --tls-cert");
    client.refused(
        json!({ "command": "snapshot", "path": "/nonexistent/dir/snap" }),
        "/nonexistent/dir/snap",
    );
    let moved = client.ok(json!({ "command": "migrate", "to": to }));
    assert!(moved["pages_sent"].as_u64() >= Some(64 * 256), "{moved}");
    assert_eq!(moved["snapshot"], false, "{moved}");

    let source = source.wait_with_output().unwrap();
    assert!(source.status.success(), "{}", text(&source.stderr));
    assert!(
        text(&source.stdout).contains("then handed over"),
        "{}",
        text(&source.stdout)
    );
    assert!(!path.exists(), "the control socket is removed with the run");
    assert_guest_checked(&destination.output(), "the destination");
    // The snapshot taken while paused runs on too, every page checked.
    let restored = vmm().arg("restore").arg(&snapshot).output().unwrap();
    assert_guest_checked(&restored, "the restored snapshot");
    std::fs::remove_file(snapshot).unwrap();
}

#[test]
fn a_bad_client_is_answered_and_dropped_and_a_paused_guest_still_ends_on_sigterm() {
    if !kvm_available(
        "a_bad_client_is_answered_and_dropped_and_a_paused_guest_still_ends_on_sigterm",
    ) {
        return;
    }
    let (mut source, path) = controlled("sigterm");
    let mut client = Client::connect(&path);
    client.refused(json!([1, 2]), "a JSON object");
    client.refused(json!({ "verb": "pause" }), "no \"command\"");
    let error = client.send("{");
    assert!(
        error["error"].as_str().unwrap().contains("not JSON"),
        "{error}"
    );
    // A line past the bound is answered, and its connection ends: the
    // server may close it before the rest of the line is written (EPIPE).
    let _ = client.out.write_all(&[b'x'; 100_000]);
    let _ = client.out.write_all(b"\n");
    let mut answer = String::new();
    client.answers.read_line(&mut answer).unwrap();
    let long: Value = serde_json::from_str(&answer).unwrap_or_else(|e| panic!("{answer:?}: {e}"));
    assert!(
        long["error"].as_str().unwrap().contains("at most"),
        "{long}"
    );
    let mut rest = Vec::new();
    assert_eq!(client.answers.read_to_end(&mut rest).unwrap_or(0), 0);
    drop(client);
    // The next client is served.
    let mut client = Client::connect(&path);
    client.ok(json!({ "command": "pause" }));
    let mode = std::os::unix::fs::PermissionsExt::mode(&path.metadata().unwrap().permissions());
    assert_eq!(
        mode & 0o077,
        0,
        "the socket is for its owner alone: {mode:o}"
    );

    let sent = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(source.id() as i32, libc::SIGTERM) }, 0);
    while source.try_wait().unwrap().is_none() {
        assert!(
            sent.elapsed() < Duration::from_secs(5),
            "a paused guest held the run"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(source.wait().unwrap().code(), Some(128 + libc::SIGTERM));
    assert!(!path.exists(), "the control socket is removed with the run");
}

#[test]
fn the_control_client_and_option_get_clear_errors() {
    let dir = std::env::temp_dir().join(format!("rvmm-{}-control-errors", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("fake.ctl");
    let control = |args: &[&str]| vmm().arg("control").args(args).output().unwrap();
    let nowhere = control(&["/nonexistent/x.ctl", "status"]);
    assert_eq!(nowhere.status.code(), Some(1));
    assert!(
        text(&nowhere.stderr).contains("/nonexistent/x.ctl: "),
        "{}",
        text(&nowhere.stderr)
    );
    let field = control(&[socket.to_str().unwrap(), "snapshot", "path"]);
    assert_eq!(field.status.code(), Some(2));
    assert!(
        text(&field.stderr).contains("is not NAME=VALUE"),
        "{}",
        text(&field.stderr)
    );
    // A server that hangs up without a word, then one that answers garbage.
    let listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let server = std::thread::spawn(move || {
        for answer in [&b""[..], b"not json\n"] {
            let (mut client, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&client).read_line(&mut line).unwrap();
            client.write_all(answer).unwrap();
        }
    });
    for expected in ["no answer came", "the answer: "] {
        let out = control(&[socket.to_str().unwrap(), "status"]);
        assert_eq!(out.status.code(), Some(1));
        assert!(
            text(&out.stderr).contains(expected),
            "{}",
            text(&out.stderr)
        );
    }
    server.join().unwrap();
    // A socket that cannot be bound fails before the guest starts.
    let params = migrate_params().map(|p| p.to_string()).join(",");
    let unbound = migrate_with(vmm(), &params)
        .args(["--control", "/nonexistent/dir/x.ctl"])
        .output()
        .unwrap();
    assert_eq!(unbound.status.code(), Some(1));
    assert!(text(&unbound.stderr).contains("cannot listen on /nonexistent/dir/x.ctl"));
    std::fs::remove_dir_all(dir).unwrap();
}
