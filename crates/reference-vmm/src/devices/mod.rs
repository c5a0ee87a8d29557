//! Port-I/O devices and the bus that routes guest port accesses to them.

mod bus;
mod serial;
mod shared;

pub use bus::{BusError, IoBus, PioDevice};
pub use serial::{NoIrq, SerialConsole, SharedBuffer};
pub use shared::SharedBus;
