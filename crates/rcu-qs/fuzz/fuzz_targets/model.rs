//! Random operation sequences against rcu-qs and a simple model of it.
//! `cargo +nightly fuzz run model`; `cargo test -p rcu-qs` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| rcu_qs::model::run(data));
