//! Properties over arbitrary inputs: every policy's window stays in bounds, and
//! a wake-up that comes before or during a halt always ends it.

use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use halt_poll::{
    AioPoll, FutexWake, GuestHaltpoll, HaltOutcome, HaltPoller, KvmGrowShrink, PollPlan,
    PollPolicy, Predictive, PredictiveConfig, WokenDuring,
};
use proptest::prelude::*;

fn outcome() -> impl Strategy<Value = HaltOutcome> {
    (
        0u64..5_000_000,
        0u64..1_000_000,
        0u64..1_000_000,
        0u8..3,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(halt, slept, polled, woken, valid, preempted)| {
            let phases = [WokenDuring::Sleep, WokenDuring::Poll, WokenDuring::Block];
            let mut outcome = HaltOutcome::new(
                Duration::from_nanos(halt),
                Duration::from_nanos(slept),
                Duration::from_nanos(polled),
                phases[usize::from(woken)],
            );
            if !valid {
                outcome = outcome.spurious();
            }
            if preempted {
                outcome = outcome.preempted();
            }
            outcome
        })
}

fn stays_within(
    mut policy: impl PollPolicy,
    outcomes: &[HaltOutcome],
    max: Duration,
) -> Result<(), TestCaseError> {
    for o in outcomes {
        policy.learn(o);
        let plan = policy.plan();
        prop_assert!(plan.window <= max, "window {:?} > {max:?}", plan.window);
        prop_assert!(
            plan.sleep <= Duration::from_secs(1),
            "sleep {:?}",
            plan.sleep
        );
    }
    Ok(())
}

proptest! {
    #[test]
    fn every_policy_keeps_its_window_within_its_maximum(outcomes in prop::collection::vec(outcome(), 1..300)) {
        stays_within(KvmGrowShrink::new(), &outcomes, Duration::from_micros(200))?;
        stays_within(KvmGrowShrink::pre_6_11(), &outcomes, Duration::from_micros(200))?;
        stays_within(GuestHaltpoll::new(), &outcomes, Duration::from_micros(200))?;
        stays_within(AioPoll::new(), &outcomes, Duration::from_nanos(32_768))?;
        stays_within(Predictive::default(), &outcomes, Duration::from_micros(500))?;
        let mut config = PredictiveConfig::default();
        config.max_poll = Duration::from_micros(50);
        stays_within(Predictive::new(config), &outcomes, Duration::from_micros(50))?;
    }
}

/// A policy that carries out a given plan.
struct Plan(PollPlan);

impl PollPolicy for Plan {
    fn plan(&self) -> PollPlan {
        self.0
    }
    fn window(&self) -> Duration {
        self.0.window
    }
    fn learn(&mut self, _: &HaltOutcome) {}
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Wherever the wake-up falls (before the halt, in the sleep, in the poll,
    /// after it), the halt returns with it.
    #[test]
    fn no_wakeup_is_lost(sleep_us in 0u64..300, window_us in 0u64..300, delay_us in 0u64..600) {
        let plan = PollPlan::sleep_then_poll(Duration::from_micros(sleep_us), Duration::from_micros(window_us));
        let wake = Arc::new(FutexWake::new());
        let mut poller = HaltPoller::new(wake.clone(), Plan(plan));
        let waker = {
            let wake = wake.clone();
            thread::spawn(move || {
                let start = Instant::now();
                while start.elapsed() < Duration::from_micros(delay_us) {
                    std::hint::spin_loop();
                }
                wake.wake(3);
            })
        };
        if delay_us == 0 {
            waker.join().unwrap(); // the wake-up comes before the halt
            prop_assert_eq!(poller.halt().fired, 1 << 3);
        } else {
            prop_assert_eq!(poller.halt().fired, 1 << 3);
            waker.join().unwrap();
        }
    }
}
