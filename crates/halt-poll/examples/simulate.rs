//! Prints the simulator's table: every policy on every synthetic trace (and on
//! recorded traces given as arguments), beside the oracle, then `Predictive`
//! against `KvmGrowShrink` on each trace (the goal `tests/goal.rs` checks).
//! With `--update-results` the output also goes to the crate's RESULTS.md, section "simulator".
//!
//! `cargo run --release -p halt-poll --example simulate [TRACE_FILE...]`

use std::fmt::Write as _;
use std::path::Path;

// The workspace's RESULTS.md writer (test-support's), a copy of which ships with the crate.
#[path = "support/results.rs"]
mod results;

#[path = "../sim/mod.rs"]
mod sim;
use halt_poll::{
    AioPoll, Fixed, GuestHaltpoll, KvmGrowShrink, Never, PollPolicy, Predictive, PredictiveConfig,
};
use sim::{SimParams, SimResult, Trace, oracle, simulate, table};

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
        ("Predictive", Box::new(Predictive::default())),
        (
            "Predictive, no latency slack",
            Box::new(Predictive::new(no_slack())),
        ),
    ]
}

/// `Predictive`'s settings with no latency slack: always the cheapest plan.
fn no_slack() -> PredictiveConfig {
    let mut config = PredictiveConfig::default();
    config.latency_slack = 0.0;
    config
}

fn main() {
    let params = SimParams::default();
    let mut traces = Trace::synthetic(20_000);
    let args: Vec<String> = results::args().collect();
    for arg in &args {
        match Trace::load(Path::new(arg)) {
            Ok(t) => traces.push(t),
            Err(e) => {
                eprintln!("error: cannot load trace {arg}: {e}");
                std::process::exit(1);
            }
        }
    }
    let mut out = format!(
        "Simulated with block latency {:?}, poll latency {:?}, sleep lateness {:?}, λ = {}.\n\n",
        params.block_latency, params.poll_latency, params.sleep_lateness, params.cpu_weight
    );
    let mut goal = String::from(
        "**Predictive against KvmGrowShrink**\n\n\
         | trace | mean latency µs, Predictive | KvmGrowShrink | wasted poll CPU µs/halt, Predictive | KvmGrowShrink |\n\
         |---|---|---|---|---|\n",
    );
    for trace in &traces {
        let mut results: Vec<_> = policies()
            .into_iter()
            .map(|(name, mut p)| simulate(name, p.as_mut(), trace, &params))
            .collect();
        let (kvm, predictive) = (
            by_name(&results, "KvmGrowShrink"),
            by_name(&results, "Predictive"),
        );
        let _ = writeln!(
            goal,
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} |",
            trace.name,
            micros(predictive.mean_latency),
            micros(kvm.mean_latency),
            micros(predictive.wasted_cpu),
            micros(kvm.wasted_cpu),
        );
        results.push(oracle(trace, &params));
        let _ = writeln!(out, "{}", table(trace, &results, &params));
    }
    out.push_str(&goal);
    print!("{out}");
    let command = results::command("cargo run --release -p halt-poll --example simulate");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    results::write_section_if_asked(&path, "halt-poll", "simulator", &command, &out);
}

fn by_name<'a>(results: &'a [SimResult], name: &str) -> &'a SimResult {
    results
        .iter()
        .find(|r| r.policy == name)
        .expect("every policy ran")
}

fn micros(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
