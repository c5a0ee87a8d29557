//! Arbitrary migration streams (after a valid header) against the stream reader.
//! `cargo +nightly fuzz run migration_stream`; `cargo test -p migration` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| migration::invariants::migration_stream(data));
