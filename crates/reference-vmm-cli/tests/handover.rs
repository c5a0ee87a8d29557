//! A migration endpoint nobody can hold hostage, tried from outside as a
//! user runs `reference-vmm`: silent connections hold up no source, a
//! destination waits for a late source as long as asked and no longer, a
//! destination that stops answering holds the source's guest no longer
//! than its limits, a signal ends a source whatever it waits on, and a
//! hand-over whose last messages are lost leaves the guest running at one
//! place or reported lost, never at two.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::{UnixListener, UnixStream};
use std::process::{Child, Output, Stdio};
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use cli::*;
use common::kvm_available;
use migration::{Address, HANDOVER_MARGIN, Record};

/// A `receive` whose stderr lines arrive on a channel as it prints them.
struct Receiver {
    child: Child,
    lines: mpsc::Receiver<String>,
    address: String,
}

impl Receiver {
    fn start(listen: &str, extra: &[String]) -> Self {
        let mut child = vmm()
            .args(["receive", "--listen", listen])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stderr = BufReader::new(child.stderr.take().unwrap());
        thread::spawn(move || {
            for line in stderr.lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        // After --insecure's warning, if any.
        let address = lines
            .iter()
            .find_map(|l| l.strip_prefix("listening on ").map(str::to_owned))
            .expect("receive says where it listens");
        Self {
            child,
            lines,
            address,
        }
    }

    /// Waits until `n` lines satisfy `wanted`, `within` at most; returns
    /// them, and every line seen.
    fn wait_for(
        &self,
        n: usize,
        within: Duration,
        wanted: impl Fn(&str) -> bool,
    ) -> (Vec<String>, Vec<String>) {
        let deadline = Instant::now() + within;
        let (mut found, mut seen) = (Vec::new(), Vec::new());
        while found.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(line) = self.lines.recv_timeout(left) else {
                panic!("{} of {n} lines within {within:?}: {seen:?}", found.len())
            };
            if wanted(&line) {
                found.push(line.clone());
            }
            seen.push(line);
        }
        (found, seen)
    }

    /// Its exit, stdout, and the stderr lines not read yet.
    fn finish(mut self) -> (Output, Vec<String>) {
        let status = self.child.wait().unwrap();
        let mut stdout = Vec::new();
        self.child
            .stdout
            .take()
            .unwrap()
            .read_to_end(&mut stdout)
            .unwrap();
        let out = Output {
            status,
            stdout,
            stderr: Vec::new(),
        };
        (out, self.lines.iter().collect())
    }

    /// Its open file descriptors and resident memory (KiB).
    fn footprint(&self) -> (usize, u64) {
        let pid = self.child.id();
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
            .unwrap()
            .count();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let rss = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
            .unwrap();
        (fds, rss)
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `n` TCP connections to `address` that never send a byte.
fn silent(address: &str, n: usize) -> Vec<TcpStream> {
    let at = address.strip_prefix("tcp:").unwrap();
    (0..n).map(|_| TcpStream::connect(at).unwrap()).collect()
}

/// A TLS source moved to a fresh destination that sees `silent_first`
/// silent connections just before it: the source's wall time, and the
/// destination's stderr lines.
fn move_in_tls(silent_first: usize, handshake_ms: u64) -> (Duration, Vec<String>) {
    let (ca, _) = test_support::certs::cas("hostage");
    let (mut receive_tls, source_tls) = tls_args(&ca, "127.0.0.1");
    receive_tls.extend(["--handshake-timeout-ms".into(), handshake_ms.to_string()]);
    let destination = Receiver::start("tcp:127.0.0.1:0", &receive_tls);
    let held = silent(&destination.address, silent_first);
    let mut args = vec!["--migrate-to", &destination.address];
    args.extend(source_tls.iter().map(String::as_str));
    let start = Instant::now();
    let source = source(&args).wait_with_output().unwrap();
    let took = start.elapsed();
    assert!(source.status.success(), "{}", text(&source.stderr));
    let (out, lines) = destination.finish();
    let out = Output {
        stderr: lines.join("\n").into_bytes(),
        ..out
    };
    assert_guest_checked(&out, "a TLS source behind silent connections");
    drop(held);
    (took, lines)
}

#[test]
fn a_hundred_silent_connections_hold_up_no_tls_source_and_each_is_dropped_and_logged() {
    let test = "a_hundred_silent_connections_hold_up_no_tls_source_and_each_is_dropped_and_logged";
    if !kvm_available(test) {
        return;
    }
    // The listener alone: each silent connection dropped at its deadline,
    // logged with its address, and what it held given back.
    let (ca, _) = test_support::certs::cas("silent");
    let (mut receive_tls, _) = tls_args(&ca, "127.0.0.1");
    receive_tls.extend(["--handshake-timeout-ms".into(), "1500".into()]);
    let destination = Receiver::start("tcp:127.0.0.1:0", &receive_tls);
    let (fds_before, rss_before) = destination.footprint();
    let held = silent(&destination.address, 100);
    thread::sleep(Duration::from_millis(500));
    let (fds_held, rss_held) = destination.footprint();
    let (dropped, _) = destination.wait_for(100, Duration::from_secs(20), |l| {
        l.ends_with(": no handshake and stream header within 1500 ms")
    });
    for conn in &held {
        let peer = format!("dropped tcp:{}:", conn.local_addr().unwrap());
        assert!(dropped.iter().any(|l| l.starts_with(&peer)), "{peer}");
    }
    thread::sleep(Duration::from_millis(100));
    let (fds_after, _) = destination.footprint();
    eprintln!(
        "fds {fds_before} -> {fds_held} with 100 silent connections -> {fds_after}; \
         RSS {rss_before} -> {rss_held} KiB"
    );
    // Two descriptors a connection in handshake (its socket, and what
    // cuts it), none once dropped; a few MiB of stacks at most.
    assert!(fds_held <= fds_before + 2 * 100, "{fds_held} fds");
    assert!(fds_after <= fds_before, "{fds_after} fds after the drops");
    assert!(rss_held <= rss_before + 32 * 1024, "{rss_held} KiB");
    drop(destination);
    // A legitimate source behind 100 silent connections, against one alone.
    let (alone, _) = move_in_tls(0, 5000);
    let (behind, lines) = move_in_tls(100, 5000);
    eprintln!("a TLS source alone {alone:?}, behind 100 silent connections {behind:?}");
    assert!(behind <= alone * 2, "{behind:?} against {alone:?} alone");
    let dropped = lines
        .iter()
        .filter(|l| l.starts_with("dropped tcp:127.0.0.1:"))
        .count();
    assert_eq!(dropped, 100, "{lines:?}");
}

#[test]
fn a_destination_waits_for_a_late_source_as_long_as_asked_and_no_longer() {
    let test = "a_destination_waits_for_a_late_source_as_long_as_asked_and_no_longer";
    if !kvm_available(test) {
        return;
    }
    // Nobody comes.
    let out = vmm()
        .args(["receive", "--listen", "tcp:127.0.0.1:0", "--insecure"])
        .args(["--wait-ms", "300"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("no source began its stream within 300 ms"),
        "{stderr}"
    );
    // A source that connects at once and sends its first record 3 s in,
    // to a destination that waits 1 s: the destination gives up, and the
    // source's guest runs on there.
    let destination = Receiver::start(
        "tcp:127.0.0.1:0",
        &["--insecure".into(), "--wait-ms".into(), "1000".into()],
    );
    let late = source(&[
        "--migrate-to",
        &destination.address,
        "--insecure",
        "--migrate-after-ms",
        "3000",
    ]);
    let (gave_up, lines) = destination.finish();
    assert_eq!(gave_up.status.code(), Some(1), "{lines:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.contains("no source began its stream within 1000 ms")),
        "{lines:?}"
    );
    let out = late.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stderr).contains("the guest ran on here"));
    assert_eq!(text(&out.stdout).matches("pages_checked = 256").count(), 2);
    // One that waits: the source sends its first record 40 s in, over
    // plain TCP and over a Unix socket (the two at once).
    let waiting = [
        Receiver::start("tcp:127.0.0.1:0", &["--insecure".into()]),
        Receiver::start(&socket("late").to_string(), &[]),
    ];
    let sources: Vec<Child> = waiting
        .iter()
        .map(|d| {
            let mut args = vec!["--migrate-to", &d.address, "--migrate-after-ms", "40000"];
            if d.address.starts_with("tcp:") {
                args.push("--insecure");
            }
            source(&args)
        })
        .collect();
    for (destination, source) in waiting.into_iter().zip(sources) {
        let out = source.wait_with_output().unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert!(text(&out.stdout).contains("then handed over"));
        let (out, lines) = destination.finish();
        let out = Output {
            stderr: lines.join("\n").into_bytes(),
            ..out
        };
        assert_guest_checked(&out, "a source 40 s late");
    }
}

/// A destination on a Unix socket that takes its source, reads nothing more
/// or (`read_all`) the whole stream, and then neither reads nor answers
/// until released.
fn fake_destination(
    name: &str,
    read_all: bool,
) -> (String, mpsc::Sender<()>, thread::JoinHandle<()>) {
    let listener = socket(name).listen().unwrap();
    let address = listener.address().unwrap().to_string();
    let (release, held) = mpsc::channel();
    let fake = thread::spawn(move || {
        let mut input = listener.accept().unwrap();
        if read_all {
            input.config().unwrap();
            while !matches!(input.next_record(), Ok(Record::End) | Err(_)) {}
        }
        // Neither reads on nor answers, until released.
        let _ = held.recv();
        drop(input);
    });
    (address, release, fake)
}

#[test]
fn sigterm_ends_a_source_blocked_on_a_destination_that_never_reads_within_a_second() {
    let test = "sigterm_ends_a_source_blocked_on_a_destination_that_never_reads_within_a_second";
    if !kvm_available(test) {
        return;
    }
    let (address, release, fake) = fake_destination("never-reads", false);
    let mut source = source(&["--migrate-to", &address]);
    // The stream (some 2 MB) fills the socket's buffers within this.
    thread::sleep(Duration::from_millis(1500));
    assert!(source.try_wait().unwrap().is_none(), "the source ended");
    // SAFETY: kill(2) of the child this test spawned, still running.
    assert_eq!(unsafe { libc::kill(source.id() as i32, libc::SIGTERM) }, 0);
    let signalled = Instant::now();
    let status = loop {
        if let Some(status) = source.try_wait().unwrap() {
            break status;
        }
        assert!(signalled.elapsed() < Duration::from_secs(30), "no exit");
        thread::sleep(Duration::from_millis(5));
    };
    let took = signalled.elapsed();
    let out = source.wait_with_output().unwrap();
    let stderr = text(&out.stderr);
    eprintln!("the source exited {took:?} after SIGTERM");
    assert_eq!(status.code(), Some(128 + libc::SIGTERM), "{stderr}");
    assert!(
        stderr.contains("migration failed: the run was stopped")
            && stderr.contains("terminated (SIGTERM)"),
        "{stderr}"
    );
    assert!(took <= Duration::from_secs(1), "{took:?}");
    release.send(()).unwrap();
    fake.join().unwrap();
}

#[test]
fn a_migration_blocked_on_its_destination_ends_with_the_guest() {
    let test = "a_migration_blocked_on_its_destination_ends_with_the_guest";
    if !kvm_available(test) {
        return;
    }
    // A guest that runs 1 s whatever the move does, moved 50 ms in to a
    // destination that never reads: the source ends with its guest, not
    // with a limit of the migration's (30 s a write, 300 s the move).
    let (address, release, fake) = fake_destination("guest-ends", false);
    let mut params = migrate_params();
    params[1] *= 2;
    params[4] = 0;
    let params = params.map(|p| p.to_string()).join(",");
    let start = Instant::now();
    let out = run_migrate(&params)
        .args(["--migrate-to", &address, "--migrate-after-ms", "50"])
        .output()
        .unwrap();
    let took = start.elapsed();
    release.send(()).unwrap();
    fake.join().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    eprintln!("the source exited {took:?} after it started");
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("migration failed: cannot pause the guest: vCPU")
            && stderr.contains("is no longer running (its program ended or failed)"),
        "{stderr}"
    );
    assert_eq!(stdout.matches("pages_checked = 256").count(), 2, "{stdout}");
    assert!(took < Duration::from_secs(10), "{took:?}: {stderr}");
}

#[test]
fn a_destination_that_never_answers_holds_the_guest_no_longer_than_the_limits() {
    let test = "a_destination_that_never_answers_holds_the_guest_no_longer_than_the_limits";
    if !kvm_available(test) {
        return;
    }
    let (address, release, fake) = fake_destination("never-answers", true);
    // No dirty limit: its pauses before the hand-over's would add to the
    // guest's stall.
    let out = source(&[
        "--migrate-to",
        &address,
        "--downtime-ms",
        "20",
        "--no-dirty-limit",
    ])
    .wait_with_output()
    .unwrap();
    release.send(()).unwrap();
    fake.join().unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let limit = Duration::from_millis(20) + HANDOVER_MARGIN;
    assert!(
        stderr.contains(&format!(
            "the destination did not answer within {} ms of the pause (the 20 ms downtime \
             limit and the {} ms hand-over margin); the guest ran on here",
            limit.as_millis(),
            HANDOVER_MARGIN.as_millis()
        )),
        "{stderr}"
    );
    // The guest ran on here, and saw the pause as its longest stall: the
    // limit, and the vCPUs' own park and resume (scheduled on a host that
    // may be busy).
    assert_eq!(stdout.matches("pages_checked = 256").count(), 2, "{stdout}");
    let ticks_per_ms = lapic_timer::TscClock::shared().tsc_khz();
    for stall in stdout.split("max_stall_ticks = ").skip(1) {
        let ticks: u64 = stall.split([',', ' ']).next().unwrap().parse().unwrap();
        let ms = ticks / ticks_per_ms;
        eprintln!(
            "longest stall {ms} ms against the {} ms limit",
            limit.as_millis()
        );
        assert!(ms >= 20, "the guest was never paused: {stdout}");
        assert!(
            Duration::from_millis(ms) <= limit + Duration::from_millis(250),
            "{ms} ms: {stdout}"
        );
    }
}

/// What a hand-over proxy loses on the way.
#[derive(Clone, Copy, Debug)]
enum Lose {
    /// The source's COMMIT.
    Commit,
    /// The destination's RUNNING.
    Running,
}

/// Forwards a source at `listen` to the destination at `to`, both ways,
/// and cuts both once the destination's READY has passed and `lose` comes.
fn handover_proxy(listen: &Address, to: &str, lose: Lose) -> thread::JoinHandle<()> {
    let Address::Unix(path) = listen else {
        panic!("a unix: address")
    };
    let listener = UnixListener::bind(path).unwrap();
    let (path, to) = (path.clone(), to.strip_prefix("unix:").unwrap().to_owned());
    thread::spawn(move || {
        let (from_source, _) = listener.accept().unwrap();
        let _ = std::fs::remove_file(path);
        let to_destination = UnixStream::connect(to).unwrap();
        let ready_passed = Arc::new(AtomicBool::new(false));
        let sockets = [
            from_source.try_clone().unwrap(),
            to_destination.try_clone().unwrap(),
        ];
        let sockets = Arc::new(sockets);
        let cut = move |sockets: &[UnixStream; 2]| {
            for s in sockets {
                let _ = s.shutdown(std::net::Shutdown::Both);
            }
        };
        let answers = {
            let (mut from, mut to) = (
                to_destination.try_clone().unwrap(),
                from_source.try_clone().unwrap(),
            );
            let (ready_passed, sockets) = (ready_passed.clone(), sockets.clone());
            thread::spawn(move || {
                // TAKEN, then READY; RUNNING after them.
                let mut byte = [0u8];
                for seen in 1.. {
                    if from.read_exact(&mut byte).is_err() {
                        return;
                    }
                    if seen == 3 && matches!(lose, Lose::Running) {
                        return cut(&sockets);
                    }
                    if seen == 2 {
                        ready_passed.store(true, SeqCst);
                    }
                    if to.write_all(&byte).is_err() {
                        return;
                    }
                }
            })
        };
        let (mut from, mut to) = (from_source, to_destination);
        let mut buf = vec![0u8; 1 << 16];
        while let Ok(n @ 1..) = from.read(&mut buf) {
            // After READY only the COMMIT comes from the source.
            if ready_passed.load(SeqCst) && matches!(lose, Lose::Commit) {
                cut(&sockets);
                break;
            }
            if to.write_all(&buf[..n]).is_err() {
                break;
            }
        }
        let _ = answers.join();
    })
}

#[test]
fn a_hand_over_whose_last_message_is_lost_runs_the_guest_once_or_reports_it_lost() {
    let test = "a_hand_over_whose_last_message_is_lost_runs_the_guest_once_or_reports_it_lost";
    if !kvm_available(test) {
        return;
    }
    for lose in [Lose::Commit, Lose::Running] {
        let destination = Receiver::start(&socket(&format!("lost-{lose:?}")).to_string(), &[]);
        let proxy_at = socket(&format!("proxy-{lose:?}"));
        let proxy = handover_proxy(&proxy_at, &destination.address, lose);
        let source = source(&["--migrate-to", &proxy_at.to_string()])
            .wait_with_output()
            .unwrap();
        proxy.join().unwrap();
        let (there, lines) = destination.finish();
        let (stdout, stderr) = (text(&source.stdout), text(&source.stderr));
        // The source committed: it never runs the guest again, and says
        // where it may be.
        assert_eq!(source.status.code(), Some(1), "{lose:?}: {stderr}");
        assert!(
            stderr.contains("the hand-over was committed")
                && stderr.contains("it no longer runs here"),
            "{lose:?}: {stderr}"
        );
        assert!(
            stdout.contains("then handed over") && !stdout.contains("pages_checked"),
            "{lose:?}: the guest ran on at the source: {stdout}"
        );
        match lose {
            // The destination never had the commit: its VM never ran.
            Lose::Commit => {
                assert_eq!(there.status.code(), Some(1), "{lines:?}");
                assert!(
                    lines
                        .iter()
                        .any(|l| l.contains("the source did not commit the hand-over")),
                    "{lines:?}"
                );
                assert!(there.stdout.is_empty(), "the guest ran at the destination");
            }
            // It had: the guest runs there, and there only.
            Lose::Running => {
                let there = Output {
                    stderr: lines.join("\n").into_bytes(),
                    ..there
                };
                assert_guest_checked(&there, "RUNNING lost");
            }
        }
    }
}
