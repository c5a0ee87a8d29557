//! Post-copy between two `reference-vmm` processes as a user runs them:
//! `run --postcopy` to `receive`, with and without `--migrate-resume` and
//! `--resume`; and a destination killed in the middle of post-copy, which
//! leaves its source saying the guest is lost, never running it again.
//! Each test skips, saying so, where `userfaultfd(2)` is refused.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::process::{Child, Output, Stdio};
use std::time::Duration;

use cli::*;
use common::kvm_available;
use migration::postcopy::userfaultfd_available;
use test_support::proxy::{LinkProxy, Plan};

fn can_run(test: &str) -> bool {
    kvm_available(test)
        && match userfaultfd_available() {
            Ok(()) => true,
            Err(e) => common::skip(test, &format!("userfaultfd(2) is refused here: {e}")),
        }
}

/// A `receive` on a loopback port the kernel picks, with `extra`.
fn receive(extra: &[&str]) -> Background {
    Background(
        vmm()
            .args(["receive", "--listen", "tcp:127.0.0.1:0", "--insecure"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn two_processes_move_a_guest_in_postcopy_and_each_says_what_it_did() {
    if !can_run("two_processes_move_a_guest_in_postcopy_and_each_says_what_it_did") {
        return;
    }
    for (postcopy, resume) in [("immediate", false), ("hybrid", true)] {
        let mut destination = receive(if resume { &["--resume"] } else { &[] });
        let at = destination.listening_on();
        let mut args = vec!["--migrate-to", &at, "--insecure", "--postcopy", postcopy];
        if resume {
            args.push("--migrate-resume");
        }
        let source = source(&args).wait_with_output().unwrap();
        let stdout = text(&source.stdout);
        assert!(
            source.status.success(),
            "{postcopy}: {stdout}\n{}",
            text(&source.stderr)
        );
        assert!(
            stdout.contains("then handed over") && stdout.contains("; post-copy: "),
            "{postcopy}: {stdout}"
        );
        let destination = destination.output();
        let log = text(&destination.stderr);
        assert!(
            log.contains("post-copy: the guest runs here")
                && log.contains("post-copy: every page here"),
            "{postcopy}: {log}"
        );
        assert_guest_checked(&destination, postcopy);
    }
}

/// A `receive`, and a source moving to it in post-copy at once with
/// `extra` through a proxy that holds the source's stream once the
/// destination has said RUNNING (after TAKEN, MADE, READY): its pages never
/// reach it.
fn held_move(extra: &[&str]) -> (Background, Child, LinkProxy) {
    let mut destination = receive(&[]);
    let at: SocketAddr = destination
        .listening_on()
        .strip_prefix("tcp:")
        .unwrap()
        .parse()
        .unwrap();
    let proxy = LinkProxy::start(at, Plan::HoldAfter { answers: 4 }).unwrap();
    let to = format!("tcp:{}", proxy.address());
    let mut args = vec!["--migrate-to", &to, "--insecure", "--postcopy", "immediate"];
    args.extend(extra);
    (destination, source(&args), proxy)
}

/// Kills the destination of a [`held_move`] once its guest runs there, and
/// returns the source's output.
fn kill_the_destination(extra: &[&str]) -> Output {
    let (mut destination, source, _proxy) = held_move(extra);
    destination.log_line_with("post-copy: the guest runs here", Duration::from_secs(60));
    destination.0.kill().unwrap();
    let _ = destination.0.wait();
    source.wait_with_output().unwrap()
}

#[test]
fn a_destination_killed_in_the_middle_of_postcopy_leaves_the_source_saying_the_guest_is_lost() {
    let test =
        "a_destination_killed_in_the_middle_of_postcopy_leaves_the_source_saying_the_guest_is_lost";
    if !can_run(test) {
        return;
    }
    for extra in [
        &[][..],
        &["--migrate-resume", "--migrate-timeout-ms", "2000"],
    ] {
        let out = kill_the_destination(extra);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{extra:?}: {stdout}\n{stderr}");
        assert!(
            stderr.contains("error: migration: the guest is lost"),
            "{extra:?}: {stderr}"
        );
        // Handed over, and never run again here: no vCPU finished.
        assert!(stdout.contains("then handed over"), "{extra:?}: {stdout}");
        assert!(!stdout.contains("pages_checked"), "{extra:?}: {stdout}");
        if extra.is_empty() {
            assert!(stderr.contains("--migrate-resume"), "{stderr}");
        } else {
            assert!(
                stderr.contains("could not be reached again within 2000 ms"),
                "{stderr}"
            );
        }
    }
}

/// The source killed once its guest runs at the destination, the rest of
/// its stream held on the way: the destination, its vCPUs waiting on pages
/// that will never come, stops its VM and says the guest is lost.
#[test]
fn a_source_killed_in_the_middle_of_postcopy_leaves_the_destination_saying_the_guest_is_lost() {
    let test =
        "a_source_killed_in_the_middle_of_postcopy_leaves_the_destination_saying_the_guest_is_lost";
    if !can_run(test) {
        return;
    }
    let (mut destination, mut source, proxy) = held_move(&[]);
    let stderr = destination.0.stderr.take().unwrap();
    let (tx, lines) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stderr)).map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let runs_here = |line: &String| line.contains("post-copy: the guest runs here");
    while !lines
        .recv_timeout(Duration::from_secs(60))
        .map(|l| runs_here(&l))
        .unwrap()
    {}
    source.kill().unwrap();
    let _ = source.wait();
    let status = destination.0.wait().unwrap();
    // The reader thread may still be on the last lines: up to its EOF.
    let log: Vec<String> =
        std::iter::from_fn(|| lines.recv_timeout(Duration::from_secs(10)).ok()).collect();
    assert_eq!(status.code(), Some(1), "{log:?}");
    assert!(
        log.iter()
            .any(|l| l.contains("post-copy: the guest is lost: the source went away")),
        "{log:?}"
    );
    drop(proxy);
}
