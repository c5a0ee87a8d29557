//! A deterministic simulator: replays a trace of host-timer wake lateness
//! through an advance policy, and scores the lateness left and the spin spent,
//! beside the oracle that knows each wake-up.
//!
//! For an advance `A` and a wake lateness `W`: the expiry is `max(W − A, 0)`
//! late and spins `max(A − W, 0)`. Score = mean lateness + λ·mean spin.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::Path;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use crate::advance::{AdvancePolicy, Wakeup};
use crate::events::TimerEvents;

/// Host-timer wake lateness, one sample per expiry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// What it models.
    pub name: String,
    /// Wake lateness of each expiry.
    pub lateness: Vec<Duration>,
}

/// SplitMix64, for reproducible traces.
struct Rng(u64);

impl Rng {
    fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
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
        let text = fs::read_to_string(path)?;
        let mut lateness = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let ns: u64 = line.parse().map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}:{}: {e}: {line:?}", path.display(), n + 1),
                )
            })?;
            lateness.push(Duration::from_nanos(ns));
        }
        let name = path
            .file_stem()
            .map_or("recorded".into(), |s| s.to_string_lossy().into_owned());
        Ok(Self { name, lateness })
    }

    /// Writes the trace, one lateness in ns per line.
    pub fn save(&self, path: &Path) -> io::Result<()> {
        let mut text = format!("# {}: host-timer wake lateness per expiry, ns\n", self.name);
        for l in &self.lateness {
            let _ = writeln!(text, "{}", l.as_nanos());
        }
        fs::write(path, text)
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
}

impl SimResult {
    /// Mean lateness + λ·mean spin, in µs.
    pub fn score(&self, spin_weight: f64) -> f64 {
        (self.mean.as_nanos() as f64 + spin_weight * self.spin.as_nanos() as f64) / 1000.0
    }

    fn from(policy: &str, mut late: Vec<Duration>, spin: Duration) -> Self {
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
            spin: spin / n as u32,
        }
    }
}

/// Replays `trace` through `policy` (which learns as it goes).
pub fn simulate(name: &str, policy: &mut dyn AdvancePolicy, trace: &Trace) -> SimResult {
    let (mut late, mut spin) = (Vec::with_capacity(trace.lateness.len()), Duration::ZERO);
    for &w in &trace.lateness {
        let a = policy.advance();
        late.push(w.saturating_sub(a));
        spin += a.saturating_sub(w);
        let delta = w.as_nanos() as i64 - a.as_nanos() as i64;
        policy.learn(&Wakeup {
            advance: a,
            delta_ns: delta,
        });
    }
    SimResult::from(name, late, spin)
}

/// The oracle: advances by exactly each wake-up's lateness.
pub fn oracle(trace: &Trace) -> SimResult {
    SimResult::from(
        "oracle",
        vec![Duration::ZERO; trace.lateness.len()],
        Duration::ZERO,
    )
}

/// A Markdown table of `results` on `trace`.
pub fn table(trace: &Trace, results: &[SimResult], spin_weight: f64) -> String {
    let f = |d: Duration| d.as_nanos() as f64 / 1000.0;
    let mut out = format!(
        "**{}** ({} expiries)\n\n| policy | p50 late µs | p99 late µs | mean late µs | spin µs/expiry | score (λ={spin_weight}) |\n|---|---|---|---|---|---|\n",
        trace.name,
        trace.lateness.len()
    );
    for r in results {
        let _ = writeln!(
            out,
            "| {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
            r.policy,
            f(r.p50),
            f(r.p99),
            f(r.mean),
            f(r.spin),
            r.score(spin_weight)
        );
    }
    out
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
    use crate::{Fixed, NoAdvance};

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
