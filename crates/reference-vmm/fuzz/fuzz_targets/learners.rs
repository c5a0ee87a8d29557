//! Arbitrary guest writes to the mailbox ring and the interrupt record against the learners that read them.
//! `cargo +nightly fuzz run learners`; `cargo test -p reference-vmm` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| reference_vmm::invariants::learners(data));
