//! The booster's bound against threads that never give a boost back: three
//! "vCPU" threads busy-loop for ever, on the booster's own CPU, so a boosted
//! one (`SCHED_FIFO`) keeps the booster off that CPU and never returns to ask
//! for its boost to end. Only the revoker can end each boost. A sampler
//! thread, above everything and on another CPU, reads each target's
//! scheduling policy from outside (`sched_getattr`) every 20 µs. Each run
//! tries the default revoker (anywhere, `SCHED_DEADLINE`), then the same with
//! a second revoker on the sampler's CPU, away from the targets
//! (`FifoBoost::with_revoker_cpus`).
//!
//! With `--requests held` or `--requests flipped` the boosts are the ones
//! a hostile guest asks for (`GuestBoosts`): each target's request word says
//! it is in a critical section, for ever (one request), or it flips the mark
//! and the request's sequence as fast as it can, and the main loop grants
//! what the words ask through the targets' real thread probes.
//!
//! `cargo run --release -p vcpu-sched --example boost_bound [-- --json] [--seconds N] [--runs N] [--hogs N] [--requests held|flipped] [--max-boost-us N]`
//!
//! Prints, per run and revoker placement (with `--json`, one object per run:
//! two revokers, and `one_revoker` inside), `boosts`, `revoked_by_deadline`, `budget_us` (`max_boost`),
//! `max_boost_us` (the longest time a target may have been real-time: from
//! the last sample before to the first sample after, over the stretches
//! the sampler watched throughout), `max_boost_certain_us` (the longest it
//! certainly was: from the first real-time sample to the last, over every
//! stretch, watched or not), `max_boost_cpu_us` (the
//! most CPU time a target ran in one such stretch, from its `schedstat`),
//! `unrecorded_fifo_samples` (samples of a real-time target while the
//! booster had no record of boosting it), and `max_period_boost_us` (the
//! most time one target may have been real-time within one budget period,
//! counting each real-time sample as real-time since the pass before).
//! Goal: `max_boost_us` and `max_boost_certain_us` at most `budget_us` +
//! 1000, `max_period_boost_us` at most twice the budget per period plus
//! `budget_us`, + 1000 µs (`period_bound_us`: the booster counts its periods
//! from a vCPU's first boost in each, so a sampler's period can hold the end
//! of one and the start of the next, each up to the budget plus the boost
//! begun just under it), and no unrecorded sample. The CPU time tells why a
//! stretch was long: much less CPU than wall time means the target's CPU ran
//! nothing of ours (the host took it, which delays the revoker's timer on
//! that CPU too); as much CPU means the target really kept it. A stretch
//! during which (or just before which) the sampler itself was off its CPU
//! for over 250 µs has no tight upper bound: it is counted apart
//! (`unwatched_stretches`, with `max_sampler_gap_us`), and only its certain
//! length counts.
//!
//! `--seconds N` is per run and placement (default 6), `--runs N` repeats
//! the runs (default 1), `--hogs N` keeps N CPU-hog threads running
//! throughout (default 0), as other tenants would, `--max-boost-us N` sets
//! `max_boost` (default 1000, `BoostBudget`'s; 100 is the reference VMM's
//! for boosts on delivery). With `--update-results` the table also goes to the
//! crate's RESULTS.md,
//! section "boost bound" (or "boost bound beside hogs", with ", N µs
//! boosts" for another `max_boost`).

// The workspace's CPU hogs and RESULTS.md writer (test-support's), copies of which ship with the crate.
#[path = "support/hogs.rs"]
#[allow(dead_code, reason = "only the hogs' start and stop are used here")]
mod hogs;
#[path = "support/results.rs"]
mod results;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::thread;
use std::time::{Duration, Instant};

use vcpu_sched::thread::{available_cpus, current_tid, get_attr, pin, set_attr};
use vcpu_sched::{
    BoostBudget, BoostRequest, Booster, FifoBoost, GuestBoosts, NoBoost, NoGuestView,
    RequestLimits, SchedAttr, SchedEvents, SchedStats, Scheduler, Tid,
};

const TARGETS: usize = 3;
const SAMPLE_EVERY: Duration = Duration::from_micros(20);

/// Counts boosts per target (to tell a boost that came and went between two
/// samples from one that was never recorded) and restores, and everything else as
/// `SchedStats` does.
#[derive(Default)]
struct Events {
    stats: SchedStats,
    boosts: [AtomicU64; TARGETS],
    /// Restores begun per target (to tell one long boost from two that
    /// the sampler saw no gap between).
    unboosts: [AtomicU64; TARGETS],
}

impl SchedEvents for Events {
    fn boosted(&self, vcpu: usize) {
        self.stats.boosted(vcpu);
        self.boosts[vcpu].fetch_add(1, SeqCst);
    }
    fn unboosted(&self, vcpu: usize, held: Duration, revoked: bool) {
        self.unboosts[vcpu].fetch_add(1, SeqCst);
        self.stats.unboosted(vcpu, held, revoked);
    }
    fn boost_failed(&self, vcpu: usize, error: &std::io::Error) {
        self.stats.boost_failed(vcpu, error);
    }
    fn restore_failed(&self, vcpu: usize, error: &std::io::Error) {
        self.stats.restore_failed(vcpu, error);
    }
    fn revoker_failed(&self, error: &std::io::Error) {
        self.stats.revoker_failed(error);
    }
}

struct Args {
    json: bool,
    seconds: u64,
    runs: u64,
    hogs: u64,
    requests: Option<Requests>,
    /// `max_boost`, where not the default's.
    max_boost_us: Option<u64>,
}

/// What a hostile guest's request words say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Requests {
    /// In one critical section for ever.
    Held,
    /// Entering and leaving critical sections as fast as it can.
    Flipped,
}

impl Requests {
    fn name(self) -> &'static str {
        match self {
            Self::Held => "held",
            Self::Flipped => "flipped",
        }
    }
}

fn args() -> Result<Args, String> {
    let mut args = Args {
        json: false,
        seconds: 6,
        runs: 1,
        hogs: 0,
        requests: None,
        max_boost_us: None,
    };
    let mut it = results::args();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--json" => args.json = true,
            "--requests" => {
                args.requests = Some(match it.next().as_deref() {
                    Some("held") => Requests::Held,
                    Some("flipped") => Requests::Flipped,
                    other => return Err(format!("--requests {other:?}: held or flipped")),
                });
            }
            "--seconds" | "--runs" | "--hogs" | "--max-boost-us" => {
                let n = it.next().ok_or(format!("{arg} needs a number"))?;
                let least = u64::from(arg != "--hogs");
                let n = n
                    .parse()
                    .ok()
                    .filter(|&s| s >= least)
                    .ok_or(format!("{arg} {n:?}: a whole number, at least {least}"))?;
                match arg.as_str() {
                    "--runs" => args.runs = n,
                    "--hogs" => args.hogs = n,
                    "--max-boost-us" => args.max_boost_us = Some(n),
                    _ => args.seconds = n,
                }
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}; use [--json] [--seconds N] [--runs N] [--hogs N] [--requests held|flipped] [--max-boost-us N]"
                ));
            }
        }
    }
    Ok(args)
}

/// What the sampler saw.
#[derive(Default)]
struct Seen {
    samples: u64,
    /// The longest real-time stretch the sampler watched throughout, from
    /// the samples around it.
    max_fifo: Duration,
    /// The longest real-time stretch from its first real-time sample to its
    /// last, watched or not.
    max_fifo_certain: Duration,
    /// The most CPU time a target ran in one watched real-time stretch.
    max_fifo_cpu: Duration,
    /// Real-time samples with no record around them.
    unrecorded: u64,
    /// Real-time stretches during which the sampler itself was off its CPU
    /// for over `UNWATCHED` (the machine stalled): not measurable.
    unwatched: u64,
    /// The sampler's longest gap between two passes.
    max_gap: Duration,
    /// The most real-time time of one target in one budget period, each
    /// real-time sample counting since the pass before.
    max_period_fifo: Duration,
    /// The time the host ran nothing of this machine on the shared CPU
    /// (its steal time) during the run.
    stolen: Duration,
}

impl Seen {
    /// Counts stretch `s` of target `tid`, which a sample at `now` saw end.
    fn end(&mut self, s: &Stretch, tid: Tid, now: Instant, w: &Watch) {
        self.max_fifo_certain = self.max_fifo_certain.max(s.last - s.first);
        if !s.seen_begin || w.stalled {
            self.unwatched += 1;
            return;
        }
        self.max_fifo = self.max_fifo.max(now - w.last_other);
        let ran = cpu_time(tid).saturating_sub(s.cpu_at_first);
        self.max_fifo_cpu = self.max_fifo_cpu.max(ran);
    }
}

/// A gap between two sampling passes beyond this means the sampler, above
/// everything on its CPU, did not run: the machine, not the booster, stalled.
const UNWATCHED: Duration = Duration::from_micros(250);

fn is_fifo(tid: Tid) -> bool {
    get_attr(tid).is_ok_and(|a| a.policy == libc::SCHED_FIFO as u32)
}

/// The steal time of `cpu` so far: how long the host (this machine is a VM)
/// ran something else on it, from `/proc/stat` (0 if unreadable).
fn steal(cpu: usize) -> Duration {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let name = format!("cpu{cpu}");
    // SAFETY: sysconf reads a constant of the system and touches no memory of ours.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    stat.lines()
        .find(|l| l.split_whitespace().next() == Some(name.as_str()))
        .and_then(|l| l.split_whitespace().nth(8)?.parse::<u64>().ok())
        .map_or(Duration::ZERO, |t| {
            Duration::from_millis(t * 1000 / ticks_per_s)
        })
}

/// The CPU time thread `tid` of this process has run (the first field of
/// its `schedstat`, in ns; 0 if unreadable).
fn cpu_time(tid: Tid) -> Duration {
    std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .map_or(Duration::ZERO, Duration::from_nanos)
}

/// One target as the sampler follows it.
struct Watch {
    /// The last sample that saw it not real-time.
    last_other: Instant,
    /// Whether the sampler stalled since that sample (then the stretch
    /// after it has no tight bound).
    stalled: bool,
    /// The real-time stretch it is in, if any.
    stretch: Option<Stretch>,
    /// The budget period it is in, and its real-time time in it so far.
    period: (u128, Duration),
}

/// A run of real-time samples of one target within one boost.
struct Stretch {
    first: Instant,
    last: Instant,
    /// The target's CPU time at the first sample.
    cpu_at_first: Duration,
    /// The target's restores counted before the first sample: while the
    /// count stays, no restore began, so the target stayed real-time
    /// between the samples.
    unboosts: u64,
    /// Whether the sample before it saw the target not real-time (not in
    /// another boost that ended unseen).
    seen_begin: bool,
}

/// Samples every target until `stop`: the longest real-time stretch of each
/// (bounded by the samples around it), the CPU time it ran in it (from the
/// first sample inside to the first after, so within a sampling pass of the
/// truth), and real-time samples that no record covers (no record before,
/// none after, and no boost in between).
fn sample(
    tids: &[Tid],
    booster: &Booster<FifoBoost, Arc<Events>>,
    (events, period): (&Events, Duration),
    stop: &AtomicBool,
) -> Seen {
    let mut seen = Seen::default();
    let start = Instant::now();
    let mut watches: Vec<Watch> = tids
        .iter()
        .map(|_| Watch {
            last_other: start,
            stalled: false,
            stretch: None,
            period: (0, Duration::ZERO),
        })
        .collect();
    let mut last_pass = start;
    while !stop.load(SeqCst) {
        let gap = last_pass.elapsed();
        seen.max_gap = seen.max_gap.max(gap);
        if gap > UNWATCHED {
            watches.iter_mut().for_each(|w| w.stalled = true);
        }
        last_pass = Instant::now();
        for (v, (&tid, w)) in tids.iter().zip(&mut watches).enumerate() {
            let unboosts = events.unboosts[v].load(SeqCst);
            let boosts = events.boosts[v].load(SeqCst);
            let recorded_before = booster.is_boosted(v);
            let fifo = is_fifo(tid);
            let recorded_after = booster.is_boosted(v);
            let unchanged = events.boosts[v].load(SeqCst) == boosts;
            let same_boost = |s: &Stretch| events.unboosts[v].load(SeqCst) == s.unboosts;
            let now = Instant::now();
            seen.samples += 1;
            let this_period = (now - start).as_nanos() / period.as_nanos().max(1);
            if w.period.0 != this_period {
                w.period = (this_period, Duration::ZERO);
            }
            if fifo {
                w.period.1 += gap.min(UNWATCHED);
                seen.max_period_fifo = seen.max_period_fifo.max(w.period.1);
            }
            if !fifo {
                if let Some(s) = w.stretch.take() {
                    seen.end(&s, tid, now, w);
                }
                (w.stalled, w.last_other) = (false, now);
                continue;
            }
            seen.unrecorded += u64::from(!recorded_before && !recorded_after && unchanged);
            match &mut w.stretch {
                Some(s) if same_boost(s) => s.last = now,
                other => {
                    // A new boost; one before it, if any, ended unseen.
                    let seen_begin = other.is_none();
                    if let Some(s) = other.take() {
                        seen.max_fifo_certain = seen.max_fifo_certain.max(s.last - s.first);
                        seen.unwatched += 1;
                    }
                    *other = Some(Stretch {
                        first: now,
                        last: now,
                        cpu_at_first: cpu_time(tid),
                        unboosts,
                        seen_begin,
                    });
                }
            }
        }
        thread::sleep(SAMPLE_EVERY);
    }
    seen
}

fn main() {
    let args = match args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let cpus = available_cpus().expect("sched_getaffinity");
    let (shared_cpu, sampler_cpu) = match cpus[..] {
        [shared, .., sampler] => (shared, sampler),
        _ => {
            eprintln!(
                "error: this example needs two CPUs: one shared by the booster and its targets, one to watch from"
            );
            std::process::exit(1);
        }
    };
    // Started before this thread is pinned: the hogs may run anywhere.
    let _hogs = hogs::Hogs::start(args.hogs as usize);
    pin(0, &[shared_cpu]).expect("pin the booster");
    if let Err(e) = FifoBoost::default().check() {
        eprintln!("error: this example boosts threads to SCHED_FIFO: {e}");
        std::process::exit(1);
    }
    let mut budget = BoostBudget::default();
    if let Some(us) = args.max_boost_us {
        budget.max_boost = Duration::from_micros(us);
    }
    let mut table = format!(
        "{} CPU hogs throughout; {} s per run, {TARGETS} targets busy-looping on the booster's CPU, max_boost {} µs; \
         boosts {}; goal: real-time at most max_boost + 1000 µs by both bounds, at most twice the {} µs per {} ms period plus max_boost, + 1000 µs, \
         in any period of the sampler's (two of the booster's may meet in it), and no real-time sample without a record\n\n\
         | run | revokers | boosts | revoked by deadline | longest real-time µs, at most | longest real-time µs, at least | most CPU in one boost µs | most real-time in one period µs, at most | host took the shared CPU, ms | unrecorded samples | unwatched stretches | goal |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
        args.hogs,
        args.seconds,
        budget.max_boost.as_micros(),
        match args.requests {
            None => "asked for by the main loop, for every target, as fast as it can".to_string(),
            Some(r) => format!(
                "asked for by a hostile guest's request words ({}), granted by GuestBoosts (3 ms per request)",
                r.name()
            ),
        },
        budget.per_period.as_micros(),
        budget.period.as_millis(),
    );
    for run in 1..=args.runs {
        let mut json = Vec::new();
        for placement in [Placement::Anywhere, Placement::AlsoAway] {
            let control = match placement {
                Placement::Anywhere => FifoBoost::default(),
                Placement::AlsoAway => FifoBoost::default().with_revoker_cpus(&[sampler_cpu]),
            };
            let (events, seen) = run_once(&args, control, budget, shared_cpu, sampler_cpu);
            let (row, fields) = report(&args, (run, placement), &events.stats, budget, &seen);
            table.push_str(&row);
            json.push(fields);
        }
        if args.json {
            // One object per run: two revokers, with one revoker's run inside.
            println!(
                "{{\"revokers\": 2, {}, \"one_revoker\": {{{}}}}}",
                json[1], json[0]
            );
        }
    }
    let command = results::command("cargo run --release -p vcpu-sched --example boost_bound");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    let mut section = match (args.requests, args.hogs) {
        (None, 0) => "boost bound".to_string(),
        (None, _) => "boost bound beside hogs".to_string(),
        (Some(r), 0) => format!("boost bound, guest requests {}", r.name()),
        (Some(r), _) => format!("boost bound, guest requests {} beside hogs", r.name()),
    };
    if let Some(us) = args.max_boost_us {
        section.push_str(&format!(", {us} µs boosts"));
    }
    results::write_section_if_asked(&path, "vcpu-sched", &section, &command, &table);
}

/// One run: boosts the targets for `args.seconds` while the sampler watches.
fn run_once(
    args: &Args,
    fifo: FifoBoost,
    budget: BoostBudget,
    shared_cpu: usize,
    sampler_cpu: usize,
) -> (Arc<Events>, Seen) {
    let stop = Arc::new(AtomicBool::new(false));
    let words: Arc<[AtomicU64]> = (0..TARGETS).map(|_| AtomicU64::new(0)).collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let targets: Vec<_> = (0..TARGETS)
        .map(|v| {
            let (stop, tx, words, requests) =
                (stop.clone(), tx.clone(), words.clone(), args.requests);
            thread::spawn(move || {
                pin(0, &[shared_cpu]).expect("pin a target");
                tx.send(current_tid()).expect("main waits");
                spin_as_guest(&words[v], requests, &stop);
            })
        })
        .collect();
    let tids: Vec<Tid> = (0..TARGETS).map(|_| rx.recv().expect("a target")).collect();
    let events = Arc::new(Events::default());
    let booster = Booster::with_events(TARGETS, fifo, events.clone()).with_budget(budget);
    let sched = Scheduler::new(TARGETS, NoBoost, booster, NoGuestView);
    for (v, &tid) in tids.iter().enumerate() {
        sched.register_thread(v, tid).expect("a target's stat file");
    }
    let limits = RequestLimits::new(Duration::from_millis(3), budget.max_boost);
    let requests = GuestBoosts::new(TARGETS, words, limits);
    let (watching, sampling) = (AtomicBool::new(false), AtomicBool::new(false));
    let seen = thread::scope(|s| {
        let sampler = s.spawn(|| {
            pin(0, &[sampler_cpu]).expect("pin the sampler");
            let top = SchedAttr {
                policy: libc::SCHED_FIFO as u32,
                priority: 90,
                ..Default::default()
            };
            set_attr(0, &top).expect("the sampler above everything");
            watching.store(true, SeqCst);
            sample(&tids, sched.booster(), (&events, budget.period), &sampling)
        });
        // The first boost is watched like any other.
        while !watching.load(SeqCst) {
            thread::yield_now();
        }
        let stolen_before = steal(shared_cpu);
        let end = Instant::now() + Duration::from_secs(args.seconds);
        while Instant::now() < end {
            for v in 0..TARGETS {
                // Boosting a target on this CPU stops this loop until the
                // revoker takes the boost back.
                match args.requests {
                    None => drop(sched.booster().boost(v)),
                    Some(_) => drop(requests.check(&sched, v)),
                }
            }
            thread::yield_now();
        }
        let stolen = steal(shared_cpu).saturating_sub(stolen_before);
        sampling.store(true, SeqCst);
        Seen {
            stolen,
            ..sampler.join().expect("the sampler")
        }
    });
    drop(sched);
    stop.store(true, SeqCst);
    for t in targets {
        t.join().expect("a target");
    }
    (events, seen)
}

/// A target's loop: a guest spinning in guest mode, whose request word says
/// what `requests` has it say.
fn spin_as_guest(word: &AtomicU64, requests: Option<Requests>, stop: &AtomicBool) {
    if requests == Some(Requests::Held) {
        let held = BoostRequest {
            sequence: 1,
            active: true,
        };
        word.store(held.encode(), SeqCst);
    }
    let mut sequence = 0u32;
    while !stop.load(SeqCst) {
        if requests == Some(Requests::Flipped) {
            sequence = sequence.wrapping_add(1);
            let flip = BoostRequest {
                sequence,
                active: sequence % 2 == 1,
            };
            word.store(flip.encode(), SeqCst);
        }
        std::hint::spin_loop();
    }
}

/// Where the revokers run.
#[derive(Clone, Copy, Debug)]
enum Placement {
    /// The default: one, `SCHED_DEADLINE`, on any CPU (so mostly on the CPU
    /// of the boost it ends, whose target it preempts).
    Anywhere,
    /// `FifoBoost::with_revoker_cpus`: that one, and a second on the
    /// sampler's CPU, away from the targets.
    AlsoAway,
}

impl Placement {
    fn name(self) -> &'static str {
        match self {
            Self::Anywhere => "one, anywhere",
            Self::AlsoAway => "and one on another CPU",
        }
    }
}

/// Prints one run's result unless `--json`; returns its row of the
/// RESULTS.md table and its JSON fields.
fn report(
    args: &Args,
    (run, placement): (u64, Placement),
    stats: &SchedStats,
    budget: BoostBudget,
    seen: &Seen,
) -> (String, String) {
    let get = |a: &AtomicU64| a.load(SeqCst);
    let budget_us = budget.max_boost.as_micros();
    let max_us = seen.max_fifo.as_micros();
    let certain_us = seen.max_fifo_certain.as_micros();
    let max_cpu_us = seen.max_fifo_cpu.as_micros();
    let bound = budget_us + 1000;
    let period_us = seen.max_period_fifo.as_micros();
    let period_bound = 2 * (budget.per_period + budget.max_boost).as_micros() + 1000;
    let met = max_us.max(certain_us) <= bound && period_us <= period_bound && seen.unrecorded == 0;
    // The CPU a target got while real-time: what a boost takes from the
    // machine's other threads, whatever the host does.
    let cpu_met = max_cpu_us <= bound && period_us <= period_bound && seen.unrecorded == 0;
    let stolen_ms = seen.stolen.as_millis();
    let verdict = match (met, cpu_met) {
        (true, _) => "met".to_string(),
        (false, true) => {
            format!("not met; met in CPU time (the host took the shared CPU {stolen_ms} ms)")
        }
        (false, false) => "not met".to_string(),
    };
    let json = format!(
        "\"seconds\": {}, \"boosts\": {}, \"revoked_by_deadline\": {}, \"budget_us\": {budget_us}, \"max_boost_us\": {max_us}, \"max_boost_certain_us\": {certain_us}, \"max_boost_cpu_us\": {max_cpu_us}, \"unrecorded_fifo_samples\": {}, \"samples\": {}, \"unwatched_stretches\": {}, \"max_sampler_gap_us\": {}, \"restore_errors\": {}, \"revoker_errors\": {}, \"shared_cpu_steal_ms\": {stolen_ms}, \"max_period_boost_us\": {period_us}, \"period_bound_us\": {period_bound}, \"requests\": \"{}\", \"goal_met\": {met}, \"cpu_goal_met\": {cpu_met}",
        args.seconds,
        get(&stats.boosts),
        get(&stats.boosts_revoked),
        seen.unrecorded,
        seen.samples,
        seen.unwatched,
        seen.max_gap.as_micros(),
        get(&stats.restore_errors),
        get(&stats.revoker_errors),
        args.requests.map_or("none", Requests::name),
    );
    if !args.json {
        println!(
            "revokers: {}: {} boosts in {} s, {} revoked by their deadline; the most CPU a target ran \
             real-time in one boost: {max_cpu_us} µs, the longest it was real-time: \
             at most {max_us} µs, at least {certain_us} µs (max_boost {budget_us} µs; {} stretches not watched throughout, \
             the sampler's longest gap {} µs); real-time in one {} ms period: at most {period_us} µs; \
             {} of {} samples saw a real-time target with \
             no record; goal (at most {bound} µs per boost, {period_bound} µs per period, no such sample): {verdict}",
            placement.name(),
            get(&stats.boosts),
            args.seconds,
            get(&stats.boosts_revoked),
            seen.unwatched,
            seen.max_gap.as_micros(),
            budget.period.as_millis(),
            seen.unrecorded,
            seen.samples,
        );
    }
    let row = format!(
        "| {run} | {} | {} | {} | {max_us} | {certain_us} | {max_cpu_us} | {period_us} | {stolen_ms} | {} | {} | {verdict} |\n",
        placement.name(),
        get(&stats.boosts),
        get(&stats.boosts_revoked),
        seen.unrecorded,
        seen.unwatched,
    );
    (row, json)
}
