//! The state a vCPU starts in: 64-bit mode at CPL3, paging on, its own TSS and IDT.
//!
//! The vCPU never passes through real or protected mode: KVM lets the VMM set
//! long-mode segment and control registers directly, and on PVM any CPL0 code
//! (a firmware-style mode switch included) would be emulated instruction by
//! instruction.

use kvm_bindings::{CpuId, kvm_regs, kvm_sregs};

use super::gdt::{KERNEL_CS, KERNEL_DS, USER_CS, USER_DS, flat_segment, task_register};

/// CR0: PE, MP, ET, NE, WP, AM, PG.
pub const CR0: u64 = 0x8005_0033;
/// CR4: PAE, OSFXSR, OSXMMEXCPT (SSE usable from guest programs).
pub const CR4: u64 = 0x620;
/// EFER: SCE, LME, LMA.
pub const EFER: u64 = 0x501;
/// RFLAGS at entry: reserved bit 1 and IF, so interrupts can reach CPL3 code.
pub const RFLAGS: u64 = 0x202;

/// Where a vCPU's descriptor tables and stacks are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VcpuBootInfo {
    /// vCPU index (also its APIC ID).
    pub index: u32,
    /// Guest address of the GDT and its limit.
    pub gdt: (u64, u16),
    /// Guest address of this vCPU's IDT and its limit.
    pub idt: (u64, u16),
    /// Guest address of this vCPU's TSS.
    pub tss: u64,
    /// Guest address of the top-level page table.
    pub cr3: u64,
}

/// Sets `sregs` for 64-bit CPL3 execution with the tables in `boot`.
pub fn long_mode_sregs(sregs: &mut kvm_sregs, boot: &VcpuBootInfo) {
    sregs.cs = flat_segment(USER_CS);
    let data = flat_segment(USER_DS);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = task_register(boot.index, boot.tss);
    sregs.gdt.base = boot.gdt.0;
    sregs.gdt.limit = boot.gdt.1;
    sregs.idt.base = boot.idt.0;
    sregs.idt.limit = boot.idt.1;
    sregs.cr0 = CR0;
    sregs.cr3 = boot.cr3;
    sregs.cr4 = CR4;
    sregs.efer = EFER;
}

/// CR0 at a PVH entry: protected mode (PE) and ET, paging off.
const PVH_CR0: u64 = 0x11;
/// RFLAGS at a PVH entry: only the reserved bit; interrupts off.
const PVH_RFLAGS: u64 = 0x2;

/// Sets `sregs` as the PVH boot protocol enters an image: 32-bit protected
/// mode, paging off, CPL0, flat 4 GiB code and data segments, a valid task
/// register; `gdt` is the image's GDT (its start-up loads its own anyway).
pub fn pvh_sregs(sregs: &mut kvm_sregs, gdt: (u64, u16)) {
    let mut code = flat_segment(KERNEL_CS);
    code.l = 0;
    code.db = 1;
    sregs.cs = code;
    let data = flat_segment(KERNEL_DS);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = task_register(0, 0);
    sregs.gdt.base = gdt.0;
    sregs.gdt.limit = gdt.1;
    sregs.idt.base = 0;
    sregs.idt.limit = 0;
    sregs.cr0 = PVH_CR0;
    sregs.cr3 = 0;
    sregs.cr4 = 0;
    sregs.efer = 0;
}

/// General registers at a PVH entry `rip`: interrupts off, no start-info
/// structure (`rbx` = 0: the image's start-up reads none).
pub fn pvh_regs(rip: u64) -> kvm_regs {
    kvm_regs {
        rip,
        rflags: PVH_RFLAGS,
        ..Default::default()
    }
}

/// General registers at entry: the program's ABI is
/// `entry(rdi = vcpu index, rsi = vcpu count, rdx = per-vCPU data block)`.
pub fn entry_regs(rip: u64, rsp: u64, index: u32, count: u32, data: u64) -> kvm_regs {
    kvm_regs {
        rip,
        rsp,
        rflags: RFLAGS,
        rdi: u64::from(index),
        rsi: u64::from(count),
        rdx: data,
        ..Default::default()
    }
}

/// CPUID leaves that carry the APIC ID.
const LEAF_FEATURES: u32 = 1;
const LEAF_X2APIC_TOPOLOGY: u32 = 0xB;
const LEAF_V2_TOPOLOGY: u32 = 0x1F;

/// Makes CPUID report `apic_id` as the vCPU's initial (x2)APIC ID.
pub fn set_apic_id(cpuid: &mut CpuId, apic_id: u32) {
    for entry in cpuid.as_mut_slice() {
        match entry.function {
            LEAF_FEATURES => entry.ebx = (entry.ebx & 0x00FF_FFFF) | (apic_id << 24),
            LEAF_X2APIC_TOPOLOGY | LEAF_V2_TOPOLOGY => entry.edx = apic_id,
            _ => {}
        }
    }
}

/// CPUID.1:ECX bits of the local-APIC features both irqchips emulate.
const X2APIC: u32 = 1 << 21;
const TSC_DEADLINE_TIMER: u32 = 1 << 24;

/// Makes CPUID advertise x2APIC and the TSC-deadline timer, which the guest
/// programs use and both the userspace and KVM's LAPIC emulate (KVM's enables
/// the TSC-deadline mode only if CPUID has it).
pub fn advertise_apic_features(cpuid: &mut CpuId) {
    for entry in cpuid.as_mut_slice() {
        if entry.function == LEAF_FEATURES {
            entry.ecx |= X2APIC | TSC_DEADLINE_TIMER;
        }
    }
}

/// CPUID leaf whose EAX\[7:0\] is MAXPHYADDR.
const LEAF_ADDRESS_SIZES: u32 = 0x8000_0008;
/// MAXPHYADDR where CPUID does not report it (SDM 4.1.4).
const DEFAULT_PHYS_BITS: u8 = 36;

/// The physical-address width (MAXPHYADDR) `cpuid` gives a vCPU.
pub fn phys_bits(cpuid: &CpuId) -> u8 {
    cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == LEAF_ADDRESS_SIZES)
        .map_or(DEFAULT_PHYS_BITS, |e| e.eax as u8)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    #[test]
    fn phys_bits_are_leaf_0x80000008s_or_36() {
        let sizes = kvm_cpuid_entry2 {
            function: 0x8000_0008,
            eax: 0x3030,
            ..Default::default()
        };
        assert_eq!(phys_bits(&CpuId::from_entries(&[sizes]).unwrap()), 0x30);
        assert_eq!(phys_bits(&CpuId::new(0).unwrap()), 36);
    }

    #[test]
    fn sregs_enter_long_mode_at_cpl3() {
        let mut sregs = kvm_sregs::default();
        let boot = VcpuBootInfo {
            index: 2,
            gdt: (0x1000, 0x5f),
            idt: (0x5000, 0xfff),
            tss: 0x9000,
            cr3: 0x2000,
        };
        long_mode_sregs(&mut sregs, &boot);
        assert_eq!(sregs.cs.dpl, 3);
        assert_eq!(sregs.cs.selector & 3, 3);
        assert_eq!(sregs.ss.selector, USER_DS);
        assert_eq!(sregs.tr.selector, 0x50);
        assert_eq!(sregs.tr.base, 0x9000);
        assert_eq!(sregs.efer & 0x500, 0x500);
        assert_ne!(sregs.cr0 & (1 << 31), 0);
        assert_eq!((sregs.idt.base, sregs.gdt.limit), (0x5000, 0x5f));
    }

    #[test]
    fn pvh_entry_is_flat_32_bit_protected_mode_without_paging() {
        let mut sregs = kvm_sregs::default();
        pvh_sregs(&mut sregs, (0x1f_0000, 0x42f));
        assert_eq!((sregs.cs.l, sregs.cs.db, sregs.cs.dpl), (0, 1, 0));
        assert_eq!((sregs.cs.base, sregs.cs.limit), (0, 0xffff_ffff));
        assert_eq!(sregs.ss.db, 1);
        assert_eq!((sregs.cr0 & 1, sregs.cr0 >> 31, sregs.efer), (1, 0, 0));
        assert_eq!((sregs.gdt.base, sregs.gdt.limit), (0x1f_0000, 0x42f));
        assert_eq!(pvh_regs(0x10_2000).rflags & 0x200, 0, "interrupts off");
    }

    #[test]
    fn entry_regs_follow_the_program_abi() {
        let regs = entry_regs(0x10_0000, 0x21_8000, 3, 4, 0x21_8000);
        assert_eq!(
            (regs.rip, regs.rsp, regs.rdi, regs.rsi),
            (0x10_0000, 0x21_8000, 3, 4)
        );
        assert_eq!(regs.rflags, 0x202);
    }

    #[test]
    fn apic_id_is_patched_into_cpuid() {
        let entries = [
            kvm_cpuid_entry2 {
                function: 1,
                ebx: 0xAB00_0800,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 0xB,
                edx: 9,
                ..Default::default()
            },
            kvm_cpuid_entry2 {
                function: 7,
                ebx: 0x1234,
                ..Default::default()
            },
        ];
        let mut cpuid = CpuId::from_entries(&entries).unwrap();
        set_apic_id(&mut cpuid, 5);
        advertise_apic_features(&mut cpuid);
        let e = cpuid.as_slice();
        assert_eq!(e[0].ebx, 0x0500_0800);
        assert_eq!(e[0].ecx, X2APIC | TSC_DEADLINE_TIMER);
        assert_eq!(e[1].edx, 5);
        assert_eq!((e[2].ebx, e[2].ecx), (0x1234, 0), "other leaves untouched");
    }
}
