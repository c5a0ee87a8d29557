//! Every worked example in the README (its `sh` blocks), run as written
//! with the binary on `PATH`: each moves, restores or drives a `migrate`
//! guest that checks all its pages at the end.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::kvm_available;

/// How long one example may take (each takes a few seconds).
const LIMIT: Duration = Duration::from_secs(120);

/// The README's `sh` blocks, in order.
fn examples() -> Vec<String> {
    let readme = include_str!("../README.md");
    readme
        .split("```sh\n")
        .skip(1)
        .map(|rest| rest.split("```").next().unwrap_or_default().to_owned())
        .collect()
}

/// Removes what the examples leave in /tmp.
fn clean() {
    for entry in std::fs::read_dir("/tmp").unwrap().flatten() {
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with("rvmm-example.")
        {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Runs `script` with bash (`-e`), in a process group of its own that is
/// killed once it ends, so that nothing it started in the background
/// outlives it; returns its status and output.
fn run(script: &str) -> (bool, String) {
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_reference-vmm"));
    let path = format!(
        "{}:{}",
        bin.parent().unwrap().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let mut child = Command::new("bash")
        .args(["-e", "-c", script])
        .env("PATH", path)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .unwrap();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > LIMIT {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    // SAFETY: kill(2) on the process group the child leads.
    unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (status.is_some_and(|s| s.success()), text)
}

#[test]
fn every_worked_example_in_the_readme_runs_as_written() {
    if !kvm_available("every_worked_example_in_the_readme_runs_as_written") {
        return;
    }
    let examples = examples();
    assert_eq!(
        examples.len(),
        5,
        "migration, post-copy, snapshot, incremental snapshots, control socket"
    );
    for script in examples {
        clean();
        let (ok, output) = run(&script);
        assert!(ok, "{script}\n{output}");
        assert!(
            output.matches("pages_checked = 256").count() >= 2,
            "no guest checked its pages:\n{script}\n{output}"
        );
    }
    clean();
}
