// Guests that do something wrong on purpose, one way each, so that the tests can
// check that the VMM ends the run with a clear error and never panics.
// Entry: rdi = vCPU index, rsi = vCPU count, rdx = per-vCPU data block.

// triple_fault: asks the runtime for the shutdown service, which triple-faults.
    .globl test_guests_triple_fault
test_guests_triple_fault:
    mov eax, {sys_shutdown}
    ud2

// bad_port: vCPU 0 writes to port 0x1234, where no device lives; the other vCPUs
// spin in guest mode, so the VMM must kick them out of KVM_RUN to end the run.
    .globl test_guests_bad_port
test_guests_bad_port:
    test edi, edi
    jnz rt_spin_forever
    mov dx, 0x1234
    mov al, 0x5a
    out dx, al
    jmp rt_spin_forever

// bad_ucall: a ucall with a command the VMM does not know.
    .globl test_guests_bad_ucall
test_guests_bad_ucall:
    mov edi, 0xbad
    call rt_ucall
    jmp rt_spin_forever

// gp_fault: `hlt` at CPL3 raises #GP(0); the runtime reports the exception.
    .globl test_guests_gp_fault
test_guests_gp_fault:
    hlt
    jmp rt_spin_forever

// assert_fail: a failed guest assertion with its two values.
    .globl test_guests_assert_fail
test_guests_assert_fail:
    lea rdi, [rip + assert_fail_message]
    mov esi, 1
    mov edx, 2
    jmp rt_assert_fail

assert_fail_message: .asciz "one equals two"

// spin: every vCPU spins in guest mode until the VMM stops it (see --timeout-ms).
    .globl test_guests_spin
test_guests_spin:
    jmp rt_spin_forever
