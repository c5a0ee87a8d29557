//! A custom timer-advance policy and the register model.
use std::time::Duration;

use lapic_timer::{AdvancePolicy, GuestTime, LapicTimer, TimerRegister, Wakeup};

/// Half of the last lateness, as the advance.
struct HalfLate(Duration);

impl AdvancePolicy for HalfLate {
    fn advance(&self) -> Duration {
        self.0
    }
    fn learn(&mut self, wakeup: &Wakeup) {
        self.0 = Duration::from_nanos(wakeup.delta_ns.max(0) as u64 / 2);
    }
}

fn main() {
    let mut policy = HalfLate(Duration::ZERO);
    policy.learn(&Wakeup::new(Duration::ZERO, 4_000));
    assert_eq!(policy.advance(), Duration::from_micros(2));
    let mut timer = LapicTimer::new(GuestTime {
        tsc_khz: 1_000_000,
        ns: 0,
        tsc_at_ns: 0,
    });
    timer.write(TimerRegister::LvtTimer, 0x20030, 0).unwrap(); // periodic
    timer
        .write(TimerRegister::InitialCount, 1_000_000, 0)
        .unwrap();
    println!("next expiry {:?}", timer.next_expiry_ns());
}
