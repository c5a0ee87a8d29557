//! Whether a test can use `/dev/kvm`: where it cannot, the test fails, or,
//! with [`ALLOW_NO_KVM`] set to 1, skips and says so ([`skip`]); `.ci/run`
//! prints the log of skips.

use std::fs::OpenOptions;
use std::io::Write;

/// Set to 1, it lets the tests that need `/dev/kvm` skip, saying so,
/// where it cannot be opened; without it they fail there.
pub const ALLOW_NO_KVM: &str = "VM_LATENCY_ALLOW_NO_KVM";

/// Whether `/dev/kvm` opens read-write, for `test` of `package`: where it
/// does not, panics, or with [`ALLOW_NO_KVM`] set, [`skip`]s.
pub fn available(package: &str, test: &str) -> bool {
    match OpenOptions::new().read(true).write(true).open("/dev/kvm") {
        Ok(_) => true,
        Err(e) if std::env::var_os(ALLOW_NO_KVM).is_some_and(|v| v == "1") => {
            skip(package, test, &format!("cannot open /dev/kvm ({e})"))
        }
        Err(e) => panic!("cannot open /dev/kvm ({e}); set {ALLOW_NO_KVM}=1 to skip the KVM tests"),
    }
}

/// Says on stderr that `test` skips and why, and appends
/// `<package>::<test>: <reason>` to the file named by `SKIPPED_TESTS_LOG`;
/// returns false.
pub fn skip(package: &str, test: &str, reason: &str) -> bool {
    eprintln!("SKIPPED {test}: {reason}");
    if let Some(path) = std::env::var_os("SKIPPED_TESTS_LOG") {
        if let Ok(mut log) = OpenOptions::new().create(true).append(true).open(path) {
            let _ = writeln!(log, "{package}::{test}: {reason}");
        }
    }
    false
}
