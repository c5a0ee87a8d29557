//! How vCPU threads read the device bus on an exit: through an RCU cell by
//! default (rcu-qs), or any other [`BusAccess`] a VMM author passes.

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

/// Runs `f` on the bus `access` reads, as an empty bus if it never calls back.
pub(crate) fn with_bus<R>(
    access: &dyn BusAccess,
    reader: &Reader,
    f: impl FnOnce(&IoBus) -> R,
) -> R {
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
        let shared = RcuBus::new(&domain, bus);
        let reader = domain.register_reader();
        assert!(with_bus(&shared, &reader, |b| b.find(0x3f9).is_some()));
        shared.replace(IoBus::new());
        assert!(with_bus(&shared, &reader, |b| b.find(0x3f9).is_none()));
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
        assert!(with_bus(&Silent, &reader, |b| b.find(0x3f8).is_none()));
    }
}
