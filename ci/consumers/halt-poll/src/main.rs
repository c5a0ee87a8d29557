//! A custom halt-poll policy, driven by the crate's own learning interface.
use std::time::Duration;

use halt_poll::{HaltOutcome, PollPolicy};

/// Polls for the last halt's length, up to 100 µs.
struct LastHalt(Duration);

impl PollPolicy for LastHalt {
    fn window(&self) -> Duration {
        self.0.min(Duration::from_micros(100))
    }
    fn learn(&mut self, outcome: &HaltOutcome) {
        self.0 = outcome.halt;
    }
}

fn main() {
    let mut policy = LastHalt(Duration::ZERO);
    policy.learn(&HaltOutcome::woken_while_polling(Duration::from_micros(30)));
    assert_eq!(policy.window(), Duration::from_micros(30));
    println!("window {:?}", policy.plan().window);
}
