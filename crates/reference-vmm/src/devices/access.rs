//! How vCPU threads read the device bus on an exit: through the VMM's own
//! RCU cell by default (rcu-qs), read in place, or through any other
//! [`BusAccess`] a VMM author passes.

use rcu_qs::{Domain, RcuCell, Reader};

use super::IoBus;

/// The device bus as every vCPU thread reads it on an exit, and as a
/// hot-plug replaces it.
pub trait BusAccess: Send + Sync {
    /// Calls `f` once on the current bus; `reader` is the calling vCPU
    /// thread's RCU reader, online. (An access that never calls `f` reads
    /// as an empty bus: the guest's access faults.)
    fn read(&self, reader: &Reader, f: &mut dyn FnMut(&IoBus));
    /// Replaces the bus.
    fn replace(&self, bus: IoBus);
}

/// The bus behind an `RcuCell`: a load and a dereference per lookup, with
/// the vCPU threads offline while in the guest. A replaced bus is dropped
/// after a grace period, on the domain's reclaim thread.
pub struct RcuBus(RcuCell<IoBus>);

impl RcuBus {
    /// `bus`, read by the readers of `domain`.
    pub fn new(domain: &Domain, bus: IoBus) -> Self {
        Self(RcuCell::new(domain, bus))
    }
}

impl BusAccess for RcuBus {
    fn read(&self, reader: &Reader, f: &mut dyn FnMut(&IoBus)) {
        f(self.0.read(reader))
    }

    fn replace(&self, bus: IoBus) {
        self.0.store(bus)
    }
}

/// How the vCPU threads read the bus: what [`Policies::bus`](crate::Policies::bus)
/// returns.
pub enum BusRead {
    /// The VMM's RCU cell, read in place on the exit path: no indirect call.
    Rcu(RcuBus),
    /// Any other access, through a trait object: the exit path then pays
    /// for two indirect calls on cold code, which `reference-bench rcu`
    /// measures beside the RCU cell in place (over 100 ns a read on this
    /// project's machines).
    Custom(Box<dyn BusAccess>),
}

impl BusRead {
    /// Runs `f` on the current bus (an empty one if a custom access never
    /// calls back).
    pub(crate) fn with<R>(&self, reader: &Reader, f: impl FnOnce(&IoBus) -> R) -> R {
        match self {
            Self::Rcu(rcu) => f(rcu.0.read(reader)),
            Self::Custom(access) => with_custom(&**access, reader, f),
        }
    }
}

/// Runs `f` on the bus `access` reads, as an empty bus if it never calls back.
fn with_custom<R>(access: &dyn BusAccess, reader: &Reader, f: impl FnOnce(&IoBus) -> R) -> R {
    let mut f = Some(f);
    let mut result = None;
    access.read(reader, &mut |bus| {
        if let Some(f) = f.take() {
            result = Some(f(bus));
        }
    });
    match (result, f) {
        (Some(r), _) => r,
        (None, Some(f)) => f(&IoBus::new()),
        (None, None) => unreachable!("f ran, so it left a result"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::SerialConsole;
    use std::sync::Arc;

    #[test]
    fn the_rcu_bus_sees_the_bus_and_its_replacement() {
        let domain = Domain::new();
        let mut bus = IoBus::new();
        let console = SerialConsole::new(Box::new(std::io::sink()));
        bus.insert(0x3f8, 8, Arc::new(console)).unwrap();
        let reader = domain.register_reader();
        let inline = BusRead::Rcu(RcuBus::new(&domain, bus));
        assert!(inline.with(&reader, |b| b.find(0x3f9).is_some()));
        let BusRead::Rcu(rcu) = &inline else {
            unreachable!()
        };
        rcu.replace(IoBus::new());
        assert!(inline.with(&reader, |b| b.find(0x3f9).is_none()));
        let custom = BusRead::Custom(Box::new(RcuBus::new(&domain, IoBus::new())));
        assert!(custom.with(&reader, |b| b.find(0x3f9).is_none()));
    }

    #[test]
    fn an_access_that_never_calls_back_reads_as_an_empty_bus() {
        struct Silent;
        impl BusAccess for Silent {
            fn read(&self, _: &Reader, _: &mut dyn FnMut(&IoBus)) {}
            fn replace(&self, _: IoBus) {}
        }
        let domain = Domain::new();
        let reader = domain.register_reader();
        let silent = BusRead::Custom(Box::new(Silent));
        assert!(silent.with(&reader, |b| b.find(0x3f8).is_none()));
    }
}
