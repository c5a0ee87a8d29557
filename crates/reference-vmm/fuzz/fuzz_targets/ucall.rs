//! Arbitrary ucall port data and guest memory against the ucall decoder.
//! `cargo +nightly fuzz run ucall`; `cargo test -p reference-vmm` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| reference_vmm::invariants::ucall(data));
