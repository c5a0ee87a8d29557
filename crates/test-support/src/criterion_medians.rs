//! Criterion's medians, read back from the files a `cargo bench` run leaves,
//! so that a bench can write its own table into `RESULTS.md`.

use std::path::PathBuf;
use std::process::Command;

/// Whether this bench process measures every benchmark: run by `cargo bench`
/// with no filter and not in test or list mode (`--quick` is fine). Only then
/// are all the medians on disk this run's, not an earlier run's.
pub fn measures_everything() -> bool {
    std::env::args()
        .skip(1)
        .all(|a| a == "--bench" || a == "--quick")
        && std::env::args().any(|a| a == "--bench")
}

/// The median of benchmark `id` of `group` in ns, from criterion's
/// `estimates.json` of its latest run; `None` if there is none.
pub fn median_ns(group: &str, id: &str) -> Option<f64> {
    median_ns_in(&criterion_dir()?, group, id)
}

/// [`median_ns`] from the criterion directory `dir`.
pub(crate) fn median_ns_in(dir: &std::path::Path, group: &str, id: &str) -> Option<f64> {
    let path = dir
        .join(filename_safe(group))
        .join(filename_safe(id))
        .join("new/estimates.json");
    let json = std::fs::read_to_string(path).ok()?;
    let estimates: serde_json::Value = serde_json::from_str(&json).ok()?;
    estimates["median"]["point_estimate"].as_f64()
}

/// Where criterion writes: `$CARGO_TARGET_DIR/criterion`, or the target
/// directory `cargo metadata` names, as criterion finds it.
pub(crate) fn criterion_dir() -> Option<PathBuf> {
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let cargo = std::env::var_os("CARGO")?;
            let out = Command::new(cargo)
                .args(["metadata", "--format-version", "1", "--no-deps"])
                .output()
                .ok()?;
            let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
            PathBuf::from(metadata["target_directory"].as_str()?)
        }
    };
    Some(target.join("criterion"))
}

/// Criterion's `make_filename_safe`, for the names used here (short ASCII).
pub(crate) fn filename_safe(name: &str) -> String {
    name.replace(['?', '"', '/', '\\', '*', '<', '>', ':', '|', '^'], "_")
}
