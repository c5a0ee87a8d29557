//! KVM's in-kernel halt polling on real `/dev/kvm`: a vCPU halts in the kernel
//! (in-kernel irqchip) and is woken by signals, as a VMM's kick would; its
//! binary stats show the polling, and `KVM_CAP_HALT_POLL` switches it off.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::thread;
use std::time::{Duration, Instant};

use halt_poll::kvm::{
    BinaryStats, HALT_POLL_NS_GROW_START, KvmHaltStats, StatKind, TunedVcpus, TunerConfig,
    WindowTuner, set_vm_halt_poll,
};
use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit, VmFd};
use vmm_sys_util::signal::{Killable, SIGRTMIN, register_signal_handler};

/// `/dev/kvm`. Where it cannot be opened the test fails, or with
/// `VM_LATENCY_ALLOW_NO_KVM=1` skips, saying so (`None`).
fn kvm() -> Option<Kvm> {
    match Kvm::new() {
        Ok(k) => Some(k),
        Err(e) if std::env::var_os("VM_LATENCY_ALLOW_NO_KVM").is_none_or(|v| v != "1") => {
            panic!("cannot open /dev/kvm ({e}); set VM_LATENCY_ALLOW_NO_KVM=1 to skip")
        }
        Err(e) => {
            eprintln!("SKIPPED: cannot open /dev/kvm ({e})");
            if let Some(log) = std::env::var_os("SKIPPED_TESTS_LOG") {
                let line = format!("halt-poll::kvm: cannot open /dev/kvm ({e})\n");
                let _ = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(log)
                    .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
            }
            None
        }
    }
}

extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

/// 64 KiB of page-aligned guest memory.
struct GuestMemory(*mut u8);

const MEM_SIZE: usize = 0x10000;

impl GuestMemory {
    fn new() -> Self {
        // SAFETY: an anonymous private mapping; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MEM_SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Self(p.cast())
    }

    fn write(&mut self, at: usize, bytes: &[u8]) {
        assert!(at + bytes.len() <= MEM_SIZE);
        // SAFETY: in bounds of the mapping, which we own.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.0.add(at), bytes.len()) };
    }
}

impl Drop for GuestMemory {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.0.cast(), MEM_SIZE) };
    }
}

/// A VM whose only vCPU runs, in real mode at 0x1000, `hlt; jmp .-1` with
/// interrupts off: every KVM_RUN halts in the kernel until a signal arrives.
fn halting_vm(kvm: &Kvm) -> (VmFd, kvm_ioctls::VcpuFd, GuestMemory) {
    let vm = kvm.create_vm().unwrap();
    vm.create_irq_chip().unwrap();
    let mut mem = GuestMemory::new();
    mem.write(0x1000, &[0xf4, 0xeb, 0xfd]); // hlt; jmp -3
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: MEM_SIZE as u64,
        userspace_addr: mem.0 as u64,
        flags: 0,
    };
    // SAFETY: `mem` outlives the VM: the caller keeps it with the VM and vCPU.
    unsafe { vm.set_user_memory_region(region) }.unwrap();
    let vcpu = vm.create_vcpu(0).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).unwrap();
    let regs = kvm_bindings::kvm_regs {
        rip: 0x1000,
        rflags: 2,
        ..Default::default()
    };
    vcpu.set_regs(&regs).unwrap();
    (vm, vcpu, mem)
}

/// Runs the vCPU on a thread and wakes it from its halt `kicks` times, every
/// `interval`; returns it and its halt statistics.
fn halt_and_kick(
    vcpu: kvm_ioctls::VcpuFd,
    kicks: u32,
    interval: Duration,
) -> (kvm_ioctls::VcpuFd, KvmHaltStats) {
    halt_and_kick_with(vcpu, kicks, interval, || {})
}

/// [`halt_and_kick`], calling `after_kick` after each kick.
fn halt_and_kick_with(
    vcpu: kvm_ioctls::VcpuFd,
    kicks: u32,
    interval: Duration,
    mut after_kick: impl FnMut(),
) -> (kvm_ioctls::VcpuFd, KvmHaltStats) {
    register_signal_handler(SIGRTMIN(), on_kick).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let runner = {
        let stop = stop.clone();
        thread::spawn(move || {
            let mut vcpu = vcpu;
            while !stop.load(SeqCst) {
                match vcpu.run() {
                    Err(e) if e.errno() == libc::EINTR => {}
                    Ok(VcpuExit::Intr) => {}
                    other => panic!("unexpected exit: {other:?}"),
                }
            }
            vcpu
        })
    };
    // Sleep between kicks, leaving the CPUs to the vCPU: KVM stops polling
    // when another task is runnable on its CPU.
    halt_poll::set_timer_slack(Duration::from_nanos(1)).unwrap();
    for _ in 0..kicks {
        thread::sleep(interval);
        runner.kill(SIGRTMIN()).unwrap();
        after_kick();
    }
    stop.store(true, SeqCst);
    // Keep kicking until the thread notices: a kick just before KVM_RUN is lost.
    while !runner.is_finished() {
        runner.kill(SIGRTMIN()).unwrap();
        thread::sleep(Duration::from_millis(1));
    }
    let vcpu = runner.join().unwrap();
    let stats = KvmHaltStats::read(&BinaryStats::for_vcpu(&vcpu).unwrap()).unwrap();
    (vcpu, stats)
}

#[test]
fn vcpu_stats_describe_the_halt_counters_and_histograms() {
    let Some(kvm) = kvm() else { return };
    let (_vm, vcpu, _mem) = halting_vm(&kvm);
    let stats = BinaryStats::for_vcpu(&vcpu).unwrap();
    for name in [
        "halt_successful_poll",
        "halt_attempted_poll",
        "halt_wait_ns",
        "halt_poll_success_ns",
    ] {
        let d = stats
            .descriptors()
            .iter()
            .find(|d| d.name == name)
            .unwrap_or_else(|| panic!("{name}"));
        assert_eq!((d.kind, d.size), (StatKind::Cumulative, 1), "{name}");
    }
    let hist = stats
        .descriptors()
        .iter()
        .find(|d| d.name == "halt_wait_hist")
        .unwrap();
    assert_eq!((hist.kind, hist.size), (StatKind::LogHist, 32));
    assert_eq!(
        KvmHaltStats::read(&stats).unwrap(),
        {
            let mut never_ran = KvmHaltStats::default();
            never_ran.halt_poll_success_hist = vec![0; 32];
            never_ran.halt_poll_fail_hist = vec![0; 32];
            never_ran.halt_wait_hist = vec![0; 32];
            never_ran
        },
        "a vCPU that never ran has not halted"
    );
}

#[test]
fn short_halts_make_kvm_poll_and_its_stats_add_up() {
    let Some(kvm) = kvm() else { return };
    let (vm, vcpu, _mem) = halting_vm(&kvm);
    // Halts of ~50 µs, a few ms on a busy host: all shorter than a 100 ms
    // maximum, so KVM grows its window and polls. (Whether a poll catches the
    // wake-up depends on the host: KVM stops polling as soon as another task
    // is runnable on the CPU.)
    set_vm_halt_poll(&vm, Duration::from_millis(100)).unwrap();
    let (_, s) = halt_and_kick(vcpu, 300, Duration::from_micros(50));
    assert!(s.halt_attempted_poll > 0, "{s:?}");
    assert_eq!(
        s.halt_poll_success_hist.iter().sum::<u64>(),
        s.halt_successful_poll,
        "{s:?}"
    );
    assert_eq!(
        s.halt_poll_fail_hist.iter().sum::<u64>(),
        s.halt_attempted_poll - s.halt_successful_poll,
        "{s:?}"
    );
    assert!(s.halt_poll_success_ns + s.halt_poll_fail_ns > 0, "{s:?}");
}

#[test]
fn a_zero_window_switches_in_kernel_polling_off() {
    let Some(kvm) = kvm() else { return };
    let (vm, vcpu, _mem) = halting_vm(&kvm);
    set_vm_halt_poll(&vm, Duration::ZERO).unwrap();
    let (_, s) = halt_and_kick(vcpu, 400, Duration::from_micros(30));
    assert_eq!(
        (s.halt_attempted_poll, s.halt_successful_poll),
        (0, 0),
        "{s:?}"
    );
    assert!(s.halt_wait_ns > 0, "the vCPU blocked instead: {s:?}");
    assert!(s.halt_wait_hist.iter().sum::<u64>() > 0);
}

#[test]
fn a_window_that_does_not_fit_32_bits_is_an_error() {
    let Some(kvm) = kvm() else { return };
    let vm = kvm.create_vm().unwrap();
    let err = set_vm_halt_poll(&vm, Duration::from_secs(5)).unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    set_vm_halt_poll(&vm, Duration::from_micros(100)).unwrap();
}

#[test]
fn the_tuner_reads_long_halts_and_switches_kvm_polling_off() {
    let Some(kvm) = kvm() else { return };
    let (vm, vcpu, _mem) = halting_vm(&kvm);
    let stats = TunedVcpus::open([&vcpu]).unwrap();
    let mut tuner = WindowTuner::default();
    assert_eq!(tuner.tune(&vm, &stats).unwrap(), None, "no halt yet");
    // Halts of 2 ms and more (longer still on a busy host): polling never pays.
    let (vcpu, _) = halt_and_kick(vcpu, 40, Duration::from_millis(2));
    assert_eq!(tuner.tune(&vm, &stats).unwrap(), Some(Duration::ZERO));
    // The window is set on the VM: short halts now never poll.
    let before = KvmHaltStats::read(&BinaryStats::for_vcpu(&vcpu).unwrap()).unwrap();
    let (_, after) = halt_and_kick(vcpu, 200, Duration::from_micros(30));
    assert_eq!(
        after.halt_attempted_poll, before.halt_attempted_poll,
        "{after:?}"
    );
    let blocks = |s: &KvmHaltStats| s.halt_wait_hist.iter().sum::<u64>();
    assert!(blocks(&after) > blocks(&before), "it halted: {after:?}");
}

#[test]
fn a_budget_keeps_kvms_polling_within_it() {
    let Some(kvm) = kvm() else { return };
    let (vm, vcpu, _mem) = halting_vm(&kvm);
    let stats = TunedVcpus::open([&vcpu]).unwrap();
    let own = BinaryStats::for_vcpu(&vcpu).unwrap();
    let polled = |s: &KvmHaltStats| s.halt_poll_success_ns + s.halt_poll_fail_ns;
    let budget = 0.2;
    let mut config = TunerConfig::default();
    config.budget = Some(budget);
    let mut tuner = WindowTuner::starting_from(config, &stats).unwrap();
    // The workload of the tests above: halts of 50 µs and more, so many
    // that KVM's own window (200 µs) polls most of the vCPU's time. The
    // tuner runs every 10 ms between kicks; the measured share counts from
    // its first window on, which is when the budget can first hold.
    let mut last_tune = Instant::now();
    let mut windows = Vec::new();
    let mut since: Option<(Instant, KvmHaltStats)> = None;
    let mut untuned = None;
    let (_, end) = halt_and_kick_with(vcpu, 10_000, Duration::from_micros(50), || {
        if last_tune.elapsed() >= Duration::from_millis(10) {
            last_tune = Instant::now();
            if let Some(w) = tuner.tune(&vm, &stats).unwrap() {
                untuned.get_or_insert(tuner.polling_share().unwrap_or_default());
                windows.push(w);
                since.get_or_insert_with(|| (Instant::now(), KvmHaltStats::read(&own).unwrap()));
            }
        }
    });
    let (start, first) = since.expect("the tuner set a window");
    let share = (polled(&end) - polled(&first)) as f64 / start.elapsed().as_nanos() as f64;
    eprintln!(
        "KVM's own window polled {untuned:?} of the vCPU; then windows {:?}..{:?}, \
         {} changes, polling {:.1} % of the vCPU, {} of {} polls caught",
        windows.first(),
        windows.last(),
        tuner.changes(),
        100.0 * share,
        end.halt_successful_poll - first.halt_successful_poll,
        end.halt_attempted_poll - first.halt_attempted_poll,
    );
    assert!(
        windows
            .iter()
            .all(|w| w.is_zero() || *w >= HALT_POLL_NS_GROW_START),
        "{windows:?}"
    );
    // The estimate is an upper bound of KVM's polling; the tolerance covers
    // an interval that breaks the budget before the tuner shrinks.
    assert!(
        share <= budget * 1.25,
        "polled {share:.3} of the vCPU: {windows:?}"
    );
}

#[test]
fn a_vcpu_joins_the_tuner_from_its_own_thread_while_its_lock_is_held_and_leaves() {
    use std::os::fd::{AsRawFd, BorrowedFd};
    use std::sync::{Mutex, mpsc};
    let Some(kvm) = kvm() else { return };
    let (vm, vcpu, _mem) = halting_vm(&kvm);
    register_signal_handler(SIGRTMIN(), on_kick).unwrap();
    let tuned = TunedVcpus::default();
    let stop = Arc::new(AtomicBool::new(false));
    // Cloud Hypervisor's shape: the vCPU thread holds its vCPU's lock for as
    // long as it runs, so only that thread can reach the vCPU's fd.
    let vcpu = Arc::new(Mutex::new(vcpu));
    let (joined, has_joined) = mpsc::channel();
    let runner = {
        let (tuned, stop, vcpu) = (tuned.clone(), stop.clone(), vcpu.clone());
        thread::spawn(move || {
            let mut vcpu = vcpu.lock().unwrap();
            tuned.join(3, &*vcpu).unwrap();
            joined.send(()).unwrap();
            while !stop.load(SeqCst) {
                match vcpu.run() {
                    Err(e) if e.errno() == libc::EINTR => {}
                    Ok(VcpuExit::Intr) => {}
                    other => panic!("unexpected exit: {other:?}"),
                }
            }
        })
    };
    has_joined.recv().unwrap();
    assert!(vcpu.try_lock().is_err(), "the vCPU thread holds its lock");
    // The VM as a bare borrowed fd: no kvm-ioctls type is needed.
    // SAFETY: `vm` owns the fd and outlives `raw`.
    let raw = unsafe { BorrowedFd::borrow_raw(vm.as_raw_fd()) };
    let mut tuner = WindowTuner::starting_from(TunerConfig::default(), &tuned).unwrap();
    halt_poll::set_timer_slack(Duration::from_nanos(1)).unwrap();
    for _ in 0..40 {
        thread::sleep(Duration::from_millis(2));
        runner.kill(SIGRTMIN()).unwrap();
    }
    // Long halts, read through the joined vCPU's stats while it runs.
    assert_eq!(tuner.tune(&raw, &tuned).unwrap(), Some(Duration::ZERO));
    assert_eq!(tuned.ids(), [3]);
    stop.store(true, SeqCst);
    while !runner.is_finished() {
        runner.kill(SIGRTMIN()).unwrap();
        thread::sleep(Duration::from_millis(1));
    }
    runner.join().unwrap();
    assert!(tuned.leave(3), "vCPU 3 was there");
    assert!(!tuned.leave(3), "and is gone");
    assert_eq!(tuner.tune(&raw, &tuned).unwrap(), Some(Duration::ZERO));
    assert!(tuned.ids().is_empty());
}

#[test]
fn observing_chooses_a_window_and_meters_the_polling_without_setting_it() {
    let Some(kvm) = kvm() else { return };
    let (_vm, vcpu, _mem) = halting_vm(&kvm);
    let stats = TunedVcpus::open([&vcpu]).unwrap();
    let mut tuner = WindowTuner::default();
    assert_eq!(tuner.observe(&stats).unwrap(), None, "no halt yet");
    let (vcpu, _) = halt_and_kick(vcpu, 40, Duration::from_millis(2));
    assert_eq!(tuner.observe(&stats).unwrap(), Some(Duration::ZERO));
    // Nothing was set: KVM's own window still polls short halts.
    let before = KvmHaltStats::read(&BinaryStats::for_vcpu(&vcpu).unwrap()).unwrap();
    let (_, after) = halt_and_kick(vcpu, 200, Duration::from_micros(30));
    assert!(
        after.halt_attempted_poll > before.halt_attempted_poll,
        "{after:?}"
    );
    // The meter counts what KVM reported between the reads.
    tuner.observe(&stats).unwrap();
    let (polled, vcpu_time) = tuner.polling_total();
    let reported = |s: &KvmHaltStats| s.halt_poll_success_ns + s.halt_poll_fail_ns;
    assert!(polled >= Duration::from_nanos(reported(&after) - reported(&before)));
    assert!(vcpu_time > Duration::ZERO && polled < vcpu_time);
}
