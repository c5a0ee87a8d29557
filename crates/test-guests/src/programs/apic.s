// apic-script: each vCPU runs the local-APIC operations the VMM wrote for
// it (test_guests::apic_script), params[0] of them, and records what each
// read back: the conformance guest, whose records a runner compares between
// two APICs. Entry: rdi = vCPU index.
    .globl test_guests_apic_script
test_guests_apic_script:
    shl rdi, {apic_script_shift}
    mov rax, {apic_script_addr}
    add rdi, rax                    // this vCPU's operations
    mov rsi, [{params}]
    mov rax, {apic_script_ops}
    cmp rsi, rax
    cmova rsi, rax                  // no further than the area
    mov eax, {sys_apic_script}
    ud2
    call rt_done

// Service `sys_apic_script`: runs rsi operations from rdi at CPL0 with
// interrupts off, so that nothing the operations raise is taken meanwhile.
// A barrier counts itself in at `acks` and waits until the count reaches
// its value (the VMM zeroes it: fresh memory).
// An operation is 4 u64s: kind (the guest sets bits 63:32 to a status: 1
// done, 2 #GP), register (MSR index, or offset in the xAPIC page), value,
// and what it read. A #GP from an operation's rdmsr or wrmsr resumes at
// rt_script_faulted (rt_exception_common knows the two instructions).
rt_sys_apic_script:
    push rbx
    push r8
    mov r8, rdi
    mov rbx, rsi
1:  test rbx, rbx
    jz 9f
    mov ecx, [r8 + 8]
    mov rax, [r8 + 16]
    mov rdx, rax
    shr rdx, 32
    mov esi, [r8]
    cmp esi, {op_rdmsr}
    je 2f
    cmp esi, {op_wrmsr}
    je 3f
    cmp esi, {op_msr_or}
    je 4f
    cmp esi, {op_mmio_read}
    je 5f
    cmp esi, {op_mmio_write}
    je 6f
    cmp esi, {op_delay}
    je 7f
    cmp esi, {op_barrier}
    je 10f
    cmp esi, {op_wrmsr_tsc}
    je 11f
    mov dword ptr [r8 + 4], {status_faulted} // no such operation
    jmp 8f
2:  call rt_script_rdmsr
    jmp 8f
3:  call rt_script_wrmsr
    jmp 8f
4:  call rt_script_rdmsr         // read, or in the value, write back
    cmp dword ptr [r8 + 4], {status_done}
    jne 8f
    or rax, [r8 + 16]
    mov rdx, rax
    shr rdx, 32
    call rt_script_wrmsr
    jmp 8f
5:  mov rax, {xapic_base}
    add rax, rcx
    mov eax, dword ptr [rax]
    mov [r8 + 24], rax
    mov dword ptr [r8 + 4], {status_done}
    jmp 8f
6:  mov rdx, {xapic_base}
    add rdx, rcx
    mov dword ptr [rdx], eax
    mov dword ptr [r8 + 4], {status_done}
    jmp 8f
7:  mov rcx, rax                    // delay: rcx TSC ticks
    rdtsc
    shl rdx, 32
    or rax, rdx
    add rcx, rax
71: rdtsc
    shl rdx, 32
    or rax, rdx
    cmp rax, rcx
    jb 71b
    mov dword ptr [r8 + 4], {status_done}
    jmp 8f
10: mov rcx, {acks}                 // barrier: count in, wait for the value
    lock inc qword ptr [rcx]
101: pause
    cmp [rcx], rax
    jb 101b
    mov dword ptr [r8 + 4], {status_done}
    jmp 8f
11: mov rsi, rax                    // wrmsr of the TSC now + the value
    rdtsc
    shl rdx, 32
    or rax, rdx
    add rax, rsi
    mov rdx, rax
    shr rdx, 32
    call rt_script_wrmsr
8:  add r8, 32
    dec rbx
    jmp 1b
9:  pop r8
    pop rbx
    add qword ptr [rsp], 2
    iretq

// rdmsr ecx into [r8 + 24], status in [r8 + 4]; rax = the value.
rt_script_rdmsr:
    rdmsr
    shl rdx, 32
    or rax, rdx
    mov [r8 + 24], rax
    mov dword ptr [r8 + 4], {status_done}
    ret

// wrmsr ecx = edx:eax, status in [r8 + 4].
rt_script_wrmsr:
    wrmsr
    mov dword ptr [r8 + 4], {status_done}
    ret

// Where a #GP of rt_script_rdmsr or rt_script_wrmsr resumes: it returns from
// the operation's call as faulted.
rt_script_faulted:
    mov dword ptr [r8 + 4], {status_faulted}
    ret
