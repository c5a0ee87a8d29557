//! The port-I/O bus: which device answers which port range.

use std::io;
use std::sync::Arc;

/// A device on the port-I/O bus. `offset` is relative to the device's base port.
///
/// Devices are shared by every vCPU thread, so they take `&self` and keep their
/// own interior mutability.
pub trait PioDevice: Send + Sync {
    /// The guest reads `data.len()` bytes at `offset`.
    fn read(&self, offset: u16, data: &mut [u8]);
    /// The guest writes `data` at `offset`; an error is the VMM's own (its output
    /// failed), not the guest's, and ends the run.
    fn write(&self, offset: u16, data: &[u8]) -> io::Result<()>;
}

/// Why a device could not be added to the bus.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BusError {
    /// The new range is empty or runs past port 0xffff.
    #[error("port range {base:#x}+{len} is empty or runs past 0xffff")]
    BadRange {
        /// First port.
        base: u16,
        /// Number of ports.
        len: u16,
    },
    /// The new range overlaps a device already on the bus.
    #[error("port range {base:#x}+{len} overlaps a device at {existing:#x}")]
    Overlap {
        /// First port of the new range.
        base: u16,
        /// Number of ports of the new range.
        len: u16,
        /// First port of the device it overlaps.
        existing: u16,
    },
}

struct Entry {
    base: u16,
    len: u16,
    device: Arc<dyn PioDevice>,
}

impl Entry {
    fn end(&self) -> u32 {
        u32::from(self.base) + u32::from(self.len)
    }
}

/// Maps port ranges to devices. Built before the vCPUs start, then only read.
#[derive(Default)]
pub struct IoBus {
    entries: Vec<Entry>,
}

impl IoBus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `device` at ports `base..base + len`.
    pub fn insert(
        &mut self,
        base: u16,
        len: u16,
        device: Arc<dyn PioDevice>,
    ) -> Result<(), BusError> {
        let new = Entry { base, len, device };
        if len == 0 || new.end() > 0x1_0000 {
            return Err(BusError::BadRange { base, len });
        }
        if let Some(e) = self
            .entries
            .iter()
            .find(|e| u32::from(base) < e.end() && u32::from(e.base) < new.end())
        {
            return Err(BusError::Overlap {
                base,
                len,
                existing: e.base,
            });
        }
        self.entries.push(new);
        Ok(())
    }

    /// The device answering `port`, and the port's offset from the device's base.
    pub fn find(&self, port: u16) -> Option<(&dyn PioDevice, u16)> {
        self.entries
            .iter()
            .find(|e| port >= e.base && u32::from(port) < e.end())
            .map(|e| (e.device.as_ref(), port - e.base))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Recorder(Mutex<Vec<(u16, Vec<u8>)>>);

    impl PioDevice for Recorder {
        fn read(&self, offset: u16, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&self, offset: u16, data: &[u8]) -> io::Result<()> {
            self.0.lock().unwrap().push((offset, data.to_vec()));
            Ok(())
        }
    }

    #[test]
    fn routes_ports_to_the_device_with_offsets() {
        let dev = Arc::new(Recorder::default());
        let mut bus = IoBus::new();
        bus.insert(0x3f8, 8, dev.clone()).unwrap();
        let (d, offset) = bus.find(0x3fd).unwrap();
        assert_eq!(offset, 5);
        d.write(offset, &[1]).unwrap();
        let mut buf = [0u8; 2];
        d.read(offset, &mut buf);
        assert_eq!(buf, [5, 5]);
        assert_eq!(dev.0.lock().unwrap()[0], (5, vec![1]));
        assert!(bus.find(0x3f7).is_none());
        assert!(bus.find(0x400).is_none());
    }

    #[test]
    fn rejects_overlaps_and_bad_ranges() {
        let mut bus = IoBus::new();
        bus.insert(0x10, 4, Arc::new(Recorder::default())).unwrap();
        let overlap = bus.insert(0x13, 2, Arc::new(Recorder::default()));
        assert_eq!(
            overlap,
            Err(BusError::Overlap {
                base: 0x13,
                len: 2,
                existing: 0x10
            })
        );
        bus.insert(0x14, 1, Arc::new(Recorder::default())).unwrap();
        assert!(matches!(
            bus.insert(0xffff, 2, Arc::new(Recorder::default())),
            Err(BusError::BadRange { .. })
        ));
        assert!(matches!(
            bus.insert(0x20, 0, Arc::new(Recorder::default())),
            Err(BusError::BadRange { .. })
        ));
        bus.insert(0xffff, 1, Arc::new(Recorder::default()))
            .unwrap();
        assert!(bus.find(0xffff).is_some());
    }
}
