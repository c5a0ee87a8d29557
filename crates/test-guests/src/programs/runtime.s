// The guest runtime: CPL0 exception stubs and a small CPL3 library that every
// guest program is assembled together with, into one position-independent image.
//
// Conventions
// - Intel syntax; names in braces are constants substituted from Rust (programs/mod.rs),
//   so this file must not contain other braces.
// - Only RIP-relative references inside the image and absolute guest-physical
//   constants: the image is copied to guest memory, so it must not need relocating.
// - Library routines follow the System V calling convention: arguments in rdi, rsi,
//   rdx, rcx, r8; rax, rcx, rdx, rsi, rdi, r8-r11 are clobbered.
// - CPL0 code is emulated instruction by instruction on PVM: keep it short.

    .pushsection .rodata.test_guests_image, "a"
    .balign 4096
    .globl test_guests_image_start
test_guests_image_start:

// ---------------------------------------------------------------------------
// CPL0: one 16-byte entry stub per exception vector 0..31, vector 0 first.
// Each pushes a zero error code where the CPU pushes none, then its vector.

.macro exception_stub vector, has_error_code
    .balign 16
    .if \has_error_code == 0
    push 0
    .endif
    push \vector
    jmp rt_exception_common
.endm

    .balign 16
    .globl test_guests_exception_stubs
test_guests_exception_stubs:
    exception_stub 0, 0
    exception_stub 1, 0
    exception_stub 2, 0
    exception_stub 3, 0
    exception_stub 4, 0
    exception_stub 5, 0
    .balign 16
    jmp rt_ud_dispatch          // vector 6, #UD: also the CPL3 -> CPL0 service call
    exception_stub 7, 0
    exception_stub 8, 1
    exception_stub 9, 0
    exception_stub 10, 1
    exception_stub 11, 1
    exception_stub 12, 1
    exception_stub 13, 1
    exception_stub 14, 1
    exception_stub 15, 0
    exception_stub 16, 0
    exception_stub 17, 1
    exception_stub 18, 0
    exception_stub 19, 0
    exception_stub 20, 0
    exception_stub 21, 1
    exception_stub 22, 0
    exception_stub 23, 0
    exception_stub 24, 0
    exception_stub 25, 0
    exception_stub 26, 0
    exception_stub 27, 0
    exception_stub 28, 0
    exception_stub 29, 1
    exception_stub 30, 1
    exception_stub 31, 0

// Reports an unexpected exception to the VMM, which ends the run.
// Stack: vector, error code, then the CPU's frame (rip, cs, rflags, rsp, ss).
// A #GP that apic-script's operations expect (programs/apic.s) resumes at
// rt_script_faulted instead.
rt_exception_common:
    cmp qword ptr [rsp], 13
    jne 2f
    push rax
    lea rax, [rip + rt_script_rdmsr]
    cmp rax, [rsp + 24]
    je 1f
    lea rax, [rip + rt_script_wrmsr]
    cmp rax, [rsp + 24]
    jne 3f
1:  lea rax, [rip + rt_script_faulted]
    mov [rsp + 24], rax
    pop rax
    add rsp, 16                 // the vector and the error code
    iretq
3:  pop rax
2:
    mov rax, cr2
    sub rsp, 40                 // ucall frame: cmd, vector, error code, rip, cr2
    mov qword ptr [rsp], {ucall_exception}
    mov rcx, [rsp + 40]
    mov [rsp + 8], rcx
    mov rcx, [rsp + 48]
    mov [rsp + 16], rcx
    mov rcx, [rsp + 56]
    mov [rsp + 24], rcx
    mov [rsp + 32], rax
    mov rax, {ucall_transport}
    cmp qword ptr [rax], 0
    jne 2f
    mov eax, esp
    mov dx, {ucall_port}
    out dx, eax
1:  jmp 1b                      // the VMM never resumes a vCPU after this
2:  mov rdi, rsp
    call rt_ucall_text          // ends the run through isa-debug-exit
    jmp 1b

// #UD from CPL3 is how guest programs ask for a CPL0 service: `int N` raises #UD
// on PVM even through a DPL3 gate, and `syscall` does not change privilege.
// eax holds the service number. #UD at CPL0, or an unknown service, is a real #UD.
rt_ud_dispatch:
    test byte ptr [rsp + 8], 3  // the faulting CS: CPL3?
    jz 1f
    cmp eax, {sys_cpuid}
    je rt_sys_cpuid
    cmp eax, {sys_shutdown}
    je rt_sys_shutdown
    cmp eax, {sys_halt}
    je rt_sys_halt
    cmp eax, {sys_wrmsr}
    je rt_sys_wrmsr
    cmp eax, {sys_rdmsr}
    je rt_sys_rdmsr
    cmp eax, {sys_apic_script}
    je rt_sys_apic_script
1:  push 0
    push 6
    jmp rt_exception_common

// Service `sys_cpuid`: CPUID leaf edi, subleaf esi, at CPL0. On PVM a CPL3 `cpuid`
// runs natively and returns the host's values; at CPL0 KVM answers with the CPUID
// the VMM set (the vCPU's own APIC ID, for one).
rt_sys_cpuid:
    mov eax, edi
    mov ecx, esi
    cpuid
    add qword ptr [rsp], 2      // return past the ud2
    iretq

// Service `sys_shutdown`: load an empty IDT and fault. Every exception then
// faults again (#GP, #DF): a triple fault, the way firmware resets a machine.
rt_sys_shutdown:
    lidt [rip + rt_null_idtr]
    ud2

rt_null_idtr:
    .word 0
    .quad 0

// Service `sys_halt`: halts unless the u64 at rdi is already >= rsi. The check
// runs with interrupts off and `sti; hlt` cannot be split (STI's shadow), so an
// interrupt that arrives after the check always ends the halt: no lost wake-up.
rt_sys_halt:
    cmp [rdi], rsi
    jae 1f
    sti
    hlt
1:  add qword ptr [rsp], 2
    iretq

// Service `sys_wrmsr`: MSR edi = rsi.
rt_sys_wrmsr:
    mov ecx, edi
    mov rax, rsi
    mov rdx, rsi
    shr rdx, 32
    wrmsr
    add qword ptr [rsp], 2
    iretq

// Service `sys_rdmsr`: rax = MSR edi.
rt_sys_rdmsr:
    mov ecx, edi
    rdmsr
    shl rdx, 32
    or rax, rdx
    add qword ptr [rsp], 2
    iretq

// CPL0: every external interrupt (vectors 32-255), on the interrupt stack
// (IST 1), whose top is this vCPU's interrupt record: the TSC of the last
// interrupt at +0, the number of interrupts at +8. Then EOI, and back.
// 3 pushes and the CPU's 5-quadword frame put the record at rsp + 64.
.macro irq_record
    push rax
    push rcx
    push rdx
    rdtsc
    mov [rsp + 64], eax
    mov [rsp + 68], edx
    inc qword ptr [rsp + 72]
.endm

    .balign 16
    .globl test_guests_irq_entry
test_guests_irq_entry:
    irq_record
    mov ecx, {msr_eoi}
    xor eax, eax
    xor edx, edx
    wrmsr
rt_irq_return:
    pop rdx
    pop rcx
    pop rax
    iretq

// The same for vectors 0xF0-0xFE, which xAPIC-mode programs use: EOI through
// the xAPIC page (the x2APIC EOI MSR #GPs in xAPIC mode).
    .balign 16
    .globl test_guests_xapic_irq_entry
test_guests_xapic_irq_entry:
    irq_record
    mov rax, {xapic_base}
    mov dword ptr [rax + 0xB0], 0
    jmp rt_irq_return

// ---------------------------------------------------------------------------
// CPL3 library.

// rt_ucall(cmd, arg0, arg1, arg2, arg3): reports to the VMM. The frame is built on
// the stack and its address goes out on the ucall port (stacks are below 4 GiB).
rt_ucall:
    sub rsp, 40
    mov [rsp], rdi
    mov [rsp + 8], rsi
    mov [rsp + 16], rdx
    mov [rsp + 24], rcx
    mov [rsp + 32], r8
    mov rax, {ucall_transport}
    cmp qword ptr [rax], 0
    jne 1f
    mov eax, esp
    mov dx, {ucall_port}
    out dx, eax
    add rsp, 40
    ret
1:  mov rdi, rsp
    call rt_ucall_text
    add rsp, 40
    ret

// rt_ucall_text(frame): the ucall as one line on the serial console, for a
// VMM without the ucall port: "@ucall <vcpu> <cmd> <arg0> <arg1> <arg2> <arg3>",
// then " <string at arg0>" for a report or an assertion. The vCPU index
// comes from the stack pointer, which is inside the vCPU's area. Then, on
// QEMU's isa-debug-exit port: a failure ends the run at once (1), and the
// last vCPU to finish ends it (0). Also called at CPL0, from an exception.
rt_ucall_text:
    push rbx
    push r12
    mov rbx, rdi
    call rt_serial_lock
    lea rdi, [rip + rt_ucall_tag]
    call rt_serial_puts
    mov rax, rsp
    sub rax, {vcpu_area_base}
    xor edx, edx
    mov ecx, {vcpu_area_size}
    div rcx
    mov rdi, rax
    call rt_serial_put_dec
    xor r12d, r12d
1:  mov edi, 32                 // ' ', then cmd and the 4 args
    call rt_serial_putc
    mov rdi, [rbx + r12 * 8]
    call rt_serial_put_dec
    inc r12
    cmp r12, 5
    jb 1b
    mov rax, [rbx]
    cmp rax, {ucall_report}
    je 2f
    cmp rax, {ucall_assert}
    jne 3f
2:  mov edi, 32
    call rt_serial_putc
    mov rdi, [rbx + 8]
    call rt_serial_puts
3:  mov edi, 10                 // '\n'
    call rt_serial_putc
    call rt_serial_unlock
    mov rax, [rbx]
    pop r12
    pop rbx
    cmp rax, {ucall_report}
    je 4f
    cmp rax, {ucall_done}
    je 5f
    mov al, 1                   // an assertion or exception: the run failed
    jmp rt_debug_exit
4:  ret
5:  mov rax, {done_count}
    lock inc qword ptr [rax]
    mov rcx, {boot_vcpus}
    mov rcx, [rcx]
    cmp [rax], rcx
    jb 4b
    xor eax, eax
// rt_debug_exit(al): QEMU's isa-debug-exit ends QEMU with status al * 2 + 1;
// a VMM without it goes on to the next: Cloud Hypervisor's ACPI shutdown
// (S5), then the i8042's reset, which Firecracker takes as the end. The
// status is then in the lines on COM1.
rt_debug_exit:
    mov dx, {debug_exit_port}
    out dx, al
    mov al, {acpi_s5}
    mov dx, {acpi_shutdown_port}
    out dx, al
    mov al, {i8042_reset}
    mov dx, {i8042_command_port}
    out dx, al
    ret

rt_ucall_tag: .asciz "@ucall "

// rt_cpuid(leaf, subleaf) -> eax, ebx, ecx, edx as the VMM configured them.
rt_cpuid:
    mov eax, {sys_cpuid}
    ud2
    ret

// rt_halt_below(addr: *const u64, value: u64): halts until an interrupt, unless
// *addr >= value already (checked with interrupts off: see rt_sys_halt).
rt_halt_below:
    mov eax, {sys_halt}
    ud2
    ret

// rt_wrmsr(msr: u32, value: u64)
rt_wrmsr:
    mov eax, {sys_wrmsr}
    ud2
    ret

// rt_rdmsr(msr: u32) -> u64
rt_rdmsr:
    mov eax, {sys_rdmsr}
    ud2
    ret

// rt_apic_enable(): turns on x2APIC mode in IA32_APIC_BASE, then software-enables
// the local APIC (SVR = spurious vector 0xFF | enable), as a guest kernel does
// once at boot. (The userspace APIC starts in x2APIC mode; KVM's does not.)
rt_apic_enable:
    mov edi, {msr_apic_base}
    call rt_rdmsr
    or rax, 0xc00               // enabled, x2APIC mode
    mov edi, {msr_apic_base}
    mov rsi, rax
    call rt_wrmsr
    mov edi, {msr_svr}
    mov esi, 0x1ff
    jmp rt_wrmsr

// rt_apic_enable_all(count): rt_apic_enable, then waits until all `count` vCPUs
// have enabled theirs: an APIC that is not enabled yet drops a fixed IPI (as
// KVM's does), so no vCPU sends one before every APIC can take it.
rt_apic_enable_all:
    push rdi
    call rt_apic_enable
    pop rdi
// rt_apics_ready(count): counts this vCPU's APIC in, then waits for all `count`.
rt_apics_ready:
    mov rax, {apic_ready}
    lock inc qword ptr [rax]
1:  cmp [rax], rdi
    jae 2f
    pause
    jmp 1b
2:  ret

// rt_xapic_enable_all(count): the same in xAPIC mode: software-enables the
// APIC through its page (SVR at +0xF0), then waits for every vCPU's.
rt_xapic_enable_all:
    mov rax, {xapic_base}
    mov dword ptr [rax + 0xF0], 0x1ff
    jmp rt_apics_ready

// rt_xapic_send_ipi(dest: u8, vector: u8): a fixed IPI through the xAPIC page:
// the destination into the ICR's high half (bits 31:24), then the low half sends.
rt_xapic_send_ipi:
    mov rax, {xapic_base}
    shl edi, 24
    mov [rax + 0x310], edi
    movzx esi, sil
    mov [rax + 0x300], esi
    ret

// rt_send_ipi(dest: u32, vector: u8): a fixed IPI to x2APIC ID `dest`.
rt_send_ipi:
    shl rdi, 32
    movzx esi, sil
    or rsi, rdi
    mov edi, {msr_icr}
    jmp rt_wrmsr

// rt_report(name: *const c_char, value: u64): a named value for the VMM's report.
rt_report:
    mov rdx, rsi
    mov rsi, rdi
    mov edi, {ucall_report}
    jmp rt_ucall

// rt_assert_fail(message: *const c_char, a: u64, b: u64): ends the run with an error.
rt_assert_fail:
    mov rcx, rdx
    mov rdx, rsi
    mov rsi, rdi
    mov edi, {ucall_assert}
    call rt_ucall
    jmp rt_spin_forever

// rt_done(): this vCPU has finished; the VMM stops running it.
rt_done:
    mov edi, {ucall_done}
    call rt_ucall
    // fall through: the VMM does not resume a vCPU after done

// rt_spin_forever(): spins at CPL3 until the VMM stops the vCPU.
rt_spin_forever:
    pause
    jmp rt_spin_forever

// rt_serial_lock() / rt_serial_unlock(): one writer at a time on the console, so
// lines from different vCPUs do not interleave.
rt_serial_lock:
    mov eax, {serial_lock}
1:  lock bts dword ptr [rax], 0
    jnc 2f
    pause
    jmp 1b
2:  ret

rt_serial_unlock:
    mov eax, {serial_lock}
    mov dword ptr [rax], 0      // x86 stores have release semantics
    ret

// rt_serial_putc(c: u8)
rt_serial_putc:
    mov eax, edi
    mov dx, {serial_port}
    out dx, al
    ret

// rt_serial_puts(s: *const c_char)
rt_serial_puts:
    mov dx, {serial_port}
1:  mov al, [rdi]
    test al, al
    jz 2f
    out dx, al
    inc rdi
    jmp 1b
2:  ret

// rt_serial_put_dec(value: u64): writes value in decimal.
rt_serial_put_dec:
    sub rsp, 24                 // digit buffer, filled from the end
    lea rsi, [rsp + 24]
    mov rax, rdi
    mov ecx, 10
1:  xor edx, edx
    div rcx
    add dl, 48                  // '0'
    dec rsi
    mov [rsi], dl
    test rax, rax
    jnz 1b
    lea rcx, [rsp + 24]
    mov dx, {serial_port}
2:  mov al, [rsi]
    out dx, al
    inc rsi
    cmp rsi, rcx
    jne 2b
    add rsp, 24
    ret
