//! What the domain, readers and cells promise, including under misuse.
#![cfg(not(loom))] // these use real threads and time; tests/loom.rs models the protocol

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rcu_qs::{Domain, GracePeriod, RcuCell, RcuCounters, RcuError, RcuEvents};

/// Long enough that only a deadlock reaches it.
const DEADLOCK: Duration = Duration::from_secs(60);

/// Runs `f` on another thread; fails the test if it does not finish (a deadlock).
fn finishes<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(DEADLOCK)
        .expect("deadlock: the call never returned")
}

/// Runs `f` on a new thread; returns it with the thread's `/proc` task directory.
fn spawn_with_proc_dir<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> (thread::JoinHandle<T>, PathBuf) {
    let (task_tx, task_rx) = mpsc::channel();
    let handle = thread::spawn(move || {
        let task = std::fs::read_link("/proc/thread-self").unwrap();
        task_tx.send(Path::new("/proc").join(task)).unwrap();
        f()
    });
    (handle, task_rx.recv().unwrap())
}

/// Waits until every thread in `tasks` sleeps, or 10 s pass (a thread that
/// spins where it should block never sleeps; the caller's assertions catch it).
fn until_asleep(tasks: &[PathBuf]) {
    let sleeping = |task: &PathBuf| {
        let stat = std::fs::read_to_string(task.join("stat")).unwrap_or_default();
        // The state follows the command name, which is in parentheses and may hold any byte.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('S'))
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !tasks.iter().all(sleeping) && Instant::now() < deadline {
        thread::yield_now();
    }
}

#[test]
fn a_grace_period_waits_for_an_online_reader_until_its_quiescent_state() {
    let domain = Domain::new();
    let mut reader = domain.register_reader();
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (domain, done) = (domain.clone(), done.clone());
        thread::spawn(move || {
            domain.synchronize().unwrap();
            done.store(true, Ordering::SeqCst);
        })
    };
    // However long the reader stays in its read-side section, the writer waits.
    thread::sleep(Duration::from_millis(50));
    assert!(
        !done.load(Ordering::SeqCst),
        "grace period ended under an online reader"
    );
    reader.quiescent();
    writer.join().unwrap();
    assert!(done.load(Ordering::SeqCst));
}

#[test]
fn offline_readers_never_delay_a_grace_period() {
    let domain = Domain::new();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let (offline_tx, offline_rx) = mpsc::channel();
    let blocked_reader = {
        let domain = domain.clone();
        thread::spawn(move || {
            let mut reader = domain.register_reader();
            reader.offline_while(|| {
                offline_tx.send(()).unwrap();
                release_rx.recv().unwrap(); // a blocking wait, e.g. a halted vCPU
            });
            assert!(reader.is_online());
        })
    };
    offline_rx.recv().unwrap();
    let d = domain.clone();
    finishes(move || d.synchronize().unwrap());
    release_tx.send(()).unwrap();
    blocked_reader.join().unwrap();
}

#[test]
fn waiting_from_an_online_reader_is_an_error_not_a_deadlock() {
    let domain = Domain::new();
    let mut reader = domain.register_reader();
    let cell = RcuCell::new(&domain, 1u32);
    assert_eq!(domain.synchronize(), Err(RcuError::OnlineReader));
    assert_eq!(domain.barrier(), Err(RcuError::OnlineReader));
    let rejected = cell.replace(2).unwrap_err();
    assert_eq!(
        (rejected.value, rejected.error),
        (2, RcuError::OnlineReader)
    );
    assert_eq!(
        *cell.read(&reader),
        1,
        "a refused replace publishes nothing"
    );
    // From the reader itself, it goes offline while it waits.
    reader.synchronize().unwrap();
    assert!(reader.is_online());
    reader.offline();
    assert_eq!(domain.synchronize(), Ok(()));
    assert_eq!(cell.replace(3).unwrap(), 1);
}

#[test]
fn dropping_an_online_reader_unregisters_it() {
    let domain = Domain::new();
    let reader = domain.register_reader();
    drop(reader);
    let d = domain.clone();
    finishes(move || d.synchronize().unwrap());
}

#[test]
fn a_thread_that_exits_without_unregistering_does_not_hold_up_grace_periods() {
    let domain = Domain::new();
    let d = domain.clone();
    thread::spawn(move || std::mem::forget(d.register_reader()))
        .join()
        .unwrap();
    let d = domain.clone();
    finishes(move || d.synchronize().unwrap());
}

#[test]
fn reading_through_a_reader_of_another_domain_panics_with_a_clear_message() {
    let (a, b) = (Domain::new(), Domain::new());
    let cell = RcuCell::new(&a, 7u8);
    let stranger = b.register_reader();
    let err = catch_unwind(AssertUnwindSafe(|| *cell.read(&stranger))).unwrap_err();
    assert_eq!(
        err.downcast_ref::<&str>(),
        Some(&"RcuCell::read through a Reader of another Domain")
    );
}

#[test]
fn a_read_through_an_offline_reader_brings_it_online_and_is_protected() {
    let domain = Domain::new();
    let cell = RcuCell::new(&domain, String::from("old"));
    let mut reader = domain.register_reader();
    reader.offline();
    assert_eq!(cell.read(&reader), "old");
    assert!(reader.is_online());
    assert_eq!(domain.synchronize(), Err(RcuError::OnlineReader));
}

#[test]
fn concurrent_callers_share_grace_periods() {
    let counters = Arc::new(RcuCounters::default());
    let domain = Domain::builder().events(counters.clone()).build();
    let mut reader = domain.register_reader();
    let (callers, tasks): (Vec<_>, Vec<_>) = (0..8)
        .map(|_| {
            let d = domain.clone();
            spawn_with_proc_dir(move || d.synchronize().unwrap())
        })
        .unzip();
    // Asleep, every caller waits on the first grace period, held by the reader.
    until_asleep(&tasks);
    reader.offline();
    for c in callers {
        c.join().unwrap();
    }
    let gps = counters.grace_periods.load(Ordering::SeqCst);
    assert!(
        (1..=3).contains(&gps),
        "8 concurrent callers took {gps} grace periods"
    );
    assert!(counters.readers_waited_on.load(Ordering::SeqCst) >= 1);
    assert!(
        counters.blocked_grace_periods.load(Ordering::SeqCst) >= 1,
        "a writer waiting on an online reader blocks"
    );
}

#[test]
fn deferred_values_are_dropped_on_the_reclaim_thread_after_a_grace_period() {
    let domain = Domain::new();
    let dropped_on = Arc::new(Mutex::new(Vec::new()));
    struct Noted(Arc<Mutex<Vec<String>>>);
    impl Drop for Noted {
        fn drop(&mut self) {
            self.0
                .lock()
                .unwrap()
                .push(thread::current().name().unwrap_or("?").to_owned());
        }
    }
    let mut reader = domain.register_reader();
    for _ in 0..10 {
        domain.defer(Noted(dropped_on.clone()));
    }
    // Held back by the online reader.
    thread::sleep(Duration::from_millis(20));
    assert!(dropped_on.lock().unwrap().is_empty());
    assert!(domain.pending_reclaim_bytes() > 0);
    reader.quiescent();
    reader.offline();
    domain.barrier().unwrap();
    let names = dropped_on.lock().unwrap().clone();
    assert_eq!(names, vec!["rcu-reclaim"; 10]);
    assert_eq!(domain.pending_reclaim_bytes(), 0);
}

#[test]
fn deferring_is_bounded_in_memory() {
    #[derive(Default)]
    struct MaxPending(AtomicUsize);
    impl RcuEvents for MaxPending {
        fn pending_reclaim(&self, bytes: usize) {
            self.0.fetch_max(bytes, Ordering::SeqCst);
        }
    }
    let max = Arc::new(MaxPending::default());
    let limit = 1024;
    let domain = Domain::builder()
        .max_pending_bytes(limit)
        .events(max.clone())
        .build();
    let mut reader = domain.register_reader();
    let writer = {
        let d = domain.clone();
        thread::spawn(move || {
            for i in 0..200u64 {
                d.defer([i; 8]); // 64 bytes each
            }
        })
    };
    thread::sleep(Duration::from_millis(50));
    // The reader holds every grace period: the writer must be stuck at the bound.
    assert!(!writer.is_finished());
    assert!(domain.pending_reclaim_bytes() <= limit);
    reader.offline();
    writer.join().unwrap();
    domain.barrier().unwrap();
    assert!(
        max.0.load(Ordering::SeqCst) <= limit,
        "pending peaked at {:?}",
        max.0
    );
}

#[test]
fn the_last_handle_reclaims_everything_before_it_is_gone() {
    let live = Arc::new(AtomicUsize::new(0));
    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let domain = Domain::new();
    let cell = RcuCell::new(&domain, Counted(live.clone()));
    live.fetch_add(1, Ordering::SeqCst);
    for _ in 0..100 {
        live.fetch_add(1, Ordering::SeqCst);
        cell.store(Counted(live.clone()));
        live.fetch_add(1, Ordering::SeqCst);
        domain.defer(Counted(live.clone()));
    }
    drop(cell);
    drop(domain);
    assert_eq!(live.load(Ordering::SeqCst), 0);
}

#[test]
fn a_callback_that_drops_the_last_handle_does_not_deadlock() {
    let domain = Domain::new();
    let (tx, rx) = mpsc::channel();
    let d = domain.clone();
    domain.call(move || {
        drop(d);
        tx.send(()).unwrap();
    });
    drop(domain);
    rx.recv_timeout(DEADLOCK).unwrap();
}

#[test]
fn a_panicking_callback_does_not_stop_reclamation() {
    let domain = Domain::new();
    let ran = Arc::new(AtomicBool::new(false));
    domain.call(|| panic!("a destructor panicked"));
    let r = ran.clone();
    domain.call(move || r.store(true, Ordering::SeqCst));
    domain.barrier().unwrap();
    assert!(ran.load(Ordering::SeqCst));
}

#[test]
fn grace_period_events_report_wait_and_readers() {
    #[derive(Default)]
    struct Last(Mutex<Option<GracePeriod>>);
    impl RcuEvents for Last {
        fn grace_period(&self, gp: &GracePeriod) {
            *self.0.lock().unwrap() = Some(*gp);
        }
    }
    let last = Arc::new(Last::default());
    let domain = Domain::builder().events(last.clone()).build();
    domain.synchronize().unwrap();
    let gp = last.0.lock().unwrap().unwrap();
    assert_eq!((gp.readers_waited_on, gp.blocked), (0, false));
}

#[test]
fn a_run_loop_generic_over_qs_reporter_drives_a_reader() {
    use rcu_qs::QsReporter;
    fn exits(qs: &mut impl QsReporter, n: usize) {
        for _ in 0..n {
            qs.offline();
            qs.online();
            qs.quiescent();
        }
    }
    let domain = Domain::default();
    let mut reader = domain.register_reader();
    exits(&mut reader, 3);
    assert!(reader.is_online());
    // Offline through the trait lets a writer's grace period end.
    QsReporter::offline(&mut reader);
    assert_eq!(domain.synchronize(), Ok(()));
    assert_eq!(reader.domain().synchronize(), Ok(()));
}

#[test]
fn a_writer_that_never_spins_blocks_and_is_woken() {
    let counters = Arc::new(RcuCounters::default());
    let domain = Domain::builder()
        .spin(Duration::ZERO)
        .events(counters.clone())
        .build();
    let mut reader = domain.register_reader();
    let d = domain.clone();
    let (writer, task) = spawn_with_proc_dir(move || d.synchronize().unwrap());
    // A quiescent state reported before the writer looks at the readers would
    // let it finish without waiting, so the reader holds out until it sleeps.
    until_asleep(&[task]);
    while counters.grace_periods.load(Ordering::SeqCst) == 0 && !writer.is_finished() {
        reader.quiescent();
        thread::yield_now();
    }
    writer.join().unwrap();
    assert_eq!(counters.blocked_grace_periods.load(Ordering::SeqCst), 1);
}

#[test]
fn counters_track_pending_reclamation() {
    let counters = Arc::new(RcuCounters::default());
    let domain = Domain::builder().events(counters.clone()).build();
    let mut reader = domain.register_reader();
    domain.defer([0u8; 100]);
    assert_eq!(counters.pending_reclaim_bytes.load(Ordering::SeqCst), 100);
    reader.offline();
    domain.barrier().unwrap();
    assert_eq!(counters.pending_reclaim_bytes.load(Ordering::SeqCst), 0);
}

#[test]
fn exclusive_access_and_debug_output() {
    let domain = Domain::new();
    let mut cell = RcuCell::new(&domain, vec![1, 2]);
    cell.get_mut().push(3);
    let reader = domain.register_reader();
    assert_eq!(cell.read(&reader), &[1, 2, 3]);
    assert!(format!("{reader:?}").contains("online: true"));
    assert!(format!("{domain:?}").contains("readers: 1"));
    assert!(format!("{cell:?}").starts_with("RcuCell"));
    let rejected = cell.replace(vec![]).unwrap_err();
    assert_eq!(rejected.to_string(), RcuError::OnlineReader.to_string());
    assert!(std::error::Error::source(&rejected).is_some());
    assert!(format!("{rejected:?}").contains("OnlineReader"));
}
