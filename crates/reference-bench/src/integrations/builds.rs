//! What the Cloud Hypervisor integrations share: both builds, or the goals
//! saying how to get them, and the patched build's log.

use std::ffi::OsStr;
use std::path::PathBuf;

use crate::Options;
use crate::cloud_hypervisor::CloudHypervisor;
use crate::peer::Peers;
use crate::peer_run::PeerBinary;
use crate::table::Table;

/// The stock Cloud Hypervisor among `peers` and the patched build `opts`
/// names; without both, each goal `asks` goes to `t` as not measured,
/// saying how to get them.
pub(super) fn cloud_hypervisors<'p>(
    opts: Options,
    peers: &'p Peers,
    t: &mut Table,
    asks: &[String],
) -> Option<(&'p CloudHypervisor, CloudHypervisor)> {
    let patched = opts.patched_cloud_hypervisor.map(CloudHypervisor::at);
    if let (Some(stock), Some(patched)) = (peers.cloud_hypervisor(), patched) {
        return Some((stock, patched));
    }
    let why = missing(peers.cloud_hypervisor().is_some());
    for ask in asks {
        t.peer_goal(format!("Goal: {ask}. Not measured: {why}."));
    }
    None
}

/// What is missing, and how to get it.
fn missing(have_stock: bool) -> String {
    let build = "build the patched one with integrations/cloud-hypervisor/apply.sh and name it \
                 with --patched-cloud-hypervisor";
    match have_stock {
        true => build.into(),
        false => format!(
            "no stock Cloud Hypervisor ({}); and {build}",
            crate::cloud_hypervisor::HINT
        ),
    }
}

/// A log file in the temporary folder, removed when dropped.
pub(super) struct LogFile(PathBuf);

impl LogFile {
    pub(super) fn new() -> Self {
        Self(std::env::temp_dir().join(format!("reference-bench-ch-{}.log", std::process::id())))
    }

    /// `ch`, logging (`-v`) to this file.
    pub(super) fn onto(&self, ch: &CloudHypervisor) -> CloudHypervisor {
        let args = [
            OsStr::new("-v"),
            OsStr::new("--log-file"),
            self.0.as_os_str(),
        ];
        ch.clone().with_args(args)
    }

    /// What it holds, emptied.
    pub(super) fn take(&self) -> String {
        let bytes = std::fs::read(&self.0).unwrap_or_default();
        let _ = std::fs::remove_file(&self.0);
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl Drop for LogFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}
