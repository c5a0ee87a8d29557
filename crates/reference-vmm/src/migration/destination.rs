//! The destination side: the VM created from the stream's description, its
//! memory written as page runs arrive, and each vCPU's KVM state restored,
//! all before the source is answered; the vCPU threads restore their
//! interrupt controllers when the VM runs.

use std::io::Read;
use std::time::Duration;

use vm_memory::{Bytes, GuestAddress};

use super::stream::{Record, StreamReader, is_zero};
use super::{ChipState, MigrationError, VcpuState};
use crate::memory::VmMemory;
use crate::policies::Irqchip;
use crate::vm::{Boot, Vm, VmConfig};
use test_guests::layout::PAGE_SIZE;
use test_guests::programs::{self as guest, GuestProgram};

/// A VM received whole, ready to run its program where it left off.
pub struct Incoming {
    /// The VM, its memory written and its vCPUs' KVM state restored.
    pub vm: Vm,
    /// The program it runs.
    pub program: &'static GuestProgram,
    /// Pages received (a page sent in several rounds counts each time).
    pub pages: u64,
}

/// Reads a whole stream into a new VM. The stream gives the machine and
/// what its guest sees (vCPUs, memory, parameters, where the APICs live, the
/// timer period's floor); `config` gives the rest, the destination's own:
/// its policies, timer placement, RCU mode, KVM halt polling and timeout.
/// Nothing runs until the caller runs the VM, and the caller answers the
/// source (see [`super::answer`]) in between. The calling thread reads at
/// nice -10 where the process may raise it, and gets its own weight back
/// on return: at the switch-over it must not wait behind other tenants.
pub fn receive<R: Read>(
    input: &mut StreamReader<R>,
    config: &VmConfig,
) -> Result<Incoming, MigrationError> {
    let _favoured = super::favour::Favoured::this_thread();
    let description = input.config()?;
    let program = guest::find(&description.program)
        .ok_or_else(|| MigrationError::UnknownGuest(description.program.clone()))?;
    let config = VmConfig {
        vcpus: description.vcpus,
        mem_mib: description.mem_mib,
        params: description.params,
        boot: Boot::Incoming,
        dirty_ring: None,
        irqchip: description.irqchip,
        min_timer_period: Duration::from_nanos(description.min_timer_period_ns),
        cpu_features: Some(description.cpu_features),
        ..config.clone()
    };
    let restore_error = |e| MigrationError::Restore(Box::new(e));
    let mut vm = Vm::new(&config).map_err(restore_error)?;
    let missing = vm.state_support().missing_msrs(&description.msrs);
    if !missing.is_empty() {
        return Err(MigrationError::MissingMsrs(missing));
    }
    let memory = vm.memory();
    let mut states = Vec::new();
    let mut pages = 0;
    loop {
        match input.next_record()? {
            Record::Pages { gpa, data } => {
                memory.write_slice(&data, GuestAddress(gpa))?;
                pages += data.len() as u64 / PAGE_SIZE;
            }
            Record::Zero { gpa, pages: n } => {
                zero_pages(&memory, gpa, n)?;
                pages += n;
            }
            Record::Vcpu(state) => states.push(*state),
            Record::End => break,
        }
    }
    states.sort_by_key(|s| s.index);
    let irqchip = description.irqchip;
    for state in &states {
        check_chip(state, irqchip)?;
        let fd = &vm.vcpu_fds()[state.index as usize];
        if fd.get_tsc_khz().ok() != Some(description.tsc_khz) {
            fd.set_tsc_khz(description.tsc_khz).map_err(|source| {
                restore_error(crate::Error::Kvm {
                    op: "KVM_SET_TSC_KHZ",
                    source,
                })
            })?;
        }
        state
            .restore(fd, description.tsc_khz)
            .map_err(restore_error)?;
    }
    vm.set_incoming(states.into_iter().map(|s| (s.chip, s.halted)).collect());
    Ok(Incoming { vm, program, pages })
}

/// Zeroes `pages` pages at `gpa`, writing only those that are not zero
/// already: a fresh VM's memory reads as zeros without being allocated,
/// and stays so.
fn zero_pages(memory: &VmMemory, gpa: u64, pages: u64) -> Result<(), MigrationError> {
    let mut page = [0u8; PAGE_SIZE as usize];
    for at in (0..pages).map(|i| GuestAddress(gpa + i * PAGE_SIZE)) {
        memory.read_slice(&mut page, at)?;
        if !is_zero(&page) {
            memory.write_slice(&[0; PAGE_SIZE as usize], at)?;
        }
    }
    Ok(())
}

fn check_chip(state: &VcpuState, irqchip: Irqchip) -> Result<(), MigrationError> {
    match (&state.chip, irqchip) {
        (ChipState::Kernel(_), Irqchip::Kernel) | (ChipState::User { .. }, Irqchip::User) => Ok(()),
        _ => Err(MigrationError::ChipMismatch {
            vcpu: state.index,
            irqchip,
        }),
    }
}
