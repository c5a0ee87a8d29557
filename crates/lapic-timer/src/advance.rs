//! Advance policies: how early to arm the host timer so that, after its wake-up
//! lateness, the expiry path can spin to the exact target.
//!
//! A policy learns from each [`Wakeup`]: when the host timer was armed (the
//! target minus the advance) and when the thread actually woke, relative to the
//! target. Early wakes are spun away (CPU), late ones are lateness.

use std::time::Duration;

/// One host-timer wake-up, as the policies learn from it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Wakeup {
    /// The advance the timer was armed with.
    pub advance: Duration,
    /// Wake time minus target, ns: negative means early (and spun), positive late.
    pub delta_ns: i64,
}

impl Wakeup {
    /// A wake-up `delta_ns` after the target (negative: before it) of a host
    /// timer armed `advance` early.
    pub fn new(advance: Duration, delta_ns: i64) -> Self {
        Self { advance, delta_ns }
    }

    /// What a deadline teaches: armed at `armed_ns` for `target_ns` with
    /// `advance`, its host timer woke at `woke_ns` (host ns). A host timer
    /// cannot fire before it is armed, so the advance it had is at most the
    /// distance it was armed at: a deadline closer than the advance fired at
    /// once, and still tells how late the host runs a timer that is due.
    /// `None` for a deadline already past when armed (a guest behind its
    /// timers): its lateness would be the backlog, not the host's.
    pub fn of_deadline(
        advance: Duration,
        armed_ns: u64,
        target_ns: u64,
        woke_ns: u64,
    ) -> Option<Self> {
        let distance = target_ns.checked_sub(armed_ns).filter(|&d| d > 0)?;
        let delta_ns = i128::from(woke_ns) - i128::from(target_ns);
        Some(Self::new(
            advance.min(Duration::from_nanos(distance)),
            delta_ns.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64,
        ))
    }

    /// How late the host timer woke after the time it was armed for.
    pub fn wake_lateness(&self) -> Duration {
        let ns = self
            .delta_ns
            .saturating_add(self.advance.as_nanos().min(i64::MAX as u128) as i64);
        Duration::from_nanos(ns.max(0) as u64)
    }
}

/// Decides how early to arm the host timer.
pub trait AdvancePolicy {
    /// How far before the target to arm the host timer.
    fn advance(&self) -> Duration;

    /// Learns from a wake-up.
    fn learn(&mut self, wakeup: &Wakeup);
}

impl<P: AdvancePolicy + ?Sized> AdvancePolicy for Box<P> {
    fn advance(&self) -> Duration {
        (**self).advance()
    }

    fn learn(&mut self, wakeup: &Wakeup) {
        (**self).learn(wakeup)
    }
}

/// No advance: the host timer is armed for the target itself (every wake-up's
/// lateness is the guest's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoAdvance;

impl AdvancePolicy for NoAdvance {
    fn advance(&self) -> Duration {
        Duration::ZERO
    }

    fn learn(&mut self, _: &Wakeup) {}
}

/// A fixed advance (the hand-tuned `lapic_timer_advance_ns` of "KVM: x86:
/// add option to advance tscdeadline hrtimer expiration", 2014).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fixed(pub Duration);

impl AdvancePolicy for Fixed {
    fn advance(&self) -> Duration {
        self.0
    }

    fn learn(&mut self, _: &Wakeup) {}
}

/// KVM's automatic tuning (`adjust_lapic_timer_advance`), exactly: ignore deltas
/// below 100 or above 10000 TSC cycles; otherwise move the advance by one
/// eighth of the delta (in ns), down when early, up when late; if it exceeds
/// 5000 ns (including by wrapping below zero, as the kernel's `u32` does),
/// reset it to 1000 ns. Once the advance is 0 it never changes again: the
/// kernel only tunes inside `__kvm_wait_lapic_expire`, which
/// `kvm_wait_lapic_expire` skips while `timer_advance_ns` is 0.
///
/// The kernel filters on the guest TSC delta in cycles before converting it
/// to ns; [`KvmAdaptive::learn_cycles`] takes that delta and is exact.
/// [`AdvancePolicy::learn`] converts a [`Wakeup`]'s ns to cycles first (as
/// the guest's TSC would have counted them), so near the filter's edges it
/// sees what a TSC read at the same moment would have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvmAdaptive {
    advance_ns: u32,
    tsc_khz: u64,
}

impl KvmAdaptive {
    /// `LAPIC_TIMER_ADVANCE_ADJUST_MIN`, cycles.
    pub const ADJUST_MIN: u64 = 100;
    /// `LAPIC_TIMER_ADVANCE_ADJUST_MAX`, cycles.
    pub const ADJUST_MAX: u64 = 10_000;
    /// `LAPIC_TIMER_ADVANCE_NS_INIT`.
    pub const NS_INIT: u32 = 1_000;
    /// `LAPIC_TIMER_ADVANCE_NS_MAX`.
    pub const NS_MAX: u32 = 5_000;
    /// `LAPIC_TIMER_ADVANCE_ADJUST_STEP`.
    pub const STEP: u32 = 8;

    /// KVM's tuning for a guest TSC of `tsc_khz`, starting at 1000 ns.
    pub fn new(tsc_khz: u64) -> Self {
        Self {
            advance_ns: Self::NS_INIT,
            tsc_khz: tsc_khz.max(1),
        }
    }

    /// Learns from one expiry as the kernel does: `delta_cycles` is the guest
    /// TSC when the expiry was handled minus the deadline
    /// (`advance_expire_delta`: negative when early).
    pub fn learn_cycles(&mut self, delta_cycles: i64) {
        let cycles = delta_cycles.unsigned_abs();
        if self.advance_ns == 0 || !(Self::ADJUST_MIN..=Self::ADJUST_MAX).contains(&cycles) {
            return;
        }
        // `ns` is a u64 and the advance a u32 in the kernel: the step is
        // truncated to 32 bits and the advance wraps.
        let ns = cycles * 1_000_000 / self.tsc_khz;
        let step = (ns / u64::from(Self::STEP)) as u32;
        self.advance_ns = if delta_cycles < 0 {
            self.advance_ns.wrapping_sub(step)
        } else {
            self.advance_ns.wrapping_add(step)
        };
        if self.advance_ns > Self::NS_MAX {
            self.advance_ns = Self::NS_INIT;
        }
    }
}

impl AdvancePolicy for KvmAdaptive {
    fn advance(&self) -> Duration {
        Duration::from_nanos(u64::from(self.advance_ns))
    }

    fn learn(&mut self, w: &Wakeup) {
        let cycles = i128::from(w.delta_ns) * i128::from(self.tsc_khz) / 1_000_000;
        self.learn_cycles(cycles.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64);
    }
}

/// Settings of [`Percentile`].
#[derive(Clone, Copy, Debug, PartialEq)]
#[non_exhaustive]
pub struct PercentileConfig {
    /// Ns of spin that cost as much as one ns of lateness (λ). The advance is
    /// the `1 / (1 + λ)` quantile of the wake lateness: λ = 0.1 gives p91.
    pub spin_weight: f64,
    /// Wake-ups the histogram remembers (counts decay by 1/memory per wake-up).
    pub memory: u32,
    /// Largest advance.
    pub max_advance: Duration,
    /// Wake-ups seen before the advance is the quantile: a host stall among
    /// the first few cannot make itself the quantile. Until then the advance
    /// is the shortest wake lateness seen (from the fourth wake-up on), which
    /// a stall cannot raise.
    pub min_samples: u32,
}

impl Default for PercentileConfig {
    fn default() -> Self {
        Self {
            spin_weight: 0.1,
            memory: 512,
            max_advance: Duration::from_micros(500),
            min_samples: 32,
        }
    }
}

const BUCKETS: usize = 64;
/// Bucket 1 starts at 2^7 = 128 ns; four buckets per octave up to ~8 ms.
const FIRST_SHIFT: u32 = 7;

fn bucket_of(ns: u64) -> usize {
    if ns < 1 << FIRST_SHIFT {
        return 0;
    }
    let msb = 63 - ns.leading_zeros();
    (1 + 4 * (msb - FIRST_SHIFT) as usize + ((ns >> (msb - 2)) & 3) as usize).min(BUCKETS - 1)
}

fn edge_ns(i: usize) -> f64 {
    if i == 0 {
        return 0.0;
    }
    let (octave, quarter) = ((i - 1) / 4, (i - 1) % 4);
    f64::from(1u32 << FIRST_SHIFT) * 2f64.powi(octave as i32) * (1.0 + quarter as f64 / 4.0)
}

/// A histogram of wake lateness whose counts decay by `1/memory` per sample.
#[derive(Clone, Debug)]
struct Decayed {
    memory: u32,
    counts: [f64; BUCKETS],
    weight: f64,
}

impl Decayed {
    fn new(memory: u32) -> Self {
        Self {
            memory: memory.max(2),
            counts: [0.0; BUCKETS],
            weight: 1.0,
        }
    }

    fn record(&mut self, lateness_ns: u64) {
        self.counts[bucket_of(lateness_ns)] += self.weight;
        self.weight /= 1.0 - 1.0 / f64::from(self.memory);
        if self.weight > 1e100 {
            self.counts.iter_mut().for_each(|c| *c /= self.weight);
            self.weight = 1.0;
        }
    }

    /// The `q` quantile, interpolated within its bucket.
    fn quantile_ns(&self, q: f64) -> f64 {
        let total: f64 = self.counts.iter().sum();
        let mut below = 0.0;
        for (k, &c) in self.counts.iter().enumerate() {
            if c > 0.0 && below + c >= q * total {
                let within = (q * total - below) / c;
                return edge_ns(k) + within * (edge_ns(k + 1) - edge_ns(k));
            }
            below += c;
        }
        edge_ns(BUCKETS)
    }
}

/// Wake-ups seen before the warm-up advance (the shortest lateness so far):
/// the shortest of four is a stall only if all four were.
const WARMUP_SAMPLES: u64 = 4;

/// Wake-ups the recent window holds ([`Percentile::RECENT_WAKEUPS`]).
const RECENT_WAKEUPS: usize = 32;
/// How far above the recent quantile the advance may stay while the long
/// histogram still remembers a slower host.
const RECENT_MARGIN: f64 = 1.25;

/// The last `RECENT_WAKEUPS` wake lateness values, exactly: after that
/// many wake-ups nothing older counts.
#[derive(Clone, Debug)]
struct Window {
    values: [u64; RECENT_WAKEUPS],
    len: usize,
    next: usize,
}

impl Window {
    fn new() -> Self {
        Self {
            values: [0; RECENT_WAKEUPS],
            len: 0,
            next: 0,
        }
    }

    fn record(&mut self, lateness_ns: u64) {
        self.values[self.next] = lateness_ns;
        self.next = (self.next + 1) % RECENT_WAKEUPS;
        self.len = (self.len + 1).min(RECENT_WAKEUPS);
    }

    /// The `q` quantile: the smallest value at least `q` of the window is
    /// at or below.
    fn quantile_ns(&self, q: f64) -> f64 {
        let mut sorted = self.values;
        let held = &mut sorted[..self.len];
        held.sort_unstable();
        let rank = (q * self.len as f64).ceil() as usize;
        held.get(rank.clamp(1, self.len.max(1)) - 1)
            .copied()
            .unwrap_or(0) as f64
    }
}

/// This crate's own policy: Marcelo Tosatti's "rightmost bucket" (in the
/// thread of his tscdeadline advance patch), made explicit.
///
/// It keeps a decayed histogram of the host timer's wake lateness (independent
/// of the advance it used) and advances by the quantile that minimises
/// expected lateness plus λ × expected spin: the pinball loss, whose minimiser
/// is the `1/(1+λ)` quantile. The histogram forgets, so the advance follows a
/// distribution that shifts.
///
/// Host stalls do not move it: until [`PercentileConfig::min_samples`]
/// wake-ups are in, the advance is the shortest wake lateness seen (which
/// spins only when a wake-up comes sooner than every one before, and which a
/// stall, only ever longer, cannot raise), and a quantile is not moved by a
/// rare outlier (one stall in 32 samples is above p91). Wasted
/// spin does not last: a window holds exactly the last
/// [`RECENT_WAKEUPS`](Self::RECENT_WAKEUPS) wake-ups, and the advance is at
/// most 1.25 times their quantile, so when the host gets faster the advance
/// follows within that many expiries (for p91, the 30th fast one) instead of waiting for the long
/// histogram to forget.
#[derive(Clone, Debug)]
pub struct Percentile {
    config: PercentileConfig,
    long: Decayed,
    recent: Window,
    samples: u64,
    shortest_ns: u64,
    advance_ns: u64,
}

impl Default for Percentile {
    fn default() -> Self {
        Self::new(PercentileConfig::default())
    }
}

impl Percentile {
    /// Wake-ups of the recent window: after this many fast wake-ups in a
    /// row, the advance is at most 1.25 times their quantile, whatever came
    /// before.
    pub const RECENT_WAKEUPS: usize = RECENT_WAKEUPS;

    /// A policy with `config`, starting with no advance until it has data.
    pub fn new(config: PercentileConfig) -> Self {
        Self {
            config,
            long: Decayed::new(config.memory),
            recent: Window::new(),
            samples: 0,
            shortest_ns: u64::MAX,
            advance_ns: 0,
        }
    }

    /// The quantile it aims at.
    pub fn quantile(&self) -> f64 {
        1.0 / (1.0 + self.config.spin_weight.max(0.0))
    }
}

impl AdvancePolicy for Percentile {
    fn advance(&self) -> Duration {
        Duration::from_nanos(self.advance_ns)
    }

    fn learn(&mut self, w: &Wakeup) {
        let lateness = w.wake_lateness().as_nanos() as u64;
        self.long.record(lateness);
        self.recent.record(lateness);
        self.samples += 1;
        let max_advance = self.config.max_advance.as_nanos() as f64;
        if self.samples < u64::from(self.config.min_samples) {
            self.shortest_ns = self.shortest_ns.min(lateness);
            if self.samples >= WARMUP_SAMPLES {
                self.advance_ns = (self.shortest_ns as f64).min(max_advance) as u64;
            }
            return;
        }
        let q = self.quantile();
        let advance = self
            .long
            .quantile_ns(q)
            .min(RECENT_MARGIN * self.recent.quantile_ns(q))
            .min(max_advance);
        self.advance_ns = advance as u64;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    fn wake(advance_ns: u64, delta_ns: i64) -> Wakeup {
        Wakeup {
            advance: Duration::from_nanos(advance_ns),
            delta_ns,
        }
    }

    #[test]
    fn wake_lateness_adds_back_the_advance() {
        assert_eq!(wake(40_000, -15_000).wake_lateness(), 25 * US);
        assert_eq!(wake(0, 3_000).wake_lateness(), 3 * US);
        assert_eq!(wake(0, -5).wake_lateness(), Duration::ZERO);
    }

    #[test]
    fn kvm_adjusts_by_an_eighth_inside_the_dead_band() {
        // 2 GHz guest TSC: 1 ns = 2 cycles.
        let mut k = KvmAdaptive::new(2_000_000);
        assert_eq!(k.advance(), Duration::from_nanos(1000));
        k.learn(&wake(1000, 800)); // 1600 cycles late: +100 ns
        assert_eq!(k.advance(), Duration::from_nanos(1100));
        k.learn(&wake(1100, -400)); // 800 cycles early: -50 ns
        assert_eq!(k.advance(), Duration::from_nanos(1050));
        k.learn(&wake(1050, 40)); // 80 cycles: below the dead band
        k.learn(&wake(1050, 6_000)); // 12000 cycles: a spike, ignored
        assert_eq!(k.advance(), Duration::from_nanos(1050));
    }

    /// Expected values stepped through `adjust_lapic_timer_advance` and the
    /// guard in `kvm_wait_lapic_expire` by hand, in the kernel's integer
    /// types, for a 2.596 GHz guest TSC.
    #[test]
    fn kvm_in_cycles_follows_the_kernel_step_by_step() {
        let mut k = KvmAdaptive::new(2_596_000);
        let traced = [
            (99, 1000),     // below ADJUST_MIN: ignored
            (100, 1004),    // 100 cycles = 38 ns (38.5 truncated), / 8 = 4
            (10_000, 1485), // 3852 ns / 8 = 481
            (10_001, 1485), // above ADJUST_MAX: ignored
            (-10_001, 1485),
            (-100, 1481),
            (-10_000, 1000),
            (2_500, 1120), // 963 ns / 8 = 120
            (-7_999, 735), // 3081 ns / 8 = 385
            (150, 742),    // 57 ns / 8 = 7
            (-2_000, 646), // 770 ns / 8 = 96
        ];
        for (delta, advance) in traced {
            k.learn_cycles(delta);
            assert_eq!(k.advance(), Duration::from_nanos(advance), "after {delta}");
        }
    }

    #[test]
    fn kvm_tunes_nothing_once_the_advance_is_zero() {
        let mut k = KvmAdaptive::new(1_000_000); // 1 ns = 1 cycle
        k.learn_cycles(-8_000); // 1000 - 8000 / 8 = 0
        assert_eq!(k.advance(), Duration::ZERO);
        for delta in [8_000, -150, 5_000] {
            k.learn_cycles(delta);
            assert_eq!(k.advance(), Duration::ZERO, "after {delta}");
        }
    }

    #[test]
    fn kvm_in_ns_filters_on_the_cycles_a_tsc_would_count() {
        // 100 cycles at 2.596 GHz are 38.5 ns: a wake-up 38 ns late is 98
        // cycles (ignored), 39 ns is 101 cycles (tuned by 38 ns / 8).
        let mut k = KvmAdaptive::new(2_596_000);
        k.learn(&wake(1000, 38));
        assert_eq!(k.advance(), Duration::from_nanos(1000));
        k.learn(&wake(1000, 39));
        assert_eq!(k.advance(), Duration::from_nanos(1004));
    }

    #[test]
    fn kvm_resets_above_5000_ns_and_on_wrap() {
        let mut k = KvmAdaptive::new(1_000_000); // 1 ns = 1 cycle
        for _ in 0..100 {
            k.learn(&wake(0, 9_000)); // +1125 each, until it passes 5000
            assert!(k.advance() <= Duration::from_nanos(5_000));
        }
        let mut w = KvmAdaptive::new(1_000_000);
        w.learn(&wake(0, -9_000)); // 1000 - 1125 wraps below zero: reset
        assert_eq!(w.advance(), Duration::from_nanos(1000));
    }

    #[test]
    fn percentile_advances_by_the_chosen_quantile() {
        let mut p = Percentile::default();
        assert_eq!(p.advance(), Duration::ZERO);
        // Wake lateness uniform over 20..40 µs: p91 is about 38 µs.
        for i in 0..2000u64 {
            p.learn(&wake(
                p.advance().as_nanos() as u64,
                (20_000 + (i * 7919) % 20_000) as i64 - p.advance().as_nanos() as i64,
            ));
        }
        let a = p.advance();
        assert!(a > 36 * US && a < 40 * US, "{a:?}");
        let lazy = Percentile::new(PercentileConfig {
            spin_weight: 1.0,
            ..Default::default()
        });
        assert!((lazy.quantile() - 0.5).abs() < 1e-9, "λ = 1: the median");
    }

    #[test]
    fn percentile_warms_up_on_the_shortest_lateness_which_a_stall_cannot_raise() {
        let mut p = Percentile::default();
        let lateness_us = [5_000, 30, 25, 28, 5_000, 26, 24];
        let advances: Vec<u64> = lateness_us
            .iter()
            .map(|&us| {
                p.learn(&wake(
                    p.advance().as_nanos() as u64,
                    us * 1000 - p.advance().as_nanos() as i64,
                ));
                p.advance().as_micros() as u64
            })
            .collect();
        assert_eq!(advances, [0, 0, 0, 25, 25, 25, 24]);
    }

    /// The host slows down for a while, then gets fast again: whatever the
    /// length of the slow phase, the advance is back within 1.25x the fast
    /// quantile after `RECENT_WAKEUPS` fast wake-ups (and not before 29 of
    /// the 32 are fast: p91 still sees the slow ones).
    #[test]
    fn percentile_recovers_within_its_window_after_any_slow_phase() {
        let fast = |i: u64| 20_000 + (i * 7919) % 10_000; // 20-30 µs
        for slow_len in [100u64, 500, 2000] {
            let mut p = Percentile::default();
            let feed = |p: &mut Percentile, lateness_ns: u64| {
                let advance = p.advance().as_nanos() as u64;
                p.learn(&wake(advance, lateness_ns as i64 - advance as i64));
            };
            (0..200).for_each(|i| feed(&mut p, fast(i)));
            let fast_advance = p.advance();
            (0..slow_len).for_each(|i| feed(&mut p, 400_000 + fast(i)));
            assert!(
                p.advance() > 300 * US,
                "learned the slow host: {:?}",
                p.advance()
            );
            let mut back_at = None;
            for i in 1..=Percentile::RECENT_WAKEUPS as u64 * 2 {
                feed(&mut p, fast(i));
                if back_at.is_none() && p.advance().as_secs_f64() <= 1.25 * 30e-6 {
                    back_at = Some(i);
                }
            }
            let back_at = back_at.expect("recovered");
            assert!(
                (29..=Percentile::RECENT_WAKEUPS as u64).contains(&back_at),
                "after {slow_len} slow: back at expiry {back_at}"
            );
            assert!(
                p.advance() <= fast_advance.mul_f64(1.25),
                "{:?}",
                p.advance()
            );
        }
    }

    #[test]
    fn window_quantile_is_an_order_statistic_of_what_it_holds() {
        let mut w = Window::new();
        assert_eq!(w.quantile_ns(0.9), 0.0, "empty");
        (1..=10).for_each(|v| w.record(v));
        assert_eq!(
            (w.quantile_ns(0.5), w.quantile_ns(0.91), w.quantile_ns(1.0)),
            (5.0, 10.0, 10.0)
        );
        (0..RECENT_WAKEUPS).for_each(|_| w.record(7));
        assert_eq!(w.quantile_ns(1.0), 7.0, "older values are gone");
    }

    #[test]
    fn percentile_follows_a_shift_and_respects_its_cap() {
        let mut p = Percentile::new(PercentileConfig {
            max_advance: 50 * US,
            ..Default::default()
        });
        for _ in 0..3000 {
            p.learn(&wake(0, 10_000));
        }
        assert!(p.advance() < 12 * US, "{:?}", p.advance());
        for _ in 0..3000 {
            p.learn(&wake(0, 300_000));
        }
        assert_eq!(p.advance(), 50 * US, "capped");
    }
}
