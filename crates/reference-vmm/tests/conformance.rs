//! KVM's LAPIC as the oracle: the conformance guest's sequences, on this
//! VMM's local APIC and on KVM's, read back the same.

mod common;

use common::kvm_available;
use reference_vmm::Irqchip;
use reference_vmm::conformance::{self, DEFAULT_OPS, SEEDS_PER_VM};
use test_guests::apic_script::{self, Mode};

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

#[test]
fn lapic_timers_model_alone_answers_as_kvms_timer() {
    if !kvm_available("lapic_timers_model_alone_answers_as_kvms_timer") {
        return;
    }
    for mode in [Mode::X2apic, Mode::Xapic] {
        for first in (0..SEEDS).step_by(SEEDS_PER_VM as usize) {
            let seeds = first..first + u64::from(SEEDS_PER_VM);
            let scripts: Vec<_> = (0..)
                .zip(seeds.clone())
                .map(|(v, seed)| apic_script::generate(seed, mode, v, DEFAULT_OPS as usize))
                .collect();
            let kvm = conformance::records(Irqchip::Kernel, &scripts).unwrap();
            for (seed, records) in seeds.zip(&kvm) {
                if let Some((i, model)) = conformance::timer_model_difference(mode, records) {
                    panic!(
                        "seed {seed} ({mode:?}), operation {i}: {} KVM: {}, the model: {}",
                        model.op, records[i].outcome, model.outcome
                    );
                }
            }
        }
    }
}
