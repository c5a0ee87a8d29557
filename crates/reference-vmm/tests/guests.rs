//! Runs the built-in guest programs on real `/dev/kvm` and checks what they report.

mod common;

use std::io;
use std::time::Duration;

use common::kvm_available;
use reference_vmm::devices::SharedBuffer;
use reference_vmm::{Error, GuestFault, RunReport, StopReason, Vm, VmConfig};
use test_guests::ucall::UcallError;

fn lines(serial: &SharedBuffer) -> Vec<String> {
    let text = String::from_utf8(serial.contents()).unwrap();
    text.lines().map(String::from).collect()
}

/// A generous bound, so that a broken kick fails the test instead of hanging it.
const TIMEOUT: Duration = Duration::from_secs(60);

fn run(name: &str, vcpus: u32) -> (Result<RunReport, Error>, SharedBuffer) {
    let config = VmConfig {
        vcpus,
        timeout: Some(TIMEOUT),
        ..VmConfig::default()
    };
    let serial = SharedBuffer::default();
    let result = Vm::new(&config)
        .unwrap()
        .run(test_guests::find(name).unwrap(), Box::new(serial.clone()));
    (result, serial)
}

fn check_hello(vcpus: u32) {
    let (result, serial) = run("hello", vcpus);
    let report = result.unwrap();
    let mut lines = lines(&serial);
    lines.sort();
    let mut expected: Vec<String> = (0..vcpus).map(|i| format!("hello from vcpu {i}")).collect();
    expected.sort();
    assert_eq!(lines, expected, "one whole greeting line per vCPU");
    assert_eq!(report.vcpus.len(), vcpus as usize);
    for s in &report.vcpus {
        assert!(s.finished, "vcpu {} did not finish", s.index);
        assert_eq!(
            report.value(s.index, "apic_id"),
            Some(u64::from(s.index)),
            "APIC ID of vcpu {}",
            s.index
        );
        assert_ne!(
            report.value(s.index, "tsc"),
            Some(0),
            "vcpu {} must report a TSC reading",
            s.index
        );
        assert!(report.value(s.index, "tsc").is_some());
    }
}

#[test]
fn hello_on_one_vcpu() {
    if kvm_available("hello_on_one_vcpu") {
        check_hello(1);
    }
}

#[test]
fn hello_on_four_vcpus() {
    if kvm_available("hello_on_four_vcpus") {
        check_hello(4);
    }
}

#[test]
fn hello_on_eight_vcpus() {
    if kvm_available("hello_on_eight_vcpus") {
        check_hello(8);
    }
}

fn guest_fault(name: &str, vcpus: u32) -> (u32, GuestFault, String) {
    match run(name, vcpus).0 {
        Err(e @ Error::Guest { .. }) => {
            let text = e.to_string();
            let Error::Guest { vcpu, fault, .. } = e else {
                unreachable!()
            };
            (vcpu, fault, text)
        }
        other => panic!("{name}: expected a guest fault, got {other:?}"),
    }
}

#[test]
fn triple_fault_ends_the_run_with_a_clear_error() {
    if !kvm_available("triple_fault_ends_the_run_with_a_clear_error") {
        return;
    }
    let (vcpu, fault, text) = guest_fault("triple-fault", 2);
    assert!(vcpu < 2);
    assert_eq!(fault, GuestFault::TripleFault);
    assert!(
        text.contains("KVM_EXIT_SHUTDOWN") && text.contains("rip 0x"),
        "{text}"
    );
}

#[test]
fn unknown_port_names_the_vcpu_port_and_data_and_stops_the_spinning_vcpus() {
    if !kvm_available("unknown_port_names_the_vcpu_port_and_data_and_stops_the_spinning_vcpus") {
        return;
    }
    // vCPUs 1..3 spin in guest mode: ending the run needs kicks that work.
    let (vcpu, fault, text) = guest_fault("bad-port", 4);
    assert_eq!(vcpu, 0);
    assert_eq!(
        fault,
        GuestFault::UnknownPort {
            port: 0x1234,
            write: true,
            data: vec![0x5a]
        }
    );
    assert!(
        text.starts_with("vCPU 0: port write of 1 byte(s) at port 0x1234"),
        "{text}"
    );
    assert!(text.contains("cpl 3"), "{text}");
}

#[test]
fn bad_ucall_is_a_guest_fault() {
    if kvm_available("bad_ucall_is_a_guest_fault") {
        let (_, fault, _) = guest_fault("bad-ucall", 1);
        assert_eq!(
            fault,
            GuestFault::BadUcall(UcallError::UnknownCommand(0xbad))
        );
    }
}

#[test]
fn cpl3_privileged_instruction_is_reported_as_gp() {
    if kvm_available("cpl3_privileged_instruction_is_reported_as_gp") {
        let (_, fault, text) = guest_fault("gp-fault", 1);
        assert!(
            matches!(
                fault,
                GuestFault::Exception {
                    vector: 13,
                    error_code: 0,
                    ..
                }
            ),
            "{text}"
        );
        assert!(text.contains("#GP"), "{text}");
    }
}

#[test]
fn guest_assertion_carries_message_and_values() {
    if kvm_available("guest_assertion_carries_message_and_values") {
        let (_, fault, _) = guest_fault("assert-fail", 1);
        assert_eq!(
            fault,
            GuestFault::AssertFailed {
                message: "one equals two".into(),
                a: 1,
                b: 2
            }
        );
    }
}

#[test]
fn timeout_kicks_vcpus_that_never_exit() {
    if !kvm_available("timeout_kicks_vcpus_that_never_exit") {
        return;
    }
    let config = VmConfig {
        vcpus: 3,
        timeout: Some(Duration::from_millis(100)),
        ..VmConfig::default()
    };
    let result = Vm::new(&config)
        .unwrap()
        .run(test_guests::find("spin").unwrap(), Box::new(io::sink()));
    let Err(Error::Stopped { reason, partial }) = result else {
        panic!("expected a stop at the timeout, got {result:?}");
    };
    assert_eq!(reason, StopReason::Timeout(Duration::from_millis(100)));
    assert_eq!(partial.vcpus.len(), 3, "every vCPU's part of the report");
    assert!(partial.vcpus.iter().all(|s| !s.finished));
}

#[test]
fn bad_configuration_is_rejected_before_anything_runs() {
    if !kvm_available("bad_configuration_is_rejected_before_anything_runs") {
        return;
    }
    for config in [
        VmConfig {
            vcpus: 0,
            ..VmConfig::default()
        },
        VmConfig {
            vcpus: 1000,
            ..VmConfig::default()
        },
        VmConfig {
            mem_mib: 31,
            ..VmConfig::default()
        },
        VmConfig {
            mem_mib: 1 << 40,
            ..VmConfig::default()
        },
    ] {
        assert!(
            matches!(Vm::new(&config), Err(Error::Config(_))),
            "{config:?}"
        );
    }
}
