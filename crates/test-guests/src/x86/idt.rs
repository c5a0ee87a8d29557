//! The interrupt descriptor table.
//!
//! Every vector that has a handler gets a 64-bit interrupt gate on the kernel code
//! segment; the others stay not-present, so delivering one raises #NP, which the
//! runtime reports to the VMM like any other exception.

use super::gdt::KERNEL_CS;

/// Number of gates in a full IDT.
pub const IDT_ENTRIES: usize = 256;
/// Size of a full IDT in bytes.
pub const IDT_SIZE: usize = IDT_ENTRIES * 16;

/// Present, DPL 0, 64-bit interrupt gate (interrupts disabled on entry).
const INTERRUPT_GATE: u8 = 0x8E;

/// The 16-byte gate for a handler at guest address `handler`, on the stack
/// of interrupt-stack-table entry `ist` (0: the usual stack switch).
pub fn interrupt_gate(handler: u64, ist: u8) -> [u64; 2] {
    let low = (handler & 0xFFFF)
        | u64::from(KERNEL_CS) << 16
        | u64::from(ist & 7) << 32
        | u64::from(INTERRUPT_GATE) << 40
        | ((handler >> 16) & 0xFFFF) << 48;
    [low, handler >> 32]
}

/// A full IDT with a gate for each `(vector, handler, ist)`, as bytes.
pub fn build_idt(handlers: impl IntoIterator<Item = (u8, u64, u8)>) -> Vec<u8> {
    let mut idt = vec![0u8; IDT_SIZE];
    for (vector, handler, ist) in handlers {
        let at = usize::from(vector) * 16;
        let [low, high] = interrupt_gate(handler, ist);
        idt[at..at + 8].copy_from_slice(&low.to_le_bytes());
        idt[at + 8..at + 16].copy_from_slice(&high.to_le_bytes());
    }
    idt
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_splits_the_handler_address() {
        let [low, high] = interrupt_gate(0x1122_3344_5566_7788, 1);
        assert_eq!(low & 0xFFFF, 0x7788);
        assert_eq!((low >> 16) & 0xFFFF, 0x08);
        assert_eq!((low >> 32) & 0x7, 1, "IST 1");
        assert_eq!((low >> 40) & 0xFF, 0x8E);
        assert_eq!(low >> 48, 0x5566);
        assert_eq!(high, 0x1122_3344);
    }

    #[test]
    fn only_given_vectors_are_present() {
        let idt = build_idt([(0, 0x1000, 0), (13, 0x2000, 0)]);
        let present = |v: usize| idt[v * 16 + 5] & 0x80 != 0;
        assert!(present(0) && present(13));
        assert!(!present(1) && !present(255));
    }
}
