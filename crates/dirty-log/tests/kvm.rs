//! Every backend on `/dev/kvm`: a CPL3 guest writes known pseudo-random pages
//! between harvests, and each harvest must hold every page written (exactly
//! them, except the first manual-protect harvest with INITIALLY_SET, which
//! reports every page); and a pre-copy of a guest that keeps writing must end
//! byte-for-byte equal to the guest's memory.
//!
//! The guest is x86-64 code: on other hosts `tests/other_arch.rs` says so.
#![cfg(target_arch = "x86_64")]

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use dirty_log::{
    DirtyLimit, DirtyLog, DirtyRate, DirtySet, DirtyStats, KvmBitmap, KvmDirtyRing,
    KvmManualProtect, ManualConfig, RingFull, Slots, copy_round, copy_round_pipelined,
    enable_dirty_ring,
};
use kvm_ioctls::VcpuFd;
use vm_memory::{Bytes, GuestAddress};
use writer_vm::{DATA_ADDR, Memory, PAGE, Stop, Writer, WriterVm, Xorshift, run};

#[path = "support/kvm.rs"]
mod writer_vm;

const DATA_BYTES: u64 = 16 << 20;
const RING_BYTES: u32 = 1 << 20;
const DATA_SLOT: u32 = 1;

#[derive(Clone, Copy, Debug)]
enum Backend {
    Bitmap,
    Manual { initially_set: bool },
    Ring,
}

const ALL: [Backend; 4] = [
    Backend::Bitmap,
    Backend::Manual {
        initially_set: false,
    },
    Backend::Manual {
        initially_set: true,
    },
    Backend::Ring,
];

/// Whether `/dev/kvm` can be opened. Where it cannot the test fails, or
/// with `VM_LATENCY_ALLOW_NO_KVM=1` skips, saying so.
fn kvm_available() -> bool {
    writer_vm::kvm_available()
}

struct Setup {
    vm: WriterVm,
    log: Box<dyn DirtyLog + Send>,
    ring: Option<RingFull>,
    vcpus: Vec<VcpuFd>,
    manual: Option<KvmManualProtect>,
}

/// A VM with `writers.len()` vCPUs, each writing its own half of the data.
fn setup(backend: Backend, writers: &[Writer]) -> Setup {
    let ring_bytes = matches!(backend, Backend::Ring).then_some(RING_BYTES);
    let vm = WriterVm::new(DATA_BYTES, false, |vm| {
        if let Some(bytes) = ring_bytes {
            enable_dirty_ring(vm, bytes)?;
        }
        Ok(())
    })
    .unwrap();
    let share = vm.data_pages() / writers.len() as u64;
    let vcpus: Vec<VcpuFd> = writers
        .iter()
        .enumerate()
        .map(|(i, w)| vm.vcpu(i as u64, *w, i as u64 * share, share).unwrap())
        .collect();
    let slots = vm.slots().unwrap();
    let (mut log, ring, manual): (Box<dyn DirtyLog + Send>, _, _) = match backend {
        Backend::Bitmap => (
            Box::new(KvmBitmap::new(&*vm.vm, slots).unwrap()),
            None,
            None,
        ),
        Backend::Manual { initially_set } => {
            let mut config = ManualConfig::default();
            config.initially_set = initially_set;
            let log = KvmManualProtect::new(&*vm.vm, slots, config).unwrap();
            (Box::new(log), None, None)
        }
        Backend::Ring => {
            let log = KvmDirtyRing::new(&*vm.vm, slots, RING_BYTES).unwrap();
            for (i, v) in vcpus.iter().enumerate() {
                log.attach(i, v).unwrap();
            }
            let full = log.full_handler();
            (Box::new(log), Some(full), None)
        }
    };
    log.enable().unwrap();
    Setup {
        vm,
        log,
        ring,
        vcpus,
        manual,
    }
}

/// Runs `vcpu` to the end of its next round, draining full rings on the way.
fn round(vcpu: &mut VcpuFd, ring: Option<&RingFull>) -> u64 {
    loop {
        match run(vcpu).unwrap() {
            Stop::Round(n) => return n,
            Stop::RingFull => ring.expect("only ring VMs fill rings").drain(0).unwrap(),
        }
    }
}

fn data_pages_of(set: &DirtySet) -> BTreeSet<u64> {
    let bitmap = set.get(DATA_SLOT).unwrap();
    bitmap
        .runs()
        .flat_map(|(first, n)| first..first + n)
        .collect()
}

#[test]
fn every_backend_harvests_exactly_the_written_pages() {
    if !kvm_available() {
        return;
    }
    const WRITES: u64 = 300;
    for backend in ALL {
        let seeds = [0x1234_5678_9abc_def1u64, 0x0fed_cba9_8765_4321];
        let writers: Vec<Writer> = seeds
            .iter()
            .map(|&seed| Writer::Random {
                seed,
                writes_per_round: WRITES,
            })
            .collect();
        let mut s = setup(backend, &writers);
        let share = s.vm.data_pages() / 2;
        let mut streams: Vec<Xorshift> = seeds
            .iter()
            .map(|&seed| Xorshift::new(seed, share))
            .collect();
        for r in 0..4 {
            let mut expected = BTreeSet::new();
            for (i, vcpu) in s.vcpus.iter_mut().enumerate() {
                assert_eq!(round(vcpu, s.ring.as_ref()), r);
                let base = i as u64 * share;
                expected.extend(streams[i].by_ref().take(WRITES as usize).map(|p| base + p));
            }
            // The VMM's own write (a device's DMA, say) must show up too.
            let vmm_page = 7 + r;
            s.vm.memory
                .write_obj(r, GuestAddress(DATA_ADDR + vmm_page * PAGE))
                .unwrap();
            expected.insert(vmm_page);
            let mut set = DirtySet::for_slots(s.log.slots());
            s.log.harvest(&mut set).unwrap();
            let got = data_pages_of(&set);
            if r == 0
                && matches!(
                    backend,
                    Backend::Manual {
                        initially_set: true
                    }
                )
            {
                assert_eq!(
                    got.len() as u64,
                    s.vm.data_pages(),
                    "INITIALLY_SET: all pages first"
                );
            } else {
                let missing: Vec<_> = expected.difference(&got).collect();
                let extra: Vec<_> = got.difference(&expected).collect();
                assert!(
                    missing.is_empty() && extra.is_empty(),
                    "{backend:?} round {r}: missing {missing:?}, extra {extra:?}"
                );
            }
        }
        s.log.disable().unwrap();
    }
}

/// Copies `run` of guest memory into `dest` (an image of the data slot).
fn copy_into(
    memory: &Memory,
    dest: &mut [u8],
    run: dirty_log::CopyRun,
) -> Result<(), dirty_log::Error> {
    if run.slot.id != DATA_SLOT {
        return Ok(());
    }
    let offset = (run.first_page * PAGE) as usize;
    memory
        .read_slice(
            &mut dest[offset..offset + run.len()],
            GuestAddress(run.guest_addr()),
        )
        .map_err(|e| dirty_log::Error::Config(e.to_string()))
}

#[test]
fn a_pre_copy_of_a_writing_guest_ends_byte_for_byte_equal() {
    if !kvm_available() {
        return;
    }
    for (backend, pipelined) in ALL.into_iter().map(|b| (b, false)).chain([(
        Backend::Manual {
            initially_set: true,
        },
        true,
    )]) {
        let writers = [
            Writer::Random {
                seed: 3,
                writes_per_round: 500,
            },
            Writer::Random {
                seed: 5,
                writes_per_round: 500,
            },
        ];
        let mut s = setup(backend, &writers);
        if pipelined {
            let slots = s.vm.slots().unwrap();
            let mut manual =
                KvmManualProtect::new(&*s.vm.vm, slots, ManualConfig::default()).unwrap();
            s.log.disable().unwrap();
            manual.enable().unwrap();
            s.manual = Some(manual);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let rounds: Arc<Vec<AtomicU64>> =
            Arc::new(s.vcpus.iter().map(|_| AtomicU64::new(0)).collect());
        let threads: Vec<_> = s
            .vcpus
            .drain(..)
            .enumerate()
            .map(|(index, mut vcpu)| {
                let (stop, ring, rounds) = (stop.clone(), s.ring.clone(), rounds.clone());
                thread::spawn(move || {
                    while !stop.load(Ordering::SeqCst) {
                        round(&mut vcpu, ring.as_ref());
                        rounds[index].fetch_add(1, Ordering::SeqCst);
                    }
                })
            })
            .collect();
        let mut dest = vec![0u8; DATA_BYTES as usize];
        s.vm.memory
            .read_slice(&mut dest, GuestAddress(DATA_ADDR))
            .unwrap();
        let memory = s.vm.memory.clone();
        let mut pass = |s: &mut Setup| match &s.manual {
            Some(manual) => {
                copy_round_pipelined(manual, |r| copy_into(&memory, &mut dest, r)).unwrap()
            }
            None => copy_round(s.log.as_mut(), |r| copy_into(&memory, &mut dest, r)).unwrap(),
        };
        // Copy while the guest writes: at least 5 passes, and until every
        // vCPU has written through two passes' worth of rounds (on 2 busy
        // cores a vCPU thread may not have been scheduled yet).
        let (mut copied, mut passes) = (0, 0);
        let deadline = Instant::now() + Duration::from_secs(20);
        let all_wrote = || rounds.iter().all(|r| r.load(Ordering::SeqCst) >= 2);
        while passes < 5 || !all_wrote() || copied == 0 {
            assert!(
                Instant::now() < deadline,
                "the guest never wrote while we copied"
            );
            copied += pass(&mut s);
            passes += 1;
        }
        stop.store(true, Ordering::SeqCst);
        threads.into_iter().for_each(|t| t.join().unwrap());
        pass(&mut s); // the final round, with every vCPU out of KVM_RUN
        let mut image = vec![0u8; DATA_BYTES as usize];
        s.vm.memory
            .read_slice(&mut image, GuestAddress(DATA_ADDR))
            .unwrap();
        let differing = image.iter().zip(&dest).filter(|(a, b)| a != b).count();
        assert_eq!(
            differing, 0,
            "{backend:?} (pipelined: {pipelined}): {differing} bytes differ"
        );
    }
}

#[test]
fn misuse_and_bad_configuration_are_errors_not_panics() {
    if !kvm_available() {
        return;
    }
    let vm = WriterVm::new(4 << 20, false, |vm| {
        let too_small = enable_dirty_ring(vm, 1000).unwrap_err();
        assert!(
            too_small.to_string().contains("power of two"),
            "{too_small}"
        );
        Ok(())
    })
    .unwrap();
    let slots = || vm.slots().unwrap();
    let mut log = KvmBitmap::new(&*vm.vm, slots()).unwrap();
    let mut set = DirtySet::for_slots(log.slots());
    assert!(matches!(
        log.harvest(&mut set),
        Err(dirty_log::Error::Enabled(false))
    ));
    log.enable().unwrap();
    assert!(matches!(log.enable(), Err(dirty_log::Error::Enabled(true))));
    log.disable().unwrap();
    assert!(matches!(
        log.disable(),
        Err(dirty_log::Error::Enabled(false))
    ));
    let mut bad_chunk = ManualConfig::default();
    bad_chunk.chunk_bytes = 100 << 10;
    assert!(KvmManualProtect::new(&*vm.vm, slots(), bad_chunk).is_err());
    assert!(
        Slots::from_memory_with_ids(&vm.memory, &[0]).is_err(),
        "two regions, one id"
    );
}

/// What passed for success and lost the guest's writes: a ring backend
/// with no ring attached, slots never registered (enabling logging would
/// have created them), a ring-full exit with nothing to collect.
#[test]
fn misuse_that_would_lose_writes_is_a_named_error() {
    if !kvm_available() {
        return;
    }
    let vm = WriterVm::new(4 << 20, false, |vm| {
        enable_dirty_ring(vm, RING_BYTES)?;
        Ok(())
    })
    .unwrap();
    let vcpu = vm.vcpu(0, Writer::Sequential, 0, 16).unwrap();
    let mut unattached = KvmDirtyRing::new(&*vm.vm, vm.slots().unwrap(), RING_BYTES).unwrap();
    assert!(matches!(unattached.enable(), Err(dirty_log::Error::NoRing)));
    let ring = KvmDirtyRing::new(&*vm.vm, vm.slots().unwrap(), RING_BYTES).unwrap();
    ring.attach(0, &vcpu).unwrap();
    let full = ring.full_handler();
    // vCPU 1's ring was never attached; vCPU 0's, empty, may have been
    // reset by a harvest just before its exit, but not twice with no reset.
    let nothing = |e| matches!(e, Err(dirty_log::Error::NothingToCollect { .. }));
    assert!(nothing(full.drain(1)));
    assert!(full.drain(0).is_ok());
    assert!(nothing(full.drain(0)));
    // The VMM registered the memory itself and did not say so.
    let unsaid = Slots::from_memory(&vm.memory).unwrap();
    assert!(!unsaid.has_owner());
    let mut bitmap = KvmBitmap::new(&*vm.vm, unsaid).unwrap();
    let e = bitmap.enable().unwrap_err();
    assert!(matches!(e, dirty_log::Error::NotRegistered), "{e}");
    assert!(e.to_string().contains("Slots::owned_by"), "{e}");
    let mut no_stall = ManualConfig::default();
    no_stall.max_stall = Duration::ZERO;
    let e = KvmManualProtect::new(&*vm.vm, vm.slots().unwrap(), no_stall).unwrap_err();
    assert!(e.to_string().contains("max_stall of 0"), "{e}");
    // A ring larger than the VM's, and a VM with none: touching the pages
    // past KVM's ring would raise SIGBUS.
    let larger = KvmDirtyRing::new(&*vm.vm, vm.slots().unwrap(), RING_BYTES * 2).unwrap();
    let e = larger.attach(0, &vcpu).unwrap_err();
    assert!(
        matches!(e, dirty_log::Error::RingNotEnabled { vcpu: 0, .. }),
        "{e}"
    );
    let plain = WriterVm::new(4 << 20, false, |_| Ok(())).unwrap();
    let vcpu = plain.vcpu(0, Writer::Sequential, 0, 16).unwrap();
    let never = KvmDirtyRing::new(&*plain.vm, plain.slots().unwrap(), RING_BYTES).unwrap();
    let e = never.attach(0, &vcpu).unwrap_err();
    assert!(
        e.to_string().contains("enable_dirty_ring with that size"),
        "{e}"
    );
}

/// Resets a vCPU thread makes on a full ring are in the backend's events
/// before any harvest.
#[test]
fn resets_on_a_full_ring_are_counted_where_they_run() {
    if !kvm_available() {
        return;
    }
    // A one-page ring (256 entries) fills in the first round of 4096 pages.
    const SMALL_RING: u32 = 4096;
    let vm = WriterVm::new(DATA_BYTES, false, |vm| {
        enable_dirty_ring(vm, SMALL_RING)?;
        Ok(())
    })
    .unwrap();
    let pages = vm.data_pages();
    let mut vcpu = vm.vcpu(0, Writer::Sequential, 0, pages).unwrap();
    let stats = Arc::new(DirtyStats::default());
    let mut log =
        KvmDirtyRing::with_events(&*vm.vm, vm.slots().unwrap(), SMALL_RING, stats.clone()).unwrap();
    log.attach(0, &vcpu).unwrap();
    let full = log.full_handler();
    log.enable().unwrap();
    assert!(matches!(run(&mut vcpu).unwrap(), Stop::RingFull));
    full.drain(0).unwrap();
    assert_eq!(stats.reset_calls.load(Ordering::Relaxed), 1);
    assert!(stats.reset_ns.load(Ordering::Relaxed) > 0);
    assert_eq!(
        stats.pages_harvested.load(Ordering::Relaxed),
        0,
        "no harvest yet"
    );
}

#[test]
fn a_slow_clear_shrinks_the_chunk_so_no_single_call_stalls_long() {
    if !kvm_available() {
        return;
    }
    let vm = WriterVm::new(DATA_BYTES, false, |_| Ok(())).unwrap();
    let mut config = ManualConfig::default();
    config.initially_set = true;
    config.chunk_bytes = 4 << 20;
    config.max_stall = std::time::Duration::from_nanos(1);
    let mut log = KvmManualProtect::new(&*vm.vm, vm.slots().unwrap(), config).unwrap();
    assert_eq!(log.chunk_pages(), 1024);
    log.enable().unwrap();
    let dirty = log.get(1).unwrap();
    assert_eq!(dirty.count(), vm.data_pages(), "INITIALLY_SET");
    let mut progress = Vec::new();
    log.clear(1, &dirty, |page| progress.push(page)).unwrap();
    assert_eq!(log.chunk_pages(), 64, "every call was over the bound");
    assert!(
        progress.windows(2).all(|w| w[0] < w[1]),
        "cleared in page order"
    );
    assert_eq!(progress.last(), Some(&vm.data_pages()));
    assert!(
        log.get(1).unwrap().is_clean(),
        "everything cleared, nothing written since"
    );
}

/// A vCPU writing flat out on the ring, measured by `DirtyRate` from the
/// ring's per-vCPU counts (harvested at each full ring, as a pre-copy
/// round would), then held by `DirtyLimit` to a quarter of that rate by
/// pauses at its ring-full exits: its rate falls to at most half.
#[test]
fn a_dirty_limit_slows_a_writer_through_its_ring_full_exits() {
    if !kvm_available() {
        return;
    }
    // 1024 entries: the limit acts at each full ring, so a small one lets it
    // settle early in the phase, however slowly a busy host runs the writer.
    const RING: u32 = 16 << 10;
    let vm = WriterVm::new(DATA_BYTES, false, |vm| {
        enable_dirty_ring(vm, RING)?;
        Ok(())
    })
    .unwrap();
    let mut vcpu = vm.vcpu(0, Writer::Sequential, 0, vm.data_pages()).unwrap();
    let mut log = KvmDirtyRing::new(&*vm.vm, vm.slots().unwrap(), RING).unwrap();
    log.attach(0, &vcpu).unwrap();
    let full = log.full_handler();
    log.enable().unwrap();
    let mut harvested = DirtySet::for_slots(log.slots());
    let start = Instant::now();
    let mut rate = DirtyRate::new(1, Duration::from_millis(50));
    let mut limit = DirtyLimit::new(1, f64::INFINITY).with_max_pause(Duration::from_secs(1));
    let pages = || full.pages_by_vcpu()[0].1;
    // Runs the writer for `phase`, pausing as the limit says at each full
    // ring; returns its pages per second over the phase's second half.
    let mut run_for = |phase: Duration, limit: &mut DirtyLimit| {
        let end = Instant::now() + phase;
        let mut from = None;
        while Instant::now() < end {
            if run(&mut vcpu).unwrap() != Stop::RingFull {
                continue;
            }
            full.drain(0).unwrap();
            log.harvest(&mut harvested).unwrap();
            rate.observe(start.elapsed(), &[pages()]).unwrap();
            limit.update(rate.rates()).unwrap();
            thread::sleep(limit.pause(0));
            if from.is_none() && Instant::now() + phase / 2 >= end {
                from = Some((Instant::now(), pages()));
            }
        }
        let (at, count) = from.expect("the ring filled in the phase's second half");
        (pages() - count) as f64 / at.elapsed().as_secs_f64()
    };
    let free = run_for(Duration::from_millis(400), &mut limit);
    assert_eq!(limit.pause(0), Duration::ZERO, "no limit, no pause");
    limit.set_target(free / 4.0);
    let held = run_for(Duration::from_millis(1200), &mut limit);
    eprintln!(
        "free {free:.0} pages/s, held to {:.0}: {held:.0}",
        free / 4.0
    );
    assert!(
        held > 0.0 && held <= free / 2.0,
        "free {free:.0}, held {held:.0}"
    );
    assert!(limit.pause(0) > Duration::ZERO);
}
