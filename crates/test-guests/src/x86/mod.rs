//! x86-64 structures a VMM builds in guest memory and in vCPU registers to
//! start the programs, and the local-APIC registers they use.

pub mod apic;
pub mod boot;
pub mod gdt;
pub mod idt;
pub mod paging;
