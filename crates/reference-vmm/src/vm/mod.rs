//! A VM: guest memory with the boot structures, vCPUs and devices, ready to
//! run a guest program ([`Vm::run`], in `run.rs`).

mod config;
mod description;
pub(crate) mod pause;
mod run;

pub use config::{Boot, VmConfig};
pub use description::VmDescription;
pub use pause::PauseError;
pub use run::{Controller, RunControl};

use std::sync::Arc;

use kvm_bindings::KVM_MAX_CPUID_ENTRIES;
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use vm_memory::{Bytes, GuestAddress};

use crate::CpuFeatures;
use crate::apic::{MSR_APIC_BASE, MSR_TSC_DEADLINE};
use crate::devices::PioDevice;
use crate::duty_cycle::VcpuPauses;
use crate::error::{ConfigError, Error};
use crate::irqchip;
use crate::irqchip::ChipState;
use crate::memory::VmMemory;
use crate::policies::Irqchip;
use crate::stop::StopHandle;
use crate::vcpu::state::StateSupport;
use test_guests::GuestProgram;
use test_guests::boot_memory;
use test_guests::layout::{
    GDT_ADDR, PARAMS, PARAMS_OFFSET, PML4_ADDR, SHARED_DATA_ADDR, check_mem_mib, check_vcpus,
    idt_addr, tss_addr,
};
use test_guests::x86::boot::{
    VcpuBootInfo, advertise_apic_features, long_mode_sregs, pvh_sregs, set_apic_id,
};
use test_guests::x86::gdt::build_gdt;
use test_guests::x86::idt::IDT_SIZE;

/// A VM ready to run a guest program: memory, boot structures and vCPUs set up.
pub struct Vm {
    /// As built: an image's vCPUs, memory and parameters in place of the
    /// configuration's.
    config: VmConfig,
    vcpus: Vec<VcpuFd>,
    vm: Arc<VmFd>,
    memory: VmMemory,
    stop: StopHandle,
    devices: Vec<(u16, u16, Arc<dyn PioDevice>)>,
    domain: Arc<rcu_qs::Domain>,
    ring_full: Option<dirty_log::RingFull>,
    dirty_pauses: Arc<VcpuPauses>,
    state_support: Arc<StateSupport>,
    /// The vCPUs' MAXPHYADDR, as their CPUID reports it.
    phys_bits: u8,
    /// The CPU features the guest is given.
    cpu_features: CpuFeatures,
    controller: Option<Controller>,
    /// Each vCPU's interrupt controller state and halt, from a stream.
    incoming: Option<Vec<(ChipState, bool)>>,
}

impl Vm {
    /// Creates the VM on `/dev/kvm`.
    pub fn new(config: &VmConfig) -> Result<Self, Error> {
        config.check()?;
        let (vcpus, mem_mib, params) = config.machine();
        let kvm = Kvm::new().map_err(Error::OpenKvm)?;
        let kvm_max = u32::try_from(kvm.get_max_vcpus()).unwrap_or(u32::MAX);
        let vcpus = check_vcpus(vcpus, kvm_max).map_err(ConfigError::from)?;
        let mem_size = check_mem_mib(mem_mib).map_err(ConfigError::from)? << 20;
        let vm = kvm.create_vm().map_err(kvm_err("KVM_CREATE_VM"))?;
        if let Some(bytes) = config.dirty_ring {
            dirty_log::enable_dirty_ring(&vm, bytes)?;
        }
        let memory = VmMemory::from_ranges(&[(GuestAddress(0), mem_size as usize)])
            .map_err(Error::AllocateMemory)?;
        register_memory(&vm, &memory)?;
        match config.irqchip {
            Irqchip::User => route_apic_msrs_to_userspace(&vm)?,
            Irqchip::Kernel => {
                vm.create_irq_chip()
                    .map_err(kvm_err("KVM_CREATE_IRQCHIP"))?;
                irqchip::set_window(&vm, config.kvm_halt_poll)?;
            }
        }
        match &config.boot {
            Boot::Direct => write_boot_structures(&memory, vcpus, mem_size)?,
            Boot::Image(image) => {
                image.load(&memory)?;
            }
            Boot::Incoming => {}
        }
        if config.boot != Boot::Incoming {
            write_params(&memory, &params)?;
        }
        let state_support = Arc::new(StateSupport::query(&kvm)?);
        let mut cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err("KVM_GET_SUPPORTED_CPUID"))?;
        let cpu_features = guest_features(&mut cpuid, config.cpu_features)?;
        let vcpu_fds = (0..vcpus)
            .map(|i| create_vcpu(&vm, &cpuid, i, vcpus, config))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            config: VmConfig {
                vcpus,
                mem_mib,
                params,
                ..config.clone()
            },
            vcpus: vcpu_fds,
            vm: Arc::new(vm),
            memory,
            stop: StopHandle::default(),
            devices: Vec::new(),
            domain: Arc::new(rcu_qs::Domain::new()),
            ring_full: None,
            dirty_pauses: Arc::new(VcpuPauses::new(vcpus as usize)),
            state_support,
            phys_bits: test_guests::x86::boot::phys_bits(&cpuid),
            cpu_features,
            controller: None,
            incoming: None,
        })
    }

    /// Runs `controller` on a thread of its own once the vCPUs have started
    /// (a migration: the `migration` crate's `Migration::run`); the run waits for
    /// it before it returns.
    pub fn on_start(&mut self, controller: Controller) {
        self.controller = Some(controller);
    }

    /// Each vCPU's interrupt-controller state and whether it was halted, by
    /// index, for a VM created with [`Boot::Incoming`] whose KVM state is
    /// restored already (the `migration` crate's `receive`).
    pub fn set_incoming(&mut self, vcpus: Vec<(ChipState, bool)>) {
        self.incoming = Some(vcpus);
    }

    /// Guest memory, shared with the VM (for a scenario to read results).
    pub fn memory(&self) -> VmMemory {
        self.memory.clone()
    }

    /// Guest memory as dirty-log slots (region i as slot i), as this VM
    /// registered them: what a dirty-log backend tracks.
    pub fn dirty_slots(&self) -> Result<dirty_log::Slots, dirty_log::Error> {
        let slots = dirty_log::Slots::from_memory(&self.memory)?;
        // SAFETY: `Vm::new` registered region i of this memory as slot i
        // with no flags (`register_memory`), and the VM and its vCPU threads
        // keep it mapped.
        unsafe { slots.assume_registered(&*self.vm) }
    }

    /// The VM, for dirty logging.
    pub fn vm_fd(&self) -> Arc<VmFd> {
        self.vm.clone()
    }

    /// The vCPUs, for attaching dirty rings.
    pub fn vcpu_fds(&self) -> &[VcpuFd] {
        &self.vcpus
    }

    /// What vCPU threads do on `KVM_EXIT_DIRTY_RING_FULL`: drain the rings.
    pub fn set_ring_full(&mut self, handler: dirty_log::RingFull) {
        self.ring_full = Some(handler);
    }

    /// Each vCPU's dirty ring, bytes, if the VM has one
    /// ([`VmConfig::dirty_ring`]).
    pub fn dirty_ring_bytes(&self) -> Option<u32> {
        self.config.dirty_ring
    }

    /// Each vCPU's duty cycle, which its thread takes at its exits: a
    /// controller (a migration's dirty limit) sets it while the VM runs.
    pub fn dirty_pauses(&self) -> Arc<VcpuPauses> {
        self.dirty_pauses.clone()
    }

    /// The RCU domain whose readers the vCPU threads will be: a writer may
    /// wait for grace periods on it while the VM runs.
    pub fn rcu_domain(&self) -> Arc<rcu_qs::Domain> {
        self.domain.clone()
    }

    /// A handle that stops the run from another thread (on a signal, say).
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// Adds `device` at ports `base..base + len` for the run.
    pub fn add_device(&mut self, base: u16, len: u16, device: Arc<dyn PioDevice>) {
        self.devices.push((base, len, device));
    }

    /// What a migration's destination needs to create this VM.
    fn description(&self, program: &GuestProgram) -> VmDescription {
        let tsc_khz = self
            .vcpus
            .first()
            .and_then(|fd| fd.get_tsc_khz().ok())
            .unwrap_or_else(|| lapic_timer::TscClock::shared().tsc_khz() as u32);
        VmDescription {
            program: program.name.to_owned(),
            vcpus: self.vcpus.len() as u32,
            mem_mib: self.config.mem_mib,
            params: self.config.params,
            irqchip: self.config.irqchip,
            min_timer_period_ns: self.config.min_timer_period.as_nanos() as u64,
            tsc_khz,
            cpu_features: self.cpu_features,
            msrs: self.state_support.msrs().to_vec(),
        }
    }

    /// What KVM on this host lets a vCPU's saved state carry.
    pub fn state_support(&self) -> &StateSupport {
        &self.state_support
    }
}

fn kvm_err(op: &'static str) -> impl Fn(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { op, source }
}

fn write_params(memory: &VmMemory, params: &[u64; PARAMS]) -> Result<(), Error> {
    let bytes: Vec<u8> = params.iter().flat_map(|p| p.to_le_bytes()).collect();
    memory
        .write_slice(&bytes, GuestAddress(SHARED_DATA_ADDR + PARAMS_OFFSET))
        .map_err(|source| Error::WriteMemory {
            what: "the program parameters",
            source,
        })
}

fn register_memory(vm: &VmFd, memory: &VmMemory) -> Result<(), Error> {
    let slots = dirty_log::Slots::from_memory(memory).map_err(Error::RegisterMemory)?;
    // SAFETY: `memory` stays mapped as long as the VM can run: the Vm and
    // then the vCPU threads' shared state hold it.
    unsafe { slots.register(vm) }
        .map(drop)
        .map_err(Error::RegisterMemory)
}

/// Writes the GDT, page tables, guest image, and each vCPU's TSS and IDT.
fn write_boot_structures(memory: &VmMemory, vcpus: u32, mem_size: u64) -> Result<(), Error> {
    for segment in boot_memory::segments(vcpus, mem_size) {
        memory
            .write_slice(&segment.bytes, GuestAddress(segment.addr))
            .map_err(|source| Error::WriteMemory {
                what: segment.what,
                source,
            })?;
    }
    Ok(())
}

/// x2APIC MSRs exit to userspace as invalid (there is no in-kernel APIC);
/// IA32_TSC_DEADLINE and IA32_APIC_BASE, which KVM would otherwise handle or
/// drop, are denied by the MSR filter so that they exit too.
fn route_apic_msrs_to_userspace(vm: &VmFd) -> Result<(), Error> {
    use kvm_bindings::{
        KVM_CAP_X86_USER_SPACE_MSR, KVM_MSR_EXIT_REASON_FILTER, KVM_MSR_EXIT_REASON_INVAL,
        kvm_enable_cap,
    };
    use kvm_ioctls::{MsrFilterDefaultAction, MsrFilterRange, MsrFilterRangeFlags};
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_X86_USER_SPACE_MSR,
        ..Default::default()
    };
    cap.args[0] = u64::from(KVM_MSR_EXIT_REASON_INVAL | KVM_MSR_EXIT_REASON_FILTER);
    vm.enable_cap(&cap)
        .map_err(kvm_err("KVM_ENABLE_CAP(X86_USER_SPACE_MSR)"))?;
    let deny = [0u8];
    let range = |base| MsrFilterRange {
        flags: MsrFilterRangeFlags::READ | MsrFilterRangeFlags::WRITE,
        base,
        msr_count: 1,
        bitmap: &deny,
    };
    vm.set_msr_filter(
        MsrFilterDefaultAction::ALLOW,
        &[range(MSR_TSC_DEADLINE), range(MSR_APIC_BASE)],
    )
    .map_err(kvm_err("KVM_X86_SET_MSR_FILTER"))
}

/// Makes `cpuid` (KVM's supported one) the guest's: the APIC features both
/// irqchips emulate, and no feature beyond `wanted`, which this host must
/// have every one of. Returns the guest's features.
fn guest_features(
    cpuid: &mut kvm_bindings::CpuId,
    wanted: Option<CpuFeatures>,
) -> Result<CpuFeatures, Error> {
    advertise_apic_features(cpuid);
    let Some(wanted) = wanted else {
        return Ok(CpuFeatures::from_cpuid(cpuid));
    };
    let missing = wanted.missing_from(&CpuFeatures::from_cpuid(cpuid));
    if !missing.is_empty() {
        return Err(ConfigError::MissingCpuFeatures(missing).into());
    }
    wanted.mask(cpuid);
    Ok(CpuFeatures::from_cpuid(cpuid))
}

fn create_vcpu(
    vm: &VmFd,
    cpuid: &kvm_bindings::CpuId,
    index: u32,
    count: u32,
    config: &VmConfig,
) -> Result<VcpuFd, Error> {
    let irqchip = config.irqchip;
    let fd = vm
        .create_vcpu(u64::from(index))
        .map_err(kvm_err("KVM_CREATE_VCPU"))?;
    if irqchip == Irqchip::Kernel {
        // KVM's LAPIC holds every vCPU but the first in wait-for-SIPI; these
        // guests start all vCPUs at their entry point, as the userspace one does.
        let runnable = kvm_bindings::kvm_mp_state {
            mp_state: kvm_bindings::KVM_MP_STATE_RUNNABLE,
        };
        fd.set_mp_state(runnable)
            .map_err(kvm_err("KVM_SET_MP_STATE"))?;
    }
    let mut cpuid = cpuid.clone();
    set_apic_id(&mut cpuid, index);
    advertise_apic_features(&mut cpuid);
    fd.set_cpuid2(&cpuid).map_err(kvm_err("KVM_SET_CPUID2"))?;
    let mut sregs = fd.get_sregs().map_err(kvm_err("KVM_GET_SREGS"))?;
    let gdt_len = build_gdt(count, tss_addr).len();
    let boot = VcpuBootInfo {
        index,
        gdt: (GDT_ADDR, (gdt_len - 1) as u16),
        idt: (idt_addr(index), (IDT_SIZE - 1) as u16),
        tss: tss_addr(index),
        cr3: PML4_ADDR,
    };
    match config.boot {
        Boot::Direct | Boot::Incoming => long_mode_sregs(&mut sregs, &boot),
        Boot::Image(_) => pvh_sregs(&mut sregs, boot.gdt),
    }
    fd.set_sregs(&sregs).map_err(kvm_err("KVM_SET_SREGS"))?;
    Ok(fd)
}
