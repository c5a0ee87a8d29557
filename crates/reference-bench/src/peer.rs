//! The peer VMMs in a bench: a bench guest booted by QEMU, Cloud Hypervisor
//! or Firecracker from an image file ([`test_guests::pvh`]), with its
//! parameters in the image.

use std::time::Duration;

use crate::Error;
use crate::{Options, Runs, goal};

use crate::cloud_hypervisor::CloudHypervisor;
use crate::firecracker::Firecracker;
use crate::peer_run::{PeerError, PeerRun};
use crate::qemu::{INSTALL_HINT, Qemu, QemuApic};
use test_guests::layout::PARAMS;
use test_guests::pvh::Image;

/// How long one peer's run may take (a peer that does not get through the
/// guest is killed then; `--quick` runs a tenth of the rounds).
fn timeout(opts: Options) -> Duration {
    Duration::from_secs(if opts.quick { 5 } else { 30 })
}

/// A peer VMM that boots the bench's guests.
#[derive(Clone, Copy, Debug)]
pub enum PeerVmm<'a> {
    /// QEMU, with its local APICs where given.
    Qemu(&'a Qemu, QemuApic),
    /// Cloud Hypervisor, on KVM's LAPIC.
    CloudHypervisor(&'a CloudHypervisor),
    /// Firecracker, on KVM's LAPIC.
    Firecracker(&'a Firecracker),
}

impl PeerVmm<'_> {
    /// Its name, in errors.
    pub fn name(self) -> &'static str {
        match self {
            Self::Qemu(..) => "QEMU",
            Self::CloudHypervisor(_) => "Cloud Hypervisor",
            Self::Firecracker(_) => "Firecracker",
        }
    }

    fn run(
        self,
        image: &std::path::Path,
        vcpus: u32,
        mem_mib: u64,
        timeout: Duration,
    ) -> Result<PeerRun, PeerError> {
        match self {
            Self::Qemu(qemu, apic) => qemu.run(image, vcpus, mem_mib, apic, timeout),
            Self::CloudHypervisor(ch) => ch.run(image, vcpus, mem_mib, timeout),
            Self::Firecracker(fc) => fc.run(image, vcpus, mem_mib, timeout),
        }
    }
}

/// Runs the built-in `program` on `vcpus` vCPUs with `params` under `vmm`.
pub fn run_image(
    vmm: PeerVmm,
    program: &str,
    vcpus: u32,
    params: &[u64],
    opts: Options,
) -> Result<PeerRun, Error> {
    const MEM_MIB: u64 = 64;
    let mut all = [0; PARAMS];
    all[..params.len().min(PARAMS)].copy_from_slice(&params[..params.len().min(PARAMS)]);
    let program = test_guests::find(program).expect("bench programs are built in");
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
    let result = vmm.run(&path, vcpus, MEM_MIB, timeout(opts));
    std::fs::remove_file(&path).unwrap_or(());
    Ok(result?)
}

/// What a scenario saw of QEMU's run of one variant, for a goal against it
/// that has no figure: only what happened in this run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeerSeen<'a> {
    /// No QEMU binary was found when the scenario started.
    Absent,
    /// QEMU ran and failed, with this error, and was not run again.
    Failed(&'a str),
    /// QEMU ran without an error.
    Ran,
}

impl<'a> PeerSeen<'a> {
    /// `found`: whether the scenario had a QEMU to run; `failure`: the
    /// error of the variant's run, if it failed.
    pub fn of(found: bool, failure: Option<&'a str>) -> Self {
        match (found, failure) {
            (false, _) => Self::Absent,
            (true, Some(e)) => Self::Failed(e),
            (true, None) => Self::Ran,
        }
    }

    /// Why there is no figure.
    fn why(self) -> String {
        match self {
            Self::Absent => format!(
                "no qemu-system-x86_64 was on PATH when this scenario started (install it with \
                 `{INSTALL_HINT}`, or give --qemu)"
            ),
            Self::Failed(e) => format!("QEMU's own APIC failed in this run: {e}"),
            Self::Ran => "QEMU's own APIC ran but reported nothing".into(),
        }
    }
}

/// The goal `what` of this VMM's runs `ours` against QEMU's own APIC's
/// (`user`), met where `met` holds for the ratio; QEMU on KVM's LAPIC
/// (`kernel`) is given beside it. Says what this run saw where QEMU gave
/// no result (`seen`).
pub fn goal_against_qemu(
    seen: PeerSeen,
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
        return format!("Goal: {what}. Not measured: {}{beside_kernel}.", seen.why());
    }
    let ratio = ours.ratio_to(user);
    goal(
        what,
        &format!("{} QEMU's{beside_kernel}", ratio.ratio_text()),
        met(ratio.median()),
        &ratio.each(met),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_goal_without_qemus_figure_says_what_this_run_saw() {
        let ours = Runs(vec![1.0]);
        let none = Runs::new();
        let line = |seen| goal_against_qemu(seen, "x", &ours, &none, &none, |_| true);
        assert!(line(PeerSeen::of(false, None)).contains("no qemu-system-x86_64 was on PATH"));
        let failed = line(PeerSeen::of(true, Some("QEMU did not finish within 30s")));
        assert!(
            failed.contains("failed in this run: QEMU did not finish within 30s"),
            "{failed}"
        );
        assert!(
            !failed.contains("PVM") && !failed.contains("7.2"),
            "{failed}"
        );
        assert!(line(PeerSeen::of(true, None)).contains("ran but reported nothing"));
    }
}
