//! KVM's own halt polling, for VMMs that keep the in-kernel irqchip: set the
//! per-VM window (`KVM_CAP_HALT_POLL`) and read a vCPU's binary statistics
//! (`KVM_GET_STATS_FD`), whose halt counters and histograms show what in-kernel
//! polling does; [`WindowTuner`] sets the window from them. Enabled by the
//! `kvm` feature.

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::time::Duration;

use kvm_bindings::{
    KVM_CAP_HALT_POLL, KVM_STATS_BASE_MASK, KVM_STATS_BASE_POW2, KVM_STATS_TYPE_MASK,
    KVM_STATS_UNIT_MASK, KVMIO, kvm_enable_cap,
};
use vmm_sys_util::ioctl::{ioctl, ioctl_with_ref};

pub mod tuner;
pub mod vcpus;
pub use tuner::{HALT_POLL_NS_GROW_START, TunerConfig, WindowTuner};
pub use vcpus::TunedVcpus;

/// The two ioctls this module issues itself, on whatever file descriptor
/// the VMM holds (a kvm-ioctls `VmFd`/`VcpuFd` of any version, or its own).
mod ioctls {
    use super::{KVMIO, kvm_enable_cap};
    vmm_sys_util::ioctl_io_nr!(KVM_GET_STATS_FD, KVMIO, 0xce);
    vmm_sys_util::ioctl_iow_nr!(KVM_ENABLE_CAP, KVMIO, 0xa3, kvm_enable_cap);
}

/// What went wrong talking to KVM.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KvmError {
    /// The window does not fit the capability's 32-bit nanoseconds.
    #[error("a halt-polling window of {0:?} does not fit KVM_CAP_HALT_POLL (at most 2^32-1 ns)")]
    WindowTooLong(Duration),
    /// `KVM_ENABLE_CAP(KVM_CAP_HALT_POLL)` failed.
    #[error("KVM_ENABLE_CAP(KVM_CAP_HALT_POLL) failed: {0}")]
    EnableCap(#[source] io::Error),
    /// `KVM_GET_STATS_FD` failed.
    #[error("KVM_GET_STATS_FD failed: {0}")]
    StatsFd(#[source] io::Error),
    /// Reading the stats file failed.
    #[error("cannot read KVM binary stats: {0}")]
    Read(#[source] io::Error),
    /// The stats file is not laid out as the KVM API says.
    #[error("malformed KVM binary stats: {0}")]
    Malformed(&'static str),
    /// No statistic has this name.
    #[error("KVM has no binary statistic called {0:?}")]
    NoSuchStat(String),
}

/// Sets the maximum halt-polling window of the VM whose file descriptor is
/// `vm` (0 stops in-kernel polling). It may be set again at any time; KVM's
/// grow/shrink rule then works under the new maximum.
///
/// `vm` is anything that holds the VM's fd: a kvm-ioctls `VmFd` of any
/// version, or a VMM's own handle. One system call, `ioctl(KVM_ENABLE_CAP)`.
pub fn set_vm_halt_poll(vm: &impl AsRawFd, max: Duration) -> Result<(), KvmError> {
    let ns = u32::try_from(max.as_nanos()).map_err(|_| KvmError::WindowTooLong(max))?;
    let mut cap = kvm_enable_cap {
        cap: KVM_CAP_HALT_POLL,
        ..Default::default()
    };
    cap.args[0] = u64::from(ns);
    // SAFETY: KVM reads one `kvm_enable_cap` from the pointer, which lives
    // for the call; on anything but a VM fd the ioctl fails with an error.
    let ret = unsafe { ioctl_with_ref(vm, ioctls::KVM_ENABLE_CAP(), &cap) };
    if ret == 0 {
        Ok(())
    } else {
        Err(KvmError::EnableCap(io::Error::last_os_error()))
    }
}

/// What a statistic measures (`KVM_STATS_TYPE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StatKind {
    /// A counter that only grows.
    Cumulative,
    /// A current value.
    Instant,
    /// The highest value seen.
    Peak,
    /// A histogram with buckets of `bucket_size`.
    LinearHist,
    /// A histogram with power-of-two buckets.
    LogHist,
    /// A type this crate does not know.
    Other(u32),
}

/// One statistic's descriptor.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatDesc {
    /// Its name, e.g. `halt_poll_success_ns`.
    pub name: String,
    /// What it measures.
    pub kind: StatKind,
    /// Its unit bits (`KVM_STATS_UNIT_*`).
    pub unit: u32,
    /// Whether the exponent is a power of two (else of ten).
    pub base_pow2: bool,
    /// The value is `raw * base^exponent` units (e.g. -9 for nanoseconds).
    pub exponent: i16,
    /// Number of u64 values (1, or the histogram's buckets).
    pub size: u16,
    /// Offset of the values within the data block.
    pub offset: u32,
    /// Width of a linear histogram's buckets.
    pub bucket_size: u32,
}

/// A file of KVM binary statistics (of a VM or a vCPU).
#[derive(Debug)]
pub struct BinaryStats {
    file: File,
    data_offset: u64,
    descriptors: Vec<StatDesc>,
}

/// Size of `struct kvm_stats_header`.
const HEADER_SIZE: usize = 24;
/// Size of `struct kvm_stats_desc` without its name.
const DESC_SIZE: usize = 16;
/// Sanity bounds on what the kernel describes.
const MAX_NAME_SIZE: u32 = 4096;
const MAX_DESCRIPTORS: u32 = 65_536;

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

impl BinaryStats {
    /// The statistics of the vCPU whose file descriptor is `vcpu` (a
    /// kvm-ioctls `VcpuFd` of any version, or a VMM's own handle). Needs
    /// `ioctl(KVM_GET_STATS_FD)` and `pread64` on the calling thread; the
    /// vCPU may be running meanwhile (no KVM lock is taken), so a vCPU
    /// thread can open its own before its first `KVM_RUN`.
    pub fn for_vcpu(vcpu: &impl AsRawFd) -> Result<Self, KvmError> {
        Self::open(vcpu)
    }

    /// The statistics of the VM whose file descriptor is `vm`.
    pub fn for_vm(vm: &impl AsRawFd) -> Result<Self, KvmError> {
        Self::open(vm)
    }

    fn open(fd: &impl AsRawFd) -> Result<Self, KvmError> {
        // SAFETY: KVM_GET_STATS_FD takes no argument and returns a new file
        // descriptor or -1; `fd` is a VM or vCPU descriptor.
        let ret = unsafe { ioctl(fd, ioctls::KVM_GET_STATS_FD()) };
        if ret < 0 {
            return Err(KvmError::StatsFd(io::Error::last_os_error()));
        }
        // SAFETY: `ret` is a fresh descriptor that nothing else owns.
        let file = unsafe { File::from_raw_fd(ret) };
        Self::parse(file)
    }

    fn read_exact_at(file: &File, len: usize, offset: u64) -> Result<Vec<u8>, KvmError> {
        let mut buf = vec![0; len];
        file.read_exact_at(&mut buf, offset)
            .map_err(KvmError::Read)?;
        Ok(buf)
    }

    fn parse(file: File) -> Result<Self, KvmError> {
        let h = Self::read_exact_at(&file, HEADER_SIZE, 0)?;
        let (name_size, num_desc) = (u32_at(&h, 4), u32_at(&h, 8));
        let (desc_offset, data_offset) = (u32_at(&h, 16), u32_at(&h, 20));
        if name_size == 0 || name_size > MAX_NAME_SIZE || num_desc > MAX_DESCRIPTORS {
            return Err(KvmError::Malformed(
                "implausible name size or descriptor count",
            ));
        }
        let stride = DESC_SIZE + name_size as usize;
        let block = Self::read_exact_at(&file, stride * num_desc as usize, u64::from(desc_offset))?;
        let descriptors = block.chunks_exact(stride).map(Self::descriptor).collect();
        Ok(Self {
            file,
            data_offset: u64::from(data_offset),
            descriptors,
        })
    }

    fn descriptor(d: &[u8]) -> StatDesc {
        let flags = u32_at(d, 0);
        let name = &d[DESC_SIZE..];
        let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(name.len())];
        let kind = match flags & KVM_STATS_TYPE_MASK {
            0 => StatKind::Cumulative,
            1 => StatKind::Instant,
            2 => StatKind::Peak,
            3 => StatKind::LinearHist,
            4 => StatKind::LogHist,
            other => StatKind::Other(other),
        };
        StatDesc {
            name: String::from_utf8_lossy(name).into_owned(),
            kind,
            unit: flags & KVM_STATS_UNIT_MASK,
            base_pow2: flags & KVM_STATS_BASE_MASK == KVM_STATS_BASE_POW2,
            exponent: i16::from_le_bytes([d[4], d[5]]),
            size: u16::from_le_bytes([d[6], d[7]]),
            offset: u32_at(d, 8),
            bucket_size: u32_at(d, 12),
        }
    }

    /// Every statistic's descriptor.
    pub fn descriptors(&self) -> &[StatDesc] {
        &self.descriptors
    }

    /// The current values of the statistic called `name`.
    pub fn read(&self, name: &str) -> Result<Vec<u64>, KvmError> {
        let d = self
            .descriptors
            .iter()
            .find(|d| d.name == name)
            .ok_or_else(|| KvmError::NoSuchStat(name.into()))?;
        let bytes = Self::read_exact_at(
            &self.file,
            8 * usize::from(d.size),
            self.data_offset + u64::from(d.offset),
        )?;
        Ok(bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect())
    }

    /// The current value of the single-valued statistic called `name`.
    pub fn read_one(&self, name: &str) -> Result<u64, KvmError> {
        self.read(name)?
            .first()
            .copied()
            .ok_or(KvmError::Malformed("a statistic with no value"))
    }
}

/// A vCPU's halt-polling statistics, as KVM keeps them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KvmHaltStats {
    /// Polls that caught the wake-up.
    pub halt_successful_poll: u64,
    /// Halts that polled.
    pub halt_attempted_poll: u64,
    /// Successful polls ended by an invalid wake-up.
    pub halt_poll_invalid: u64,
    /// Wake-ups of a blocked vCPU.
    pub halt_wakeup: u64,
    /// Time polling in successful polls, ns.
    pub halt_poll_success_ns: u64,
    /// Time polling in failed polls, ns.
    pub halt_poll_fail_ns: u64,
    /// Time blocked, ns.
    pub halt_wait_ns: u64,
    /// Log2 histogram of successful poll times (the histograms are empty
    /// where the kernel has none).
    pub halt_poll_success_hist: Vec<u64>,
    /// Log2 histogram of failed poll times.
    pub halt_poll_fail_hist: Vec<u64>,
    /// Log2 histogram of block times.
    pub halt_wait_hist: Vec<u64>,
}

impl KvmHaltStats {
    /// Reads them from a vCPU's statistics.
    pub fn read(stats: &BinaryStats) -> Result<Self, KvmError> {
        Ok(Self {
            halt_successful_poll: stats.read_one("halt_successful_poll")?,
            halt_attempted_poll: stats.read_one("halt_attempted_poll")?,
            halt_poll_invalid: stats.read_one("halt_poll_invalid")?,
            halt_wakeup: stats.read_one("halt_wakeup")?,
            halt_poll_success_ns: stats.read_one("halt_poll_success_ns")?,
            halt_poll_fail_ns: stats.read_one("halt_poll_fail_ns")?,
            halt_wait_ns: stats.read_one("halt_wait_ns")?,
            halt_poll_success_hist: read_hist(stats, "halt_poll_success_hist")?,
            halt_poll_fail_hist: read_hist(stats, "halt_poll_fail_hist")?,
            halt_wait_hist: read_hist(stats, "halt_wait_hist")?,
        })
    }
}

/// A histogram, or none where this kernel has none (they came in Linux 5.15,
/// a release after binary stats).
fn read_hist(stats: &BinaryStats, name: &str) -> Result<Vec<u64>, KvmError> {
    match stats.read(name) {
        Err(KvmError::NoSuchStat(_)) => Ok(Vec::new()),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A stats file laid out as the KVM API documents it.
    fn fake_stats(name_size: u32, descs: &[(&str, u32, u16, u32)], data: &[u64]) -> File {
        let desc_offset = HEADER_SIZE as u32 + 8; // an id string would sit between
        let stride = DESC_SIZE as u32 + name_size;
        let data_offset = desc_offset + stride * descs.len() as u32;
        let mut bytes = Vec::new();
        for v in [
            0,
            name_size,
            descs.len() as u32,
            HEADER_SIZE as u32,
            desc_offset,
            data_offset,
        ] {
            bytes.extend(v.to_le_bytes());
        }
        bytes.extend(b"kvm-1234");
        for (name, flags, size, offset) in descs {
            bytes.extend(flags.to_le_bytes());
            bytes.extend((-9i16).to_le_bytes());
            bytes.extend(size.to_le_bytes());
            bytes.extend(offset.to_le_bytes());
            bytes.extend(0u32.to_le_bytes());
            let mut n = name.as_bytes().to_vec();
            n.resize(name_size as usize, 0);
            bytes.extend(n);
        }
        data.iter().for_each(|v| bytes.extend(v.to_le_bytes()));
        let mut f = tempfile();
        f.write_all(&bytes).unwrap();
        f
    }

    fn tempfile() -> File {
        let path = std::env::temp_dir().join(format!(
            "halt-poll-stats-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f
    }

    #[test]
    fn parses_descriptors_and_values() {
        let f = fake_stats(
            32,
            &[("halt_wait_ns", 0x20, 1, 0), ("halt_wait_hist", 0x24, 3, 8)],
            &[77, 1, 2, 3],
        );
        let stats = BinaryStats::parse(f).unwrap();
        let d = &stats.descriptors()[1];
        assert_eq!(
            (d.name.as_str(), d.kind, d.size, d.exponent),
            ("halt_wait_hist", StatKind::LogHist, 3, -9)
        );
        assert_eq!(
            stats.descriptors()[0].unit,
            kvm_bindings::KVM_STATS_UNIT_SECONDS
        );
        assert_eq!(stats.read_one("halt_wait_ns").unwrap(), 77);
        assert_eq!(stats.read("halt_wait_hist").unwrap(), [1, 2, 3]);
        assert!(matches!(stats.read("nope"), Err(KvmError::NoSuchStat(_))));
    }

    #[test]
    fn halt_stats_without_histograms_read_as_empty_ones() {
        let names = [
            "halt_successful_poll",
            "halt_attempted_poll",
            "halt_poll_invalid",
            "halt_wakeup",
            "halt_poll_success_ns",
            "halt_poll_fail_ns",
            "halt_wait_ns",
        ];
        let descs: Vec<_> = (0u32..).zip(names).map(|(i, n)| (n, 0, 1, 8 * i)).collect();
        let stats = BinaryStats::parse(fake_stats(32, &descs, &[1, 2, 3, 4, 5, 6, 7])).unwrap();
        let halt = KvmHaltStats::read(&stats).unwrap();
        assert_eq!((halt.halt_successful_poll, halt.halt_wait_ns), (1, 7));
        assert!(halt.halt_wait_hist.is_empty() && halt.halt_poll_success_hist.is_empty());
        // A missing counter is still an error.
        let stats = BinaryStats::parse(fake_stats(32, &descs[1..], &[2, 3, 4, 5, 6, 7])).unwrap();
        assert!(matches!(
            KvmHaltStats::read(&stats),
            Err(KvmError::NoSuchStat(_))
        ));
    }

    #[test]
    fn rejects_malformed_and_truncated_files() {
        assert!(matches!(
            BinaryStats::parse(fake_stats(0, &[], &[])),
            Err(KvmError::Malformed(_))
        ));
        let mut short = tempfile();
        short.write_all(&[1, 2, 3]).unwrap();
        assert!(matches!(BinaryStats::parse(short), Err(KvmError::Read(_))));
        // A descriptor pointing past the data block.
        let stats = BinaryStats::parse(fake_stats(16, &[("x", 0, 4, 0)], &[1])).unwrap();
        assert!(matches!(stats.read("x"), Err(KvmError::Read(_))));
    }

    #[test]
    fn windows_beyond_32_bits_are_refused_before_any_ioctl() {
        let err = u32::try_from(Duration::from_secs(5).as_nanos());
        assert!(
            err.is_err(),
            "5 s is more than 2^32 ns, so set_vm_halt_poll refuses it"
        );
    }
}
