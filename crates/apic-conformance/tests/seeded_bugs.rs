//! The conformance runner catches each of four plausible APIC bugs,
//! planted one at a time, within the default seeds (`cargo test -p
//! apic-conformance --features seeded-bugs --test seeded_bugs`; `.ci/run`
//! runs it).
#![cfg(feature = "seeded-bugs")]

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use apic_conformance::{self as conformance, DEFAULT_OPS};
use common::kvm_available;
use reference_vmm::seeded_bugs::{SeededBug, plant};
use test_guests::apic_script::Mode;

/// The default seeds: as many as `tests/conformance.rs` runs.
const SEEDS: u64 = 200;

#[test]
fn the_runner_catches_each_seeded_bug_within_the_default_seeds() {
    if !kvm_available("the_runner_catches_each_seeded_bug_within_the_default_seeds") {
        return;
    }
    // One test: a planted bug holds for the whole process.
    for bug in SeededBug::ALL {
        plant(Some(bug));
        let caught = [Mode::X2apic, Mode::Xapic].map(|mode| {
            let found = conformance::compare(0, SEEDS, mode, DEFAULT_OPS as usize).unwrap();
            found.map(|d| (d.origin.to_string(), d.ours.len()))
        });
        plant(None);
        eprintln!("{bug:?}: first caught at (origin, operations) {caught:?}");
        assert!(
            caught.iter().all(Option::is_some),
            "{bug:?} escaped: {caught:?}"
        );
    }
    let clean = conformance::compare(0, SEEDS, Mode::X2apic, DEFAULT_OPS as usize).unwrap();
    assert!(clean.is_none(), "the bug was removed");
}
