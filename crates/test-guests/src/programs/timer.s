// cyclictest: arms the TSC-deadline timer params[0] times, params[1] TSC
// ticks apart (each deadline the previous one plus the period), halting until
// each interrupt; stores each lateness (the TSC the interrupt entry read minus
// the deadline, in ticks, signed) at the samples area, and reports "samples"
// and the interrupts it took ("irqs"); with params[2] = 1 it also reports
// each lateness ("lateness", in order), for a VMM that cannot read its memory.
// Only vCPU 0 measures; the others finish at once.
    .globl test_guests_cyclictest
test_guests_cyclictest:
    test rdi, rdi
    jnz 9f
    lea r13, [rdx - {irq_record_below_data}]
    call timer_setup            // r14 = samples, r15 = period in ticks
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov r12, rax                // the deadline
1:  cmp rbx, r14
    jae 8f
    add r12, r15
    mov edi, {msr_tsc_deadline}
    mov rsi, r12
    call rt_wrmsr
    lea rdi, [r13 + 8]
    lea rsi, [rbx + 1]
    call rt_wait_count
    mov rax, [r13]
    sub rax, r12
    mov rcx, {samples}
    mov [rcx + rbx * 8], rax
    inc rbx
    jmp 1b
8:  lea rdi, [rip + 10f]
    mov rsi, rbx
    call rt_report
    lea rdi, [rip + 11f]
    mov rsi, [r13 + 8]
    call rt_report
    cmp qword ptr [{params} + 16], 0
    je 9f
    xor r12d, r12d
7:  cmp r12, rbx
    jae 9f
    mov rcx, {samples}
    mov rsi, [rcx + r12 * 8]
    lea rdi, [rip + 12f]
    call rt_report
    inc r12
    jmp 7b
9:  call rt_done
10: .asciz "samples"
11: .asciz "irqs"
12: .asciz "lateness"

// timer-spin: every vCPU arms its TSC-deadline timer params[0] times, each
// deadline params[1] ticks after the arming plus up to 16383 ticks of jitter
// (the TSC's low bits), and spins at CPL3 without an exit until that timer's
// interrupt has arrived. The interrupt is posted while the vCPU is on its way
// back into the guest from the deadline write, so a poster that misses the
// vCPU's entry loses it and the vCPU spins for ever. Reports "irqs".
    .globl test_guests_timer_spin
test_guests_timer_spin:
    lea r13, [rdx - {irq_record_below_data}]
    call timer_setup            // r14 = deadlines, r15 = distance in ticks
1:  cmp rbx, r14
    jae 8f
    inc rbx
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov rcx, rax
    and ecx, 0x3fff
    add rax, rcx
    add rax, r15
    mov edi, {msr_tsc_deadline}
    mov rsi, rax
    call rt_wrmsr
2:  cmp [r13 + 8], rbx          // until this deadline's interrupt came
    jae 1b
    pause
    jmp 2b
8:  lea rdi, [rip + 10f]
    mov rsi, [r13 + 8]
    call rt_report
    call rt_done
10: .asciz "irqs"

// timer_setup(): enables the local APIC with its LVT timer in TSC-deadline
// mode (vector 0x50); r14 = params[0], r15 = params[1], rbx = 0.
timer_setup:
    call rt_apic_enable
    mov edi, {msr_lvt_timer}
    mov esi, 0x40050            // TSC-deadline mode, vector 0x50
    call rt_wrmsr
    mov r14, [{params}]
    mov r15, [{params} + 8]
    xor ebx, ebx
    ret
