//! The guest programs as an image file, booted here through the PVH entry
//! (QEMU boots the same images: reference-bench's `tests/peer.rs`).

mod common;

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
