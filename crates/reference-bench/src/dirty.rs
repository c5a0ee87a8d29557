//! `reference-bench dirty`: `dirty_log_perf_test` on the reference VMM's own guest,
//! for each dirty-log backend: vCPUs write every page of their part of
//! memory once per pass, and the VMM harvests between passes.

use std::io;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use dirty_log::DirtyStats;
use dirty_log::perf::{self, Mode, RING_BYTES, Tracker};

use crate::Error;
use crate::{Cell, Options, Table};
use reference_vmm::devices::PioDevice;
use reference_vmm::{Vm, VmConfig};
use test_guests::abi::GATE_PORT;
use test_guests::layout::{DIRTY_AREA_ADDR, PAGE_SIZE};
use test_guests::programs as guest;

/// vCPUs, MiB each, passes after the populating one (without `--quick`).
const VCPUS: u32 = 2;
const MIB_PER_VCPU: u64 = 256;
const ITERATIONS: usize = 4;
/// How long the controller waits for the guest at the gate before giving up.
const GATE_TIMEOUT: Duration = Duration::from_secs(120);

/// Holds each vCPU after a pass until the controller opens the next one.
#[derive(Default)]
struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    arrived: usize,
    generation: u64,
    /// Opened for good: the controller is gone.
    open: bool,
    /// The run is over: nobody will arrive any more.
    closed: bool,
}

impl PioDevice for Gate {
    fn read(&self, _: u16, data: &mut [u8]) {
        data.fill(0);
    }

    /// A vCPU finished a pass: wait for the next.
    fn write(&self, _: u16, _: &[u8]) -> io::Result<()> {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = s.generation;
        s.arrived += 1;
        self.changed.notify_all();
        while s.generation == generation && !s.open {
            s = self.changed.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }
}

impl Gate {
    /// Waits until `vcpus` have arrived.
    fn wait_for(&self, vcpus: usize) -> Result<(), dirty_log::Error> {
        let deadline = Instant::now() + GATE_TIMEOUT;
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while s.arrived < vcpus {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || s.closed {
                return Err(dirty_log::Error::Worker(
                    "the guest never reached the gate".into(),
                ));
            }
            s = self
                .changed
                .wait_timeout(s, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        Ok(())
    }

    /// Starts the next pass.
    fn release(&self) {
        let mut s = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        s.arrived = 0;
        s.generation += 1;
        self.changed.notify_all();
    }

    /// The run ended: wakes a controller that waits for arrivals.
    fn close(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .closed = true;
        self.changed.notify_all();
    }

    /// Lets every vCPU through from now on.
    fn open(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .open = true;
        self.changed.notify_all();
    }
}

/// Runs the scenario: every mode in one run.
pub fn run(opts: Options, progress: &mut dyn FnMut(&str)) -> Result<Table, Error> {
    let mib = if opts.quick { 32 } else { MIB_PER_VCPU };
    let iterations = if opts.quick { 2 } else { ITERATIONS };
    let mut t = Table::new(
        format!(
            "dirty: dirty_log_perf_test, {VCPUS} vCPUs x {mib} MiB, {iterations} iterations, 4 KiB pages"
        ),
        &perf::COLUMNS,
    );
    for mode in Mode::ALL {
        progress(&format!("dirty: {}", mode.name()));
        let row = measure(mode, mib, iterations)?;
        t.row(row.cells(mode).into_iter().map(Cell::text).collect());
    }
    t.note("Better: shorter times. One run per mode: times, not ratios, as dirty_log_perf_test prints them.");
    t.note("Each vCPU writes every page of its part once per pass and stops at a gate port; the VMM harvests (and for the pipelined mode clears on a worker thread) between passes. Iteration N is the mean of passes 2 onwards; for the ring, get is collecting entries on the harvest thread, clear is KVM_RESET_DIRTY_RINGS, and drains on a full ring happen on the vCPU threads, inside their pass.".to_string());
    Ok(t)
}

fn measure(mode: Mode, mib: u64, iterations: usize) -> Result<perf::Row, Error> {
    let pages = (mib << 20) / PAGE_SIZE;
    let mut config = VmConfig {
        vcpus: VCPUS,
        mem_mib: ((DIRTY_AREA_ADDR >> 20) + u64::from(VCPUS) * mib + 2).next_multiple_of(2),
        timeout: Some(Duration::from_secs(600)),
        dirty_ring: (mode == Mode::Ring).then_some(RING_BYTES),
        ..VmConfig::default()
    };
    config.params[0] = pages;
    config.params[1] = iterations as u64 + 1;
    let mut vm = Vm::new(&config)?;
    let gate = Arc::new(Gate::default());
    vm.add_device(GATE_PORT, 1, gate.clone());
    let stats = Arc::new(DirtyStats::default());
    let slots = vm.dirty_slots()?;
    let vcpus: Vec<_> = vm.vcpu_fds().iter().collect();
    let (mut tracker, ring) = Tracker::new(mode, &*vm.vm_fd(), slots, stats.clone(), &vcpus)?;
    if let Some(ring) = ring {
        vm.set_ring_full(ring);
    }
    let controller = {
        let gate = gate.clone();
        thread::spawn(move || {
            let mut started = Instant::now();
            let mut first = true;
            let result = perf::measure(mode, &mut tracker, &stats, iterations, || {
                if !first {
                    started = Instant::now();
                    gate.release();
                }
                first = false;
                gate.wait_for(VCPUS as usize)?;
                Ok(started.elapsed())
            });
            gate.open(); // the last pass ends; nothing may wait any more
            result
        })
    };
    let program = guest::find("dirty-writer").expect("built in");
    let run = vm.run(program, Box::new(io::sink()));
    gate.close(); // a controller still waiting gives up: the run is over
    let row = controller
        .join()
        .map_err(|_| Error::ThreadPanicked("dirty-log controller"));
    run?; // the run's own error explains a controller's first
    Ok(row??)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dirty_log::{DirtyLog, DirtySet, KvmBitmap, KvmDirtyRing};

    /// Every page each vCPU wrote in a pass is in the harvest after it, with
    /// the bitmap and with a dirty ring small enough to fill many times a pass.
    #[test]
    fn every_pass_harvests_every_written_page() {
        match kvm_ioctls::Kvm::new() {
            Ok(_) => {}
            Err(e) if std::env::var_os("VM_LATENCY_ALLOW_NO_KVM").is_some_and(|v| v == "1") => {
                eprintln!("SKIPPED every_pass_harvests_every_written_page: /dev/kvm: {e}");
                return;
            }
            Err(e) => panic!("cannot open /dev/kvm ({e}); set VM_LATENCY_ALLOW_NO_KVM=1 to skip"),
        }
        for ring in [None, Some(4096)] {
            check_passes(ring);
        }
    }

    fn check_passes(ring_bytes: Option<u32>) {
        const PAGES: u64 = 1024;
        const PASSES: u64 = 3;
        let mut config = VmConfig {
            vcpus: 2,
            timeout: Some(Duration::from_secs(60)),
            dirty_ring: ring_bytes,
            ..VmConfig::default()
        };
        config.params[0] = PAGES;
        config.params[1] = PASSES;
        let mut vm = Vm::new(&config).unwrap();
        let gate = Arc::new(Gate::default());
        vm.add_device(GATE_PORT, 1, gate.clone());
        let slots = vm.dirty_slots().unwrap();
        let mut log: Box<dyn DirtyLog + Send> = match ring_bytes {
            None => Box::new(KvmBitmap::new(&*vm.vm_fd(), slots).unwrap()),
            Some(bytes) => {
                let ring = KvmDirtyRing::new(&*vm.vm_fd(), slots, bytes).unwrap();
                for (i, v) in vm.vcpu_fds().iter().enumerate() {
                    ring.attach(i, v).unwrap();
                }
                vm.set_ring_full(ring.full_handler());
                Box::new(ring)
            }
        };
        log.enable().unwrap();
        let checker = {
            let gate = gate.clone();
            thread::spawn(move || {
                let first = DIRTY_AREA_ADDR / PAGE_SIZE;
                let mut missing = Vec::new();
                for _ in 0..PASSES {
                    if gate.wait_for(2).is_err() {
                        break;
                    }
                    let mut set = DirtySet::for_slots(log.slots());
                    let harvested = log.harvest(&mut set).map(|()| set);
                    missing.push(harvested.map(|set| {
                        let bitmap = set.get(0).expect("slot 0");
                        (first..first + 2 * PAGES)
                            .filter(|&p| !bitmap.is_dirty(p))
                            .count()
                    }));
                    gate.release();
                }
                gate.open(); // before any assertion: never leave a vCPU waiting
                missing
            })
        };
        let run = vm.run(guest::find("dirty-writer").unwrap(), Box::new(io::sink()));
        gate.close();
        let missing = checker.join().unwrap();
        run.unwrap();
        assert_eq!(missing.len() as u64, PASSES, "ring {ring_bytes:?}");
        for (pass, m) in missing.into_iter().enumerate() {
            assert_eq!(
                m.unwrap(),
                0,
                "ring {ring_bytes:?}, pass {pass}: written pages not harvested"
            );
        }
    }
}
