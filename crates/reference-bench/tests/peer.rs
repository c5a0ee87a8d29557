//! QEMU, the peer VMM, boots the guest kit's images on the same KVM and
//! reports what the guests did.

#[path = "../../reference-vmm/tests/common/mod.rs"]
#[allow(dead_code)] // the KVM check: QEMU needs no /dev/kvm of its own here
mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::skip;
use reference_bench::qemu::{INSTALL_HINT, Qemu, QemuApic, QemuError};
use test_guests::Image;
use test_guests::layout::PARAMS;

const QEMU_TIMEOUT: Duration = Duration::from_secs(60);

fn image(name: &str, vcpus: u32) -> Image {
    Image::build(test_guests::find(name).unwrap(), vcpus, 64, [0; PARAMS]).unwrap()
}

/// Writes `image` to a file of its own under the target directory.
fn image_file(test: &str, image: &Image) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("{test}.elf"));
    std::fs::write(&path, image.bytes()).unwrap();
    path
}

fn qemu(test: &str) -> Option<Qemu> {
    let found = Qemu::find();
    if found.is_none() {
        skip(
            test,
            &format!("no qemu-system-x86_64 on PATH ({INSTALL_HINT})"),
        );
    }
    found
}

#[test]
fn qemu_boots_every_vcpu_of_the_same_image_with_either_apic() {
    let test = "qemu_boots_every_vcpu_of_the_same_image_with_either_apic";
    let Some(qemu) = qemu(test) else { return };
    let path = image_file(test, &image("hello", 3));
    for apic in [QemuApic::User, QemuApic::Kernel] {
        let run = qemu.run(&path, 3, 64, apic, QEMU_TIMEOUT).unwrap();
        for vcpu in 0..3 {
            let greeting = format!("hello from vcpu {vcpu}\n");
            assert!(run.serial.contains(&greeting), "{apic:?}: {run:?}");
            assert_eq!(
                run.value(vcpu, "apic_id"),
                Some(u64::from(vcpu)),
                "{apic:?}"
            );
            assert!(run.value(vcpu, "tsc").is_some_and(|t| t > 0), "{apic:?}");
        }
        assert!(
            run.cpu_time > Duration::ZERO,
            "{apic:?}: QEMU's CPU time read back"
        );
    }
}

#[test]
fn a_guest_failure_under_qemu_ends_the_run_with_its_exception() {
    let test = "a_guest_failure_under_qemu_ends_the_run_with_its_exception";
    let Some(qemu) = qemu(test) else { return };
    let path = image_file(test, &image("gp-fault", 1));
    let err = qemu
        .run(&path, 1, 64, QemuApic::User, QEMU_TIMEOUT)
        .unwrap_err();
    assert!(
        matches!(&err, QemuError::Guest(what) if what.contains("vector: 13")),
        "{err}"
    );
}
