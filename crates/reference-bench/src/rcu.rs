//! `reference-bench rcu`: what reading the device bus costs on every exit (RCU, a
//! read-write lock, arc-swap), and how long a writer waits for a grace period
//! while vCPUs run guest code, with guest mode as an extended quiescent state
//! and without.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::thread;
use std::time::{Duration, Instant};

use crate::Error;
use crate::{Cell, Options, Runs, Table, config, goal, measure, measure_config, ticks_per_us};
use arc_swap::ArcSwap;
use rcu_qs::{Domain, Reader};
use reference_vmm::devices::{BusAccess, BusRead, IoBus, RcuBus};
use reference_vmm::{FamilyPolicies, Policies};
use reference_vmm_cli::presets::Choices;

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
    const MODES: [Bus; 4] = [Bus::RwLock, Bus::Rcu, Bus::ArcSwap, Bus::RcuInPlace];
    let exits = opts.rounds(LOOKUP_EXITS);
    let mut ns = vec![Runs::new(); MODES.len()];
    for rep in 0..opts.reps() {
        for (i, &bus) in MODES.iter().enumerate() {
            progress(&format!("rcu: {bus} ({}/{})", rep + 1, opts.reps()));
            let mut config = config(VCPUS, Choices::default(), &[exits, 1]);
            config.policies = Arc::new(bus);
            let run = measure_config("port-exits", config, |_| {})?;
            let s = run.report.stats;
            ns[i].push(
                s.bus_lookup_ticks as f64 / ticks_per_us() * 1e3 / s.bus_lookups.max(1) as f64,
            );
        }
    }
    for (i, bus) in MODES.iter().enumerate() {
        t.row(vec![
            Cell::text("bus read + device write per exit (ns)"),
            Cell::text(bus.to_string()),
            Cell::runs(&ns[i], 0),
            Cell::ratio(&ns[i].ratio_to(&ns[0])),
        ]);
    }
    t.better("fewer ns per exit; shorter grace periods (their max is the longest of all runs)");
    t.note(format!(
        "Bus reads: every vCPU makes {exits} POST-code port writes back to back; the VMM times, with the TSC, the bus lookup and the device's write on each exit (the vCPU thread is already back online; each vCPU thread keeps its own count, so nothing both vCPUs write is inside the timed region); {} runs per variant, alternating.",
        opts.reps()
    ));
    let [rwlock, rcu, arc_swap, in_place] = [&ns[0], &ns[1], &ns[2], &ns[3]];
    t.note(format!(
        "The first three read through a BusAccess trait object, the hook a VMM author's own access takes, so that they differ in their synchronisation alone; the last is the VMM's default, its RCU cell read in place. The trait object's call cost {:.0} ns per exit here (the RCU rows' medians apart).",
        rcu.median() - in_place.median()
    ));
    let per_run: Vec<bool> = (0..rcu.0.len())
        .map(|i| rcu.0[i] <= rwlock.0[i] && rcu.0[i] <= arc_swap.0[i])
        .collect();
    t.note(goal(
        "the RCU bus read no slower than the RwLock's and arc-swap's",
        &format!(
            "{:.0} ns against {:.0} ns and {:.0} ns",
            rcu.median(),
            rwlock.median(),
            arc_swap.median()
        ),
        rcu.median() <= rwlock.median() && rcu.median() <= arc_swap.median(),
        &per_run,
    ));
    Ok(())
}

/// One run's grace periods: p50 and max wait (µs), and the mean interval
/// between two exits of a vCPU (µs).
struct GracePeriods {
    p50: f64,
    max: f64,
    exit_interval: f64,
}

fn grace_periods(
    opts: Options,
    progress: &mut dyn FnMut(&str),
    t: &mut Table,
) -> Result<(), Error> {
    let exits = opts.rounds(GP_EXITS);
    let mut runs: [Vec<GracePeriods>; 2] = Default::default();
    for rep in 0..opts.reps() {
        for (extended_qs, runs) in [false, true].into_iter().zip(&mut runs) {
            progress(&format!(
                "rcu: grace periods, extended QS {} ({}/{})",
                if extended_qs { "on" } else { "off" },
                rep + 1,
                opts.reps()
            ));
            runs.push(grace_period_run(extended_qs, exits)?);
        }
    }
    let p50 = runs
        .each_ref()
        .map(|r| Runs(r.iter().map(|g| g.p50).collect()));
    let worst = runs
        .each_ref()
        .map(|r| r.iter().map(|g| g.max).fold(f64::NAN, f64::max));
    let interval = runs
        .each_ref()
        .map(|r| Runs(r.iter().map(|g| g.exit_interval).collect()));
    for (i, name) in [
        "extended QS off (QS at each exit)",
        "extended QS on (offline in the guest)",
    ]
    .into_iter()
    .enumerate()
    {
        t.row(vec![
            Cell::text("grace period p50 (µs)"),
            Cell::text(name),
            Cell::runs(&p50[i], 1),
            Cell::ratio(&p50[i].ratio_to(&p50[0])),
        ]);
        t.row(vec![
            Cell::text("grace period max (µs)"),
            Cell::text(name),
            Cell::num(worst[i], 1),
            Cell::text(""),
        ]);
    }
    t.note(format!(
        "Grace periods: a writer calls synchronize() every 200 µs while each vCPU exits every {:.0} µs on average ({GP_PAUSES} pauses between exits), {} runs per setting, alternating.",
        interval[0].median(),
        opts.reps()
    ));
    t.note(goal(
        "with the extended QS a grace period completes in under 10 µs while vCPUs run guest code",
        &format!("p50 {:.1} µs", p50[1].median()),
        p50[1].median() < 10.0,
        &p50[1].each(|p| p < 10.0),
    ));
    let bounded = p50[0].median() <= 2.0 * interval[0].median();
    t.note(format!(
        "Without it, a grace period waits for every vCPU's next exit: p50 {:.1} µs against an exit interval of {:.0} µs ({}); the max also counts vCPU threads the host descheduled while online.",
        p50[0].median(),
        interval[0].median(),
        if bounded { "bounded by it" } else { "longer than two intervals" }
    ));
    Ok(())
}

/// Runs `port-exits` while a writer thread waits for grace periods.
fn grace_period_run(extended_qs: bool, exits: u64) -> Result<GracePeriods, Error> {
    let m = Choices {
        extended_qs,
        ..Choices::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut writer = None;
    let run = measure("port-exits", VCPUS, m, &[exits, GP_PAUSES], |vm| {
        let (domain, stop) = (vm.rcu_domain(), stop.clone());
        writer = Some(thread::spawn(move || {
            let mut waits = Runs::new();
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
    Ok(GracePeriods {
        p50: waits.median(),
        max: waits.range().1,
        exit_interval: run.wall.as_secs_f64() * 1e6 / exits as f64,
    })
}

/// How the vCPU threads read the bus: the family's RCU cell or one of its
/// baselines, each a [`BusAccess`] the VMM takes as a policy, or the VMM's
/// own RCU cell in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bus {
    /// rcu-qs: a load and a dereference per lookup.
    Rcu,
    /// A read lock per lookup.
    RwLock,
    /// arc-swap: a guarded load per lookup.
    ArcSwap,
    /// The VMM's default: its RCU cell, read with no indirect call.
    RcuInPlace,
}

impl std::fmt::Display for Bus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Rcu => "rcu",
            Self::RwLock => "rwlock",
            Self::ArcSwap => "arc-swap",
            Self::RcuInPlace => "rcu in place (the VMM's default)",
        })
    }
}

/// The family's policies, with the bus read this way.
impl Policies for Bus {
    fn bus(&self, bus: IoBus, domain: &Domain) -> BusRead {
        let custom: Box<dyn BusAccess> = match self {
            Self::RcuInPlace => return FamilyPolicies.bus(bus, domain),
            Self::Rcu => Box::new(RcuBus::new(domain, bus)),
            Self::RwLock => Box::new(RwLockBus(RwLock::new(bus))),
            Self::ArcSwap => Box::new(ArcSwapBus(ArcSwap::from_pointee(bus))),
        };
        BusRead::Custom(custom)
    }
}

/// The bus behind a `RwLock`.
struct RwLockBus(RwLock<IoBus>);

impl BusAccess for RwLockBus {
    fn read(&self, _: &Reader, f: &mut dyn FnMut(&IoBus)) {
        f(&self.0.read().unwrap_or_else(PoisonError::into_inner))
    }

    fn replace(&self, bus: IoBus) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = bus;
    }
}

/// The bus behind an `ArcSwap`.
struct ArcSwapBus(ArcSwap<IoBus>);

impl BusAccess for ArcSwapBus {
    fn read(&self, _: &Reader, f: &mut dyn FnMut(&IoBus)) {
        f(&self.0.load())
    }

    fn replace(&self, bus: IoBus) {
        self.0.store(Arc::new(bus));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reference_vmm::devices::SerialConsole;

    #[test]
    fn every_bus_read_sees_the_bus_and_its_replacement() {
        let domain = Domain::new();
        for mode in [Bus::Rcu, Bus::RwLock, Bus::ArcSwap] {
            let mut bus = IoBus::new();
            let console = SerialConsole::new(Box::new(std::io::sink()));
            bus.insert(0x3f8, 8, Arc::new(console)).unwrap();
            let BusRead::Custom(shared) = mode.bus(bus, &domain) else {
                panic!("{mode} is read through its BusAccess");
            };
            let reader = domain.register_reader();
            let found = |shared: &dyn BusAccess| {
                let mut found = None;
                shared.read(&reader, &mut |b| found = Some(b.find(0x3f9).is_some()));
                found
            };
            assert_eq!(found(&*shared), Some(true), "{mode}");
            shared.replace(IoBus::new());
            assert_eq!(found(&*shared), Some(false), "{mode}");
        }
        let in_place = Bus::RcuInPlace.bus(IoBus::new(), &domain);
        assert!(matches!(in_place, BusRead::Rcu(_)));
    }
}
