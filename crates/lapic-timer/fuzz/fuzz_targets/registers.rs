//! Arbitrary guest register/MSR writes and time steps against the LAPIC timer
//! model, and arbitrary wake-ups against the advance policies.
//! `cargo +nightly fuzz run registers`; `cargo test -p lapic-timer` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| lapic_timer::invariants::run(data));
