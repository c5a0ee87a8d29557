//! Properties of the register model and the policies over arbitrary inputs.

use std::time::Duration;

use lapic_timer::registers::divisor;
use lapic_timer::{
    AdvancePolicy, GuestTime, KvmAdaptive, LapicTimer, Percentile, PercentileConfig, TimerRegister,
    Wakeup,
};
use proptest::prelude::*;

const TIME: GuestTime = GuestTime {
    tsc_khz: 2_000_000,
    ns: 0,
    tsc_at_ns: 0,
};

proptest! {
    /// One-shot: the current count is the time left in ticks, never above the
    /// initial count, and the timer fires exactly once, at its deadline.
    #[test]
    fn one_shot_counts_like_the_reference(count in 1u32.., div in 0u32..16, start in 0u64..1 << 40, elapsed in 0u64..1 << 44) {
        let mut t = LapicTimer::new(TIME);
        t.write(TimerRegister::LvtTimer, 0x30, 0).unwrap();
        t.write(TimerRegister::DivideConfig, div, 0).unwrap();
        t.write(TimerRegister::InitialCount, count, start).unwrap();
        let tick = u64::from(divisor(div));
        let deadline = start + u64::from(count) * tick;
        let now = start + elapsed;
        let expected = deadline.saturating_sub(now) / tick;
        prop_assert_eq!(u64::from(t.read(TimerRegister::CurrentCount, now)), expected);
        prop_assert_eq!(t.next_expiry_ns(), Some(deadline));
        let fired = t.expire(now);
        prop_assert_eq!(fired.is_some(), now >= deadline);
        prop_assert!(t.expire(now).is_none(), "fires once");
    }

    /// KVM's tuning stays within [0, 5000] ns whatever it sees.
    #[test]
    fn kvm_adaptive_stays_bounded(deltas in prop::collection::vec(any::<i64>(), 1..200), khz in 1u64..10_000_000) {
        let mut k = KvmAdaptive::new(khz);
        for d in deltas {
            k.learn(&Wakeup::new(k.advance(), d));
            prop_assert!(k.advance() <= Duration::from_nanos(5_000));
        }
    }

    /// The own policy never advances beyond its cap.
    #[test]
    fn percentile_respects_its_cap(deltas in prop::collection::vec(-1_000_000i64..10_000_000, 1..300), cap_us in 0u64..1000) {
        let mut config = PercentileConfig::default();
        config.max_advance = Duration::from_micros(cap_us);
        let mut p = Percentile::new(config);
        for d in deltas {
            p.learn(&Wakeup::new(p.advance(), d));
            prop_assert!(p.advance() <= Duration::from_micros(cap_us));
        }
    }
}
