//! Arbitrary sequences of vCPU state events, directed-yield searches, boosts
//! and restores. `cargo +nightly fuzz run events`; `cargo test -p vcpu-sched`
//! replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vcpu_sched::invariants::run(data));
