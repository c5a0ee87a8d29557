//! `WindowTuner` replayed on statistics recorded from a real vCPU halting in
//! KVM (one line per 10 ms read of its binary statistics: the seven halt
//! counters, then `halt_poll_success_hist`, `halt_poll_fail_hist` and
//! `halt_wait_hist`, 32 buckets each). The vCPU ran `hlt` in a loop and a
//! thread woke it with signals: `kvm-stats-bursty.txt` nine wake-ups 50 µs
//! apart then one 3 ms later, over and over; `kvm-stats-idle-1ms.txt` one
//! every 1 ms. (KVM counts `halt_wakeup` only for wake-ups by an interrupt or
//! another vCPU, so it stays at 1 here.)

use std::time::Duration;

use halt_poll::kvm::{HALT_POLL_NS_GROW_START, KvmHaltStats, TunerConfig, WindowTuner};

const BUCKETS: usize = 32;

fn recorded(text: &str) -> Vec<KvmHaltStats> {
    text.lines()
        .map(|line| {
            let v: Vec<u64> = line.split(' ').map(|x| x.parse().unwrap()).collect();
            assert_eq!(v.len(), 7 + 3 * BUCKETS, "{line}");
            let hist = |i: usize| v[7 + i * BUCKETS..7 + (i + 1) * BUCKETS].to_vec();
            let mut s = KvmHaltStats::default();
            s.halt_successful_poll = v[0];
            s.halt_attempted_poll = v[1];
            s.halt_poll_invalid = v[2];
            s.halt_wakeup = v[3];
            s.halt_poll_success_ns = v[4];
            s.halt_poll_fail_ns = v[5];
            s.halt_wait_ns = v[6];
            s.halt_poll_success_hist = hist(0);
            s.halt_poll_fail_hist = hist(1);
            s.halt_wait_hist = hist(2);
            s
        })
        .collect()
}

/// The reads' interval.
const TICK: Duration = Duration::from_millis(10);

/// The windows the tuner chooses, one per recorded read.
fn replay(text: &str) -> Vec<Option<Duration>> {
    let mut tuner = WindowTuner::default();
    recorded(text)
        .into_iter()
        .map(|s| tuner.update(TICK, std::slice::from_ref(&s)))
        .collect()
}

#[test]
fn bursts_of_short_halts_get_a_window_that_covers_them() {
    let windows = replay(include_str!("data/kvm-stats-bursty.txt"));
    // Most halts last 65-262 µs (the 50 µs sleeps of a signalling thread on
    // this host); one in ten lasts 3 ms and is not worth polling.
    let last = windows.last().copied().flatten().unwrap();
    assert!(
        last >= Duration::from_micros(131) && last <= Duration::from_micros(262),
        "{windows:?}"
    );
}

#[test]
fn an_idle_1_ms_timer_gets_no_window_from_the_first_choice_on() {
    let windows = replay(include_str!("data/kvm-stats-idle-1ms.txt"));
    let chosen: Vec<Duration> = windows.iter().flatten().copied().collect();
    assert!(!chosen.is_empty(), "{windows:?}");
    assert!(chosen.iter().all(|w| w.is_zero()), "{windows:?}");
}

#[test]
fn a_budget_on_the_recorded_vcpu_shrinks_at_once_and_holds_otherwise() {
    // KVM's polls on the bursty vCPU mostly failed within a few µs (another
    // task wanted the CPU), but some intervals polled 6-8 % of it: each of
    // those is over twice a 3 % budget and shrinks the window at once. A
    // window grows only after `hold` (10) intervals, but in its first climb.
    const BUDGET: f64 = 0.03;
    let mut config = TunerConfig::default();
    config.budget = Some(BUDGET);
    let mut tuner = WindowTuner::new(config);
    let mut last: Option<Duration> = None;
    let (mut held, mut broken, mut narrowed) = (0, 0, false);
    for s in recorded(include_str!("data/kvm-stats-bursty.txt")) {
        let window = tuner.update(TICK, std::slice::from_ref(&s));
        held += 1;
        if tuner
            .polling_share()
            .is_some_and(|share| share > 2.0 * BUDGET)
        {
            broken += 1;
            assert!(
                window < last || window == Some(Duration::ZERO),
                "{window:?} after {last:?}"
            );
        } else if window > last && last.is_some() && narrowed {
            assert!(held >= 10, "{window:?} after {last:?}, {held} intervals");
        }
        assert!(
            window.is_none_or(|w| w.is_zero() || w >= HALT_POLL_NS_GROW_START),
            "{window:?}"
        );
        narrowed |= window < last;
        if window != last {
            held = 0;
        }
        last = window;
    }
    assert!(
        broken >= 2,
        "the recording breaks the budget {broken} times"
    );
}
