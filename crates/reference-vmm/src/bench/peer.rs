//! The peer VMM in a bench: a bench guest booted by QEMU from an image file
//! ([`crate::pvh`]), with its parameters in the image.

use std::time::Duration;

use crate::bench::{Options, Runs, goal};
use crate::error::Error;
use crate::guest;
use crate::layout::PARAMS;
use crate::pvh::Image;
use crate::qemu::{INSTALL_HINT, Qemu, QemuApic, QemuRun};

/// How long one QEMU run may take (a QEMU that does not get through the
/// guest is killed then; `--quick` runs a tenth of the rounds).
fn timeout(opts: Options) -> Duration {
    Duration::from_secs(if opts.quick { 5 } else { 30 })
}

/// Runs the built-in `program` on `vcpus` vCPUs with `params` under QEMU
/// with `apic`.
pub fn run_image(
    qemu: &Qemu,
    program: &str,
    vcpus: u32,
    params: &[u64],
    apic: QemuApic,
    opts: Options,
) -> Result<QemuRun, Error> {
    const MEM_MIB: u64 = 64;
    let mut all = [0; PARAMS];
    all[..params.len().min(PARAMS)].copy_from_slice(&params[..params.len().min(PARAMS)]);
    let program = guest::find(program).expect("bench programs are built in");
    let image = Image::build(program, vcpus, MEM_MIB, all)?;
    let path = std::env::temp_dir().join(format!(
        "reference-vmm-bench-{}-{}.elf",
        std::process::id(),
        program.name
    ));
    std::fs::write(&path, image.bytes()).map_err(|source| Error::WriteImage {
        path: path.clone(),
        source,
    })?;
    let result = qemu.run(&path, vcpus, MEM_MIB, apic, timeout(opts));
    std::fs::remove_file(&path).unwrap_or(());
    Ok(result?)
}

/// The goal `what` of this VMM's runs `ours` against QEMU's own APIC's
/// (`user`), met where `met` holds for the ratio; QEMU on KVM's LAPIC
/// (`kernel`) is given beside it. Says why where QEMU gave no result.
pub fn goal_against_qemu(
    opts: Options,
    what: &str,
    ours: &Runs,
    user: &Runs,
    kernel: &Runs,
    met: impl Fn(f64) -> bool,
) -> String {
    let beside_kernel = match kernel.0.is_empty() {
        true => String::new(),
        false => format!(
            "; against QEMU on KVM's LAPIC: {}",
            ours.ratio_to(kernel).ratio_text()
        ),
    };
    if user.0.is_empty() {
        let why = match opts.qemu() {
            None => format!("no qemu-system-x86_64 on PATH (install it with `{INSTALL_HINT}`)"),
            Some(_) => "QEMU's own APIC gave no result (see below; on PVM, QEMU 7.2 was seen to stop at the guest's first HLT, its vCPU thread spinning in qemu_wait_io_event with the BQL held)".into(),
        };
        return format!("Goal: {what}. Not measured: {why}{beside_kernel}.");
    }
    let ratio = ours.ratio_to(user);
    goal(
        what,
        &format!("{} QEMU's{beside_kernel}", ratio.ratio_text()),
        met(ratio.median()),
        &ratio.each(met),
    )
}
