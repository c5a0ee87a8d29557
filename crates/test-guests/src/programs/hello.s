// hello: every vCPU greets on the serial console, then reports its APIC ID (as
// CPUID reports it, through the runtime's CPL0 service) and a TSC reading through ucall, and finishes.
// Entry: rdi = vCPU index, rsi = vCPU count, rdx = per-vCPU data block.

    .globl test_guests_hello
test_guests_hello:
    mov r12, rdi

    call rt_serial_lock
    lea rdi, [rip + hello_greeting]
    call rt_serial_puts
    mov rdi, r12
    call rt_serial_put_dec
    mov edi, 10                 // '\n'
    call rt_serial_putc
    call rt_serial_unlock

    mov edi, 1                  // CPUID.1:EBX[31:24] is the initial APIC ID
    xor esi, esi
    call rt_cpuid
    shr ebx, 24
    lea rdi, [rip + hello_apic_id]
    mov esi, ebx
    call rt_report

    rdtsc
    shl rdx, 32
    or rax, rdx
    lea rdi, [rip + hello_tsc]
    mov rsi, rax
    call rt_report

    jmp rt_done

hello_greeting: .asciz "hello from vcpu "
hello_apic_id:  .asciz "apic_id"
hello_tsc:      .asciz "tsc"
