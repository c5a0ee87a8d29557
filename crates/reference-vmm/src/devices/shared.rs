//! The device bus as every vCPU thread reads it on an exit, through one of
//! three mechanisms so each can be measured against the others.

use std::sync::{Arc, PoisonError, RwLock};

use arc_swap::ArcSwap;
use rcu_qs::{Domain, RcuCell, Reader};

use super::IoBus;
use crate::mechanisms::BusAccess;

/// The bus behind an `RcuCell` (lock-free reads, vCPU threads offline in
/// the guest), a `RwLock`, or an `ArcSwap`.
pub enum SharedBus {
    /// rcu-qs: a load and a dereference per lookup.
    Rcu(RcuCell<IoBus>),
    /// A read lock per lookup.
    RwLock(RwLock<IoBus>),
    /// arc-swap: a guarded load per lookup.
    ArcSwap(ArcSwap<IoBus>),
}

impl SharedBus {
    /// `bus`, read through `access`; `domain` is the RCU domain of the vCPU threads.
    pub fn new(access: BusAccess, bus: IoBus, domain: &Domain) -> Self {
        match access {
            BusAccess::Rcu => Self::Rcu(RcuCell::new(domain, bus)),
            BusAccess::RwLock => Self::RwLock(RwLock::new(bus)),
            BusAccess::ArcSwap => Self::ArcSwap(ArcSwap::from_pointee(bus)),
        }
    }

    /// Runs `f` on the current bus; `reader` is the calling vCPU thread's,
    /// online.
    pub fn with<R>(&self, reader: &Reader, f: impl FnOnce(&IoBus) -> R) -> R {
        match self {
            Self::Rcu(cell) => f(cell.read(reader)),
            Self::RwLock(lock) => f(&lock.read().unwrap_or_else(PoisonError::into_inner)),
            Self::ArcSwap(swap) => f(&swap.load()),
        }
    }

    /// Replaces the bus (a hot-plug); with RCU the old one is dropped after a
    /// grace period, on the domain's reclaim thread.
    pub fn replace(&self, bus: IoBus) {
        match self {
            Self::Rcu(cell) => cell.store(bus),
            Self::RwLock(lock) => *lock.write().unwrap_or_else(PoisonError::into_inner) = bus,
            Self::ArcSwap(swap) => swap.store(Arc::new(bus)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::SerialConsole;

    #[test]
    fn every_access_mode_sees_the_bus_and_its_replacement() {
        let domain = Domain::new();
        for access in [BusAccess::Rcu, BusAccess::RwLock, BusAccess::ArcSwap] {
            let mut bus = IoBus::new();
            bus.insert(
                0x3f8,
                8,
                Arc::new(SerialConsole::new(Box::new(std::io::sink()))),
            )
            .unwrap();
            let shared = SharedBus::new(access, bus, &domain);
            let reader = domain.register_reader();
            assert!(
                shared.with(&reader, |b| b.find(0x3f9).is_some()),
                "{access}"
            );
            shared.replace(IoBus::new());
            assert!(
                shared.with(&reader, |b| b.find(0x3f9).is_none()),
                "{access}"
            );
        }
    }
}
