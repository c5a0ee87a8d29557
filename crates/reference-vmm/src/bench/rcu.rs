//! `bench rcu`: what reading the device bus costs on every exit (RCU, a
//! read-write lock, arc-swap), and how long a writer waits for a grace period
//! while vCPUs run guest code, with guest mode as an extended quiescent state
//! and without.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use crate::bench::{Cell, Options, Table, measure, median, ticks_per_us};
use crate::error::Error;
use crate::mechanisms::{BusAccess, Mechanisms};

/// Exits per vCPU for the lookup cost, without `--quick`.
const LOOKUP_EXITS: u64 = 20_000;
/// Exits per vCPU for the grace periods, without `--quick`.
const GP_EXITS: u64 = 2_000;
/// Pause instructions between exits while grace periods are measured.
const GP_PAUSES: u64 = 2_000;
const VCPUS: u32 = 2;

/// Runs the scenario: two tables' worth of rows in one.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let mut t = Table::new(
        format!("rcu: device-bus reads on the exit path and writer grace periods, {VCPUS} vCPUs"),
        &["measure", "variant", "value", "vs baseline"],
    );
    lookups(opts, progress, &mut t)?;
    grace_periods(opts, progress, &mut t)?;
    Ok(t)
}

fn lookups(opts: Options, progress: &mut dyn FnMut(&str), t: &mut Table) -> Result<(), Error> {
    const MODES: [BusAccess; 3] = [BusAccess::RwLock, BusAccess::Rcu, BusAccess::ArcSwap];
    let exits = opts.rounds(LOOKUP_EXITS);
    let mut ns = vec![Vec::new(); MODES.len()];
    for rep in 0..opts.reps() {
        for (i, &bus) in MODES.iter().enumerate() {
            progress(&format!("rcu: --bus {bus} ({}/{})", rep + 1, opts.reps()));
            let m = Mechanisms {
                bus,
                ..Mechanisms::default()
            };
            let run = measure("port-exits", VCPUS, m, &[exits, 1], |_| {})?;
            let s = run.report.stats;
            ns[i].push(
                s.bus_lookup_ticks as f64 / ticks_per_us() * 1e3 / s.bus_lookups.max(1) as f64,
            );
        }
    }
    let ns: Vec<f64> = ns.iter().map(|v| median(v)).collect();
    for (i, bus) in MODES.iter().enumerate() {
        t.row(vec![
            Cell::text("bus read + device write per exit (ns)"),
            Cell::text(format!("--bus {bus}")),
            Cell::num(ns[i], 0),
            Cell::ratio(ns[i] / ns[0]),
        ]);
    }
    t.note(format!(
        "Bus reads: every vCPU makes {exits} POST-code port writes back to back; the VMM times, with the TSC, the bus lookup and the device's write on each exit (the vCPU thread is already back online); median of {} runs.",
        opts.reps()
    ));
    Ok(())
}

fn grace_periods(
    opts: Options,
    progress: &mut dyn FnMut(&str),
    t: &mut Table,
) -> Result<(), Error> {
    let exits = opts.rounds(GP_EXITS);
    let mut rows = Vec::new();
    for extended_qs in [false, true] {
        progress(&format!(
            "rcu: grace periods, extended QS {}",
            if extended_qs { "on" } else { "off" }
        ));
        let m = Mechanisms {
            extended_qs,
            ..Mechanisms::default()
        };
        let stop = Arc::new(AtomicBool::new(false));
        let mut writer = None;
        let run = measure("port-exits", VCPUS, m, &[exits, GP_PAUSES], |vm| {
            let (domain, stop) = (vm.rcu_domain(), stop.clone());
            writer = Some(thread::spawn(move || {
                let mut waits = Vec::new();
                while !stop.load(Ordering::SeqCst) {
                    let start = Instant::now();
                    if domain.synchronize().is_err() {
                        break;
                    }
                    waits.push(start.elapsed().as_secs_f64() * 1e6);
                    thread::sleep(Duration::from_micros(200));
                }
                waits
            }));
        })?;
        stop.store(true, Ordering::SeqCst);
        let waits = writer
            .map(|w| w.join().unwrap_or_default())
            .unwrap_or_default();
        let interval = run.wall.as_secs_f64() * 1e6 / exits as f64;
        rows.push((
            extended_qs,
            median(&waits),
            max(&waits),
            interval,
            waits.len(),
        ));
    }
    let base = rows[0].1;
    for &(on, p50, worst, interval, n) in &rows {
        let name = if on {
            "extended QS on (offline in the guest)"
        } else {
            "extended QS off (QS at each exit)"
        };
        t.row(vec![
            Cell::text("grace period p50 (µs)"),
            Cell::text(name),
            Cell::num(p50, 1),
            Cell::ratio(p50 / base),
        ]);
        t.row(vec![
            Cell::text("grace period max (µs)"),
            Cell::text(name),
            Cell::num(worst, 1),
            Cell::text(""),
        ]);
        t.note(format!(
            "Grace periods, {}: {n} synchronize() calls, 200 µs apart, while each vCPU exits every {interval:.0} µs on average ({GP_PAUSES} pauses between exits).",
            if on { "on" } else { "off" }
        ));
    }
    let (on, off) = (&rows[1], &rows[0]);
    t.note(format!(
        "Goal: with the extended QS a grace period completes in under 10 µs while vCPUs run guest code ({}); without it, it is bounded by the exit interval (p50 {:.1} µs, max {:.1} µs, against an interval of {:.0} µs: {}).",
        if on.1 < 10.0 { format!("p50 {:.1} µs: met", on.1) } else { format!("p50 {:.1} µs: not met", on.1) },
        off.1,
        off.2,
        off.3,
        if off.1 <= 2.0 * off.3 { "bounded at p50; the max also counts vCPU threads the host descheduled while online" } else { "not bounded" }
    ));
    Ok(())
}

fn max(values: &[f64]) -> f64 {
    values.iter().copied().fold(f64::NAN, f64::max)
}
