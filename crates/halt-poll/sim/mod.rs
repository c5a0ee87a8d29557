//! A deterministic simulator: replays a trace of wake times through a policy and
//! scores wake latency and poll CPU, beside the oracle that knows the future.
//!
//! Each halt of a trace is the time from the start of the halt to its wake
//! event. For a plan (sleep `s`, then poll `w`), with a block costing `L` of wake
//! latency, a poll `ℓ`, and sleeps ending `δ` late:
//! - a wake before the sleep ends (`t < s + δ`) is seen `L` late, no CPU spent;
//! - a wake during the poll is seen `ℓ` late, after `t − (s + δ)` of poll CPU;
//! - a later wake is seen `L` late, after the whole window of poll CPU (wasted).
//!
//! The oracle polls exactly the halts whose wake comes before the break-even
//! point `(L − ℓ) / λ` (λ: the weight of poll CPU against latency) and blocks at
//! once on the others.
//!
//! Not part of the library: the machinery behind the crate's `simulate` and
//! `pingpong` examples, its goal test, and the fuzz target's invariants, which
//! include this file (so each uses only part of it). Copy it if a policy of
//! your own should be scored the same way.
#![allow(dead_code)]

use std::io;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use halt_poll::{HaltEvents, HaltOutcome, PollPlan, PollPolicy, WokenDuring};

mod traces;
use traces::Rng;

/// The machine the simulation models.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimParams {
    /// Wake latency when the thread was blocked or sleeping.
    pub block_latency: Duration,
    /// Wake latency when the thread was polling.
    pub poll_latency: Duration,
    /// How late a timed sleep ends.
    pub sleep_lateness: Duration,
    /// Nanoseconds of latency one nanosecond of poll CPU is worth (for the
    /// oracle and the cost column).
    pub cpu_weight: f64,
}

impl Default for SimParams {
    /// Costs measured on this project's machines (PVM, on 2 cores): a blocked
    /// thread resumes about 30 µs after its wake-up, a timed sleep ends about
    /// 25 µs late.
    fn default() -> Self {
        Self {
            block_latency: Duration::from_micros(30),
            poll_latency: Duration::from_nanos(100),
            sleep_lateness: Duration::from_micros(25),
            cpu_weight: 0.1,
        }
    }
}

/// A sequence of halts, each the time from halt start to its wake event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// What it models.
    pub name: String,
    /// Wake time of each halt.
    pub wakes: Vec<Duration>,
}

impl Trace {
    fn generate(
        name: &str,
        halts: usize,
        seed: u64,
        mut f: impl FnMut(usize, &mut Rng) -> Duration,
    ) -> Self {
        let mut rng = Rng(seed);
        Self {
            name: name.to_owned(),
            wakes: (0..halts).map(|i| f(i, &mut rng)).collect(),
        }
    }

    /// Exponentially distributed wake times (memoryless, e.g. network requests).
    pub fn exponential(halts: usize, mean: Duration, seed: u64) -> Self {
        let m = mean.as_nanos() as f64 / 1000.0;
        Self::generate(&format!("exponential {m} µs"), halts, seed, |_, r| {
            r.exponential(m)
        })
    }

    /// Mostly short wakes (15-25 µs) with `long_percent` long ones (1-2 ms).
    pub fn bimodal(halts: usize, long_percent: u32, seed: u64) -> Self {
        let p = f64::from(long_percent) / 100.0;
        Self::generate(
            &format!("bimodal 20 µs / 1.5 ms, {long_percent}% long"),
            halts,
            seed,
            |_, r| {
                if r.unit() < p {
                    r.uniform(1000.0, 2000.0)
                } else {
                    r.uniform(15.0, 25.0)
                }
            },
        )
    }

    /// A timer: every wake `period` ± 2 µs after the halt starts.
    pub fn periodic(halts: usize, period: Duration, seed: u64) -> Self {
        let p = period.as_nanos() as f64 / 1000.0;
        Self::generate(&format!("periodic {p} µs"), halts, seed, |_, r| {
            r.uniform(p - 2.0, p + 2.0)
        })
    }

    /// Bursts of 50 short wakes (5-15 µs), each followed by 5 ms of idle.
    pub fn bursty(halts: usize, seed: u64) -> Self {
        Self::generate("bursty: 50 x 5-15 µs, then 5 ms", halts, seed, |i, r| {
            if i % 51 == 50 {
                r.uniform(4_900.0, 5_100.0)
            } else {
                r.uniform(5.0, 15.0)
            }
        })
    }

    /// Adversarial for grow/shrink: short (5 µs) and long (300 µs) halts alternate.
    pub fn alternating(halts: usize) -> Self {
        Self::generate("alternating 5 µs / 300 µs", halts, 0, |i, _| {
            Duration::from_micros(if i % 2 == 0 { 5 } else { 300 })
        })
    }

    /// The built-in synthetic traces, `halts` halts each.
    pub fn synthetic(halts: usize) -> Vec<Trace> {
        vec![
            Self::exponential(halts, Duration::from_micros(50), 1),
            Self::bimodal(halts, 20, 2),
            Self::periodic(halts, Duration::from_micros(100), 3),
            Self::bursty(halts, 4),
            Self::alternating(halts),
        ]
    }

    /// Reads a trace written by [`save`](Trace::save) (one wake time in ns per
    /// line; `#` starts a comment).
    pub fn load(path: &Path) -> io::Result<Self> {
        let (name, wakes) = traces::load(path)?;
        Ok(Self { name, wakes })
    }

    /// Writes the trace, one wake time in ns per line.
    pub fn save(&self, path: &Path) -> io::Result<()> {
        let header = format!("{}: wake time of each halt, ns", self.name);
        traces::save(path, &header, &self.wakes)
    }
}

/// How a policy did on a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    /// The policy.
    pub policy: String,
    /// Mean wake latency.
    pub mean_latency: Duration,
    /// 99th percentile wake latency.
    pub p99_latency: Duration,
    /// Poll CPU per halt, on average.
    pub poll_cpu: Duration,
    /// Poll CPU per halt spent in polls that did not catch the wake-up.
    pub wasted_cpu: Duration,
    /// Halts woken while polling, in percent.
    pub polled_percent: f64,
}

impl SimResult {
    /// Mean latency plus weighted poll CPU, in ns: what the oracle minimises.
    pub fn cost_ns(&self, cpu_weight: f64) -> f64 {
        self.mean_latency.as_nanos() as f64 + cpu_weight * self.poll_cpu.as_nanos() as f64
    }
}

struct Tally {
    latencies: Vec<Duration>,
    poll_cpu: Duration,
    wasted: Duration,
    polled: usize,
}

impl Tally {
    fn new(n: usize) -> Self {
        Self {
            latencies: Vec::with_capacity(n),
            poll_cpu: Duration::ZERO,
            wasted: Duration::ZERO,
            polled: 0,
        }
    }

    fn result(mut self, policy: String) -> SimResult {
        let n = self.latencies.len().max(1) as u32;
        self.latencies.sort_unstable();
        let p99 = self
            .latencies
            .get(self.latencies.len() * 99 / 100)
            .copied()
            .unwrap_or_default();
        SimResult {
            policy,
            mean_latency: self.latencies.iter().sum::<Duration>() / n,
            p99_latency: p99,
            poll_cpu: self.poll_cpu / n,
            wasted_cpu: self.wasted / n,
            polled_percent: 100.0 * self.polled as f64 / f64::from(n),
        }
    }
}

/// One halt with wake time `t` under `policy`'s plan, as [the module](self) models it.
pub fn simulate_halt(
    policy: &dyn PollPolicy,
    t: Duration,
    p: &SimParams,
) -> (HaltOutcome, Duration) {
    let plan = policy.plan();
    let poll_start = if plan.sleep > Duration::ZERO {
        plan.sleep + p.sleep_lateness
    } else {
        Duration::ZERO
    };
    let poll_end = poll_start + plan.window;
    let (woken, slept, polled, latency) = if t < poll_start {
        (WokenDuring::Sleep, t, Duration::ZERO, p.block_latency)
    } else if t <= poll_end && (plan.window > Duration::ZERO || t == poll_start) {
        (
            WokenDuring::Poll,
            poll_start,
            t - poll_start,
            p.poll_latency,
        )
    } else {
        (WokenDuring::Block, poll_start, plan.window, p.block_latency)
    };
    let outcome = HaltOutcome::new(t + latency, slept, polled, woken);
    (outcome, latency)
}

/// Replays `trace` through `policy` (which learns as it goes).
pub fn simulate(
    name: &str,
    policy: &mut dyn PollPolicy,
    trace: &Trace,
    p: &SimParams,
) -> SimResult {
    let mut tally = Tally::new(trace.wakes.len());
    for &t in &trace.wakes {
        let (outcome, latency) = simulate_halt(policy, t, p);
        tally.latencies.push(latency);
        tally.poll_cpu += outcome.polled;
        if outcome.poll_succeeded() {
            tally.polled += 1;
        } else {
            tally.wasted += outcome.polled;
        }
        policy.learn(&outcome);
    }
    tally.result(name.to_owned())
}

/// The oracle: knows each wake time, polls exactly until it when it comes
/// before the break-even point, blocks at once otherwise.
pub fn oracle(trace: &Trace, p: &SimParams) -> SimResult {
    let gain = p.block_latency.saturating_sub(p.poll_latency).as_nanos() as f64;
    let break_even = if p.cpu_weight > 0.0 {
        gain / p.cpu_weight
    } else {
        f64::INFINITY
    };
    let mut tally = Tally::new(trace.wakes.len());
    for &t in &trace.wakes {
        if (t.as_nanos() as f64) <= break_even {
            tally.latencies.push(p.poll_latency);
            tally.poll_cpu += t;
            tally.polled += 1;
        } else {
            tally.latencies.push(p.block_latency);
        }
    }
    tally.result("oracle".to_owned())
}

/// A Markdown table of `results` for `trace`.
pub fn table(trace: &Trace, results: &[SimResult], p: &SimParams) -> String {
    let us = |d: Duration| d.as_nanos() as f64 / 1000.0;
    let cost = format!("cost (λ={})", p.cpu_weight);
    let columns = [
        "policy",
        "mean latency µs",
        "p99 latency µs",
        "poll CPU µs/halt",
        "wasted µs/halt",
        "woken polling",
        &cost,
    ];
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            vec![
                r.policy.clone(),
                format!("{:.2}", us(r.mean_latency)),
                format!("{:.1}", us(r.p99_latency)),
                format!("{:.2}", us(r.poll_cpu)),
                format!("{:.2}", us(r.wasted_cpu)),
                format!("{:.1}%", r.polled_percent),
                format!("{:.2}", r.cost_ns(p.cpu_weight) / 1000.0),
            ]
        })
        .collect();
    let heading = format!("**{}** ({} halts)", trace.name, trace.wakes.len());
    traces::table(&heading, &columns, &rows)
}

/// Records each halt's wake time, to replay real runs in the simulator.
///
/// A halt woken while polling gives its wake time exactly; one woken from a
/// block resumed `block_latency` after its wake, which is subtracted (but the
/// wake is never put before the end of the poll window). Only the first
/// `limit` halts are kept.
#[derive(Debug)]
pub struct TraceRecorder {
    block_latency: Duration,
    limit: usize,
    wakes: Mutex<Vec<Duration>>,
}

impl TraceRecorder {
    /// A recorder of up to `limit` halts, assuming a blocked thread resumes
    /// `block_latency` after its wake.
    pub fn new(block_latency: Duration, limit: usize) -> Self {
        Self {
            block_latency,
            limit,
            wakes: Mutex::new(Vec::new()),
        }
    }

    /// The recorded halts, as a trace called `name`.
    pub fn trace(&self, name: &str) -> Trace {
        let wakes = self
            .wakes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Trace {
            name: name.to_owned(),
            wakes,
        }
    }
}

impl HaltEvents for TraceRecorder {
    fn halted(&self, _: &PollPlan, o: &HaltOutcome) {
        let wake = match o.woken {
            WokenDuring::Poll => o.halt,
            WokenDuring::Block => o
                .halt
                .saturating_sub(self.block_latency)
                .max(o.slept + o.polled),
            WokenDuring::Sleep => o.halt.saturating_sub(self.block_latency).min(o.slept),
        };
        let mut wakes = self.wakes.lock().unwrap_or_else(PoisonError::into_inner);
        if wakes.len() < self.limit {
            wakes.push(wake);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use halt_poll::{Fixed, KvmGrowShrink, Never};

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn traces_are_deterministic() {
        assert_eq!(Trace::synthetic(100), Trace::synthetic(100));
        assert_ne!(
            Trace::exponential(100, 50 * US, 1),
            Trace::exponential(100, 50 * US, 2)
        );
    }

    #[test]
    fn never_polls_and_always_pays_block_latency() {
        let trace = Trace::alternating(10);
        let r = simulate("never", &mut Never, &trace, &SimParams::default());
        assert_eq!(
            (r.mean_latency, r.poll_cpu, r.polled_percent),
            (30 * US, Duration::ZERO, 0.0)
        );
    }

    #[test]
    fn a_fixed_window_polls_short_halts_and_wastes_on_long_ones() {
        let trace = Trace::alternating(10);
        let r = simulate("fixed", &mut Fixed(10 * US), &trace, &SimParams::default());
        // 5 halts polled for 5 µs, 5 halts waste 10 µs each.
        assert_eq!(r.poll_cpu, (25 * US + 50 * US) / 10);
        assert_eq!(r.wasted_cpu, 50 * US / 10);
        assert_eq!(r.polled_percent, 50.0);
    }

    #[test]
    fn the_oracle_polls_only_before_break_even() {
        // L − ℓ = 29.9 µs: break-even at 299 µs for λ = 0.1, 598 µs for λ = 0.05.
        let trace = Trace::alternating(10);
        assert_eq!(
            oracle(&trace, &SimParams::default()).polled_percent,
            50.0,
            "300 µs is past 299"
        );
        let cheap_cpu = SimParams {
            cpu_weight: 0.05,
            ..SimParams::default()
        };
        let r = oracle(&trace, &cheap_cpu);
        assert_eq!(
            (r.polled_percent, r.poll_cpu),
            (100.0, Duration::from_nanos(152_500))
        );
    }

    #[test]
    fn kvm_on_the_alternating_trace_blocks_every_short_halt() {
        let trace = Trace::alternating(1000);
        let r = simulate(
            "kvm",
            &mut KvmGrowShrink::new(),
            &trace,
            &SimParams::default(),
        );
        assert_eq!(
            r.polled_percent, 0.0,
            "grow on a short, shrink to 0 on a long: never in time"
        );
    }

    #[test]
    fn traces_round_trip_through_a_file() {
        let path = std::env::temp_dir().join(format!("halt-poll-trace-{}.txt", std::process::id()));
        let trace = Trace::periodic(20, 100 * US, 9);
        trace.save(&path).unwrap();
        let loaded = Trace::load(&path).unwrap();
        assert_eq!(loaded.wakes, trace.wakes);
        std::fs::write(&path, "12\nnot a number\n").unwrap();
        let err = Trace::load(&path).unwrap_err();
        assert!(err.to_string().contains(":2:"), "{err}");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn recorder_estimates_wake_times() {
        let r = TraceRecorder::new(30 * US, 3);
        r.halted(
            &PollPlan::default(),
            &HaltOutcome::woken_while_polling(7 * US),
        );
        r.halted(
            &PollPlan::default(),
            &HaltOutcome::woken_after_blocking(10 * US, 100 * US),
        );
        r.halted(
            &PollPlan::default(),
            &HaltOutcome::woken_after_blocking(10 * US, 20 * US),
        );
        r.halted(&PollPlan::default(), &HaltOutcome::woken_while_polling(US));
        assert_eq!(
            r.trace("t").wakes,
            [7 * US, 70 * US, 10 * US],
            "the fourth is past the limit"
        );
    }
}
