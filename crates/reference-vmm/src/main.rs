//! `reference-vmm`: runs built-in guest programs on KVM.

use std::fs::File;
use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use reference_vmm::guest::{self, GuestProgram, PROGRAMS};
use reference_vmm::layout::MAX_VCPUS;
use reference_vmm::vm::{check_mem_mib, check_vcpus};
use reference_vmm::{ConfigError, Vm, VmConfig};

/// A reference VMM on real KVM for the vm-latency crates.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a built-in guest program on every vCPU.
    Run(RunArgs),
    /// List the built-in guest programs.
    Guests,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// Guest program to run (see `reference-vmm guests`).
    #[arg(long, value_parser = parse_guest)]
    guest: &'static GuestProgram,
    /// Number of vCPUs, each on its own thread.
    #[arg(long, default_value_t = 1, value_name = "N", value_parser = parse_vcpus)]
    vcpus: u32,
    /// Guest memory in MiB (even).
    #[arg(long, default_value_t = 64, value_name = "M", value_parser = parse_mem_mib)]
    mem_mib: u64,
    /// Write the guest's serial output to this file instead of stdout.
    #[arg(long, value_name = "PATH")]
    serial_out: Option<PathBuf>,
    /// Stop every vCPU and fail if the guest has not finished after this long.
    #[arg(long, value_name = "MS", value_parser = clap::value_parser!(u64).range(1..))]
    timeout_ms: Option<u64>,
}

fn parse_guest(name: &str) -> Result<&'static GuestProgram, ConfigError> {
    guest::find(name).ok_or_else(|| ConfigError::UnknownGuest {
        name: name.to_owned(),
        known: PROGRAMS
            .iter()
            .map(|p| p.name)
            .collect::<Vec<_>>()
            .join(", "),
    })
}

fn parse_vcpus(s: &str) -> Result<u32, String> {
    let n = s
        .parse::<u32>()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    check_vcpus(n, MAX_VCPUS).map_err(|e| e.to_string())
}

fn parse_mem_mib(s: &str) -> Result<u64, String> {
    let n = s
        .parse::<u64>()
        .map_err(|e| format!("{s:?} is not a number: {e}"))?;
    check_mem_mib(n).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Run(args) => run(args),
        Command::Guests => {
            let lines: String = PROGRAMS
                .iter()
                .map(|p| format!("{:<14} {}\n", p.name, p.about))
                .collect();
            print_or_fail(&lines)
        }
    }
}

fn run(args: RunArgs) -> ExitCode {
    let serial_out: Box<dyn Write + Send> = match &args.serial_out {
        Some(path) => match File::create(path) {
            Ok(f) => Box::new(f),
            Err(e) => return fail(&format!("cannot create {}: {e}", path.display())),
        },
        None => Box::new(io::stdout()),
    };
    let config = VmConfig {
        vcpus: args.vcpus,
        mem_mib: args.mem_mib,
        timeout: args.timeout_ms.map(Duration::from_millis),
    };
    match Vm::new(&config).and_then(|vm| vm.run(args.guest, serial_out)) {
        Ok(report) => print_or_fail(&format!("{report}\n")),
        Err(e) => fail(&e.to_string()),
    }
}

fn print_or_fail(text: &str) -> ExitCode {
    match io::stdout().lock().write_all(text.as_bytes()) {
        Ok(()) => ExitCode::SUCCESS,
        // Nobody is reading (e.g. `| head`): not worth an error message.
        Err(e) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => fail(&format!("cannot write to stdout: {e}")),
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("error: {message}");
    ExitCode::FAILURE
}
