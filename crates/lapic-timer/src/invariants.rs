//! Drives the register model with arbitrary guest writes and time steps, and the
//! advance policies with arbitrary wake-ups; panics if an invariant breaks. The
//! fuzz target (`fuzz/`) feeds it random bytes; `cargo test` replays the corpus.

use std::time::Duration;

use crate::advance::{AdvancePolicy, KvmAdaptive, Percentile, Wakeup};
use crate::model::LapicTimer;
use crate::registers::{TimerMode, TimerRegister};
use crate::time::GuestTime;

fn u64_at(data: &[u8], i: usize) -> u64 {
    (0..8).fold(0, |v, k| {
        v | u64::from(data.get(i + k).copied().unwrap_or(0)) << (8 * k)
    })
}

/// Runs every check on `data`.
pub fn run(data: &[u8]) {
    let time = GuestTime {
        tsc_khz: u64_at(data, 0) % 10_000_000,
        ns: u64_at(data, 8) >> 4,
        tsc_at_ns: u64_at(data, 16),
    };
    let mut timer = LapicTimer::new(time);
    let mut now = u64_at(data, 24) >> 8;
    let mut kvm = KvmAdaptive::new(time.tsc_khz);
    let mut own = Percentile::default();
    for op in data.get(32..).unwrap_or(&[]).chunks(9) {
        let arg = u64_at(op, 1);
        match op[0] % 8 {
            0..=3 => {
                let reg = TimerRegister::ALL[usize::from(op[0] % 4)];
                let ok = timer.write(reg, arg as u32, now).is_ok();
                assert_eq!(ok, reg != TimerRegister::CurrentCount);
            }
            4 => timer.write_tsc_deadline(arg),
            5 => now = now.saturating_add(arg >> 24),
            6 => {
                if let Some(f) = timer.expire(now) {
                    assert!(f.due_ns <= now, "fired before due: {f:?} at {now}");
                }
            }
            _ => {
                let restored = {
                    let mut r = LapicTimer::new(time);
                    r.restore(&timer.save(now), now);
                    r
                };
                assert_eq!(
                    restored.save(now),
                    timer.save(now),
                    "save/restore round trip"
                );
            }
        }
        check(&timer, now);
        let w = Wakeup {
            advance: own.advance(),
            delta_ns: arg as i64,
        };
        kvm.learn(&w);
        own.learn(&w);
        assert!(kvm.advance() <= Duration::from_nanos(5_000));
        assert!(own.advance() <= Duration::from_micros(500));
    }
}

fn check(timer: &LapicTimer, now: u64) {
    let initial = timer.read(TimerRegister::InitialCount, now);
    assert!(timer.read(TimerRegister::CurrentCount, now) <= initial);
    match timer.lvt().mode {
        TimerMode::TscDeadline => assert_eq!(timer.read(TimerRegister::CurrentCount, now), 0),
        TimerMode::Reserved => assert_eq!(timer.next_expiry_ns(), None),
        TimerMode::OneShot | TimerMode::Periodic => assert_eq!(timer.tsc_deadline(), 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays every input committed under `fuzz-corpus/registers/`.
    #[test]
    fn replays_the_fuzz_corpus() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/fuzz-corpus/registers");
        let mut inputs = 0;
        for entry in std::fs::read_dir(dir).expect("the corpus is committed") {
            run(&std::fs::read(entry.unwrap().path()).unwrap());
            inputs += 1;
        }
        assert!(inputs >= 8, "the corpus has only {inputs} inputs");
    }
}
