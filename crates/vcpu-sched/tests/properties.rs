//! Candidate selection against a straightforward model of the kernel's
//! `kvm_vcpu_on_spin` loop (with the fix that records the index of the vCPU
//! yielded to): for any flags, any last-boosted value and any yield results,
//! the same vCPUs are tried in the same order with the same outcome.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use proptest::prelude::*;
use vcpu_sched::{GuestView, RunState, VcpuState, YieldResult, on_spin};

/// One vCPU as the model sees it.
#[derive(Clone, Copy, Debug)]
struct Flags {
    ready: bool,
    blocking: bool,
    runnable: bool,
    preempted: bool,
    in_kernel: bool,
    in_spin_loop: bool,
    dy_eligible: bool,
    result: u8,
}

fn flags() -> impl Strategy<Value = Flags> {
    (any::<[bool; 7]>(), 0u8..3).prop_map(|(b, result)| Flags {
        ready: b[0] || b[3], // KVM's sched_out sets ready with preempted
        blocking: b[1],
        runnable: b[2],
        preempted: b[3],
        in_kernel: b[4],
        in_spin_loop: b[5],
        dy_eligible: b[6],
        result,
    })
}

fn result(r: u8) -> YieldResult {
    [
        YieldResult::Yielded,
        YieldResult::NotYielded,
        YieldResult::Failed,
    ][usize::from(r)]
}

/// The kernel's loop, written out plainly on the model's own flags.
fn model(
    me: usize,
    v: &mut [Flags],
    last: usize,
    kernel_mode: bool,
) -> (Option<usize>, Vec<usize>, usize) {
    let n = v.len();
    let mut tried = Vec::new();
    let (mut tries, mut last_boosted) = (3, last);
    let start = last.wrapping_add(1);
    for idx in (0..n).map(|i| start.wrapping_add(i) % n) {
        let c = v[idx];
        let skip = idx == me
            || !c.ready
            || (c.blocking && !c.runnable)
            || (c.preempted && kernel_mode && !c.in_kernel);
        if skip {
            continue;
        }
        let eligible = !c.in_spin_loop || c.dy_eligible;
        if c.in_spin_loop {
            v[idx].dy_eligible = !c.dy_eligible;
        }
        if !eligible {
            continue;
        }
        tried.push(idx);
        match result(c.result) {
            YieldResult::Yielded => {
                last_boosted = idx;
                return (Some(idx), tried, last_boosted);
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
    (None, tried, last_boosted)
}

struct View(Vec<Flags>);

impl GuestView for View {
    fn runnable(&self, vcpu: usize) -> bool {
        self.0[vcpu].runnable
    }
    fn in_kernel(&self, vcpu: usize) -> bool {
        self.0[vcpu].in_kernel
    }
}

fn states(v: &[Flags]) -> Vec<VcpuState> {
    v.iter()
        .map(|f| {
            let s = VcpuState::new();
            if f.ready {
                s.delivered();
            }
            s.set_preempted(f.preempted);
            if f.blocking {
                s.set_run_state(RunState::Halted);
            }
            s.set_in_spin_loop(f.in_spin_loop);
            s.set_dy_eligible(f.dy_eligible);
            s
        })
        .collect()
}

proptest! {
    #[test]
    fn on_spin_matches_the_kernels_loop(
        mut v in proptest::collection::vec(flags(), 2..12),
        me in 0usize..12,
        last in prop_oneof![0usize..24, Just(usize::MAX)],
        kernel_mode: bool,
    ) {
        let me = me % v.len();
        let vcpus = states(&v);
        let view = View(v.clone());
        let last_boosted = AtomicUsize::new(last);
        let mut tried = Vec::new();
        let got = on_spin(me, &vcpus, &last_boosted, kernel_mode, &view, |idx| {
            tried.push(idx);
            result(v[idx].result)
        });
        let (want, want_tried, want_last) = model(me, &mut v, last, kernel_mode);
        prop_assert_eq!(got, want);
        prop_assert_eq!(tried, want_tried);
        prop_assert_eq!(last_boosted.load(SeqCst), want_last);
        prop_assert!(want_last < vcpus.len() || want_last == last);
        // The eligibility toggles happened to the same vCPUs: probing each one
        // once more now gives the model's next answer.
        for (i, s) in vcpus.iter().enumerate().filter(|&(i, _)| i != me) {
            let f = v[i];
            prop_assert_eq!(s.eligible_for_directed_yield(), !f.in_spin_loop || f.dy_eligible);
        }
        prop_assert!(vcpus[me].eligible_for_directed_yield(), "the caller's flags are cleared");
    }
}
