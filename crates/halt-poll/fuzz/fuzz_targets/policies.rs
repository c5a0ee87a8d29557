//! Every poll policy on arbitrary traces and outcomes (halt lengths are the
//! guest's choice). `cargo +nightly fuzz run policies`; `cargo test -p halt-poll`
//! replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| halt_poll::invariants::run(data));
