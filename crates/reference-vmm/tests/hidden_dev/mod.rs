//! A machine without `/dev/kvm`, for one command: a mount namespace whose
//! `/dev` is an empty tmpfs.

use std::path::Path;
use std::process::Command;

/// `program args...` in a mount namespace of its own whose `/dev` is an
/// empty tmpfs: a machine without `/dev/kvm`, for this one command. It
/// needs root (CAP_SYS_ADMIN) and util-linux's `unshare`; where those are
/// missing the command fails, saying `unshare:` or `mount:`.
pub fn without_dev(program: &Path, args: &[&str]) -> Command {
    let mut run = Command::new("unshare");
    run.args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(r#"mount -t tmpfs none /dev && exec "$@""#)
        .arg("sh")
        .arg(program)
        .args(args);
    run
}

/// Whether `output` is [`without_dev`] failing to make its namespace.
pub fn namespace_refused(output: &str) -> bool {
    output.contains("unshare: ") || output.contains("mount: ")
}
