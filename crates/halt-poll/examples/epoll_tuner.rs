//! `WindowTuner` with a polling budget, wired as a VMM on KVM's in-kernel
//! irqchip (Firecracker, Cloud Hypervisor) would wire it: a real VM whose
//! real-mode guest runs `sti; hlt; jmp` with an IVT pointing every vector at
//! an `iret` stub; a device thread raising IRQ0 (`KVM_IRQ_LINE`) from a
//! timerfd; and a tuner thread driven by a timerfd in an epoll loop, with
//! its stats fds opened before it installs a seccomp filter that allows only
//! what it needs (any other system call kills the process).
//!
//! `cargo run -p halt-poll --features kvm --example epoll_tuner -- [SHARE [IRQ_PERIOD_US]]`
//! (x86_64; default 0.05 of the vCPU and an interrupt every 150 µs, halts short
//! enough that KVM's own window polls most of the vCPU in the first interval).

#[cfg(target_arch = "x86_64")]
fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    vm::run()
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("epoll_tuner runs a real-mode x86 guest: x86_64 only");
}

#[cfg(target_arch = "x86_64")]
mod vm {
    use std::os::fd::AsRawFd;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::thread;
    use std::time::{Duration, Instant};

    use halt_poll::kvm::{BinaryStats, KvmHaltStats, TunedVcpus, TunerConfig, WindowTuner};
    use kvm_bindings::{KVMIO, kvm_enable_cap, kvm_regs, kvm_userspace_memory_region};
    use kvm_ioctls::{Kvm, VcpuExit};
    use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
    use vmm_sys_util::eventfd::EventFd;
    use vmm_sys_util::signal::{Killable, SIGRTMIN, register_signal_handler};
    use vmm_sys_util::timerfd::TimerFd;

    vmm_sys_util::ioctl_iow_nr!(KVM_ENABLE_CAP, KVMIO, 0xa3, kvm_enable_cap);

    const MEM: usize = 0x10000;
    /// The `iret` stub every vector points at: EOI to the PIC, then return.
    const STUB: usize = 0x500;
    const TUNE_EVERY: Duration = Duration::from_millis(10);
    const RUN_FOR: Duration = Duration::from_secs(2);

    pub fn run() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let mut args = std::env::args().skip(1);
        let share: f64 = args.next().map_or(Ok(0.05), |a| a.parse())?;
        let period_us: u64 = args.next().map_or(Ok(150), |a| a.parse())?;
        if !(share > 0.0 && share <= 1.0) || period_us == 0 {
            return Err("SHARE must be in (0, 1] and IRQ_PERIOD_US at least 1".into());
        }

        // The VM: KVM's PIC, IOAPIC and LAPICs, and one vCPU in real mode.
        let vm = Arc::new(Kvm::new()?.create_vm()?);
        vm.create_irq_chip()?;
        // SAFETY: a fresh anonymous mapping, checked below; unmapped at the
        // end, after the vCPU thread is joined.
        let host = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                MEM,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if host == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: the mapping is MEM bytes, zeroed, and only this slice writes it.
        let mem = unsafe { std::slice::from_raw_parts_mut(host.cast::<u8>(), MEM) };
        for vector in 0..256 {
            mem[vector * 4..vector * 4 + 2].copy_from_slice(&(STUB as u16).to_le_bytes());
        }
        // push ax; mov al, 0x20; out 0x20, al; pop ax; iret
        mem[STUB..STUB + 7].copy_from_slice(&[0x50, 0xb0, 0x20, 0xe6, 0x20, 0x58, 0xcf]);
        mem[0x1000..0x1004].copy_from_slice(&[0xfb, 0xf4, 0xeb, 0xfc]); // sti; hlt; jmp -4
        let region = kvm_userspace_memory_region {
            slot: 0,
            guest_phys_addr: 0,
            memory_size: MEM as u64,
            userspace_addr: mem.as_mut_ptr() as u64,
            flags: 0,
        };
        // SAFETY: the mapping lives until the end of this function, after the
        // vCPU thread that runs the guest has been joined.
        unsafe { vm.set_user_memory_region(region) }?;
        let mut vcpu = vm.create_vcpu(0)?;
        let mut sregs = vcpu.get_sregs()?;
        (sregs.cs.base, sregs.cs.selector) = (0, 0);
        vcpu.set_sregs(&sregs)?;
        vcpu.set_regs(&kvm_regs {
            rip: 0x1000,
            rsp: 0x8000,
            rflags: 2,
            ..Default::default()
        })?;
        // One stats fd for this report, one for the tuner (opened here: the
        // vCPU fd moves to its thread).
        let stats = BinaryStats::for_vcpu(&vcpu)?;
        let tuner_stats = TunedVcpus::open([&vcpu])?;
        let before = KvmHaltStats::read(&stats)?;

        // The vCPU thread: every halt stays in KVM; a signal ends KVM_RUN.
        extern "C" fn kick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}
        register_signal_handler(SIGRTMIN(), kick)?;
        let stop = Arc::new(AtomicBool::new(false));
        let vcpu_thread = {
            let stop = stop.clone();
            thread::spawn(move || {
                while !stop.load(SeqCst) {
                    match vcpu.run() {
                        Ok(VcpuExit::Intr) => {}
                        Err(e) if e.errno() == libc::EINTR => {}
                        other => panic!("unexpected exit: {other:?}"),
                    }
                }
            })
        };

        // The device: IRQ0, an edge, every period.
        let device = {
            let (vm, stop) = (vm.clone(), stop.clone());
            let mut timer = TimerFd::new()?;
            let period = Duration::from_micros(period_us);
            timer.reset(period, Some(period))?;
            thread::spawn(move || -> Result<(), kvm_ioctls::Error> {
                while !stop.load(SeqCst) && timer.wait().is_ok() {
                    vm.set_irq_line(0, true)?;
                    vm.set_irq_line(0, false)?;
                }
                Ok(())
            })
        };

        // The tuner: everything it opens is opened here, before its filter.
        let mut config = TunerConfig::default();
        config.budget = Some(share);
        let finish = EventFd::new(0)?;
        let tuner = {
            let (vm, stats) = (vm.clone(), tuner_stats);
            let mut tuner = WindowTuner::starting_from(config, &stats)?;
            let mut timer = TimerFd::new()?;
            timer.reset(TUNE_EVERY, Some(TUNE_EVERY))?;
            let epoll = Epoll::new()?;
            for (fd, token) in [(timer.as_raw_fd(), 0), (finish.as_raw_fd(), 1)] {
                epoll.ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, token),
                )?;
            }
            let mut log = Vec::new();
            thread::spawn(
                move || -> Result<_, Box<dyn std::error::Error + Send + Sync>> {
                    install_seccomp_filter()?;
                    let mut events = [EpollEvent::default(); 2];
                    loop {
                        let n = epoll.wait(-1, &mut events)?;
                        if events[..n].iter().any(|e| e.data() == 1) {
                            return Ok((tuner, log));
                        }
                        timer.wait()?;
                        let changes = tuner.changes();
                        let window = tuner.tune(&vm, &stats)?;
                        if tuner.changes() != changes {
                            log.push((Instant::now(), window, tuner.polling_share()));
                        }
                    }
                },
            )
        };

        let start = Instant::now();
        thread::sleep(RUN_FOR);
        finish.write(1)?;
        let (tuner, log) = tuner.join().map_err(|_| "the tuner thread panicked")??;
        stop.store(true, SeqCst);
        device.join().map_err(|_| "the device thread panicked")??;
        while !vcpu_thread.is_finished() {
            vcpu_thread.kill(SIGRTMIN())?;
            thread::sleep(Duration::from_millis(1));
        }
        vcpu_thread.join().map_err(|_| "the vCPU thread panicked")?;
        let elapsed = start.elapsed();
        let after = KvmHaltStats::read(&stats)?;
        // SAFETY: the mapping made above; the guest that used it has stopped.
        unsafe { libc::munmap(host, MEM) };

        for (at, window, share) in &log {
            let (at, share) = ((*at - start).as_millis(), share.unwrap_or(0.0));
            println!(
                "{at:>5} ms: window {window:?} (the interval before polled {:.1} %)",
                100.0 * share
            );
        }
        let polled = |s: &KvmHaltStats| s.halt_poll_success_ns + s.halt_poll_fail_ns;
        let halts = |s: &KvmHaltStats| s.halt_successful_poll + s.halt_wakeup;
        println!(
            "{} changes in {elapsed:.1?} ({:.1}/s); KVM polled {:.2} % of the vCPU (budget {:.1} %); \
             {} of {} halts caught by a poll",
            tuner.changes(),
            tuner.changes() as f64 / elapsed.as_secs_f64(),
            100.0 * (polled(&after) - polled(&before)) as f64 / elapsed.as_nanos() as f64,
            100.0 * share,
            after.halt_successful_poll - before.halt_successful_poll,
            halts(&after) - halts(&before),
        );
        Ok(())
    }

    /// The tuner thread's system calls, as a seccomp allowlist for this
    /// thread alone; anything else kills the process.
    const ALLOWED: &[libc::c_long] = &[
        libc::SYS_epoll_wait,    // the loop
        libc::SYS_epoll_pwait,   // the same, from a libc without epoll_wait
        libc::SYS_read,          // the timerfd's expirations
        libc::SYS_pread64,       // the stats fds
        libc::SYS_clock_gettime, // Instant::now, where the vDSO falls back
        libc::SYS_futex,         // std's locks
        libc::SYS_mmap,          // the allocator
        libc::SYS_munmap,
        libc::SYS_mprotect,
        libc::SYS_madvise,
        libc::SYS_brk,
        libc::SYS_sigaltstack, // thread exit
        libc::SYS_rt_sigprocmask,
        libc::SYS_close, // its timerfd, eventfd and epoll fd, dropped as it returns
        libc::SYS_fcntl, // std's check, in debug builds, that a dropped fd was open
        libc::SYS_exit,
    ];

    /// Installs [`ALLOWED`], and `ioctl` for `KVM_ENABLE_CAP` only, on this
    /// thread.
    fn install_seccomp_filter() -> std::io::Result<()> {
        const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
        const ARCH: u32 = 4; // offsets in struct seccomp_data
        const NR: u32 = 0;
        const ARG1: u32 = 16 + 8; // the ioctl's request, low half
        let stmt = |code: u32, k: u32| libc::sock_filter {
            code: code as u16,
            jt: 0,
            jf: 0,
            k,
        };
        let jeq = |k: u32, jt: u8, jf: u8| libc::sock_filter {
            code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
            jt,
            jf,
            k,
        };
        let load = |at| stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, at);
        let allow = stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW);
        let kill = stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_KILL_PROCESS);
        let mut filter = vec![load(ARCH), jeq(AUDIT_ARCH_X86_64, 1, 0), kill, load(NR)];
        for &nr in ALLOWED {
            filter.extend([jeq(nr as u32, 0, 1), allow]);
        }
        filter.extend([
            jeq(libc::SYS_ioctl as u32, 0, 3),
            load(ARG1),
            jeq(KVM_ENABLE_CAP() as u32, 0, 1),
            allow,
            kill,
        ]);
        let program = libc::sock_fprog {
            len: filter.len() as u16,
            filter: filter.as_mut_ptr(),
        };
        // SAFETY: prctl with integer arguments; then a pointer to a filter
        // program that outlives the call (the kernel copies it).
        let ok = unsafe {
            libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
                && libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &program) == 0
        };
        match ok {
            true => Ok(()),
            false => Err(std::io::Error::last_os_error()),
        }
    }
}
