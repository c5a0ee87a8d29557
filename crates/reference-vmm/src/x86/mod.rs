//! x86-64 structures the VMM builds in guest memory and in vCPU registers.

pub mod boot;
pub mod gdt;
pub mod idt;
pub mod paging;
