//! This VMM's own local APIC (`Irqchip::User`), with the family on its
//! paths: the lapic-timer advance and delivery lead on the timer, the
//! halt-poll poller on `hlt`, the vcpu-sched scheduler on delivery, waits and
//! yields, and guest-side polling.

use std::sync::Arc;

use halt_poll::{HaltPoller, HaltStats, MonotonicClock as MonotonicPoll, PollPolicy};
use kvm_bindings::kvm_interrupt;
use kvm_ioctls::VcpuFd;
use lapic_timer::time::rdtsc;
use lapic_timer::{Clock, GuestTime, MonotonicClock, TscClock};
use vmm_sys_util::ioctl::ioctl_with_ref;

use super::ChipState;
use super::IrqChip;
use super::host_timer::HostTimer;
use super::timer_wake::TimerWake;
use crate::apic::{Action, LocalApic, XAPIC_BASE, XAPIC_SIZE};
use crate::error::Error;
use crate::exit::ApicExits;
use crate::guest_abi::{GuestPoll, TimerLead};
use crate::irq::{WAKE_INTERRUPT, WAKE_TIMER};
use crate::policies::WakeSource;
use crate::shared::VmShared;
use test_guests::layout::{irq_record, mailbox};

// The halt poller keeps one policy per wake source: policy `i` learns from
// the halts that source `i` (bit `i` of the events) ended, in the order
// `start` asks `Policies::halt_poll` for them.
const _: () = assert!(WAKE_INTERRUPT == 0 && WAKE_TIMER == 1);

/// The vCPU ioctl this needs that kvm-ioctls does not wrap.
mod ioctls {
    use kvm_bindings::{KVMIO, kvm_interrupt};
    vmm_sys_util::ioctl_iow_nr!(KVM_INTERRUPT, KVMIO, 0x86, kvm_interrupt);
}

/// One vCPU's local APIC in this VMM, with its host timer, delivery lead,
/// halt poller and (with `--guest-poll`) guest-side polling.
pub struct UserIrqChip {
    shared: Arc<VmShared>,
    vcpu: usize,
    clock: GuestClock,
    guest_poll: Option<GuestPoll>,
    apic: LocalApic,
    timer: HostTimer,
    lead: TimerLead,
    poller: HaltPoller<Box<dyn PollPolicy + Send>, TimerWake, MonotonicPoll, Arc<HaltStats>>,
}

impl IrqChip for UserIrqChip {
    type Apic = Self;

    fn start(fd: &VcpuFd, index: u32, shared: &Arc<VmShared>) -> Result<Self, Error> {
        let vcpu = index as usize;
        let clock = GuestClock::new(fd);
        let time = clock.now();
        let setup = &shared.apic;
        let timer = HostTimer::start(clock.tsc_khz, shared, vcpu)?;
        let policies = [WakeSource::Interrupt, WakeSource::Timer]
            .map(|source| setup.policies.halt_poll(index, source))
            .into();
        let wake = TimerWake::new(shared.irqs.wake_source(vcpu), WAKE_TIMER);
        let poller =
            HaltPoller::with_policies(wake, policies).with_events(shared.stats.halt.clone());
        Ok(Self {
            apic: LocalApic::new(index, time)
                .with_min_timer_period_ns(setup.min_timer_period_ns)
                .with_phys_bits(setup.phys_bits),
            timer,
            lead: TimerLead::new(time, irq_record(index)),
            guest_poll: setup
                .policies
                .guest_poll(index)
                .map(|policy| GuestPoll::new(policy, mailbox(index), clock.tsc_khz)),
            clock,
            poller,
            shared: shared.clone(),
            vcpu,
        })
    }

    fn apic(&mut self) -> &mut Self {
        self
    }

    fn entering_guest(&mut self) {
        self.shared.irqs.scheduler().entering_guest(self.vcpu);
    }

    fn prepare_entry(&mut self, fd: &mut VcpuFd) -> Result<(), Error> {
        let vcpu = self.vcpu;
        if let Some(expiry) = self.timer.take_due(&self.shared, vcpu) {
            self.timer.receive(&expiry);
            self.fire_timer();
        } else if self.due_now() {
            self.fire_timer();
        }
        // Borrowed beside the fields below, not cloned: this runs before
        // every entry, and an `Arc` clone is an atomic every vCPU writes.
        let (shared, irqs) = (&self.shared, &self.shared.irqs);
        let deliverable = self.apic.deliverable(&irqs.pending(vcpu));
        let run = fd.get_kvm_run();
        let can_inject = run.ready_for_interrupt_injection != 0 && run.if_flag != 0;
        run.request_interrupt_window = u8::from(deliverable.is_some() && !can_inject);
        if let (Some(vector), true) = (deliverable, can_inject) {
            let arg = kvm_interrupt {
                irq: u32::from(vector),
            };
            // SAFETY: a vCPU fd and a kvm_interrupt that lives for the call,
            // which only reads it; the result is checked.
            let ret = unsafe { ioctl_with_ref(fd, ioctls::KVM_INTERRUPT(), &arg) };
            if ret != 0 {
                return Err(Error::Kvm {
                    op: "KVM_INTERRUPT",
                    source: vmm_sys_util::errno::Error::last(),
                });
            }
            irqs.take(vcpu, vector);
            self.apic.start_service(vector);
            self.lead.injected(vector, &shared.memory);
            // More pending: come back as soon as the guest can take one.
            fd.get_kvm_run().request_interrupt_window = u8::from(irqs.pending(vcpu) != [0; 4]);
        }
        Ok(())
    }

    fn left_guest(&mut self) {
        // It ran: the policy undoes what it did for it (a boost ends).
        self.shared.irqs.scheduler().left_guest(self.vcpu);
        if let Some(lead) = self
            .lead
            .learn(&self.shared.memory, &self.shared.stats.delivery)
        {
            self.timer.set_lead(lead);
            // The halt's own look at the deadline moves with the lead, as
            // `due_now` does: a stale one would end halts that find no work.
            self.publish_due();
        }
        if let Some(poll) = &mut self.guest_poll {
            poll.learn(&self.shared.memory);
        }
    }

    /// Waits, polling or blocked as the halt-poll policy says, until an
    /// interrupt can be delivered, the timer fires (its thread's expiry, or
    /// its deadline seen while polling), a stop or a pause.
    fn halt(&mut self) -> bool {
        let vcpu = self.vcpu;
        loop {
            // Published before the look for work (see `crate::irq`).
            self.shared.irqs.scheduler().halted(vcpu);
            let timer_due = self.due_now();
            let irqs = &self.shared.irqs;
            let work = timer_due
                || self.apic.deliverable(&irqs.pending(vcpu)).is_some()
                || self.timer.has_due(&self.shared, vcpu);
            if work || self.shared.stop_requested() || self.shared.moving.pause.requested() {
                irqs.scheduler().woken(vcpu);
                return work;
            }
            self.poller.halt();
            self.shared.irqs.scheduler().woken(vcpu);
        }
    }

    /// Takes a timer expiry its thread delivered first, so that it is
    /// pending in the state rather than in flight.
    fn save(&mut self, _: &VcpuFd) -> Result<ChipState, Error> {
        if let Some(expiry) = self.timer.take_due(&self.shared, self.vcpu) {
            self.timer.receive(&expiry);
            self.fire_timer();
        }
        Ok(ChipState::User {
            apic: self.apic.save(MonotonicClock.now_ns()),
            irr: self.shared.irqs.pending(self.vcpu),
        })
    }

    fn restore(&mut self, state: &ChipState) -> Result<(), Error> {
        let ChipState::User { apic, irr } = state else {
            return Err(Error::ChipMismatch(self.vcpu as u32));
        };
        self.reanchor();
        self.apic.restore(apic, MonotonicClock.now_ns());
        self.publish_apic_state();
        for vector in (0..=255u8).filter(|&v| irr[usize::from(v / 64)] & (1 << (v % 64)) != 0) {
            self.shared.irqs.post_local(self.vcpu, vector);
        }
        self.rearm();
        Ok(())
    }

    /// Nothing to add: the poller and the host timer count into the VM's
    /// statistics as they go.
    fn finish(&mut self) -> Result<(), Error> {
        Ok(())
    }
}

impl ApicExits for UserIrqChip {
    fn read_msr(&mut self, index: u32) -> Option<u64> {
        let pending = self.shared.irqs.pending(self.vcpu);
        self.apic
            .read(index, &pending, MonotonicClock.now_ns())
            .ok()
    }

    fn write_msr(&mut self, index: u32, value: u64) -> bool {
        self.reanchor();
        match self.apic.write(index, value, MonotonicClock.now_ns()) {
            Ok(action) => {
                self.apply(action);
                true
            }
            Err(_) => false,
        }
    }

    fn read_apic_mmio(&mut self, addr: u64, data: &mut [u8]) -> bool {
        if !in_xapic_page(addr) {
            return false;
        }
        let pending = self.shared.irqs.pending(self.vcpu);
        let now = MonotonicClock.now_ns();
        self.apic
            .mmio_read_bytes(addr - XAPIC_BASE, data, &pending, now);
        true
    }

    fn write_apic_mmio(&mut self, addr: u64, data: &[u8]) -> bool {
        if !in_xapic_page(addr) {
            return false;
        }
        self.reanchor();
        let now = MonotonicClock.now_ns();
        let action = self.apic.mmio_write_bytes(addr - XAPIC_BASE, data, now);
        self.apply(action);
        true
    }

    fn waiting(&mut self) {
        self.shared.irqs.scheduler().waiting(self.vcpu);
    }

    fn yield_to(&mut self, target: usize) {
        let ctx = self.shared.irqs.scheduler().ctx();
        vcpu_sched::pv_yield_to(&ctx, self.vcpu, target);
    }
}

impl UserIrqChip {
    /// Whether the LVT timer's delivery is due already (its deadline is
    /// within the lead of now): a deadline the guest wrote in the past, or
    /// one that came due while the vCPU ran. The vCPU thread fires it itself
    /// at entry, as KVM fires a past TSC deadline at once instead of arming
    /// an hrtimer, rather than through the host timer's wake-up. (Deadlines
    /// just ahead still go through the host timer, whose wake-ups the advance
    /// learns from.)
    /// The clock is read only when a deadline is armed: this runs before
    /// every entry.
    fn due_now(&mut self) -> bool {
        let lead = self.lead.current().as_nanos() as u64;
        self.apic
            .timer()
            .next_expiry_ns()
            .is_some_and(|at| at <= MonotonicClock.now_ns().saturating_add(lead))
    }

    /// Refreshes the guest-time mapping of the timer and the lead from a
    /// fresh (TSC, clock) pair, before a deadline is armed or checked.
    fn reanchor(&mut self) {
        let time = self.clock.now();
        self.apic.timer().set_guest_time(time);
        self.lead.set_guest_time(time);
    }

    /// Tells the VM which IPIs reach this vCPU now (after an SVR or
    /// IA32_APIC_BASE write, a restore).
    fn publish_apic_state(&self) {
        let (enabled, x2apic) = (self.apic.enabled(), self.apic.x2apic());
        self.shared.irqs.set_apic_state(self.vcpu, enabled, x2apic);
    }

    /// Does what an APIC register write asks beyond the register: send an
    /// IPI, or re-arm the timer.
    fn apply(&mut self, action: Action) {
        self.publish_apic_state();
        match action {
            Action::Ipi { vector, to } => {
                self.shared.irqs.ipi(self.vcpu, vector, to);
            }
            // Due already: the next entry fires it (`due_now`), so the timer
            // thread must not fire it again.
            Action::TimerChanged if self.due_now() => {
                let _ = self.timer.disarm();
            }
            Action::TimerChanged => self.rearm(),
            Action::Eoi | Action::None => {}
        }
    }

    /// Fires the LVT timer if it is due `lead` from now (delivery starts that
    /// early, and the guest's entry runs that much later), and re-arms it.
    fn fire_timer(&mut self) {
        self.reanchor();
        let start = MonotonicClock.now_ns();
        let now = start + self.lead.current().as_nanos() as u64;
        if let Some(fired) = self.apic.timer().expire(now).filter(|f| f.deliver) {
            self.shared.irqs.post_local(self.vcpu, fired.vector);
            self.lead.fired(fired.vector, fired.due_ns, start);
        }
        self.rearm();
    }

    /// Tells the halt's wake source when to wake for the LVT timer's next
    /// expiry: when its delivery starts (its deadline less the lead, when
    /// `due_now` turns true), or earlier where the host timer fires earlier
    /// and nothing else wakes the vCPU (see [`HostTimer::wake_at`]).
    fn publish_due(&mut self) {
        let lead = self.lead.current().as_nanos() as u64;
        let wake = (self.apic.timer().next_delivery_ns())
            .map(|at| self.timer.wake_at(at.saturating_sub(lead)));
        self.poller.source().set_due(wake);
    }

    /// Arms the host timer for the LVT timer's next expiry, or disarms it.
    fn rearm(&mut self) {
        // A host timer that cannot be set is out of the guest's reach and of
        // ours: the timer then fires at the next exit instead (prepare_entry
        // checks). A masked timer delivers nothing, so it needs no host timer:
        // its expiries are spent at the next entry (`due_now`) or when it is
        // unmasked.
        let _ = match self.apic.timer().next_delivery_ns() {
            Some(at) => self.timer.arm(at),
            None => self.timer.disarm(),
        };
        self.publish_due();
    }
}

/// Whether an MMIO access is to the xAPIC page: the local APIC answers it
/// whatever its size (see [`LocalApic::mmio_read_bytes`]).
fn in_xapic_page(addr: u64) -> bool {
    (XAPIC_BASE..XAPIC_BASE + XAPIC_SIZE).contains(&addr)
}

/// The guest's TSC against the host's `CLOCK_MONOTONIC`: the frequency KVM
/// gives the guest (`KVM_GET_TSC_KHZ`) and the offset between guest and
/// host TSC, read once; [`GuestClock::now`] pairs a fresh TSC reading with the
/// clock, so conversions never drift far from an anchor.
struct GuestClock {
    tsc_khz: u64,
    offset: i64,
}

impl GuestClock {
    fn new(fd: &VcpuFd) -> Self {
        const IA32_TSC: u32 = 0x10;
        let tsc_khz = fd
            .get_tsc_khz()
            .map(u64::from)
            .unwrap_or_else(|_| TscClock::shared().tsc_khz());
        let mut msrs = kvm_bindings::Msrs::from_entries(&[kvm_bindings::kvm_msr_entry {
            index: IA32_TSC,
            ..Default::default()
        }])
        .expect("one entry fits");
        let offset = match fd.get_msrs(&mut msrs) {
            Ok(1) => msrs.as_slice()[0].data.wrapping_sub(rdtsc()) as i64,
            _ => 0,
        };
        Self { tsc_khz, offset }
    }

    fn now(&self) -> GuestTime {
        GuestTime {
            tsc_khz: self.tsc_khz,
            ns: MonotonicClock.now_ns(),
            tsc_at_ns: rdtsc().wrapping_add_signed(self.offset),
        }
    }
}
