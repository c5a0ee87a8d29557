//! The `reference-bench` command line, as a user runs it.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;
#[path = "../../reference-vmm/tests/hidden_dev/mod.rs"]
mod hidden_dev;

use std::process::{Command, Output};

use common::{kvm_available, skip};
use hidden_dev::{namespace_refused, without_dev};

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reference-bench"))
        .args(args)
        .output()
        .unwrap()
}

/// A Markdown report's paragraphs, list items and table rows, each on one
/// line again (the report wraps its prose).
fn unwrapped(markdown: &str) -> Vec<String> {
    let mut units: Vec<String> = Vec::new();
    let mut open = false;
    for line in markdown.lines() {
        let own = line.starts_with("- ") || line.starts_with('|') || line.starts_with('#');
        match (line.is_empty(), own, open) {
            (true, _, _) => open = false,
            (false, true, _) | (false, false, false) => {
                units.push(line.to_owned());
                open = !own;
            }
            (false, false, true) => {
                let last = units.last_mut().unwrap();
                last.push(' ');
                last.push_str(line);
            }
        }
    }
    units
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn bad_arguments_get_a_clear_error_and_status_2() {
    let cases: [(&[&str], &str); 7] = [
        (&["rcu", "--only", "x"], "--only is for halt, timer, sched"),
        (
            &["halt", "--baseline", "/nonexistent/b.json"],
            "/nonexistent/b.json: No such file",
        ),
        (&["fly"], "invalid value 'fly'"),
        (&[], "<SCENARIO>"),
        (
            &["halt", "--update-benchmarks-md"],
            "--update-benchmarks-md is for `all`",
        ),
        (
            &["all", "--quick", "--update-benchmarks-md"],
            "takes a full run, not --quick",
        ),
        (
            &["sched", "--qemu", "/nonexistent/qemu"],
            "--qemu /nonexistent/qemu: no such file",
        ),
    ];
    for (args, expected) in cases {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn help_explains_every_option() {
    let out = bench(&["--help"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let help = text(&out.stdout);
    for option in [
        "--update-benchmarks-md",
        "--quick",
        "--json",
        "--qemu <PATH>",
        "--out <PATH>",
    ] {
        assert!(help.contains(option), "{option}: {help}");
    }
}

#[test]
fn a_bench_writes_its_report_where_asked_and_leaves_benchmarks_md_alone() {
    if !kvm_available("a_bench_writes_its_report_where_asked_and_leaves_benchmarks_md_alone") {
        return;
    }
    let tracked = concat!(env!("CARGO_MANIFEST_DIR"), "/../../BENCHMARKS.md");
    let before = std::fs::read(tracked).ok();
    let dir = std::env::temp_dir().join(format!("reference-vmm-bench-{}", std::process::id()));
    let path = dir.join("rcu.json");
    let out = bench(&["rcu", "--quick", "--json", "--out", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let written = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(written, text(&out.stdout), "the report is what was printed");
    let tables: serde_json::Value = serde_json::from_str(&written).unwrap();
    let rcu = &tables[0];
    assert!(
        rcu["title"].as_str().unwrap().starts_with("rcu:"),
        "{written}"
    );
    assert_eq!(rcu["rows"][0]["variant"], "rwlock", "{written}");
    let notes = rcu["notes"].as_array().unwrap();
    assert!(
        notes.iter().any(|n| n
            .as_str()
            .unwrap()
            .starts_with("Host: other processes kept")),
        "{written}"
    );
    assert_eq!(std::fs::read(tracked).ok(), before, "BENCHMARKS.md changed");
}

#[test]
fn a_bench_runs_the_qemu_it_is_given() {
    if !kvm_available("a_bench_runs_the_qemu_it_is_given") {
        return;
    }
    // A "QEMU" that fails at once: its peer rows give no result, and the
    // report says why, so the binary given is the one that ran.
    // Its report goes to a temporary folder, never where the main job's does.
    let dir = std::env::temp_dir().join(format!("reference-bench-qemu-{}", std::process::id()));
    let path = dir.join("sched.md");
    let out = bench(&[
        "sched",
        "--quick",
        "--qemu",
        "/bin/false",
        "--out",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report = text(&out.stdout);
    let failed = "QEMU exited with status 1";
    for (apic, how) in [
        (
            "kernel-irqchip=off",
            "rows whose guest halts not run, as a ping-pong",
        ),
        ("kernel-irqchip=on", "no result, not run again"),
    ] {
        assert!(
            unwrapped(&report)
                .iter()
                .any(|line| line.contains(apic) && line.contains(how) && line.contains(failed)),
            "{apic}: {:#?}",
            unwrapped(&report)
        );
    }
    // Run again with one variant, it compares with the first run's figures.
    let only = [
        "sched",
        "--quick",
        "--qemu",
        "/bin/false",
        "--only",
        "none",
        "--out",
    ];
    let again = bench(&[&only[..], &[path.to_str().unwrap()]].concat());
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(again.status.success(), "{}", text(&again.stderr));
    let second = text(&again.stdout);
    let against = format!("## Against {}", dir.join("sched.json").display());
    assert!(second.contains(&against), "{second}");
    assert!(second.contains(" figures compared; "), "{second}");
    assert!(
        second.contains("Run with --only none: only the rows named so ran"),
        "{second}"
    );
    assert!(!second.contains("\nGoal"), "no goals with --only: {second}");
    assert!(
        report.contains("--qemu /bin/false"),
        "the command: {report}"
    );
}

#[test]
fn a_bench_without_its_peers_says_so_in_its_notes() {
    if !kvm_available("a_bench_without_its_peers_says_so_in_its_notes") {
        return;
    }
    // A PATH with the shell the CPU hog runs in, and no QEMU.
    let dir = std::env::temp_dir().join(format!("reference-vmm-no-qemu-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sh = dir.join("sh");
    let _ = std::fs::remove_file(&sh);
    std::os::unix::fs::symlink("/bin/sh", &sh).unwrap();
    let report = dir.join("halt.md");
    let out = Command::new(env!("CARGO_BIN_EXE_reference-bench"))
        .args(["halt", "--quick", "--out", report.to_str().unwrap()])
        .env("PATH", &dir)
        .env_remove("VM_LATENCY_PEERS")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let notes = std::fs::read_to_string(&report).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    // Under the table, and again in the summary at the top.
    let absent = "Not measured: no qemu-system-x86_64 was on PATH when this scenario started";
    let goals = |what: &str| {
        unwrapped(&notes)
            .iter()
            .filter(|l| l.contains(what))
            .count()
    };
    assert_eq!(goals(absent), 2 * 2, "{notes}");
    // One goal against both, under the table and in the summary.
    for peer in [
        "Cloud Hypervisor: no cloud-hypervisor",
        "Firecracker: no firecracker",
    ] {
        let absent = format!("{peer} was found");
        assert_eq!(goals(&absent), 2, "{notes}");
        assert!(notes.contains("VM_LATENCY_PEERS"), "how to get it: {notes}");
    }
    assert!(!notes.contains("was seen to stop"), "{notes}");
}

#[test]
fn bench_all_writes_what_finished_when_a_scenario_fails_and_exits_1() {
    let name = "bench_all_writes_what_finished_when_a_scenario_fails_and_exits_1";
    // Without /dev/kvm the first scenario fails at once.
    let report =
        std::env::temp_dir().join(format!("reference-vmm-partial-{}.md", std::process::id()));
    let out = without_dev(
        env!("CARGO_BIN_EXE_reference-bench").as_ref(),
        &["all", "--quick", "--out", report.to_str().unwrap()],
    )
    .output()
    .unwrap();
    let stderr = text(&out.stderr);
    if namespace_refused(&stderr) {
        skip(name, &format!("cannot hide /dev: {}", stderr.trim()));
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("error: bench halt: cannot open /dev/kvm")
            && stderr.contains("(the report has the scenarios that finished)"),
        "{stderr}"
    );
    let written = std::fs::read_to_string(&report).unwrap();
    std::fs::remove_file(&report).unwrap();
    assert!(
        written.contains("Incomplete: bench halt: cannot open /dev/kvm"),
        "{written}"
    );
}

/// The network namespaces whose names start with `prefix`.
fn namespaces(prefix: &str) -> Vec<String> {
    let dir = std::fs::read_dir("/var/run/netns");
    let names = dir.into_iter().flatten().flatten();
    let names = names.filter_map(|e| e.file_name().into_string().ok());
    names.filter(|n| n.starts_with(prefix)).collect()
}

/// A bench started with `args`, its stderr read until a line contains
/// `wanted` (at most 120 s): the child, the lines so far, and the rest.
struct Started {
    child: std::process::Child,
    seen: Vec<String>,
    rest: std::sync::mpsc::Receiver<String>,
}

fn start_until(args: &[&str], wanted: &str) -> Started {
    use std::io::{BufRead, BufReader};
    let mut child = Command::new(env!("CARGO_BIN_EXE_reference-bench"))
        .args(args)
        .env_remove("VM_LATENCY_PEERS")
        .stderr(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (lines, rest) = std::sync::mpsc::channel();
    let stderr = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = lines.send(line);
        }
    });
    let mut seen = Vec::new();
    while !seen.iter().any(|l: &String| l.contains(wanted)) {
        match rest.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(line) => seen.push(line),
            Err(e) => {
                let _ = child.kill();
                panic!("no {wanted:?} ({e}): {seen:?}");
            }
        }
    }
    Started { child, seen, rest }
}

impl Started {
    /// Sends `signal`; the exit status and every line of stderr.
    fn stop(mut self, signal: i32) -> (Option<i32>, String) {
        // SAFETY: kill(2) on the child this test spawned and has not reaped.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
        let status = self.child.wait().unwrap();
        self.seen.extend(self.rest.iter());
        (status.code(), self.seen.join("\n"))
    }
}

/// Whether `done` holds within 5 s, looking every 100 ms (for what another
/// process does: starting a child, the kernel reaping one).
fn within_5_s(done: impl Fn() -> bool) -> bool {
    for _ in 0..50 {
        if done() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    done()
}

/// The children of process `pid`.
fn children(pid: u32) -> Vec<u32> {
    let path = format!("/proc/{pid}/task/{pid}/children");
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[test]
fn a_signal_mid_migrate_ends_what_the_run_started_and_writes_what_finished() {
    let name = "a_signal_mid_migrate_ends_what_the_run_started_and_writes_what_finished";
    if !kvm_available(name) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("reference-bench-stop-{}", std::process::id()));
    // Ctrl-C to `all` (the ring's rows only, so that it reaches migrate
    // soon), SIGTERM to `migrate`.
    let all = ["all", "--quick", "--only", "ring", "--out"];
    let migrate = ["migrate", "--quick", "--out"];
    for (args, signal, finished) in [
        (&all[..], libc::SIGINT, Some("### halt")),
        (&migrate[..], libc::SIGTERM, None),
    ] {
        let report = dir.join(format!("{}.md", args[0]));
        let args = [args, &[report.to_str().unwrap()]].concat();
        // The first move under way: its namespaces made (where they can be).
        let run = start_until(&args, "] migrate:");
        let pid = run.child.id();
        let prefix = format!("rvmm-{}-", pid % 100_000);
        let made = namespaces(&prefix);
        let (status, stderr) = run.stop(signal);
        let what = reference_bench::stop::name(signal);
        assert_eq!(status, Some(128 + signal), "{stderr}");
        assert!(
            stderr.contains(&format!("stopping on {what}: ended ")),
            "{stderr}"
        );
        assert!(namespaces(&prefix).is_empty(), "left behind, of {made:?}");
        let written = std::fs::read_to_string(&report).unwrap();
        let stopped = format!("Stopped by {what} during migrate after ");
        assert!(written.contains(&stopped), "{written}");
        if let Some(table) = finished {
            assert!(written.contains(table), "what finished: {written}");
        }
        let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
            .unwrap()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.starts_with("rvmm-bench-") && n.contains(&pid.to_string()))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn ctrl_c_ends_the_processes_a_run_started() {
    let name = "ctrl_c_ends_the_processes_a_run_started";
    if !kvm_available(name) {
        return;
    }
    if Command::new("qemu-system-x86_64")
        .arg("--version")
        .output()
        .is_err()
    {
        skip(name, "no qemu-system-x86_64 on PATH to start as a peer");
        return;
    }
    let dir = std::env::temp_dir().join(format!("reference-bench-ctrl-c-{}", std::process::id()));
    let report = dir.join("sched.md");
    let run = start_until(
        &["sched", "--quick", "--out", report.to_str().unwrap()],
        "sched: qemu",
    );
    // QEMU starts after the progress line; give it a moment to appear.
    let pid = run.child.id();
    assert!(within_5_s(|| !children(pid).is_empty()), "no peer started");
    let peers = children(pid);
    let (status, stderr) = run.stop(libc::SIGINT);
    assert_eq!(status, Some(128 + libc::SIGINT), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
    // Killed, then reaped by whoever inherited them.
    let alive = || {
        peers
            .iter()
            .filter(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
            .count()
    };
    assert!(
        within_5_s(|| alive() == 0),
        "{peers:?} outlived the run: {stderr}"
    );
}
