//! Delivering interrupts to vCPUs: the pending (IRR) bits of every vCPU, and
//! the wake-up that makes sure the target sees them.
//!
//! Any thread may post: a vCPU writing its ICR, a vCPU's timer thread. The
//! poster sets the IRR bit (or the timer expiry), tells the boost policy
//! (`vcpu-sched`) that the target was delivered to, and then looks at where
//! the target is:
//! - in the guest: a kick ([`crate::kick`]) brings it out of `KVM_RUN`;
//! - halted: its halt-poll wake source wakes it (polling or blocked);
//! - in the VMM: nothing; it looks for work before it enters the guest again.
//!
//! # The handshake: why no post is missed
//! Two sides, each writing first and reading second, with a SeqCst fence in
//! between on both (`VcpuState`'s run-state accessors have them; the IRR is
//! SeqCst atomics, the timer expiry a slot under a lock):
//!
//! | vCPU thread | poster |
//! |---|---|
//! | 1. run state := `InGuest` (or `Halted` before a halt) | 1. IRR bit or timer expiry := set |
//! | 2. read the IRR and the timer expiry; inject | 2. read the run state |
//! | 3. `KVM_RUN` (or block on the wake source) | 3. `InGuest`: kick; `Halted`: wake |
//!
//! In the single order of SeqCst fences one of the two sides' fences comes
//! first. If the poster's does, the vCPU's read in step 2 sees the work and
//! injects it. If the vCPU's does, the poster reads `InGuest` (or `Halted`)
//! and kicks (or wakes). A kick is a signal that stays pending while the
//! vCPU is still in the VMM, so the `KVM_RUN` of step 3 returns at once
//! instead of entering the guest ([`crate::kick`]); a wake sets the wake
//! source's event bit before it looks for a sleeper, so a halt that starts
//! afterwards returns at once. Either way the vCPU looks again. The vCPU
//! goes back to `InVmm` only after `KVM_RUN` returns, and publishes again
//! before its next look, so every look is covered.
//!
//! The order matters: a vCPU that looked for work before publishing
//! `InGuest` would let a post land in between, see `InVmm`, send no kick, and
//! leave the vCPU in the guest with the interrupt pending until some
//! unrelated exit (for a guest that spins without exits: for ever). The loom
//! model `a_post_racing_with_entry_is_injected_or_kicks` in `vcpu-sched`'s
//! `tests/loom.rs` checks both orders; `tests/contention.rs` runs guests
//! that spin without exits while their timers and IPIs are posted, beside
//! CPU hogs. KVM does the same with `vcpu->mode = IN_GUEST_MODE`, a full
//! barrier, then its request check in `vcpu_enter_guest`.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use halt_poll::FutexWake;
use lapic_timer::{Expiry, TimerSink};
use vcpu_sched::{
    BoostBudget, BoostPolicy, Booster, FifoBoost, GuestBoosts, GuestView, RequestLimits,
    RequestWatcher, RequestWords, RunState, SchedStats, Scheduler,
};
use vm_memory::{Bytes, GuestAddress};

use crate::memory::VmMemory;

use crate::apic::Destination;
use crate::kick::KickTarget;

/// Wake-source bit for an interrupt.
pub const WAKE_INTERRUPT: usize = 0;
/// Wake-source bit for a timer expiry.
pub const WAKE_TIMER: usize = 1;

/// One vCPU's delivery state: how to reach its thread.
struct Link {
    wake: Arc<FutexWake>,
    thread: KickTarget,
    /// Its APIC is software-enabled, so it accepts fixed IPIs (KVM's
    /// `__apic_accept_irq` drops them otherwise); false at reset.
    accepting: AtomicBool,
    /// Its APIC is in x2APIC mode, which decides the broadcast ID it takes.
    x2apic: AtomicBool,
}

/// What waits to be injected into each vCPU: its IRR and its timer's due
/// expiry. It is also the scheduler's guest view: a halted vCPU with either
/// would run if woken (KVM's `vcpu_dy_runnable`).
#[derive(Default)]
pub struct Pending {
    irr: Vec<[AtomicU64; 4]>,
    timer_due: Vec<Mutex<Option<Expiry>>>,
}

impl Pending {
    fn new(vcpus: usize) -> Self {
        Self {
            irr: (0..vcpus).map(|_| Default::default()).collect(),
            timer_due: (0..vcpus).map(|_| Mutex::new(None)).collect(),
        }
    }

    fn timer(&self, vcpu: usize) -> std::sync::MutexGuard<'_, Option<Expiry>> {
        self.timer_due[vcpu]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// vCPU `vcpu`'s IRR.
    pub fn irr(&self, vcpu: usize) -> [u64; 4] {
        let irr = &self.irr[vcpu];
        [0, 1, 2, 3].map(|w| irr[w].load(SeqCst))
    }
}

impl GuestView for Pending {
    fn runnable(&self, vcpu: usize) -> bool {
        vcpu < self.irr.len() && (self.irr(vcpu) != [0; 4] || self.timer(vcpu).is_some())
    }

    /// Unknown here (no guest register is read): every preempted vCPU is a
    /// candidate.
    fn in_kernel(&self, _: usize) -> bool {
        true
    }
}

/// The vCPU scheduling of a VM here: `FifoBoost` boosts, counted in
/// [`SchedStats`], with [`Pending`] as the guest view.
pub type VmScheduler =
    Scheduler<Box<dyn BoostPolicy>, Booster<FifoBoost, Arc<SchedStats>>, Arc<Pending>>;

/// Counters of what delivery did.
#[derive(Debug, Default)]
pub struct IrqStats {
    /// Interrupts posted.
    pub posted: AtomicU64,
    /// Kicks sent to vCPUs in the guest.
    pub kicks: AtomicU64,
    /// Wake-ups of halted vCPUs.
    pub wakes: AtomicU64,
    /// IPIs to a vCPU that does not exist (dropped, as hardware does).
    pub dropped: AtomicU64,
}

/// `FifoBoost` with a second revoker on this process's last CPU: the first
/// sleeps on the CPU of the boost it ends and stalls with it when the host
/// takes that CPU away, and the second, elsewhere whenever the boosted vCPU
/// is not on that last CPU, ends the boost meanwhile (vcpu-sched's README).
fn boost_control() -> FifoBoost {
    let last = vcpu_sched::thread::available_cpus()
        .ok()
        .and_then(|cpus| cpus.last().copied());
    match last {
        Some(cpu) => FifoBoost::default().with_revoker_cpus(&[cpu]),
        None => FifoBoost::default(),
    }
}

/// Every vCPU's pending interrupts and the way to reach its thread, with
/// the VM's scheduler (run states, boosts), told of every delivery.
pub struct Interrupts {
    links: Vec<Link>,
    pending: Arc<Pending>,
    sched: Arc<VmScheduler>,
    /// What delivery did.
    pub stats: IrqStats,
}

impl Interrupts {
    /// Delivery for `vcpus` vCPUs, boosting with `policy` within `budget`.
    pub fn new(vcpus: usize, policy: Box<dyn BoostPolicy>, budget: BoostBudget) -> Self {
        let pending = Arc::new(Pending::new(vcpus));
        let stats = Arc::new(SchedStats::default());
        let booster = Booster::with_events(vcpus, boost_control(), stats).with_budget(budget);
        Self {
            links: (0..vcpus)
                .map(|_| Link {
                    wake: Arc::new(FutexWake::new()),
                    thread: KickTarget::default(),
                    accepting: AtomicBool::new(false),
                    x2apic: AtomicBool::new(false),
                })
                .collect(),
            sched: Arc::new(Scheduler::new(vcpus, policy, booster, pending.clone())),
            pending,
            stats: IrqStats::default(),
        }
    }

    /// The VM's vCPU scheduling: run states, boosts, and what they did
    /// (`scheduler().events()`).
    pub fn scheduler(&self) -> &VmScheduler {
        &self.sched
    }

    /// The same, shared, for a thread of its own (a device's).
    pub fn scheduler_handle(&self) -> Arc<VmScheduler> {
        self.sched.clone()
    }

    /// vCPU `vcpu`'s halt-poll wake source.
    pub fn wake_source(&self, vcpu: usize) -> Arc<FutexWake> {
        self.links[vcpu].wake.clone()
    }

    /// Registers the calling thread as vCPU `vcpu`'s, for kicks and boosts
    /// (and the scheduler's probe of it, which guest-requested boosts read).
    ///
    /// # Errors
    /// The thread's stat file cannot be opened.
    pub fn register_thread(&self, vcpu: usize) -> io::Result<()> {
        self.links[vcpu].thread.register_current();
        self.sched
            .register_thread(vcpu, vcpu_sched::thread::current_tid())
    }

    /// Starts granting the boosts the guest asks for in its boost-request
    /// words in `memory`, within `limits`, every [`GUEST_BOOST_INTERVAL`],
    /// until the watcher is dropped.
    pub fn grant_guest_boosts(
        &self,
        memory: VmMemory,
        limits: RequestLimits,
    ) -> io::Result<RequestWatcher> {
        let words = GuestRequestWords(memory);
        let requests = GuestBoosts::new(self.links.len(), words, limits);
        RequestWatcher::spawn(Arc::new(requests), self.sched.clone(), GUEST_BOOST_INTERVAL)
    }

    /// The calling thread stops running vCPU `vcpu`: no more kicks to it.
    pub fn unregister_thread(&self, vcpu: usize) {
        self.links[vcpu].thread.clear();
        let _ = self.sched.booster().ran(vcpu);
    }

    /// vCPU `vcpu`'s APIC is software-enabled (`accepting`) or disabled,
    /// in x2APIC mode or xAPIC: which IPIs reach it. Its own thread says so
    /// after each register write.
    /// Called on every register write, it stores only a change: senders
    /// read these words.
    pub fn set_apic_state(&self, vcpu: usize, accepting: bool, x2apic: bool) {
        let link = &self.links[vcpu];
        if link.accepting.load(SeqCst) != accepting {
            link.accepting.store(accepting, SeqCst);
        }
        if link.x2apic.load(SeqCst) != x2apic {
            link.x2apic.store(x2apic, SeqCst);
        }
    }

    /// Sends `vector` from vCPU `from` to `to`, skipping a vCPU whose APIC
    /// is software-disabled. Returns how many vCPUs got it.
    pub fn ipi(&self, from: usize, vector: u8, to: Destination) -> usize {
        let (mut reached, mut delivered) = (0, 0);
        for (t, link) in self.links.iter().enumerate() {
            if !to.reaches(from, t, link.x2apic.load(SeqCst)) {
                continue;
            }
            reached += 1;
            if link.accepting.load(SeqCst) {
                self.post(t, vector);
                delivered += 1;
            }
        }
        if reached == 0 && matches!(to, Destination::Physical(_)) {
            self.stats.dropped.fetch_add(1, SeqCst);
        }
        delivered
    }

    /// Makes `vector` pending on vCPU `vcpu` and makes sure it notices.
    pub fn post(&self, vcpu: usize, vector: u8) {
        self.post_local(vcpu, vector);
        self.stats.posted.fetch_add(1, SeqCst);
        self.sched.delivered(vcpu);
        self.notify(vcpu, WAKE_INTERRUPT);
    }

    /// The pending vectors of vCPU `vcpu`.
    pub fn pending(&self, vcpu: usize) -> [u64; 4] {
        self.pending.irr(vcpu)
    }

    /// Takes `vector` off vCPU `vcpu`'s pending set (it is being injected).
    pub fn take(&self, vcpu: usize, vector: u8) {
        self.pending.irr[vcpu][usize::from(vector / 64)].fetch_and(!(1 << (vector % 64)), SeqCst);
    }

    /// Sets `vector` pending on the calling vCPU itself (its own timer).
    pub fn post_local(&self, vcpu: usize, vector: u8) {
        self.pending.irr[vcpu][usize::from(vector / 64)].fetch_or(1 << (vector % 64), SeqCst);
    }

    /// Takes vCPU `vcpu`'s timer expiry, if its timer thread delivered one.
    pub fn take_timer(&self, vcpu: usize) -> Option<Expiry> {
        self.pending.timer(vcpu).take()
    }

    /// Whether vCPU `vcpu`'s timer thread has delivered an expiry.
    pub fn has_timer(&self, vcpu: usize) -> bool {
        self.pending.timer(vcpu).is_some()
    }

    /// Kicks vCPU `vcpu` out of the guest, if it is in, so that it looks
    /// at its requests (a dirty limit's pause due).
    pub fn kick(&self, vcpu: usize) {
        if let Some(link) = self.links.get(vcpu) {
            let _ = link.thread.kick();
        }
    }

    /// Kicks every vCPU out of the guest and wakes every halted one, so
    /// each looks at its requests (a pause).
    pub fn kick_all(&self) {
        for link in &self.links {
            // A thread not registered yet looks at its requests before its
            // first entry; one that cannot be signalled has ended.
            let _ = link.thread.kick();
        }
        self.wake_all();
    }

    /// Boosts every vCPU thread (vcpu-sched's boost, within its budget), so
    /// that a kick to them all (a pause) is taken at once, not after the
    /// host's other tenants' slices; where boosts are refused, nothing.
    pub fn boost_all(&self) {
        for vcpu in 0..self.links.len() {
            let _ = self.sched.booster().boost(vcpu);
        }
    }

    /// Wakes every halted vCPU (to stop it).
    pub fn wake_all(&self) {
        for link in &self.links {
            link.wake.wake(WAKE_INTERRUPT);
        }
    }

    /// A timer sink that delivers vCPU `vcpu`'s expiries.
    pub fn timer_sink(self: &Arc<Self>, vcpu: usize) -> VcpuTimerSink {
        VcpuTimerSink {
            irqs: self.clone(),
            vcpu,
        }
    }

    fn notify(&self, vcpu: usize, source: usize) {
        let link = &self.links[vcpu];
        match self.sched.state(vcpu).run_state() {
            RunState::InGuest => {
                // A kick can only fail for a thread that is gone.
                if let Ok(true) = link.thread.kick() {
                    self.stats.kicks.fetch_add(1, SeqCst);
                }
            }
            RunState::Halted => {
                link.wake.wake(source);
                self.stats.wakes.fetch_add(1, SeqCst);
            }
            RunState::InVmm => {}
        }
    }
}

/// Delivers one vCPU's timer expiries: the expiry waits for the vCPU thread,
/// which spins to the exact deadline just before it enters the guest.
pub struct VcpuTimerSink {
    irqs: Arc<Interrupts>,
    vcpu: usize,
}

impl TimerSink for VcpuTimerSink {
    fn expired(&self, expiry: Expiry) {
        *self.irqs.pending.timer(self.vcpu) = Some(expiry);
        self.irqs.notify(self.vcpu, WAKE_TIMER);
    }
}

/// How often guest-requested boosts are looked at: a preempted lock holder
/// waits at most about this (plus the watcher's own wake-up) for its boost,
/// against a host time slice of a few milliseconds.
pub const GUEST_BOOST_INTERVAL: Duration = Duration::from_micros(500);

/// Each vCPU's boost-request word, read from guest memory
/// ([`test_guests::layout::boost_request`]) as the guest writes it.
struct GuestRequestWords(VmMemory);

impl RequestWords for GuestRequestWords {
    fn read(&self, vcpu: usize) -> Option<u64> {
        let vcpu = u32::try_from(vcpu).ok()?;
        let at = GuestAddress(test_guests::layout::boost_request(vcpu));
        self.0.load(at, std::sync::atomic::Ordering::Acquire).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vcpu_sched::NoBoost;

    #[test]
    fn ipis_reach_their_destinations_and_unknown_ones_are_dropped() {
        let irqs = Interrupts::new(3, Box::new(NoBoost), BoostBudget::default());
        for v in 0..3 {
            irqs.set_apic_state(v, true, false);
        }
        assert_eq!(irqs.ipi(0, 0x40, Destination::Physical(2)), 1);
        assert_eq!(irqs.pending(2), [0, 1, 0, 0], "vector 0x40: word 1, bit 0");
        assert_eq!(irqs.ipi(0, 0x41, Destination::AllExcludingSelf), 2);
        assert_eq!(irqs.pending(0), [0; 4]);
        assert_eq!(irqs.ipi(1, 0x42, Destination::All), 3);
        assert_eq!(irqs.ipi(1, 0x43, Destination::SelfOnly), 1);
        assert_eq!(irqs.ipi(0, 0x44, Destination::Physical(7)), 0);
        assert_eq!(irqs.stats.dropped.load(SeqCst), 1);
        irqs.take(2, 0x40);
        assert_eq!(irqs.pending(2)[1] & 1, 0);
        assert_ne!(irqs.pending(2), [0; 4], "0x41 and 0x42 wait");
    }

    #[test]
    fn a_software_disabled_vcpu_gets_no_ipi() {
        let irqs = Interrupts::new(3, Box::new(NoBoost), BoostBudget::default());
        assert_eq!(
            irqs.ipi(0, 0x40, Destination::All),
            0,
            "all disabled at reset"
        );
        irqs.set_apic_state(2, true, false);
        assert_eq!(irqs.ipi(0, 0x41, Destination::All), 1);
        assert_eq!(irqs.ipi(0, 0x42, Destination::Physical(1)), 0);
        assert_eq!(irqs.pending(1), [0; 4]);
        assert_eq!(irqs.pending(2), [0, 1 << 1, 0, 0], "0x41 alone");
        irqs.set_apic_state(2, false, false);
        assert_eq!(irqs.ipi(0, 0x43, Destination::Physical(2)), 0);
        assert_eq!(irqs.pending(2), [0, 1 << 1, 0, 0], "what it had stays");
        irqs.set_apic_state(1, true, true);
        irqs.set_apic_state(2, true, false);
        assert_eq!(irqs.ipi(0, 0x44, Destination::Physical(0xFF)), 1, "2 alone");
        assert_eq!(
            irqs.ipi(0, 0x45, Destination::Physical(u32::MAX)),
            1,
            "1 alone"
        );
    }

    #[test]
    fn a_halted_vcpu_with_an_interrupt_pending_is_a_directed_yield_candidate() {
        let irqs = Interrupts::new(3, Box::new(vcpu_sched::KvmReady), BoostBudget::default());
        let sched = irqs.scheduler();
        for v in 1..3 {
            sched.halted(v);
        }
        let view = sched.guest();
        assert!(!view.runnable(1) && !view.runnable(9), "nothing pending");
        irqs.post(2, 0x40); // marks it ready, as KVM's delivery boost does
        assert!(view.runnable(2) && sched.state(2).is_ready());
        let mut tried = Vec::new();
        sched.ctx().on_spin(0, |v| {
            tried.push(v);
            vcpu_sched::YieldResult::Yielded
        });
        assert_eq!(tried, [2], "1 is halted with nothing pending: skipped");
    }

    /// A pause's boost reaches every vCPU thread that runs, and no other;
    /// without `CAP_SYS_NICE`, none.
    #[test]
    fn boosting_all_boosts_each_registered_vcpu_thread() {
        let irqs = std::sync::Arc::new(Interrupts::new(
            2,
            Box::new(NoBoost),
            BoostBudget::default(),
        ));
        let (registered, ready) = std::sync::mpsc::channel();
        let (finish, done) = std::sync::mpsc::channel::<()>();
        let vcpu0 = {
            let irqs = irqs.clone();
            std::thread::spawn(move || {
                irqs.register_thread(0).unwrap();
                registered.send(()).unwrap();
                let _ = done.recv();
                irqs.unregister_thread(0);
            })
        };
        ready.recv().unwrap();
        irqs.boost_all();
        let boosts = irqs.scheduler().booster().events().boosts.load(SeqCst);
        finish.send(()).unwrap();
        vcpu0.join().unwrap();
        let may = FifoBoost::default().check().is_ok();
        assert_eq!(boosts, u64::from(may), "vCPU 1 has no thread to boost");
    }

    #[test]
    fn a_halted_vcpu_is_woken_and_one_in_the_vmm_is_left_alone() {
        use halt_poll::WakeSource;
        let irqs = Interrupts::new(2, Box::new(NoBoost), BoostBudget::default());
        irqs.scheduler().halted(1);
        irqs.post(1, 0x50);
        assert_ne!(irqs.wake_source(1).take(), 0, "woken");
        irqs.scheduler().woken(1);
        irqs.post(1, 0x51);
        assert_eq!(
            irqs.wake_source(1).take(),
            0,
            "it checks its IRR before entry"
        );
        assert_eq!(irqs.stats.wakes.load(SeqCst), 1);
    }
}
