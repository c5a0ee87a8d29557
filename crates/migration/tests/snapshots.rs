//! Incremental snapshots on `/dev/kvm`: a full snapshot of a guest whose
//! memory is full, then an increment after the guest rewrote a tenth of
//! it. The increment's size against the base's (its pause is the bench's
//! `snapshot` scenario's); each restore
//! (the base alone, then the base and the increment) compared byte for
//! byte with the guest's memory when the last snapshot was taken, and the
//! chain run on to the guest's end, where it checks every page it wrote.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::fs::File;
use std::io::BufReader;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use common::kvm_available;
use migration::{
    DirtyLogBackend, MigrateOptions, MigrationError, MigrationReport, Mover, SnapshotKind,
    StreamReader, receive_chain,
};
use reference_vmm::{RunControl, Vm, VmConfig, VmMemory};
use test_guests::layout::{DIRTY_AREA_ADDR, PAGE_SIZE};
use vm_memory::{Bytes, GuestAddress};

const MEM_MIB: u64 = 128;
const VCPUS: u32 = 2;
/// A tenth of memory, split between the vCPUs: the pages the guest rewrites.
const PAGES_EACH: u64 = (MEM_MIB << 20) / PAGE_SIZE / 10 / VCPUS as u64;
/// What the VMM fills before the base, where the guest never writes: below
/// the guest's pages, and above them to the end of memory.
const FILLED: [(u64, u64); 2] = [(20 << 20, DIRTY_AREA_ADDR), (48 << 20, MEM_MIB << 20)];

/// The guest's memory and each snapshot's report, as each was taken.
struct Taken {
    base: (MigrationReport, Vec<u8>),
    increment: (MigrationReport, Vec<u8>),
}

fn config(backend: DirtyLogBackend) -> VmConfig {
    let ms = lapic_timer::TscClock::shared().tsc_khz();
    let options = MigrateOptions {
        backend,
        ..MigrateOptions::default()
    };
    let mut config = VmConfig {
        vcpus: VCPUS,
        mem_mib: MEM_MIB,
        dirty_ring: options.dirty_ring(),
        ..VmConfig::default()
    };
    // Its pages rewritten flat out, a 1 ms timer, 200 ms once the test
    // says the snapshots are done.
    config.params[..5].copy_from_slice(&[PAGES_EACH, 200 * ms, 0, ms, 1]);
    config
}

fn memory_bytes(memory: &VmMemory) -> Vec<u8> {
    let mut bytes = vec![0; (MEM_MIB << 20) as usize];
    memory.read_slice(&mut bytes, GuestAddress(0)).unwrap();
    bytes
}

/// Pauses the guest, takes a `kind` snapshot to `path` with a copy of its
/// memory first, and runs it on.
fn take(
    mover: &mut Mover,
    control: &RunControl,
    memory: &VmMemory,
    path: &Path,
    kind: SnapshotKind,
    before: impl FnOnce(),
) -> Result<(MigrationReport, Vec<u8>), MigrationError> {
    let states = control.pause(Duration::from_secs(10))?;
    before();
    let bytes = memory_bytes(memory);
    let report = mover.snapshot_paused(control, &states, path, kind);
    control.resume();
    Ok((report?, bytes))
}

/// The base once the guest wrote its pages (and the VMM the rest), the
/// increment once it rewrote them; then the guest runs to its end.
fn take_chain(
    mut mover: Mover,
    control: &RunControl,
    memory: &VmMemory,
    files: &[PathBuf; 4],
) -> Result<Taken, MigrationError> {
    std::thread::sleep(Duration::from_millis(300));
    let fill = || {
        for (start, end) in FILLED {
            let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i % 251) as u8 | 1).collect();
            for at in (start..end).step_by(PAGE_SIZE as usize) {
                memory.write_slice(&page, GuestAddress(at)).unwrap();
            }
        }
    };
    let base = take(
        &mut mover,
        control,
        memory,
        &files[0],
        SnapshotKind::Full,
        fill,
    )?;
    std::thread::sleep(Duration::from_millis(300));
    let increment = take(
        &mut mover,
        control,
        memory,
        &files[1],
        SnapshotKind::Incremental,
        || {},
    )?;
    // A second chain, of the running guest: a full snapshot ends the first.
    mover.snapshot(control, &files[2], SnapshotKind::Full)?;
    mover.snapshot(control, &files[3], SnapshotKind::Incremental)?;
    test_guests::abi::note_migration_ended(memory).unwrap();
    Ok(Taken { base, increment })
}

fn restored(files: &[PathBuf]) -> Result<migration::Incoming, MigrationError> {
    let mut inputs: Vec<_> = files
        .iter()
        .map(|f| StreamReader::new(BufReader::new(File::open(f).unwrap())).unwrap())
        .collect();
    receive_chain(&mut inputs, &VmConfig::default())
}

/// Why `files` do not restore, as a chain.
fn refused(files: &[PathBuf]) -> String {
    match restored(files) {
        Ok(_) => panic!("{files:?} restored"),
        Err(e) => e.to_string(),
    }
}

/// The first page where `got` differs from `want`, if any.
fn first_difference(got: &[u8], want: &[u8]) -> Option<u64> {
    let page = PAGE_SIZE as usize;
    (0..want.len() / page)
        .find(|&p| got[p * page..][..page] != want[p * page..][..page])
        .map(|p| p as u64)
}

fn a_chain_restores_byte_for_byte(backend: DirtyLogBackend) {
    let dir = std::env::temp_dir();
    let files = ["base", "increment", "second-base", "second-increment"]
        .map(|name| dir.join(format!("snapshots-{}-{backend}-{name}", std::process::id())));
    let mut vm = Vm::new(&config(backend)).unwrap();
    let memory = vm.memory();
    let mover = Mover::prepare(
        &mut vm,
        MigrateOptions {
            backend,
            ..MigrateOptions::default()
        },
    )
    .unwrap();
    let (done, taken) = mpsc::channel();
    let chain = files.clone();
    vm.on_start(Box::new(move |control| {
        drop(done.send(take_chain(mover, control, &memory, &chain)))
    }));
    let source = vm
        .run(
            test_guests::find("migrate").unwrap(),
            Box::new(std::io::sink()),
        )
        .unwrap();
    assert_eq!(
        source.value(0, "pages_checked"),
        Some(PAGES_EACH),
        "the source's guest"
    );
    let Taken { base, increment } = taken.recv().unwrap().unwrap();

    // Bytes on disk: each file holds a memory image with holes where the
    // snapshot has no page.
    let metadata = files.clone().map(|f| std::fs::metadata(f).unwrap());
    let sizes = metadata.clone().map(|m| m.blocks() * 512);
    assert!(
        metadata[1].len() >= MEM_MIB << 20,
        "the increment's image spans memory"
    );
    let second = restored(&files[2..]).unwrap();
    let run = second
        .vm
        .run(second.program, Box::new(std::io::sink()))
        .unwrap();
    assert_eq!(
        run.value(0, "pages_checked"),
        Some(PAGES_EACH),
        "the second chain"
    );
    eprintln!(
        "{backend}: base {} bytes on disk, {} pages in {:?}; increment {} bytes on disk ({} long), {} pages in {:?}",
        sizes[0],
        base.0.pages_sent,
        base.0.downtime,
        sizes[1],
        metadata[1].len(),
        increment.0.pages_sent,
        increment.0.downtime
    );
    assert!(
        sizes[1] * 100 <= sizes[0] * 15,
        "the increment is {} of the base's {} bytes",
        sizes[1],
        sizes[0]
    );

    let mixed = refused(&[files[0].clone(), files[3].clone()]);
    assert!(
        mixed.contains("snapshot 2 is not the increment taken after snapshot 1"),
        "{mixed}"
    );
    let alone = restored(&files[..1]).unwrap();
    assert_eq!(
        first_difference(&memory_bytes(&alone.vm.memory()), &base.1),
        None,
        "the base"
    );
    let chain = restored(&files[..2]).unwrap();
    assert_eq!(
        first_difference(&memory_bytes(&chain.vm.memory()), &increment.1),
        None,
        "the chain"
    );
    let run = chain
        .vm
        .run(chain.program, Box::new(std::io::sink()))
        .unwrap();
    for vcpu in 0..VCPUS {
        assert_eq!(
            run.value(vcpu, "pages_checked"),
            Some(PAGES_EACH),
            "vCPU {vcpu} restored"
        );
    }

    let wrong = refused(&[files[1].clone()]);
    assert!(wrong.contains("give its base first"), "{wrong}");
    let backwards = refused(&[files[0].clone(), files[0].clone()]);
    assert!(
        backwards.contains("snapshot 2 is not the increment taken after snapshot 1"),
        "{backwards}"
    );
    files.iter().for_each(|f| std::fs::remove_file(f).unwrap());
}

#[test]
fn a_chain_over_manual_protect_restores_byte_for_byte() {
    if kvm_available("a_chain_over_manual_protect_restores_byte_for_byte") {
        a_chain_restores_byte_for_byte(DirtyLogBackend::Manual);
    }
}

#[test]
fn a_chain_over_the_dirty_ring_restores_byte_for_byte() {
    if kvm_available("a_chain_over_the_dirty_ring_restores_byte_for_byte") {
        a_chain_restores_byte_for_byte(DirtyLogBackend::Ring);
    }
}

#[test]
fn a_chain_over_the_bitmap_restores_byte_for_byte() {
    if kvm_available("a_chain_over_the_bitmap_restores_byte_for_byte") {
        a_chain_restores_byte_for_byte(DirtyLogBackend::Bitmap);
    }
}
