//! QEMU, the peer VMM: boots an image file ([`test_guests::pvh`]) under QEMU on
//! the same KVM and collects what the guest reported, so that this VMM's
//! figures can stand beside QEMU's for the same guest code.
//!
//! QEMU runs with the arguments of [`qemu_args`]. The guest reports in ucall
//! text lines on COM1 and ends QEMU through the debug-exit port at
//! [`DEBUG_EXIT_PORT`](test_guests::abi::DEBUG_EXIT_PORT); a QEMU that has not ended by the timeout is killed by
//! its pid (on an emulation failure QEMU pauses instead of exiting).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use test_guests::pvh::qemu_args;

use crate::peer_run::{self, Launch, PeerBinary, PeerError, PeerRun};

/// The QEMU binary looked for on `PATH`.
pub const QEMU_BINARY: &str = "qemu-system-x86_64";

/// How to install QEMU where it is missing (Debian).
pub const INSTALL_HINT: &str = "apt-get install -y --no-install-recommends qemu-system-x86";

/// Where QEMU's local APICs live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QemuApic {
    /// QEMU's own, in userspace (`kernel-irqchip=off`): the same job as this
    /// VMM's `--irqchip user`.
    User,
    /// KVM's in-kernel LAPIC (`kernel-irqchip=on`), for reference.
    Kernel,
}

/// A QEMU binary to run images with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Qemu {
    binary: PathBuf,
}

impl PeerBinary for Qemu {
    const NAME: &'static str = QEMU_BINARY;

    fn at(path: impl Into<PathBuf>) -> Self {
        Self {
            binary: path.into(),
        }
    }

    fn binary(&self) -> &Path {
        &self.binary
    }
}

impl Qemu {
    /// The command line that boots `image` (with `vcpus` vCPUs and `mem_mib`
    /// MiB) under QEMU with `apic`.
    pub fn command(&self, image: &Path, vcpus: u32, mem_mib: u64, apic: QemuApic) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.args(qemu_args(image, vcpus, mem_mib, apic == QemuApic::Kernel));
        cmd
    }

    /// Boots `image` and waits for the guest to finish, at most `timeout`.
    pub fn run(
        &self,
        image: &Path,
        vcpus: u32,
        mem_mib: u64,
        apic: QemuApic,
        timeout: Duration,
    ) -> Result<PeerRun, PeerError> {
        peer_run::run(Launch {
            vmm: "QEMU",
            hint: INSTALL_HINT,
            command: self.command(image, vcpus, mem_mib, apic),
            // isa-debug-exit with 0: status 1.
            exit_status: 1,
            vcpus,
            timeout,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_names_the_apic_and_the_image() {
        let cmd = Qemu::at("/usr/bin/qemu").command(Path::new("g.elf"), 1, 64, QemuApic::User);
        let args: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        let line = args.join(" ");
        assert!(line.contains("-accel kvm,kernel-irqchip=off"), "{line}");
        assert!(line.contains("isa-debug-exit,iobase=0xf4"), "{line}");
        assert!(line.ends_with("-kernel g.elf"), "{line}");
    }

    #[test]
    fn a_missing_binary_is_a_clear_error() {
        let err = Qemu::at("/nonexistent/qemu")
            .run(
                Path::new("x"),
                1,
                64,
                QemuApic::User,
                Duration::from_secs(1),
            )
            .unwrap_err();
        assert!(err.to_string().contains("apt-get install"), "{err}");
    }
}
