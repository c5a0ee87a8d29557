// migrate: the migration guest. Each vCPU owns params[0] pages (from the
// dirty area, vCPU i's after vCPU i-1's) and a generation per page (after
// every vCPU's pages). For params[1] TSC ticks (with params[4] = 1: from
// when it sees the VMM's migration count change, so that it runs until a
// move has ended however slow the host) it writes, one page after the
// other, at least params[2] ticks apart: each write bumps the page's
// generation g and fills page p with (p << 40) ^ (g << 16) ^ k in word k.
// Meanwhile vCPU 0 re-arms a TSC-deadline timer (vector 0x50) params[3]
// ticks ahead each time the last one fired (0: no timer), and every vCPU
// but the last sends an IPI (vector 0x42) to the next whenever the next has
// taken the previous one. With params[5] = w > 0, the vCPUs from index w
// on touch no memory of their own: as fast as they can they compute (a
// pass of 512 multiply-adds in registers), so that their count of passes,
// "computes", measures the CPU they got while the others dirty memory.
// (Reading their pages would not do: under shadow paging KVM maps a page
// whose guest PTE is dirty writable at a read fault, and reports it dirty.)
// The longest gap between two TSC reads is the
// stall the guest saw ("max_stall_ticks"); with params[6] = s > 0, each gap
// longer than s ticks is reported as it ends, "stall_at_ticks" (its end,
// from the vCPU's start) then "stall_ticks", at most 256 per vCPU. At the end every armed timer
// must have fired and every IPI arrived (else "a timer interrupt was lost"
// or "an IPI was lost"), and every page must hold what its generation says
// (else "page check failed", with the page and the word); every vCPU stays
// until all have checked, taking the IPIs sent to it. Reports
// "max_stall_ticks", "irqs", "ipis_sent", "pages_checked" and "writes" (or
// "computes").

// rax = the TSC (clobbers rdx).
.macro tsc64
    rdtsc
    shl rdx, 32
    or rax, rdx
.endm

// rdx = the value page rcx holds in word 0 at generation rax.
.macro page_value
    mov rdx, rcx
    shl rdx, 40
    shl rax, 16
    xor rdx, rax
.endm

// Spins until the count at `count` reaches `target` (both operands), or
// fails with `message` after 2^34 TSC ticks.
.macro wait_count count, target, message
    tsc64
    mov [rsp + 48], rax
91: mov rax, \count
    cmp rax, \target
    jae 92f
    pause
    tsc64
    sub rax, [rsp + 48]
    mov rcx, 0x400000000
    cmp rax, rcx
    jb 91b
    lea rdi, [rip + \message]
    mov rsi, \count
    mov rdx, \target
    call rt_assert_fail
92:
.endm

    .globl test_guests_migrate
test_guests_migrate:
    sub rsp, 96
    mov [rsp], rdi              // index
    mov [rsp + 8], rsi          // count
    lea r13, [rdx - {irq_record_below_data}]
    mov r14, [{params}]         // pages per vCPU
    mov rax, [{params} + 16]
    mov [rsp + 56], rax         // ticks between writes
    xor eax, eax
    mov rcx, [{params} + 40]    // writers (0: all)
    test rcx, rcx
    jz 12f
    cmp rdi, rcx
    setae al
12: mov [rsp + 64], rax         // 1: this vCPU only computes
    test rax, rax
    jz 13f
    mov qword ptr [rsp + 56], 0 // and does not wait between pages
13:
    mov rax, r14
    shl rax, 12
    mov rcx, rax
    imul rax, rdi
    mov r12, {dirty_area}
    add r12, rax                // this vCPU's pages
    imul rcx, rsi
    mov rbp, {dirty_area}
    add rbp, rcx
    mov rax, r14
    shl rax, 3
    imul rax, rdi
    add rbp, rax                // this vCPU's generations
    xor eax, eax
    mov [rsp + 24], rax         // the longest gap
    mov [rsp + 32], rax         // timers armed
    mov [rsp + 40], rax         // IPIs sent
    mov [rsp + 72], rax         // stalls reported
    mov rdi, rsi
    call rt_apic_enable_all
    call migrate_has_timer
    jz 1f
    mov edi, {msr_lvt_timer}
    mov esi, 0x40050            // TSC-deadline mode, vector 0x50
    call rt_wrmsr
    call migrate_arm_timer
1:  tsc64
    mov [rsp + 80], rax         // the start
    mov [rsp + 16], rax         // the last TSC read
    mov [rsp + 48], rax         // when the last write began
    mov r15, rax
    add r15, [{params} + 8]     // when to stop
    cmp qword ptr [{params} + 32], 0
    je 11f
    mov r15, -1                 // not before the migration count changes
11: xor ebx, ebx                // writes
2:  cmp r15, -1
    jne 21f
    cmp qword ptr [{migrations}], 0
    je 21f
    mov r15, [rsp + 16]
    add r15, [{params} + 8]     // params[1] ticks after the move
21: cmp [rsp + 16], r15
    jae 5f
    mov rax, rbx
    xor edx, edx
    div r14
    mov rcx, rdx                // the page
    cmp qword ptr [rsp + 64], 0
    jne 6f
    mov rax, [rbp + rcx * 8]
    inc rax
    mov [rbp + rcx * 8], rax    // its generation
    page_value
    mov rdi, rcx
    shl rdi, 12
    add rdi, r12
    xor ecx, ecx
3:  mov rax, rdx
    xor rax, rcx
    mov [rdi + rcx * 8], rax
    inc rcx
    cmp rcx, 512
    jb 3b
30: inc rbx
    call migrate_has_timer
    jz 31f
    mov rax, [r13 + 8]
    cmp rax, [rsp + 32]
    jb 31f
    call migrate_arm_timer      // the last one fired
31: mov rdi, [rsp]
    inc rdi
    cmp rdi, [rsp + 8]
    jae 4f
    mov rax, [r13 + 8 + {vcpu_area_size}]   // the next vCPU's interrupts
    cmp rax, [rsp + 40]
    jb 4f
    mov esi, 0x42
    call rt_send_ipi
    inc qword ptr [rsp + 40]
4:  tsc64
    mov rcx, rax
    sub rcx, [rsp + 16]
    mov [rsp + 16], rax
    cmp rcx, [rsp + 24]
    jbe 41f
    mov [rsp + 24], rcx
41: call migrate_note_stall     // the gap in rcx
    mov rax, [rsp + 16]
    sub rax, [rsp + 48]
    cmp rax, [rsp + 56]
    jb 4b
    mov rax, [rsp + 16]
    mov [rsp + 48], rax
    jmp 2b

    // A computing pass: 512 multiply-adds, in registers only.
6:  mov ecx, 512
    mov eax, 1
    mov rdi, 0x9e3779b97f4a7c15
61: imul rax, rdi
    add rax, rcx
    dec rcx
    jnz 61b
    jmp 30b

5:  call migrate_has_timer
    jz 51f
    wait_count "[r13 + 8]", "[rsp + 32]", 80f
51: mov rax, [rsp]
    inc rax
    cmp rax, [rsp + 8]
    jae 52f
    wait_count "[r13 + 8 + {vcpu_area_size}]", "[rsp + 40]", 81f
52: xor ecx, ecx
53: cmp rcx, r14
    jae 57f
    mov rax, [rbp + rcx * 8]
    test rax, rax
    jz 56f
    page_value
    mov rdi, rcx
    shl rdi, 12
    add rdi, r12
    xor esi, esi
55: mov rax, rdx
    xor rax, rsi
    cmp [rdi + rsi * 8], rax
    jne 58f
    inc rsi
    cmp rsi, 512
    jb 55b
56: inc rcx
    jmp 53b
58: mov rdx, rsi
    mov rsi, rcx
    lea rdi, [rip + 82f]
    call rt_assert_fail
    // Every vCPU stays (taking interrupts) until all have checked theirs:
    // the APIC-ready count goes from `count` to twice that.
57: mov rdi, [rsp + 8]
    shl rdi, 1
    call rt_apics_ready
    lea rdi, [rip + 83f]
    mov rsi, [rsp + 24]
    call rt_report
    lea rdi, [rip + 84f]
    mov rsi, [r13 + 8]
    call rt_report
    lea rdi, [rip + 85f]
    mov rsi, [rsp + 40]
    call rt_report
    lea rdi, [rip + 86f]
    mov rsi, r14
    call rt_report
    lea rdi, [rip + 87f]
    cmp qword ptr [rsp + 64], 0
    je 59f
    lea rdi, [rip + 88f]
59: mov rsi, rbx
    call rt_report
    call rt_done
80: .asciz "a timer interrupt was lost"
81: .asciz "an IPI was lost"
82: .asciz "page check failed"
83: .asciz "max_stall_ticks"
84: .asciz "irqs"
85: .asciz "ipis_sent"
86: .asciz "pages_checked"
87: .asciz "writes"
88: .asciz "computes"

// Reports the gap of rcx ticks that just ended, if params[6] is set, the
// gap is longer and fewer than 256 were reported. The caller's frame is at
// rsp + 8.
migrate_note_stall:
    mov rax, [{params} + 48]
    test rax, rax
    jz 1f
    cmp rcx, rax
    jbe 1f
    cmp qword ptr [rsp + 8 + 72], 256
    jae 1f
    inc qword ptr [rsp + 8 + 72]
    push rcx
    lea rdi, [rip + 2f]
    mov rsi, [rsp + 16 + 16]    // the last TSC read
    sub rsi, [rsp + 16 + 80]    // from the start
    call rt_report
    pop rsi
    lea rdi, [rip + 3f]
    call rt_report
    tsc64
    mov [rsp + 8 + 16], rax     // the reports' own time is no stall
1:  ret
2: .asciz "stall_at_ticks"
3: .asciz "stall_ticks"

// ZF clear if this vCPU runs the timer (vCPU 0, with a period). The
// caller's frame is at rsp + 8.
migrate_has_timer:
    cmp qword ptr [rsp + 8], 0
    jne 1f
    cmp qword ptr [{params} + 24], 0
    je 1f
    ret                         // ZF clear: params[3] != 0
1:  xor eax, eax                // ZF set
    ret

// Arms the timer params[3] ticks from now and counts it. Frame at rsp + 8.
migrate_arm_timer:
    tsc64
    add rax, [{params} + 24]
    mov rsi, rax
    mov edi, {msr_tsc_deadline}
    call rt_wrmsr
    inc qword ptr [rsp + 8 + 32]
    ret

// halt-wake: vCPU 0 halts until an interrupt arrives; the others spin for
// params[0] TSC ticks (with params[1] = 1: from when they see the VMM's
// migration count change), then the last sends vCPU 0 an IPI (vector
// 0x42), and each waits until vCPU 0 has taken it. Reports "irqs" (vCPU 0's: 1). For
// a migration that must move a halted vCPU and wake it afterwards.
    .globl test_guests_halt_wake
test_guests_halt_wake:
    lea r13, [rdx - {irq_record_below_data}]
    mov r12, rdi                // index
    mov r14, rsi                // count
    mov rdi, rsi
    call rt_apic_enable_all
    test r12, r12
    jnz 2f
    lea rdi, [r13 + 8]
    mov esi, 1
    call rt_wait_count          // halted until the IPI
    jmp 4f
2:  cmp qword ptr [{params} + 8], 0
    je 21f
    cmp qword ptr [{migrations}], 0
    jne 21f
    pause
    jmp 2b
21: tsc64
    mov rbx, rax
    add rbx, [{params}]
3:  pause
    tsc64
    cmp rax, rbx
    jb 3b
    lea rax, [r14 - 1]
    cmp r12, rax
    jne 5f
    xor edi, edi
    mov esi, 0x42
    call rt_send_ipi
5:  imul rax, r12, {vcpu_area_size}
    mov rcx, r13
    sub rcx, rax                // vCPU 0's interrupt record
6:  cmp qword ptr [rcx + 8], 1
    jae 4f
    pause
    jmp 6b
4:  lea rdi, [rip + 7f]
    mov rsi, [r13 + 8]
    call rt_report
    call rt_done
7:  .asciz "irqs"
