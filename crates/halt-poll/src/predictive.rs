//! `Predictive`: this crate's own policy. It learns the distribution of wake
//! times, not only the last halt, and picks the plan (an optional sleep, then a
//! poll window) that minimises expected wake latency plus weighted poll CPU.
//!
//! # How
//! - Every halt's wake time goes into a histogram of 64 log-spaced buckets
//!   (256 ns to about 16 ms, four per octave) whose counts decay by `1/memory`
//!   per halt (in O(1): newer samples weigh more), so the distribution follows
//!   the workload. There are two: one for
//!   halts that follow a short halt, one for halts that follow a long one, so a
//!   workload whose halts alternate is predicted rather than averaged.
//! - Every few halts it evaluates, for every poll start `a` (0, or the end of a
//!   sleep) and poll end `b` at bucket edges, the expected cost
//!   `P(t<a)·L + P(a≤t≤b)·(ℓ + λ·E[t−a]) + P(t>b)·(L + λ·(b−a))`,
//!   with `L` the latency of waking from a block, `ℓ` from a poll, and `λ` the
//!   weight of a nanosecond of poll CPU against one of latency; prefix sums make
//!   each evaluation O(1). It keeps the cheapest; blocking at once is a candidate.
//!   A window ends at the longest wake seen in its last bucket, not at the edge.
//! - A loop predictor, as in L-TAGE branch predictors: when the last runs of
//!   short halts all had the same length `n`, the halt after `n` short ones has
//!   its own histogram, so the long halt that ends a regular burst is
//!   predicted (and not polled) instead of paying a window every burst.
//! - Latency slack: the cheapest plan may be mixed with a frugal one. Of the
//!   plans that waste less CPU in failed polls (and poll no more), it takes the
//!   one that saves the most per nanosecond of added latency, for just enough
//!   halts (chosen at random) that the expected latency above a poll's grows
//!   by at most `latency_slack`. This is the optimum of "least failed-poll CPU
//!   within a latency budget", which needs a mixture: on memoryless bimodal
//!   wakes no single window trades a little latency for CPU. It mixes only
//!   where failed polls are a real cost: at least a tenth of the plan's poll
//!   CPU, and at least `cpu_weight` ns of them saved per ns of latency added.
//!   Where nearly every poll succeeds, polling works and is left alone.
//! - A sleep ends late: the lateness of past sleeps is learned, and a sleep is
//!   planned to end that much before the poll start.
//! - If a poll was cut short because the thread was preempted, or skipped
//!   because the CPU was contended (the [`HaltPoller`](crate::HaltPoller) does
//!   not poll then), it stops polling for 2, 4, 8... halts (up to 256), then
//!   probes again: on 2 busy cores a poller can starve the very thread that
//!   would wake it, and a CPU hog outlasts one contention verdict. Such halts
//!   are not learned from: their times are distorted.

use std::time::Duration;

use crate::policy::{HaltOutcome, PollPlan, PollPolicy, WokenDuring};

const BUCKETS: usize = 64;
/// Lower edge of bucket 1 (bucket 0 is everything below it): 2^8 ns.
const FIRST_EDGE_SHIFT: u32 = 8;
/// Latency slack is spent only on plans whose failed polls are at least this
/// share of their poll CPU: where nearly every poll succeeds, polling works.
const MIN_WASTED_SHARE: f64 = 0.1;
/// A poll after a sleep starts this share earlier than the shortest wake seen:
/// the samples' range understates the real one.
const START_GUARD: f64 = 0.01;
/// Samples before the first learned plan.
const WARM_UP: u32 = 2;
/// Until a context has this many samples it re-plans after every halt.
const EAGER_SAMPLES: u32 = 32;

/// Settings of [`Predictive`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
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
    /// Shortest poll window when it polls at all: wake-ups a little later than
    /// any seen so far (a host interrupt, a cache miss) are still caught.
    pub min_window: Duration,
    /// How much mean wake latency, as a fraction of the cheapest plan's (above
    /// `poll_latency`), it may give up to waste less CPU in failed polls (0:
    /// always the cheapest plan; a negative or NaN slack counts as 0). See the
    /// module docs.
    pub latency_slack: f64,
}

impl Default for PredictiveConfig {
    fn default() -> Self {
        Self {
            max_poll: Duration::from_micros(500),
            block_latency: Duration::from_micros(30),
            poll_latency: Duration::from_nanos(100),
            cpu_weight: 0.1,
            memory: 1024,
            replan_every: 8,
            hybrid: true,
            min_window: Duration::from_micros(10),
            latency_slack: 0.5,
        }
    }
}

/// The lower edge of bucket `i`, in ns: buckets split each octave from 256 ns
/// into four equal parts (an integer log with two mantissa bits).
fn edge_ns(i: usize) -> f64 {
    if i == 0 {
        return 0.0;
    }
    let (octave, quarter) = ((i - 1) / 4, (i - 1) % 4);
    f64::from(1u32 << FIRST_EDGE_SHIFT) * 2f64.powi(octave as i32) * (1.0 + quarter as f64 / 4.0)
}

/// A representative wake time of bucket `i`, in ns: the middle of its range.
fn mid_ns(i: usize) -> f64 {
    (edge_ns(i) + edge_ns(i + 1)) / 2.0
}

fn bucket_of(ns: f64) -> usize {
    let ns = ns as u64;
    if ns < 1 << FIRST_EDGE_SHIFT {
        return 0;
    }
    let msb = 63 - ns.leading_zeros();
    let quarter = (ns >> (msb - 2)) & 3;
    (1 + 4 * (msb - FIRST_EDGE_SHIFT) as usize + quarter as usize).min(BUCKETS - 1)
}

fn as_ns(d: Duration) -> f64 {
    d.as_nanos() as f64
}

/// Decayed counts of wake times, and the shortest and longest wake seen in each
/// bucket (windows start and end there, not at bucket edges).
///
/// Decay is O(1): each sample is added with a weight that grows by
/// `1/(1 - 1/memory)` per sample, which is the same as shrinking all older
/// counts; the counts are rescaled before the weight grows too large. A bitmask
/// tracks the buckets with samples, so planning looks only at those.
#[derive(Clone, Debug)]
struct Histogram {
    counts: [f64; BUCKETS],
    shortest_ns: [f64; BUCKETS],
    longest_ns: [f64; BUCKETS],
    occupied: u64,
    weight: f64,
    samples: u32,
    since_replan: u32,
    plans: Plans,
}

/// A bucket whose share falls below this is forgotten.
const NEGLIGIBLE: f64 = 1e-6;

impl Histogram {
    fn new(initial: PollPlan) -> Self {
        Self {
            counts: [0.0; BUCKETS],
            shortest_ns: [f64::INFINITY; BUCKETS],
            longest_ns: [0.0; BUCKETS],
            occupied: 0,
            weight: 1.0,
            samples: 0,
            since_replan: 0,
            plans: Plans::only(initial),
        }
    }

    fn record(&mut self, wake_ns: f64, memory: u32) {
        let k = bucket_of(wake_ns);
        self.counts[k] += self.weight;
        self.shortest_ns[k] = self.shortest_ns[k].min(wake_ns);
        self.longest_ns[k] = self.longest_ns[k].max(wake_ns);
        self.occupied |= 1 << k;
        self.weight /= 1.0 - 1.0 / f64::from(memory.max(2));
        if self.weight > 1e100 {
            self.counts.iter_mut().for_each(|c| *c /= self.weight);
            self.weight = 1.0;
        }
        self.samples = self.samples.saturating_add(1);
        self.since_replan += 1;
    }

    /// The occupied buckets, in order, after forgetting negligible ones.
    fn occupied_buckets(&mut self) -> ([usize; BUCKETS], usize) {
        let total: f64 = (0..BUCKETS)
            .filter(|&k| self.occupied & (1 << k) != 0)
            .map(|k| self.counts[k])
            .sum();
        let (mut list, mut n) = ([0; BUCKETS], 0);
        for k in 0..BUCKETS {
            if self.occupied & (1 << k) == 0 {
                continue;
            }
            if self.counts[k] < NEGLIGIBLE * total {
                (self.counts[k], self.shortest_ns[k], self.longest_ns[k]) =
                    (0.0, f64::INFINITY, 0.0);
                self.occupied &= !(1 << k);
                continue;
            }
            list[n] = k;
            n += 1;
        }
        (list, n)
    }

    /// Calls `visit` with every candidate plan under this distribution, the
    /// simplest first: blocking at once, then each poll start (0, or after a
    /// sleep, at the shortest wake of an occupied bucket) with each window end
    /// (just after the longest wake of an occupied bucket). The search is
    /// quadratic in the number of occupied buckets, usually a handful.
    fn for_each_plan(
        &mut self,
        c: &PredictiveConfig,
        sleep_lateness_ns: f64,
        mut visit: impl FnMut(Candidate),
    ) {
        let (list, n) = self.occupied_buckets();
        let used = &list[..n];
        let total: f64 = used.iter().map(|&k| self.counts[k]).sum();
        if total <= 0.0 {
            return;
        }
        // below[x]: mass and sum of wake times in the occupied buckets before used[x].
        let mut below = [(0.0, 0.0); BUCKETS + 1];
        for (x, &k) in used.iter().enumerate() {
            let p = self.counts[k] / total;
            below[x + 1] = (below[x].0 + p, below[x].1 + p * mid_ns(k));
        }
        let (block, poll_lat) = (as_ns(c.block_latency), as_ns(c.poll_latency));
        let (max_poll, min_window) = (as_ns(c.max_poll), as_ns(c.min_window));
        visit(Candidate {
            latency_ns: block,
            cpu_ns: 0.0,
            wasted_ns: 0.0,
            plan: PollPlan::default(),
        });
        // A sleep is planned only from enough samples: a few long halts while
        // warming up would otherwise sleep through the short ones after them.
        let may_sleep = c.hybrid && self.samples >= EAGER_SAMPLES;
        let starts = std::iter::once((0, 0.0)).chain(
            (0..n)
                .filter(|_| may_sleep)
                .map(|x| (x, self.shortest_ns[used[x]] * (1.0 - START_GUARD))),
        );
        for (x, a) in starts {
            let sleep = a - sleep_lateness_ns;
            if a > 0.0 && sleep <= 0.0 {
                continue; // a sleep that short would end after the poll start
            }
            for y in x..n {
                let b = (self.longest_ns[used[y]] + 1.0).max(a + min_window);
                if b - a > max_poll {
                    break;
                }
                let (p_in, m_in) = (below[y + 1].0 - below[x].0, below[y + 1].1 - below[x].1);
                let p_after = 1.0 - below[y + 1].0;
                visit(Candidate {
                    latency_ns: block * (below[x].0 + p_after) + poll_lat * p_in,
                    cpu_ns: (m_in - a * p_in) + p_after * (b - a),
                    wasted_ns: p_after * (b - a),
                    plan: PollPlan {
                        sleep: Duration::from_nanos(sleep.max(0.0) as u64),
                        window: Duration::from_nanos((b - a) as u64),
                    },
                });
            }
        }
    }

    /// Plans for this distribution: the cheapest, and the frugal mixture
    /// (see the module docs).
    fn best_plans(&mut self, c: &PredictiveConfig, sleep_lateness_ns: f64) -> Plans {
        let mut best: Option<Candidate> = None;
        self.for_each_plan(c, sleep_lateness_ns, |p| {
            // Only a clear gain (1 ns) beats the simpler plan found first.
            if best.is_none_or(|b| p.cost(c.cpu_weight) < b.cost(c.cpu_weight) - 1.0) {
                best = Some(p);
            }
        });
        let Some(best) = best else {
            return self.plans;
        };
        match self.frugal_plan(c, sleep_lateness_ns, &best) {
            Some(frugal) => {
                let added = frugal.latency_ns - best.latency_ns;
                let budget = c.latency_slack * (best.latency_ns - as_ns(c.poll_latency));
                Plans {
                    best: best.plan,
                    frugal: frugal.plan,
                    frugal_share: (budget / added).clamp(0.0, 1.0),
                }
            }
            None => Plans::only(best.plan),
        }
    }

    /// The plan that saves the most failed-poll CPU per nanosecond of latency
    /// added to `best` (a successful poll is what buys the latency), if `best`
    /// wastes enough for a trade to be worth it (see the module docs).
    fn frugal_plan(
        &mut self,
        c: &PredictiveConfig,
        sleep_lateness_ns: f64,
        best: &Candidate,
    ) -> Option<Candidate> {
        if best.wasted_ns < MIN_WASTED_SHARE * best.cpu_ns {
            return None;
        }
        let mut frugal: Option<(f64, Candidate)> = None;
        self.for_each_plan(c, sleep_lateness_ns, |p| {
            let saved = best.wasted_ns - p.wasted_ns;
            let added = p.latency_ns - best.latency_ns;
            let worth = saved > 0.0
                && added > 0.0
                && saved >= c.cpu_weight * added
                && p.cpu_ns <= best.cpu_ns;
            if worth && frugal.is_none_or(|(rate, _)| saved / added > rate) {
                frugal = Some((saved / added, p));
            }
        });
        frugal.map(|(_, p)| p)
    }
}

/// One plan with its expected wake latency, poll CPU and failed-poll CPU per
/// halt.
#[derive(Clone, Copy, Debug)]
struct Candidate {
    latency_ns: f64,
    cpu_ns: f64,
    wasted_ns: f64,
    plan: PollPlan,
}

impl Candidate {
    fn cost(&self, cpu_weight: f64) -> f64 {
        self.latency_ns + cpu_weight * self.cpu_ns
    }
}

/// What a context plans: the cheapest plan, and a frugal one used for a share
/// of the halts.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Plans {
    best: PollPlan,
    frugal: PollPlan,
    frugal_share: f64,
}

impl Plans {
    fn only(plan: PollPlan) -> Self {
        Self {
            best: plan,
            frugal: plan,
            frugal_share: 0.0,
        }
    }
}

/// The contexts a halt can be in, each with its own histogram.
const AFTER_SHORT: usize = 0;
const AFTER_LONG: usize = 1;
/// The halt after a run of short halts as long as the last few runs.
const RUN_END: usize = 2;

/// Loop predictor: the length of runs of short halts between long ones, and how
/// many runs in a row had that length.
#[derive(Clone, Copy, Debug, Default)]
struct RunLength {
    current: u32,
    last: u32,
    repeats: u32,
}

/// Runs of the same length needed before the end of the next one is predicted.
const RUN_REPEATS: u32 = 2;

impl RunLength {
    fn record(&mut self, long: bool) {
        if !long {
            self.current = self.current.saturating_add(1);
            return;
        }
        if self.current == self.last {
            self.repeats = (self.repeats + 1).min(RUN_REPEATS);
        } else {
            (self.last, self.repeats) = (self.current, 0);
        }
        self.current = 0;
    }

    /// Whether the next halt ends a run as long as the last ones.
    fn ends_now(&self) -> bool {
        self.repeats >= RUN_REPEATS && self.last > 0 && self.current == self.last
    }
}

/// This crate's own policy; see the [module docs](self).
#[derive(Clone, Debug)]
pub struct Predictive {
    config: PredictiveConfig,
    /// Wake-time distributions after a short halt, after a long one, and at
    /// the predicted end of a run of short ones: a workload whose halts
    /// alternate or come in regular bursts is predicted, not averaged.
    contexts: [Histogram; 3],
    /// Which context the next halt is in.
    next: usize,
    runs: RunLength,
    /// Whether the next halt uses its context's frugal plan.
    frugal: bool,
    /// State of the xorshift generator that picks the frugal halts.
    random: u64,
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
    /// A policy with `config`. Each context blocks at once until it has seen
    /// a couple of halts: a guess would only cost CPU, and with one policy
    /// per wake source (see [`HaltPoller`](crate::HaltPoller)) a source that
    /// never fires then never makes the poller poll.
    pub fn new(config: PredictiveConfig) -> Self {
        let initial = Histogram::new(PollPlan::default());
        Self {
            config,
            contexts: [initial.clone(), initial.clone(), initial],
            next: AFTER_SHORT,
            runs: RunLength::default(),
            frugal: false,
            random: 0x9E37_79B9_7F4A_7C15,
            sleep_lateness_ns: as_ns(config.block_latency),
            backoff_left: 0,
            backoff_level: 0,
        }
    }

    /// A uniform number in [0, 1) (xorshift64).
    fn next_unit(&mut self) -> f64 {
        self.random ^= self.random << 13;
        self.random ^= self.random >> 7;
        self.random ^= self.random << 17;
        (self.random >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Picks the next halt's context, and whether it uses the frugal plan.
    fn predict_next(&mut self, long: bool) {
        self.runs.record(long);
        self.next = if self.runs.ends_now() {
            RUN_END
        } else if long {
            AFTER_LONG
        } else {
            AFTER_SHORT
        };
        let share = self.contexts[self.next].plans.frugal_share;
        self.frugal = share > 0.0 && self.next_unit() < share;
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

    /// Returns whether the halt says nothing about wake times: its poll was cut
    /// short by a preemption, or skipped because the CPU was contended. Either
    /// backs off: a poller on a contended CPU delays the thread that would wake
    /// it, and the contention outlasts the probe's verdict.
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
        o.preempted
    }
}

impl PollPolicy for Predictive {
    fn plan(&self) -> PollPlan {
        let plans = &self.contexts[self.next].plans;
        if self.backoff_left > 0 {
            PollPlan::default()
        } else if self.frugal {
            plans.frugal
        } else {
            plans.best
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
        let every = if h.samples < EAGER_SAMPLES {
            1
        } else {
            config.replan_every
        };
        if h.samples >= WARM_UP && h.since_replan >= every {
            h.since_replan = 0;
            h.plans = h.best_plans(&config, lateness);
        }
        self.predict_next(wake > self.long_ns());
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
        assert_eq!(bucket_of(255.0), 0);
        assert_eq!(bucket_of(256.0), 1);
        assert_eq!(bucket_of(320.0), 2, "a quarter octave up");
        assert_eq!(bucket_of(511.0), 4);
        assert_eq!(bucket_of(512.0), 5);
    }

    #[test]
    fn short_wakes_are_polled_for_just_long_enough() {
        let mut p = Predictive::default();
        learn_n(&mut p, 200, HaltOutcome::woken_while_polling(5 * US));
        let plan = p.plan();
        assert_eq!(plan.sleep, Duration::ZERO);
        assert!(
            plan.window >= 5 * US && plan.window <= 11 * US,
            "min_window 10 µs: {plan:?}"
        );
    }

    #[test]
    fn long_unpredictable_wakes_are_not_polled() {
        // Memoryless wakes averaging 5 ms: no window or sleep pays for itself.
        let trace = Trace::exponential(2000, 5_000 * US, 7);
        let r = simulate(
            "Predictive",
            &mut Predictive::default(),
            &trace,
            &SimParams::default(),
        );
        assert!(r.polled_percent < 2.0, "{r:?}");
        assert!(r.poll_cpu < US, "{r:?}");
    }

    #[test]
    fn predictable_wakes_are_slept_through_then_polled() {
        let params = SimParams::default();
        let trace = Trace::periodic(2000, 150 * US, 1);
        let r = simulate("Predictive", &mut Predictive::default(), &trace, &params);
        assert!(r.polled_percent > 95.0, "{r:?}");
        assert!(r.poll_cpu < 30 * US, "sleeps most of the 150 µs: {r:?}");
        let plan = {
            let mut p = Predictive::default();
            simulate("Predictive", &mut p, &trace, &params);
            p.plan()
        };
        let earliest = *trace.wakes.iter().min().unwrap();
        assert!(
            plan.sleep >= 80 * US && plan.sleep + params.sleep_lateness <= earliest + US,
            "polls from about the earliest wake on: {plan:?}, {earliest:?}"
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
    fn a_halt_skipped_on_a_contended_cpu_backs_off_too() {
        let mut p = Predictive::default();
        learn_n(&mut p, 64, HaltOutcome::woken_while_polling(5 * US));
        let window = p.window();
        assert!(window > Duration::ZERO);
        let contended = HaltOutcome {
            preempted: true,
            ..HaltOutcome::woken_after_blocking(Duration::ZERO, 80 * US)
        };
        p.learn(&contended);
        assert_eq!(p.window(), Duration::ZERO, "no poll right after contention");
        learn_n(
            &mut p,
            2,
            HaltOutcome::woken_after_blocking(Duration::ZERO, 20 * US),
        );
        assert_eq!(p.window(), window, "probes again, with what it had learned");
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
    fn the_long_halt_ending_a_regular_burst_is_predicted() {
        let mut p = Predictive::default();
        let short = HaltOutcome::woken_while_polling(8 * US);
        let long = HaltOutcome::woken_after_blocking(Duration::ZERO, 5_000 * US);
        for _ in 0..100 {
            learn_n(&mut p, 5, short);
            p.learn(&long);
        }
        learn_n(&mut p, 4, short);
        assert!(p.window() > Duration::ZERO, "mid-burst: poll");
        p.learn(&short);
        let plan = p.plan();
        assert!(
            plan.sleep > 4_000 * US,
            "the fifth short one ends it: sleep through to the long wake, {plan:?}"
        );
        // A burst of another length breaks the prediction until it repeats.
        p.learn(&short);
        assert!(p.window() > Duration::ZERO);
    }

    #[test]
    fn latency_slack_blocks_a_share_of_memoryless_bimodal_halts() {
        let trace = Trace::bimodal(4000, 20, 2);
        let params = SimParams::default();
        let run = |latency_slack| {
            let mut p = Predictive::new(PredictiveConfig {
                latency_slack,
                ..Default::default()
            });
            let r = simulate("Predictive", &mut p, &trace, &params);
            (r, p.contexts[AFTER_SHORT].plans)
        };
        let (cheapest, plans) = run(0.0);
        assert_eq!(plans.frugal_share, 0.0);
        for odd in [-1.0, f64::NAN] {
            let (r, _) = run(odd);
            assert_eq!(r.wasted_cpu, cheapest.wasted_cpu, "slack {odd} counts as 0");
        }
        let (frugal, plans) = run(0.5);
        assert!(
            plans.frugal.sleep > 25 * US,
            "the frugal plan does not poll for the short wakes: {plans:?}"
        );
        assert!(
            plans.frugal_share > 0.05 && plans.frugal_share < 0.5,
            "{plans:?}"
        );
        assert!(frugal.wasted_cpu < cheapest.wasted_cpu * 95 / 100);
        let budget = cheapest.mean_latency.as_secs_f64() * 1.6;
        assert!(frugal.mean_latency.as_secs_f64() < budget, "{frugal:?}");
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
        // After a long halt comes a short one: poll (at least min_window).
        let after_long = p.plan();
        assert!(
            after_long.window >= 5 * US && after_long.window <= 11 * US,
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
