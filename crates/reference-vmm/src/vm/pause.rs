//! Pausing a running VM for a controller (live migration, a snapshot): every
//! vCPU thread leaves `KVM_RUN`, captures its own state (it owns its fd and
//! its interrupt controller) and parks until the controller decides: resume,
//! or hand the VM over and end.
//!
//! The controller sets the request before it kicks and wakes the vCPUs (see
//! `kick`): a vCPU that misses the flag at the top of its loop gets
//! the kick in its next `KVM_RUN`, which returns at once.

use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::vcpu::state::VcpuState;

/// What the controller decided for parked vCPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Run on, as if nothing happened.
    Resume,
    /// The VM lives elsewhere now: end the vCPU threads.
    HandOver,
}

/// Why the vCPUs could not all be parked.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PauseError {
    /// A vCPU's run ended (its program finished, or it failed) before it parked.
    #[error("vCPU {0} is no longer running (its program ended or failed)")]
    Ended(u32),
    /// A vCPU did not park in time: a VMM bug, never the guest's doing.
    #[error("vCPU(s) {0:?} did not pause within {1:?}")]
    Timeout(Vec<u32>, Duration),
}

/// The meeting point of the vCPU threads and a controller.
#[derive(Debug)]
pub struct PauseGate {
    requested: AtomicBool,
    inner: Mutex<Inner>,
    changed: Condvar,
}

#[derive(Debug)]
struct Inner {
    /// Each vCPU's state once parked.
    parked: Vec<Option<VcpuState>>,
    /// vCPU threads whose run has ended.
    ended: Vec<bool>,
    decision: Option<Decision>,
    /// Counts pauses, so a vCPU waits for this pause's decision only.
    generation: u64,
}

impl PauseGate {
    /// A gate for `vcpus` vCPUs, nobody paused.
    pub fn new(vcpus: usize) -> Self {
        Self {
            requested: AtomicBool::new(false),
            inner: Mutex::new(Inner {
                parked: (0..vcpus).map(|_| None).collect(),
                ended: vec![false; vcpus],
                decision: None,
                generation: 0,
            }),
            changed: Condvar::new(),
        }
    }

    /// Whether vCPUs should park (checked at the top of the run loop and by
    /// a halted vCPU).
    pub fn requested(&self) -> bool {
        self.requested.load(SeqCst)
    }

    /// Asks every vCPU to park; the caller then kicks and wakes them.
    pub fn request(&self) {
        let mut inner = self.lock();
        inner.decision = None;
        inner.parked.iter_mut().for_each(|p| *p = None);
        self.requested.store(true, SeqCst);
    }

    /// vCPU `vcpu` parks with its `state` and waits for the decision.
    pub fn park(&self, vcpu: usize, state: VcpuState) -> Decision {
        let mut inner = self.lock();
        let generation = inner.generation;
        inner.parked[vcpu] = Some(state);
        self.changed.notify_all();
        loop {
            if inner.generation != generation {
                return Decision::Resume;
            }
            if let Some(decision) = inner.decision {
                return decision;
            }
            inner = self.wait(inner);
        }
    }

    /// vCPU `vcpu`'s thread is leaving its run loop for good.
    pub fn ended(&self, vcpu: usize) {
        self.lock().ended[vcpu] = true;
        self.changed.notify_all();
    }

    /// Waits until every vCPU has parked, and returns their states by index.
    pub fn wait_parked(&self, timeout: Duration) -> Result<Vec<VcpuState>, PauseError> {
        let deadline = Instant::now() + timeout;
        let mut inner = self.lock();
        loop {
            if let Some(i) = inner.ended.iter().position(|&e| e) {
                return Err(PauseError::Ended(i as u32));
            }
            if inner.parked.iter().all(Option::is_some) {
                return Ok(inner.parked.iter_mut().filter_map(Option::take).collect());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let missing = (0u32..).zip(&inner.parked).filter(|(_, p)| p.is_none());
                return Err(PauseError::Timeout(
                    missing.map(|(i, _)| i).collect(),
                    timeout,
                ));
            }
            inner = self
                .changed
                .wait_timeout(inner, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Ends the pause with `decision`: parked vCPUs go on (or end), and so
    /// does any vCPU still on its way to park.
    pub fn decide(&self, decision: Decision) {
        let mut inner = self.lock();
        inner.decision = Some(decision);
        if decision == Decision::Resume {
            inner.generation += 1;
            self.requested.store(false, SeqCst);
        }
        self.changed.notify_all();
    }

    /// Waits up to `timeout` for a vCPU's run to end; returns whether one has.
    pub fn wait_for_end(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut inner = self.lock();
        while !inner.ended.contains(&true) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            inner = self
                .changed
                .wait_timeout(inner, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        true
    }

    /// The first vCPU whose run ended, if one has.
    pub fn first_ended(&self) -> Option<u32> {
        self.lock().ended.iter().position(|&e| e).map(|i| i as u32)
    }

    /// Whether the VM was handed over.
    pub fn handed_over(&self) -> bool {
        self.lock().decision == Some(Decision::HandOver)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait<'a>(&self, guard: MutexGuard<'a, Inner>) -> MutexGuard<'a, Inner> {
        self.changed
            .wait(guard)
            .unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;

    use super::*;
    use crate::vcpu::state::tests::zeroed as user_vcpu;

    /// Parks vCPUs `vcpus` on threads; returns their decisions' handles.
    fn park_all(gate: &Arc<PauseGate>, vcpus: &[u32]) -> Vec<thread::JoinHandle<Decision>> {
        vcpus
            .iter()
            .map(|&i| {
                let gate = gate.clone();
                thread::spawn(move || gate.park(i as usize, user_vcpu(i)))
            })
            .collect()
    }

    #[test]
    fn parked_states_come_back_by_index_and_resume_releases_them() {
        let gate = Arc::new(PauseGate::new(2));
        gate.request();
        assert!(gate.requested());
        let parked = park_all(&gate, &[1, 0]);
        let states = gate.wait_parked(Duration::from_secs(10)).unwrap();
        assert_eq!(states.iter().map(|s| s.index).collect::<Vec<_>>(), [0, 1]);
        gate.decide(Decision::Resume);
        assert!(!gate.requested());
        for p in parked {
            assert_eq!(p.join().unwrap(), Decision::Resume);
        }
        assert!(!gate.handed_over());
        // A second pause waits for its own parking, not the first one's.
        gate.request();
        assert!(matches!(
            gate.wait_parked(Duration::from_millis(20)),
            Err(PauseError::Timeout(missing, _)) if missing == [0, 1]
        ));
    }

    #[test]
    fn a_hand_over_ends_every_parked_vcpu_and_any_late_one() {
        let gate = Arc::new(PauseGate::new(2));
        gate.request();
        let first = park_all(&gate, &[0]);
        while gate.lock().parked[0].is_none() {
            thread::yield_now();
        }
        gate.decide(Decision::HandOver);
        assert!(gate.handed_over());
        assert_eq!(
            first.into_iter().next().unwrap().join().unwrap(),
            Decision::HandOver
        );
        assert_eq!(gate.park(1, user_vcpu(1)), Decision::HandOver);
    }

    #[test]
    fn a_vcpu_whose_run_ended_fails_the_pause_by_name() {
        let gate = Arc::new(PauseGate::new(3));
        assert!(!gate.wait_for_end(Duration::from_millis(1)));
        gate.request();
        let parked = park_all(&gate, &[0]);
        gate.ended(2);
        assert!(gate.wait_for_end(Duration::from_secs(10)));
        assert_eq!(gate.first_ended(), Some(2));
        assert_eq!(
            gate.wait_parked(Duration::from_secs(10)).unwrap_err(),
            PauseError::Ended(2)
        );
        gate.decide(Decision::Resume);
        assert_eq!(
            parked.into_iter().next().unwrap().join().unwrap(),
            Decision::Resume
        );
    }
}
