# Guest programs that dirty memory, for the dirty-log tests and benchmarks.
# They run at CPL3 in 64-bit mode, use registers only (no stack), and end each
# round with an 8-byte store of the round number to the MMIO doorbell, which
# exits to the VMM; the VMM resumes them for the next round.
#
# Entry registers:
#   rdi  first byte of the memory to write
#   rsi  pages in it
#   rcx  xorshift64 state (random writer; never 0)
#   r8   writes per round (random writer)
#   r10  the doorbell's address
    .pushsection .rodata.dirty_log_writer_guest, "a"
    .balign 16
    .globl dirty_log_writer_guest_image_start
dirty_log_writer_guest_image_start:

# Writes `r8` pseudo-random pages per round; each write stores the round
# number in the page's first 8 bytes. The VMM replays the same xorshift64
# sequence to know which pages were written.
    .globl dirty_log_writer_guest_random_writer
dirty_log_writer_guest_random_writer:
    xor r11, r11
1:
    mov r9, r8
2:
    mov rax, rcx
    shl rax, 13
    xor rcx, rax
    mov rax, rcx
    shr rax, 7
    xor rcx, rax
    mov rax, rcx
    shl rax, 17
    xor rcx, rax
    mov rax, rcx
    xor edx, edx
    div rsi
    shl rdx, 12
    mov [rdi + rdx], r11
    dec r9
    jnz 2b
    mov [r10], r11
    inc r11
    jmp 1b

# Writes every page once per round, in order (dirty_log_perf_test's loop).
    .globl dirty_log_writer_guest_sequential_writer
dirty_log_writer_guest_sequential_writer:
    xor r11, r11
1:
    mov rax, rdi
    mov rcx, rsi
2:
    mov [rax], r11
    add rax, 4096
    dec rcx
    jnz 2b
    mov [r10], r11
    inc r11
    jmp 1b

    .globl dirty_log_writer_guest_image_end
dirty_log_writer_guest_image_end:
    .popsection
