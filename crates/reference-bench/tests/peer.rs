//! The peer VMMs, QEMU, Cloud Hypervisor and Firecracker, boot the guest
//! kit's images on the same KVM and report what the guests did; the guest
//! ends each run through the exit its VMM honours.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::skip;
use reference_bench::cloud_hypervisor::{self, CloudHypervisor};
use reference_bench::firecracker::{self, Firecracker};
use reference_bench::peer_run::{PeerBinary, PeerError, PeerRun};
use reference_bench::qemu::{INSTALL_HINT, Qemu, QemuApic};
use test_guests::Image;
use test_guests::layout::PARAMS;

const QEMU_TIMEOUT: Duration = Duration::from_secs(60);

fn image(name: &str, vcpus: u32) -> Image {
    Image::build(test_guests::find(name).unwrap(), vcpus, 64, [0; PARAMS]).unwrap()
}

/// Writes `image` to a file of its own under the target directory.
fn image_file(test: &str, image: &Image) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let path = dir.join(format!("{test}.elf"));
    std::fs::write(&path, image.bytes()).unwrap();
    path
}

fn qemu(test: &str) -> Option<Qemu> {
    let found = Qemu::find();
    if found.is_none() {
        skip(
            test,
            &format!("no qemu-system-x86_64 on PATH ({INSTALL_HINT})"),
        );
    }
    found
}

#[test]
fn qemu_boots_every_vcpu_of_the_same_image_with_either_apic() {
    let test = "qemu_boots_every_vcpu_of_the_same_image_with_either_apic";
    let Some(qemu) = qemu(test) else { return };
    let path = image_file(test, &image("hello", 3));
    for apic in [QemuApic::User, QemuApic::Kernel] {
        let run = qemu.run(&path, 3, 64, apic, QEMU_TIMEOUT).unwrap();
        for vcpu in 0..3 {
            let greeting = format!("hello from vcpu {vcpu}\n");
            assert!(run.serial.contains(&greeting), "{apic:?}: {run:?}");
            assert_eq!(
                run.value(vcpu, "apic_id"),
                Some(u64::from(vcpu)),
                "{apic:?}"
            );
            assert!(run.value(vcpu, "tsc").is_some_and(|t| t > 0), "{apic:?}");
        }
        assert!(
            run.cpu_time > Duration::ZERO,
            "{apic:?}: QEMU's CPU time read back"
        );
    }
}

#[test]
fn a_guest_failure_under_qemu_ends_the_run_with_its_exception() {
    let test = "a_guest_failure_under_qemu_ends_the_run_with_its_exception";
    let Some(qemu) = qemu(test) else { return };
    let path = image_file(test, &image("gp-fault", 1));
    let err = qemu
        .run(&path, 1, 64, QemuApic::User, QEMU_TIMEOUT)
        .unwrap_err();
    assert!(
        matches!(&err, PeerError::Guest { what, .. } if what.contains("vector: 13")),
        "{err}"
    );
}

/// The Rust VMMs that adopters run, each found on `PATH` or in the peers'
/// folder; a skip, saying how to get it, where it is not.
fn rust_peers(test: &str) -> Vec<(&'static str, RustPeer)> {
    let mut found = Vec::new();
    match CloudHypervisor::find() {
        Some(ch) => found.push(("Cloud Hypervisor", RustPeer::Ch(ch))),
        None => {
            skip(
                test,
                &format!("no cloud-hypervisor ({})", cloud_hypervisor::HINT),
            );
        }
    }
    match Firecracker::find() {
        Some(fc) => found.push(("Firecracker", RustPeer::Fc(fc))),
        None => {
            skip(test, &format!("no firecracker ({})", firecracker::HINT));
        }
    }
    found
}

enum RustPeer {
    Ch(CloudHypervisor),
    Fc(Firecracker),
}

impl RustPeer {
    fn run(&self, image: &Path, vcpus: u32, timeout: Duration) -> Result<PeerRun, PeerError> {
        match self {
            Self::Ch(ch) => ch.run(image, vcpus, 64, timeout),
            Self::Fc(fc) => fc.run(image, vcpus, 64, timeout),
        }
    }
}

#[test]
fn cloud_hypervisor_and_firecracker_boot_the_same_image_and_the_guest_ends_them() {
    let test = "cloud_hypervisor_and_firecracker_boot_the_same_image_and_the_guest_ends_them";
    if !common::kvm_available(test) {
        return;
    }
    let path = image_file(test, &image("hello", 3));
    for (name, peer) in rust_peers(test) {
        let run = peer.run(&path, 3, QEMU_TIMEOUT).unwrap();
        for vcpu in 0..3 {
            let greeting = format!("hello from vcpu {vcpu}\n");
            assert!(run.serial.contains(&greeting), "{name}: {run:?}");
            assert_eq!(run.value(vcpu, "apic_id"), Some(u64::from(vcpu)), "{name}");
        }
        assert!(
            run.cpu_time > Duration::ZERO,
            "{name}: its CPU time read back"
        );
    }
}

#[test]
fn a_guest_failure_under_a_rust_peer_ends_the_run_with_its_exception() {
    let test = "a_guest_failure_under_a_rust_peer_ends_the_run_with_its_exception";
    if !common::kvm_available(test) {
        return;
    }
    let path = image_file(test, &image("gp-fault", 1));
    for (name, peer) in rust_peers(test) {
        let err = peer.run(&path, 1, QEMU_TIMEOUT).unwrap_err();
        assert!(
            matches!(&err, PeerError::Guest { what, .. } if what.contains("vector: 13")),
            "{name}: {err}"
        );
    }
}

/// The kit's virtio driver under Cloud Hypervisor, which always has a
/// virtio entropy device: every request comes back by its MSI-X interrupt,
/// whether the vCPU halts or spins for it. Under Firecracker, which has no
/// PCI bus, the guest says what it lacks.
#[test]
fn the_virtio_rng_guest_gets_each_request_back_by_its_interrupt() {
    let test = "the_virtio_rng_guest_gets_each_request_back_by_its_interrupt";
    if !common::kvm_available(test) {
        return;
    }
    let program = test_guests::find("virtio-rng").unwrap();
    for (name, peer) in rust_peers(test) {
        for spin in [0, 1] {
            let mut params = [0; PARAMS];
            params[..2].copy_from_slice(&[50, spin]);
            let image = Image::build(program, 2, 64, params).unwrap();
            let path = image_file(&format!("{test}-{spin}"), &image);
            let run = peer.run(&path, 2, QEMU_TIMEOUT);
            if let RustPeer::Fc(_) = peer {
                let err = run.unwrap_err();
                assert!(
                    matches!(&err, PeerError::Guest { what, .. }
                        if what.contains("no virtio entropy device on PCI bus 0")),
                    "{name}: {err}"
                );
                continue;
            }
            let run = run.unwrap();
            assert_eq!(
                run.value(0, "irqs"),
                Some(50),
                "{name}, spin {spin}: {run:?}"
            );
            let (ticks, max) = (run.value(0, "ticks").unwrap(), run.value(0, "max").unwrap());
            assert!(max > 0 && max <= ticks, "{name}, spin {spin}: {run:?}");
        }
    }
}

#[test]
fn a_guest_that_never_ends_is_stopped_at_the_timeout() {
    let test = "a_guest_that_never_ends_is_stopped_at_the_timeout";
    if !common::kvm_available(test) {
        return;
    }
    // The migration guest waits for a move that never comes.
    let mut params = [0; PARAMS];
    params[..5].copy_from_slice(&[16, 1, 0, 1 << 20, 1]);
    let program = test_guests::find("migrate").unwrap();
    let path = image_file(test, &Image::build(program, 1, 64, params).unwrap());
    for (name, peer) in rust_peers(test) {
        let err = peer.run(&path, 1, Duration::from_secs(2)).unwrap_err();
        assert!(
            matches!(&err, PeerError::Timeout { timeout, .. } if *timeout == Duration::from_secs(2)),
            "{name}: {err}"
        );
    }
}

#[test]
fn a_rust_peer_that_is_not_there_is_a_clear_error() {
    let path = Path::new("/nonexistent/image.elf");
    let err = CloudHypervisor::at("/nonexistent/cloud-hypervisor")
        .run(path, 1, 64, QEMU_TIMEOUT)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with("cannot start Cloud Hypervisor (/nonexistent/cloud-hypervisor)")
            && err.contains("VM_LATENCY_PEERS"),
        "{err}"
    );
    let err = Firecracker::at("/nonexistent/firecracker")
        .run(
            &std::env::temp_dir().join("rb-absent.elf"),
            1,
            64,
            QEMU_TIMEOUT,
        )
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("cannot start Firecracker"), "{err}");
}

/// One request to Firecracker's API on `socket`: its status code.
fn firecracker_api(socket: &Path, method: &str, path: &str, body: &str) -> u16 {
    use std::io::{Read, Write};
    let mut api = std::os::unix::net::UnixStream::connect(socket).unwrap();
    api.set_read_timeout(Some(QEMU_TIMEOUT)).unwrap();
    write!(
        api,
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 12];
    api.read_exact(&mut head).unwrap();
    let status = String::from_utf8_lossy(&head[9..12]).into_owned();
    status
        .parse()
        .unwrap_or_else(|_| panic!("{method} {path}: {head:?}"))
}

/// Firecracker with its API on `socket`, COM1 on a pipe.
fn firecracker_with_api(fc: &Path, socket: &Path) -> std::process::Child {
    let mut child = std::process::Command::new(fc)
        .arg("--api-sock")
        .arg(socket)
        .args(["--log-path", "/dev/null"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + QEMU_TIMEOUT;
    while !socket.exists() {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("firecracker exited ({status}) before its API socket {socket:?} was there");
        }
        assert!(std::time::Instant::now() < deadline, "no API socket");
        std::thread::sleep(Duration::from_millis(10));
    }
    child
}

#[test]
fn a_guest_restored_by_firecracker_takes_no_stray_legacy_interrupt() {
    let test = "a_guest_restored_by_firecracker_takes_no_stray_legacy_interrupt";
    if !common::kvm_available(test) {
        return;
    }
    let Some(fc) = reference_bench::peer_run::find_binary(firecracker::BINARY) else {
        skip(test, &format!("no firecracker ({})", firecracker::HINT));
        return;
    };
    // The migration guest waits for a move that never comes: it runs on,
    // reporting nothing, unless an interrupt it never armed lands on an
    // exception vector (Firecracker raises legacy IRQ 5 on a restore).
    let mut params = [0; PARAMS];
    params[..5].copy_from_slice(&[16, 1, 0, 1 << 20, 1]);
    let program = test_guests::find("migrate").unwrap();
    let image = image_file(test, &Image::build(program, 2, 64, params).unwrap());
    // Short: a socket's path holds at most 107 bytes (the target directory's
    // may be longer).
    let dir = std::env::temp_dir().join(format!("rb-fc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (snapshot, memory) = (dir.join("vm.snap"), dir.join("vm.mem"));
    let mut source = firecracker_with_api(&fc, &dir.join("source.sock"));
    let api =
        |method, path, body: String| firecracker_api(&dir.join("source.sock"), method, path, &body);
    let boot = serde_json::json!({ "kernel_image_path": image }).to_string();
    assert_eq!(api("PUT", "/boot-source", boot), 204);
    let machine = r#"{"vcpu_count": 2, "mem_size_mib": 64}"#.to_owned();
    assert_eq!(api("PUT", "/machine-config", machine), 204);
    let start = r#"{"action_type": "InstanceStart"}"#.to_owned();
    assert_eq!(api("PUT", "/actions", start), 204);
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        api("PATCH", "/vm", r#"{"state": "Paused"}"#.to_owned()),
        204
    );
    let create = serde_json::json!({
        "snapshot_type": "Full",
        "snapshot_path": snapshot,
        "mem_file_path": memory,
    });
    assert_eq!(api("PUT", "/snapshot/create", create.to_string()), 204);
    source.kill().unwrap();
    source.wait().unwrap();
    let restored_at = dir.join("restored.sock");
    let mut restored = firecracker_with_api(&fc, &restored_at);
    let load = serde_json::json!({
        "snapshot_path": snapshot,
        "mem_backend": { "backend_type": "File", "backend_path": memory },
        "resume_vm": true,
    });
    assert_eq!(
        firecracker_api(&restored_at, "PUT", "/snapshot/load", &load.to_string()),
        204
    );
    std::thread::sleep(Duration::from_secs(1));
    let still_running = restored.try_wait().unwrap().is_none();
    restored.kill().unwrap();
    let out = restored.wait_with_output().unwrap();
    let serial = String::from_utf8_lossy(&out.stdout);
    assert!(
        still_running && !serial.contains("@ucall"),
        "the restored guest stopped or faulted: {serial:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cloud_hypervisor_moves_a_guest_between_two_of_its_processes() {
    use reference_bench::cloud_hypervisor_api::{MoveLink, MoveRequest, PeerMove};
    let test = "cloud_hypervisor_moves_a_guest_between_two_of_its_processes";
    if !common::kvm_available(test) {
        return;
    }
    let Some(ch) = CloudHypervisor::find() else {
        skip(
            test,
            &format!("no cloud-hypervisor ({})", cloud_hypervisor::HINT),
        );
        return;
    };
    // 2 vCPUs each rewriting 1024 pages for 3 s, a timer every 1 ms: every
    // page checked against its generation at the end, on the destination.
    let ticks = reference_bench::ticks_per_us();
    let mut params = [0; PARAMS];
    params[..4].copy_from_slice(&[
        1024,
        (3e6 * ticks) as u64,
        (100.0 * ticks) as u64,
        (1e3 * ticks) as u64,
    ]);
    let program = test_guests::find("migrate").unwrap();
    let image = image_file(test, &Image::build(program, 2, 64, params).unwrap());
    let request = MoveRequest {
        after: Duration::from_millis(500),
        downtime: Duration::from_millis(300),
        timeout: Duration::from_secs(10),
        postcopy: false,
    };
    let socket = std::env::temp_dir().join(format!("rb-chm-test-{}.sock", std::process::id()));
    let moved = ch
        .migrate(
            &image,
            (2, 64),
            request,
            &MoveLink::Unix(socket.clone()),
            QEMU_TIMEOUT,
        )
        .unwrap();
    let PeerMove::Moved { destination, .. } = moved else {
        panic!("the move failed: {moved:?}");
    };
    for vcpu in 0..2 {
        assert_eq!(
            destination.value(vcpu, "pages_checked"),
            Some(1024),
            "{destination:?}"
        );
    }
    assert!(!socket.exists(), "the move's socket is left behind");
}

#[test]
fn a_peer_that_ends_before_its_api_socket_is_there_is_a_clear_error() {
    use reference_bench::cloud_hypervisor_api::{MoveLink, MoveRequest};
    use reference_bench::firecracker_api::FirecrackerApi;
    // `false` as either VMM: it exits at once, without a socket.
    let dir = std::env::temp_dir().join(format!("rb-gone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let err = FirecrackerApi::start(&Firecracker::at("/bin/false"), &dir.join("fc.sock"))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("did not open its API socket"), "{err}");
    let image = image_file("a_peer_that_ends_before_its_api_socket", &image("hello", 1));
    let gone = CloudHypervisor::at("/bin/false");
    let request = MoveRequest {
        after: Duration::ZERO,
        downtime: Duration::from_millis(20),
        timeout: Duration::from_secs(1),
        postcopy: false,
    };
    let link = MoveLink::Unix(dir.join("move.sock"));
    let moved = gone.migrate(&image, (1, 64), request, &link, QEMU_TIMEOUT);
    let taken = gone.snapshot_and_restore(&image, (1, 64), Duration::ZERO, QEMU_TIMEOUT);
    std::fs::remove_dir_all(&dir).unwrap();
    for err in [moved.err().unwrap(), taken.err().unwrap()] {
        let err = err.to_string();
        // Without ch-remote found, that is the error; else the VMM's exit.
        assert!(
            err.contains("no ch-remote beside") || err.contains("exited with status 1"),
            "{err}"
        );
    }
}

#[test]
fn firecracker_refuses_a_bad_request_with_its_reason() {
    use reference_bench::firecracker_api::FirecrackerApi;
    let test = "firecracker_refuses_a_bad_request_with_its_reason";
    let Some(fc) = Firecracker::find() else {
        skip(test, &format!("no firecracker ({})", firecracker::HINT));
        return;
    };
    let dir = std::env::temp_dir().join(format!("rb-fc-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut api = FirecrackerApi::start(&fc, &dir.join("api.sock")).unwrap();
    let missing = dir.join("no-such-kernel.elf");
    let err = api.boot(&missing, (1, 64), false).unwrap_err().to_string();
    drop(api);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(err.contains("PUT /boot-source"), "{err}");
    assert!(err.contains("HTTP/1.1 4"), "Firecracker's answer: {err}");
}
