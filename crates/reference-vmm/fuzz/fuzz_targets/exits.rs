//! Arbitrary synthetic exits (port I/O, MMIO, halts, ucalls) against the exit handler.
//! `cargo +nightly fuzz run exits`; `cargo test -p reference-vmm` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| reference_vmm::invariants::exits(data));
