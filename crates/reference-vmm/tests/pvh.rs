//! The guest programs as an image file, booted here through the PVH entry
//! (QEMU boots the same images: reference-bench's `tests/peer.rs`).

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

use common::kvm_available;
use reference_vmm::{Boot, Error, GuestFault, Vm, VmConfig};
use test_guests::layout::PARAMS;
use test_guests::pvh::Image;

fn image(name: &str, vcpus: u32) -> Image {
    Image::build(test_guests::find(name).unwrap(), vcpus, 64, [0; PARAMS]).unwrap()
}

#[test]
fn every_vcpu_enters_through_the_pvh_entry_here() {
    if !kvm_available("every_vcpu_enters_through_the_pvh_entry_here") {
        return;
    }
    let image = Arc::new(image("hello", 3));
    let config = VmConfig {
        boot: Boot::Image(image.clone()),
        ..VmConfig::default()
    };
    let vm = Vm::new(&config).unwrap();
    let report = vm.run(image.program(), Box::new(std::io::sink())).unwrap();
    for vcpu in 0..3 {
        assert_eq!(report.value(vcpu, "apic_id"), Some(u64::from(vcpu)));
    }
    assert_eq!(report.stats.output_lost, 0);
}

#[test]
fn a_fault_after_the_pvh_entry_is_reported_as_under_the_direct_boot() {
    if !kvm_available("a_fault_after_the_pvh_entry_is_reported_as_under_the_direct_boot") {
        return;
    }
    let image = Arc::new(image("gp-fault", 1));
    let config = VmConfig {
        boot: Boot::Image(image.clone()),
        ..VmConfig::default()
    };
    let err = Vm::new(&config)
        .unwrap()
        .run(image.program(), Box::new(std::io::sink()))
        .unwrap_err();
    assert!(
        matches!(
            &err,
            Error::Guest {
                fault: GuestFault::Exception { vector: 13, .. },
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn the_command_line_writes_an_image_and_boots_it() {
    if !kvm_available("the_command_line_writes_an_image_and_boots_it") {
        return;
    }
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-hello.elf");
    let vmm = env!("CARGO_BIN_EXE_reference-vmm");
    let out = Command::new(vmm)
        .args(["image", "--guest", "hello", "--vcpus", "2", "--out"])
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        stdout.contains("-kernel") && stdout.contains("run --image"),
        "{stdout}"
    );
    let run = Command::new(vmm)
        .arg("run")
        .arg("--image")
        .arg(&path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(run.status.success(), "{run:?}");
    assert!(stdout.contains("hello from vcpu 1"), "{stdout}");
    assert!(stdout.contains("apic_id"), "{stdout}");

    std::fs::write(&path, b"not an image").unwrap();
    let bad = Command::new(vmm)
        .arg("run")
        .arg("--image")
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(1), "{bad:?}");
    assert!(stderr.contains("not a bootable ELF image"), "{stderr}");
    let both = Command::new(vmm)
        .args(["run", "--guest", "hello", "--image"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(both.status.code(), Some(2), "{both:?}");
}
