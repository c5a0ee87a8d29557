//! Port-I/O devices and the bus that routes guest port accesses to them.

mod bus;
mod post;
mod serial;
mod shared;

pub use bus::{BusError, IoBus, PioDevice};
pub use post::{POST_PORT, PostCode};
pub use serial::{NoIrq, SerialConsole, SharedBuffer};
pub use shared::SharedBus;
