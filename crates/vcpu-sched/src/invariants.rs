//! Drives vCPU states, candidate selection and the booster with arbitrary
//! sequences of events, and panics if an invariant breaks. The fuzz target
//! (`fuzz/`) feeds it random bytes; `cargo test` replays the corpus.

use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use std::time::Duration;

use crate::{
    Booster, FakeClock, NoEvents, NoGuestView, RunState, ThreadControl, Tid, VcpuState,
    YieldResult, on_spin,
};

const VCPUS: usize = 4;
const STATES: [RunState; 3] = [RunState::InVmm, RunState::InGuest, RunState::Halted];

/// Remembers which threads are boosted.
#[derive(Default)]
struct Control(Mutex<[bool; VCPUS]>);

impl ThreadControl for Control {
    fn boost(&self, tid: Tid) -> io::Result<()> {
        self.set(tid, true)
    }
    fn restore(&self, tid: Tid) -> io::Result<()> {
        self.set(tid, false)
    }
    fn yield_now(&self) {}
}

impl Control {
    fn set(&self, tid: Tid, boosted: bool) -> io::Result<()> {
        let mut threads = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let slot = usize::try_from(tid)
            .ok()
            .and_then(|i| threads.get_mut(i))
            .ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        *slot = boosted;
        Ok(())
    }

    fn boosted(&self, vcpu: usize) -> bool {
        self.0.lock().unwrap_or_else(|e| e.into_inner())[vcpu]
    }
}

/// Runs every check on `data`: each 3 bytes are an operation, a vCPU and an argument.
pub fn run(data: &[u8]) {
    let vcpus: Vec<VcpuState> = (0..VCPUS).map(|_| VcpuState::new()).collect();
    let clock = std::sync::Arc::new(FakeClock::default());
    let booster = Booster::manual(VCPUS, Control::default(), NoEvents, clock.clone());
    (0..VCPUS).for_each(|v| booster.register(v, v as Tid));
    let last = AtomicUsize::new(data.first().map_or(0, |&b| usize::from(b)));
    for op in data.chunks_exact(3) {
        let (v, arg) = (usize::from(op[1]) % VCPUS, op[2]);
        let state = &vcpus[v];
        match op[0] % 10 {
            0 => {
                state.delivered();
                assert!(state.is_ready());
            }
            1 => {
                state.entering_guest();
                assert!(!state.is_ready() && !state.is_preempted());
                assert_eq!(state.run_state(), RunState::InGuest);
            }
            2 => {
                state.left_guest();
                assert_eq!(state.run_state(), RunState::InVmm);
            }
            3 => {
                let (from, to) = (
                    STATES[usize::from(arg) % 3],
                    STATES[usize::from(arg / 3) % 3],
                );
                let was = state.run_state();
                assert_eq!(state.transition(from, to), was == from);
                assert_eq!(state.run_state(), if was == from { to } else { was });
            }
            4 => {
                state.set_preempted(arg & 1 == 1);
                assert!(arg & 1 == 0 || state.is_ready(), "preempted implies ready");
            }
            5 => state.set_in_spin_loop(arg & 1 == 1),
            6 => spin(&vcpus, v, &last, arg),
            7 => {
                let boosted = booster.boost(v).expect("the control never fails");
                assert!(!boosted || booster.control().boosted(v));
            }
            8 => {
                booster.ran(v).expect("the control never fails");
                assert!(!booster.is_boosted(v) && !booster.control().boosted(v));
            }
            _ => {
                clock.advance(Duration::from_micros(u64::from(arg) * 10));
                booster.revoke_expired();
            }
        }
        for (i, _) in vcpus.iter().enumerate() {
            assert_eq!(
                booster.is_boosted(i),
                booster.control().boosted(i),
                "the booster's record and the thread disagree"
            );
        }
    }
    drop(booster); // restores whatever is still boosted
}

/// One directed-yield search by `me`, whose attempts succeed, fail or do
/// nothing as the bits of `arg` say.
fn spin(vcpus: &[VcpuState], me: usize, last: &AtomicUsize, arg: u8) {
    let ready: Vec<bool> = vcpus.iter().map(VcpuState::is_ready).collect();
    let mut tried = Vec::new();
    let got = on_spin(me, vcpus, last, arg & 1 == 1, &NoGuestView, |idx| {
        tried.push(idx);
        match (arg >> (1 + tried.len() % 3)) & 3 {
            0 => YieldResult::Yielded,
            1 => YieldResult::Failed,
            _ => YieldResult::NotYielded,
        }
    });
    assert!(
        tried.iter().all(|&i| i != me && ready[i]),
        "tried {tried:?}"
    );
    if let Some(idx) = got {
        assert_eq!(last.load(SeqCst), idx, "the index is recorded");
        assert_eq!(tried.last(), Some(&idx));
    }
    let mut sorted = tried.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), tried.len(), "each vCPU is tried at most once");
}

#[cfg(test)]
mod tests {
    #[test]
    fn sequences_of_every_operation_hold() {
        let mut data = vec![3u8];
        for op in 0..10u8 {
            for v in 0..4u8 {
                data.extend([op, v, op.wrapping_mul(37) ^ v]);
            }
        }
        super::run(&data);
        super::run(&[]);
    }

    /// Replays every input committed under `fuzz-corpus/events/`.
    #[test]
    fn replays_the_fuzz_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-corpus/events");
        let mut inputs = 0;
        for entry in std::fs::read_dir(dir).expect("the corpus is committed") {
            super::run(&std::fs::read(entry.unwrap().path()).unwrap());
            inputs += 1;
        }
        assert!(inputs >= 8, "the corpus has only {inputs} inputs");
    }
}
