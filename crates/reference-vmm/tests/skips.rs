//! A KVM test where `/dev/kvm` cannot be opened fails, unless the user lets
//! it skip (`VM_LATENCY_ALLOW_NO_KVM=1`), and then it says so: the test
//! below runs this binary's own KVM test again in a mount namespace whose
//! `/dev` is an empty tmpfs.

mod common;
mod hidden_dev;

use std::process::Output;

use common::{kvm_available, skip};
use hidden_dev::{namespace_refused, without_dev};
use reference_vmm::{Vm, VmConfig};
use test_support::kvm::ALLOW_NO_KVM;

const KVM_TEST: &str = "a_guest_runs_on_dev_kvm";

#[test]
fn a_guest_runs_on_dev_kvm() {
    if !kvm_available(KVM_TEST) {
        return;
    }
    let vm = Vm::new(&VmConfig::default()).unwrap();
    let report = vm
        .run(
            test_guests::find("hello").unwrap(),
            Box::new(std::io::sink()),
        )
        .unwrap();
    assert_eq!(report.value(0, "apic_id"), Some(0));
}

/// [`KVM_TEST`] run by this binary with `/dev` hidden, `allow` or not; its
/// own skip log left out (it would list a skip that is this test's doing).
fn without_dev_kvm(allow: bool) -> std::io::Result<Output> {
    let exe = std::env::current_exe()?;
    let mut run = without_dev(&exe, &["--exact", KVM_TEST, "--nocapture"]);
    run.env_remove("SKIPPED_TESTS_LOG").env_remove(ALLOW_NO_KVM);
    if allow {
        run.env(ALLOW_NO_KVM, "1");
    }
    run.output()
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn without_dev_kvm_a_kvm_test_fails_unless_the_user_lets_it_skip() {
    let name = "without_dev_kvm_a_kvm_test_fails_unless_the_user_lets_it_skip";
    // The namespace needs root (CAP_SYS_ADMIN) and util-linux's unshare.
    let failed = match without_dev_kvm(false) {
        Ok(out) if namespace_refused(&text(&out)) => {
            skip(name, &format!("cannot hide /dev: {}", text(&out).trim()));
            return;
        }
        Ok(out) => out,
        Err(e) => {
            skip(name, &format!("cannot run unshare: {e}"));
            return;
        }
    };
    let all = text(&failed);
    assert!(!failed.status.success(), "{all}");
    assert!(
        all.contains("cannot open /dev/kvm") && all.contains("set VM_LATENCY_ALLOW_NO_KVM=1"),
        "{all}"
    );
    let skipped = without_dev_kvm(true).unwrap();
    let all = text(&skipped);
    assert!(skipped.status.success(), "{all}");
    assert!(
        all.contains(&format!("SKIPPED {KVM_TEST}: cannot open /dev/kvm")),
        "{all}"
    );
}
