//! One vCPU's complete state as plain data ([`VcpuState`]), captured on
//! its own thread while it is out of `KVM_RUN` and restored on a new vCPU
//! (a migration's destination, a snapshot's restore).
//!
//! A vCPU's state is KVM's (registers, segments, FPU/XSAVE, XCRs, pending
//! events, MSRs including the TSC) and its interrupt controller's
//! ([`ChipState`]). The guest's TSC is captured with the wall-clock time,
//! and a restore sets it ahead by the time that passed, so guest time
//! continues and the guest sees its downtime as a stall.

use std::time::{SystemTime, UNIX_EPOCH};

use kvm_bindings::{
    Msrs, kvm_msr_entry, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, kvm_xsave,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd};

use crate::apic::{X2APIC_FIRST, X2APIC_LAST};
use crate::error::Error;
use crate::irqchip::state::ChipState;

/// IA32_TSC.
const MSR_TSC: u32 = 0x10;

/// One vCPU's complete state, captured on its own thread while it is out
/// of `KVM_RUN`.
#[derive(Debug)]
pub struct VcpuState {
    /// The vCPU's index.
    pub index: u32,
    /// Whether it was halted (waiting for an interrupt) in this VMM.
    pub halted: bool,
    /// Wall-clock time of the capture, ns since the epoch.
    pub captured_at_ns: u64,
    /// General registers.
    pub regs: kvm_regs,
    /// Segment and control registers.
    pub sregs: kvm_sregs,
    /// FPU and extended state.
    pub xsave: Box<kvm_xsave>,
    /// Extended control registers.
    pub xcrs: kvm_xcrs,
    /// Pending exceptions, interrupts, NMIs and SMIs.
    pub events: kvm_vcpu_events,
    /// KVM's multiprocessing state (halted or runnable; in-kernel LAPIC).
    pub mp_state: u32,
    /// Every MSR KVM saves for it, the TSC among them.
    pub msrs: Vec<(u32, u64)>,
    /// Its interrupt controller.
    pub chip: ChipState,
}

/// What KVM on this host lets a migration save: the MSRs it lists, and
/// whether a vCPU's XSAVE state fits `kvm_xsave`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateSupport {
    msrs: Vec<u32>,
    xsave_fits: bool,
}

impl StateSupport {
    /// The MSRs of `msrs` that this host's KVM does not list.
    pub fn missing_msrs(&self, msrs: &[u32]) -> Vec<u32> {
        msrs.iter()
            .copied()
            .filter(|m| !self.msrs.contains(m))
            .collect()
    }

    /// The MSRs a vCPU's state carries here.
    pub fn msrs(&self) -> &[u32] {
        &self.msrs
    }

    /// Asks KVM.
    pub fn query(kvm: &Kvm) -> Result<Self, Error> {
        let list = kvm.get_msr_index_list().map_err(|source| Error::Kvm {
            op: "KVM_GET_MSR_INDEX_LIST",
            source,
        })?;
        // The x2APIC range belongs to the APIC's state, whichever holds it.
        let msrs = list
            .as_slice()
            .iter()
            .copied()
            .filter(|m| !(X2APIC_FIRST..=X2APIC_LAST).contains(m))
            .collect();
        // KVM_CAP_XSAVE2 gives the size KVM_GET_XSAVE2 needs: above 4096
        // (AMX, say), `kvm_xsave` would cut the state short.
        let size = kvm.check_extension_int(Cap::Xsave2);
        Ok(Self {
            msrs,
            xsave_fits: size <= std::mem::size_of::<kvm_xsave>() as i32,
        })
    }
}

fn kvm(op: &'static str) -> impl Fn(kvm_ioctls::Error) -> Error {
    move |source| Error::Kvm { op, source }
}

impl VcpuState {
    /// Reads vCPU `index`'s state from KVM, with its controller's `chip`.
    pub fn capture(
        fd: &VcpuFd,
        index: u32,
        halted: bool,
        chip: ChipState,
        support: &StateSupport,
    ) -> Result<Self, Error> {
        if !support.xsave_fits {
            return Err(Error::Kvm {
                op: "KVM_GET_XSAVE",
                source: kvm_ioctls::Error::new(libc::E2BIG),
            });
        }
        let msrs = read_msrs(fd, &support.msrs)?;
        Ok(Self {
            index,
            halted,
            captured_at_ns: wall_clock_ns(),
            regs: fd.get_regs().map_err(kvm("KVM_GET_REGS"))?,
            sregs: fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?,
            xsave: Box::new(fd.get_xsave().map_err(kvm("KVM_GET_XSAVE"))?),
            xcrs: fd.get_xcrs().map_err(kvm("KVM_GET_XCRS"))?,
            events: fd.get_vcpu_events().map_err(kvm("KVM_GET_VCPU_EVENTS"))?,
            mp_state: match chip {
                ChipState::Kernel(_) => {
                    fd.get_mp_state().map_err(kvm("KVM_GET_MP_STATE"))?.mp_state
                }
                ChipState::User { .. } => kvm_bindings::KVM_MP_STATE_RUNNABLE,
            },
            msrs,
            chip,
        })
    }

    /// Sets KVM's side of the state on `fd` (the caller restores a user
    /// APIC's on its thread), the guest's TSC ahead by the wall-clock time
    /// since the capture at `tsc_khz`.
    pub fn restore(&self, fd: &VcpuFd, tsc_khz: u32) -> Result<(), Error> {
        fd.set_regs(&self.regs).map_err(kvm("KVM_SET_REGS"))?;
        fd.set_sregs(&self.sregs).map_err(kvm("KVM_SET_SREGS"))?;
        // SAFETY: `kvm_xsave` is 4096 bytes, all of them ours for the call;
        // capture refused a host whose XSAVE state needs more (KVM_CAP_XSAVE2).
        unsafe { fd.set_xsave(&self.xsave) }.map_err(kvm("KVM_SET_XSAVE"))?;
        fd.set_xcrs(&self.xcrs).map_err(kvm("KVM_SET_XCRS"))?;
        if let ChipState::Kernel(lapic) = &self.chip {
            fd.set_lapic(lapic).map_err(kvm("KVM_SET_LAPIC"))?;
        }
        self.restore_msrs(fd, tsc_khz)?;
        fd.set_vcpu_events(&self.events)
            .map_err(kvm("KVM_SET_VCPU_EVENTS"))?;
        if let ChipState::Kernel(_) = self.chip {
            let mp_state = kvm_bindings::kvm_mp_state {
                mp_state: self.mp_state,
            };
            fd.set_mp_state(mp_state).map_err(kvm("KVM_SET_MP_STATE"))?;
        }
        Ok(())
    }

    /// The MSRs, the TSC first (KVM arms a TSC deadline against it) and
    /// moved on by the time since the capture.
    fn restore_msrs(&self, fd: &VcpuFd, tsc_khz: u32) -> Result<(), Error> {
        let elapsed_ns = wall_clock_ns().saturating_sub(self.captured_at_ns);
        let ticks = (u128::from(elapsed_ns) * u128::from(tsc_khz) / 1_000_000) as u64;
        let mut entries: Vec<kvm_msr_entry> = self
            .msrs
            .iter()
            .map(|&(index, data)| kvm_msr_entry {
                index,
                data: match index {
                    MSR_TSC => data.wrapping_add(ticks),
                    _ => data,
                },
                ..Default::default()
            })
            .collect();
        entries.sort_by_key(|e| e.index != MSR_TSC);
        let mut rest = &entries[..];
        while !rest.is_empty() {
            let msrs = Msrs::from_entries(rest).map_err(|_| Error::Kvm {
                op: "KVM_SET_MSRS",
                source: kvm_ioctls::Error::new(libc::E2BIG),
            })?;
            let set = fd.set_msrs(&msrs).map_err(kvm("KVM_SET_MSRS"))?;
            let Some(refused) = rest.get(set) else {
                break;
            };
            // KVM lists some MSRs it refuses to write unless the guest's
            // CPUID has their feature (KVM's paravirtual ones): one that
            // already holds the value loses nothing.
            if read_msrs(fd, &[refused.index])? != [(refused.index, refused.data)] {
                return Err(Error::MsrRefused {
                    vcpu: self.index,
                    msr: refused.index,
                    value: refused.data,
                });
            }
            rest = &rest[set + 1..];
        }
        Ok(())
    }

    /// Whether the vCPU was halted: in this VMM, or in KVM's LAPIC.
    pub fn is_halted(&self) -> bool {
        self.halted
            || matches!(self.chip, ChipState::Kernel(_))
                && self.mp_state == kvm_bindings::KVM_MP_STATE_HALTED
    }

    /// The guest's TSC when it was captured, if KVM gave it.
    pub fn tsc(&self) -> Option<u64> {
        self.msrs.iter().find(|(i, _)| *i == MSR_TSC).map(|m| m.1)
    }
}

/// Reads every MSR in `indices` that KVM gives (a batch read stops at the
/// first one it refuses: that one is skipped and the rest read on).
fn read_msrs(fd: &VcpuFd, indices: &[u32]) -> Result<Vec<(u32, u64)>, Error> {
    let mut out = Vec::with_capacity(indices.len());
    let mut rest = indices;
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|&index| kvm_msr_entry {
                index,
                ..Default::default()
            })
            .collect();
        let mut msrs = Msrs::from_entries(&entries).map_err(|_| Error::Kvm {
            op: "KVM_GET_MSRS",
            source: kvm_ioctls::Error::new(libc::E2BIG),
        })?;
        let read = fd.get_msrs(&mut msrs).map_err(kvm("KVM_GET_MSRS"))?;
        out.extend(msrs.as_slice()[..read].iter().map(|e| (e.index, e.data)));
        rest = rest.get(read + 1..).unwrap_or_default();
    }
    Ok(out)
}

fn wall_clock_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A state of zeros with KVM's LAPIC, for tests that only pass it on.
    pub(crate) fn zeroed(index: u32) -> VcpuState {
        VcpuState {
            index,
            halted: false,
            captured_at_ns: 0,
            regs: kvm_regs::default(),
            sregs: kvm_sregs::default(),
            xsave: Box::default(),
            xcrs: kvm_xcrs::default(),
            events: kvm_vcpu_events::default(),
            mp_state: 0,
            msrs: Vec::new(),
            chip: ChipState::Kernel(Box::default()),
        }
    }
}
