//! Shared by the integration tests: skip, loudly, where the machine has no usable KVM.

use std::fs::OpenOptions;
use std::io::Write;

/// Whether `/dev/kvm` can be used; if not, [`skip`]s (`.ci/run` prints the log).
pub fn kvm_available(test: &str) -> bool {
    match kvm_ioctls::Kvm::new() {
        Ok(_) => true,
        Err(e) => skip(test, &format!("cannot open /dev/kvm ({e})")),
    }
}

/// Says on stderr that `test` skips and why, and appends `<test>: <reason>`
/// to the file named by `SKIPPED_TESTS_LOG`; returns false.
pub fn skip(test: &str, reason: &str) -> bool {
    eprintln!("SKIPPED {test}: {reason}");
    if let Some(path) = std::env::var_os("SKIPPED_TESTS_LOG") {
        if let Ok(mut log) = OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(log, "{}::{test}: {reason}", env!("CARGO_PKG_NAME"));
        }
    }
    false
}
