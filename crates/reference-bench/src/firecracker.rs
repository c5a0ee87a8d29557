//! Firecracker, a peer VMM: boots an image file ([`test_guests::pvh`]) from
//! a configuration file (`--no-api --config-file`), the guest's COM1 on its
//! standard output and its log on standard error; the guest ends it
//! through the i8042's reset
//! ([`I8042_COMMAND_PORT`](test_guests::abi::I8042_COMMAND_PORT)).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::peer_run::{self, Launch, PeerBinary, PeerEnv, PeerError, PeerRun};

/// Its binary's name.
pub const BINARY: &str = "firecracker";

/// Where to get it.
pub const HINT: &str = "build it from its source, or set VM_LATENCY_PEERS to a folder holding \
                        it (this project's machines: ../shared/peers)";

/// A Firecracker binary to run images with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Firecracker {
    binary: PathBuf,
    env: PeerEnv,
}

/// The configuration that boots `image` with `vcpus` vCPUs and `mem_mib`
/// MiB, and no drive.
pub fn config(image: &Path, vcpus: u32, mem_mib: u64) -> String {
    serde_json::json!({
        "boot-source": { "kernel_image_path": image },
        "drives": [],
        "machine-config": { "vcpu_count": vcpus, "mem_size_mib": mem_mib },
    })
    .to_string()
}

impl PeerBinary for Firecracker {
    const NAME: &'static str = BINARY;

    fn at(path: impl Into<PathBuf>) -> Self {
        Self {
            binary: path.into(),
            env: PeerEnv::default(),
        }
    }

    fn binary(&self) -> &Path {
        &self.binary
    }
}

impl Firecracker {
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

    /// The command line that boots the VM `config_file` describes, its log
    /// on standard error (not among the guest's lines).
    pub fn command(&self, config_file: &Path) -> Command {
        let mut cmd = Command::new(&self.binary);
        self.env.apply(&mut cmd);
        cmd.args(["--no-api", "--log-path", "/dev/stderr", "--config-file"])
            .arg(config_file);
        cmd
    }

    /// Boots `image` and waits for the guest to finish, at most `timeout`;
    /// its configuration goes in a file beside the image, removed after.
    pub fn run(
        &self,
        image: &Path,
        vcpus: u32,
        mem_mib: u64,
        timeout: Duration,
    ) -> Result<PeerRun, PeerError> {
        let vmm = "Firecracker";
        let path = image.with_extension("firecracker.json");
        std::fs::write(&path, config(image, vcpus, mem_mib)).map_err(|source| {
            PeerError::Write {
                vmm,
                path: path.clone(),
                source,
            }
        })?;
        let ran = peer_run::run(Launch {
            vmm,
            hint: HINT,
            command: self.command(&path),
            exit_status: 0,
            vcpus,
            timeout,
        });
        let _ = std::fs::remove_file(&path);
        ran
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_configuration_names_the_image_the_vcpus_and_the_memory() {
        let config: serde_json::Value =
            serde_json::from_str(&config(Path::new("/g.elf"), 3, 64)).unwrap();
        assert_eq!(config["boot-source"]["kernel_image_path"], "/g.elf");
        assert_eq!(config["machine-config"]["vcpu_count"], 3);
        assert_eq!(config["machine-config"]["mem_size_mib"], 64);
        assert_eq!(config["drives"], serde_json::json!([]));
    }
}
