//! The POST-code port (0x80): firmware writes progress codes there; the VMM
//! keeps the last one. A device with next to no work, so that an exit to it
//! costs the exit path itself.

use std::io;
use std::sync::atomic::{AtomicU8, Ordering::Relaxed};

use super::PioDevice;

pub use test_guests::abi::POST_PORT;

/// Keeps the last byte written.
#[derive(Debug, Default)]
pub struct PostCode(AtomicU8);

impl PostCode {
    /// The last code written.
    pub fn last(&self) -> u8 {
        self.0.load(Relaxed)
    }
}

impl PioDevice for PostCode {
    fn read(&self, _: u16, data: &mut [u8]) {
        data.fill(self.last());
    }

    fn write(&self, _: u16, data: &[u8]) -> io::Result<()> {
        if let Some(&b) = data.last() {
            self.0.store(b, Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_code() {
        let p = PostCode::default();
        p.write(0, &[1, 0x42]).unwrap();
        let mut b = [0; 2];
        p.read(0, &mut b);
        assert_eq!((p.last(), b), (0x42, [0x42; 2]));
    }
}
