//! A crate's `RESULTS.md`: one section per measuring command, each rewritten
//! in place by the command that measures it, with that command and the machine
//! it ran on, so that every number in the file is the named command's.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

/// Replaces section `name` of `results_md` (the crate's `RESULTS.md`; created
/// with a title for `crate_name` if missing) with `body`, headed by `command`
/// and the machine. Prints where it wrote, or why it could not: a result that
/// cannot be saved is still printed by its command, so this never fails it.
pub fn write_section(results_md: &Path, crate_name: &str, name: &str, command: &str, body: &str) {
    let old = std::fs::read_to_string(results_md).unwrap_or_else(|_| title(crate_name));
    let section = format!(
        "`{command}`, on {} ({})\n\n{}\n",
        machine(),
        today(),
        body.trim_end()
    );
    match std::fs::write(results_md, replace_section(&old, name, &section)) {
        Ok(()) => eprintln!("wrote section {name:?} of {}", results_md.display()),
        Err(e) => eprintln!("cannot write {}: {e}", results_md.display()),
    }
}

/// The argument that asks a measuring example to rewrite its section of the
/// crate's tracked `RESULTS.md`; without it a run only prints.
pub const UPDATE_RESULTS: &str = "--update-results";

/// Whether `args` (a process's arguments) include [`UPDATE_RESULTS`].
pub fn update_asked(mut args: impl Iterator<Item = String>) -> bool {
    args.any(|a| a == UPDATE_RESULTS)
}

/// This process's arguments, less [`UPDATE_RESULTS`]: what an example's own
/// parser reads.
pub fn args() -> impl Iterator<Item = String> {
    std::env::args().skip(1).filter(|a| a != UPDATE_RESULTS)
}

/// [`write_section`] where this process was run with [`UPDATE_RESULTS`];
/// otherwise says how to ask, leaving `results_md` as it was.
pub fn write_section_if_asked(
    results_md: &Path,
    crate_name: &str,
    name: &str,
    command: &str,
    body: &str,
) {
    if update_asked(std::env::args().skip(1)) {
        write_section(results_md, crate_name, name, command, body);
    } else {
        eprintln!(
            "{} not rewritten (run with {UPDATE_RESULTS} to record this run there)",
            results_md.display()
        );
    }
}

/// The command line that ran this process: `cargo_command` (say, `cargo run
/// --release -p halt-poll --example pingpong`) and, after `--`, the arguments
/// (less the `--bench` that `cargo bench` adds, and [`UPDATE_RESULTS`]).
pub fn command(cargo_command: &str) -> String {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench" && a != UPDATE_RESULTS)
        .collect();
    if args.is_empty() {
        cargo_command.to_owned()
    } else {
        format!("{cargo_command} -- {}", args.join(" "))
    }
}

pub(crate) fn title(crate_name: &str) -> String {
    format!(
        "# {crate_name} results\n\n\
         Each section is written by the command it names, which replaces only its \
         own section; what each measures is in the crate's README. Ratios compare \
         variants of the same run: these hosts are shared and noisy.\n"
    )
}

/// `text` with the section between `name`'s markers replaced by `section`, or
/// with the section appended when `text` has no such markers.
pub fn replace_section(text: &str, name: &str, section: &str) -> String {
    let (begin, end) = (
        format!("<!-- begin {name} -->\n"),
        format!("<!-- end {name} -->\n"),
    );
    let block = format!("{begin}{section}{end}");
    match (text.find(&begin), text.find(&end)) {
        (Some(b), Some(e)) if b < e => {
            format!("{}{block}{}", &text[..b], &text[e + end.len()..])
        }
        _ => format!("{}\n{block}", text.trim_end_matches('\n').to_owned() + "\n"),
    }
}

/// The kernel, the CPU model and how many CPUs are online.
pub(crate) fn machine() -> String {
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .and_then(|l| l.split(':').nth(1))
        .unwrap_or("unknown CPU")
        .trim();
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("Linux {}, {cpus} × {model}", kernel.trim())
}

/// Today's date (UTC), `YYYY-MM-DD`.
pub(crate) fn today() -> String {
    let days = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400) as i64;
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to a date.
pub(crate) fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}
