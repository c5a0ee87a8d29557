// The PVH entry: how a VMM that boots ELF images starts this image (QEMU's
// `-kernel`, the reference VMM's `run --image`; the file comes from
// `Image::build`, see pvh.rs). The PVH boot protocol enters here in 32-bit
// protected mode, paging off, at CPL0. In a few instructions this does what a
// direct boot does with KVM_SET_SREGS (x86/boot.rs): long mode on the image's
// page tables, its GDT, the vCPU's TSS and IDT; then it probes for the ucall
// port (without it, the legacy PICs are masked), and enters the program at
// CPL3 with the program ABI's registers.
// A VMM with the ucall port starts every vCPU here; elsewhere the boot vCPU starts the others
// with INIT and start-up IPIs through a real-mode trampoline (below).
// CPL0 code is emulated on PVM: keep it short. The image always lives at
// IMAGE_ADDR, so the 32-bit part's absolute addresses are the image's base
// plus a label's offset.

// PAE paging on the image's page tables, and EFER.LME: long mode starts at
// the next CR0 write that turns paging on (both ways in run this).
.macro long_mode_tables
    mov eax, {cr4}
    mov cr4, eax
    mov eax, {pml4}
    mov cr3, eax
    mov ecx, {msr_efer}
    mov eax, {efer_lme}
    xor edx, edx
    wrmsr
.endm

    .code32
    .balign 16
    .globl test_guests_pvh_entry
test_guests_pvh_entry:
    long_mode_tables
    mov eax, {cr0}              // paging on: long mode, in 32-bit code for now
    mov cr0, eax
    lgdt [{boot_table}]
    .byte 0xea                  // ljmp to 64-bit kernel code
    .long {image_addr} + rt_pvh_long_mode - test_guests_image_start
    .word {kernel_cs}

    .code64
rt_pvh_long_mode:
    mov eax, {kernel_ds}
    mov ds, ax
    mov es, ax
    mov ss, ax
    mov eax, 1                  // CPUID.1:EBX[31:24]: the initial APIC ID,
    cpuid                       // which is the vCPU index
    shr ebx, 24
    mov eax, ebx
    imul eax, eax, {vcpu_area_size}
    lea rsi, [rax + {vcpu_area_base}]
    lea rsp, [rsi + {exception_stack}]
    mov eax, ebx                // this vCPU's TSS descriptor
    shl eax, 4
    add eax, {tss_base_selector}
    ltr ax
    sub rsp, 16                 // this vCPU's IDT, by a pseudo-descriptor
    mov word ptr [rsp + 6], {idt_limit}
    lea rax, [rsi + {idt_offset}]
    mov [rsp + 8], rax
    lidt [rsp + 6]
    add rsp, 16
    mov dx, {ucall_port}        // only a VMM with the port answers
    in eax, dx
    xor ecx, ecx
    cmp eax, {ucall_probe}
    setne cl
    mov rax, {ucall_transport}
    mov [rax], rcx
    jrcxz 1f                    // that VMM starts every vCPU itself
    test ebx, ebx
    jnz 1f
    mov al, 0xff                // elsewhere the boot vCPU masks the legacy
    out {pic_master_data}, al   // PICs, as a kernel does (a VMM may raise
    out {pic_slave_data}, al    // their lines: Firecracker on a restore)
    push rsi                    // and starts the others
    call rt_pvh_start_aps
    pop rsi
1:  push {user_ds}              // iretq to the program at CPL3
    lea rax, [rsi + {user_stack}]
    push rax
    push {rflags}
    push {user_cs}
    mov rax, {boot_table}
    push qword ptr [rax + 8]
    mov edi, ebx                // rdi = index, rsi = count, rdx = data block
    lea rdx, [rsi + {vcpu_data}]
    mov rsi, [rax + 16]
    iretq

// The boot vCPU starts the others as firmware does: it copies the real-mode
// trampoline below 1 MiB with the GDT's pseudo-descriptor, then sends INIT
// and two start-up IPIs to all but itself through the xAPIC page.
rt_pvh_start_aps:
    mov rax, {boot_table}
    cmp qword ptr [rax + 16], 1
    jbe 1f
    mov rdx, [rax]
    lea rsi, [rip + rt_pvh_trampoline]
    lea rcx, [rip + rt_pvh_trampoline_end]
    sub rcx, rsi
    mov edi, {trampoline}
    rep movsb
    mov [rdi - 8], rdx          // its last 8 bytes: the pseudo-descriptor
    mov rax, {xapic_base}
    mov dword ptr [rax + 0xF0], 0x1ff   // SVR: the APIC software-enabled
    mov dword ptr [rax + 0x300], 0xC4500 // INIT, all but self
    mov dword ptr [rax + 0x300], 0xC4600 + {trampoline} / 4096 // SIPI
    mov dword ptr [rax + 0x300], 0xC4600 + {trampoline} / 4096
1:  ret

// An AP's first instructions, in real mode at CS:IP = trampoline page:0.
// Straight into long mode (PE and PG at once), then the common path above.
    .code16
rt_pvh_trampoline:
    cli
    long_mode_tables
    .byte 0x66, 0x2e, 0x0f, 0x01, 0x16 // lgdt cs:[gdtr], 32-bit base
    .word rt_pvh_trampoline_gdtr - rt_pvh_trampoline
    mov eax, {cr0}
    mov cr0, eax
    .byte 0x66, 0xea            // ljmp to 64-bit kernel code
    .long {image_addr} + rt_pvh_long_mode - test_guests_image_start
    .word {kernel_cs}
    .balign 8
rt_pvh_trampoline_gdtr:
    .quad 0
rt_pvh_trampoline_end:
    .code64
