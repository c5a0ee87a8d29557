//! Costs of the mechanism's pieces: a policy's per-halt work (plan + learn), and
//! the wake source's poll check and wake-up when nobody is blocked.
//!
//! `cargo bench -p halt-poll --bench main`

use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use halt_poll::{
    AioPoll, Fixed, FutexWake, GuestHaltpoll, HaltOutcome, KvmGrowShrink, PollPolicy, Predictive,
    WakeSource,
};

/// A halt woken while polling after about 200 ns, jittered so histograms see
/// several buckets.
fn outcomes() -> Vec<HaltOutcome> {
    (0..64)
        .map(|i| HaltOutcome::woken_while_polling(Duration::from_nanos(150 + 37 * (i % 9))))
        .collect()
}

fn per_halt<P: PollPolicy>(c: &mut Criterion, name: &str, mut policy: P) {
    let outcomes = outcomes();
    let mut i = 0;
    c.bench_function(&format!("policy plan+learn/{name}"), |b| {
        b.iter(|| {
            black_box(policy.plan());
            policy.learn(&outcomes[i % outcomes.len()]);
            i += 1;
        })
    });
}

fn policies(c: &mut Criterion) {
    per_halt(c, "Fixed", Fixed(Duration::from_micros(200)));
    per_halt(c, "KvmGrowShrink", KvmGrowShrink::new());
    per_halt(c, "GuestHaltpoll", GuestHaltpoll::new());
    per_halt(c, "AioPoll", AioPoll::new());
    per_halt(c, "Predictive", Predictive::default());
}

fn wake(c: &mut Criterion) {
    let w = FutexWake::new();
    c.bench_function("FutexWake::take, nothing pending", |b| {
        b.iter(|| black_box(w.take()))
    });
    c.bench_function("FutexWake::wake + take, nobody blocked", |b| {
        b.iter(|| {
            w.wake(0);
            black_box(w.take())
        })
    });
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(30)
}

criterion_group! { name = benches; config = config(); targets = policies, wake }
criterion_main!(benches);
