//! `Predictive`: this crate's own policy. It learns the distribution of wake
//! times, not only the last halt, and picks the plan (an optional sleep, then a
//! poll window) that minimises expected wake latency plus weighted poll CPU.
//!
//! # How
//! - Every halt's wake time goes into a histogram of 64 log-spaced buckets
//!   (256 ns to about 14 ms, four per octave) whose counts decay by `1/memory`
//!   per halt, so the distribution follows the workload. There are two: one for
//!   halts that follow a short halt, one for halts that follow a long one, so a
//!   workload whose halts alternate is predicted rather than averaged.
//! - Every few halts it evaluates, for every poll start `a` (0, or the end of a
//!   sleep) and poll end `b` at bucket edges, the expected cost
//!   `P(t<a)·L + P(a≤t≤b)·(ℓ + λ·E[t−a]) + P(t>b)·(L + λ·(b−a))`,
//!   with `L` the latency of waking from a block, `ℓ` from a poll, and `λ` the
//!   weight of a nanosecond of poll CPU against one of latency; prefix sums make
//!   each evaluation O(1). It keeps the cheapest; blocking at once is a candidate.
//!   A window ends at the longest wake seen in its last bucket, not at the edge.
//! - A sleep ends late: the lateness of past sleeps is learned, and a sleep is
//!   planned to end that much before the poll start.
//! - If polling was cut short because another thread needed the CPU, it stops
//!   polling for 2, 4, 8... halts (up to 256), then probes again: on 2 busy cores
//!   a poller can starve the very thread that would wake it.

use std::time::Duration;

use crate::policy::{HaltOutcome, PollPlan, PollPolicy, WokenDuring};

const BUCKETS: usize = 64;
/// Lower edge of bucket 1 (bucket 0 is everything below it).
const FIRST_EDGE_NS: f64 = 256.0;
/// Four buckets per octave.
const BUCKET_RATIO: f64 = 1.189_207_115_002_721;
/// Samples before the first learned plan.
const WARM_UP: u32 = 8;

/// Settings of [`Predictive`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictiveConfig {
    /// Longest poll window.
    pub max_poll: Duration,
    /// Latency of a wake-up that finds the thread blocked (futex wake, scheduler).
    pub block_latency: Duration,
    /// Latency of a wake-up seen while polling.
    pub poll_latency: Duration,
    /// Nanoseconds of latency one nanosecond of poll CPU is worth (λ).
    pub cpu_weight: f64,
    /// Halts each histogram remembers (its counts decay by 1/memory per halt).
    pub memory: u32,
    /// Halts between two re-plans.
    pub replan_every: u32,
    /// Whether it may sleep before polling (hybrid polling).
    pub hybrid: bool,
}

impl Default for PredictiveConfig {
    fn default() -> Self {
        Self {
            max_poll: Duration::from_micros(500),
            block_latency: Duration::from_micros(30),
            poll_latency: Duration::from_nanos(100),
            cpu_weight: 0.1,
            memory: 128,
            replan_every: 8,
            hybrid: true,
        }
    }
}

/// The lower edge of bucket `i`, in ns.
fn edge_ns(i: usize) -> f64 {
    if i == 0 {
        0.0
    } else {
        FIRST_EDGE_NS * BUCKET_RATIO.powi(i as i32 - 1)
    }
}

/// A representative wake time of bucket `i`, in ns.
fn mid_ns(i: usize) -> f64 {
    if i == 0 {
        FIRST_EDGE_NS / 2.0
    } else {
        edge_ns(i) * BUCKET_RATIO.sqrt()
    }
}

fn bucket_of(ns: f64) -> usize {
    if ns < FIRST_EDGE_NS {
        return 0;
    }
    let i = 1 + ((ns / FIRST_EDGE_NS).ln() / BUCKET_RATIO.ln()) as usize;
    i.min(BUCKETS - 1)
}

fn as_ns(d: Duration) -> f64 {
    d.as_nanos() as f64
}

/// Decayed counts of wake times, and the longest wake seen in each bucket.
#[derive(Clone, Debug)]
struct Histogram {
    counts: [f64; BUCKETS],
    longest_ns: [f64; BUCKETS],
    samples: u32,
    since_replan: u32,
    plan: PollPlan,
}

impl Histogram {
    fn new(initial: PollPlan) -> Self {
        Self {
            counts: [0.0; BUCKETS],
            longest_ns: [0.0; BUCKETS],
            samples: 0,
            since_replan: 0,
            plan: initial,
        }
    }

    fn record(&mut self, wake_ns: f64, memory: u32) {
        let keep = 1.0 - 1.0 / f64::from(memory.max(1));
        self.counts.iter_mut().for_each(|c| *c *= keep);
        let k = bucket_of(wake_ns);
        self.counts[k] += 1.0;
        self.longest_ns[k] = self.longest_ns[k].max(wake_ns);
        self.samples = self.samples.saturating_add(1);
        self.since_replan += 1;
    }

    /// Where a window covering buckets below `j` ends: the longest wake seen in
    /// them, not the bucket edge, so the window is no longer than needed.
    fn end_ns(&self, j: usize) -> f64 {
        (0..j)
            .rev()
            .find(|&k| self.counts[k] > 0.0)
            .map_or(edge_ns(j), |k| self.longest_ns[k] + 1.0)
    }

    /// The cheapest plan under this distribution (see the module docs).
    fn best_plan(&self, c: &PredictiveConfig, sleep_lateness_ns: f64) -> PollPlan {
        let total: f64 = self.counts.iter().sum();
        if total <= 0.0 {
            return self.plan;
        }
        // prob[k], moment[k]: mass and sum of wake times in buckets below k.
        let mut prob = [0.0; BUCKETS + 1];
        let mut moment = [0.0; BUCKETS + 1];
        for k in 0..BUCKETS {
            prob[k + 1] = prob[k] + self.counts[k] / total;
            moment[k + 1] = moment[k] + self.counts[k] / total * mid_ns(k);
        }
        let (block, poll_lat, weight) =
            (as_ns(c.block_latency), as_ns(c.poll_latency), c.cpu_weight);
        let max_poll = as_ns(c.max_poll);
        let mut best = (block, PollPlan::default()); // blocking at once
        let starts = if c.hybrid { BUCKETS } else { 1 };
        for i in 0..starts {
            let a = edge_ns(i);
            let sleep = a - sleep_lateness_ns;
            if i > 0 && sleep <= 0.0 {
                continue; // a sleep that short would end after the poll start
            }
            for j in i + 1..=BUCKETS {
                if self.counts[j - 1] <= 0.0 && j < BUCKETS {
                    continue; // ending in an empty bucket never beats ending below it
                }
                let b = self.end_ns(j).max(a);
                if b - a > max_poll {
                    break;
                }
                let inside = prob[j] - prob[i];
                let cost = block * prob[i]
                    + poll_lat * inside
                    + weight * ((moment[j] - moment[i]) - a * inside)
                    + (1.0 - prob[j]) * (block + weight * (b - a));
                // Only a clear gain (1 ns) beats the simpler plan found first.
                if cost < best.0 - 1.0 {
                    let sleep = if i == 0 {
                        Duration::ZERO
                    } else {
                        Duration::from_nanos(sleep as u64)
                    };
                    best = (
                        cost,
                        PollPlan {
                            sleep,
                            window: Duration::from_nanos((b - a) as u64),
                        },
                    );
                }
            }
        }
        best.1
    }
}

/// This crate's own policy; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Predictive {
    config: PredictiveConfig,
    /// One distribution after a short halt, one after a long one: a workload
    /// whose halts alternate is predicted, not averaged.
    contexts: [Histogram; 2],
    /// Which context the next halt is in.
    next: usize,
    /// Learned lateness of a timed sleep, in ns.
    sleep_lateness_ns: f64,
    /// Preemption back-off: halts left without polling, and the current level.
    backoff_left: u32,
    backoff_level: u32,
}

impl Default for Predictive {
    fn default() -> Self {
        Self::new(PredictiveConfig::default())
    }
}

impl Predictive {
    /// A policy with `config`; it starts by polling up to 10 µs until it has
    /// seen a few halts.
    pub fn new(config: PredictiveConfig) -> Self {
        let initial = PollPlan::poll(Duration::from_micros(10).min(config.max_poll));
        Self {
            config,
            contexts: [Histogram::new(initial), Histogram::new(initial)],
            next: 0,
            sleep_lateness_ns: as_ns(config.block_latency),
            backoff_left: 0,
            backoff_level: 0,
        }
    }

    /// Wakes later than this make the next halt's context "after a long halt":
    /// a few block latencies, beyond which polling rarely pays.
    fn long_ns(&self) -> f64 {
        4.0 * as_ns(self.config.block_latency)
    }

    /// Where the wake-up of a finished halt most likely was, from halt start.
    fn wake_estimate_ns(&self, o: &HaltOutcome) -> f64 {
        let latency = as_ns(self.config.block_latency);
        let poll_end = as_ns(o.slept + o.polled);
        match o.woken {
            WokenDuring::Poll => as_ns(o.halt),
            // Blocked: the wake came after the poll window, `latency` before resuming.
            WokenDuring::Block => (as_ns(o.halt) - latency).max(poll_end),
            WokenDuring::Sleep => (as_ns(o.halt) - latency).clamp(0.0, as_ns(o.slept)),
        }
    }

    fn learn_sleep_lateness(&mut self, o: &HaltOutcome) {
        let planned = self.plan().sleep;
        if planned > Duration::ZERO && o.woken != WokenDuring::Sleep {
            let late = (as_ns(o.slept) - as_ns(planned)).max(0.0);
            // A slow average that leans towards the late end.
            let alpha = if late > self.sleep_lateness_ns {
                0.25
            } else {
                0.05
            };
            self.sleep_lateness_ns += alpha * (late - self.sleep_lateness_ns);
        }
    }

    fn learn_preemption(&mut self, o: &HaltOutcome) -> bool {
        if o.preempted {
            self.backoff_level = (self.backoff_level + 1).min(8);
            self.backoff_left = 1 << self.backoff_level;
            return true;
        }
        if o.polled > Duration::ZERO {
            self.backoff_level = self.backoff_level.saturating_sub(1);
        }
        self.backoff_left = self.backoff_left.saturating_sub(1);
        false
    }
}

impl PollPolicy for Predictive {
    fn plan(&self) -> PollPlan {
        if self.backoff_left > 0 {
            PollPlan::default()
        } else {
            self.contexts[self.next].plan
        }
    }

    fn window(&self) -> Duration {
        self.plan().window
    }

    fn learn(&mut self, o: &HaltOutcome) {
        if self.learn_preemption(o) {
            return; // a cut-short poll says nothing about the wake time
        }
        self.learn_sleep_lateness(o);
        let wake = self.wake_estimate_ns(o);
        let (config, lateness) = (self.config, self.sleep_lateness_ns);
        let h = &mut self.contexts[self.next];
        h.record(wake, config.memory);
        if h.samples >= WARM_UP && h.since_replan >= config.replan_every {
            h.since_replan = 0;
            h.plan = h.best_plan(&config, lateness);
        }
        self.next = usize::from(wake > self.long_ns());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimParams, Trace, simulate};

    const US: Duration = Duration::from_micros(1);

    fn learn_n(p: &mut Predictive, n: usize, o: HaltOutcome) {
        for _ in 0..n {
            p.learn(&o);
        }
    }

    #[test]
    fn buckets_are_monotonic_and_cover_the_range() {
        for i in 1..BUCKETS {
            assert!(edge_ns(i) > edge_ns(i - 1));
            assert_eq!(bucket_of(mid_ns(i)), i, "bucket {i}");
        }
        assert_eq!(bucket_of(0.0), 0);
        assert_eq!(bucket_of(1e12), BUCKETS - 1);
        assert!(edge_ns(BUCKETS - 1) > 10e6, "covers beyond 10 ms");
    }

    #[test]
    fn short_wakes_are_polled_for_just_long_enough() {
        let mut p = Predictive::default();
        learn_n(&mut p, 200, HaltOutcome::woken_while_polling(5 * US));
        let plan = p.plan();
        assert_eq!(plan.sleep, Duration::ZERO);
        assert!(plan.window >= 5 * US && plan.window <= 7 * US, "{plan:?}");
    }

    #[test]
    fn long_wakes_are_not_polled() {
        let mut p = Predictive::default();
        learn_n(
            &mut p,
            200,
            HaltOutcome::woken_after_blocking(Duration::ZERO, 5_000 * US),
        );
        assert_eq!(p.plan(), PollPlan::default());
    }

    #[test]
    fn predictable_wakes_are_slept_through_then_polled() {
        let params = SimParams::default();
        let trace = Trace::periodic(2000, 150 * US, 1);
        let r = simulate("own", &mut Predictive::default(), &trace, &params);
        assert!(r.polled_percent > 95.0, "{r:?}");
        assert!(r.poll_cpu < 30 * US, "sleeps most of the 150 µs: {r:?}");
        let plan = {
            let mut p = Predictive::default();
            simulate("own", &mut p, &trace, &params);
            p.plan()
        };
        assert!(
            plan.sleep >= 80 * US && plan.sleep + params.sleep_lateness <= 148 * US,
            "{plan:?}"
        );
    }

    #[test]
    fn preemption_backs_off_exponentially_and_recovers() {
        let mut p = Predictive::default();
        learn_n(&mut p, 64, HaltOutcome::woken_while_polling(5 * US));
        assert!(p.window() > Duration::ZERO);
        let cut = HaltOutcome {
            preempted: true,
            ..HaltOutcome::woken_after_blocking(2 * US, 80 * US)
        };
        p.learn(&cut);
        assert_eq!(p.window(), Duration::ZERO);
        learn_n(
            &mut p,
            2,
            HaltOutcome::woken_after_blocking(Duration::ZERO, 20 * US),
        );
        assert!(p.window() > Duration::ZERO, "probes again after 2 halts");
        p.learn(&cut);
        learn_n(
            &mut p,
            2,
            HaltOutcome::woken_after_blocking(Duration::ZERO, 20 * US),
        );
        assert_eq!(p.window(), Duration::ZERO, "the second back-off is longer");
    }

    #[test]
    fn the_window_never_exceeds_max_poll() {
        let config = PredictiveConfig {
            cpu_weight: 0.0,
            max_poll: 200 * US,
            ..Default::default()
        };
        let mut p = Predictive::new(config);
        learn_n(&mut p, 100, HaltOutcome::woken_while_polling(190 * US));
        learn_n(
            &mut p,
            100,
            HaltOutcome::woken_after_blocking(Duration::ZERO, 300 * US),
        );
        assert!(p.plan().window <= 200 * US);
    }

    #[test]
    fn alternating_halts_are_predicted_from_the_previous_one() {
        let mut p = Predictive::new(PredictiveConfig {
            hybrid: false,
            ..Default::default()
        });
        for _ in 0..100 {
            p.learn(&HaltOutcome::woken_while_polling(5 * US));
            p.learn(&HaltOutcome::woken_after_blocking(Duration::ZERO, 430 * US));
        }
        // After a long halt comes a short one: poll just past 5 µs.
        let after_long = p.plan();
        assert!(
            after_long.window >= 5 * US && after_long.window < 6 * US,
            "{after_long:?}"
        );
        p.learn(&HaltOutcome::woken_while_polling(5 * US));
        assert_eq!(
            p.plan(),
            PollPlan::default(),
            "after a short halt comes a long one: block"
        );
    }
}
