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

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn bad_arguments_get_a_clear_error_and_status_2() {
    let cases: [(&[&str], &str); 5] = [
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
    let out = bench(&["sched", "--quick", "--qemu", "/bin/false", "--out", path.to_str().unwrap()]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let report = text(&out.stdout);
    for apic in ["kernel-irqchip=off", "kernel-irqchip=on"] {
        let failed = "no result, not run again: QEMU exited with status 1";
        assert!(
            report
                .lines()
                .any(|line| line.contains(apic) && line.contains(failed)),
            "{apic}: {report}"
        );
    }
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
    let goals = |what: &str| notes.lines().filter(|l| l.contains(what)).count();
    assert_eq!(goals(absent), 2 * 2, "{notes}");
    for peer in ["cloud-hypervisor", "firecracker"] {
        let absent = format!("Not measured: no {peer} was found");
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
