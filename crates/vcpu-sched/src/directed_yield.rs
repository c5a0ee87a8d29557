//! Directed-yield candidate selection, as `kvm_vcpu_on_spin` does it.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use crate::state::VcpuState;

/// What the VMM knows of its vCPUs' guest state, for candidate selection.
pub trait GuestView {
    /// KVM's `vcpu_dy_runnable`: a blocking vCPU that would run if woken (an
    /// interrupt is pending for it).
    fn runnable(&self, vcpu: usize) -> bool;
    /// Whether a preempted vCPU was in guest kernel mode (or has an interrupt
    /// pending): with `yield_to_kernel_mode`, user-mode ones are skipped.
    fn in_kernel(&self, vcpu: usize) -> bool;
}

/// A view that knows nothing: no blocking vCPU is runnable, every preempted
/// vCPU counts as in kernel mode.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoGuestView;

impl GuestView for NoGuestView {
    fn runnable(&self, _: usize) -> bool {
        false
    }
    fn in_kernel(&self, _: usize) -> bool {
        true
    }
}

impl<G: GuestView + ?Sized> GuestView for std::sync::Arc<G> {
    fn runnable(&self, vcpu: usize) -> bool {
        (**self).runnable(vcpu)
    }
    fn in_kernel(&self, vcpu: usize) -> bool {
        (**self).in_kernel(vcpu)
    }
}

impl<G: GuestView + ?Sized> GuestView for &G {
    fn runnable(&self, vcpu: usize) -> bool {
        (**self).runnable(vcpu)
    }
    fn in_kernel(&self, vcpu: usize) -> bool {
        (**self).in_kernel(vcpu)
    }
}

/// What an attempt to yield to a candidate did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum YieldResult {
    /// The CPU went to the candidate (KVM's `yield_to` > 0).
    Yielded,
    /// Nothing happened, try the next (0).
    NotYielded,
    /// The attempt failed (< 0); after three failures the search stops.
    Failed,
}

/// KVM's `kvm_vcpu_on_spin`: vCPU `me` is spinning (waiting on others); yield
/// to the first suitable vCPU, round robin from the one after the last vCPU
/// boosted.
///
/// A candidate is skipped if it is not ready; if it is blocking and not
/// runnable (`runnable(idx)`: KVM's `vcpu_dy_runnable`, e.g. an interrupt is
/// pending for it); if it was preempted in user mode while the caller wants
/// kernel-mode targets (`in_kernel(idx)`: it was in kernel mode or has an
/// interrupt pending); or if it is not eligible (it is spinning itself;
/// eligible every other time). `yield_to(idx)` makes the attempt. At most three
/// failures end the search.
///
/// Unlike upstream before the fix, `last_boosted` records the *index* of the
/// vCPU yielded to, not the loop counter. Returns that index.
pub fn on_spin(
    me: usize,
    vcpus: &[VcpuState],
    last_boosted: &AtomicUsize,
    yield_to_kernel_mode: bool,
    guest: &dyn GuestView,
    mut yield_to: impl FnMut(usize) -> YieldResult,
) -> Option<usize> {
    let n = vcpus.len();
    if n < 2 || me >= n {
        return None;
    }
    vcpus[me].set_in_spin_loop(true);
    let start = last_boosted.load(SeqCst).wrapping_add(1);
    let mut tries = 3;
    let mut boosted = None;
    for i in 0..n {
        let idx = start.wrapping_add(i) % n;
        if idx == me {
            continue;
        }
        let v = &vcpus[idx];
        if !v.is_ready() || (v.is_blocking() && !guest.runnable(idx)) {
            continue;
        }
        if v.is_preempted() && yield_to_kernel_mode && !guest.in_kernel(idx) {
            continue;
        }
        if !v.eligible_for_directed_yield() {
            continue;
        }
        match yield_to(idx) {
            YieldResult::Yielded => {
                last_boosted.store(idx, SeqCst);
                boosted = Some(idx);
                break;
            }
            YieldResult::Failed => {
                tries -= 1;
                if tries == 0 {
                    break;
                }
            }
            YieldResult::NotYielded => {}
        }
    }
    vcpus[me].set_in_spin_loop(false);
    vcpus[me].set_dy_eligible(false);
    boosted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vcpus(n: usize) -> Vec<VcpuState> {
        (0..n).map(|_| VcpuState::new()).collect()
    }

    /// vCPU `runnable` has an interrupt pending; vCPU `user` was in user mode.
    struct View {
        runnable: usize,
        user: usize,
    }

    impl GuestView for View {
        fn runnable(&self, v: usize) -> bool {
            v == self.runnable
        }
        fn in_kernel(&self, v: usize) -> bool {
            v != self.user
        }
    }

    #[test]
    fn round_robin_from_the_last_boosted_and_records_the_index() {
        let v = vcpus(4);
        v.iter().for_each(VcpuState::delivered);
        let last = AtomicUsize::new(2);
        let mut tried = Vec::new();
        let got = on_spin(0, &v, &last, false, &NoGuestView, |i| {
            tried.push(i);
            YieldResult::Yielded
        });
        assert_eq!((got, tried), (Some(3), vec![3]));
        assert_eq!(
            last.load(SeqCst),
            3,
            "the index of the vCPU, not the loop counter (0)"
        );
    }

    #[test]
    fn skips_not_ready_blocking_and_user_mode_preempted() {
        let v = vcpus(5);
        v[2].delivered();
        v[2].set_run_state(crate::RunState::Halted); // blocking
        v[3].set_preempted(true); // ready, preempted, user mode
        v[4].delivered();
        let last = AtomicUsize::new(0);
        let view = View {
            runnable: 99,
            user: 3,
        };
        let mut tried = Vec::new();
        on_spin(0, &v, &last, true, &view, |i| {
            tried.push(i);
            YieldResult::NotYielded
        });
        assert_eq!(
            tried,
            [4],
            "1 not ready, 2 blocking, 3 preempted in user mode"
        );
        let mut tried = Vec::new();
        on_spin(
            0,
            &v,
            &last,
            false,
            &View {
                runnable: 2,
                user: 3,
            },
            |i| {
                tried.push(i);
                YieldResult::NotYielded
            },
        );
        assert_eq!(
            tried,
            [2, 3, 4],
            "2 is blocking but runnable; without yield_to_kernel_mode, 3 counts"
        );
    }

    #[test]
    fn three_failures_end_the_search_and_the_caller_is_never_a_candidate() {
        let v = vcpus(6);
        v.iter().for_each(VcpuState::delivered);
        let last = AtomicUsize::new(5);
        let mut tried = Vec::new();
        let got = on_spin(2, &v, &last, false, &NoGuestView, |i| {
            tried.push(i);
            YieldResult::Failed
        });
        assert_eq!((got, tried), (None, vec![0, 1, 3]));
        assert!(
            v[2].eligible_for_directed_yield(),
            "the caller's spin flags are cleared after"
        );
    }

    #[test]
    fn nothing_happens_with_fewer_than_two_vcpus_or_a_bad_index() {
        let last = AtomicUsize::new(0);
        assert_eq!(
            on_spin(0, &vcpus(1), &last, false, &NoGuestView, |_| {
                YieldResult::Yielded
            }),
            None
        );
        assert_eq!(
            on_spin(7, &vcpus(3), &last, false, &NoGuestView, |_| {
                YieldResult::Yielded
            }),
            None
        );
    }
}
