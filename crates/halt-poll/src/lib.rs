//! Adaptive poll-before-block for halted vCPUs and other VMM waits.

#![deny(missing_docs)]

pub mod clock;
pub mod contention;
pub mod policy;
pub mod poller;
pub mod predictive;
pub mod presets;
pub mod sim;
pub mod stats;
pub mod wake;

pub use clock::{Clock, FakeClock, MonotonicClock, set_timer_slack};
pub use policy::{Fixed, HaltOutcome, Never, PollPlan, PollPolicy, WokenDuring};
pub use poller::{Halt, HaltPoller};
pub use predictive::{Predictive, PredictiveConfig};
pub use presets::{AioPoll, GuestHaltpoll, KvmGrowShrink};
pub use stats::{HaltEvents, HaltStats, NoEvents, TraceRecorder};
pub use wake::{EventFdWake, Events, FutexWake, WakeSource};
