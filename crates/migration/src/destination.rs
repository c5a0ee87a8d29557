//! The destination side: the VM created from the stream's description, its
//! memory written as page runs arrive, and each vCPU's KVM state restored,
//! all before the source is answered; the vCPU threads restore their
//! interrupt controllers when the VM runs.

use std::io::{Read, Write};
use std::time::Duration;

use vm_memory::bitmap::Bitmap;
use vm_memory::{Address as _, Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryRegion};

use super::image::read_image;
use super::postcopy::PostcopyPages;
use super::postcopy::pages::PageSet;
use super::stream::{Link, Record, StreamReader};
use super::{Connection, MigrationError, handover};
use reference_vmm::Irqchip;
use reference_vmm::VmMemory;
use reference_vmm::{Boot, Vm, VmConfig};
use reference_vmm::{ChipState, VcpuState, VmDescription};
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
    /// Post-copy: the pages the guest still lacks, registered; fetch them
    /// with [`Incoming::fetch`] once the source has committed, then run
    /// the VM. `None` for a guest that came whole.
    pub postcopy: Option<PostcopyPages>,
}

/// Reads a whole stream into a new VM. The stream gives the machine and
/// what its guest sees (vCPUs, memory, parameters, where the APICs live, the
/// timer period's floor); `config` gives the rest, the destination's own:
/// its policies, timer placement, RCU mode, KVM halt polling and timeout.
/// Nothing runs until the caller runs the VM, and the caller answers the
/// source (see [`super::answer`]) in between. The calling thread reads at
/// nice -10 where the process may raise it, and gets its own weight back
/// on return: at the switch-over it must not wait behind other tenants.
/// An incremental snapshot is refused: it restores after its base
/// ([`receive_chain`]); so is a post-copy stream, which comes on a
/// connection ([`receive_from`]).
pub fn receive<R: Read>(
    input: &mut StreamReader<R>,
    config: &VmConfig,
) -> Result<Incoming, MigrationError> {
    receive_chain(std::slice::from_mut(input), config)
}

/// A live migration's destination: [`receive`] from the source's
/// connection, and, for a post-copy stream, the source told once the VM is
/// made (its guest pauses only then, so that the VM's creation is not part
/// of the downtime).
pub fn receive_from(
    input: &mut StreamReader<Connection>,
    config: &VmConfig,
) -> Result<Incoming, MigrationError> {
    read_chain(std::slice::from_mut(input), config, handover::made)
}

/// Reads a full snapshot and the increments taken after it, in order, into
/// a new VM, as [`receive`] reads one stream: each increment's pages over
/// the memory so far, the vCPUs' state from the last. An increment that
/// does not follow the snapshot before it (its parent's id), or of another
/// VM, is refused, naming its place in the chain.
pub fn receive_chain<R: Read>(
    inputs: &mut [StreamReader<R>],
    config: &VmConfig,
) -> Result<Incoming, MigrationError> {
    read_chain(inputs, config, |_| {
        Err(std::io::ErrorKind::Unsupported.into())
    })
}

/// What tells a post-copy source that the VM is made: an error where the
/// input cannot.
type Made<R> = fn(&mut R) -> std::io::Result<()>;

fn read_chain<R: Read>(
    inputs: &mut [StreamReader<R>],
    config: &VmConfig,
    made: Made<R>,
) -> Result<Incoming, MigrationError> {
    let _favoured = super::favour::Favoured::this_thread();
    let (first, rest) = inputs
        .split_first_mut()
        .ok_or_else(|| MigrationError::Chain("no snapshot to restore".into()))?;
    let description = first.config()?;
    let program = guest::find(&description.program)
        .ok_or_else(|| MigrationError::UnknownGuest(description.program.clone()))?;
    let mut vm = create(&description, config)?;
    let memory = vm.memory();
    let mut applied = apply(first, &memory, made)?;
    if applied.link.is_some_and(|link| !link.is_full()) {
        return Err(MigrationError::Chain(
            "the first snapshot is an increment: give its base first".into(),
        ));
    }
    let chained = !rest.is_empty();
    for (place, input) in (2..).zip(rest) {
        if input.config()? != description {
            return Err(MigrationError::Chain(format!(
                "snapshot {place} is of another VM than snapshot 1"
            )));
        }
        let before = applied.link.map(|link| link.id);
        let next = apply(input, &memory, made)?;
        if before.is_none() || next.link.map(|link| link.parent) != before {
            return Err(MigrationError::Chain(format!(
                "snapshot {place} is not the increment taken after snapshot {}",
                place - 1
            )));
        }
        applied = Applied {
            pages: applied.pages + next.pages,
            ..next
        };
    }
    restore_vcpus(&vm, &description, &applied.states)?;
    let postcopy = match applied.postcopy {
        Some(_) if chained => {
            return Err(MigrationError::Chain(
                "a post-copy stream is no snapshot".into(),
            ));
        }
        Some((id, needed)) => Some(PostcopyPages::prepare(&memory, id, needed)?),
        None => None,
    };
    vm.set_incoming(
        applied
            .states
            .into_iter()
            .map(|s| (s.chip, s.halted))
            .collect(),
    );
    Ok(Incoming {
        vm,
        program,
        pages: applied.pages,
        postcopy,
    })
}

/// The VM `description` describes, with `config`'s mechanisms, created to
/// receive its memory and state.
fn create(description: &VmDescription, config: &VmConfig) -> Result<Vm, MigrationError> {
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
    let vm = Vm::new(&config).map_err(|e| MigrationError::Restore(Box::new(e)))?;
    let missing = vm.state_support().missing_msrs(&description.msrs);
    if !missing.is_empty() {
        return Err(MigrationError::MissingMsrs(missing));
    }
    Ok(vm)
}

/// What one stream brought: its pages written to memory, its vCPUs' states
/// by index, its place in a snapshot chain, and in post-copy the move's id
/// and the pages still to come.
struct Applied {
    pages: u64,
    states: Vec<VcpuState>,
    link: Option<Link>,
    postcopy: Option<(u64, PageSet)>,
}

/// Writes a stream's pages to `memory` as they come, to its End record.
fn apply<R: Read>(
    input: &mut StreamReader<R>,
    memory: &VmMemory,
    made: Made<R>,
) -> Result<Applied, MigrationError> {
    let mut applied = Applied {
        pages: 0,
        states: Vec::new(),
        link: None,
        postcopy: None,
    };
    let pages = (memory.last_addr().0 + 1) / PAGE_SIZE;
    let mut image = Vec::new();
    loop {
        match input.next_record()? {
            Record::Pages { gpa, data } => {
                memory.write_slice(&data, GuestAddress(gpa))?;
                applied.pages += data.len() as u64 / PAGE_SIZE;
            }
            Record::Zero { gpa, pages: n } => {
                zero_pages(memory, gpa, n)?;
                applied.pages += n;
            }
            Record::Vcpu(state) => applied.states.push(*state),
            Record::Chain(link) => applied.link = Some(link),
            Record::Postcopy(id) => {
                made(input.get_mut()).map_err(|e| match e.kind() {
                    std::io::ErrorKind::Unsupported => {
                        MigrationError::Stream(super::StreamError::Io(std::io::Error::new(
                            std::io::ErrorKind::InvalidData,
                            "a post-copy stream, which comes on a connection (receive_from)",
                        )))
                    }
                    _ => MigrationError::NotCommitted(format!(
                        "the source did not hear that the VM is made: {e}"
                    )),
                })?;
                applied.postcopy = Some((id, PageSet::new(pages)));
            }
            Record::Missing { gpa, pages: n } => {
                if let Some((_, needed)) = &mut applied.postcopy {
                    needed.insert_run(gpa / PAGE_SIZE, n);
                }
            }
            Record::Image { gpa, pages: n } => image.push((gpa, n * PAGE_SIZE)),
            Record::End => break,
        }
    }
    read_image(input, &image, |gpa, data| {
        memory.write_slice(data, GuestAddress(gpa))?;
        applied.pages += data.len() as u64 / PAGE_SIZE;
        Ok::<_, MigrationError>(())
    })?;
    applied.states.sort_by_key(|s| s.index);
    Ok(applied)
}

/// Sets each vCPU's KVM state from `states`, at the guest's TSC rate.
fn restore_vcpus(
    vm: &Vm,
    description: &VmDescription,
    states: &[VcpuState],
) -> Result<(), MigrationError> {
    let restore_error = |e| MigrationError::Restore(Box::new(e));
    for state in states {
        check_chip(state, description.irqchip)?;
        let fd = &vm.vcpu_fds()[state.index as usize];
        if fd.get_tsc_khz().ok() != Some(description.tsc_khz) {
            fd.set_tsc_khz(description.tsc_khz).map_err(|source| {
                restore_error(reference_vmm::Error::Kvm {
                    op: "KVM_SET_TSC_KHZ",
                    source,
                })
            })?;
        }
        state
            .restore(fd, description.tsc_khz)
            .map_err(restore_error)?;
    }
    Ok(())
}

/// The destination's half of the hand-over ([`handover`]): answers the
/// source (READY, or why not), waits for its commit (each read bounded by
/// the connection's timeout), and tells it the guest runs here. Only what
/// this returns `Ok` may run: a source that did not commit runs the guest
/// on, or lost it (see [`handover`]). The calling thread reads at nice -10
/// meanwhile, as [`receive`] does: the guest stands still, here and at the
/// source, until the commit is read.
///
/// # Errors
/// `received`'s error, after telling the source; or
/// [`MigrationError::NotCommitted`].
pub fn hand_over<C: Read + Write>(
    link: &mut C,
    received: Result<Incoming, MigrationError>,
) -> Result<Incoming, MigrationError> {
    let _favoured = super::favour::Favoured::this_thread();
    let incoming = match received {
        Ok(incoming) => incoming,
        Err(e) => {
            let _ = handover::answer(link, Err(&e.to_string()));
            return Err(e);
        }
    };
    handover::answer(link, Ok(()))
        .map_err(|e| MigrationError::NotCommitted(format!("the answer did not reach it: {e}")))?;
    handover::read_commit(link)?;
    handover::running(link);
    Ok(incoming)
}

/// Zeroes `pages` pages at `gpa`, writing only those an earlier record
/// wrote: memory's bitmap marks each page this VMM has written, and a fresh
/// VM's other pages read as zeros. Not reading them matters: a read would
/// fault each one in, which for a large guest's first pass is most of the
/// destination's CPU time, taken from whatever else runs on its host.
fn zero_pages(memory: &VmMemory, gpa: u64, pages: u64) -> Result<(), MigrationError> {
    for at in (0..pages).map(|i| GuestAddress(gpa + i * PAGE_SIZE)) {
        let written = memory
            .to_region_addr(at)
            .is_none_or(|(region, offset)| region.bitmap().dirty_at(offset.raw_value() as usize));
        if written {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Which of `memory`'s first `pages` pages are resident (mincore).
    fn resident(memory: &VmMemory, pages: usize) -> Vec<bool> {
        let host = memory.get_host_address(GuestAddress(0)).unwrap();
        let mut vec = vec![0u8; pages];
        // SAFETY: `host` starts a mapping of at least `pages` pages (the
        // caller's memory), and `vec` holds one byte per page.
        let rc =
            unsafe { libc::mincore(host.cast(), pages * PAGE_SIZE as usize, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().map(|b| b & 1 == 1).collect()
    }

    #[test]
    fn a_zero_run_clears_the_pages_written_before_and_leaves_the_rest_unmapped() {
        let memory = VmMemory::from_ranges(&[(GuestAddress(0), 16 * PAGE_SIZE as usize)]).unwrap();
        let written = GuestAddress(3 * PAGE_SIZE);
        memory
            .write_slice(&[0xa5; PAGE_SIZE as usize], written)
            .unwrap();
        zero_pages(&memory, 0, 16).unwrap();
        let mut page = [1u8; PAGE_SIZE as usize];
        memory.read_slice(&mut page, written).unwrap();
        assert!(
            page.iter().all(|&b| b == 0),
            "the page written before is zeros"
        );
        let unwritten: Vec<usize> = (0..16).filter(|&p| p != 3).collect();
        let mapped = resident(&memory, 16);
        assert!(
            unwritten.iter().all(|&p| !mapped[p]),
            "a zero run faulted in pages nothing wrote: {mapped:?}"
        );
    }

    #[test]
    fn a_zero_run_past_memory_is_an_error() {
        let memory = VmMemory::from_ranges(&[(GuestAddress(0), 4 * PAGE_SIZE as usize)]).unwrap();
        assert!(zero_pages(&memory, 3 * PAGE_SIZE, 2).is_err());
    }

    #[test]
    fn an_empty_chain_is_refused() {
        match receive_chain::<&[u8]>(&mut [], &VmConfig::default()) {
            Err(MigrationError::Chain(why)) => assert_eq!(why, "no snapshot to restore"),
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("restored nothing"),
        }
    }
}
