//! A vCPU's host timer for its LAPIC timer, where [`TimerPlacement`](crate::TimerPlacement) puts it:
//! lapic-timer's `SignalTimer`, which signals the vCPU thread itself out of
//! `KVM_RUN` from the timer interrupt (`vcpu-thread`, as KVM's hrtimer kicks
//! its vCPU), or a `TimerThread` that hands each expiry to the vCPU through
//! the VM's interrupts and a kick (`vcpu-cpu`, `anywhere`).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use lapic_timer::{Clock, Expiry, MonotonicClock, SignalTimer, SpinAt, TimerThread};

use crate::error::Error;
use crate::kick;
use crate::shared::VmShared;

/// One vCPU's host timer; either way the vCPU thread spins to the target
/// ([`SpinAt::Receiver`]).
pub(super) enum HostTimer {
    /// Signals the vCPU thread (made on it, and kept there).
    Signal(SignalTimer),
    /// A timer thread whose expiries wait in the VM's interrupts.
    Thread(TimerThread),
}

impl HostTimer {
    /// vCPU `vcpu`'s host timer; call it on the vCPU's own thread.
    pub(super) fn start(tsc_khz: u64, shared: &Arc<VmShared>, vcpu: usize) -> Result<Self, Error> {
        let apic = &shared.apic;
        let policy = apic.policies.timer_advance(vcpu as u32, tsc_khz);
        let stats = shared.stats.timer.clone();
        let started = match apic.timer_placement.thread() {
            None => SignalTimer::new(policy, stats, kick::timer_signal()).map(Self::Signal),
            Some(placement) => TimerThread::start(
                policy,
                shared.irqs.timer_sink(vcpu),
                stats,
                SpinAt::Receiver,
            )
            .map(|t| Self::Thread(t.with_placement(placement))),
        };
        started.map_err(|source| Error::SpawnThread {
            vcpu: vcpu as u32,
            source,
        })
    }

    /// Arms the deadline `deadline_ns`, replacing any armed one.
    pub(super) fn arm(&mut self, deadline_ns: u64) -> io::Result<()> {
        match self {
            Self::Signal(t) => t.arm(deadline_ns, 0),
            Self::Thread(t) => t.arm(deadline_ns, 0),
        }
    }

    /// Disarms the deadline, if any.
    pub(super) fn disarm(&mut self) -> io::Result<()> {
        match self {
            Self::Signal(t) => t.disarm(),
            Self::Thread(t) => t.disarm(),
        }
    }

    /// Sets the delivery lead for deadlines armed from now on.
    pub(super) fn set_lead(&self, lead: Duration) {
        match self {
            Self::Signal(t) => t.set_lead(lead),
            Self::Thread(t) => t.set_lead(lead),
        }
    }

    /// The expiry the host timer has for vCPU `vcpu`, if its time has come.
    pub(super) fn take_due(&mut self, shared: &VmShared, vcpu: usize) -> Option<Expiry> {
        match self {
            Self::Signal(t) => t.take_due(),
            Self::Thread(_) => shared.irqs.take_timer(vcpu),
        }
    }

    /// Whether [`HostTimer::take_due`] has an expiry (a halted vCPU's look;
    /// the clock is read only where a signal timer is armed).
    pub(super) fn has_due(&self, shared: &VmShared, vcpu: usize) -> bool {
        match self {
            Self::Signal(t) => t
                .fire_at_ns()
                .is_some_and(|at| at <= MonotonicClock.now_ns()),
            Self::Thread(_) => shared.irqs.has_timer(vcpu),
        }
    }

    /// When a halted vCPU should wake for a delivery due at `delivery_ns`:
    /// then, where a timer thread's expiry (and its advance) wakes it early;
    /// at the armed host timer's time where nothing else will (the signal
    /// stays blocked outside `KVM_RUN`).
    pub(super) fn wake_at(&self, delivery_ns: u64) -> u64 {
        match self {
            Self::Signal(t) => t.fire_at_ns().map_or(delivery_ns, |at| at.min(delivery_ns)),
            Self::Thread(_) => delivery_ns,
        }
    }

    /// Where delivery starts: learns and spins to `expiry`'s target.
    pub(super) fn receive(&self, expiry: &Expiry) {
        match self {
            Self::Signal(t) => t.receive(expiry),
            Self::Thread(t) => t.receive(expiry),
        };
    }
}
