//! KVM's LAPIC as the oracle: the conformance guest's sequences, on this
//! VMM's local APIC and on KVM's, read back the same; the answers KVM gave
//! for the fuzz corpus are still what it answers.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use apic_conformance::{self as conformance, DEFAULT_OPS, SEEDS_PER_VM, fuzz_corpus};
use common::{kvm_available, skip};
use reference_vmm::Irqchip;
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

#[test]
fn lapic_timers_model_alone_answers_as_kvms_timer() {
    if !kvm_available("lapic_timers_model_alone_answers_as_kvms_timer") {
        return;
    }
    for mode in [Mode::X2apic, Mode::Xapic] {
        for first in (0..SEEDS).step_by(SEEDS_PER_VM as usize) {
            let seeds = first..first + u64::from(SEEDS_PER_VM);
            let scripts = conformance::scripts(first, SEEDS_PER_VM, mode, DEFAULT_OPS as usize);
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

#[test]
fn the_committed_fuzz_corpus_answers_are_still_kvms() {
    let test = "the_committed_fuzz_corpus_answers_are_still_kvms";
    if !kvm_available(test) {
        return;
    }
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../reference-vmm");
    let text = std::fs::read_to_string(format!("{root}/{}", fuzz_corpus::EXPECTATIONS)).unwrap();
    let answers = fuzz_corpus::parse(&text).unwrap();
    let cpuid = kvm_ioctls::Kvm::new()
        .unwrap()
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .unwrap();
    let here = test_guests::x86::boot::phys_bits(&cpuid);
    if here != answers.phys_bits {
        let why = format!(
            "KVM's answers were recorded with MAXPHYADDR {}, this host's is {here}",
            answers.phys_bits
        );
        skip(test, &why);
        return;
    }
    // The longest inputs: those whose answers reach furthest.
    let mut inputs: Vec<(String, Vec<u8>)> =
        std::fs::read_dir(format!("{root}/fuzz-corpus/local_apic"))
            .unwrap()
            .map(|e| {
                let path = e.unwrap().path();
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read(&path).unwrap())
            })
            .collect();
    inputs.sort_by_key(|(name, input)| (std::cmp::Reverse(input.len()), name.clone()));
    for (name, input) in inputs.iter().take(16) {
        let fresh = conformance::records(Irqchip::Kernel, &[fuzz_corpus::script(input)]).unwrap();
        if let Some((now, then)) = fuzz_corpus::first_change(&fresh[0], &answers.by_input[name]) {
            panic!(
                "KVM now answers {name}'s {} with {} (recorded: {then}): record the \
                 answers again (`reference-vmm conformance --record-fuzz-corpus`)",
                now.op, now.outcome
            );
        }
    }
}
