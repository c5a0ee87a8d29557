// pingpong: vCPUs 0 and 1 bounce a message params[0] times; each waits for
// the other's. With params[1] = 0 a message is a fixed IPI (vector 0x40) and
// the receiver halts until it arrives. With params[1] = 1 the receiver first
// polls its mailbox at CPL3 for the window the VMM published there, and a
// sender that finds its target polling posts to the mailbox instead of
// sending an IPI (the guest haltpoll driver and TIF_POLLING_NRFLAG); each
// wait's outcome goes to the mailbox's ring for the VMM's policy to learn.
// Gaps (params[3] > 0): before every params[3]-th round trip (params[4] = 1:
// before one in params[3] at random) vCPU 0 halts params[2] TSC ticks on its
// TSC-deadline timer (vector 0x50), so both vCPUs are idle: vCPU 1's halt
// lasts the gap. vCPU 0 reports the TSC ticks of the round trips alone
// ("ticks", gaps excluded); both report the interrupts they took ("irqs",
// timers included) and the messages that came by mailbox ("mailbox"). Other
// vCPUs finish at once. params[5] = 1: the xAPIC page instead of x2APIC MSRs
// (vector 0xF0), as an APIC without x2APIC (QEMU's own) has it; no gaps then.
// params[6] = 1: the receiver spins for the IPI instead of halting.
    .globl test_guests_pingpong
test_guests_pingpong:
    mov r12, rdi                // vCPU index
    lea r13, [rdx - {irq_record_below_data}]
    mov rdi, rsi
    cmp qword ptr [{params} + 40], 0
    jne 7f
    call rt_apic_enable_all
    cmp r12, 1
    ja 9f
    mov edi, {msr_lvt_timer}
    mov esi, 0x40050            // TSC-deadline mode, vector 0x50
    call rt_wrmsr
    jmp 6f
7:  call rt_xapic_enable_all
    cmp qword ptr [{params} + 24], 0
    je 6f
    lea rdi, [rip + 13f]        // gaps need the TSC-deadline timer
    mov rsi, [{params} + 24]
    xor edx, edx
    call rt_assert_fail
6:  cmp r12, 1
    ja 9f
    push 0                      // gaps so far ([rsp])
    mov r14, [{params}]         // rounds
    xor r15, r15                // rounds done
    xor ebp, ebp                // interrupts to wait for: IPIs and gap timers
    xor ebx, ebx                // ticks of the round trips (vCPU 0)
1:  cmp r15, r14
    jae 8f
    inc r15
    test r12, r12
    jnz 2f
    call pp_gap                 // vCPU 0: a gap first, maybe
    rdtsc
    shl rdx, 32
    or rax, rdx
    sub rbx, rax
    mov edi, 1                  // send, then wait for the answer
    call pp_send
    call pp_wait
    rdtsc
    shl rdx, 32
    or rax, rdx
    add rbx, rax
    jmp 1b
2:  call pp_wait                // vCPU 1: wait, then answer
    xor edi, edi
    call pp_send
    jmp 1b
8:  test r12, r12
    jnz 3f
    lea rdi, [rip + 10f]
    mov rsi, rbx
    call rt_report
3:  lea rdi, [rip + 11f]
    mov rsi, [r13 + 8]
    call rt_report
    mov rsi, r15                // by mailbox: rounds less IPIs (interrupts
    sub rsi, rbp                // waited for, less the gaps' timers)
    add rsi, [rsp]
    lea rdi, [rip + 12f]
    call rt_report
9:  call rt_done
10: .asciz "ticks"
11: .asciz "irqs"
12: .asciz "mailbox"
13: .asciz "pingpong: gaps need x2APIC mode (params[5] = 0)"

// pp_gap(): vCPU 0's gap before round trip r15, if it has one: halts on its
// TSC-deadline timer params[2] ticks from now. Counts the gap in its
// caller's [rsp] and the timer's interrupt in rbp.
pp_gap:
    mov rcx, [{params} + 24]    // one gap in rcx round trips
    test rcx, rcx
    jz 9f
    mov rax, r15                // every rcx-th ...
    cmp qword ptr [{params} + 32], 0
    je 1f
    rdtsc                       // ... or at random: the TSC's low bits
    shr eax, 6
1:  xor edx, edx
    div rcx
    test rdx, rdx
    jnz 9f
    inc qword ptr [rsp + 8]
    inc rbp
    rdtsc
    shl rdx, 32
    or rax, rdx
    add rax, [{params} + 16]
    mov edi, {msr_tsc_deadline}
    mov rsi, rax
    call rt_wrmsr
    lea rdi, [r13 + 8]
    mov rsi, rbp
    call rt_wait_count
9:  ret

// pp_mailbox(vcpu: rdi) -> rax: the mailbox of vCPU rdi.
pp_mailbox:
    mov rax, rdi
    shl rax, {mailbox_shift}
    add rax, {mailboxes}
    ret

// pp_send(to: rdi): posts to the target's mailbox if it is polling (state
// 1 -> 2, atomically), else sends the IPI.
pp_send:
    call pp_mailbox
    mov rcx, rax
    mov eax, 1
    mov edx, 2
    lock cmpxchg [rcx + 8], rdx
    je 1f
    cmp qword ptr [{params} + 40], 0
    jne 2f
    mov esi, 0x40
    jmp rt_send_ipi
2:  mov esi, 0xf0
    jmp rt_xapic_send_ipi
1:  ret

// pp_wait(): waits for one message: polls the mailbox for the published
// window if there is one (state 1; a sender makes it 2), then falls back to
// halting for the IPI (state back to 0 with a cmpxchg, so a message posted
// meanwhile is never missed). Records the outcome in the mailbox ring.
pp_wait:
    push rbx
    mov rdi, r12
    call pp_mailbox
    mov rbx, rax                // this vCPU's mailbox
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov r8, rax                 // wait start
    mov r9, rax                 // poll end (no window: none)
    mov r10, [rbx]              // the window, ticks
    test r10, r10
    jz 4f
    mov qword ptr [rbx + 8], 1  // polling
    add r9, r10
2:  cmp qword ptr [rbx + 8], 2
    je 3f
    pause
    rdtsc
    shl rdx, 32
    or rax, rdx
    cmp rax, r9
    jb 2b
    mov eax, 1                  // window over: stop polling, unless a message came
    xor edx, edx
    lock cmpxchg [rbx + 8], rdx
    jne 3f
    mov r9, rax                 // (rax is 1 here; poll end taken below)
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov r9, rax
    jmp 4f
3:  mov qword ptr [rbx + 8], 0  // a message by mailbox
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov r9, rax                 // polled until now
    xor r11d, r11d              // not blocked
    jmp 5f
4:  inc rbp                     // by IPI: halt until it arrives
    lea rdi, [r13 + 8]
    mov rsi, rbp
    push r8
    push r9
    call pp_wait_count
    pop r9
    pop r8
    mov r11, 1
5:  rdtsc                       // record (polled, halt | blocked << 63)
    shl rdx, 32
    or rax, rdx
    sub rax, r8
    shl r11, 63
    or rax, r11
    sub r9, r8
    mov rcx, [rbx + 16]
    mov rdx, rcx
    and rdx, {ring_mask}
    shl rdx, 4
    mov [rbx + rdx + 32], r9
    mov [rbx + rdx + 40], rax
    inc rcx
    mov [rbx + 16], rcx
    pop rbx
    ret

// pp_wait_count(counter: *const u64, n: u64): rt_wait_count, or with
// params[6] = 1 a spin at CPL3 with interrupts on until *counter >= n: the
// interrupt still arrives while the vCPU runs, without a halt.
pp_wait_count:
    cmp qword ptr [{params} + 48], 0
    je rt_wait_count
1:  cmp [rdi], rsi
    jae 2f
    pause
    jmp 1b
2:  ret

// rt_wait_count(counter: *const u64, n: u64): halts until *counter >= n.
rt_wait_count:
1:  cmp [rdi], rsi
    jae 2f
    call rt_halt_below
    jmp 1b
2:  ret

// apic-abuse: absurd local-APIC values, which must get the architectural
// answer: an IPI with vector 5 is not sent and sets ESR ("esr"); an IPI to a
// vCPU that does not exist vanishes; a TSC deadline in the past fires at once
// ("irqs" = 1: only the timer's interrupt arrives).
    .globl test_guests_apic_abuse
test_guests_apic_abuse:
    lea r13, [rdx - {irq_record_below_data}]
    call rt_apic_enable
    xor edi, edi
    mov esi, 5
    call rt_send_ipi
    mov edi, {msr_esr}
    xor esi, esi
    call rt_wrmsr
    mov edi, {msr_esr}
    call rt_rdmsr
    lea rdi, [rip + 1f]
    mov rsi, rax
    call rt_report
    mov edi, 200
    mov esi, 0x40
    call rt_send_ipi
    mov edi, {msr_lvt_timer}
    mov esi, 0x40050            // TSC-deadline mode, vector 0x50
    call rt_wrmsr
    mov edi, {msr_tsc_deadline}
    mov esi, 1                  // long past
    call rt_wrmsr
    lea rdi, [r13 + 8]
    mov rsi, 1
    call rt_wait_count
    lea rdi, [rip + 2f]
    mov rsi, [r13 + 8]
    call rt_report
    call rt_done
1:  .asciz "esr"
2:  .asciz "irqs"

// apic-gp: writes a non-zero value to EOI, which raises #GP.
    .globl test_guests_apic_gp
test_guests_apic_gp:
    call rt_apic_enable
    mov edi, {msr_eoi}
    mov esi, 1
    call rt_wrmsr
    call rt_done

// sched-ipi: vCPU 0 sends an IPI (vector 0x41) to all others params[0]
// times and each time spins until all have acknowledged (a shared counter),
// exiting every params[1] pause iterations as a pause-loop exit would (a
// write of its index to the pause port); the others halt until each IPI and
// acknowledge it. vCPU 0 reports the TSC ticks of all rounds ("ticks") and
// the acknowledgements ("acks"). params[2] = 1: through the xAPIC page
// (vector 0xF1), as an APIC without x2APIC (QEMU's own) has it.
    .globl test_guests_sched_ipi
test_guests_sched_ipi:
    mov r12, rdi                // vCPU index
    mov rbx, rsi                // vCPU count
    lea r13, [rdx - {irq_record_below_data}]
    mov rdi, rbx
    cmp qword ptr [{params} + 16], 0
    jne 7f
    call rt_apic_enable_all
    jmp 8f
7:  call rt_xapic_enable_all
8:  mov r14, [{params}]         // rounds
    mov r8, {acks}
    xor r15, r15                // rounds done
    test r12, r12
    jnz 5f
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov rbp, rax                // the start TSC
    dec rbx                     // acknowledgements per round
1:  cmp r15, r14
    jae 4f
    inc r15
    cmp qword ptr [{params} + 16], 0
    jne 9f
    mov rsi, 0xc0041            // all excluding self, vector 0x41
    mov edi, {msr_icr}
    call rt_wrmsr
    jmp 12f
9:  mov rax, {xapic_base}       // the same through the xAPIC page, vector 0xF1
    mov dword ptr [rax + 0x300], 0xc00f1
12: mov r10, r15
    imul r10, rbx               // acknowledgements expected so far
    mov r8, {acks}
2:  mov rcx, [{params} + 8]     // pause iterations per exit
3:  cmp [r8], r10
    jae 1b
    pause
    dec rcx
    jnz 3b
    mov eax, r12d
    mov dx, {pause_port}
    out dx, eax
    jmp 2b
4:  rdtsc
    shl rdx, 32
    or rax, rdx
    sub rax, rbp
    lea rdi, [rip + 10f]
    mov rsi, rax
    call rt_report
    lea rdi, [rip + 11f]
    mov r8, {acks}
    mov rsi, [r8]
    call rt_report
    call rt_done
5:  cmp r15, r14                // the others: wait for each IPI, acknowledge it
    jae 6f
    inc r15
    lea rdi, [r13 + 8]
    mov rsi, r15
    call rt_wait_count
    mov r8, {acks}
    lock inc qword ptr [r8]
    jmp 5b
6:  call rt_done
10: .asciz "ticks"
11: .asciz "acks"

// ipi-ring: every vCPU sends params[0] IPIs (vector 0x40) to the next one
// around the ring, each only after the next one took the previous (its
// interrupt count, read in its interrupt record), and halts until the IPI
// from the vCPU before it has arrived. No two IPIs to one vCPU are ever
// pending at once, which the IRR would merge, so each vCPU must count exactly
// params[0] interrupts. Targets are hit both halted and in the guest (while
// they spin for their own IPI to be taken; every params[1] pauses the spin
// exits to the pause port, 0: never). With params[2] = 1 the APICs stay in
// xAPIC mode and every access goes through the xAPIC page (MMIO), vector 0xF0.
// Reports "irqs".
    .globl test_guests_ipi_ring
test_guests_ipi_ring:
    mov r12, rdi                // vCPU index
    lea r13, [rdx - {irq_record_below_data}]
    lea rbx, [rdi + 1]          // the next vCPU
    lea rbp, [r13 + {vcpu_area_size}] // and its interrupt record
    cmp rbx, rsi
    jb 1f
    xor ebx, ebx                // after the last vCPU comes vCPU 0
    mov rax, r12
    imul rax, rax, {vcpu_area_size}
    mov rbp, r13
    sub rbp, rax
1:  mov rdi, rsi
    cmp qword ptr [{params} + 16], 0
    jne 7f
    call rt_apic_enable_all
    lea rax, [rip + rt_send_ipi]
    push rax
    push 0x40
    jmp 8f
7:  call rt_xapic_enable_all
    lea rax, [rip + rt_xapic_send_ipi]
    push rax
    push 0xf0                   // an xAPIC-mode vector: EOI through the page
8:  mov r14, [{params}]         // rounds
    xor r15, r15                // rounds done
2:  cmp r15, r14
    jae 5f
    inc r15
    mov edi, ebx
    mov rsi, [rsp]              // the vector
    call [rsp + 8]              // and how to send it
    lea rdi, [r13 + 8]
    mov rsi, r15
    call rt_wait_count          // the IPI from the vCPU before
3:  mov rcx, [{params} + 8]     // until the next vCPU took ours
4:  cmp [rbp + 8], r15
    jae 2b
    pause
    dec rcx
    jnz 4b
    mov eax, r12d
    mov dx, {pause_port}
    out dx, eax
    jmp 3b
5:  add rsp, 16
    lea rdi, [rip + 6f]
    mov rsi, [r13 + 8]
    call rt_report
    call rt_done
6:  .asciz "irqs"

// port-exits: every vCPU writes params[0] times to the POST-code port, with
// params[1] pause instructions between two writes; each write is an exit that
// the VMM routes through its device bus. Reports "exits".
    .globl test_guests_port_exits
test_guests_port_exits:
    mov r14, [{params}]
    xor r15, r15
1:  cmp r15, r14
    jae 3f
    mov rcx, [{params} + 8]
2:  pause
    dec rcx
    jnz 2b
    mov eax, r15d
    mov dx, {post_port}
    out dx, al
    inc r15
    jmp 1b
3:  lea rdi, [rip + 4f]
    mov rsi, r15
    call rt_report
    call rt_done
4:  .asciz "exits"

// dirty-writer: each vCPU writes every page of its own params[0] pages of
// free memory (from the dirty area, vCPU i's part after vCPU i-1's) once per
// pass, then stops at the iteration gate (a port write the VMM holds until
// the next pass); params[1] passes in all (dirty_log_perf_test's loop).
    .globl test_guests_dirty_writer
test_guests_dirty_writer:
    mov r14, [{params}]         // pages
    mov r15, [{params} + 8]     // passes
    mov rax, r14
    shl rax, 12
    imul rax, rdi
    mov r12, {dirty_area}
    add r12, rax                // this vCPU's part
    xor ebx, ebx                // passes done
1:  cmp rbx, r15
    jae 3f
    mov rax, r12
    mov rcx, r14
2:  mov [rax], rbx
    add rax, 4096
    dec rcx
    jnz 2b
    mov eax, ebx
    mov dx, {gate_port}
    out dx, al
    inc rbx
    jmp 1b
3:  call rt_done
