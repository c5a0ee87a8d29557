//! Memslots the VMM owns, on `/dev/kvm`: registered with
//! `KVM_SET_USER_MEMORY_REGION2` and flags of its own, logging switched only
//! through its `SlotOwner`, a subset of them tracked; a slot removed or grown
//! while tracked is an error. The guest is real-mode x86 code.
#![cfg(target_arch = "x86_64")]

use std::io;
use std::sync::Mutex;

use dirty_log::{DirtyLog, DirtySet, Error, KvmBitmap, PAGE_SIZE, Slot, SlotOwner, Slots};
use kvm_bindings::{
    KVM_MEM_LOG_DIRTY_PAGES, KVM_MEM_READONLY, kvm_userspace_memory_region,
    kvm_userspace_memory_region2,
};
use kvm_ioctls::{Cap, Kvm, VcpuExit, VcpuFd, VmFd};

/// Guest RAM with the code (slot 0, the VMM's, not tracked), a read-only
/// page (slot 1) and a writable one (slot 2, room for 128 pages).
const RAM: (u64, u64) = (0, 0x10000);
const READ_ONLY: (u64, u64) = (0x10000, PAGE_SIZE);
const WRITABLE: (u64, u64) = (0x20000, PAGE_SIZE);
const WRITABLE_ROOM: usize = 128 * PAGE_SIZE as usize;

/// `/dev/kvm` with `KVM_SET_USER_MEMORY_REGION2` and read-only memory, or
/// `None`: where it cannot be opened the test fails, or with
/// `VM_LATENCY_ALLOW_NO_KVM=1` skips, saying so; where it lacks either
/// capability the test skips, saying so.
fn kvm() -> Option<Kvm> {
    let skip = |why: String| {
        eprintln!("SKIPPED: {why}");
        if let Some(log) = std::env::var_os("SKIPPED_TESTS_LOG") {
            let line = format!("dirty-log::owned_slots: {why}\n");
            let _ = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .and_then(|mut f| io::Write::write_all(&mut f, line.as_bytes()));
        }
        None
    };
    let kvm = match Kvm::new() {
        Ok(kvm) => kvm,
        Err(e) if std::env::var_os("VM_LATENCY_ALLOW_NO_KVM").is_none_or(|v| v != "1") => {
            panic!("cannot open /dev/kvm ({e}); set VM_LATENCY_ALLOW_NO_KVM=1 to skip")
        }
        Err(e) => return skip(format!("cannot open /dev/kvm ({e})")),
    };
    for cap in [Cap::UserMemory2, Cap::ReadonlyMem] {
        if !kvm.check_extension(cap) {
            return skip(format!("this KVM lacks {cap:?}"));
        }
    }
    Some(kvm)
}

/// An anonymous mapping, unmapped on drop.
struct Mapping(*mut u8, usize);

impl Mapping {
    fn new(len: usize) -> Self {
        // SAFETY: a fresh anonymous private mapping; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Self(p.cast(), len)
    }

    fn addr(&self) -> u64 {
        self.0 as u64
    }

    fn byte(&self, at: usize) -> u8 {
        assert!(at < self.1);
        // SAFETY: in bounds of the mapping, which lives as long as `self`.
        unsafe { self.0.add(at).read_volatile() }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `new`.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}

/// The VMM's memslot table, as Cloud Hypervisor keeps one: each slot as it
/// registered it with `KVM_SET_USER_MEMORY_REGION2`, flags and all. Logging
/// is switched by registering the same region again with only
/// `KVM_MEM_LOG_DIRTY_PAGES` changed.
#[derive(Debug)]
struct VmmSlots {
    vm: &'static VmFd,
    regions: Mutex<Vec<kvm_userspace_memory_region2>>,
}

/// A VMM's owner is usually a handle to its table: here, a reference.
impl SlotOwner for &'static VmmSlots {
    fn set_dirty_logging(&self, slot: &Slot, on: bool) -> io::Result<()> {
        let mut regions = self.regions.lock().unwrap();
        let region = regions
            .iter_mut()
            .find(|r| r.slot == slot.id)
            .ok_or_else(|| io::Error::other(format!("the VMM has no slot {}", slot.id)))?;
        match on {
            true => region.flags |= KVM_MEM_LOG_DIRTY_PAGES,
            false => region.flags &= !KVM_MEM_LOG_DIRTY_PAGES,
        }
        // SAFETY: the same memory the VMM registered, still mapped.
        unsafe { self.vm.set_user_memory_region2(*region) }
            .map_err(|e| io::Error::from_raw_os_error(e.errno()))
    }
}

impl VmmSlots {
    fn flags(&self, id: u32) -> u32 {
        let regions = self.regions.lock().unwrap();
        regions.iter().find(|r| r.slot == id).unwrap().flags
    }

    /// Registers (or, with `bytes` 0, removes) slot `id` as the VMM would.
    fn set(&self, id: u32, flags: u32, (guest, bytes): (u64, u64), host: u64) {
        let region = kvm_userspace_memory_region2 {
            slot: id,
            flags,
            guest_phys_addr: guest,
            memory_size: bytes,
            userspace_addr: host,
            ..Default::default()
        };
        // SAFETY: the memory outlives the VM (the test keeps both).
        unsafe { self.vm.set_user_memory_region2(region) }.unwrap();
        let mut regions = self.regions.lock().unwrap();
        regions.retain(|r| r.slot != id);
        regions.push(region);
    }
}

/// A VM whose vCPU runs, in real mode at 0x1000: a write to the writable
/// page, a write to the read-only one (an MMIO exit), `hlt`. The VMM's
/// slots: 0 by `KVM_SET_USER_MEMORY_REGION`, 1 and 2 by `..._REGION2`.
fn vm(kvm: &Kvm) -> (&'static VmFd, VcpuFd, &'static VmmSlots, [Mapping; 3]) {
    let vm: &'static VmFd = Box::leak(Box::new(kvm.create_vm().unwrap()));
    let memory = [
        Mapping::new(RAM.1 as usize),
        Mapping::new(READ_ONLY.1 as usize),
        Mapping::new(WRITABLE_ROOM),
    ];
    #[rustfmt::skip]
    let code: [u8; 23] = [
        0xb8, 0x00, 0x20, 0x8e, 0xd8,       // mov ax, 0x2000; mov ds, ax
        0xc6, 0x06, 0x05, 0x00, 0x11,       // mov byte [5], 0x11: writable page
        0xb8, 0x00, 0x10, 0x8e, 0xd8,       // mov ax, 0x1000; mov ds, ax
        0xc6, 0x06, 0x00, 0x00, 0x22,       // mov byte [0], 0x22: read-only page
        0xf4, 0xeb, 0xfd,                   // hlt; jmp -3
    ];
    // SAFETY: 23 bytes at 0x1000 of the 64 KiB RAM mapping.
    unsafe { std::ptr::copy_nonoverlapping(code.as_ptr(), memory[0].0.add(0x1000), code.len()) };
    let region = kvm_userspace_memory_region {
        slot: 0,
        flags: 0,
        guest_phys_addr: RAM.0,
        memory_size: RAM.1,
        userspace_addr: memory[0].addr(),
    };
    // SAFETY: the memory outlives the VM (the caller keeps both).
    unsafe { vm.set_user_memory_region(region) }.unwrap();
    let slots: &'static VmmSlots = Box::leak(Box::new(VmmSlots {
        vm,
        regions: Mutex::new(Vec::new()),
    }));
    slots.set(1, KVM_MEM_READONLY, READ_ONLY, memory[1].addr());
    slots.set(2, 0, WRITABLE, memory[2].addr());
    let vcpu = vm.create_vcpu(0).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).unwrap();
    let regs = kvm_bindings::kvm_regs {
        rip: 0x1000,
        rflags: 2,
        ..Default::default()
    };
    vcpu.set_regs(&regs).unwrap();
    (vm, vcpu, slots, memory)
}

/// The three slots as dirty-log describes them, tracking 1 and 2 only.
fn tracked(memory: &[Mapping; 3], owner: &'static VmmSlots) -> Slots {
    let [ram, read_only, writable] = memory;
    Slots::new([
        Slot::new(0, RAM.0, ram.addr(), RAM.1).unwrap(),
        Slot::new(1, READ_ONLY.0, read_only.addr(), READ_ONLY.1).unwrap(),
        Slot::new(2, WRITABLE.0, writable.addr(), WRITABLE.1).unwrap(),
    ])
    .unwrap()
    .only(&[1, 2])
    .unwrap()
    .owned_by(owner)
}

#[test]
fn a_vmm_owned_slot_keeps_its_flags_while_a_subset_is_tracked() {
    let Some(kvm) = kvm() else { return };
    let (vm, mut vcpu, owner, memory) = vm(&kvm);
    let mut log = KvmBitmap::new(vm, tracked(&memory, owner)).unwrap();
    let ids: Vec<u32> = log.slots().iter().map(|s| s.id).collect();
    assert_eq!(ids, [1, 2], "slot 0 is the VMM's and untracked");
    log.enable().unwrap();
    assert_eq!(
        (owner.flags(1), owner.flags(2)),
        (
            KVM_MEM_READONLY | KVM_MEM_LOG_DIRTY_PAGES,
            KVM_MEM_LOG_DIRTY_PAGES
        ),
        "only the logging flag was added, through the VMM's own table"
    );
    // The read-only slot is still read-only in KVM while it logs: the
    // guest's write to it exits to the VMM and leaves the page as it was.
    match vcpu.run().unwrap() {
        VcpuExit::MmioWrite(addr, data) => assert_eq!((addr, data), (READ_ONLY.0, &[0x22][..])),
        other => panic!("expected the read-only page's MMIO write, got {other:?}"),
    }
    assert!(matches!(vcpu.run().unwrap(), VcpuExit::Hlt));
    assert_eq!((memory[1].byte(0), memory[2].byte(5)), (0, 0x11));
    let mut set = DirtySet::for_slots(log.slots());
    log.harvest(&mut set).unwrap();
    assert!(
        set.get(1).unwrap().is_clean(),
        "a read-only page is never dirty"
    );
    assert_eq!(set.get(2).unwrap().runs().collect::<Vec<_>>(), [(0, 1)]);
    assert!(set.get(0).is_none());
    log.disable().unwrap();
    assert_eq!(
        (owner.flags(1), owner.flags(2)),
        (KVM_MEM_READONLY, 0),
        "the VMM's flags are as it set them"
    );
}

#[test]
fn a_slot_removed_or_grown_while_tracked_fails_the_harvest() {
    let Some(kvm) = kvm() else { return };
    let (vm, _vcpu, owner, memory) = vm(&kvm);
    let mut log = KvmBitmap::new(vm, tracked(&memory, owner)).unwrap();
    log.enable().unwrap();
    let mut set = DirtySet::for_slots(log.slots());
    log.harvest(&mut set).unwrap();
    // The VMM removes slot 2 and registers it again, logging, 128 pages
    // long: KVM's bitmap for it is now two words, not one.
    owner.set(2, 0, (WRITABLE.0, 0), 0);
    let changed = |e: Result<(), Error>| matches!(e, Err(Error::SlotChanged { slot: 2, pages: 1 }));
    assert!(changed(log.harvest(&mut set)), "removed");
    let grown = (WRITABLE.0, WRITABLE_ROOM as u64);
    owner.set(2, KVM_MEM_LOG_DIRTY_PAGES, grown, memory[2].addr());
    let e = log.harvest(&mut set);
    assert!(changed(e), "grown: KVM's copy stopped at the guard page");
}
