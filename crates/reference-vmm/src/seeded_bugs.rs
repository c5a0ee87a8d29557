//! Plausible local-APIC bugs that a test plants in this VMM's APIC one at a
//! time, to show that the conformance runner (the apic-conformance crate)
//! catches each within its default seeds. Only the `seeded-bugs` feature
//! can plant one; without it [`planted`] is `false` and the checks fold
//! away.

/// A bug the APIC can be built to have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeededBug {
    /// PPR reports only TPR's priority class (bits 7:4), losing its
    /// sub-class.
    PprDropsTprSubclass,
    /// SVR keeps bit 12, EOI-broadcast suppression, which the version
    /// register does not offer.
    SvrKeepsBroadcastSuppression,
    /// An LVT entry written while the APIC is software-disabled keeps the
    /// mask bit the guest wrote.
    LvtUnmaskedWhileDisabled,
    /// Another vCPU's IPI reaches a vCPU whose APIC is software-disabled.
    DisabledVcpuTakesIpis,
}

impl SeededBug {
    /// Every seeded bug.
    pub const ALL: [SeededBug; 4] = [
        Self::PprDropsTprSubclass,
        Self::SvrKeepsBroadcastSuppression,
        Self::LvtUnmaskedWhileDisabled,
        Self::DisabledVcpuTakesIpis,
    ];
}

#[cfg(feature = "seeded-bugs")]
mod planting {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};

    use super::SeededBug;

    /// The planted bug's index in [`SeededBug::ALL`] plus one; 0: none.
    static PLANTED: AtomicUsize = AtomicUsize::new(0);

    /// Plants `bug` in every APIC of this process from now on (`None`:
    /// removes it).
    pub fn plant(bug: Option<SeededBug>) {
        let index = bug.and_then(|b| SeededBug::ALL.iter().position(|&x| x == b));
        PLANTED.store(index.map_or(0, |i| i + 1), SeqCst);
    }

    /// Whether `bug` is planted.
    pub fn planted(bug: SeededBug) -> bool {
        let index = PLANTED.load(SeqCst);
        index != 0 && SeededBug::ALL[index - 1] == bug
    }
}

#[cfg(feature = "seeded-bugs")]
pub use planting::{plant, planted};

/// Whether `bug` is planted: never, without the `seeded-bugs` feature.
#[cfg(not(feature = "seeded-bugs"))]
pub fn planted(_bug: SeededBug) -> bool {
    false
}
