//! Two hosts for the migration tests and bench: two network namespaces
//! joined by a veth pair, the source's end rate-limited by a token bucket
//! (this kernel has no netem, so there is no added delay), made by the
//! test and removed when it drops them. A process runs in one with
//! [`TwoHosts::command`]; a thread of this process enters one with
//! [`TwoHosts::enter`] (the sockets it makes then belong to it).

use std::process::Command;

/// The source's and the destination's namespaces and addresses.
#[derive(Debug)]
pub struct TwoHosts {
    /// The source's namespace.
    pub source: String,
    /// The destination's namespace.
    pub destination: String,
    /// The source's end of the veth pair, while it is in no namespace yet.
    veth: String,
}

/// The destination's address on the link (namespaces keep it private).
pub const DESTINATION_IP: &str = "10.213.0.2";
const SOURCE_IP: &str = "10.213.0.1";

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("cannot run ip: {e}"))?;
    match out.status.success() {
        true => Ok(()),
        false => Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// The part of every name this process gives its namespaces and links.
fn process_id() -> u32 {
    std::process::id() % 100_000
}

/// Removes every namespace and unmoved veth end this process made, for a
/// process stopped before its [`TwoHosts`] were dropped; returns the
/// namespaces it removed.
pub fn remove_all_of_this_process() -> Vec<String> {
    let prefix = format!("rvmm-{}-", process_id());
    let names: Vec<String> = std::fs::read_dir("/var/run/netns")
        .map(|dir| {
            let names = dir
                .flatten()
                .filter_map(|e| e.file_name().into_string().ok());
            names.filter(|n| n.starts_with(&prefix)).collect()
        })
        .unwrap_or_default();
    let _ = ip(&["link", "del", &format!("rv{}s", process_id())]);
    names
        .into_iter()
        .filter(|ns| ip(&["netns", "del", ns]).is_ok())
        .collect()
}

impl TwoHosts {
    /// Two namespaces named after `tag`, the link between them limited to
    /// `rate` (tc's syntax, e.g. `1gbit`) from the source. An error says
    /// why they cannot be made here (not root, no `ip`).
    pub fn new(tag: &str, rate: &str) -> Result<Self, String> {
        let id = process_id();
        let (a, b) = (format!("rv{id}s"), format!("rv{id}d"));
        let hosts = Self {
            source: format!("rvmm-{id}-{tag}-src"),
            destination: format!("rvmm-{id}-{tag}-dst"),
            veth: a.clone(),
        };
        ip(&["netns", "add", &hosts.source])?;
        ip(&["netns", "add", &hosts.destination])?;
        ip(&["link", "add", &a, "type", "veth", "peer", "name", &b])?;
        ip(&["link", "set", &a, "netns", &hosts.source])?;
        ip(&["link", "set", &b, "netns", &hosts.destination])?;
        for (ns, dev, addr) in [
            (&hosts.source, &a, SOURCE_IP),
            (&hosts.destination, &b, DESTINATION_IP),
        ] {
            ip(&["-n", ns, "addr", "add", &format!("{addr}/24"), "dev", dev])?;
            ip(&["-n", ns, "link", "set", dev, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        let tc = Command::new("ip")
            .args([
                "netns",
                "exec",
                &hosts.source,
                "tc",
                "qdisc",
                "add",
                "dev",
                &a,
            ])
            .args([
                "root", "tbf", "rate", rate, "burst", "1mb", "latency", "50ms",
            ])
            .output()
            .map_err(|e| format!("cannot run tc: {e}"))?;
        if !tc.status.success() {
            return Err(format!(
                "tc: {}",
                String::from_utf8_lossy(&tc.stderr).trim()
            ));
        }
        Ok(hosts)
    }

    /// Moves the calling thread into namespace `ns`: the sockets it makes
    /// from then on, and those of the threads it spawns, are that host's.
    pub fn enter(ns: &str) -> Result<(), String> {
        let path = format!("/var/run/netns/{ns}");
        let file = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        // SAFETY: setns on a namespace file this function holds open; it
        // changes only the calling thread's network namespace.
        let done =
            unsafe { libc::setns(std::os::fd::AsRawFd::as_raw_fd(&file), libc::CLONE_NEWNET) };
        match done {
            0 => Ok(()),
            _ => Err(format!("setns {ns}: {}", std::io::Error::last_os_error())),
        }
    }

    /// `program` to run in namespace `ns`.
    pub fn command(ns: &str, program: &str) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", ns, program]);
        command
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes its end of the veth pair, and so both;
        // a pair made and not moved yet goes by name.
        let _ = ip(&["link", "del", &self.veth]);
        let _ = ip(&["netns", "del", &self.source]);
        let _ = ip(&["netns", "del", &self.destination]);
    }
}
