//! Runs one built-in guest program with given mechanisms and parameters, for
//! the tests that check what a program reports.

use std::time::Duration;

use reference_vmm::VmMemory;
use reference_vmm::{Error, RunReport, Vm, VmConfig};
use reference_vmm_cli::presets::Choices;

/// Runs `name` on `vcpus` vCPUs; returns its report and its memory after the run.
pub fn run(
    name: &str,
    vcpus: u32,
    choices: Choices,
    params: &[u64],
) -> Result<(RunReport, VmMemory), Error> {
    let mut config = choices.config(VmConfig {
        vcpus,
        timeout: Some(Duration::from_secs(120)),
        ..VmConfig::default()
    });
    config.params[..params.len()].copy_from_slice(params);
    let vm = Vm::new(&config)?;
    let memory = vm.memory();
    let report = vm.run(
        test_guests::find(name).expect("a built-in program"),
        Box::new(std::io::sink()),
    )?;
    Ok((report, memory))
}

/// Asserts that every one of the first `vcpus` vCPUs reported `name` as `expected`.
#[allow(dead_code)] // each test binary compiles this module; not all of them use it
pub fn assert_each(report: &RunReport, vcpus: u32, name: &str, expected: u64, what: &str) {
    for vcpu in 0..vcpus {
        assert_eq!(
            report.value(vcpu, name),
            Some(expected),
            "{what}: vCPU {vcpu}"
        );
    }
}
