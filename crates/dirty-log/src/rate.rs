//! How fast the guest dirties memory, and a dirty limit per vCPU.
//!
//! A pre-copy converges only if the VMM sends pages faster than the guest
//! dirties them. [`DirtyRate`] turns page counts sampled at harvests (per
//! vCPU from the ring, [`KvmDirtyRing::pages_by_vcpu`](crate::KvmDirtyRing::pages_by_vcpu);
//! per slot from a [`DirtySet`](crate::DirtySet)'s [`counts`](crate::DirtySet::counts))
//! into pages per second, which with the measured bandwidth gives the
//! downtime a stop-and-copy would take now. [`DirtyLimit`] is QEMU's
//! dirty-limit (8.1) idea: given a target rate for the whole VM, it tells the
//! VMM how long each vCPU that writes faster than its share should pause,
//! so that only the vCPUs that write pay. When is the VMM's: at each
//! ring-full exit (QEMU), or after each slice of time the vCPU runs, at an
//! exit the VMM forces (a VMM that harvests the rings often, as a pre-copy
//! does, empties them before they fill; the reference VMM pauses a vCPU
//! after each 20 ms it runs, kicking it, starting from
//! [`with_first_pause`](DirtyLimit::with_first_pause) of a few ms). A vCPU
//! that writes nothing is never given a pause. Per-vCPU rates need the
//! dirty ring: bitmaps say which pages were written, not by whom, so with
//! them the VMM can only spread a slot's rate over the vCPUs and pause
//! them all (QEMU's auto-converge).
//!
//! Both are plain data driven by the caller's clock, so a fake one tests
//! them.

use std::time::Duration;

use crate::error::Error;

/// Half-life of [`DirtyRate`]'s smoothing unless told otherwise.
pub const DEFAULT_HALF_LIFE: Duration = Duration::from_millis(200);

/// Pages dirtied per second per source (a vCPU, or a slot), smoothed
/// exponentially over time.
#[derive(Clone, Debug, PartialEq)]
pub struct DirtyRate {
    half_life: Duration,
    /// The last sample: when, and each source's count then.
    last: Option<(Duration, Vec<u64>)>,
    rates: Vec<f64>,
    /// Whether a rate has been measured yet (the first is taken as is).
    measured: bool,
}

impl DirtyRate {
    /// An estimator for `sources` sources, smoothing with a half-life of
    /// `half_life` (a sample that long after the last weighs half).
    pub fn new(sources: usize, half_life: Duration) -> Self {
        Self {
            half_life,
            last: None,
            rates: vec![0.0; sources],
            measured: false,
        }
    }

    /// Takes each source's count of pages dirtied since some fixed start
    /// (`counts`, cumulative) at time `now` (since some fixed epoch). The
    /// first call only sets the baseline. A count below the last one (a
    /// counter that restarted) counts as nothing dirtied; a time not after
    /// the last sample's is ignored.
    ///
    /// # Errors
    /// [`Error::Config`] if `counts` is not one count per source.
    pub fn observe(&mut self, now: Duration, counts: &[u64]) -> Result<(), Error> {
        if counts.len() != self.rates.len() {
            return Err(Error::Config(format!(
                "{} dirty counts for {} sources",
                counts.len(),
                self.rates.len()
            )));
        }
        let Some((then, before)) = &self.last else {
            self.last = Some((now, counts.to_vec()));
            return Ok(());
        };
        let Some(elapsed) = now.checked_sub(*then).filter(|e| !e.is_zero()) else {
            return Ok(());
        };
        let seconds = elapsed.as_secs_f64();
        let weight = match self.measured {
            true => 1.0 - 0.5f64.powf(seconds / self.half_life.as_secs_f64().max(1e-9)),
            false => 1.0,
        };
        for ((rate, &count), &was) in self.rates.iter_mut().zip(counts).zip(before) {
            let now_rate = count.saturating_sub(was) as f64 / seconds;
            *rate += weight * (now_rate - *rate);
        }
        self.measured = true;
        self.last = Some((now, counts.to_vec()));
        Ok(())
    }

    /// Source `source`'s pages per second (0 before two samples, or for no
    /// such source).
    pub fn rate(&self, source: usize) -> f64 {
        self.rates.get(source).copied().unwrap_or(0.0)
    }

    /// Every source's pages per second.
    pub fn rates(&self) -> &[f64] {
        &self.rates
    }

    /// The whole VM's pages per second.
    pub fn total(&self) -> f64 {
        self.rates.iter().sum()
    }
}

/// The largest factor by which one [`DirtyLimit::update`] changes a pause.
const MAX_STEP: f64 = 4.0;
/// How far above or below its share a vCPU's rate may be before its pause
/// changes.
const TOLERANCE: f64 = 0.1;

/// How long each vCPU should pause at its next exit (after each
/// [`update`](Self::update)), so that the VM's dirty rate comes down to a
/// target.
///
/// Each [`update`](Self::update) shares the target among the vCPUs by
/// water-filling (a vCPU writing below an equal share keeps its rate and
/// leaves the rest to the others), then moves the pause of each vCPU above
/// its share up, and of each below it down, by the ratio of its rate to its
/// share (at most 4x per update). A vCPU that writes nothing has no pause.
#[derive(Clone, Debug, PartialEq)]
pub struct DirtyLimit {
    target: f64,
    first_pause: Duration,
    max_pause: Duration,
    pauses: Vec<Duration>,
}

impl DirtyLimit {
    /// A limit of `target` pages per second for a VM of `vcpus` vCPUs, with
    /// pauses from 50 µs up to 100 ms. A pause at each full ring of `n`
    /// entries caps a vCPU near `n` pages per pause: a 4096-entry ring and
    /// 100 ms hold a writer to about 41 000 pages (160 MiB) per second.
    pub fn new(vcpus: usize, target: f64) -> Self {
        Self {
            target: target.max(0.0),
            first_pause: Duration::from_micros(50),
            max_pause: Duration::from_millis(100),
            pauses: vec![Duration::ZERO; vcpus],
        }
    }

    /// The same limit with pauses of at most `max` (a vCPU paused that long
    /// at each full ring still runs between pauses).
    pub fn with_max_pause(mut self, max: Duration) -> Self {
        self.max_pause = max;
        self.first_pause = self.first_pause.min(max);
        self
    }

    /// The same limit with a first pause of `first` (the pause a vCPU gets
    /// when it first writes above its share; at most the longest pause): a
    /// VMM that pauses its vCPUs per time slice rather than per full ring
    /// starts with a share of the slice.
    pub fn with_first_pause(mut self, first: Duration) -> Self {
        self.first_pause = first.min(self.max_pause);
        self
    }

    /// The target, pages per second.
    pub fn target(&self) -> f64 {
        self.target
    }

    /// Sets the target (pages per second); the pauses follow at the next
    /// [`update`](Self::update).
    pub fn set_target(&mut self, target: f64) {
        self.target = target.max(0.0);
    }

    /// Moves each vCPU's pause toward its share of the target, from each
    /// vCPU's current rate (`rates`, pages per second, as
    /// [`DirtyRate::rates`] gives them for a ring's vCPUs).
    ///
    /// # Errors
    /// [`Error::Config`] if `rates` is not one rate per vCPU.
    pub fn update(&mut self, rates: &[f64]) -> Result<(), Error> {
        if rates.len() != self.pauses.len() {
            return Err(Error::Config(format!(
                "{} dirty rates for {} vCPUs",
                rates.len(),
                self.pauses.len()
            )));
        }
        let share = water_level(rates, self.target);
        for (pause, &rate) in self.pauses.iter_mut().zip(rates) {
            *pause = next_pause(*pause, rate, share, self.first_pause, self.max_pause);
        }
        Ok(())
    }

    /// How long vCPU `vcpu` should pause now (zero for no such vCPU).
    pub fn pause(&self, vcpu: usize) -> Duration {
        self.pauses.get(vcpu).copied().unwrap_or(Duration::ZERO)
    }

    /// Every vCPU's pause.
    pub fn pauses(&self) -> &[Duration] {
        &self.pauses
    }
}

/// The largest share any vCPU may dirty at so that all of `rates`, each
/// capped at it, add up to `target`; infinite where they fit as they are.
fn water_level(rates: &[f64], target: f64) -> f64 {
    let mut sorted: Vec<f64> = rates.iter().map(|r| r.max(0.0)).collect();
    sorted.sort_by(f64::total_cmp);
    let mut budget = target;
    for (k, &rate) in sorted.iter().enumerate() {
        let share = budget / (sorted.len() - k) as f64;
        if rate > share {
            return share;
        }
        budget -= rate;
    }
    f64::INFINITY
}

/// A vCPU's next pause: longer when `rate` is above `share`, shorter when
/// below, none when it does not write.
fn next_pause(pause: Duration, rate: f64, share: f64, first: Duration, max: Duration) -> Duration {
    if rate <= 0.0 {
        return Duration::ZERO;
    }
    let ratio = (rate / share).clamp(1.0 / MAX_STEP, MAX_STEP);
    if ratio > 1.0 + TOLERANCE {
        return pause.max(first).mul_f64(ratio).min(max);
    }
    if ratio < 1.0 - TOLERANCE {
        let shorter = pause.mul_f64(ratio);
        return if shorter < first / 2 {
            Duration::ZERO
        } else {
            shorter
        };
    }
    pause
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_steady_writer_reads_its_rate_and_the_first_sample_is_a_baseline() {
        let mut r = DirtyRate::new(2, DEFAULT_HALF_LIFE);
        r.observe(Duration::ZERO, &[0, 7]).unwrap();
        assert_eq!(r.rates(), [0.0, 0.0], "a baseline only");
        for i in 1..=5u64 {
            r.observe(MS * (100 * i as u32), &[i * 1000, 7]).unwrap();
        }
        assert!((r.rate(0) - 10_000.0).abs() < 1e-6, "{}", r.rate(0));
        assert_eq!(r.rate(1), 0.0, "a source that writes nothing");
        assert_eq!(r.total(), r.rate(0));
        assert_eq!(r.rate(9), 0.0);
    }

    #[test]
    fn a_change_weighs_half_after_one_half_life() {
        let mut r = DirtyRate::new(1, 100 * MS);
        r.observe(Duration::ZERO, &[0]).unwrap();
        r.observe(100 * MS, &[1000]).unwrap(); // 10 000 pages/s
        r.observe(200 * MS, &[1000 + 3000]).unwrap(); // 30 000 now
        assert!((r.rate(0) - 20_000.0).abs() < 1e-6, "{}", r.rate(0));
        // Many short samples at a rate, as one long one.
        let mut short = DirtyRate::new(1, 100 * MS);
        short.observe(Duration::ZERO, &[0]).unwrap();
        short.observe(100 * MS, &[1000]).unwrap();
        for i in 1..=10u64 {
            short
                .observe(MS * (100 + 10 * i as u32), &[1000 + 300 * i])
                .unwrap();
        }
        assert!((short.rate(0) - r.rate(0)).abs() < 1e-6);
    }

    #[test]
    fn odd_samples_are_errors_or_ignored_never_panics() {
        let mut r = DirtyRate::new(2, DEFAULT_HALF_LIFE);
        assert!(matches!(r.observe(MS, &[1]), Err(Error::Config(_))));
        r.observe(10 * MS, &[100, 100]).unwrap();
        r.observe(10 * MS, &[500, 500]).unwrap(); // no time passed
        r.observe(5 * MS, &[900, 900]).unwrap(); // time went back
        assert_eq!(r.rates(), [0.0, 0.0]);
        r.observe(20 * MS, &[50, 200]).unwrap(); // a counter restarted
        assert_eq!(r.rate(0), 0.0);
        assert!((r.rate(1) - 10_000.0).abs() < 1e-6);
        let mut zero = DirtyRate::new(1, Duration::ZERO);
        zero.observe(Duration::ZERO, &[0]).unwrap();
        zero.observe(MS, &[1]).unwrap();
        zero.observe(2 * MS, &[3]).unwrap();
        assert!((zero.rate(0) - 2000.0).abs() < 1e-6, "no smoothing");
    }

    #[test]
    fn the_target_is_shared_by_water_filling() {
        assert_eq!(water_level(&[100.0, 200.0], 1000.0), f64::INFINITY);
        assert_eq!(water_level(&[100.0, 5000.0, 5000.0], 1000.0), 450.0);
        assert_eq!(water_level(&[0.0, 0.0, 9000.0], 900.0), 900.0);
        assert_eq!(water_level(&[10.0, 10.0], 0.0), 0.0);
    }

    /// A ring of `entries` pages filled at `raw` pages per second, paused
    /// `pause` at each full exit, runs at `entries / (entries / raw + pause)`.
    fn paused_rate(raw: f64, pause: Duration) -> f64 {
        let entries = 4096.0;
        if raw <= 0.0 {
            return 0.0;
        }
        entries / (entries / raw + pause.as_secs_f64())
    }

    #[test]
    fn heavy_writers_converge_to_their_share_and_others_are_never_paused() {
        let raw = [0.0, 2_000.0, 400_000.0, 1_000_000.0];
        let mut limit = DirtyLimit::new(4, 100_000.0).with_max_pause(Duration::from_secs(1));
        let mut rates = raw;
        for _ in 0..40 {
            limit.update(&rates).unwrap();
            for (rate, (&raw, &pause)) in rates.iter_mut().zip(raw.iter().zip(limit.pauses())) {
                *rate = paused_rate(raw, pause);
            }
        }
        assert_eq!(limit.pause(0), Duration::ZERO, "writes nothing");
        assert_eq!(limit.pause(1), Duration::ZERO, "below its share");
        let share = (100_000.0 - 2_000.0) / 2.0;
        for v in [2, 3] {
            let off = (rates[v] - share).abs() / share;
            assert!(off <= TOLERANCE * 1.5, "vCPU {v}: {} vs {share}", rates[v]);
        }
        let total: f64 = rates.iter().sum();
        assert!(total <= 100_000.0 * (1.0 + TOLERANCE), "{total}");
    }

    #[test]
    fn pauses_stay_within_the_maximum_and_end_when_the_target_allows() {
        let mut limit = DirtyLimit::new(1, 1.0).with_max_pause(5 * MS);
        for _ in 0..50 {
            limit.update(&[1e9]).unwrap();
        }
        assert_eq!(limit.pause(0), 5 * MS);
        limit.set_target(f64::INFINITY);
        for _ in 0..10 {
            limit.update(&[1e9]).unwrap();
        }
        assert_eq!(limit.pause(0), Duration::ZERO, "all fit: no pause");
        assert!(matches!(limit.update(&[1.0, 2.0]), Err(Error::Config(_))));
        assert_eq!(limit.pause(7), Duration::ZERO);
        limit.set_target(-5.0);
        assert_eq!(limit.target(), 0.0);
    }

    #[test]
    fn the_first_pause_is_the_one_given_and_never_above_the_maximum() {
        let first = |limit: DirtyLimit| {
            let mut limit = limit;
            limit.update(&[2.0]).unwrap(); // twice its share of 1.0
            limit.pause(0)
        };
        let slice = DirtyLimit::new(1, 1.0).with_max_pause(1000 * MS);
        assert_eq!(
            first(slice.clone()),
            Duration::from_micros(100),
            "50 µs, doubled"
        );
        assert_eq!(first(slice.clone().with_first_pause(5 * MS)), 10 * MS);
        assert_eq!(first(slice.with_first_pause(5000 * MS)), 1000 * MS);
    }
}
