//! Arbitrary dirty-bitmap words and dirty-ring entries, as a buggy or hostile
//! kernel could leave them. `cargo +nightly fuzz run decode`; `cargo test -p
//! dirty-log` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| dirty_log::invariants::run(data));
