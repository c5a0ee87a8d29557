//! Port-I/O devices, the bus that routes guest port accesses to them, and
//! the bounded buffer between the console and its output.

mod access;
mod bus;
pub mod completion;
mod output;
mod post;
mod serial;

pub use access::{BusAccess, BusRead, RcuBus};
pub use bus::{BusError, IoBus, PioDevice};
pub use output::{BoundedOutput, OUTPUT_BUFFER_BYTES, OutputDrain};
pub use post::{POST_PORT, PostCode};
pub use serial::{NoIrq, SerialConsole, SharedBuffer};
