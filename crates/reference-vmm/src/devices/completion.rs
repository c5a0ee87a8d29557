//! The completion device, on KVM's irqchip: a Firecracker-style device
//! thread. A vCPU submits an "I/O" by writing its index to
//! [`COMPLETION_PORT`]; an ioeventfd per vCPU (matching the index) takes
//! the write in KVM, with no exit. The device thread waits on them all
//! (epoll) and completes each by writing the submitter's irqfd, routed
//! (`KVM_SET_GSI_ROUTING`) as an MSI of [`COMPLETION_VECTOR`] to its APIC,
//! through vcpu-sched ([`Scheduler::deliver`], the target from
//! [`IrqTargets`]), so that the boost policy can act on a target its
//! interrupt finds waiting for a CPU. A vCPU's next submission tells
//! vcpu-sched it ran ([`Scheduler::ran`]): a boost its last completion gave
//! it ends there.
//!
//! [`Scheduler::deliver`]: vcpu_sched::Scheduler::deliver
//! [`Scheduler::ran`]: vcpu_sched::Scheduler::ran

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::thread::{self, JoinHandle};

use kvm_bindings::{
    KVM_IRQ_ROUTING_IRQCHIP, KVM_IRQ_ROUTING_MSI, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER,
    KVM_IRQCHIP_PIC_SLAVE, KvmIrqRouting, kvm_irq_routing_entry,
};
use kvm_ioctls::{IoEventAddress, VmFd};
use test_guests::abi::{COMPLETION_PORT, COMPLETION_VECTOR};
use vcpu_sched::{Delivery, GsiRoute, IrqTargets, MsiMessage};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::error::Error;
use crate::irq::VmScheduler;

/// The first GSI of the completion interrupts (vCPU `v`'s is this + `v`),
/// past the 24 that KVM's PIC and IOAPIC pins take.
pub const COMPLETION_GSI_BASE: u32 = 24;

/// What the device did, and what `deliver` found its targets doing.
#[derive(Debug, Default)]
pub struct CompletionStats {
    /// I/Os completed (interrupts raised through an irqfd).
    pub completions: AtomicU64,
    /// Targets waiting for a CPU (handed to the boost policy).
    pub preempted: AtomicU64,
    /// Targets on a CPU.
    pub running: AtomicU64,
    /// Targets asleep (halted in KVM, not yet woken).
    pub asleep: AtomicU64,
}

/// The device and its thread; see the [module docs](self).
#[derive(Debug)]
pub struct CompletionDevice {
    stop: EventFd,
    thread: JoinHandle<Result<(), std::io::Error>>,
    /// What it did.
    pub stats: Arc<CompletionStats>,
}

/// What a failed KVM call was.
fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { op, source }
}

fn io(thread: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::SpawnHelper { thread, source }
}

impl CompletionDevice {
    /// Routes the completion GSIs, registers each vCPU's ioeventfd and
    /// irqfd on `vm` (with KVM's irqchip), and starts the device thread.
    pub fn start(vm: &VmFd, vcpus: u32, sched: Arc<VmScheduler>) -> Result<Self, Error> {
        let targets = route(vm, vcpus)?;
        let epoll = Epoll::new().map_err(io("completion device"))?;
        let stop = EventFd::new(libc::EFD_NONBLOCK).map_err(io("completion device"))?;
        let watch = |fd: &EventFd, data: u64| {
            let event = EpollEvent::new(EventSet::IN, data);
            epoll.ctl(
                ControlOperation::Add,
                std::os::fd::AsRawFd::as_raw_fd(fd),
                event,
            )
        };
        watch(&stop, u64::MAX).map_err(io("completion device"))?;
        let mut lines = Vec::new();
        for v in 0..vcpus {
            let submitted = EventFd::new(libc::EFD_NONBLOCK).map_err(io("completion device"))?;
            let irqfd = EventFd::new(libc::EFD_NONBLOCK).map_err(io("completion device"))?;
            vm.register_ioevent(&submitted, &IoEventAddress::Pio(COMPLETION_PORT.into()), v)
                .map_err(kvm("KVM_IOEVENTFD"))?;
            vm.register_irqfd(&irqfd, COMPLETION_GSI_BASE + v)
                .map_err(kvm("KVM_IRQFD"))?;
            watch(&submitted, u64::from(v)).map_err(io("completion device"))?;
            lines.push((submitted, irqfd));
        }
        let stats = Arc::new(CompletionStats::default());
        let device = Device {
            epoll,
            lines,
            targets,
            sched,
            stats: stats.clone(),
        };
        let thread = thread::Builder::new()
            .name("completion-device".into())
            .spawn(move || device.serve())
            .map_err(io("completion device"))?;
        Ok(Self {
            stop,
            thread,
            stats,
        })
    }

    /// Stops the device thread.
    pub fn finish(self) -> Result<Arc<CompletionStats>, Error> {
        self.stop.write(1).map_err(io("completion device"))?;
        match self.thread.join() {
            Ok(served) => served.map_err(io("completion device"))?,
            Err(_) => return Err(Error::ThreadPanicked("completion device")),
        }
        Ok(self.stats)
    }
}

/// The device thread's state.
struct Device {
    epoll: Epoll,
    /// Each vCPU's submission ioeventfd and completion irqfd.
    lines: Vec<(EventFd, EventFd)>,
    targets: IrqTargets,
    sched: Arc<VmScheduler>,
    stats: Arc<CompletionStats>,
}

impl Device {
    /// Completes every submission until the stop event.
    fn serve(self) -> Result<(), std::io::Error> {
        let mut events = vec![EpollEvent::default(); self.lines.len() + 1];
        loop {
            let n = match self.epoll.wait(-1, &mut events) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                other => other?,
            };
            for event in &events[..n] {
                let Some((submitted, irqfd)) = self.lines.get(event.data() as usize) else {
                    return Ok(()); // the stop event
                };
                let v = event.data() as u32;
                // The submitter ran: a boost its last completion gave it ends.
                self.sched.ran(v as usize);
                for _ in 0..submitted.read()? {
                    self.complete(v, irqfd)?;
                }
            }
        }
    }

    /// Raises the completion on vCPU `v`'s GSI through `irqfd`, through the
    /// scheduler, which acts on what its target was doing.
    fn complete(&self, v: u32, irqfd: &EventFd) -> Result<(), std::io::Error> {
        let s = &self.stats;
        s.completions.fetch_add(1, Relaxed);
        let Ok(target) = self.targets.gsi(COMPLETION_GSI_BASE + v) else {
            return irqfd.write(1);
        };
        let (raised, delivery) = self.sched.deliver(target, || irqfd.write(1));
        match delivery {
            Delivery::Preempted { .. } => &s.preempted,
            Delivery::Running => &s.running,
            _ => &s.asleep,
        }
        .fetch_add(1, Relaxed);
        raised
    }
}

/// Sets the VM's GSI routing: KVM's default (GSIs 0-15 to the PIC and the
/// IOAPIC, 16-23 to the IOAPIC), and an MSI of [`COMPLETION_VECTOR`] to
/// vCPU `v`'s APIC on GSI [`COMPLETION_GSI_BASE`] + `v`. Returns the same
/// routes for [`IrqTargets`].
fn route(vm: &VmFd, vcpus: u32) -> Result<IrqTargets, Error> {
    let mut entries = Vec::new();
    for gsi in 0..COMPLETION_GSI_BASE {
        entries.push(irqchip_pin(gsi, KVM_IRQCHIP_IOAPIC, gsi));
        if gsi < 16 {
            let pic = if gsi < 8 {
                KVM_IRQCHIP_PIC_MASTER
            } else {
                KVM_IRQCHIP_PIC_SLAVE
            };
            entries.push(irqchip_pin(gsi, pic, gsi % 8));
        }
    }
    let mut targets = IrqTargets::identity(vcpus as usize);
    for v in 0..vcpus {
        let msg = MsiMessage::new(0xfee0_0000 | v << 12, 0, u32::from(COMPLETION_VECTOR));
        let gsi = COMPLETION_GSI_BASE + v;
        let mut entry = kvm_irq_routing_entry {
            gsi,
            type_: KVM_IRQ_ROUTING_MSI,
            ..Default::default()
        };
        entry.u.msi.address_lo = msg.address as u32;
        entry.u.msi.address_hi = (msg.address >> 32) as u32;
        entry.u.msi.data = msg.data;
        entries.push(entry);
        targets.set_route(gsi, GsiRoute::Msi(msg));
    }
    // At most 24 + 16 + MAX_VCPUS routes, far under KVM_MAX_IRQ_ROUTES.
    let table = KvmIrqRouting::from_entries(&entries)
        .map_err(|_| kvm("KVM_SET_GSI_ROUTING")(kvm_ioctls::Error::new(libc::E2BIG)))?;
    vm.set_gsi_routing(&table)
        .map_err(kvm("KVM_SET_GSI_ROUTING"))?;
    Ok(targets)
}

/// A route from `gsi` to pin `pin` of KVM's `chip`.
fn irqchip_pin(gsi: u32, chip: u32, pin: u32) -> kvm_irq_routing_entry {
    let mut entry = kvm_irq_routing_entry {
        gsi,
        type_: KVM_IRQ_ROUTING_IRQCHIP,
        ..Default::default()
    };
    entry.u.irqchip.irqchip = chip;
    entry.u.irqchip.pin = pin;
    entry
}
