//! Checks every policy on arbitrary inputs, and panics if one breaks an
//! invariant. The fuzz target (`fuzz/`) feeds it random bytes; `cargo test`
//! replays the committed corpus.
//!
//! The bytes are read twice: as a trace of wake times replayed through the
//! simulator, and as a sequence of arbitrary (even inconsistent) outcomes fed to
//! `learn`, which is what a policy must survive in a VMM, where halt lengths are
//! the guest's choice.

use std::time::Duration;

use crate::policy::{HaltOutcome, PollPolicy, WokenDuring};
use crate::sim::{SimParams, Trace, simulate};
use crate::{AioPoll, Fixed, GuestHaltpoll, KvmGrowShrink, Never, Predictive};

/// Each policy with the longest window it may ever plan.
fn policies() -> Vec<(Box<dyn PollPolicy>, Duration)> {
    let us = Duration::from_micros;
    vec![
        (Box::new(Never), Duration::ZERO),
        (Box::new(Fixed(us(50))), us(50)),
        (Box::new(KvmGrowShrink::new()), us(200)),
        (Box::new(KvmGrowShrink::pre_6_11()), us(200)),
        (Box::new(GuestHaltpoll::new()), us(200)),
        (Box::new(AioPoll::new()), Duration::from_nanos(32_768)),
        (Box::new(Predictive::default()), us(500)),
    ]
}

fn u32_at(data: &[u8], i: usize) -> u32 {
    let b = |k: usize| u32::from(data.get(i + k).copied().unwrap_or(0));
    b(0) | b(1) << 8 | b(2) << 16 | b(3) << 24
}

fn trace(data: &[u8]) -> Trace {
    // Two bytes per halt, scaled up so both short and multi-millisecond halts occur.
    let wakes = data.chunks(2).map(|c| {
        let v = u64::from(c[0]) | u64::from(*c.get(1).unwrap_or(&0)) << 8;
        Duration::from_nanos(v * v / 4)
    });
    Trace {
        name: "fuzz".into(),
        wakes: wakes.collect(),
    }
}

fn outcomes(data: &[u8]) -> impl Iterator<Item = HaltOutcome> + '_ {
    data.chunks(13).map(|c| HaltOutcome {
        halt: Duration::from_nanos(u64::from(u32_at(c, 0))),
        slept: Duration::from_nanos(u64::from(u32_at(c, 4) >> 8)),
        polled: Duration::from_nanos(u64::from(u32_at(c, 8) >> 8)),
        woken: [WokenDuring::Sleep, WokenDuring::Poll, WokenDuring::Block]
            [usize::from(c.get(12).copied().unwrap_or(0) % 3)],
        valid: c.get(12).is_none_or(|b| b & 4 == 0),
        preempted: c.get(12).is_some_and(|b| b & 8 != 0),
    })
}

/// Runs every check on `data`; panics on a broken invariant.
pub fn run(data: &[u8]) {
    let params = SimParams {
        block_latency: Duration::from_nanos(u64::from(u32_at(data, 0) % 100_000)),
        sleep_lateness: Duration::from_nanos(u64::from(u32_at(data, 4) % 100_000)),
        cpu_weight: f64::from(data.get(8).copied().unwrap_or(10)) / 100.0,
        ..SimParams::default()
    };
    let trace = trace(data);
    for (mut policy, max) in policies() {
        let r = simulate("fuzz", policy.as_mut(), &trace, &params);
        let worst = params.block_latency.max(params.poll_latency);
        assert!(r.mean_latency <= worst && r.p99_latency <= worst, "{r:?}");
        assert!(r.wasted_cpu <= r.poll_cpu, "{r:?}");
        assert!(
            r.poll_cpu <= max,
            "polled {:?} per halt with a {max:?} window",
            r.poll_cpu
        );
        assert!((0.0..=100.0).contains(&r.polled_percent), "{r:?}");
    }
    for (mut policy, max) in policies() {
        for o in outcomes(data) {
            policy.learn(&o);
            let plan = policy.plan();
            assert!(
                plan.window <= max,
                "window {:?} above {max:?} after {o:?}",
                plan.window
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays every input committed under `fuzz-corpus/policies/`.
    #[test]
    fn replays_the_fuzz_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-corpus/policies");
        let mut inputs = 0;
        for entry in std::fs::read_dir(dir).expect("the corpus is committed") {
            run(&std::fs::read(entry.unwrap().path()).unwrap());
            inputs += 1;
        }
        assert!(inputs >= 8, "the corpus has only {inputs} inputs");
    }

    #[test]
    fn empty_and_tiny_inputs_are_fine() {
        run(&[]);
        run(&[1]);
        run(&[0xff; 13]);
    }
}
