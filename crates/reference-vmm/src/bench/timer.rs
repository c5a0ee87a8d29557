//! `bench timer`: a guest cyclictest. The guest arms TSC-deadline timers,
//! halts until each fires, and records how late its interrupt entry ran; each
//! timer-advance policy in turn, then KVM's in-kernel LAPIC timer.

use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use crate::bench::{Cell, Options, Runs, Table, goal, measure, ticks_per_us};
use crate::error::Error;
use crate::layout::SAMPLES_ADDR;
use crate::mechanisms::{HaltPoll, Irqchip, Mechanisms, TimerAdvance};

/// Timers per run, without `--quick`.
const SAMPLES: u64 = 2000;
/// Lateness histogram bucket bounds, µs.
const BUCKETS: [f64; 6] = [0.0, 5.0, 10.0, 20.0, 50.0, 100.0];

/// The advance policies on the userspace APIC, baseline first, then KVM's
/// in-kernel LAPIC timer (its own adaptive advance), with KVM's halt polling
/// as configured (`halt_poll_ns`) and polling up to 10 ms.
fn variants() -> [(String, Mechanisms); 6] {
    let user = |timer_advance| {
        (
            format!("--timer-advance {timer_advance}"),
            Mechanisms {
                timer_advance,
                ..Mechanisms::default()
            },
        )
    };
    [
        user(TimerAdvance::None),
        user(TimerAdvance::Fixed(Duration::from_micros(50))),
        user(TimerAdvance::Kvm),
        user(TimerAdvance::Own),
        kernel(HaltPoll::Kvm),
        kernel(HaltPoll::Always),
    ]
}

/// KVM's LAPIC with its halt polling as `halt_poll` sets it.
fn kernel(halt_poll: HaltPoll) -> (String, Mechanisms) {
    let name = match halt_poll.kvm_window() {
        Some(_) => format!("--irqchip kernel --halt-poll {halt_poll}"),
        None => "--irqchip kernel".into(),
    };
    let m = Mechanisms {
        irqchip: Irqchip::Kernel,
        halt_poll,
        ..Mechanisms::default()
    };
    (name, m)
}

const NONE: usize = 0;
const OWN: usize = 3;
const KERNEL: [usize; 2] = [4, 5];

/// Runs the scenario at 1 ms and 200 µs periods.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let samples = opts.rounds(SAMPLES);
    let mut t = Table::new(
        "timer: guest cyclictest, TSC-deadline timer, lateness of the interrupt entry",
        &[
            "period",
            "variant",
            "min (µs)",
            "p50 (µs)",
            "p99 (µs)",
            "max (µs)",
            "p50 vs none",
            "histogram <0/5/10/20/50/100/more µs",
        ],
    );
    let mut goals = Vec::new();
    for period_us in [1000u64, 200] {
        let period_ticks = (period_us as f64 * ticks_per_us()) as u64;
        let mut runs: Vec<Vec<Vec<f64>>> = vec![Vec::new(); variants().len()];
        for rep in 0..opts.reps() {
            for (i, (name, m)) in variants().into_iter().enumerate() {
                progress(&format!(
                    "timer: {period_us} µs, {name} ({}/{})",
                    rep + 1,
                    opts.reps()
                ));
                runs[i].push(lateness(m, samples, period_ticks)?);
            }
        }
        let p50: Vec<Runs> = runs
            .iter()
            .map(|r| Runs(r.iter().map(|lat| percentile(lat, 0.5)).collect()))
            .collect();
        for (i, (name, _)) in variants().into_iter().enumerate() {
            // The percentiles of the run with the median p50.
            let lat = runs[i]
                .iter()
                .find(|l| percentile(l, 0.5) == p50[i].median())
                .map_or(&[][..], Vec::as_slice);
            t.row(vec![
                Cell::text(format!("{period_us} µs")),
                Cell::text(name),
                Cell::num(percentile(lat, 0.0), 1),
                Cell::num(percentile(lat, 0.5), 1),
                Cell::num(percentile(lat, 0.99), 1),
                Cell::num(percentile(lat, 1.0), 1),
                Cell::ratio(&p50[i].ratio_to(&p50[NONE])),
                Cell::text(histogram(lat)),
            ]);
        }
        goals.push(timer_goal(period_us, &p50));
    }
    t.better("lateness near 0 and never below it (a timer seen before its deadline is a bug), a lower p50 vs none; the percentiles are those of the run with the median p50");
    t.note(format!(
        "{samples} timers per run, {} runs per variant, alternating; the guest halts between timers (the userspace APIC's vCPUs wait through halt-poll's own policy, which with an advance leaves the timer to the advance; KVM's LAPIC halts in the kernel, with its halt polling and lapic_timer_advance).",
        opts.reps()
    ));
    for line in goals {
        t.note(line);
    }
    Ok(t)
}

/// The goal at one period, from each variant's p50 per run: own at most a
/// third of none's, and below the better in-kernel row of the same run.
fn timer_goal(period_us: u64, p50: &[Runs]) -> String {
    let own = &p50[OWN];
    let vs_none = own.ratio_to(&p50[NONE]);
    let kernel = p50[KERNEL[0]].zip(&p50[KERNEL[1]], f64::min);
    let meets = |own: f64, vs_none: f64, kernel: f64| vs_none <= 1.0 / 3.0 && own < kernel;
    let per_run = (0..own.0.len())
        .map(|i| meets(own.0[i], vs_none.0[i], kernel.0[i]))
        .collect::<Vec<_>>();
    goal(
        &format!(
            "at {period_us} µs, own p50 at most a third of none's, and below the in-kernel LAPIC timer's p50 in the same run (--irqchip kernel: the same guest on KVM's LAPIC; the better of its two halt-polling settings)"
        ),
        &format!(
            "own p50 {:.1} µs, {} of none's, against the in-kernel timer's best {:.1} µs ({})",
            own.median(),
            vs_none.ratio_text(),
            kernel.median(),
            own.ratio_to(&kernel).ratio_text()
        ),
        meets(own.median(), vs_none.median(), kernel.median()),
        &per_run,
    )
}

/// One run: the lateness of each timer, µs.
fn lateness(m: Mechanisms, samples: u64, period_ticks: u64) -> Result<Vec<f64>, Error> {
    let run = measure("cyclictest", 1, m, &[samples, period_ticks], |_| {})?;
    let n = run.report.value(0, "samples").unwrap_or(0).min(samples) as usize;
    let mut bytes = vec![0u8; n * 8];
    run.memory
        .read_slice(&mut bytes, GuestAddress(SAMPLES_ADDR))
        .map_err(|source| Error::WriteMemory {
            what: "the samples (reading)",
            source,
        })?;
    let us = ticks_per_us();
    Ok(bytes
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()) as f64 / us)
        .collect())
}

/// The `q` quantile of `values` (0: min, 1: max).
fn percentile(values: &[f64], q: f64) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Counts per bucket: below 0, then up to each bound, then above the last.
fn histogram(values: &[f64]) -> String {
    let mut counts = [0usize; BUCKETS.len() + 1];
    for &v in values {
        let bucket = BUCKETS.iter().position(|&b| v < b).unwrap_or(BUCKETS.len());
        counts[bucket] += 1;
    }
    counts.map(|c| c.to_string()).join("/")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_histogram() {
        let v = [-1.0, 3.0, 7.0, 12.0, 30.0, 70.0, 200.0];
        assert_eq!(percentile(&v, 0.0), -1.0);
        assert_eq!(percentile(&v, 0.5), 12.0);
        assert_eq!(percentile(&v, 1.0), 200.0);
        assert!(percentile(&[], 0.5).is_nan());
        assert_eq!(histogram(&v), "1/1/1/1/1/1/1");
    }
}
