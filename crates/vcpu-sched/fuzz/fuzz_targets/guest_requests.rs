//! Guest-requested boosts under arbitrary request words, thread states and
//! time steps: no boost outlives its budget, none beyond the share per
//! period. `cargo +nightly fuzz run guest_requests`; `cargo test -p
//! vcpu-sched` replays the corpus.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| vcpu_sched::invariants::guest_requests(data));
