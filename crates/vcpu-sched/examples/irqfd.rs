//! A VMM on KVM's in-kernel irqchip, as Firecracker and Cloud Hypervisor are:
//! a device thread completes "I/O" every millisecond by writing an `EventFd`
//! registered with `KVM_IRQFD` on GSI 5, through the scheduler
//! (`Scheduler::deliver`, the target from `IrqTargets`), which looks at the
//! target's thread just before the write. KVM handles the vCPU's halts and
//! the interrupt; the VMM never sees an exit. The vCPU shares its CPU with a
//! CPU hog: a vCPU caught waiting for it (preempted before it halted again)
//! is boosted (`FifoOnDelivery`, under a 200 µs boost budget: long enough
//! to be scheduled in), or not (`NoBoost`); one asleep in its halt is left
//! to the host's wake-up, as KVM's `ready` rule leaves it.
//!
//! The guest, in real mode: `sti; hlt` in a loop, and a handler that counts
//! the interrupt in guest memory and sends the PIC its EOI.
//!
//! `cargo run --release -p vcpu-sched --example irqfd [-- --seconds N]`
//!
//! Prints a table, per policy: interrupts raised, handled by the guest (an edge the
//! vCPU had not taken before the next merges with it in the PIC), what
//! `deliver` found (waiting for a CPU, running, asleep), and the boosts;
//! with `--update-results` the table also goes to the crate's RESULTS.md, section "irqfd".
//!
//! The device thread's system calls, for a seccomp allowlist: `read`
//! (timerfd), `write` (the irqfd's eventfd), `clock_gettime`, `pread64` (the
//! vCPU thread's stat file, opened by `register_thread`), `sched_getattr` and
//! `sched_setattr` (the boost), `futex` (the revoker).

// The workspace's RESULTS.md writer (test-support's), a copy of which ships with the crate.
#[path = "support/results.rs"]
mod results;

#[cfg(target_arch = "x86_64")]
fn main() {
    let seconds = match parse_seconds() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = vcpu_sched::FifoBoost::default().check() {
        eprintln!("error: this example boosts threads to SCHED_FIFO: {e}");
        std::process::exit(1);
    }
    let mut table = format!(
        "{seconds} s per policy; an interrupt every 1 ms through an irqfd to a real-mode vCPU sharing its CPU with a CPU hog; \
         boosts of at most 200 µs\n\n\
         | policy | raised | handled by the guest | waiting for a CPU | running | asleep | boosts | boosted ms |\n\
         |---|---|---|---|---|---|---|---|\n"
    );
    for boost in [false, true] {
        match x86::run(boost, std::time::Duration::from_secs(seconds)) {
            Ok(row) => table.push_str(&row.table_row()),
            Err(e) => {
                eprintln!("error: {e}");
                std::process::exit(1);
            }
        }
    }
    println!("{table}");
    let command = results::command("cargo run --release -p vcpu-sched --example irqfd");
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("RESULTS.md");
    results::write_section_if_asked(&path, "vcpu-sched", "irqfd", &command, &table);
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("this example's guest is x86 real-mode code");
}

/// `--seconds N` (default 2).
#[cfg(target_arch = "x86_64")]
fn parse_seconds() -> Result<u64, String> {
    let args: Vec<String> = results::args().collect();
    match args.as_slice() {
        [] => Ok(2),
        [flag, n] if flag == "--seconds" => n
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or(format!("--seconds {n:?}: a whole number, at least 1")),
        _ => Err("usage: irqfd [--seconds N]".into()),
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    use std::thread;
    use std::time::{Duration, Instant};

    use kvm_bindings::{kvm_regs, kvm_userspace_memory_region};
    use kvm_ioctls::{Kvm, VcpuExit, VcpuFd, VmFd};
    use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};
    use vmm_sys_util::eventfd::EventFd;
    use vmm_sys_util::signal::{Killable, SIGRTMIN, register_signal_handler};
    use vmm_sys_util::timerfd::TimerFd;

    use vcpu_sched::thread::{available_cpus, current_tid, pin};
    use vcpu_sched::{
        BoostBudget, BoostPolicy, Booster, Delivery, FifoBoost, FifoOnDelivery, GsiRoute,
        IrqTargets, NoBoost, NoGuestView, SchedStats, Scheduler,
    };

    const MEM_SIZE: usize = 0x10000;
    /// The GSI the device's irqfd raises: KVM routes GSIs 0-15 to its PIC
    /// (vector = GSI here, the PIC's base left at 0) and IOAPIC.
    const GSI: u32 = 5;
    /// Where the guest counts the interrupts it handled (a 16-bit word).
    const COUNTER: u64 = 0x500;
    const CODE: u64 = 0x1000;
    const HANDLER: u64 = 0x1100;

    /// One policy's run.
    pub struct Row {
        policy: &'static str,
        raised: u64,
        handled: u16,
        /// What `deliver` found: waiting for a CPU, running, asleep, unknown.
        seen: [u64; 4],
        boosts: u64,
        boosted: Duration,
    }

    impl Row {
        /// Its row of the RESULTS.md table.
        pub fn table_row(&self) -> String {
            format!(
                "| {} | {} | {} | {} | {} | {} | {} | {:.1} |\n",
                self.policy,
                self.raised,
                self.handled,
                self.seen[0],
                self.seen[1],
                self.seen[2],
                self.boosts,
                self.boosted.as_secs_f64() * 1e3,
            )
        }
    }

    /// One policy's run.
    pub fn run(boost: bool, length: Duration) -> Result<Row, Box<dyn std::error::Error>> {
        let policy: Box<dyn BoostPolicy> = match boost {
            true => Box::new(FifoOnDelivery),
            false => Box::new(NoBoost),
        };
        let stats = Arc::new(SchedStats::default());
        let budget = BoostBudget::new(
            Duration::from_micros(200),
            Duration::from_millis(2),
            Duration::from_millis(10),
        );
        let booster =
            Booster::with_events(1, FifoBoost::default(), stats.clone()).with_budget(budget);
        let sched = Arc::new(Scheduler::new(1, policy, booster, NoGuestView));
        let mut targets = IrqTargets::identity(1);
        targets.set_route(GSI, GsiRoute::Vcpu(0)); // the PIC's output goes to the boot vCPU

        let (vm, mut vcpu, mem) = real_mode_vm()?;
        let irqfd = EventFd::new(libc::EFD_NONBLOCK)?;
        vm.register_irqfd(&irqfd, GSI)?;
        let cpus = available_cpus()?;
        let (vcpu_cpu, device_cpu) = (cpus[0], *cpus.last().unwrap_or(&cpus[0]));
        let _hog = pinned_hog(vcpu_cpu);

        register_signal_handler(SIGRTMIN(), on_kick)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let runner = {
            let stop = stop.clone();
            thread::spawn(move || {
                pin(0, &[vcpu_cpu]).expect("pin the vCPU");
                tid_tx.send(current_tid()).expect("main waits");
                while !stop.load(SeqCst) {
                    match vcpu.run() {
                        Err(e) if e.errno() == libc::EINTR => {}
                        Ok(VcpuExit::Intr) => {}
                        other => return Err(format!("unexpected exit: {other:?}")),
                    }
                }
                Ok(())
            })
        };
        sched.register_thread(0, tid_rx.recv()?)?;

        // The device thread (this one): a completion every millisecond.
        pin(0, &[device_cpu])?;
        let mut timer = TimerFd::new()?;
        timer.reset(Duration::from_millis(1), Some(Duration::from_millis(1)))?;
        let mut seen = [0u64; 4];
        let mut raised = 0u64;
        let end = Instant::now() + length;
        while Instant::now() < end {
            timer.wait()?;
            let target = targets.gsi(GSI)?;
            let (written, delivery) = sched.deliver(target, || irqfd.write(1));
            written?;
            raised += 1;
            seen[match delivery {
                Delivery::Preempted { .. } => 0,
                Delivery::Running => 1,
                Delivery::Blocked => 2,
                _ => 3,
            }] += 1;
        }
        thread::sleep(Duration::from_millis(20)); // the last interrupts handled
        stop.store(true, SeqCst);
        while !runner.is_finished() {
            runner.kill(SIGRTMIN())?;
            thread::sleep(Duration::from_millis(1));
        }
        runner.join().map_err(|_| "the vCPU thread panicked")??;
        let handled: u16 = mem.read_obj(GuestAddress(COUNTER))?;
        drop(vm); // before the memory it maps
        drop(mem);
        let get = |a: &AtomicU64| a.load(SeqCst);
        Ok(Row {
            policy: if boost { "FifoOnDelivery" } else { "NoBoost" },
            raised,
            handled,
            seen,
            boosts: get(&stats.boosts),
            boosted: Duration::from_nanos(get(&stats.boost_ns)),
        })
    }

    /// Takes the vCPU thread out of `KVM_RUN` (with `EINTR`) to stop it.
    extern "C" fn on_kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

    /// A CPU hog pinned to `cpu`, another tenant, stopped when dropped.
    fn pinned_hog(cpu: usize) -> impl Drop {
        struct Hog(Arc<AtomicBool>, Option<thread::JoinHandle<()>>);
        impl Drop for Hog {
            fn drop(&mut self) {
                self.0.store(true, SeqCst);
                self.1.take().map(thread::JoinHandle::join);
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        Hog(
            stop,
            Some(thread::spawn(move || {
                pin(0, &[cpu]).expect("pin the hog");
                while !stopped.load(SeqCst) {
                    std::hint::spin_loop();
                }
            })),
        )
    }

    /// A VM with KVM's irqchip and one real-mode vCPU at `sti; hlt` in a
    /// loop; every vector's handler counts at `COUNTER` and EOIs the PIC.
    fn real_mode_vm() -> Result<(VmFd, VcpuFd, GuestMemoryMmap), Box<dyn std::error::Error>> {
        let kvm = Kvm::new()?;
        let vm = kvm.create_vm()?;
        vm.create_irq_chip()?;
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), MEM_SIZE)])?;
        for vector in 0..256u64 {
            // The interrupt vector table: offset, then segment 0.
            mem.write_obj(HANDLER as u16, GuestAddress(vector * 4))?;
        }
        mem.write_slice(&[0xfb, 0xf4, 0xeb, 0xfc], GuestAddress(CODE))?; // sti; hlt; jmp -4
        // inc word [COUNTER]; mov al, 0x20; out 0x20, al; iret
        let [lo, hi] = (COUNTER as u16).to_le_bytes();
        let handler = [0xff, 0x06, lo, hi, 0xb0, 0x20, 0xe6, 0x20, 0xcf];
        mem.write_slice(&handler, GuestAddress(HANDLER))?;
        let region = kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: MEM_SIZE as u64,
            userspace_addr: mem.get_host_address(GuestAddress(0))? as u64,
            flags: 0,
        };
        // SAFETY: `mem` outlives the VM: returned with it, and the caller
        // drops the VM first.
        unsafe { vm.set_user_memory_region(region) }?;
        let vcpu = vm.create_vcpu(0)?;
        let mut sregs = vcpu.get_sregs()?;
        (sregs.cs.base, sregs.cs.selector) = (0, 0);
        (sregs.ss.base, sregs.ss.selector) = (0, 0);
        vcpu.set_sregs(&sregs)?;
        vcpu.set_regs(&kvm_regs {
            rip: CODE,
            rsp: 0x8000,
            rflags: 2,
            ..Default::default()
        })?;
        Ok((vm, vcpu, mem))
    }
}
