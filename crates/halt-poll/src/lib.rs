//! Adaptive poll-before-block for halted vCPUs and other VMM waits.

#![deny(missing_docs)]

pub mod policy;
pub mod predictive;
pub mod presets;
pub mod sim;

pub use policy::{Fixed, HaltOutcome, Never, PollPlan, PollPolicy, WokenDuring};
pub use predictive::{Predictive, PredictiveConfig};
pub use presets::{AioPoll, GuestHaltpoll, KvmGrowShrink};
