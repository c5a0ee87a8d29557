//! KVM's LAPIC as the oracle: the conformance guest's sequences, on this
//! VMM's local APIC and on KVM's, read back the same.

mod common;

use common::kvm_available;
use reference_vmm::conformance::{self, DEFAULT_OPS};
use test_guests::apic_script::Mode;

/// Seeds per mode: each a sequence of `DEFAULT_OPS` random operations.
const SEEDS: u64 = 200;

#[test]
fn this_vmms_apic_answers_as_kvms_through_x2apic_msrs_and_the_xapic_page() {
    if !kvm_available("this_vmms_apic_answers_as_kvms_through_x2apic_msrs_and_the_xapic_page") {
        return;
    }
    for mode in [Mode::X2apic, Mode::Xapic] {
        if let Some(difference) =
            conformance::compare(0, SEEDS, mode, DEFAULT_OPS as usize).unwrap()
        {
            panic!("{difference}");
        }
    }
}
