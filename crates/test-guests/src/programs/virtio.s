// virtio-rng: vCPU 0 drives the VMM's virtio entropy device: modern
// virtio-pci on bus 0, configured through ports 0xCF8/0xCFC, as Cloud
// Hypervisor always has one and QEMU adds with `-device virtio-rng-pci`. It
// identity-maps the device's structures (uncached, from page tables it
// builds in its area), routes the request queue's MSI-X entry 0 to its own
// APIC (vector 0x60), then asks params[0] times for 64 bytes, one request
// at a time: a notify write submits it, and the device's interrupt (an
// irqfd, under KVM) completes it. params[1] = 0: the vCPU halts until the
// interrupt; 1: it spins at CPL3 until the interrupt arrives, a vCPU with
// work to do, which a host's boost of the interrupt's target can help.
// vCPU 0 reports the TSC ticks from each notify to its interrupt, summed
// ("ticks") and the longest ("max"), and the interrupts it took ("irqs");
// a device that is missing or refuses a step ends the run with an
// assertion saying which. Other vCPUs finish at once.
//
// The area: table pages from +0 (3), the driver's words at +0x3000 (the
// next free table page, the MSI-X capability, the notify multiplier, the
// ticks and the longest), the queue at +0x4000 (8 descriptors, the driver's
// ring at +0x100, the device's at +0x200), the buffer at +0x5000.
    .globl test_guests_virtio_rng
test_guests_virtio_rng:
    mov r12, rdi                    // vCPU index
    lea r13, [rdx - {irq_record_below_data}]
    mov rdi, rsi
    call rt_apic_enable_all         // completions are interrupts
    test r12, r12
    jnz 9f
    call vr_find                    // rbx: the device's configuration address
    call vr_setup                   // r14: common configuration, r15: its notify
    xor ebp, ebp                    // requests done
1:  cmp rbp, [{params}]
    jae 8f
    mov ecx, ebp                    // the driver's ring slot: descriptor 0
    and ecx, 7
    mov word ptr [{virtio_area} + 0x4104 + rcx * 2], 0
    inc rbp
    mov rax, [r13 + 8]
    inc rax
    push rax                        // [rsp + 8]: the interrupt to wait for
    rdtsc
    shl rdx, 32
    or rax, rdx
    push rax                        // [rsp]: the notify's TSC
    mov word ptr [{virtio_area} + 0x4102], bp // published ...
    mov word ptr [r15], 0           // ... and notified: queue 0
2:  mov rsi, [rsp + 8]
    cmp [r13 + 8], rsi              // the interrupt taken?
    jae 4f
    cmp qword ptr [{params} + 8], 0
    je 3f
    pause                           // spinning: work to do
    jmp 2b
3:  lea rdi, [r13 + 8]
    call rt_halt_below
    jmp 2b
4:  movzx eax, word ptr [{virtio_area} + 0x4202]
    cmp ax, bp                      // and the buffer back?
    je 5f
    mov rax, [r13 + 8]              // another interrupt first: the next one
    inc rax
    mov [rsp + 8], rax
    jmp 2b
5:  pop rcx
    pop rax
    mov rax, [r13]                  // the interrupt's TSC
    sub rax, rcx
    add [{virtio_area} + 0x3018], rax
    cmp rax, [{virtio_area} + 0x3020]
    jbe 1b
    mov [{virtio_area} + 0x3020], rax
    jmp 1b
8:  lea rdi, [rip + 11f]
    mov rsi, [{virtio_area} + 0x3018]
    call rt_report
    lea rdi, [rip + 12f]
    mov rsi, [{virtio_area} + 0x3020]
    call rt_report
    lea rdi, [rip + 13f]
    mov rsi, [r13 + 8]
    call rt_report
9:  call rt_done
11: .asciz "ticks"
12: .asciz "max"
13: .asciz "irqs"

// vr_find() -> rbx: the configuration address (enable bit, bus 0, device,
// function 0) of the first virtio entropy device, modern (0x1044) or
// transitional (0x1005), with memory decoding and bus mastering on.
vr_find:
    mov ebx, 0x80000000
1:  mov edi, ebx
    call vr_cfg_read
    cmp eax, 0x10441af4
    je 2f
    cmp eax, 0x10051af4
    je 2f
    add ebx, 0x800
    cmp ebx, 0x80010000
    jb 1b
    lea rdi, [rip + 10f]
    xor esi, esi
    xor edx, edx
    call rt_assert_fail
2:  lea edi, [rbx + 4]
    call vr_cfg_read
    mov esi, eax
    or esi, 6
    lea edi, [rbx + 4]
    jmp vr_cfg_write
10: .asciz "virtio-rng: no virtio entropy device on PCI bus 0"

// vr_setup(): finds the common configuration, notify and MSI-X capabilities,
// routes MSI-X entry 0 to this vCPU and sets up queue 0 (8 entries, each
// request descriptor 0: the buffer, written by the device); the device then
// runs (DRIVER_OK). r14: the common configuration, r15: queue 0's notify.
vr_setup:
    mov rax, {virtio_area}
    mov [{virtio_area} + 0x3000], rax // table pages from the area's start
    xor r14, r14
    xor r15, r15
    xor eax, eax
    mov [{virtio_area} + 0x3008], rax // no MSI-X capability yet
    mov [{virtio_area} + 0x3018], rax // ticks
    mov [{virtio_area} + 0x3020], rax // the longest
    lea edi, [rbx + 0x34]
    call vr_cfg_read
    movzx r11d, al                  // the first capability
1:  and r11d, 0xFC
    jz 5f
    lea edi, [rbx + r11]
    call vr_cfg_read
    cmp al, 0x11
    jne 2f
    mov [{virtio_area} + 0x3008], r11 // MSI-X
    jmp 4f
2:  cmp al, 0x09                    // vendor-specific: a virtio structure
    jne 4f
    shr eax, 24                     // its type
    cmp eax, 1
    jne 3f
    mov edi, r11d
    call vr_cap_address
    mov r14, rax                    // the common configuration
    jmp 4f
3:  cmp eax, 2
    jne 4f
    mov edi, r11d
    call vr_cap_address
    mov r15, rax                    // notifications
    lea edi, [rbx + r11 + 16]
    call vr_cfg_read
    mov [{virtio_area} + 0x3010], rax // the notify offset multiplier
4:  lea edi, [rbx + r11]
    call vr_cfg_read
    shr eax, 8
    movzx r11d, al                  // the next capability
    jmp 1b
5:  test r14, r14
    jz 6f
    test r15, r15
    jz 6f
    cmp qword ptr [{virtio_area} + 0x3008], 0
    jne 7f
6:  lea rdi, [rip + 10f]
    mov rsi, r14
    mov rdx, r15
    call rt_assert_fail
7:  mov byte ptr [r14 + 0x14], 0    // reset ...
8:  cmp byte ptr [r14 + 0x14], 0    // ... until it reads back 0
    jne 8b
    mov byte ptr [r14 + 0x14], 1    // ACKNOWLEDGE
    mov byte ptr [r14 + 0x14], 3    // DRIVER
    mov dword ptr [r14 + 0x08], 1   // feature bits 63:32 ...
    mov dword ptr [r14 + 0x0C], 1   // ... VIRTIO_F_VERSION_1 alone
    mov dword ptr [r14 + 0x08], 0
    mov dword ptr [r14 + 0x0C], 0
    mov byte ptr [r14 + 0x14], 0xB  // FEATURES_OK
    movzx esi, byte ptr [r14 + 0x14]
    test esi, 8
    jnz 1f
    lea rdi, [rip + 11f]
    xor edx, edx
    call rt_assert_fail
1:  call vr_msix
    mov word ptr [r14 + 0x10], 0xFFFF // no interrupt for configuration changes
    mov word ptr [r14 + 0x16], 0    // queue 0
    mov word ptr [r14 + 0x18], 8
    mov word ptr [r14 + 0x1A], 0    // its interrupt: MSI-X entry 0
    movzx esi, word ptr [r14 + 0x1A]
    test esi, esi
    jz 2f
    lea rdi, [rip + 12f]
    xor edx, edx
    call rt_assert_fail
2:  mov rdi, {virtio_area} + 0x4000
    xor eax, eax
    mov ecx, 0x300 / 8
    rep stosq                       // descriptors and both rings zeroed
    mov rax, {virtio_area} + 0x5000
    mov [{virtio_area} + 0x4000], rax // descriptor 0: the buffer,
    mov dword ptr [{virtio_area} + 0x4008], 64 // 64 bytes,
    mov word ptr [{virtio_area} + 0x400C], 2 // written by the device
    mov dword ptr [r14 + 0x20], {virtio_area} + 0x4000
    mov dword ptr [r14 + 0x24], 0
    mov dword ptr [r14 + 0x28], {virtio_area} + 0x4100
    mov dword ptr [r14 + 0x2C], 0
    mov dword ptr [r14 + 0x30], {virtio_area} + 0x4200
    mov dword ptr [r14 + 0x34], 0
    movzx eax, word ptr [r14 + 0x1E] // queue 0's notify offset
    imul eax, [{virtio_area} + 0x3010]
    add r15, rax
    mov word ptr [r14 + 0x1C], 1    // enabled
    mov byte ptr [r14 + 0x14], 0xF  // DRIVER_OK
    ret
10: .asciz "virtio-rng: no common configuration, notify or MSI-X capability (common, notify)"
11: .asciz "virtio-rng: the device refused VIRTIO_F_VERSION_1 alone (status)"
12: .asciz "virtio-rng: the device refused MSI-X entry 0 for its queue (entry)"

// vr_msix(): MSI-X entry 0 sends vector 0x60 to this vCPU's APIC, unmasked;
// then MSI-X is enabled, the function unmasked.
vr_msix:
    mov r11, [{virtio_area} + 0x3008]
    lea edi, [rbx + r11 + 4]
    call vr_cfg_read                // the table's BAR and offset
    mov ecx, eax
    and ecx, 7
    and eax, -8
    mov r10, rax
    call vr_bar
    lea rdi, [rax + r10]
    call vr_map
    mov edx, r12d
    shl edx, 12
    or edx, 0xFEE00000
    mov dword ptr [rax], edx        // the address: this vCPU's APIC
    mov dword ptr [rax + 4], 0
    mov dword ptr [rax + 8], 0x60   // the data: fixed, vector 0x60
    mov dword ptr [rax + 12], 0     // unmasked
    lea edi, [rbx + r11]
    call vr_cfg_read
    or eax, 0x80000000              // MSI-X enable
    and eax, 0xBFFFFFFF             // function mask off
    mov esi, eax
    lea edi, [rbx + r11]
    jmp vr_cfg_write

// vr_cap_address(edi: a virtio capability's offset) -> rax: the address of
// the structure it describes, mapped.
vr_cap_address:
    mov r9d, edi
    lea edi, [rbx + r9 + 4]
    call vr_cfg_read
    movzx ecx, al                   // its BAR
    call vr_bar
    mov r10, rax
    lea edi, [rbx + r9 + 8]
    call vr_cfg_read                // its offset there
    lea rdi, [r10 + rax]
    jmp vr_map

// vr_bar(ecx: a BAR's index) -> rax: its address, both halves of a 64-bit
// one. Keeps rcx, r9-r11.
vr_bar:
    lea edi, [rbx + rcx * 4 + 0x10]
    call vr_cfg_read
    mov esi, eax
    and esi, 0xFFFFFFF0
    xor r8d, r8d
    and eax, 6
    cmp eax, 4
    jne 1f
    lea edi, [rbx + rcx * 4 + 0x14]
    call vr_cfg_read
    mov r8d, eax
1:  shl r8, 32
    lea rax, [rsi + r8]
    ret

// vr_map(rdi: a physical address) -> rax: the same; the 2 MiB that hold it
// identity-mapped, uncached, unless mapped already. Keeps r9-r11.
vr_map:
    mov rsi, {pml4}
    mov ecx, 39
    call vr_next_table
    mov ecx, 30
    call vr_next_table
    mov rax, rdi
    shr rax, 21
    and eax, 511
    lea rsi, [rsi + rax * 8]
    test byte ptr [rsi], 1
    jnz 1f
    mov rax, rdi
    and rax, -0x200000
    or rax, 0x9F                    // present, writable, user, uncached, 2 MiB
    mov [rsi], rax
1:  mov rax, rdi
    ret

// vr_next_table(rsi: a table, ecx: the shift of its index in rdi) -> rsi:
// the table its entry for rdi points to, made from the area's next free
// page (zeroed) where the entry is not present. Keeps rdi, r9-r11.
vr_next_table:
    mov rax, rdi
    shr rax, cl
    and eax, 511
    lea rsi, [rsi + rax * 8]
    mov rax, [rsi]
    test al, 1
    jnz 2f
    mov rax, [{virtio_area} + 0x3000]
    cmp rax, {virtio_area} + 0x3000
    jb 1f
    lea rdi, [rip + 10f]            // never with one device
    mov rsi, rax
    xor edx, edx
    call rt_assert_fail
1:  add qword ptr [{virtio_area} + 0x3000], 0x1000
    mov edx, 512
3:  mov qword ptr [rax + rdx * 8 - 8], 0
    dec edx
    jnz 3b
    or rax, 7                       // present, writable, user
    mov [rsi], rax
2:  mov rsi, 0x000FFFFFFFFFF000
    and rsi, rax
    ret
10: .asciz "virtio-rng: out of page-table pages (next)"

// vr_cfg_read(edi: a configuration address) -> eax: the dword there.
// Clobbers rdx only.
vr_cfg_read:
    mov eax, edi
    and eax, 0xFFFFFFFC
    mov dx, 0xCF8
    out dx, eax
    mov dx, 0xCFC
    in eax, dx
    ret

// vr_cfg_write(edi: a configuration address, esi: the dword to write there).
vr_cfg_write:
    mov eax, edi
    and eax, 0xFFFFFFFC
    mov dx, 0xCF8
    out dx, eax
    mov eax, esi
    mov dx, 0xCFC
    out dx, eax
    ret
