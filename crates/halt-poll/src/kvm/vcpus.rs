//! The vCPUs a [`WindowTuner`](super::WindowTuner) reads: a set that vCPU
//! threads join and leave, so it fits a VMM whose vCPUs come and go
//! (hotplug) and one whose vCPU handles sit behind a lock while they run.
//!
//! A VMM whose vCPU threads hold their vCPU under a lock for as long as it
//! runs (Cloud Hypervisor's `Mutex<Vcpu>`) cannot open the stats fds from
//! another thread once the vCPUs run: each vCPU thread
//! [`join`](TunedVcpus::join)s with its own fd before its first `KVM_RUN`,
//! and [`leave`](TunedVcpus::leave)s when it is removed. The tuner thread
//! only reads the stats files, never a vCPU fd.

use std::os::fd::AsRawFd;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::{BinaryStats, KvmError, KvmHaltStats};

/// vCPUs by id, each with its statistics file. Clones share the set.
///
/// ```no_run
/// use halt_poll::kvm::TunedVcpus;
/// # fn run(vcpu_fd: &std::fs::File) -> Result<(), halt_poll::kvm::KvmError> {
/// let tuned = TunedVcpus::default();
/// // On vCPU 3's thread, before its first KVM_RUN: one KVM_GET_STATS_FD
/// // on its own fd (allowed by that thread's seccomp filter), then a few
/// // pread64s of the new file.
/// tuned.join(3, vcpu_fd)?;
/// // ... and when vCPU 3 is unplugged:
/// tuned.leave(3);
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct TunedVcpus {
    vcpus: Arc<Mutex<Vec<(u32, BinaryStats)>>>,
}

impl TunedVcpus {
    /// A set of the vCPUs whose fds are `vcpus`, as ids `0, 1, ...`: the
    /// usual start for a VMM that opens them all before they run.
    pub fn open<'a, F: AsRawFd + 'a>(
        vcpus: impl IntoIterator<Item = &'a F>,
    ) -> Result<Self, KvmError> {
        let set = Self::default();
        for (id, fd) in (0..).zip(vcpus) {
            set.join(id, fd)?;
        }
        Ok(set)
    }

    /// Adds vCPU `id`, opening its statistics from `vcpu`, its fd, on this
    /// thread. A vCPU that joins after the tuner's first read counts from
    /// its first read; one already in the set is replaced.
    pub fn join(&self, id: u32, vcpu: &impl AsRawFd) -> Result<(), KvmError> {
        let stats = BinaryStats::for_vcpu(vcpu)?;
        self.join_with(id, stats);
        Ok(())
    }

    /// Adds vCPU `id` with statistics opened elsewhere.
    pub fn join_with(&self, id: u32, stats: BinaryStats) {
        let mut vcpus = self.lock();
        vcpus.retain(|(v, _)| *v != id);
        vcpus.push((id, stats));
    }

    /// Removes vCPU `id` (its stats file closes); whether it was there.
    /// The tuner's budget then counts one vCPU fewer.
    pub fn leave(&self, id: u32) -> bool {
        let mut vcpus = self.lock();
        let before = vcpus.len();
        vcpus.retain(|(v, _)| *v != id);
        vcpus.len() != before
    }

    /// The ids in the set, in the order they joined.
    pub fn ids(&self) -> Vec<u32> {
        self.lock().iter().map(|(id, _)| *id).collect()
    }

    /// Every vCPU's halt statistics, read now, with its id.
    pub(crate) fn read_all(&self) -> Result<Vec<(u32, KvmHaltStats)>, KvmError> {
        self.lock()
            .iter()
            .map(|(id, stats)| Ok((*id, KvmHaltStats::read(stats)?)))
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, Vec<(u32, BinaryStats)>> {
        self.vcpus.lock().unwrap_or_else(PoisonError::into_inner)
    }
}
