//! Where a vCPU is right now, readable from any thread.

use std::sync::atomic::{AtomicU8, Ordering};

use crossbeam_utils::CachePadded;

/// Where a vCPU's thread is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(u8)]
pub enum RunState {
    /// Not started, or handling an exit in the VMM.
    #[default]
    InVmm = 0,
    /// Inside `KVM_RUN`, running guest code.
    InGuest = 1,
    /// Halted: waiting for an interrupt, polling or blocked.
    Halted = 2,
    /// Runnable but not running: its host thread was preempted.
    Preempted = 3,
}

impl RunState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::InGuest,
            2 => Self::Halted,
            3 => Self::Preempted,
            _ => Self::InVmm,
        }
    }
}

/// One vCPU's [`RunState`], on a cache line of its own so that vCPUs updating
/// their own state never slow down each other.
#[derive(Debug, Default)]
pub struct SharedRunState(CachePadded<AtomicU8>);

impl SharedRunState {
    /// A vCPU in the VMM.
    pub fn new() -> Self {
        Self::default()
    }

    /// The current state.
    ///
    /// SeqCst, so that a thread that publishes a request and then reads the state
    /// cannot miss a vCPU that publishes its state and then reads the request
    /// (the ordering the kick protocol around `KVM_RUN` relies on).
    pub fn get(&self) -> RunState {
        RunState::from_u8(self.0.load(Ordering::SeqCst))
    }

    /// Sets the state; called by the vCPU's own thread.
    pub fn set(&self, state: RunState) {
        self.0.store(state as u8, Ordering::SeqCst);
    }

    /// Moves from `from` to `to` if the vCPU is still in `from`; returns whether it did.
    pub fn transition(&self, from: RunState, to: RunState) -> bool {
        self.0
            .compare_exchange(from as u8, to as u8, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_state_round_trips() {
        let s = SharedRunState::new();
        assert_eq!(s.get(), RunState::InVmm);
        for state in [
            RunState::InGuest,
            RunState::Halted,
            RunState::Preempted,
            RunState::InVmm,
        ] {
            s.set(state);
            assert_eq!(s.get(), state);
        }
    }

    #[test]
    fn transition_only_from_the_expected_state() {
        let s = SharedRunState::new();
        s.set(RunState::Halted);
        assert!(!s.transition(RunState::InGuest, RunState::InVmm));
        assert_eq!(s.get(), RunState::Halted);
        assert!(s.transition(RunState::Halted, RunState::InVmm));
        assert_eq!(s.get(), RunState::InVmm);
    }

    #[test]
    fn exactly_one_of_many_racing_waker_threads_wins_a_transition() {
        let s = Arc::new(SharedRunState::new());
        s.set(RunState::Halted);
        let winners: usize = (0..4)
            .map(|_| {
                let s = s.clone();
                std::thread::spawn(move || s.transition(RunState::Halted, RunState::InVmm))
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| usize::from(t.join().unwrap()))
            .sum();
        assert_eq!(winners, 1);
    }

    #[test]
    fn each_state_has_a_cache_line_of_its_own() {
        assert!(std::mem::size_of::<SharedRunState>() >= 64);
    }
}
