//! [`WindowTuner`]: sets KVM's per-VM halt-polling window from what KVM's
//! own polling did, for VMMs on the in-kernel LAPIC (the only lever they have).
//!
//! KVM grows and shrinks each vCPU's window one halt at a time, under one
//! maximum per VM (`KVM_CAP_HALT_POLL`; the module's `halt_poll_ns` until a
//! VMM sets it). Its rule sees only the last halt: it polls a little on every
//! long halt before it shrinks, and grows back on the next short one. The
//! tuner looks at the distribution of halts instead and picks the maximum
//! under which KVM's rule keeps working: the one that pays, or, with a
//! [`budget`](TunerConfig::budget), the widest whose polling an operator
//! can afford.
//!
//! # The rule
//! Called every interval (10 ms is a good default: a few halts of a busy
//! vCPU, a cheap read of a few stats files), with every vCPU's statistics:
//! 1. **Halt lengths**, from the histograms' growth since the last call, all
//!    vCPUs together: a halt a poll caught lasted its poll time
//!    (`halt_poll_success_hist`), a halt that blocked its block time
//!    (`halt_wait_hist`, which KVM counts from the end of the poll) plus the
//!    poll that failed before it: the interval's failed polling
//!    (`halt_poll_fail_ns`) shared out over its blocked halts. Where KVM has no
//!    histograms (before Linux 5.15), each count goes in the bucket of its mean
//!    (`halt_poll_success_ns` over `halt_successful_poll`, `halt_wait_ns` over
//!    `halt_wakeup`, which counts only the blocks an interrupt or another vCPU
//!    ended, not a signal).
//! 2. They join a histogram of KVM's log2 buckets whose counts keep
//!    [`keep`](TunerConfig::keep) of their weight per interval, so it follows
//!    the workload; the elapsed time fades alike, so histogram over time is
//!    a rate of halts.
//! 3. The window, among `0` and the powers of two up to
//!    [`max_window`](TunerConfig::max_window):
//!    - **Cost** (no budget): the expected cost of a halt: a halt shorter
//!      than the window costs its length in polling, a longer one the window
//!      in polling plus [`block_latency`](TunerConfig::block_latency)
//!      (blocking at once costs only that); polling is weighed by
//!      [`cpu_weight`](TunerConfig::cpu_weight) ns of latency per ns of CPU,
//!      as in [`Predictive`](crate::Predictive). The cheapest window is
//!      chosen; ties go to the shorter one.
//!    - **Budget**: the widest window (it catches the most wake-ups) whose
//!      expected polling fits `budget` × vCPUs × the elapsed time: a halt
//!      shorter than the window polls its length, a longer one the whole
//!      window. That is an upper bound: KVM polls at most the maximum, less
//!      while its own window grows or another task wants the CPU, and a
//!      halt that blocked counts its wake-up too. So the polling KVM reports
//!      (faded as the histogram is) under the window set overrules it: where
//!      that polling, scaled by how much more the next wider window would
//!      poll by the estimate (at most twice: a window twice as wide polls
//!      each halt at most twice as long), fits three quarters of the budget,
//!      the window grows a power of two past the estimate's; where that
//!      polling fits the budget, the window stays.
//! 4. A window below [`HALT_POLL_NS_GROW_START`] is set as `0`: KVM would
//!    never grow into it.
//! 5. With fewer than [`min_halts`](TunerConfig::min_halts) halts in the
//!    histogram it changes nothing: too little to go on.
//! 6. **Hysteresis**: after a change the window stays for
//!    [`hold`](TunerConfig::hold) intervals, so a bimodal workload does not
//!    flip it (and KVM's per-vCPU windows) every few milliseconds; with a
//!    budget, it grows only to a window that fits three quarters of it. Until
//!    the window first narrows it may widen at every interval (with a
//!    budget, where the last interval's polling alone allows it): that first
//!    climb, a power of two at a time, is not a flip, and a run of a few
//!    hundred milliseconds would spend itself in holds.
//! 7. **A broken budget**: when the polling KVM reports
//!    (`halt_poll_success_ns` + `halt_poll_fail_ns`), faded as the
//!    histogram is, exceeded the budget, or the last interval's alone
//!    exceeded twice the budget, the window shrinks at once, whatever the
//!    hold: one power of two below the current one (KVM's default before the
//!    first), at each interval that breaks it. Not further at once: KVM
//!    drops a vCPU's own window to 0 when its halts outlast the maximum and
//!    grows it back only on a halt shorter than it, which a vCPU whose
//!    halts all block may never have again. Single intervals
//!    of a load at the budget's edge cross it both ways; the faded history
//!    does not, so such a load keeps its window.
//!
//! Both sides stay observed whatever the window: a halt polled through shows in
//! the success histogram, one that blocked in the wait histogram. So the
//! window can always move either way.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use super::{KvmError, KvmHaltStats, TunedVcpus, set_vm_halt_poll};
use crate::stats::HIST_BUCKETS;

/// KVM's `halt_poll_ns_grow_start` (10 µs on x86): a vCPU's window grows
/// from 0 straight to it, and only while it stays under the VM's maximum, so
/// a maximum below it never polls. The tuner sets such windows as 0, which
/// says so.
pub const HALT_POLL_NS_GROW_START: Duration = Duration::from_micros(10);

/// KVM's default window on x86 (the `halt_poll_ns` module parameter's
/// default), which applies until the tuner first sets one.
const KVM_DEFAULT_WINDOW: Duration = Duration::from_micros(200);

/// The share of the budget a wider window must fit before the tuner grows
/// to it (a narrower one shrinks as soon as the current one no longer fits
/// the whole budget): a dead band, so a load whose polling sits at the
/// budget's edge does not flip between two windows at every hold's end.
const GROW_MARGIN: f64 = 0.75;

/// How many times the budget one interval's polling must exceed to shrink
/// the window at once; below that, only the faded history's polling beyond
/// the budget does.
const SUDDEN_BREAK: f64 = 2.0;

/// Settings of a [`WindowTuner`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct TunerConfig {
    /// The longest window it sets.
    pub max_window: Duration,
    /// Latency a wake-up pays when it finds the vCPU blocked rather than
    /// polling (schedule-in on the host).
    pub block_latency: Duration,
    /// Nanoseconds of latency one nanosecond of polling CPU is worth.
    pub cpu_weight: f64,
    /// Share of the halt histogram's weight kept from one interval to the next.
    pub keep: f64,
    /// Halts (weighted) in the histogram before it sets a window.
    pub min_halts: f64,
    /// `Some(share)`: polling may cost at most this share of each vCPU's time
    /// (0.05: 5 %), and the tuner sets the widest window that stays within
    /// it instead of the cheapest one: an operator's bound on what an idle
    /// or bursty guest can burn on polling (a share is clamped to `0..=1`;
    /// NaN is 0, no polling). `None`: the cost model alone.
    pub budget: Option<f64>,
    /// Intervals a window stays before it may change again (a broken budget
    /// shrinks it at once): each change is a `KVM_ENABLE_CAP` and resets
    /// KVM's per-vCPU windows to grow again, so flipping with every burst
    /// costs more than it tracks.
    pub hold: u32,
}

impl Default for TunerConfig {
    fn default() -> Self {
        Self {
            max_window: Duration::from_micros(500),
            block_latency: Duration::from_micros(30),
            cpu_weight: 0.1,
            keep: 0.75,
            min_halts: 16.0,
            budget: None,
            // 100 ms at a 10 ms interval.
            hold: 10,
        }
    }
}

/// Tunes one VM's `KVM_CAP_HALT_POLL` window; see the [module docs](self).
///
/// ```no_run
/// use std::time::Duration;
/// use std::os::fd::AsRawFd;
/// use halt_poll::kvm::{KvmError, TunedVcpus, TunerConfig, WindowTuner};
///
/// /// Tunes the VM whose fd is `vm` until `running` says stop (a VMM runs
/// /// this on a thread of its own). `vm` and `vcpus` are whatever the VMM
/// /// holds: kvm-ioctls' `VmFd` and `VcpuFd` of any version fit.
/// fn tune<F: AsRawFd>(vm: &impl AsRawFd, vcpus: &[F], running: impl Fn() -> bool) -> Result<(), KvmError> {
///     let tuned = TunedVcpus::open(vcpus)?;
///     let mut config = TunerConfig::default();
///     config.budget = Some(0.05); // poll at most 5 % of each vCPU's time
///     let mut tuner = WindowTuner::starting_from(config, &tuned)?;
///     while running() {
///         std::thread::sleep(Duration::from_millis(10));
///         if let Some(window) = tuner.tune(vm, &tuned)? {
///             println!("halt polling up to {window:?}, {} changes", tuner.changes());
///         }
///     }
///     Ok(())
/// }
/// ```
#[derive(Clone, Debug, Default)]
pub struct WindowTuner {
    config: TunerConfig,
    /// Every vCPU's statistics as last read, by id.
    last: Vec<(u32, KvmHaltStats)>,
    /// Whether statistics were ever read: from then on a vCPU that joins
    /// counts from its first read.
    seen: bool,
    /// When `last` was read (by [`WindowTuner::tune`]).
    read_at: Option<Instant>,
    halts: [f64; HIST_BUCKETS],
    /// The time the histogram covers, ns, faded as its counts are.
    time_ns: f64,
    /// The polling KVM reported over that time, ns, faded alike.
    polled_ns: f64,
    window: Option<Duration>,
    applied: Option<Duration>,
    /// Intervals since the window last changed.
    held: u32,
    /// Whether the window ever narrowed: until then it is climbing.
    narrowed: bool,
    changes: u64,
    share: Option<f64>,
    /// The polling KVM reported, and the vCPU time it covers, since the
    /// first read, ns.
    total_polled_ns: u64,
    total_vcpu_ns: u128,
}

impl WindowTuner {
    /// A tuner with `config` that counts every halt since the vCPUs' stats
    /// fds were opened; [`WindowTuner::starting_from`] counts from now.
    pub fn new(config: TunerConfig) -> Self {
        Self {
            config,
            ..Self::default()
        }
    }

    /// A tuner whose first [`tune`](Self::tune) counts only the halts after
    /// this call: it reads every vCPU's statistics now. A stats fd opened
    /// long before holds halts that say nothing about the guest now.
    pub fn starting_from(config: TunerConfig, vcpus: &TunedVcpus) -> Result<Self, KvmError> {
        let mut tuner = Self::new(config);
        tuner.last = vcpus.read_all()?;
        tuner.seen = true;
        tuner.read_at = Some(Instant::now());
        Ok(tuner)
    }

    /// A tuner whose first [`update`](Self::update) counts only what grew
    /// since `baseline` (every vCPU's statistics, as `update` takes them).
    pub fn from_baseline(config: TunerConfig, baseline: &[KvmHaltStats]) -> Self {
        Self {
            last: by_position(baseline),
            seen: true,
            ..Self::new(config)
        }
    }

    /// The window it chose last (`None`: none yet, KVM's own applies).
    pub fn window(&self) -> Option<Duration> {
        self.window
    }

    /// How many times the window changed (each a `KVM_ENABLE_CAP` in
    /// [`tune`](Self::tune)), the first choice included.
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// The polling KVM reported for the last interval, as a share of one
    /// vCPU's time (mean over the vCPUs); `None` before an interval with a
    /// length.
    pub fn polling_share(&self) -> Option<f64> {
        self.share
    }

    /// The polling KVM reported since the first read, all vCPUs together,
    /// and the vCPU time it covers (each interval's length times the vCPUs
    /// then present): their ratio is the whole run's polling share, what a
    /// [`budget`](TunerConfig::budget) bounds.
    pub fn polling_total(&self) -> (Duration, Duration) {
        let vcpu_ns = u64::try_from(self.total_vcpu_ns).unwrap_or(u64::MAX);
        (
            Duration::from_nanos(self.total_polled_ns),
            Duration::from_nanos(vcpu_ns),
        )
    }

    /// Reads the statistics of every vCPU in `vcpus` (those that joined
    /// since the last call count from now; those that left are forgotten),
    /// updates the window and sets it on the VM whose fd is `vm` when it
    /// changed. Returns the window now chosen. System calls: a `pread64`
    /// per statistic per vCPU, and `ioctl(KVM_ENABLE_CAP)` on a change.
    pub fn tune(
        &mut self,
        vm: &impl AsRawFd,
        vcpus: &TunedVcpus,
    ) -> Result<Option<Duration>, KvmError> {
        let window = self.observe(vcpus)?;
        if let Some(w) = window.filter(|&w| Some(w) != self.applied) {
            set_vm_halt_poll(vm, w)?;
            self.applied = Some(w);
        }
        Ok(window)
    }

    /// [`tune`](Self::tune) without setting anything: reads every vCPU's
    /// statistics and returns the window the tuner would set. A dry run,
    /// and a meter of KVM's own polling under whatever window is set
    /// ([`polling_total`](Self::polling_total)).
    pub fn observe(&mut self, vcpus: &TunedVcpus) -> Result<Option<Duration>, KvmError> {
        let now = vcpus.read_all()?;
        let read_at = Instant::now();
        let elapsed = self
            .read_at
            .map_or(Duration::ZERO, |last| read_at.duration_since(last));
        self.read_at = Some(read_at);
        Ok(self.update_by_id(elapsed, &now))
    }

    /// Feeds every vCPU's cumulative statistics as read now (one entry per
    /// vCPU, in the same order each time), `elapsed` after the last ones,
    /// and returns the window chosen. This is the rule without KVM: unit
    /// tests feed it recorded statistics. A zero `elapsed` adds halts but no
    /// time, so a budget cannot be checked against it. vCPU `i` of one call
    /// is vCPU `i` of the next.
    pub fn update(&mut self, elapsed: Duration, vcpus: &[KvmHaltStats]) -> Option<Duration> {
        self.update_by_id(elapsed, &by_position(vcpus))
    }

    /// As [`update`](Self::update), with each vCPU's statistics under its
    /// id: a vCPU missing from the last call (it joined) counts from this
    /// one, and one missing from this call (it left) is forgotten, so the
    /// budget covers the vCPUs there are now.
    pub fn update_by_id(
        &mut self,
        elapsed: Duration,
        vcpus: &[(u32, KvmHaltStats)],
    ) -> Option<Duration> {
        let keep = self.config.keep;
        self.halts.iter_mut().for_each(|h| *h *= keep);
        self.time_ns = self.time_ns * keep + elapsed.as_nanos() as f64;
        self.polled_ns *= keep;
        let mut polled_ns = 0;
        let never = KvmHaltStats::default();
        for (id, now) in vcpus {
            let last = self.last.iter().find(|(v, _)| v == id).map(|(_, s)| s);
            let Some(last) = last.or((!self.seen).then_some(&never)) else {
                continue;
            };
            add_halts(&mut self.halts, now, last);
            polled_ns += polled(now).saturating_sub(polled(last));
        }
        self.last = vcpus.to_vec();
        self.seen = true;
        self.polled_ns += polled_ns as f64;
        self.total_polled_ns = self.total_polled_ns.saturating_add(polled_ns);
        self.total_vcpu_ns += elapsed.as_nanos() * vcpus.len() as u128;
        let capacity_ns = elapsed.as_nanos() as f64 * vcpus.len() as f64;
        self.share = (capacity_ns > 0.0).then(|| polled_ns as f64 / capacity_ns);
        self.held = self.held.saturating_add(1);
        let broken = self.budget().is_some_and(|budget| self.broken(budget));
        let enough = self.halts.iter().sum::<f64>() >= self.config.min_halts;
        let chosen = if broken {
            Some(self.shrunk())
        } else if enough {
            self.chosen()
        } else {
            None
        };
        let chosen = chosen
            .map(above_grow_start)
            .filter(|&w| broken || self.may_move_to(w));
        if let Some(w) = chosen.filter(|&w| Some(w) != self.window) {
            self.narrowed |= self.window.is_some_and(|current| w < current);
            self.window = Some(w);
            self.held = 0;
            self.changes += 1;
        }
        self.window
    }

    /// Whether the window may move to `window` now: after
    /// [`hold`](TunerConfig::hold) intervals, or at once to widen it while
    /// it has never narrowed (the first climb is not a flip, and a short run
    /// should not wait a hold per power of two).
    fn may_move_to(&self, window: Duration) -> bool {
        match self.window {
            None => true,
            Some(current) => {
                self.held >= self.config.hold
                    || (!self.narrowed
                        && window > current
                        && self.last_interval_allows_wider(current))
            }
        }
    }

    /// With a budget, whether the polling KVM reported in the last interval
    /// alone (the only one wholly under `current`), scaled as in the rule,
    /// fits [`GROW_MARGIN`] of it: the faded history still holds the
    /// narrower window's.
    fn last_interval_allows_wider(&self, current: Duration) -> bool {
        match (self.budget(), self.share) {
            (None, _) => true,
            (Some(budget), Some(share)) => self.growth(current) * share <= budget * GROW_MARGIN,
            (Some(_), None) => false,
        }
    }

    /// The budget as a share of a vCPU, where there is one.
    fn budget(&self) -> Option<f64> {
        let share = |b: f64| if b.is_nan() { 0.0 } else { b.clamp(0.0, 1.0) };
        self.config.budget.map(share)
    }

    /// Whether polling broke `budget`: over the faded history (a load that
    /// sits at the budget's edge crosses it in single intervals without
    /// breaking it), or by more than [`SUDDEN_BREAK`] times in the last
    /// interval alone (a load that changed shrinks the window at once).
    fn broken(&self, budget: f64) -> bool {
        let capacity = self.last.len() as f64 * self.time_ns;
        let sustained = capacity > 0.0 && self.polled_ns / capacity > budget;
        let sudden = self
            .share
            .is_some_and(|share| share > budget * SUDDEN_BREAK);
        sustained || sudden
    }

    /// The window the histogram calls for (`None`: a budget with no
    /// elapsed time to spread it over yet), before the grow-start floor.
    fn chosen(&self) -> Option<Duration> {
        match self.budget() {
            None => Some(self.cheapest_window()),
            Some(budget) => self.widest_within(budget),
        }
    }

    /// The window after polling broke the budget: one power of two below
    /// the current one (KVM's default before the first), at each interval
    /// that breaks it. Not straight to the estimate's window: KVM shrinks a
    /// vCPU's own window to 0 when a halt outlasts the maximum and grows it
    /// back only on a halt shorter than the maximum, so a deep cut leaves
    /// vCPUs whose halts then all block (and last longer for it) polling
    /// nothing long after the window widens again.
    fn shrunk(&self) -> Duration {
        below(self.window.unwrap_or(KVM_DEFAULT_WINDOW))
    }

    /// The windows considered, as `(k, window)`: 0 (`k` = 0), then `2^k` ns
    /// up to the maximum.
    fn candidates(&self) -> impl Iterator<Item = (usize, Duration)> {
        let max = self.config.max_window;
        std::iter::once((0, Duration::ZERO)).chain(
            (1..HIST_BUCKETS)
                .map(|k| (k, Duration::from_nanos(1 << k)))
                .take_while(move |&(_, w)| w <= max),
        )
    }

    /// The window with the least expected cost over the halt histogram.
    fn cheapest_window(&self) -> Duration {
        let c = &self.config;
        let block = c.block_latency.as_nanos() as f64;
        let cost = |k| c.cpu_weight * self.polled_ns(k) + block * self.blocked(k);
        let mut best = (f64::INFINITY, Duration::ZERO);
        for (k, window) in self.candidates() {
            let cost = cost(k);
            if cost < best.0 {
                best = (cost, window);
            }
        }
        best.1
    }

    /// The widest window whose expected polling fits `budget` of every
    /// vCPU's time over the time the histogram covers; wider than the
    /// current one only where it fits [`GROW_MARGIN`] of it.
    fn widest_within(&self, budget: f64) -> Option<Duration> {
        let capacity = self.last.len() as f64 * self.time_ns;
        let widest = |share: f64| {
            self.candidates()
                .filter(|&(k, _)| self.polled_ns(k) <= share * capacity)
                .map(|(_, w)| w)
                .last()
                .unwrap_or(Duration::ZERO)
        };
        let estimated = match (widest(budget), self.window) {
            (fits, Some(current)) if fits > current => widest(budget * GROW_MARGIN).max(current),
            (fits, _) => fits,
        };
        let measured = self.polled_ns / capacity;
        (capacity > 0.0).then(|| match self.window {
            Some(current) if self.growth(current) * measured <= budget * GROW_MARGIN => {
                estimated.max(self.wider(current))
            }
            Some(current) if measured <= budget => estimated.max(current),
            _ => estimated,
        })
    }

    /// How much more the next wider window would poll than `current`, by
    /// the histogram's estimate, and at most twice (a window twice as wide
    /// polls each halt at most twice as long).
    fn growth(&self, current: Duration) -> f64 {
        let k = |w: Duration| self.candidates().find(|&(_, c)| c == w).map(|(k, _)| k);
        let (now, wider) = (k(current), k(self.wider(current)));
        match (
            now.map(|k| self.polled_ns(k)),
            wider.map(|k| self.polled_ns(k)),
        ) {
            (Some(now), Some(wider)) if now > 0.0 => (wider / now).min(2.0),
            _ => 2.0,
        }
    }

    /// The power of two after `window` (from 0: the first at or above
    /// [`HALT_POLL_NS_GROW_START`]), at most the maximum.
    fn wider(&self, window: Duration) -> Duration {
        self.candidates()
            .map(|(_, w)| w)
            .find(|&w| w > window && w >= HALT_POLL_NS_GROW_START)
            .unwrap_or(window)
    }

    /// Expected polling over the histogram under the window `2^k` ns (k = 0:
    /// none): buckets `0..=k` hold the halts shorter than it, which poll
    /// their length; the longer ones poll the whole window.
    fn polled_ns(&self, k: usize) -> f64 {
        if k == 0 {
            return 0.0;
        }
        let window = (1u64 << k) as f64;
        let polled = |(i, &n): (usize, &f64)| n * if i <= k { typical_ns(i) } else { window };
        self.halts.iter().enumerate().map(polled).sum()
    }

    /// Halts (weighted) longer than the window `2^k` ns (k = 0: all), which
    /// block.
    fn blocked(&self, k: usize) -> f64 {
        let first = if k == 0 { 0 } else { k + 1 };
        self.halts.iter().skip(first).sum()
    }
}

/// Statistics by position, as ids `0, 1, ...`.
fn by_position(vcpus: &[KvmHaltStats]) -> Vec<(u32, KvmHaltStats)> {
    (0..).zip(vcpus.iter().cloned()).collect()
}

/// All the polling KVM reports for a vCPU, ns.
fn polled(s: &KvmHaltStats) -> u64 {
    s.halt_poll_success_ns.saturating_add(s.halt_poll_fail_ns)
}

/// `window`, or 0 where KVM would never poll under it.
fn above_grow_start(window: Duration) -> Duration {
    if window < HALT_POLL_NS_GROW_START {
        Duration::ZERO
    } else {
        window
    }
}

/// The power of two below `window` (0 below 2 ns).
fn below(window: Duration) -> Duration {
    let ns = u64::try_from(window.as_nanos()).unwrap_or(u64::MAX);
    match ns {
        0..=1 => Duration::ZERO,
        ns => Duration::from_nanos(1 << (63 - (ns - 1).leading_zeros())),
    }
}

/// A typical length of a halt in log2 bucket `i` (`[2^(i-1), 2^i)` ns): the
/// middle.
fn typical_ns(i: usize) -> f64 {
    match i {
        0 => 0.0,
        i => 0.75 * (1u64 << i) as f64,
    }
}

/// The bucket of `ns` (KVM's `KVM_STATS_LOG_HIST_UPDATE`).
fn bucket_of(ns: u64) -> usize {
    (64 - ns.leading_zeros() as usize).min(HIST_BUCKETS - 1)
}

/// Adds the halts between `last` and `now` (one vCPU's) to `halts`.
fn add_halts(halts: &mut [f64; HIST_BUCKETS], now: &KvmHaltStats, last: &KvmHaltStats) {
    let caught = now
        .halt_successful_poll
        .saturating_sub(last.halt_successful_poll);
    let polled = now
        .halt_poll_success_ns
        .saturating_sub(last.halt_poll_success_ns);
    add_hist(
        halts,
        &now.halt_poll_success_hist,
        &last.halt_poll_success_hist,
        caught,
        polled,
        0,
    );
    let blocked = now.halt_wakeup.saturating_sub(last.halt_wakeup);
    let waited = now.halt_wait_ns.saturating_sub(last.halt_wait_ns);
    let failed = now.halt_poll_fail_ns.saturating_sub(last.halt_poll_fail_ns);
    let poll_before_block = failed.checked_div(blocked).unwrap_or(0);
    add_hist(
        halts,
        &now.halt_wait_hist,
        &last.halt_wait_hist,
        blocked,
        waited,
        poll_before_block,
    );
}

/// Adds a histogram's growth, or, without one, `count` halts at the mean
/// `total_ns / count`; each halt `extra_ns` longer than it was recorded.
fn add_hist(
    halts: &mut [f64; HIST_BUCKETS],
    now: &[u64],
    last: &[u64],
    count: u64,
    total_ns: u64,
    extra_ns: u64,
) {
    if now.is_empty() {
        if count > 0 {
            halts[bucket_of((total_ns / count).saturating_add(extra_ns))] += count as f64;
        }
        return;
    }
    for (i, &n) in now.iter().enumerate() {
        let before = last.get(i).copied().unwrap_or(0);
        let bucket =
            bucket_of((typical_ns(i.min(HIST_BUCKETS - 1)) as u64).saturating_add(extra_ns));
        halts[bucket] += n.saturating_sub(before) as f64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1000;

    /// The interval the tests feed.
    const TICK: Duration = Duration::from_millis(10);

    /// Cumulative stats of a vCPU whose halts so far were `caught` (lengths,
    /// ns, that a poll caught) and `blocked` (block times, ns).
    fn stats(caught: &[u64], blocked: &[u64]) -> KvmHaltStats {
        let empty = KvmHaltStats {
            halt_poll_success_hist: vec![0; HIST_BUCKETS],
            halt_wait_hist: vec![0; HIST_BUCKETS],
            ..KvmHaltStats::default()
        };
        more(&empty, caught, blocked)
    }

    /// `s` after more halts, `caught` and `blocked` as in [`stats`].
    fn more(s: &KvmHaltStats, caught: &[u64], blocked: &[u64]) -> KvmHaltStats {
        let mut s = s.clone();
        for &ns in caught {
            s.halt_successful_poll += 1;
            s.halt_attempted_poll += 1;
            s.halt_poll_success_ns += ns;
            s.halt_poll_success_hist[bucket_of(ns)] += 1;
        }
        for &ns in blocked {
            s.halt_wakeup += 1;
            s.halt_wait_ns += ns;
            s.halt_wait_hist[bucket_of(ns)] += 1;
        }
        s
    }

    /// A tuner with a budget of `share`.
    fn budgeted(share: f64) -> WindowTuner {
        WindowTuner::new(TunerConfig {
            budget: Some(share),
            ..TunerConfig::default()
        })
    }

    /// A tuner with `config` that may change the window every interval,
    /// for the tests of the rule itself.
    fn every_interval(config: TunerConfig) -> WindowTuner {
        WindowTuner::new(TunerConfig { hold: 1, ..config })
    }

    #[test]
    fn short_halts_get_a_window_just_above_them() {
        let mut t = WindowTuner::default();
        // 40 µs halts, seen while KVM's window caught them.
        let w = t.update(TICK, &[stats(&[40 * US; 32], &[])]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 16)), "65.5 µs > 40 µs");
    }

    #[test]
    fn long_halts_get_no_window() {
        let mut t = WindowTuner::default();
        // A 1 ms periodic timer: every halt blocks for about 1 ms.
        let w = t.update(TICK, &[stats(&[], &[1000 * US; 32])]);
        assert_eq!(w, Some(Duration::ZERO));
    }

    #[test]
    fn short_halts_seen_as_blocks_open_the_window_again() {
        let mut t = every_interval(TunerConfig::default());
        t.update(TICK, &[stats(&[], &[1000 * US; 32])]);
        // The workload turns to short halts; with no window they block briefly.
        let w = t.update(
            TICK,
            &[stats(
                &[],
                &[[1000 * US; 32].as_slice(), &[20 * US; 200]].concat(),
            )],
        );
        assert_eq!(w, Some(Duration::from_nanos(1 << 15)), "32.8 µs > 20 µs");
    }

    #[test]
    fn too_few_halts_change_nothing_and_the_histogram_fades() {
        let mut t = every_interval(TunerConfig::default());
        assert_eq!(t.update(TICK, &[stats(&[40 * US; 4], &[])]), None);
        let first = stats(&[40 * US; 40], &[]);
        assert!(
            t.update(TICK, std::slice::from_ref(&first))
                .is_some_and(|w| w > Duration::ZERO)
        );
        // Later only long halts: the short ones fade (keep 0.75 per interval).
        let mut now = first;
        let mut windows = Vec::new();
        for _ in 0..8 {
            now = more(&now, &[], &[2000 * US; 8]);
            windows.push(t.update(TICK, &[now.clone()]));
        }
        assert!(
            windows[0].is_some_and(|w| w > Duration::ZERO),
            "{windows:?}"
        );
        assert_eq!(windows[7], Some(Duration::ZERO), "{windows:?}");
    }

    #[test]
    fn a_mix_polls_for_the_short_mode_only_while_it_pays() {
        let mut t = WindowTuner::default();
        // Half 20 µs halts, half 1 ms: catching the short ones saves 30 µs
        // each, for 3.3 µs of polling on each long one.
        let w = t.update(TICK, &[stats(&[20 * US; 20], &[1000 * US; 20])]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 15)));
        // One short halt per 40 long ones: not worth polling every long one.
        let mut t = WindowTuner::default();
        let w = t.update(TICK, &[stats(&[20 * US; 2], &[1000 * US; 200])]);
        assert_eq!(w, Some(Duration::ZERO));
    }

    #[test]
    fn a_blocked_halt_counts_the_poll_that_failed_before_it() {
        // KVM polled 200 µs, then blocked 20 µs: 220 µs halts, too long for
        // the 32.8 µs window that 20 µs halts would get.
        let mut s = stats(&[], &[20 * US; 32]);
        s.halt_attempted_poll = 32;
        s.halt_poll_fail_ns = 32 * 200 * US;
        let w = WindowTuner::default().update(TICK, &[s]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 18)), "262 µs > 220 µs");
    }

    #[test]
    fn the_window_never_exceeds_max_window() {
        let config = TunerConfig {
            max_window: Duration::from_micros(50),
            ..TunerConfig::default()
        };
        let mut t = WindowTuner::new(config);
        // 100 µs halts would be worth a 131 µs window.
        let w = t.update(TICK, &[stats(&[100 * US; 64], &[])]);
        assert!(w.is_some_and(|w| w <= config.max_window), "{w:?}");
    }

    #[test]
    fn without_histograms_the_means_stand_in() {
        let mut t = WindowTuner::default();
        let mut s = stats(&[40 * US; 32], &[]);
        s.halt_poll_success_hist.clear();
        s.halt_wait_hist.clear();
        assert_eq!(t.update(TICK, &[s]), Some(Duration::from_nanos(1 << 16)));
    }

    #[test]
    fn vcpus_are_summed_and_counters_are_deltas() {
        let mut t = WindowTuner::default();
        let a = stats(&[40 * US; 10], &[]);
        let b = stats(&[40 * US; 10], &[]);
        assert_eq!(
            t.update(TICK, &[a.clone(), b.clone()]),
            Some(Duration::from_nanos(1 << 16))
        );
        // The same cumulative values again: nothing new, so the histogram only
        // fades (20 * 0.75 = 15 < 16 halts): the window stays as it was.
        assert_eq!(t.update(TICK, &[a, b]), Some(Duration::from_nanos(1 << 16)));
        assert!(t.halts.iter().sum::<f64>() < 16.0);
    }

    /// The windows a tuner chooses over 60 intervals of a bimodal load (a
    /// VM's vCPUs together): two intervals of 40 µs halts that polls catch,
    /// two of five times as many 1 ms halts, and so on.
    #[test]
    fn a_vcpu_that_joins_counts_from_its_first_read_and_one_that_leaves_is_forgotten() {
        let mut t = WindowTuner::default();
        let a = stats(&[40 * US; 10], &[]);
        t.update_by_id(TICK, &[(0, a.clone())]);
        // vCPU 7 joins with 1000 halts behind it: they happened before it
        // joined, so none of them counts (10 * 0.75 < 16 halts: no window).
        let old = stats(&[40 * US; 1000], &[]);
        assert_eq!(
            t.update_by_id(TICK, &[(0, a.clone()), (7, old.clone())]),
            None
        );
        assert_eq!(t.last.len(), 2);
        // Its next 20 halts do.
        let newer = more(&old, &[40 * US; 20], &[]);
        assert_eq!(
            t.update_by_id(TICK, &[(0, a.clone()), (7, newer)]),
            Some(Duration::from_nanos(1 << 16))
        );
        // vCPU 7 leaves: the budget's capacity is one vCPU again.
        t.update_by_id(TICK, &[(0, a)]);
        assert_eq!(t.last.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [0]);
        // 10 + 20 halts polled 40 µs each (vCPU 7's first 1000 not counted),
        // over 1 + 2 + 2 + 1 vCPU-intervals.
        let (polled, vcpu_time) = t.polling_total();
        assert_eq!(polled, Duration::from_micros(30 * 40));
        assert_eq!(vcpu_time, TICK * 6);
    }

    fn bimodal(mut t: WindowTuner) -> (Vec<Option<Duration>>, u64) {
        let mut now = stats(&[], &[]);
        let windows = (0..60)
            .map(|i| {
                now = match (i / 2) % 2 {
                    0 => more(&now, &[40 * US; 40], &[]),
                    _ => more(&now, &[], &[1000 * US; 200]),
                };
                t.update(TICK, std::slice::from_ref(&now))
            })
            .collect();
        (windows, t.changes())
    }

    #[test]
    fn a_bimodal_load_does_not_flip_the_window_every_interval() {
        // Without hysteresis the load flips the window with each phase.
        let (windows, flips) = bimodal(every_interval(TunerConfig::default()));
        assert!(flips >= 10, "{flips} changes: {windows:?}");
        // With it, a window stays for `hold` intervals after each change.
        let (windows, changes) = bimodal(WindowTuner::default());
        assert!(
            changes <= 6,
            "{changes} changes in 60 intervals: {windows:?}"
        );
        let changed_at: Vec<usize> = (1..windows.len())
            .filter(|&i| windows[i] != windows[i - 1])
            .collect();
        for pair in changed_at.windows(2) {
            assert!(pair[1] - pair[0] >= 10, "{changed_at:?}: {windows:?}");
        }
    }

    #[test]
    fn a_broken_budget_shrinks_the_window_at_once_whatever_the_hold() {
        let mut t = budgeted(0.05);
        // Two 1 ms halts per 10 ms: a 131 µs window polls at most 2.6 %.
        let mut now = stats(&[], &[1000 * US; 20]);
        assert_eq!(
            t.update(TICK * 10, std::slice::from_ref(&now)),
            Some(Duration::from_nanos(1 << 17))
        );
        // KVM reports 3 ms of polling in the next 10 ms (30 %, say its
        // vCPU windows meet halts the histogram has not seen yet): the
        // window shrinks in this interval, not `hold` intervals later.
        now = more(&now, &[], &[1000 * US; 2]);
        now.halt_poll_fail_ns += 3000 * US;
        let w = t.update(TICK, std::slice::from_ref(&now));
        assert!(
            w.is_some_and(|w| w < Duration::from_nanos(1 << 17)),
            "{w:?}"
        );
        assert_eq!(t.polling_share(), Some(0.3));
        assert_eq!(t.changes(), 2);
        // Within the budget again, the hold applies: no change for a while.
        let before = t.window();
        for _ in 0..5 {
            now = more(&now, &[], &[1000 * US; 2]);
            assert_eq!(t.update(TICK, std::slice::from_ref(&now)), before);
        }
    }

    #[test]
    fn single_intervals_over_the_budget_do_not_shrink_a_window_that_fits_on_average() {
        // A ping-pong at the budget's edge: 50 µs halts, each caught by a
        // poll of its length, 28 and 48 per 10 ms in turn (14 % and 24 % of
        // the vCPU, 19 % on average) under a 20 % budget, with the widest
        // window set.
        let widest = Some(Duration::from_nanos(1 << 18));
        let mut now = stats(&[], &[]);
        let mut t = WindowTuner::from_baseline(budgeted(0.2).config, std::slice::from_ref(&now));
        t.window = widest;
        for i in 0..40 {
            now = more(&now, &vec![50 * US; if i % 2 == 0 { 28 } else { 48 }], &[]);
            let w = t.update(TICK, std::slice::from_ref(&now));
            assert_eq!(w, widest, "interval {i}");
        }
        assert_eq!(t.changes(), 0);
        // Then 60 per 10 ms for a while: 30 %, the average breaks too.
        let shrunk = (0..10).any(|_| {
            now = more(&now, &[50 * US; 60], &[]);
            t.update(TICK, std::slice::from_ref(&now)) < widest
        });
        assert!(shrunk);
    }

    #[test]
    fn windows_below_kvms_grow_start_are_set_as_zero() {
        // Halts a poll of a few ns catches (a wake-up already pending) beside
        // long ones: the cost model calls for 2 ns, then for 256 ns.
        for (short, chosen) in [(1, 2), (200, 256)] {
            let mut t = WindowTuner::default();
            let s = stats(&[short; 64], &[1000 * US; 64]);
            assert_eq!(t.update(TICK, &[s]), Some(Duration::ZERO), "{short} ns");
            assert_eq!(t.cheapest_window(), Duration::from_nanos(chosen));
        }
        // A budget that fits an 8 µs window but not 16 µs: 0.
        let mut t = budgeted(0.1);
        let w = t.update(TICK, &[stats(&[], &[100 * US; 100])]);
        assert_eq!(w, Some(Duration::ZERO));
        t.window = None; // what it chose before the floor
        assert_eq!(t.widest_within(0.1), Some(Duration::from_nanos(1 << 13)));
        // And a maximum below it.
        let mut t = WindowTuner::new(TunerConfig {
            max_window: Duration::from_micros(8),
            ..TunerConfig::default()
        });
        assert_eq!(
            t.update(TICK, &[stats(&[4 * US; 64], &[])]),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn the_first_update_counts_only_halts_since_the_baseline() {
        let baseline = stats(&[40 * US; 100], &[]);
        let now = more(&baseline, &[40 * US; 5], &[]);
        // Counted from the stats fd's opening, 105 halts look like plenty.
        assert!(
            WindowTuner::default()
                .update(TICK, std::slice::from_ref(&now))
                .is_some()
        );
        // From the baseline, 5 halts are fewer than min_halts: no window.
        let mut t = WindowTuner::from_baseline(TunerConfig::default(), &[baseline]);
        assert_eq!(t.update(TICK, &[now]), None);
        assert_eq!(t.changes(), 0);
    }

    #[test]
    fn the_budget_sets_the_widest_window_whose_polling_fits() {
        // Forty 200 µs halts per 10 ms, all blocked: a window polls its
        // whole length on each (40 × 32.8 µs = 13 % of the vCPU).
        let busy = || stats(&[], &[200 * US; 40]);
        let w = budgeted(0.2).update(TICK, &[busy()]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 15)), "65.5 µs polls 26 %");
        // A budget that fits polling every halt through: the widest window.
        let w = budgeted(1.0).update(TICK, &[busy()]);
        assert_eq!(
            w,
            Some(Duration::from_nanos(1 << 18)),
            "the last below 500 µs"
        );
        // A share beyond a whole vCPU is one; NaN is none.
        assert_eq!(budgeted(7.0).update(TICK, &[busy()]), w);
        assert_eq!(
            budgeted(f64::NAN).update(TICK, &[busy()]),
            Some(Duration::ZERO)
        );
        // Two vCPUs have twice the budget.
        let w = budgeted(0.2).update(TICK, &[busy(), stats(&[], &[])]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 16)));
    }

    #[test]
    fn a_budget_at_the_edge_of_a_window_does_not_flip_it() {
        // 200 µs halts, 40 per 10 ms, then 36, then 40 again, and so on: a
        // 32.8 µs window polls 13.1 % and 11.8 % of the vCPU, so it fits a
        // 12 % budget every other phase (alone, the 36 phase gets it).
        let phase = |i: usize| vec![200 * US; if (i / 12) % 2 == 0 { 40 } else { 36 }];
        let w = budgeted(0.12).update(TICK, &[stats(&[], &phase(12))]);
        assert_eq!(w, Some(Duration::from_nanos(1 << 15)));
        // Growing needs a fit within 3/4 of the budget: 16.4 µs throughout,
        // KVM reporting the window's failed polls (6.6 % and 5.9 %, which
        // doubled fit 3/4 of 12 % in neither phase).
        let mut t = budgeted(0.12);
        let mut now = stats(&[], &[]);
        for i in 0..96 {
            now = with_window(&now, &phase(i), t.window());
            let w = t.update(TICK, std::slice::from_ref(&now));
            assert_eq!(w, Some(Duration::from_nanos(1 << 14)), "interval {i}");
        }
        assert_eq!(t.changes(), 1);
    }

    /// `s` after halts of `blocked` ns under `window`: each polled the
    /// whole window first, as KVM then reports (`halt_poll_fail_ns`).
    fn with_window(s: &KvmHaltStats, blocked: &[u64], window: Option<Duration>) -> KvmHaltStats {
        let mut s = more(s, &[], blocked);
        let window = window.map_or(0, |w| w.as_nanos() as u64);
        s.halt_attempted_poll += blocked.len() as u64;
        s.halt_poll_fail_ns += window * blocked.len() as u64;
        s
    }

    #[test]
    fn polling_kvm_reports_far_below_the_estimate_grows_the_window() {
        // 200 µs halts that KVM, here, hardly polls at all (another task
        // wants the CPU): the estimate fits nothing in 5 %, but what KVM
        // reports under each window leaves room, a power of two at a time,
        // and a ramp up does not wait a hold at each step.
        let halts = || vec![200 * US; 40];
        let mut t = budgeted(0.05);
        let mut now = more(&stats(&[], &[]), &[], &halts());
        assert_eq!(
            t.update(TICK, std::slice::from_ref(&now)),
            Some(Duration::ZERO)
        );
        let mut windows = Vec::new();
        for _ in 0..8 {
            now = more(&now, &[], &halts()); // no polling reported
            windows.push(t.update(TICK, std::slice::from_ref(&now)).unwrap());
        }
        let us = |w: &Duration| w.as_micros();
        assert_eq!(
            windows.iter().map(us).collect::<Vec<_>>(),
            [16, 32, 65, 131, 262, 262, 262, 262],
            "up to the widest under max_window"
        );
        // Then KVM polls the window through on every halt: 52 % of the vCPU
        // breaks the budget, and the window shrinks at once.
        now = with_window(&now, &halts(), t.window());
        assert!(t.update(TICK, std::slice::from_ref(&now)) < Some(Duration::from_micros(262)));
    }

    /// The windows a tuner with `budget` sets over `intervals` intervals of
    /// 200 halts of 40 µs each, which KVM polls as its window says: through
    /// where the window is wider (its default's, 200 µs, before the first),
    /// for the whole window before blocking otherwise.
    fn windows_over_40us_halts(budget: f64, intervals: usize) -> Vec<u128> {
        let mut t = budgeted(budget);
        let mut now = stats(&[], &[]);
        let mut window = KVM_DEFAULT_WINDOW;
        let mut windows = Vec::new();
        for _ in 0..intervals {
            now = match window >= Duration::from_micros(40) {
                true => more(&now, &[40 * US; 200], &[]),
                false => with_window(&now, &[40 * US; 200], Some(window)),
            };
            window = t.update(TICK, std::slice::from_ref(&now)).unwrap();
            windows.push(window.as_micros());
        }
        windows
    }

    #[test]
    fn a_workload_whose_polling_would_break_the_budget_gets_a_smaller_window() {
        // 200 halts of 40 µs per 10 ms: the cost model polls them all (65.5
        // µs, 80 % of the vCPU); half a vCPU fits 16.4 µs; 5 % fits nothing.
        let short = || stats(&[40 * US; 200], &[]);
        let cheapest = WindowTuner::default().update(TICK, &[short()]);
        assert_eq!(cheapest, Some(Duration::from_nanos(1 << 16)));
        // A budget broken comes down a power of two per interval from
        // KVM's default window, never further at once, to the budget's.
        assert_eq!(windows_over_40us_halts(0.05, 6), [131, 65, 32, 16, 0, 0]);
        assert_eq!(
            windows_over_40us_halts(0.5, 40).last(),
            Some(&Duration::from_nanos(1 << 14).as_micros())
        );
        // No time to spread a budget over: nothing chosen yet.
        assert_eq!(budgeted(0.5).update(Duration::ZERO, &[short()]), None);
    }
}
