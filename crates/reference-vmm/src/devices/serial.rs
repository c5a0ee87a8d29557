//! The serial console: vm-superio's 16550 UART on the port-I/O bus.

use std::convert::Infallible;
use std::io::{self, Write};
use std::sync::{Arc, Mutex, PoisonError};

use vm_superio::{Serial, Trigger};

use super::PioDevice;

/// An interrupt line that goes nowhere.
///
/// Without an interrupt controller (this VMM's first version) the UART cannot
/// interrupt the guest; guest programs write to it without waiting.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoIrq;

impl Trigger for NoIrq {
    type E = Infallible;

    fn trigger(&self) -> Result<(), Infallible> {
        Ok(())
    }
}

/// The guest's console: a 16550 whose output goes to any writer (stdout, a file).
pub struct SerialConsole {
    uart: Mutex<Serial<NoIrq, vm_superio::serial::NoEvents, Box<dyn Write + Send>>>,
}

impl SerialConsole {
    /// A console writing the guest's output to `out`.
    pub fn new(out: Box<dyn Write + Send>) -> Self {
        Self {
            uart: Mutex::new(Serial::new(NoIrq, out)),
        }
    }
}

impl PioDevice for SerialConsole {
    fn read(&self, offset: u16, data: &mut [u8]) {
        let mut uart = self.uart.lock().unwrap_or_else(PoisonError::into_inner);
        data.fill(0);
        if let (Some(first), Ok(offset)) = (data.first_mut(), u8::try_from(offset)) {
            *first = uart.read(offset);
        }
    }

    fn write(&self, offset: u16, data: &[u8]) -> io::Result<()> {
        let mut uart = self.uart.lock().unwrap_or_else(PoisonError::into_inner);
        let (Some(&value), Ok(offset)) = (data.first(), u8::try_from(offset)) else {
            return Ok(());
        };
        uart.write(offset, value).map_err(|e| match e {
            vm_superio::serial::Error::IOError(e) => e,
            other => io::Error::other(format!("{other:?}")),
        })?;
        uart.writer_mut().flush()
    }
}

/// A writer whose bytes can be read back from a clone: captures a guest's serial
/// output for a test or a tool.
#[derive(Clone, Debug, Default)]
pub struct SharedBuffer(Arc<Mutex<Vec<u8>>>);

impl SharedBuffer {
    /// Everything written so far.
    pub fn contents(&self) -> Vec<u8> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Write for SharedBuffer {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Broken;

    impl Write for Broken {
        fn write(&mut self, _: &[u8]) -> io::Result<usize> {
            Err(io::Error::from(io::ErrorKind::BrokenPipe))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn bytes_written_to_thr_reach_the_output() {
        let out = SharedBuffer::default();
        let console = SerialConsole::new(Box::new(out.clone()));
        for b in b"hi\n" {
            console.write(0, &[*b]).unwrap();
        }
        assert_eq!(out.contents(), b"hi\n");
    }

    #[test]
    fn line_status_says_the_transmitter_is_empty() {
        let console = SerialConsole::new(Box::new(SharedBuffer::default()));
        let mut lsr = [0u8; 1];
        console.read(5, &mut lsr);
        assert_eq!(lsr[0] & 0x20, 0x20);
    }

    #[test]
    fn output_errors_are_reported_not_swallowed() {
        let console = SerialConsole::new(Box::new(Broken));
        let err = console.write(0, b"x").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::BrokenPipe);
    }
}
