//! The command line as a user runs it, for the tests that migrate between
//! `reference-vmm` processes: the binary, the `migrate` guest's
//! arguments, a destination in the background, TLS files, the checks of a
//! guest that moved. Each test binary uses some of it.
#![allow(dead_code)]

use std::io::Read;
use std::process::{Child, Command, Output, Stdio};

use migration::Address;
use test_support::hosts;

/// Pages each vCPU of the `migrate` guest rewrites and checks.
pub const PAGES: u64 = 256;
/// How long the `migrate` guest runs on once its move has ended.
pub const AFTER_THE_MOVE_MS: u64 = 500;

/// The `migrate` guest's parameters: [`PAGES`] per vCPU rewritten 10 µs
/// apart, a 1 ms timer on vCPU 0, [`AFTER_THE_MOVE_MS`] once the move
/// ended (at the destination, or at the source when it failed).
pub fn migrate_params() -> [u64; 5] {
    let ms = lapic_timer::TscClock::shared().tsc_khz();
    [PAGES, AFTER_THE_MOVE_MS * ms, ms / 100, ms, 1]
}

pub fn socket(name: &str) -> Address {
    let path = std::env::temp_dir().join(format!("rvmm-{}-{name}.sock", std::process::id()));
    Address::Unix(path)
}

pub fn vmm() -> Command {
    Command::new(env!("CARGO_BIN_EXE_reference-vmm"))
}

/// The VMM in network namespace `ns` (a host of [`hosts::TwoHosts`]).
pub fn vmm_in(ns: &str) -> Command {
    hosts::TwoHosts::command(ns, env!("CARGO_BIN_EXE_reference-vmm"))
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// `run` of the migration guest on 2 vCPUs and 64 MiB with `params`.
pub fn run_migrate(params: &str) -> Command {
    migrate_with(vmm(), params)
}

/// `run` of the migration guest on 2 vCPUs and 64 MiB with `params`, by
/// `run` (the VMM, maybe in a namespace).
pub fn migrate_with(mut run: Command, params: &str) -> Command {
    run.args([
        "run",
        "--guest",
        "migrate",
        "--vcpus",
        "2",
        "--mem-mib",
        "64",
    ])
    .args(["--params", params]);
    run
}

/// `run --guest migrate` with `extra` arguments (the move 50 ms in, unless
/// they say when), in the background.
pub fn source(extra: &[&str]) -> Child {
    source_by(vmm(), extra)
}

/// [`source`], by `vmm` (maybe in a namespace).
pub fn source_by(vmm: Command, extra: &[&str]) -> Child {
    let params = migrate_params()
        .iter()
        .map(u64::to_string)
        .collect::<Vec<_>>()
        .join(",");
    migrate_with(vmm, &params)
        .args(
            (!extra.contains(&"--migrate-after-ms"))
                .then_some(["--migrate-after-ms", "50"])
                .iter()
                .flatten(),
        )
        .args(extra)
        .args(
            extra
                .contains(&"--migrate-to")
                .then_some(["--max-precopy-ms", "1000"])
                .iter()
                .flatten(),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

pub fn assert_guest_checked(out: &Output, what: &str) {
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{what}: {}\n{}",
        stdout,
        text(&out.stderr)
    );
    assert!(stdout.contains("finished"), "{what}: {stdout}");
    assert_eq!(
        stdout.matches("pages_checked = 256").count(),
        2,
        "{what}: {stdout}"
    );
}

/// `receive`'s and `run`'s TLS arguments: the destination's certificate
/// for `destination`, the source's for `source.example`, which the
/// destination allows.
pub fn tls_args(ca: &test_support::certs::Ca, destination: &str) -> (Vec<String>, Vec<String>) {
    let args = |files: test_support::certs::CertFiles| {
        [
            ("--tls-cert", files.cert),
            ("--tls-key", files.key),
            ("--tls-ca", files.ca),
        ]
        .into_iter()
        .flat_map(|(flag, path)| [flag.to_string(), path.to_string_lossy().into_owned()])
        .collect::<Vec<String>>()
    };
    let mut receive = args(ca.files(destination, ca));
    receive.extend(["--tls-allow".into(), "source.example".into()]);
    (receive, args(ca.files("source.example", ca)))
}

/// A `receive` in namespace `ns` listening at `listen` with `tls`.
pub fn receive_in(ns: &str, listen: &str, tls: &[String]) -> Background {
    Background(
        vmm_in(ns)
            .args(["receive", "--listen", listen])
            .args(tls)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    )
}

/// A process the test waits for, killed if the test fails first (a
/// destination whose source never came would wait for ever).
pub struct Background(pub Child);

impl Background {
    /// The address a `receive` prints first (after its warnings).
    pub fn listening_on(&mut self) -> String {
        let stderr = self.0.stderr.as_mut().unwrap();
        loop {
            let mut line = Vec::new();
            let mut byte = [0u8];
            while stderr.read(&mut byte).unwrap() == 1 && byte[0] != b'\n' {
                line.push(byte[0]);
            }
            let line = text(&line);
            if !line.starts_with("warning: ") {
                return line
                    .strip_prefix("listening on ")
                    .unwrap_or_else(|| panic!("{line}"))
                    .to_owned();
            }
        }
    }

    /// The first line on stderr from here that holds `word`, within
    /// `limit` (a panic past it).
    pub fn log_line_with(&mut self, word: &str, limit: std::time::Duration) -> String {
        let mut stderr = std::io::BufReader::new(self.0.stderr.take().unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let word = word.to_owned();
        std::thread::spawn(move || {
            let mut line = String::new();
            while std::io::BufRead::read_line(&mut stderr, &mut line).unwrap_or(0) > 0 {
                if line.contains(&word) {
                    let _ = tx.send(line);
                    return;
                }
                line.clear();
            }
        });
        rx.recv_timeout(limit)
            .unwrap_or_else(|_| panic!("no line on stderr within {limit:?}"))
    }

    pub fn output(&mut self) -> Output {
        let mut out = Output {
            status: self.0.wait().unwrap(),
            stdout: Vec::new(),
            stderr: Vec::new(),
        };
        self.0
            .stdout
            .take()
            .unwrap()
            .read_to_end(&mut out.stdout)
            .unwrap();
        self.0
            .stderr
            .take()
            .unwrap()
            .read_to_end(&mut out.stderr)
            .unwrap();
        out
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
