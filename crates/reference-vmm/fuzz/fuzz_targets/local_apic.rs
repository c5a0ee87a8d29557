//! Arbitrary x2APIC MSR and xAPIC page accesses, pending vectors and time against the local APIC's invariants.
//! `cargo +nightly fuzz run local_apic`; `cargo test -p reference-vmm` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| reference_vmm::invariants::local_apic(data));
