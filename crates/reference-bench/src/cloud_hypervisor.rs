//! Cloud Hypervisor, a peer VMM: boots an image file ([`test_guests::pvh`])
//! with `--kernel`, the guest's COM1 on its standard output; the guest ends
//! it through its ACPI shutdown device
//! ([`ACPI_SHUTDOWN_PORT`](test_guests::abi::ACPI_SHUTDOWN_PORT)).

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::peer_run::{self, Launch, PeerBinary, PeerEnv, PeerError, PeerRun};

/// Its binary's name.
pub const BINARY: &str = "cloud-hypervisor";

/// Where to get it.
pub const HINT: &str = "build it from its source, or set VM_LATENCY_PEERS to a folder holding \
                        it (this project's machines: ../shared/peers)";

/// A Cloud Hypervisor binary to run images with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CloudHypervisor {
    binary: PathBuf,
    env: PeerEnv,
    /// Arguments after the boot arguments.
    args: Vec<OsString>,
}

impl PeerBinary for CloudHypervisor {
    const NAME: &'static str = BINARY;

    fn at(path: impl Into<PathBuf>) -> Self {
        Self {
            binary: path.into(),
            env: PeerEnv::default(),
            args: Vec::new(),
        }
    }

    fn binary(&self) -> &Path {
        &self.binary
    }
}

impl CloudHypervisor {
    /// This binary, run with `key` set to `value` in its environment (how
    /// an integration patch takes its settings).
    pub fn with_env(mut self, key: &str, value: &str) -> Self {
        self.env.set(key, value);
        self
    }

    /// The environment it runs with beyond this process's.
    pub fn env(&self) -> &PeerEnv {
        &self.env
    }

    /// This binary, run with `args` after the boot arguments.
    pub fn with_args(mut self, args: impl IntoIterator<Item = impl Into<OsString>>) -> Self {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// The command line that boots `image` with `vcpus` vCPUs and
    /// `mem_mib` MiB: its serial port on standard output, no console.
    pub fn command(&self, image: &Path, vcpus: u32, mem_mib: u64) -> Command {
        let mut cmd = Command::new(&self.binary);
        cmd.args(boot_args(image, vcpus, mem_mib));
        cmd.args(&self.args);
        self.env.apply(&mut cmd);
        cmd
    }

    /// Boots `image` and waits for the guest to finish, at most `timeout`.
    pub fn run(
        &self,
        image: &Path,
        vcpus: u32,
        mem_mib: u64,
        timeout: Duration,
    ) -> Result<PeerRun, PeerError> {
        peer_run::run(Launch {
            vmm: "Cloud Hypervisor",
            hint: HINT,
            command: self.command(image, vcpus, mem_mib),
            exit_status: 0,
            vcpus,
            timeout,
        })
    }
}

/// The arguments that boot `image` with `vcpus` vCPUs and `mem_mib` MiB:
/// its serial port on standard output, no console.
pub fn boot_args(image: &Path, vcpus: u32, mem_mib: u64) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec!["--kernel".into(), image.into()];
    for arg in [
        "--cpus",
        &format!("boot={vcpus}"),
        "--memory",
        &format!("size={mem_mib}M"),
        "--serial",
        "tty",
        "--console",
        "off",
    ] {
        args.push(arg.into());
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_boots_the_image_with_its_serial_on_stdout() {
        let cmd = CloudHypervisor::at("/ch").command(Path::new("g.elf"), 2, 64);
        let line: Vec<String> = cmd
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            line.join(" "),
            "--kernel g.elf --cpus boot=2 --memory size=64M --serial tty --console off"
        );
    }
}
