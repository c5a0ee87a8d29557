//! What the simulators share: traces on disk (a name, and one duration in ns
//! per line, `#` starting a comment), a reproducible random source for
//! synthetic traces, and their markdown tables.
//!
//! halt-poll's and lapic-timer's `sim/` include this file through a link, so
//! that it ships with each of them.

use std::fmt::Write as _;
use std::fs;
use std::io;
use std::path::Path;
use std::time::Duration;

/// Reads a trace saved by [`save`]: its name (the file's stem) and values.
pub fn load(path: &Path) -> io::Result<(String, Vec<Duration>)> {
    let text = fs::read_to_string(path)?;
    let mut values = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let ns: u64 = line.parse().map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{}:{}: {e}: {line:?}", path.display(), n + 1),
            )
        })?;
        values.push(Duration::from_nanos(ns));
    }
    let name = path
        .file_stem()
        .map_or("recorded".into(), |s| s.to_string_lossy().into_owned());
    Ok((name, values))
}

/// Writes `values` one per line in ns, under a `# header` line.
pub fn save(path: &Path, header: &str, values: &[Duration]) -> io::Result<()> {
    let mut text = format!("# {header}\n");
    for v in values {
        let _ = writeln!(text, "{}", v.as_nanos());
    }
    fs::write(path, text)
}

/// A markdown table under the line `heading`: `columns`, then one line per
/// row.
pub fn table(heading: &str, columns: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = format!("{heading}\n\n| {} |\n|", columns.join(" | "));
    out.push_str(&"---|".repeat(columns.len()));
    out.push('\n');
    for row in rows {
        let _ = writeln!(out, "| {} |", row.join(" | "));
    }
    out
}

/// SplitMix64: the same synthetic trace from the same seed, everywhere.
#[derive(Clone, Debug)]
pub struct Rng(pub u64);

impl Rng {
    /// A uniform value in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Exponentially distributed, of mean `mean_us` µs.
    pub fn exponential(&mut self, mean_us: f64) -> Duration {
        Duration::from_nanos((-(1.0 - self.unit()).ln() * mean_us * 1000.0) as u64)
    }

    /// Uniform in `[lo_us, hi_us)` µs.
    pub fn uniform(&mut self, lo_us: f64, hi_us: f64) -> Duration {
        Duration::from_nanos(((lo_us + (hi_us - lo_us) * self.unit()) * 1000.0) as u64)
    }
}
