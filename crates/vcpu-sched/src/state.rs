//! Where a vCPU is right now, and the flags KVM keeps per vCPU for directed
//! yield, readable and writable from any thread without locks.

use crate::sync::{AtomicBool, AtomicU8, Ordering::SeqCst, fence};

use crossbeam_utils::CachePadded;

/// Where a vCPU's thread is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum RunState {
    /// Not started, or handling an exit in the VMM.
    #[default]
    InVmm = 0,
    /// Inside `KVM_RUN`, running guest code.
    InGuest = 1,
    /// Halted: waiting for an interrupt (polling or blocked).
    Halted = 2,
}

impl RunState {
    fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::InGuest,
            2 => Self::Halted,
            _ => Self::InVmm,
        }
    }
}

/// One vCPU's state, on a cache line of its own so that vCPUs updating their
/// own state never slow each other down. Every access is SeqCst: "publish a
/// request, then read the state" against "publish the state, then read the
/// request" must not both miss (the kick protocol around `KVM_RUN` relies on it).
/// A SeqCst fence follows every run-state write and precedes every run-state
/// read, so the handshake holds even when the caller's own request flag is
/// weaker than SeqCst (and so that loom, which models fences exactly, checks it).
///
/// The flags have KVM's meanings:
/// - `ready`: an interrupt or wake-up was delivered and the vCPU has not run
///   since (`vcpu->ready`, as KVM's delivery boost sets it): a good directed-yield target.
/// - `preempted`: runnable but not running. KVM learns it from its
///   sched-out notifier; a userspace VMM cannot, and sets it from what it sees
///   (a thread that is runnable and whose run delay grew: [`crate::probe`]).
/// - `in_spin_loop` / `dy_eligible`: the vCPU is itself spinning in a
///   directed-yield attempt; it is eligible as a target only every other time.
#[derive(Debug, Default)]
pub struct VcpuState(CachePadded<Flags>);

#[derive(Debug, Default)]
struct Flags {
    run: AtomicU8,
    ready: AtomicBool,
    preempted: AtomicBool,
    in_spin_loop: AtomicBool,
    dy_eligible: AtomicBool,
}

impl VcpuState {
    /// A vCPU in the VMM, not ready, not preempted.
    pub fn new() -> Self {
        Self::default()
    }

    /// Where the vCPU is.
    pub fn run_state(&self) -> RunState {
        fence(SeqCst);
        RunState::from_u8(self.0.run.load(SeqCst))
    }

    /// Sets where the vCPU is; called by the vCPU's own thread.
    pub fn set_run_state(&self, state: RunState) {
        self.0.run.store(state as u8, SeqCst);
        fence(SeqCst);
    }

    /// Moves from `from` to `to` if the vCPU is still in `from`; returns whether it did.
    pub fn transition(&self, from: RunState, to: RunState) -> bool {
        fence(SeqCst);
        self.0
            .run
            .compare_exchange(from as u8, to as u8, SeqCst, SeqCst)
            .is_ok()
    }

    /// The vCPU thread is about to enter the guest: it runs, so it is neither
    /// ready nor preempted (KVM's `sched_in`).
    pub fn entering_guest(&self) {
        self.0.ready.store(false, SeqCst);
        self.0.preempted.store(false, SeqCst);
        self.set_run_state(RunState::InGuest);
    }

    /// The vCPU thread is back in the VMM, handling an exit.
    pub fn left_guest(&self) {
        self.set_run_state(RunState::InVmm);
    }

    /// An interrupt or wake-up was delivered (KVM's `kvm_vcpu_wake_up` sets `ready`).
    pub fn delivered(&self) {
        self.0.ready.store(true, SeqCst);
    }

    /// Whether the vCPU is a good directed-yield target.
    pub fn is_ready(&self) -> bool {
        self.0.ready.load(SeqCst)
    }

    /// Marks the vCPU runnable-but-not-running (or not).
    pub fn set_preempted(&self, preempted: bool) {
        self.0.preempted.store(preempted, SeqCst);
        if preempted {
            self.0.ready.store(true, SeqCst); // KVM's sched_out sets both
        }
    }

    /// Whether the vCPU is runnable but not running.
    pub fn is_preempted(&self) -> bool {
        self.0.preempted.load(SeqCst)
    }

    /// Whether the vCPU is halted and waiting (KVM's `kvm_vcpu_is_blocking`).
    pub fn is_blocking(&self) -> bool {
        self.run_state() == RunState::Halted
    }

    /// Sets `in_spin_loop` (KVM's `kvm_vcpu_set_in_spin_loop`).
    pub fn set_in_spin_loop(&self, spinning: bool) {
        self.0.in_spin_loop.store(spinning, SeqCst);
    }

    /// Sets `dy_eligible` (KVM's `kvm_vcpu_set_dy_eligible`).
    pub fn set_dy_eligible(&self, eligible: bool) {
        self.0.dy_eligible.store(eligible, SeqCst);
    }

    /// KVM's `kvm_vcpu_eligible_for_directed_yield`: a vCPU not spinning is
    /// eligible; one spinning is eligible every other time it is checked.
    pub fn eligible_for_directed_yield(&self) -> bool {
        let spinning = self.0.in_spin_loop.load(SeqCst);
        let eligible = self.0.dy_eligible.load(SeqCst);
        if spinning {
            self.set_dy_eligible(!eligible);
        }
        !spinning || eligible
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_run_state_round_trips() {
        let s = VcpuState::new();
        assert_eq!(s.run_state(), RunState::InVmm);
        for state in [RunState::InGuest, RunState::Halted, RunState::InVmm] {
            s.set_run_state(state);
            assert_eq!(s.run_state(), state);
        }
    }

    #[test]
    fn transition_only_from_the_expected_state() {
        let s = VcpuState::new();
        s.set_run_state(RunState::Halted);
        assert!(!s.transition(RunState::InGuest, RunState::InVmm));
        assert!(s.transition(RunState::Halted, RunState::InVmm));
        assert_eq!(s.run_state(), RunState::InVmm);
    }

    #[test]
    fn delivery_makes_ready_and_running_clears_it() {
        let s = VcpuState::new();
        s.delivered();
        s.set_preempted(true);
        assert!(s.is_ready() && s.is_preempted());
        s.entering_guest();
        assert!(!s.is_ready() && !s.is_preempted());
        assert_eq!(s.run_state(), RunState::InGuest);
        s.left_guest();
        assert_eq!(s.run_state(), RunState::InVmm);
    }

    #[test]
    fn preemption_also_marks_ready_as_kvms_sched_out_does() {
        let s = VcpuState::new();
        s.set_preempted(true);
        assert!(s.is_ready());
        s.set_preempted(false);
        assert!(
            s.is_ready(),
            "un-preempting does not clear ready; running does"
        );
    }

    #[test]
    fn a_spinning_vcpu_is_eligible_every_other_check() {
        let s = VcpuState::new();
        assert!(s.eligible_for_directed_yield(), "not spinning: always");
        s.set_in_spin_loop(true);
        let checks: Vec<bool> = (0..4).map(|_| s.eligible_for_directed_yield()).collect();
        assert_eq!(checks, [false, true, false, true]);
    }

    #[test]
    fn exactly_one_of_many_racing_wakers_wins_a_transition() {
        let s = Arc::new(VcpuState::new());
        s.set_run_state(RunState::Halted);
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
        assert!(std::mem::size_of::<VcpuState>() >= 64);
        assert_eq!(std::mem::align_of::<VcpuState>() % 64, 0);
    }
}
