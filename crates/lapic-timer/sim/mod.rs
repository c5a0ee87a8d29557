//! A deterministic simulator: replays a trace of host-timer wake lateness
//! through an advance policy, and scores the lateness left and the spin spent,
//! beside the oracle that knows each wake-up.
//!
//! For an advance `A` and a wake lateness `W`: the expiry is `max(W − A, 0)`
//! late and spins `max(A − W, 0)`. Score = mean lateness + λ·mean spin.
//!
//! Not part of the library: the machinery behind the crate's `cyclictest`
//! and `simulate-timer` examples and its policy tests, which include this
//! file (so each uses only part of it).
#![allow(dead_code)]

use std::io;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lapic_timer::{AdvancePolicy, TimerEvents, Wakeup};

mod traces;
use traces::Rng;

/// Host-timer wake lateness, one sample per expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// What it models.
    pub name: String,
    /// Wake lateness of each expiry.
    pub lateness: Vec<Duration>,
}

fn us(v: f64) -> Duration {
    Duration::from_nanos((v.max(0.0) * 1000.0) as u64)
}

impl Trace {
    fn generate(
        name: &str,
        n: usize,
        seed: u64,
        mut f: impl FnMut(usize, &mut Rng) -> Duration,
    ) -> Self {
        let mut rng = Rng(seed);
        Self {
            name: name.into(),
            lateness: (0..n).map(|i| f(i, &mut rng)).collect(),
        }
    }

    /// Like this machine's timerfd: a 20 µs floor plus an exponential tail
    /// (p50 ≈ 26 µs, p99 ≈ 60 µs).
    pub fn timerfd_like(n: usize, seed: u64) -> Self {
        Self::generate("timerfd-like: 20 µs + exp(8 µs)", n, seed, |_, r| {
            us(20.0 - 8.0 * (1.0 - r.unit()).ln())
        })
    }

    /// Steady lateness with 2% of long stalls (host preemption).
    pub fn stalls(n: usize, seed: u64) -> Self {
        Self::generate("25 ± 2 µs, 2% stalls of 500 µs", n, seed, |_, r| {
            if r.unit() < 0.02 {
                us(500.0)
            } else {
                us(23.0 + 4.0 * r.unit())
            }
        })
    }

    /// The distribution shifts halfway: 20 ± 2 µs, then 60 ± 5 µs.
    pub fn shift(n: usize, seed: u64) -> Self {
        Self::generate("shift: 20 ± 2 µs, then 60 ± 5 µs", n, seed, |i, r| {
            if i < n / 2 {
                us(18.0 + 4.0 * r.unit())
            } else {
                us(55.0 + 10.0 * r.unit())
            }
        })
    }

    /// Hardware-like: a few µs with little spread (what KVM's constants are for).
    pub fn tight(n: usize, seed: u64) -> Self {
        Self::generate("tight: 2 ± 0.5 µs", n, seed, |_, r| us(1.5 + r.unit()))
    }

    /// The built-in synthetic traces.
    pub fn synthetic(n: usize) -> Vec<Trace> {
        vec![
            Self::timerfd_like(n, 1),
            Self::stalls(n, 2),
            Self::shift(n, 3),
            Self::tight(n, 4),
        ]
    }

    /// Reads a trace saved by [`save`](Trace::save): one lateness in ns per line.
    pub fn load(path: &Path) -> io::Result<Self> {
        let (name, lateness) = traces::load(path)?;
        Ok(Self { name, lateness })
    }

    /// Writes the trace, one lateness in ns per line.
    pub fn save(&self, path: &Path) -> io::Result<()> {
        let header = format!("{}: host-timer wake lateness per expiry, ns", self.name);
        traces::save(path, &header, &self.lateness)
    }
}

/// How a policy did on a trace.
#[derive(Clone, Debug, PartialEq)]
pub struct SimResult {
    /// The policy.
    pub policy: String,
    /// Median lateness.
    pub p50: Duration,
    /// 99th percentile lateness.
    pub p99: Duration,
    /// Mean lateness.
    pub mean: Duration,
    /// Mean spin per expiry.
    pub spin: Duration,
    /// Longest spin of one expiry.
    pub max_spin: Duration,
}

impl SimResult {
    /// Mean lateness + λ·mean spin, in µs.
    pub fn score(&self, spin_weight: f64) -> f64 {
        (self.mean.as_nanos() as f64 + spin_weight * self.spin.as_nanos() as f64) / 1000.0
    }

    fn from(policy: &str, mut late: Vec<Duration>, spins: &[Duration]) -> Self {
        let n = late.len().max(1);
        late.sort_unstable();
        let q = |p: f64| {
            late.get(((late.len().max(1) - 1) as f64 * p) as usize)
                .copied()
                .unwrap_or_default()
        };
        Self {
            policy: policy.into(),
            p50: q(0.5),
            p99: q(0.99),
            mean: late.iter().sum::<Duration>() / n as u32,
            spin: spins.iter().sum::<Duration>() / n as u32,
            max_spin: spins.iter().max().copied().unwrap_or_default(),
        }
    }
}

/// One expiry of a deadline armed `period` before its target, whose host
/// timer wakes `wake_lateness` after it fires: the host timer fires at the
/// target less the policy's advance, or at once where the advance is longer
/// than `period`; then the policy learns what the backend would teach it
/// ([`Wakeup::of_deadline`]). Returns the expiry's lateness and its spin.
pub fn expire_once(
    policy: &mut dyn AdvancePolicy,
    wake_lateness: Duration,
    period: Duration,
) -> (Duration, Duration) {
    let advance = policy.advance();
    let fired_early_by = advance.min(period);
    let target_ns = period.as_nanos() as u64;
    let woke_ns = (target_ns - fired_early_by.as_nanos() as u64)
        .saturating_add(wake_lateness.as_nanos().min(u128::from(u64::MAX)) as u64);
    if let Some(wakeup) = Wakeup::of_deadline(advance, 0, target_ns, woke_ns) {
        policy.learn(&wakeup);
    }
    (
        wake_lateness.saturating_sub(fired_early_by),
        fired_early_by.saturating_sub(wake_lateness),
    )
}

/// Replays `trace` through `policy` (which learns as it goes), each deadline
/// armed `period` before its target.
pub fn simulate_every(
    name: &str,
    policy: &mut dyn AdvancePolicy,
    trace: &Trace,
    period: Duration,
) -> SimResult {
    let (late, spins): (Vec<_>, Vec<_>) = trace
        .lateness
        .iter()
        .map(|&w| expire_once(policy, w, period))
        .unzip();
    SimResult::from(name, late, &spins)
}

/// Replays `trace` through `policy` with deadlines armed far ahead (an
/// hour), so that no advance is longer than a deadline's distance.
pub fn simulate(name: &str, policy: &mut dyn AdvancePolicy, trace: &Trace) -> SimResult {
    simulate_every(name, policy, trace, Duration::from_secs(3600))
}

/// The oracle: advances by exactly each wake-up's lateness.
pub fn oracle(trace: &Trace) -> SimResult {
    let zeros = vec![Duration::ZERO; trace.lateness.len()];
    SimResult::from("oracle", zeros.clone(), &zeros)
}

/// A Markdown table of `results` on `trace`.
pub fn table(trace: &Trace, results: &[SimResult], spin_weight: f64) -> String {
    let f = |d: Duration| format!("{:.2}", d.as_nanos() as f64 / 1000.0);
    let score = format!("score (λ={spin_weight})");
    let columns = [
        "policy",
        "p50 late µs",
        "p99 late µs",
        "mean late µs",
        "spin µs/expiry",
        &score,
    ];
    let rows: Vec<Vec<String>> = results
        .iter()
        .map(|r| {
            vec![
                r.policy.clone(),
                f(r.p50),
                f(r.p99),
                f(r.mean),
                f(r.spin),
                format!("{:.2}", r.score(spin_weight)),
            ]
        })
        .collect();
    let heading = format!("**{}** ({} expiries)", trace.name, trace.lateness.len());
    traces::table(&heading, &columns, &rows)
}

/// Records the host timer's wake lateness, to replay real runs (first `limit`).
#[derive(Debug)]
pub struct TraceRecorder {
    limit: usize,
    lateness: Mutex<Vec<Duration>>,
}

impl TraceRecorder {
    /// Records up to `limit` wake-ups.
    pub fn new(limit: usize) -> Self {
        Self {
            limit,
            lateness: Mutex::new(Vec::new()),
        }
    }

    /// The recorded trace.
    pub fn trace(&self, name: &str) -> Trace {
        Trace {
            name: name.into(),
            lateness: self
                .lateness
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

impl TimerEvents for TraceRecorder {
    fn woke(&self, w: &Wakeup) {
        let mut l = self.lateness.lock().unwrap_or_else(PoisonError::into_inner);
        if l.len() < self.limit {
            l.push(w.wake_lateness());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapic_timer::{Fixed, NoAdvance};

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn no_advance_is_as_late_as_the_timer_and_never_spins() {
        let t = Trace {
            name: "t".into(),
            lateness: vec![10 * US, 30 * US],
        };
        let r = simulate("none", &mut NoAdvance, &t);
        assert_eq!((r.mean, r.spin), (20 * US, Duration::ZERO));
    }

    #[test]
    fn a_fixed_advance_trades_spin_for_lateness() {
        let t = Trace {
            name: "t".into(),
            lateness: vec![10 * US, 30 * US],
        };
        let r = simulate("fixed", &mut Fixed(20 * US), &t);
        assert_eq!((r.mean, r.spin), (5 * US, 5 * US));
        assert!((r.score(0.1) - 5.5).abs() < 1e-9);
        assert_eq!(oracle(&t).score(0.1), 0.0);
    }

    const PERIOD: Duration = Duration::from_micros(200);
    const STALL: Duration = Duration::from_millis(5);

    /// Runs `lateness` through the own policy at a 200 µs period: the
    /// advance before each expiry, and each expiry's spin.
    fn own_policy_on(lateness: &[Duration]) -> (Vec<Duration>, Vec<Duration>) {
        let mut p = crate::Percentile::default();
        lateness
            .iter()
            .map(|&w| (p.advance(), expire_once(&mut p, w, PERIOD).1))
            .unzip()
    }

    /// The spin CPU, over every 50 expiries in a row: at most a tenth of
    /// their periods.
    fn assert_spin_under_a_tenth_of_the_period(spins: &[Duration], what: &str) {
        for (i, window) in spins.windows(50).enumerate() {
            let spin = window.iter().sum::<Duration>() / 50;
            assert!(
                spin <= PERIOD / 10,
                "{what}: expiries {i}..+50 spun {spin:?} each"
            );
        }
    }

    #[test]
    fn one_host_stall_does_not_move_the_own_advance() {
        let clean = Trace::timerfd_like(1000, 7).lateness;
        let (clean_advance, clean_spins) = own_policy_on(&clean);
        assert_spin_under_a_tenth_of_the_period(&clean_spins, "no stall");
        // At the first wake-up (as seen on a busy host), and in steady state.
        for at in [0, 500] {
            let mut stalled = clean.clone();
            stalled[at] = STALL;
            let (advance, spins) = own_policy_on(&stalled);
            assert_spin_under_a_tenth_of_the_period(&spins, &format!("stall at {at}"));
            for i in at + 50..stalled.len() {
                let (a, b) = (
                    advance[i].as_nanos() as f64,
                    clean_advance[i].as_nanos() as f64,
                );
                assert!(
                    (a - b).abs() <= 0.1 * b,
                    "stall at {at}: expiry {i}: {a} ns against {b} ns"
                );
            }
        }
    }

    #[test]
    fn stalls_every_100_expiries_cost_no_spin() {
        let mut lateness = Trace::timerfd_like(3000, 8).lateness;
        lateness.iter_mut().step_by(100).for_each(|w| *w = STALL);
        let (advance, spins) = own_policy_on(&lateness);
        assert_spin_under_a_tenth_of_the_period(&spins, "stalls every 100");
        assert!(advance[2999] < 60 * US, "{:?}", advance[2999]);
    }

    #[test]
    fn the_own_advance_follows_a_step_either_way() {
        let fast = |i: u64| US * 18 + Duration::from_nanos(i * 7919 % 4000);
        let slow = |i: u64| US * 55 + Duration::from_nanos(i * 7919 % 10_000);
        let lateness: Vec<Duration> = (0..3000u64)
            .map(|i| {
                if (1000..2000).contains(&i) {
                    slow(i)
                } else {
                    fast(i)
                }
            })
            .collect();
        let (advance, spins) = own_policy_on(&lateness);
        // Up: within 10 % of the slower host's p91 (64 µs) in 100 expiries.
        assert!(advance[1100] >= 58 * US, "{:?}", advance[1100]);
        // Down: the wasted spin ends within 100 expiries.
        assert_spin_under_a_tenth_of_the_period(&spins[2100..], "after the step down");
        // At most 1.25 times the faster host's p91 (22 µs) while the long
        // histogram still remembers the slower one, bucket width included.
        assert!(advance[2999] < 32 * US, "{:?}", advance[2999]);
        assert_spin_under_a_tenth_of_the_period(&spins[..2000], "before the step down");
    }

    #[test]
    fn an_advance_longer_than_the_period_fires_at_once_and_learns() {
        let mut p = Fixed(300 * US);
        let (late, spin) = expire_once(&mut p, 10 * US, PERIOD);
        assert_eq!((late, spin), (Duration::ZERO, 190 * US));
    }

    #[test]
    fn traces_are_reproducible_and_round_trip() {
        assert_eq!(Trace::synthetic(50), Trace::synthetic(50));
        let path = std::env::temp_dir().join(format!("lapic-trace-{}.txt", std::process::id()));
        let t = Trace::stalls(30, 5);
        t.save(&path).unwrap();
        assert_eq!(Trace::load(&path).unwrap().lateness, t.lateness);
        std::fs::write(&path, "x\n").unwrap();
        assert!(Trace::load(&path).unwrap_err().to_string().contains(":1:"));
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn the_recorder_keeps_wake_lateness_up_to_its_limit() {
        let r = TraceRecorder::new(1);
        r.woke(&Wakeup {
            advance: 5 * US,
            delta_ns: 1_000,
        });
        r.woke(&Wakeup {
            advance: US,
            delta_ns: 1_000,
        });
        assert_eq!(r.trace("x").lateness, [6 * US]);
    }
}
