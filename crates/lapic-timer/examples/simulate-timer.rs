//! Prints the simulator's table: every advance policy on each synthetic trace
//! (and recorded traces given as arguments), beside the oracle.
//!
//! `cargo run --release -p lapic-timer --example simulate-timer [TRACE_FILE...]`
//!
//! With `--update-results` the tables also go to the crate's RESULTS.md, section "simulator".

use std::fmt::Write as _;
use std::path::Path;

// The workspace's RESULTS.md writer (test-support's), a copy of which ships with the crate.
#[path = "support/results.rs"]
mod results;
use std::time::Duration;

#[path = "../sim/mod.rs"]
mod sim;
use lapic_timer::{AdvancePolicy, Fixed, KvmAdaptive, NoAdvance, Percentile};
use sim::{Trace, oracle, simulate, table};

const SPIN_WEIGHT: f64 = 0.1;

fn main() {
    let mut traces = Trace::synthetic(20_000);
    let mut out = String::new();
    for arg in results::args() {
        match Trace::load(Path::new(&arg)) {
            Ok(t) => traces.push(t),
            Err(e) => {
                eprintln!("error: cannot load trace {arg}: {e}");
                std::process::exit(1);
            }
        }
    }
    for trace in &traces {
        let mut policies: Vec<(String, Box<dyn AdvancePolicy>)> = vec![
            ("none".into(), Box::new(NoAdvance)),
            (
                "KvmAdaptive (2.6 GHz TSC)".into(),
                Box::new(KvmAdaptive::new(2_596_000)),
            ),
            ("Percentile".into(), Box::new(Percentile::default())),
        ];
        for us in [10, 20, 30, 40, 60, 80] {
            policies.push((
                format!("Fixed {us} µs"),
                Box::new(Fixed(Duration::from_micros(us))),
            ));
        }
        let mut results: Vec<_> = policies
            .iter_mut()
            .map(|(n, p)| simulate(n, p.as_mut(), trace))
            .collect();
        results.push(oracle(trace));
        let _ = writeln!(out, "{}", table(trace, &results, SPIN_WEIGHT));
    }
    print!("{out}");
    let command = results::command("cargo run --release -p lapic-timer --example simulate-timer");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    results::write_section_if_asked(&path, "lapic-timer", "simulator", &command, &out);
}
