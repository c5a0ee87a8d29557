//! The `reference-vmm` command line, as a user runs it.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::process::{Command, Output};

use common::kvm_available;

fn vmm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_reference-vmm"))
        .args(args)
        .output()
        .unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn bad_arguments_get_a_clear_error_and_status_2() {
    let cases: [(&[&str], &str); 28] = [
        (
            &["conformance", "--seeds", "0"],
            "invalid value '0' for '--seeds <SEEDS>'",
        ),
        (
            &["conformance", "--ops", "5000"],
            "invalid value '5000' for '--ops <OPS>'",
        ),
        (
            &["conformance", "--mode", "x3apic"],
            "invalid value 'x3apic' for '--mode <MODE>'",
        ),
        (&["run"], "--guest or --image is needed"),
        (
            &["run", "--guest", "nope"],
            "no guest program is called \"nope\"; the built-in ones are: hello",
        ),
        (
            &["run", "--guest", "hello", "--max-reports", "0"],
            "0 is not within 1..=16777216",
        ),
        (
            &["run", "--guest", "hello", "--vcpus", "0"],
            "number of vCPUs must be between 1 and 64, not 0",
        ),
        (
            &["run", "--guest", "hello", "--vcpus", "many"],
            "\"many\" is not a number",
        ),
        (
            &["run", "--guest", "hello", "--mem-mib", "33"],
            "even number of MiB between 32 and 3072, not 33",
        ),
        (&["fly"], "unrecognized subcommand 'fly'"),
        (
            &["run", "--guest", "hello", "--halt-poll", "fast"],
            "--halt-poll \"fast\" is not one of: kvm, haltpoll, aio, predictive, off, always, tuned",
        ),
        (
            &["run", "--guest", "hello", "--halt-poll", "tuned"],
            "--halt-poll tuned sets KVM's in-kernel halt-polling window: it needs --irqchip kernel",
        ),
        (
            &["run", "--guest", "hello", "--halt-poll", "budget:0.05"],
            "--halt-poll budget sets KVM's in-kernel halt-polling window: it needs --irqchip kernel",
        ),
        (
            &[
                "run",
                "--guest",
                "hello",
                "--irqchip",
                "kernel",
                "--halt-poll",
                "budget:2",
            ],
            "--halt-poll \"budget:2\" is not one of: kvm, haltpoll, aio, predictive, off, always, \
             tuned, budget:SHARE (of a vCPU, in (0, 1])",
        ),
        (
            &["run", "--guest", "hello", "--timer-advance", "fixed:x"],
            "none, fixed:NS (NS up to 1000000), kvm, percentile",
        ),
        (
            &["run", "--guest", "hello", "--irqchip", "split"],
            "--irqchip \"split\" is not one of: user, kernel",
        ),
        (
            &["run", "--guest", "pingpong", "--params", "1,x"],
            "\"x\" is not a number",
        ),
        (
            &["run", "--guest", "pingpong"],
            "pingpong needs params[0] (rounds) of at least 1, not 0",
        ),
        (
            &["run", "--guest", "spin"],
            "spin runs until it is stopped: give it a timeout (--timeout-ms)",
        ),
        (
            &[
                "run",
                "--guest",
                "hello",
                "--irqchip",
                "kernel",
                "--timer-advance",
                "kvm",
            ],
            "--timer-advance has nothing to act on",
        ),
        (
            &[
                "run",
                "--guest",
                "hello",
                "--irqchip",
                "kernel",
                "--guest-poll",
            ],
            "--guest-poll has nothing to act on",
        ),
        (
            &[
                "run",
                "--guest",
                "hello",
                "--irqchip",
                "kernel",
                "--halt-poll",
                "predictive",
            ],
            "--halt-poll haltpoll|aio|predictive has nothing to act on",
        ),
        // Guests that cannot run on what they are given: refused before a
        // vCPU starts, where they would hang or fault.
        (
            &["run", "--guest", "pingpong", "--params", "100"],
            "guest program pingpong needs at least 2 vCPUs, not 1 (--vcpus)",
        ),
        (
            &["run", "--guest", "halt-wake", "--params", "100"],
            "guest program halt-wake needs at least 2 vCPUs, not 1",
        ),
        (
            &[
                "run",
                "--guest",
                "migrate",
                "--vcpus",
                "2",
                "--params",
                "4096,1,0,0",
            ],
            "guest program migrate needs 66 MiB of guest memory for its parameters, not 64",
        ),
        (
            &[
                "image",
                "--guest",
                "cyclictest",
                "--params",
                "8000000",
                "--out",
                "/dev/null",
            ],
            "guest program cyclictest needs 80 MiB of guest memory for its parameters, not 64",
        ),
        (
            &[
                "run",
                "--guest",
                "migrate",
                "--vcpus",
                "2",
                "--params",
                "16,1,0,0,1",
            ],
            "migrate's parameters make it wait for a migration to end: give it one",
        ),
        (
            &[
                "image",
                "--guest",
                "yield-spin",
                "--params",
                "1,1",
                "--out",
                "/dev/null",
            ],
            "guest program yield-spin needs at least 2 vCPUs, not 1",
        ),
    ];
    for (args, expected) in cases {
        let out = vmm(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn help_explains_itself_and_every_subcommand() {
    for (args, expected) in [
        (&["help"][..], "Usage: reference-vmm <COMMAND>"),
        (&["help", "--help"], "Usage: reference-vmm help [COMMAND]"),
        (&["help", "run"], "--image <PATH>"),
        (
            &["help", "image"],
            "Usage: reference-vmm image [OPTIONS] --out <PATH>",
        ),
    ] {
        let out = vmm(args);
        assert!(out.status.success(), "{args:?}: {}", text(&out.stderr));
        assert!(
            text(&out.stdout).contains(expected),
            "{args:?}: {}",
            text(&out.stdout)
        );
    }
}

#[test]
fn guests_lists_every_program() {
    let out = vmm(&["guests"]);
    assert!(out.status.success());
    for p in test_guests::programs::PROGRAMS {
        assert!(text(&out.stdout).contains(p.name), "{}", p.name);
    }
}

#[test]
fn run_prints_serial_output_and_the_report() {
    if !kvm_available("run_prints_serial_output_and_the_report") {
        return;
    }
    let out = vmm(&[
        "run",
        "--guest",
        "hello",
        "--vcpus",
        "2",
        "--timeout-ms",
        "60000",
    ]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", text(&out.stderr));
    assert!(
        stdout.contains("hello from vcpu 0\n") && stdout.contains("hello from vcpu 1\n"),
        "{stdout}"
    );
    assert!(
        stdout.contains("vcpu 1: ") && stdout.contains("apic_id = 1"),
        "{stdout}"
    );
}

#[test]
fn a_guest_reports_at_most_max_reports_values_per_vcpu() {
    if !kvm_available("a_guest_reports_at_most_max_reports_values_per_vcpu") {
        return;
    }
    // hello reports two values per vCPU (its APIC id and the TSC).
    let run = |max: &str| {
        vmm(&[
            "run",
            "--guest",
            "hello",
            "--timeout-ms",
            "60000",
            "--max-reports",
            max,
        ])
    };
    let out = run("2");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = run("1");
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("error: vCPU 0: more than 1 reports from one vCPU")
            && stderr.contains("`run --max-reports N` lifts the cap"),
        "{stderr}"
    );
}

#[test]
fn serial_output_can_go_to_a_file() {
    if !kvm_available("serial_output_can_go_to_a_file") {
        return;
    }
    let path =
        std::env::temp_dir().join(format!("reference-vmm-serial-{}.txt", std::process::id()));
    let out = vmm(&[
        "run",
        "--guest",
        "hello",
        "--serial-out",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let serial = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(serial, "hello from vcpu 0\n");
    assert!(!text(&out.stdout).contains("hello from vcpu"));
}

#[test]
fn guest_errors_exit_1_with_the_vcpu_exit_and_registers() {
    if !kvm_available("guest_errors_exit_1_with_the_vcpu_exit_and_registers") {
        return;
    }
    let out = vmm(&[
        "run",
        "--guest",
        "bad-port",
        "--vcpus",
        "2",
        "--timeout-ms",
        "60000",
    ]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert!(
        stderr.starts_with("error: vCPU 0: port write of 1 byte(s) at port 0x1234"),
        "{stderr}"
    );
    assert!(
        stderr.contains("rip 0x") && stderr.contains("rflags"),
        "{stderr}"
    );
}

#[test]
fn conformance_reports_agreement_or_a_summary_of_differences() {
    if !kvm_available("conformance_reports_agreement_or_a_summary_of_differences") {
        return;
    }
    let out = vmm(&["conformance", "--seeds", "16", "--first-seed", "100"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    for mode in ["X2apic", "Xapic"] {
        let line = format!(
            "{mode}: seeds 100..116, 48 operations each: this VMM's APIC answered as KVM's"
        );
        assert!(stdout.contains(&line), "{stdout}");
    }
    // --summary runs every seed and lists what differed: here, nothing.
    let out = vmm(&[
        "conformance",
        "--seeds",
        "8",
        "--mode",
        "xapic",
        "--summary",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "");
}

#[test]
fn a_cpu_baseline_of_hosts_limits_the_guest_and_names_what_this_host_lacks() {
    if !kvm_available("a_cpu_baseline_of_hosts_limits_the_guest_and_names_what_this_host_lacks") {
        return;
    }
    let out = vmm(&["cpu-features"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let host = text(&out.stdout);
    assert_eq!(host.lines().count(), 10, "{host}");
    let dir = std::env::temp_dir();
    let file = |name: &str, body: &str| {
        let path = dir.join(format!("rvmm-{}-{name}.cpu", std::process::id()));
        std::fs::write(&path, body).unwrap();
        path.to_string_lossy().into_owned()
    };
    let this = file("this", &host);
    // Another host with one feature more, and one with a feature less.
    let with = |word: &str, value: &str| -> String {
        host.lines()
            .map(|l| match l.starts_with(word) {
                true => format!("{word} {value}\n"),
                false => format!("{l}\n"),
            })
            .collect()
    };
    let more = file("more", &with("0x80000001 0 edx", "0xffffffff"));
    let fewer = file("fewer", &with("0x1 0 ecx", "0x0"));
    let run = |baselines: &[&str]| {
        let mut args = vec!["run", "--guest", "hello"];
        for b in baselines {
            args.extend(["--cpu-baseline", b]);
        }
        vmm(&args)
    };
    assert!(run(&[&this]).status.success());
    assert!(run(&[&this, &fewer]).status.success(), "the intersection");
    let out = run(&[&more]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("this host's CPU lacks what the guest was given"),
        "{}",
        text(&out.stderr)
    );
    let bad = file("bad", "0x7 0 ebx\n");
    let out = run(&[&bad]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("want `leaf subleaf register value`"),
        "{}",
        text(&out.stderr)
    );
    for f in [this, more, fewer, bad] {
        std::fs::remove_file(f).unwrap();
    }
}

#[test]
fn conformance_records_kvms_answers_for_a_fuzz_corpus() {
    if !kvm_available("conformance_records_kvms_answers_for_a_fuzz_corpus") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("rvmm-corpus-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    // A read of the version register (x2APIC MSR 0x803, a #GP in xAPIC
    // mode), and a read of the version at the page's offset 0x30.
    std::fs::write(dir.join("b-msr"), [1u8, 3, 0, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    std::fs::write(dir.join("a-page"), [2u8, 0, 0x30, 0, 0, 0, 0, 0, 0, 0]).unwrap();
    let out = vmm(&["conformance", "--record-fuzz-corpus", dir.to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let answers = apic_conformance::fuzz_corpus::parse(&text(&out.stdout)).unwrap();
    let names: Vec<&String> = answers.by_input.keys().collect();
    assert_eq!(answers.by_input.len(), 2, "{names:?}");
    assert_eq!(
        answers.by_input["b-msr"][0],
        test_guests::apic_script::Outcome::Faulted
    );
    let version = answers.by_input["a-page"][0];
    assert!(
        matches!(version, test_guests::apic_script::Outcome::Done(v) if v & 0xFF == 0x14),
        "{version:?}"
    );
    assert!(
        text(&out.stdout).find("a-page") < text(&out.stdout).find("b-msr"),
        "sorted"
    );
    let missing = vmm(&["conformance", "--record-fuzz-corpus", "/nonexistent/corpus"]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(
        text(&missing.stderr).contains("cannot read the corpus"),
        "{}",
        text(&missing.stderr)
    );
    std::fs::remove_dir_all(dir).unwrap();
}
