// Guests that push on a bound the VMM keeps, one each, so that the tests can
// check that the bound holds. Entry: rdi = vCPU index, rsi = vCPU count,
// rdx = per-vCPU data block.

// report-flood: every vCPU reports the same named value for ever.
    .globl test_guests_report_flood
test_guests_report_flood:
1:  lea rdi, [rip + 10f]
    xor esi, esi
    call rt_report
    jmp 1b
10: .asciz "flood"

// serial-flood: every vCPU writes to the serial port for ever, without waiting
// for the transmitter.
    .globl test_guests_serial_flood
test_guests_serial_flood:
    mov dx, {serial_port}
    mov al, 0x78                // 'x'
1:  out dx, al
    jmp 1b

// periodic-timer: vCPU 0 runs its LAPIC timer in periodic mode (vector 0x58,
// divide by 1) with an initial count of params[0]. Unmasked (params[2] = 0)
// it spins until params[1] interrupts have arrived; masked (params[2] = 1) it
// makes params[1] exits to the POST-code port, 1000 pauses apart. Reports the
// interrupts it took ("irqs") and the TSC ticks from arming to the end ("ticks").
    .globl test_guests_periodic_timer
test_guests_periodic_timer:
    test rdi, rdi
    jnz 9f
    lea r13, [rdx - {irq_record_below_data}]
    call rt_apic_enable
    mov edi, {msr_timer_divide}
    mov esi, 0xb                // divide by 1
    call rt_wrmsr
    mov r15, [{params} + 16]
    and r15d, 1                 // 1: masked
    mov esi, r15d
    shl esi, 16
    or esi, 0x20058             // periodic, vector 0x58
    mov edi, {msr_lvt_timer}
    call rt_wrmsr
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov r12, rax
    mov edi, {msr_timer_initial}
    mov rsi, [{params}]
    call rt_wrmsr
    mov r14, [{params} + 8]
    test r15, r15
    jnz 3f
1:  cmp [r13 + 8], r14          // unmasked: until params[1] interrupts came
    jae 7f
    pause
    jmp 1b
3:  test r14, r14               // masked: params[1] exits
    jz 7f
    dec r14
    mov dx, {post_port}
    out dx, al
    mov ecx, 1000
4:  pause
    dec ecx
    jnz 4b
    jmp 3b
7:  rdtsc
    shl rdx, 32
    or rax, rdx
    sub rax, r12
    lea rdi, [rip + 10f]
    mov rsi, rax
    call rt_report
    lea rdi, [rip + 11f]
    mov rsi, [r13 + 8]
    call rt_report
9:  call rt_done
10: .asciz "ticks"
11: .asciz "irqs"

// xapic-bytes: vCPU 0, its APIC in xAPIC mode as at reset, accesses the xAPIC
// page with 1-, 2- and 8-byte loads and stores and reports what it read:
// "id_byte" (byte 3 of the ID register: the APIC ID), "version_word" (bits
// 15:0 of the version register), "version_qword" (an 8-byte load, which runs
// past the register), "tpr_after_byte_store" (TPR after a 1-byte store of
// 0x80), "tpr_after_dword_store" (after a 32-bit store of 0x40).
    .globl test_guests_xapic_bytes
test_guests_xapic_bytes:
    test rdi, rdi
    jnz 9f
    mov rbx, {xapic_base}
    movzx esi, byte ptr [rbx + 0x23]
    lea rdi, [rip + 10f]
    call rt_report
    movzx esi, word ptr [rbx + 0x30]
    lea rdi, [rip + 11f]
    call rt_report
    mov rsi, qword ptr [rbx + 0x30]
    lea rdi, [rip + 12f]
    call rt_report
    mov byte ptr [rbx + 0x80], 0x80
    mov esi, dword ptr [rbx + 0x80]
    lea rdi, [rip + 13f]
    call rt_report
    mov dword ptr [rbx + 0x80], 0x40
    mov esi, dword ptr [rbx + 0x80]
    lea rdi, [rip + 14f]
    call rt_report
9:  call rt_done
10: .asciz "id_byte"
11: .asciz "version_word"
12: .asciz "version_qword"
13: .asciz "tpr_after_byte_store"
14: .asciz "tpr_after_dword_store"

// yield-spin: vCPU 0 yields to vCPU 1 params[0] times through the PV yield
// port, params[1] pauses apart, then raises a flag; every other vCPU spins in
// guest mode without an exit until the flag is up. The VMM boosts vCPU 1 at
// each yield, and only its budget can take the boost back. vCPU 0 reports
// "yields", the others "spun" (1).
    .globl test_guests_yield_spin
test_guests_yield_spin:
    mov r8, {acks}
    test rdi, rdi
    jnz 5f
    mov r14, [{params}]
    xor ebx, ebx
1:  cmp rbx, r14
    jae 4f
    inc rbx
    mov dx, {yield_port}
    mov eax, 1                  // to vCPU 1
    out dx, eax
    mov rcx, [{params} + 8]
2:  pause
    dec rcx
    jnz 2b
    jmp 1b
4:  mov qword ptr [r8], 1
    lea rdi, [rip + 10f]
    mov rsi, rbx
    call rt_report
    call rt_done
5:  cmp qword ptr [r8], 0       // until vCPU 0 is done: no exits
    jne 6f
    pause
    jmp 5b
6:  lea rdi, [rip + 11f]
    mov esi, 1
    call rt_report
    call rt_done
10: .asciz "yields"
11: .asciz "spun"
