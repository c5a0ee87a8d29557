//! Prints the simulator's table: every policy on every synthetic trace (and on
//! recorded traces given as arguments), beside the oracle.
//!
//! `cargo run --release -p halt-poll --example simulate [TRACE_FILE...]`

use std::path::Path;

use halt_poll::sim::{SimParams, Trace, oracle, simulate, table};
use halt_poll::{
    AioPoll, Fixed, GuestHaltpoll, KvmGrowShrink, Never, PollPolicy, Predictive, PredictiveConfig,
};

fn policies() -> Vec<(&'static str, Box<dyn PollPolicy>)> {
    vec![
        ("never (block only)", Box::new(Never)),
        (
            "fixed 200 µs (always poll)",
            Box::new(Fixed(std::time::Duration::from_micros(200))),
        ),
        ("KvmGrowShrink", Box::new(KvmGrowShrink::new())),
        (
            "KvmGrowShrink pre-6.11",
            Box::new(KvmGrowShrink::pre_6_11()),
        ),
        ("GuestHaltpoll", Box::new(GuestHaltpoll::new())),
        ("AioPoll", Box::new(AioPoll::new())),
        ("Predictive (own)", Box::new(Predictive::default())),
        (
            "Predictive, no latency slack",
            Box::new(Predictive::new(PredictiveConfig {
                latency_slack: 0.0,
                ..Default::default()
            })),
        ),
    ]
}

fn main() {
    let params = SimParams::default();
    let mut traces = Trace::synthetic(20_000);
    for arg in std::env::args().skip(1) {
        match Trace::load(Path::new(&arg)) {
            Ok(t) => traces.push(t),
            Err(e) => {
                eprintln!("error: cannot load trace {arg}: {e}");
                std::process::exit(1);
            }
        }
    }
    println!(
        "Simulated with block latency {:?}, poll latency {:?}, sleep lateness {:?}, λ = {}.\n",
        params.block_latency, params.poll_latency, params.sleep_lateness, params.cpu_weight
    );
    for trace in &traces {
        let mut results: Vec<_> = policies()
            .into_iter()
            .map(|(name, mut p)| simulate(name, p.as_mut(), trace, &params))
            .collect();
        results.push(oracle(trace, &params));
        println!("{}", table(trace, &results, &params));
    }
}
