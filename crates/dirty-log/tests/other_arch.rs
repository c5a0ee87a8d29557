//! On a host that is not x86-64, `tests/kvm.rs` is not built: its guest is
//! x86-64 code. This says so where the run's skips are listed.
#![cfg(not(target_arch = "x86_64"))]

#[test]
fn the_kvm_tests_boot_an_x86_64_guest() {
    let reason = format!(
        "dirty-log::kvm: its guest is x86-64 code, and this host is {}",
        std::env::consts::ARCH
    );
    eprintln!("SKIPPED: {reason}");
    if let Some(log) = std::env::var_os("SKIPPED_TESTS_LOG") {
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .and_then(|mut f| std::io::Write::write_all(&mut f, format!("{reason}\n").as_bytes()));
    }
}
