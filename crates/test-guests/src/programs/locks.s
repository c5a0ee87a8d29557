// lock-holders: every vCPU takes a spinlock in shared memory params[0]
// times, holds it for params[1] pause instructions, then works params[2]
// pause instructions outside it: lock holders and waiters, as ebizzy's
// threads are, all at CPL3 with no exits. With params[3] = 1 a vCPU marks
// its boost-request word while it holds the lock (bit 32, and a new
// sequence in bits 31:0 for each critical section), so that a host granting
// guest-requested boosts can keep a preempted holder from stalling the
// waiters. With params[4] = 1 each round ends with an "I/O": the vCPU
// writes its index to the completion port and halts until the VMM's
// completion device (KVM's irqchip) interrupts it. With params[4] = 2 the
// I/O is submitted as the round starts, in flight while the vCPU works, and
// the vCPU spins after the round until it has completed: a vCPU with work
// to do, which never halts, so a completion finds it running or waiting
// for a CPU, never asleep. Each vCPU reports the
// TSC ticks of its rounds ("ticks") and the interrupts it took ("irqs").
    .globl test_guests_lock_holders
test_guests_lock_holders:
    mov r12, rdi                    // vCPU index
    lea r13, [rdx - {irq_record_below_data}]
    cmp qword ptr [{params} + 32], 0
    je 1f
    mov rdi, rsi
    call rt_apic_enable_all         // completions are interrupts
1:  mov r14, [{params}]             // rounds
    xor r15, r15                    // rounds done
    xor ebx, ebx                    // the request's sequence
    rdtsc
    shl rdx, 32
    or rax, rdx
    mov rbp, rax                    // the start TSC
1:  cmp r15, r14
    jae 8f
    inc r15
    cmp qword ptr [{params} + 32], 2
    jne 2f
    call lh_submit                  // mode 2: the I/O is in flight during the round
2:  mov eax, 1                      // test-and-set ...
    xchg eax, dword ptr [{guest_lock}]
    test eax, eax
    jz 4f
3:  pause                           // ... then test until it looks free
    cmp dword ptr [{guest_lock}], 0
    jne 3b
    jmp 2b
4:  mov rdi, {boost_requests}
    lea rdi, [rdi + r12 * 8]        // this vCPU's request word
    cmp qword ptr [{params} + 24], 0
    je 5f
    inc ebx
    mov rax, 0x100000000            // in a critical section: bit 32
    or rax, rbx
    mov [rdi], rax
5:  mov rcx, [{params} + 8]
    call lh_pause                   // hold the lock
    cmp qword ptr [{params} + 24], 0
    je 6f
    mov [rdi], rbx                  // out of it: the same sequence, bit 32 clear
6:  mov dword ptr [{guest_lock}], 0 // release
    mov rcx, [{params} + 16]
    call lh_pause                   // work outside the lock
    mov rax, [{params} + 32]
    test rax, rax
    je 1b
    cmp rax, 2
    je 7f
    call lh_submit                  // mode 1: submit, then halt until it completes
    lea rdi, [r13 + 8]
    mov rsi, r15
    call rt_wait_count
    jmp 1b
7:  cmp [r13 + 8], r15              // mode 2: spin until it has completed
    jae 1b
    pause
    jmp 7b
8:  rdtsc
    shl rdx, 32
    or rax, rdx
    sub rax, rbp
    lea rdi, [rip + 10f]
    mov rsi, rax
    call rt_report
    lea rdi, [rip + 11f]
    mov rsi, [r13 + 8]
    call rt_report
    call rt_done
10: .asciz "ticks"
11: .asciz "irqs"

// lh_submit: submits an I/O, this vCPU's index to the completion port.
lh_submit:
    mov dx, {completion_port}
    mov eax, r12d
    out dx, eax
    ret

// lh_pause(rcx): rcx pause instructions (rdi kept).
lh_pause:
    test rcx, rcx
    jz 2f
1:  pause
    dec rcx
    jnz 1b
2:  ret
