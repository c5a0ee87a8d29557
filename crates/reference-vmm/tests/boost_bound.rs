//! A boosted vCPU that spins in the guest at CPL3 with no exits, on real KVM:
//! nothing it runs can end its boost, so the booster's revoker must, from
//! outside. Its own test binary, because it finds the vCPU thread by name.

mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::kvm_available;
use reference_vmm::{Vm, VmConfig};
use vcpu_sched::{BoostBudget, FifoBoost};

/// Yields from vCPU 0 to the spinner, and pauses between them (about 1 ms):
/// a run of a few hundred ms, far longer than any one boost may last.
const YIELDS: u64 = 200;
const PAUSES: u64 = 20_000;

/// How far past the budget a boost may be seen to last here: the revoker
/// runs as `SCHED_DEADLINE`, but this shared host delays it by milliseconds
/// at times (vcpu-sched's README has the measurements). A boost nothing
/// revokes lasts the whole run.
const SLACK: Duration = Duration::from_millis(20);

/// The kernel thread id of the thread named `name` in this process.
fn thread_named(name: &str) -> Option<libc::pid_t> {
    std::fs::read_dir("/proc/self/task").ok()?.find_map(|e| {
        let path = e.ok()?.path();
        let comm = std::fs::read_to_string(path.join("comm")).ok()?;
        (comm.trim_end() == name).then(|| path.file_name()?.to_str()?.parse().ok())?
    })
}

/// Makes the calling thread `SCHED_FIFO` above the boosts (priority 1).
fn sample_above_boosts() {
    let param = libc::sched_param { sched_priority: 50 };
    // SAFETY: sets the calling thread's policy from a sched_param that
    // lives for the call; the result is checked.
    let set = unsafe { libc::sched_setscheduler(0, libc::SCHED_FIFO, &param) };
    assert_eq!(
        set, 0,
        "FifoBoost::check passed, so this may be real-time too"
    );
}

fn real_time(tid: libc::pid_t) -> bool {
    // SAFETY: sched_getscheduler only reads the policy of thread `tid`; an
    // error (the thread is gone) is -1.
    let policy = unsafe { libc::sched_getscheduler(tid) };
    policy == libc::SCHED_FIFO || policy == libc::SCHED_RR
}

#[test]
fn a_boosted_vcpu_spinning_at_cpl3_is_real_time_no_longer_than_the_budget() {
    let test = "a_boosted_vcpu_spinning_at_cpl3_is_real_time_no_longer_than_the_budget";
    if !kvm_available(test) {
        return;
    }
    if let Err(e) = FifoBoost::default().check() {
        eprintln!("SKIPPED {test}: this process cannot boost threads ({e})");
        return;
    }
    let mut config = VmConfig {
        vcpus: 2,
        timeout: Some(Duration::from_secs(120)),
        ..VmConfig::default()
    };
    config.params[..2].copy_from_slice(&[YIELDS, PAUSES]);
    let vm = Vm::new(&config).unwrap();
    let run = thread::spawn(move || {
        vm.run(
            test_guests::find("yield-spin").unwrap(),
            Box::new(std::io::sink()),
        )
    });
    // vCPU 1's scheduling policy, sampled from outside until the run ends,
    // by this thread made real-time above the boost: a sampler that a busy
    // host delays would see a stretch as long as its own delay.
    sample_above_boosts();
    let (mut spinner, mut since, mut longest) = (None, None::<Instant>, Duration::ZERO);
    let mut samples = 0u64;
    while !run.is_finished() {
        spinner = spinner.or_else(|| thread_named("vcpu1"));
        if let Some(tid) = spinner {
            samples += 1;
            match (real_time(tid), since) {
                (true, None) => since = Some(Instant::now()),
                (false, Some(at)) => {
                    longest = longest.max(at.elapsed());
                    since = None;
                }
                _ => {}
            }
        }
        // Every 500 µs, well within the slack: a real-time sampler waking
        // every few µs on vCPU 0's CPU preempts it so often that on PVM (a
        // world switch each time) its guest crawls, past the run's timeout.
        thread::sleep(Duration::from_micros(500));
    }
    let report = run.join().unwrap().unwrap();
    let budget = BoostBudget::default().max_boost;
    eprintln!(
        "{} boosts; longest real-time stretch seen {longest:?} in {samples} samples, \
         longest boost recorded {:?}, budget {budget:?}",
        report.stats.boosts,
        Duration::from_nanos(report.stats.longest_boost_ns)
    );
    assert_eq!(
        report.value(0, "yields"),
        Some(YIELDS),
        "the yielding vCPU finished"
    );
    assert_eq!(report.value(1, "spun"), Some(1), "the spinner finished");
    assert!(report.stats.boosts >= 2, "{} boosts", report.stats.boosts);
    assert!(samples > 10, "{samples} samples: the sampler ran");
    assert!(
        longest <= budget + SLACK,
        "real-time for {longest:?}, budget {budget:?}"
    );
    assert!(
        Duration::from_nanos(report.stats.longest_boost_ns) <= budget + SLACK,
        "a boost recorded for {}",
        report.stats.longest_boost_ns
    );
}
