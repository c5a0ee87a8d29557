//! Stopping a run early. On SIGINT (Ctrl-C) or SIGTERM the bench ends what
//! it started, its child processes (guests, peer VMMs, CPU hogs) and the
//! network namespaces and temporary files named after its pid, then hands
//! over to the caller, which writes the report of the scenarios that
//! finished and exits with 128 + the signal.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// The signals that stop a run.
pub const STOP_SIGNALS: [i32; 2] = [SIGINT, SIGTERM];

/// Runs `stop` on a thread of its own at the first SIGINT or SIGTERM, with
/// the signal, after [`end_what_was_started`]. A second one ends the process
/// at once (status 128 + the signal), should the first's report hang (on a
/// stdout nobody reads, say).
pub fn on_stop(stop: impl FnOnce(i32) + Send + 'static) -> io::Result<()> {
    let stopping = Arc::new(AtomicBool::new(false));
    for signal in STOP_SIGNALS {
        signal_hook::flag::register_conditional_shutdown(signal, 128 + signal, stopping.clone())?;
    }
    let mut signals = Signals::new(STOP_SIGNALS)?;
    std::thread::Builder::new()
        .name("stop".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                stopping.store(true, Ordering::SeqCst);
                eprintln!("\nstopping on {}: {}", name(signal), end_what_was_started());
                stop(signal);
            }
        })?;
    Ok(())
}

/// The signal's name.
pub fn name(signal: i32) -> &'static str {
    match signal {
        SIGINT => "SIGINT",
        SIGTERM => "SIGTERM",
        _ => "a signal",
    }
}

/// Kills this process's descendants and removes the namespaces and
/// temporary files named after its pid; says what it did.
pub fn end_what_was_started() -> String {
    let killed = kill_descendants(std::process::id());
    let namespaces = test_support::hosts::remove_all_of_this_process();
    let files = remove_temporary_files(&std::env::temp_dir(), std::process::id());
    format!(
        "ended {killed} child processes, removed {} network namespaces and {files} temporary files",
        namespaces.len()
    )
}

/// The children of each process, from `/proc/*/stat`: `(pid, parent)`.
fn parents() -> Vec<(u32, u32)> {
    let Ok(proc) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    proc.flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // The command may hold spaces and parentheses; the parent is
            // the second field after its closing one.
            let after = &stat[stat.rfind(')')? + 1..];
            let parent = after.split_whitespace().nth(1)?.parse().ok()?;
            Some((pid, parent))
        })
        .collect()
}

/// Every descendant of `root` in `tree` (`(pid, parent)` pairs).
fn descendants(tree: &[(u32, u32)], root: u32) -> Vec<u32> {
    let mut found = vec![root];
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        found.extend(tree.iter().filter(|(_, p)| *p == parent).map(|(c, _)| *c));
        i += 1;
    }
    found.remove(0);
    found
}

/// SIGKILLs every descendant of `root`; how many.
fn kill_descendants(root: u32) -> usize {
    let all = descendants(&parents(), root);
    all.iter()
        .filter(|&&pid| {
            let pid = libc::pid_t::try_from(pid).unwrap_or(0);
            // SAFETY: kill(2) on a pid read from /proc; a process gone
            // meanwhile makes it fail with ESRCH, nothing else.
            pid > 0 && unsafe { libc::kill(pid, libc::SIGKILL) } == 0
        })
        .count()
}

/// Whether `name`, in the temporary folder, is one the bench or the VMM
/// names after process `pid` (`rb-chi-1234.sock`, `rvmm-tls-1234-ca`).
fn named_after(name: &str, pid: u32) -> bool {
    const PREFIXES: [&str; 4] = ["rb-", "rvmm-", "reference-", "test-support-"];
    let pid = pid.to_string();
    PREFIXES.iter().any(|p| name.starts_with(p))
        && name
            .split(|c: char| !c.is_ascii_digit())
            .any(|part| part == pid)
}

/// Removes the entries of `dir` named after `pid`; how many.
fn remove_temporary_files(dir: &Path, pid: u32) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| named_after(n, pid)))
        .filter(|e| match e.file_type().is_ok_and(|t| t.is_dir()) {
            true => std::fs::remove_dir_all(e.path()).is_ok(),
            false => std::fs::remove_file(e.path()).is_ok(),
        })
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descendants_are_found_through_every_generation() {
        let tree = [(10, 1), (11, 10), (12, 11), (13, 10), (20, 1), (21, 20)];
        let mut found = descendants(&tree, 10);
        found.sort_unstable();
        assert_eq!(found, [11, 12, 13]);
        assert!(descendants(&tree, 12).is_empty());
    }

    #[test]
    fn this_process_is_its_parents_child() {
        let tree = parents();
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        assert!(tree.contains(&(me, parent)), "{me} of {parent}");
    }

    #[test]
    fn only_the_files_named_after_the_pid_are_removed() {
        assert!(named_after("rb-chi-1234.sock", 1234));
        assert!(named_after("rvmm-tls-1234-ca", 1234));
        assert!(named_after("reference-vmm-bench-1234-0-halt.elf", 1234));
        assert!(!named_after("rb-chi-12345.sock", 1234));
        assert!(!named_after("other-1234.sock", 1234));
        let dir = std::env::temp_dir().join(format!("stop-test-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("rb-snap-77-full")).unwrap();
        std::fs::write(dir.join("rb-snap-77-full/memory"), b"x").unwrap();
        std::fs::write(dir.join("rb-chi-77.sock"), b"").unwrap();
        std::fs::write(dir.join("rb-chi-770.sock"), b"").unwrap();
        assert_eq!(remove_temporary_files(&dir, 77), 2);
        let left: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(left, ["rb-chi-770.sock"]);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
