//! Drives vCPU states, candidate selection and the booster with arbitrary
//! sequences of events ([`run`]), and guest-requested boosts with arbitrary
//! request words ([`guest_requests`]), and panics if an invariant breaks. The
//! fuzz targets (`fuzz/`) feed them random bytes; `cargo test` replays their
//! corpora.

use std::io;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

use std::time::Duration;

use crate::{
    BoostBudget, Booster, Clock, FakeClock, GuestBoosts, NoBoost, NoEvents, NoGuestView,
    RequestLimits, RunState, SchedEvents, Scheduler, ThreadControl, ThreadSeen, Tid, VcpuState,
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

/// The step in which [`guest_requests`] lets time pass, revoking at each.
const STEP: Duration = Duration::from_micros(10);

/// Every boost's length and the boosted time per vCPU, as the booster
/// reports them.
#[derive(Default)]
struct Held(Mutex<Vec<(usize, Duration)>>);

impl SchedEvents for Held {
    fn unboosted(&self, vcpu: usize, held: Duration, _revoked: bool) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((vcpu, held));
    }
}

/// Guest-requested boosts under whatever the guest writes: each 10 bytes
/// are a vCPU, a request word (8 bytes), and an action byte whose low bits
/// say how the vCPU's thread is seen and whose high bits how long time
/// passes next. Checks that no boost outlives `max_boost`, that no vCPU's
/// boosts in a period exceed the budget per period (plus the one boost
/// begun just under it), and that the booster's record and the thread agree.
pub fn guest_requests(data: &[u8]) {
    let budget = BoostBudget::default();
    let clock = std::sync::Arc::new(FakeClock::default());
    let booster = Booster::manual(VCPUS, Control::default(), Held::default(), clock.clone())
        .with_budget(budget);
    (0..VCPUS).for_each(|v| booster.register(v, v as Tid));
    let sched = Scheduler::new(VCPUS, NoBoost, booster, NoGuestView);
    let words: Box<[std::sync::atomic::AtomicU64]> =
        (0..VCPUS).map(|_| Default::default()).collect();
    let limits = RequestLimits::new(Duration::from_millis(3), budget.max_boost);
    let requests = GuestBoosts::with_clock(VCPUS, words, limits, clock.clone());
    let seen = [
        ThreadSeen::Preempted,
        ThreadSeen::Running,
        ThreadSeen::Blocked,
    ];
    for op in data.chunks_exact(10) {
        let v = usize::from(op[0]) % VCPUS;
        let word = u64::from_le_bytes(op[1..9].try_into().expect("8 bytes"));
        requests.words()[v].store(word, SeqCst);
        let thread = seen[usize::from(op[9] & 3) % 3];
        requests.check_seen(&sched.ctx(), v, thread);
        for _ in 0..op[9] >> 2 {
            clock.advance(STEP);
            sched.booster().revoke_expired();
        }
        for i in 0..VCPUS {
            assert_eq!(
                sched.booster().is_boosted(i),
                sched.booster().control().boosted(i),
                "the booster's record and the thread disagree"
            );
        }
    }
    for v in 0..VCPUS {
        sched.booster().ran(v).expect("the control never fails"); // accounted
    }
    let held = sched
        .booster()
        .events()
        .0
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let periods = clock.now().as_nanos() / budget.period.as_nanos() + 1;
    for v in 0..VCPUS {
        let boosts: Vec<Duration> = held.iter().filter(|b| b.0 == v).map(|b| b.1).collect();
        let longest = boosts.iter().max().copied().unwrap_or_default();
        assert!(longest <= budget.max_boost + STEP, "a boost of {longest:?}");
        let total: Duration = boosts.iter().sum();
        let bound = (budget.per_period + budget.max_boost + STEP) * periods as u32;
        assert!(
            total <= bound,
            "vCPU {v}: {total:?} boosted in {periods} periods"
        );
    }
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

    #[test]
    fn guest_requests_that_hold_flip_or_garble_the_mark_stay_bounded() {
        let mut data = Vec::new();
        for i in 0..3000u32 {
            let v = (i % 3) as u8;
            let word = match v {
                0 => 1u64 << 32 | 7,                                   // held forever
                1 => u64::from(i) | u64::from(i & 1) << 32,            // flipped
                _ => u64::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15), // garbage
            };
            data.push(v);
            data.extend(word.to_le_bytes());
            data.push((i % 7) as u8 * 4); // preempted, then 0-24 steps
        }
        super::guest_requests(&data);
        super::guest_requests(&[]);
    }

    /// Replays every input committed under `fuzz-corpus/guest_requests/`.
    #[test]
    fn replays_the_guest_requests_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-corpus/guest_requests");
        let mut inputs = 0;
        for entry in std::fs::read_dir(dir).expect("the corpus is committed") {
            super::guest_requests(&std::fs::read(entry.unwrap().path()).unwrap());
            inputs += 1;
        }
        assert!(inputs >= 8, "the corpus has only {inputs} inputs");
    }
}
