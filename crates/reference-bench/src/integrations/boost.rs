//! `reference-bench ch-boost`: vcpu-sched's delivery boost inside Cloud
//! Hypervisor (`CH_VCPU_BOOST=1`), stock against patched, beside two CPU
//! hogs. The guest kit's `virtio-rng` guest times each request to Cloud
//! Hypervisor's virtio entropy device from its notify to the MSI-X
//! interrupt that completes it (the device thread's irqfd write, which the
//! patch follows with a boost of the route's target vCPU), its vCPU either
//! spinning for the interrupt (a vCPU with work to do, which the sched
//! scenario's 1.3x goal is about) or halting.

use std::time::Duration;

use super::builds::{LogFile, cloud_hypervisors};
use crate::peer::{ImageFile, Peers};
use crate::peer_run::{PeerBinary, PeerError, PeerRun};
use crate::runs::{Runs, goal};
use crate::table::{Cell, Table};
use crate::{Error, Options, ticks_per_us};
use test_support::Hogs;

/// Requests per run (a tenth with `--quick`).
const REQUESTS: u64 = 5000;
/// The spinning vCPU's round trip the boost is to reach, against stock:
/// 1.3x faster, as the sched scenario asks of a delivery boost.
const SPIN_GOAL: f64 = 1.0 / 1.3;
/// What a halting vCPU may pay for the boost, against stock.
const HALT_GOAL: f64 = 1.1;
/// How the vCPU waits for each interrupt (the guest's params[1]), and the
/// goal for it.
const WAITS: [(&str, u64, f64); 2] = [("spinning", 1, SPIN_GOAL), ("halting", 0, HALT_GOAL)];
/// The two builds, as their rows name them.
const BUILDS: [&str; 2] = ["stock", "patched, CH_VCPU_BOOST=1"];
/// Each run's bound.
const TIMEOUT: Duration = Duration::from_secs(60);

/// One way of waiting: the two builds' runs.
#[derive(Clone, Default)]
struct Cells {
    /// Mean round trip (µs), stock then patched.
    mean: [Runs; 2],
    /// Longest round trip (µs).
    max: [Runs; 2],
    /// Boosts the patched build logged.
    boosted: Runs,
}

/// `ch-boost`'s rows and goals; without both builds, says how to get them.
pub fn ch_boost(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let mut t = Table::new(
        "ch-boost: vcpu-sched's delivery boost inside Cloud Hypervisor, beside two CPU hogs, \
         stock against patched",
        &[
            "vCPU",
            "build",
            "round trip (µs)",
            "vs stock",
            "longest (µs)",
            "boosts (logged)",
        ],
    );
    let peers = Peers::find(opts);
    let asks = WAITS.map(|(wait, _, at_most)| ask(wait, at_most));
    let Some((stock, patched)) = cloud_hypervisors(opts, &peers, &mut t, &asks) else {
        return Ok(t);
    };
    let requests = opts.rounds(REQUESTS);
    let log = LogFile::new();
    let boosted = log.onto(&patched).with_env("CH_VCPU_BOOST", "1");
    let mut cells = vec![Cells::default(); WAITS.len()];
    let hogs = Hogs::start(2);
    for rep in 0..opts.reps() {
        for ((wait, param, _), c) in WAITS.into_iter().zip(&mut cells) {
            let image = ImageFile::write("virtio-rng", 1, 64, &[requests, param])?;
            for (i, build) in [stock, &boosted].into_iter().enumerate() {
                let name = BUILDS[i];
                progress(&format!(
                    "ch-boost: {wait}, {name} ({}/{})",
                    rep + 1,
                    opts.reps()
                ));
                let run = build.run(image.path(), 1, 64, TIMEOUT)?;
                let (mean, max) = round_trips(&run, requests)?;
                c.mean[i].push(mean);
                c.max[i].push(max);
            }
            c.boosted.push(logged_boosts(&log.take()));
        }
    }
    drop(hogs);
    for ((wait, _, _), c) in WAITS.into_iter().zip(&cells) {
        rows(&mut t, wait, c);
    }
    for ((wait, _, at_most), c) in WAITS.into_iter().zip(&cells) {
        t.peer_goal(boost_goal(c, wait, at_most));
    }
    t.better("a shorter round trip");
    t.note(format!(
        "Stock: {}. Patched: {} with CH_VCPU_BOOST=1, built by \
         integrations/cloud-hypervisor/apply.sh. The guest (1 vCPU, 64 MiB) asks Cloud \
         Hypervisor's virtio entropy device for 64 bytes {requests} times, one at a time, and \
         times each from its notify to the MSI-X interrupt, spinning at CPL3 or halting; two \
         CPU-hog threads run beside it on this 2-CPU host. Boosts: the patched build's last \
         logged count (every 100 ms at most) of boosts to SCHED_FIFO 1, each of a target vCPU \
         found waiting for a CPU as its interrupt was raised, at most 100 µs each and 2 ms in \
         10 ms.",
        crate::peer_run::describe(stock.binary()),
        crate::peer_run::describe(patched.binary()),
    ));
    Ok(t)
}

/// The guest's mean and longest round trip (µs), checked against the
/// requests it was asked to make.
fn round_trips(run: &PeerRun, requests: u64) -> Result<(f64, f64), Error> {
    let wrong = |what: String| {
        Error::Peer(PeerError::Guest {
            vmm: "Cloud Hypervisor",
            what: format!("virtio-rng {what}: {run:?}"),
        })
    };
    let value = |name| {
        run.value(0, name)
            .ok_or_else(|| wrong(format!("reported no {name}")))
    };
    let irqs = value("irqs")?;
    if irqs != requests {
        return Err(wrong(format!(
            "took {irqs} interrupts for {requests} requests"
        )));
    }
    let us = ticks_per_us();
    Ok((
        value("ticks")? as f64 / us / requests as f64,
        value("max")? as f64 / us,
    ))
}

/// The boosts in the patched build's last `vCPU boosts: ...` line: NaN
/// where it has none.
fn logged_boosts(log: &str) -> f64 {
    log.lines()
        .rev()
        .find_map(|line| {
            let (_, rest) = line.split_once("vCPU boosts: ")?;
            let (_, rest) = rest.split_once("a CPU, ")?;
            let (boosts, _) = rest.split_once(" boosts,")?;
            boosts.parse::<f64>().ok()
        })
        .unwrap_or(f64::NAN)
}

fn rows(t: &mut Table, wait: &str, c: &Cells) {
    for (i, build) in BUILDS.into_iter().enumerate() {
        t.row(vec![
            Cell::text(wait),
            Cell::text(build),
            Cell::runs(&c.mean[i], 1),
            match i {
                0 => Cell::text("1"),
                _ => Cell::ratio(&c.mean[1].ratio_to(&c.mean[0])),
            },
            Cell::runs(&c.max[i], 1),
            match i {
                0 => Cell::text("-"),
                _ => Cell::runs(&c.boosted, 0),
            },
        ]);
    }
}

/// What the boost's goal for a `wait`ing vCPU asks.
fn ask(wait: &str, at_most: f64) -> String {
    format!(
        "Cloud Hypervisor with vcpu-sched's delivery boost, a {wait} vCPU beside two CPU hogs: \
         its virtio round trip at most {at_most:.2}x stock's"
    )
}

/// Whether the patched build's mean round trip was at most `at_most`
/// times stock's.
fn boost_goal(c: &Cells, wait: &str, at_most: f64) -> String {
    let ratios = c.mean[1].ratio_to(&c.mean[0]);
    goal(
        &ask(wait, at_most),
        &format!(
            "{:.1} µs against {:.1} µs, {} of stock",
            c.mean[1].median(),
            c.mean[0].median(),
            ratios.ratio_text()
        ),
        ratios.median() <= at_most,
        &ratios.each(|r| r <= at_most),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_boosts_are_the_last_logged_count() {
        let log = "a vCPU boosts: 10 deliveries, 4 to a vCPU waiting for a CPU, 3 boosts, 9 µs \
                   boosted\n\
                   noise\n\
                   b vCPU boosts: 20 deliveries, 9 to a vCPU waiting for a CPU, 8 boosts, 99 µs \
                   boosted\n";
        assert_eq!(logged_boosts(log), 8.0);
        assert!(logged_boosts("vCPU boosts: none").is_nan());
    }
}
