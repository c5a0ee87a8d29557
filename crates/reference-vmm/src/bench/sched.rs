//! `bench sched`: 2x-overcommitted vCPUs and a host CPU hog. vCPU 0 sends an
//! IPI to all others and spins (with pause-loop exits) until all have
//! acknowledged, repeatedly; each boost policy in turn.

use test_support::Hogs;

use crate::bench::{Cell, Options, Runs, Table, goal, measure, ticks_per_us};
use crate::error::Error;
use crate::mechanisms::{Boost, Mechanisms};

/// Rounds per run, without `--quick`.
const ROUNDS: u64 = 2000;
/// Pause iterations between two pause-loop exits of the spinning sender.
const PAUSES_PER_EXIT: u64 = 200;
/// The variants, baseline first.
const VARIANTS: [Boost; 3] = [Boost::None, Boost::Ready, Boost::DirectedYield];

/// Runs the scenario.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let vcpus = 2 * cores as u32;
    let rounds = opts.rounds(ROUNDS);
    let mut rate = vec![Runs::new(); VARIANTS.len()];
    let mut hog_rate = vec![Runs::new(); VARIANTS.len()];
    let mut longest_boost_us = vec![Runs::new(); VARIANTS.len()];
    let hogs = Hogs::start(1);
    for rep in 0..opts.reps() {
        for (i, &boost) in VARIANTS.iter().enumerate() {
            progress(&format!(
                "sched: --boost {boost} ({}/{})",
                rep + 1,
                opts.reps()
            ));
            let m = Mechanisms {
                boost,
                ..Mechanisms::default()
            };
            let before = hogs.iterations();
            let run = measure("sched-ipi", vcpus, m, &[rounds, PAUSES_PER_EXIT], |_| {})?;
            let hog_iterations = hogs.iterations() - before;
            let secs = run.report.value(0, "ticks").unwrap_or(0) as f64 / ticks_per_us() / 1e6;
            rate[i].push(rounds as f64 / secs);
            hog_rate[i].push(hog_iterations as f64 / run.wall.as_secs_f64() / 1e6);
            longest_boost_us[i].push(run.report.stats.longest_boost_ns as f64 / 1e3);
        }
    }
    drop(hogs);
    let mut t = Table::new(
        format!(
            "sched: {vcpus} vCPUs and a CPU hog on {cores} cores, IPI to all and wait for every acknowledgement"
        ),
        &[
            "--boost",
            "rounds/s",
            "vs none",
            "hog M iterations/s",
            "hog vs none",
            "longest boost, µs",
        ],
    );
    for (i, b) in VARIANTS.iter().enumerate() {
        t.row(vec![
            Cell::text(b.to_string()),
            Cell::num(rate[i].median(), 0),
            Cell::ratio(&rate[i].ratio_to(&rate[0])),
            Cell::num(hog_rate[i].median(), 0),
            Cell::ratio(&hog_rate[i].ratio_to(&hog_rate[0])),
            Cell::num(longest_boost_us[i].range().1, 0),
        ]);
    }
    t.better("more rounds per second for the VM, with the hog keeping its iterations");
    t.note(format!(
        "{rounds} rounds per run, {} runs per variant, alternating; the sender exits every {PAUSES_PER_EXIT} pause instructions while it waits (a pause-loop exit: the boost policy's on_wait); the others halt between IPIs. Longest boost: the longest any vCPU thread stayed boosted in any run (the budget is 1000 µs; 0: no boost).",
        opts.reps()
    ));
    let directed_yield = rate[VARIANTS.len() - 1].ratio_to(&rate[0]);
    t.note(goal(
        "directed-yield boosting at least 1.5x none's rounds per second",
        &directed_yield.ratio_text(),
        directed_yield.median() >= 1.5,
        &directed_yield.each(|r| r >= 1.5),
    ));
    Ok(t)
}
