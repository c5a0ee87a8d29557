//! Which vCPU an interrupt goes to, for a VMM on KVM's in-kernel irqchip:
//! its device threads raise interrupts through an irqfd (an `EventFd`
//! registered with `KVM_IRQFD` on a GSI) or `KVM_SIGNAL_MSI`, and KVM
//! delivers them. The VMM still knows where each goes: the MSI address it
//! (or the guest, through MSI-X) programmed, or the GSI's route as it gave
//! it to `KVM_SET_GSI_ROUTING`. [`IrqTargets`] keeps that map, so the device
//! thread can tell [`crate::Scheduler::delivering`] whom it just woke.
//!
//! Every value here may come from the guest (an MSI-X table entry is guest
//! memory): any address and data give an answer, never a panic.

use std::collections::HashMap;
use std::fmt;

/// An MSI message as `KVM_SIGNAL_MSI` and `KVM_SET_GSI_ROUTING` take it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct MsiMessage {
    /// The address, high half included (`address_hi << 32 | address_lo`).
    pub address: u64,
    /// The data (vector, delivery and trigger mode).
    pub data: u32,
}

impl MsiMessage {
    /// The message with `address_lo`, `address_hi` and `data`, as
    /// `struct kvm_msi` and `struct kvm_irq_routing_msi` hold them.
    pub const fn new(address_lo: u32, address_hi: u32, data: u32) -> Self {
        Self {
            address: (address_hi as u64) << 32 | address_lo as u64,
            data,
        }
    }
}

/// Why an interrupt has no single vCPU to boost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum NoTarget {
    /// The address is not in the local APICs' window (`0xfee0_0000`).
    NotAnMsi(u64),
    /// Logical destination mode: the target depends on the guest's logical
    /// APIC IDs, which only KVM's LAPIC holds.
    Logical,
    /// Sent to every vCPU (destination `0xff`, or `0xffff_ffff` in x2APIC
    /// format).
    Broadcast,
    /// A delivery mode that targets no vCPU thread's next run (SMI, INIT,
    /// SIPI, ExtINT): the mode's number.
    DeliveryMode(u8),
    /// No vCPU has this APIC ID.
    NoSuchApic(u32),
    /// The GSI has no route this map knows.
    UnknownGsi(u32),
}

impl fmt::Display for NoTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotAnMsi(a) => write!(f, "address {a:#x} is not an MSI address (0xfeexxxxx)"),
            Self::Logical => f.write_str("logical destination mode: KVM's LAPIC resolves it"),
            Self::Broadcast => f.write_str("a broadcast: every vCPU"),
            Self::DeliveryMode(m) => write!(f, "delivery mode {m} wakes no single vCPU"),
            Self::NoSuchApic(id) => write!(f, "no vCPU has APIC ID {id}"),
            Self::UnknownGsi(gsi) => write!(f, "GSI {gsi} has no known route"),
        }
    }
}

impl std::error::Error for NoTarget {}

/// Where a GSI goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GsiRoute {
    /// An MSI route (`KVM_IRQ_ROUTING_MSI`).
    Msi(MsiMessage),
    /// A pin of KVM's PIC or IOAPIC whose destination the VMM knows (the
    /// boot vCPU, in the PIC's case; the IOAPIC's redirection entry
    /// otherwise, which the VMM reads with `KVM_GET_IRQCHIP`).
    Vcpu(usize),
}

/// The interrupt routes of one VM: APIC IDs to vCPU indices, and GSIs to
/// their routes. Rebuild it (or update it) whenever the VMM calls
/// `KVM_SET_GSI_ROUTING`, and share it with the device threads as the
/// routing table is shared (an `ArcSwap` of it, say).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IrqTargets {
    vcpu_of_apic: HashMap<u32, usize>,
    gsi: HashMap<u32, GsiRoute>,
}

/// The address window of MSIs to local APICs (bits 31:20).
const MSI_WINDOW: u64 = 0xfee;
/// Destination mode bit of the address: logical.
const DEST_MODE_LOGICAL: u64 = 1 << 2;
/// Delivery modes (data bits 10:8) that deliver a vector or an NMI.
const FIXED: u8 = 0;
const LOWEST_PRIORITY: u8 = 1;
const NMI: u8 = 4;

impl IrqTargets {
    /// vCPU `i` has APIC ID `i`: KVM's default, and most VMMs' CPUID.
    pub fn identity(vcpus: usize) -> Self {
        Self::with_apic_ids((0..vcpus).map(|i| i as u32))
    }

    /// vCPU `i` has the `i`-th APIC ID of `apic_ids` (as the VMM set them in
    /// CPUID leaf 0xb and `KVM_CREATE_VCPU`'s id).
    pub fn with_apic_ids(apic_ids: impl IntoIterator<Item = u32>) -> Self {
        Self {
            vcpu_of_apic: apic_ids
                .into_iter()
                .enumerate()
                .map(|(i, id)| (id, i))
                .collect(),
            gsi: HashMap::new(),
        }
    }

    /// Routes `gsi` as given; replaces its route.
    pub fn set_route(&mut self, gsi: u32, route: GsiRoute) {
        self.gsi.insert(gsi, route);
    }

    /// Forgets `gsi`'s route.
    pub fn remove_route(&mut self, gsi: u32) {
        self.gsi.remove(&gsi);
    }

    /// The vCPU an interrupt raised on `gsi` (an irqfd's) goes to.
    pub fn gsi(&self, gsi: u32) -> Result<usize, NoTarget> {
        match self.gsi.get(&gsi) {
            Some(GsiRoute::Msi(msg)) => self.msi(*msg),
            Some(GsiRoute::Vcpu(vcpu)) => Ok(*vcpu),
            None => Err(NoTarget::UnknownGsi(gsi)),
        }
    }

    /// The vCPU an MSI goes to: physical destination mode, one APIC ID
    /// (extended destination IDs included: address bits 11:5, as Linux
    /// guests on KVM set them with `KVM_FEATURE_MSI_EXT_DEST_ID`, or the
    /// high address word in KVM's x2APIC format), a fixed, lowest-priority
    /// or NMI delivery.
    pub fn msi(&self, msg: MsiMessage) -> Result<usize, NoTarget> {
        let address_lo = msg.address & 0xffff_ffff;
        if address_lo >> 20 != MSI_WINDOW {
            return Err(NoTarget::NotAnMsi(msg.address));
        }
        let mode = ((msg.data >> 8) & 0x7) as u8;
        if !matches!(mode, FIXED | LOWEST_PRIORITY | NMI) {
            return Err(NoTarget::DeliveryMode(mode));
        }
        if address_lo & DEST_MODE_LOGICAL != 0 {
            return Err(NoTarget::Logical);
        }
        let dest = destination_id(msg.address);
        if dest == 0xff || dest == u32::MAX {
            return Err(NoTarget::Broadcast);
        }
        self.vcpu_of_apic
            .get(&dest)
            .copied()
            .ok_or(NoTarget::NoSuchApic(dest))
    }
}

/// The destination APIC ID of an MSI address: bits 19:12, extended by the
/// high word's bits 31:8 (KVM's x2APIC format) or, with none, by bits 11:5.
fn destination_id(address: u64) -> u32 {
    let low = ((address >> 12) & 0xff) as u32;
    let high_word = (address >> 32) as u32;
    if high_word != 0 {
        return low | (high_word & 0xffff_ff00);
    }
    low | (((address >> 5) & 0x7f) as u32) << 8
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fixed-delivery MSI with vector 0x30 to APIC ID `dest` (bits 19:12).
    fn msi(dest: u32) -> MsiMessage {
        MsiMessage::new(0xfee0_0000 | (dest & 0xff) << 12, 0, 0x30)
    }

    #[test]
    fn a_physical_msi_goes_to_the_vcpu_with_its_apic_id() {
        let t = IrqTargets::with_apic_ids([0, 2, 4, 6]);
        assert_eq!(t.msi(msi(4)), Ok(2));
        assert_eq!(t.msi(msi(6)), Ok(3));
        assert_eq!(t.msi(msi(1)), Err(NoTarget::NoSuchApic(1)), "no vCPU");
        let lowest = MsiMessage::new(0xfee0_2000, 0, 0x130);
        assert_eq!(t.msi(lowest), Ok(1), "lowest priority to one APIC");
        let nmi = MsiMessage::new(0xfee0_0000, 0, 0x400);
        assert_eq!(t.msi(nmi), Ok(0));
    }

    #[test]
    fn extended_destination_ids_reach_past_apic_id_255() {
        let t = IrqTargets::with_apic_ids([0, 300, 70_000]);
        // 300 = 0x12c: bits 7:0 in address 19:12, bits 14:8 in address 11:5.
        let ext = MsiMessage::new(0xfee0_0000 | 0x2c << 12 | 0x1 << 5, 0, 0x30);
        assert_eq!(t.msi(ext), Ok(1));
        // KVM's x2APIC format: bits 31:8 in the high address word.
        let x2 = MsiMessage::new(0xfee0_0000 | (70_000 & 0xff) << 12, 70_000 & !0xff, 0x30);
        assert_eq!(t.msi(x2), Ok(2));
    }

    #[test]
    fn messages_without_one_vcpu_say_why() {
        let t = IrqTargets::identity(2);
        assert_eq!(
            t.msi(MsiMessage::new(0xfec0_0000, 0, 0x30)),
            Err(NoTarget::NotAnMsi(0xfec0_0000))
        );
        assert_eq!(
            t.msi(MsiMessage::new(0xfee0_1004, 0, 0x30)),
            Err(NoTarget::Logical)
        );
        assert_eq!(t.msi(msi(0xff)), Err(NoTarget::Broadcast));
        let x2_broadcast = MsiMessage::new(0xfeef_f000, 0xffff_ff00, 0x30);
        assert_eq!(t.msi(x2_broadcast), Err(NoTarget::Broadcast));
        for mode in [2u8, 3, 5, 6, 7] {
            let m = MsiMessage::new(0xfee0_0000, 0, u32::from(mode) << 8 | 0x30);
            assert_eq!(t.msi(m), Err(NoTarget::DeliveryMode(mode)));
        }
        assert!(NoTarget::NoSuchApic(9).to_string().contains("APIC ID 9"));
    }

    #[test]
    fn gsi_routes_resolve_through_their_msi_or_their_vcpu() {
        let mut t = IrqTargets::identity(4);
        t.set_route(24, GsiRoute::Msi(msi(3)));
        t.set_route(4, GsiRoute::Vcpu(0));
        t.set_route(25, GsiRoute::Msi(msi(9)));
        assert_eq!(t.gsi(24), Ok(3));
        assert_eq!(t.gsi(4), Ok(0));
        assert_eq!(t.gsi(25), Err(NoTarget::NoSuchApic(9)), "routed to no vCPU");
        assert_eq!(t.gsi(5), Err(NoTarget::UnknownGsi(5)));
        t.set_route(24, GsiRoute::Msi(msi(1)));
        assert_eq!(t.gsi(24), Ok(1), "a route replaced");
        t.remove_route(24);
        assert_eq!(t.gsi(24), Err(NoTarget::UnknownGsi(24)));
    }

    #[test]
    fn any_address_and_data_give_an_answer() {
        let t = IrqTargets::identity(1);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..10_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let m = MsiMessage {
                address: x,
                data: (x >> 17) as u32,
            };
            if let Ok(v) = t.msi(m) {
                assert_eq!(v, 0);
            }
        }
    }
}
