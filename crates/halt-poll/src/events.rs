//! What a poller reports: every finished halt, through an events trait with
//! a no-op default.

use std::sync::Arc;

use crate::policy::{HaltOutcome, PollPlan};

/// Receives every finished halt. The default does nothing.
pub trait HaltEvents: Send + Sync {
    /// A halt carried out `plan` and ended as `outcome`.
    fn halted(&self, _plan: &PollPlan, _outcome: &HaltOutcome) {}
}

/// No statistics, at no cost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NoEvents;

impl HaltEvents for NoEvents {}

impl<E: HaltEvents + ?Sized> HaltEvents for Arc<E> {
    fn halted(&self, plan: &PollPlan, outcome: &HaltOutcome) {
        (**self).halted(plan, outcome)
    }
}
