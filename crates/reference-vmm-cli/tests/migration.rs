//! Live migration between two VMs on real KVM, in this process over real
//! sockets (so the memory of both sides can be compared at the switch-over),
//! and between two `reference-vmm` processes as a user runs them: every
//! dirty-log backend, both interrupt controllers, Unix and TCP; snapshots;
//! and streams or destinations that fail while the source runs on.

#[path = "common/cli.rs"]
mod cli;
#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Stdio;
use std::thread;
use std::time::Duration;

use cli::*;
use common::kvm_available;
use migration::{
    self, Address, DirtyLogBackend, MigrateOptions, Moved, StreamReader, StreamWriter,
    move_in_process,
};
use reference_vmm::Irqchip;
use reference_vmm::{Boot, ChipState, CpuFeatures, VcpuState, Vm, VmConfig, VmDescription};
use reference_vmm_cli::presets::Choices;
use test_support::hosts;
use vm_memory::{Bytes, GuestAddress};

const VCPUS: u32 = 2;
/// The smallest memory with room for the guest's pages (from 32 MiB on).
const MEM_MIB: u64 = 64;
/// Pre-copy's time limit.
const MAX_PRECOPY: Duration = Duration::from_secs(1);

/// The `migrate` guest on `irqchip` ([`migrate_params`]): the guest waits
/// for the move to end, so that a move never races its run time, however
/// slow the host.
fn config(irqchip: Irqchip) -> VmConfig {
    let mut config = VmConfig {
        vcpus: VCPUS,
        mem_mib: MEM_MIB,
        timeout: Some(Duration::from_secs(300)),
        ..VmConfig::default()
    };
    config.params[..5].copy_from_slice(&migrate_params());
    Choices::on(irqchip).config(config)
}

/// Moves the migration guest 50 ms in to a VM of this process over
/// `address`, and runs it to its end there.
fn migrate(irqchip: Irqchip, backend: DirtyLogBackend, address: Address) -> Moved {
    let options = MigrateOptions {
        backend,
        after: Duration::from_millis(50),
        max_precopy: MAX_PRECOPY,
        ..MigrateOptions::default()
    };
    let config = VmConfig {
        dirty_ring: options.dirty_ring(),
        ..config(irqchip)
    };
    move_in_process(
        &config,
        test_guests::find("migrate").unwrap(),
        options,
        &address,
        true,
    )
    .unwrap()
}

/// The guest's own checks passed at the destination (every page, timer and
/// IPI, or it fails the run), its timer kept firing after the move, and the
/// memories were identical at the switch-over.
fn check(moved: &Moved, what: &str) {
    let (s, d) = (&moved.source, &moved.destination);
    assert!(
        s.handed_over && s.vcpus.iter().all(|v| !v.finished),
        "{what}: {s}"
    );
    assert_eq!(
        moved.differing,
        Some(0),
        "{what}: bytes differ at the switch-over"
    );
    assert!(
        !d.handed_over && d.vcpus.iter().all(|v| v.finished),
        "{what}: {d}"
    );
    for vcpu in 0..VCPUS {
        assert_eq!(d.value(vcpu, "pages_checked"), Some(PAGES), "{what}: {d}");
    }
    let irqs = d.value(0, "irqs").unwrap();
    let irqs_at_switch: u64 = moved
        .source_memory
        .read_obj(GuestAddress(test_guests::layout::irq_record(0) + 8))
        .unwrap();
    assert!(
        irqs > irqs_at_switch,
        "{what}: the timer stopped at the move: {d}"
    );
    assert!(d.value(0, "ipis_sent").unwrap() > 0, "{what}: {d}");
    assert_eq!(d.value(1, "irqs"), d.value(0, "ipis_sent"), "{what}: {d}");
    let m = &moved.migration;
    assert!(
        m.rounds >= 1 && m.pages_sent >= m.final_pages,
        "{what}: {m}"
    );
    assert!(m.downtime <= m.total, "{what}: {m}");
}

/// Loopback TCP on a port the kernel picks.
fn tcp() -> Address {
    "tcp:127.0.0.1:0".parse().unwrap()
}

/// `backend` moves the guest byte for byte over a Unix socket and over
/// loopback TCP, with either interrupt controller.
fn moves_everywhere(backend: DirtyLogBackend) {
    for irqchip in [Irqchip::User, Irqchip::Kernel] {
        for address in [socket(&format!("{backend:?}-{irqchip}")), tcp()] {
            let what = format!("{backend:?}, {irqchip} APIC, {address}");
            check(&migrate(irqchip, backend, address), &what);
        }
    }
}

/// A test per backend of `$check(backend)`, so that they run in parallel.
macro_rules! per_backend_tests {
    ($check:ident; $($test:ident: $backend:ident),*) => {$(
        #[test]
        fn $test() {
            if kvm_available(stringify!($test)) {
                $check(DirtyLogBackend::$backend);
            }
        }
    )*};
}

per_backend_tests! {
    moves_everywhere;
    the_bitmap_moves_a_guest_byte_for_byte_over_unix_and_tcp_with_either_apic: Bitmap,
    manual_protect_moves_a_guest_byte_for_byte_over_unix_and_tcp_with_either_apic: Manual,
    the_ring_moves_a_guest_byte_for_byte_over_unix_and_tcp_with_either_apic: Ring
}

#[test]
fn the_guest_reports_each_long_stall_as_it_ends_the_move_among_them() {
    if !kvm_available("the_guest_reports_each_long_stall_as_it_ends_the_move_among_them") {
        return;
    }
    let options = MigrateOptions {
        after: Duration::from_millis(50),
        max_precopy: MAX_PRECOPY,
        ..MigrateOptions::default()
    };
    let mut config = config(Irqchip::User);
    let ticks_per_ms = lapic_timer::TscClock::shared().tsc_khz();
    config.params[6] = ticks_per_ms / 2;
    let guest = test_guests::find("migrate").unwrap();
    let address = socket("stalls");
    let moved = move_in_process(&config, guest, options, &address, true).unwrap();
    check(&moved, "with stalls reported");
    for vcpu in 0..VCPUS {
        // Before the move at the source, from it on at the destination.
        let values = |name: &str| -> Vec<u64> {
            [&moved.source, &moved.destination]
                .iter()
                .flat_map(|r| &r.vcpus[vcpu as usize].reports)
                .filter(|r| r.name == name)
                .map(|r| r.value)
                .collect()
        };
        let (at, stalls) = (values("stall_at_ticks"), values("stall_ticks"));
        assert_eq!(at.len(), stalls.len(), "vCPU {vcpu}: one time per stall");
        assert!(at.windows(2).all(|w| w[0] < w[1]), "vCPU {vcpu}: {at:?}");
        assert!(stalls.iter().all(|&s| s > config.params[6]), "{stalls:?}");
        let longest = moved.destination.value(vcpu, "max_stall_ticks").unwrap();
        // The pause is one of them, and the longest unless the cap came first.
        assert!(
            longest > config.params[6] && !stalls.is_empty(),
            "vCPU {vcpu}"
        );
        if stalls.len() < 256 {
            assert_eq!(stalls.iter().max(), Some(&longest), "vCPU {vcpu}");
        }
    }
}

/// The migration guest writing flat out over 16 MiB on each of two vCPUs,
/// a third only computing: no round of pre-copy fits a 5 ms downtime.
fn flat_out(irqchip: Irqchip) -> VmConfig {
    let mut config = VmConfig {
        vcpus: 3,
        mem_mib: 128,
        ..config(irqchip)
    };
    config.params[0] = 4096;
    config.params[2] = 0;
    config.params[5] = 2;
    config
}

/// Past its rounds, pre-copy goes on under the dirty limit (the vCPUs
/// pause at their next exit) until a round fits the downtime, and the
/// guest moves byte for byte. With the ring only the writers are given
/// pauses; with a bitmap every vCPU alike.
///
/// Whether a vCPU reached an exit to sleep before pre-copy converged, and
/// whether the guest wrote faster than the limit at all, are the host's
/// doing: beside other jobs a starved guest may dirty little enough to
/// converge before any pause falls due (each vCPU's rate is its ring's
/// distinct pages per wall-clock second). So the pauses expected come from
/// the run's own measurements: each time the limit found the guest at 1.5
/// times its target or more (`limit_exceeded`), some vCPU was that far
/// above its share and must have been given a pause; a vCPU slept only on
/// a pause it was given; the ring gives the non-writer none, ever.
fn converges_under_the_dirty_limit(backend: DirtyLogBackend) {
    let options = MigrateOptions {
        backend,
        after: Duration::from_millis(100),
        downtime: Duration::from_millis(5),
        max_rounds: 3,
        max_precopy: MAX_PRECOPY,
        progress: migration::Progress::Text,
        timeout: Duration::from_secs(120),
        ..MigrateOptions::default()
    };
    let config = VmConfig {
        dirty_ring: options.dirty_ring(),
        ..flat_out(Irqchip::User)
    };
    let program = test_guests::find("migrate").unwrap();
    let at = socket(&format!("limit-{backend:?}"));
    let moved = move_in_process(&config, program, options, &at, true).unwrap();
    let m = &moved.migration;
    eprintln!("{backend:?}: {m}\n{}", moved.source);
    assert!(m.converged && m.limited_rounds > 0, "{m}");
    assert_eq!(moved.differing, Some(0), "{m}");
    assert!(moved.destination.vcpus.iter().all(|v| v.finished));
    assert!(moved.destination.value(2, "computes").unwrap() > 0);
    let vcpus = &moved.source.vcpus;
    let given: Vec<_> = vcpus.iter().map(|v| v.dirty_pause_given).collect();
    let paused: Vec<_> = vcpus.iter().map(|v| v.dirty_paused).collect();
    let state = format!("{m}; given {given:?}, paused {paused:?}");
    for (given, paused) in given.iter().zip(&paused) {
        assert!(
            !given.is_zero() || paused.is_zero(),
            "slept ungiven: {state}"
        );
    }
    let exceeded = m.limit_exceeded > 0;
    match backend {
        DirtyLogBackend::Ring => {
            assert!(
                given[2].is_zero(),
                "the non-writer was given a pause: {state}"
            );
            let writer = !given[0].is_zero() || !given[1].is_zero();
            assert!(
                writer || !exceeded,
                "exceeded, no writer given a pause: {state}"
            );
        }
        _ => {
            let alike = given.iter().all(|&g| g == given[0]);
            assert!(alike, "a bitmap's vCPUs are given pauses alike: {state}");
            assert!(
                !given[0].is_zero() || !exceeded,
                "exceeded, no pause: {state}"
            );
        }
    }
}

per_backend_tests! {
    converges_under_the_dirty_limit;
    the_bitmap_converges_under_the_dirty_limit_pausing_every_vcpu: Bitmap,
    manual_protect_converges_under_the_dirty_limit_pausing_every_vcpu: Manual,
    the_ring_converges_under_the_dirty_limit_pausing_only_writers: Ring
}

/// A migration that runs past its time limit gives up: the error says so
/// and the guest runs on to its end at the source.
#[test]
fn a_migration_past_its_time_limit_aborts_and_the_guest_runs_on_here() {
    if !kvm_available("a_migration_past_its_time_limit_aborts_and_the_guest_runs_on_here") {
        return;
    }
    let options = MigrateOptions {
        backend: DirtyLogBackend::Manual,
        after: Duration::from_millis(100),
        downtime: Duration::from_micros(1),
        timeout: Duration::from_millis(300),
        ..MigrateOptions::default()
    };
    let mut config = flat_out(Irqchip::Kernel);
    config.params[4] = 0; // the run's length from its start: no move ends
    config.params[1] *= 2; // 1 s: the guest outlives the limit
    let mut vm = Vm::new(&config).unwrap();
    let listener = socket("timeout").listen().unwrap();
    let address = listener.address().unwrap();
    let sink = std::thread::spawn(move || {
        // Reads what comes until the source stops sending.
        let limits = migration::AcceptLimits::default();
        let mut input = listener.accept_source(&limits, &mut |_| {}).unwrap();
        if input.config().is_ok() {
            while !matches!(input.next_record(), Ok(migration::Record::End) | Err(_)) {}
        }
    });
    let moving =
        migration::Migration::prepare(&mut vm, migration::Target::Peer(address), options).unwrap();
    let (tx, migrated) = std::sync::mpsc::channel();
    vm.on_start(Box::new(move |control| {
        let _ = tx.send(moving.run(control));
    }));
    let program = test_guests::find("migrate").unwrap();
    let report = vm.run(program, Box::new(std::io::sink())).unwrap();
    let result = migrated.recv().unwrap();
    assert!(
        matches!(result, Err(migration::MigrationError::TimedOut(t)) if t == Duration::from_millis(300)),
        "{result:?}"
    );
    assert!(!report.handed_over, "{report}");
    assert!(report.vcpus.iter().all(|v| v.finished), "{report}");
    sink.join().unwrap();
}

#[test]
fn a_halted_vcpu_moves_halted_and_wakes_on_an_ipi_sent_after_the_move() {
    if !kvm_available("a_halted_vcpu_moves_halted_and_wakes_on_an_ipi_sent_after_the_move") {
        return;
    }
    for irqchip in [Irqchip::User, Irqchip::Kernel] {
        let mut config = config(irqchip);
        // The IPI 100 ms after the move has ended, whenever that is.
        let ticks = config.params[1] / 5;
        config.params[..2].copy_from_slice(&[ticks, 1]);
        let options = MigrateOptions {
            after: Duration::from_millis(50),
            max_precopy: MAX_PRECOPY,
            ..MigrateOptions::default()
        };
        let halt_wake = test_guests::find("halt-wake").unwrap();
        let moved = move_in_process(&config, halt_wake, options, &socket("halt"), true).unwrap();
        let d = &moved.destination;
        assert_eq!(moved.migration.halted, 1, "{irqchip}: {}", moved.migration);
        assert_eq!(moved.differing, Some(0), "{irqchip}");
        assert!(d.vcpus.iter().all(|v| v.finished), "{irqchip}: {d}");
        assert_eq!(d.value(0, "irqs"), Some(1), "{irqchip}: {d}");
    }
}

/// Two hosts (network namespaces joined by a veth pair at 1 Gbit/s): the
/// guest moves in TLS from one to the other with each backend, and a
/// source whose certificate the destination does not allow is refused
/// before its guest starts.
#[test]
fn a_guest_moves_between_two_hosts_in_tls_over_a_rate_limited_link() {
    let test = "a_guest_moves_between_two_hosts_in_tls_over_a_rate_limited_link";
    if !kvm_available(test) {
        return;
    }
    let hosts = match hosts::TwoHosts::new("tls", "1gbit") {
        Ok(hosts) => hosts,
        Err(why) => {
            common::skip(test, &format!("cannot make two network namespaces: {why}"));
            return;
        }
    };
    let (ca, _) = test_support::certs::cas("hosts");
    let (receive_tls, source_tls) = tls_args(&ca, hosts::DESTINATION_IP);
    let listen = format!("tcp:{}:0", hosts::DESTINATION_IP);
    for backend in ["bitmap", "manual", "ring"] {
        let mut destination = receive_in(&hosts.destination, &listen, &receive_tls);
        let at = destination.listening_on();
        let mut args = vec!["--migrate-to", &at, "--dirty-log", backend];
        args.extend(source_tls.iter().map(String::as_str));
        let source = source_by(vmm_in(&hosts.source), &args)
            .wait_with_output()
            .unwrap();
        let stdout = text(&source.stdout);
        assert!(
            source.status.success(),
            "{backend}: {stdout}\n{}",
            text(&source.stderr)
        );
        assert!(stdout.contains("then handed over"), "{backend}: {stdout}");
        assert_guest_checked(&destination.output(), backend);
    }
    // A source with a certificate for a name the destination does not allow.
    let mut destination = receive_in(&hosts.destination, &listen, &receive_tls);
    let at = destination.listening_on();
    let intruder = ca.files("intruder.example", &ca);
    let flags = [
        ("--tls-cert", &intruder.cert),
        ("--tls-key", &intruder.key),
        ("--tls-ca", &intruder.ca),
    ];
    let mut args = vec!["--migrate-to", &at];
    for (flag, path) in &flags {
        args.extend([*flag, path.to_str().unwrap()]);
    }
    let source = source_by(vmm_in(&hosts.source), &args)
        .wait_with_output()
        .unwrap();
    assert_eq!(source.status.code(), Some(1));
    assert!(
        text(&source.stderr).contains("certificate is for intruder.example"),
        "{}",
        text(&source.stderr)
    );
    let log = destination.log_line_with("refused", Duration::from_secs(10));
    assert!(
        log.contains("intruder.example (it allows source.example)"),
        "{log}"
    );
}

#[test]
fn two_processes_hand_a_guest_over_and_the_source_exits_0() {
    if !kvm_available("two_processes_hand_a_guest_over_and_the_source_exits_0") {
        return;
    }
    // Over TCP in TLS: each side's certificate, the CA, whom it allows.
    let (ca, _) = test_support::certs::cas("cli");
    let (receive_tls, source_tls) = tls_args(&ca, "127.0.0.1");
    for (address, irqchip, backend, receive_tls, source_tls) in [
        (socket("cli"), "user", "ring", vec![], vec![]),
        (tcp(), "kernel", "bitmap", receive_tls, source_tls),
    ] {
        let mut destination = Background(
            vmm()
                .args(["receive", "--listen", &address.to_string()])
                .args(&receive_tls)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let listen = destination.listening_on();
        if let Address::Unix(path) = &address {
            // A second receive at the same path leaves the first its socket.
            let second = vmm()
                .args(["receive", "--listen", &listen])
                .output()
                .unwrap();
            assert_eq!(second.status.code(), Some(1));
            assert!(
                text(&second.stderr).contains("another process is listening on this socket"),
                "{}",
                text(&second.stderr)
            );
            assert!(path.exists());
        }
        let mut args = vec![
            "--migrate-to",
            &listen,
            "--irqchip",
            irqchip,
            "--dirty-log",
            backend,
        ];
        args.extend(source_tls.iter().map(String::as_str));
        let json = backend == "ring";
        if json {
            args.extend(["--migrate-progress", "json"]);
        }
        let source = source(&args).wait_with_output().unwrap();
        let stdout = text(&source.stdout);
        assert!(
            source.status.success(),
            "{listen}: {stdout}\n{}",
            text(&source.stderr)
        );
        if json {
            assert_progress_json(&text(&source.stderr));
        }
        assert!(
            stdout.contains("then handed over") && stdout.contains("migration: "),
            "{stdout}"
        );
        let destination = destination.output();
        assert!(
            text(&destination.stderr).contains("received "),
            "{}",
            text(&destination.stderr)
        );
        assert_guest_checked(&destination, &listen);
        if let Address::Unix(path) = &address {
            assert!(!path.exists(), "receive left its socket behind");
        }
    }
}

/// `--migrate-progress json`'s lines: a round per pre-copy round after the
/// full pass, numbered in order, each with its figures, then the outcome.
fn assert_progress_json(stderr: &str) {
    let events: Vec<serde_json::Value> = stderr
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
        .collect();
    let (outcome, rounds) = events.split_last().expect("progress lines");
    assert_eq!(outcome["event"], "migrated", "{stderr}");
    assert!(!rounds.is_empty(), "{stderr}");
    for (i, round) in rounds.iter().enumerate() {
        assert_eq!(round["event"], "round");
        assert_eq!(round["round"], i as u64 + 2, "the full pass is round 1");
        for field in [
            "pages",
            "ms",
            "bandwidth_pages_per_s",
            "dirty_rate_pages_per_s",
        ] {
            assert!(round[field].is_number(), "{field}: {round}");
        }
        assert!(round["downtime_estimate_ms"].as_f64().unwrap() >= 0.0);
    }
    assert_eq!(outcome["rounds"], rounds.len() as u64 + 1, "{stderr}");
    assert!(outcome["downtime_ms"].as_f64().unwrap() > 0.0);
}

fn snapshot_file(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("rvmm-{}-{name}.snap", std::process::id()))
}

#[test]
fn a_snapshot_is_never_written_through_a_symbolic_link() {
    if !kvm_available("a_snapshot_is_never_written_through_a_symbolic_link") {
        return;
    }
    let victim = snapshot_file("victim");
    std::fs::write(&victim, b"mine").unwrap();
    let link = snapshot_file("link");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&victim, &link).unwrap();
    let out = source(&["--snapshot-to", link.to_str().unwrap()])
        .wait_with_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("a snapshot is never written through one"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read(&victim).unwrap(), b"mine");
    std::fs::remove_file(link).unwrap();
    std::fs::remove_file(victim).unwrap();
}

#[test]
fn a_snapshot_restores_and_runs_on_and_damaged_ones_are_refused() {
    if !kvm_available("a_snapshot_restores_and_runs_on_and_damaged_ones_are_refused") {
        return;
    }
    let file = snapshot_file("whole");
    let saved = source(&["--snapshot-to", file.to_str().unwrap()])
        .wait_with_output()
        .unwrap();
    assert!(saved.status.success(), "{}", text(&saved.stderr));
    assert!(
        text(&saved.stdout).contains("then handed over"),
        "{}",
        text(&saved.stdout)
    );
    let mode = std::os::unix::fs::PermissionsExt::mode(&file.metadata().unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "guest memory for its owner alone");
    let restored = vmm().arg("restore").arg(&file).output().unwrap();
    assert_guest_checked(&restored, "restore");

    let whole = std::fs::read(&file).unwrap();
    let damaged = [
        (
            "cut",
            whole[..whole.len() * 2 / 3].to_vec(),
            "cut off in the middle of a record",
        ),
        (
            "flipped",
            flip(&whole, whole.len() / 2),
            "is corrupted (its CRC32 does not match)",
        ),
        (
            "empty",
            Vec::new(),
            "the stream ended before its End record",
        ),
    ];
    for (name, bytes, error) in damaged {
        let path = snapshot_file(name);
        std::fs::write(&path, bytes).unwrap();
        let out = vmm().arg("restore").arg(&path).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{name}");
        assert!(
            text(&out.stderr).contains(error),
            "{name}: {}",
            text(&out.stderr)
        );
        assert!(out.stdout.is_empty(), "{name}: a damaged snapshot ran");
        std::fs::remove_file(path).unwrap();
    }
    // A full snapshot is no increment: restored after itself, it is
    // refused, naming both files.
    let twice = vmm().arg("restore").args([&file, &file]).output().unwrap();
    assert_eq!(twice.status.code(), Some(1));
    let err = text(&twice.stderr);
    assert!(
        err.contains(" + ")
            && err.contains("snapshot 2 is not the increment taken after snapshot 1"),
        "{err}"
    );
    let missing = vmm()
        .args(["restore", "/nonexistent/base"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(text(&missing.stderr).contains("cannot open /nonexistent/base"));
    std::fs::remove_file(file).unwrap();
}

fn flip(bytes: &[u8], at: usize) -> Vec<u8> {
    let mut out = bytes.to_vec();
    out[at] ^= 0x40;
    out
}

#[test]
fn a_destination_that_fails_leaves_the_guest_running_at_the_source() {
    if !kvm_available("a_destination_that_fails_leaves_the_guest_running_at_the_source") {
        return;
    }
    // One destination hangs up half-way through the stream, one refuses
    // the VM after reading all of it.
    for (name, refuse) in [("hangs-up", false), ("refuses", true)] {
        let Address::Unix(path) = socket(name) else {
            unreachable!()
        };
        let listener = Address::Unix(path.clone()).listen().unwrap();
        let fake = thread::spawn(move || {
            let mut input = listener.accept().unwrap();
            let mut buf = vec![0; 1 << 20];
            match refuse {
                false => {
                    input.get_mut().read_exact(&mut buf).unwrap();
                }
                true => {
                    input.config().unwrap();
                    while !matches!(input.next_record().unwrap(), migration::Record::End) {}
                    migration::answer(input.get_mut(), Err("no room here")).unwrap();
                }
            }
        });
        let out = source(&["--migrate-to", &format!("unix:{}", path.display())])
            .wait_with_output()
            .unwrap();
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert_eq!(out.status.code(), Some(1), "{name}: {stdout}\n{stderr}");
        assert!(stderr.contains("the guest ran on here"), "{name}: {stderr}");
        if refuse {
            assert!(stderr.contains("refused the VM: no room here"), "{stderr}");
        }
        assert!(stdout.contains("finished"), "{name}: {stdout}");
        assert_eq!(
            stdout.matches("pages_checked = 256").count(),
            2,
            "{name}: {stdout}"
        );
        fake.join().unwrap();
        assert!(!path.exists(), "the listener's socket outlived it");
    }
}

/// Forwards a connection from a source to a destination, both ways, with
/// the source's byte `at` flipped or, with `cut`, nothing from it on.
fn damaging_proxy(listen: &Address, to: &str, at: usize, cut: bool) -> thread::JoinHandle<()> {
    let Address::Unix(path) = listen else {
        panic!("a unix: address")
    };
    let listener = std::os::unix::net::UnixListener::bind(path).unwrap();
    let path = path.clone();
    let to = to.strip_prefix("unix:").unwrap().to_owned();
    thread::spawn(move || {
        let (mut from_source, _) = listener.accept().unwrap();
        let _ = std::fs::remove_file(path);
        let mut to_destination = std::os::unix::net::UnixStream::connect(&to).unwrap();
        let (mut answer_in, mut answer_out) = (
            to_destination.try_clone().unwrap(),
            from_source.try_clone().unwrap(),
        );
        let answers = thread::spawn(move || std::io::copy(&mut answer_in, &mut answer_out));
        let mut buf = vec![0u8; 1 << 16];
        let mut seen = 0;
        while let Ok(n @ 1..) = from_source.read(&mut buf) {
            let chunk = &mut buf[..n];
            let end = match (seen..seen + n).contains(&at) {
                true if cut => at - seen,
                true => {
                    chunk[at - seen] ^= 0x08;
                    n
                }
                false => n,
            };
            seen += n;
            if to_destination.write_all(&chunk[..end]).is_err() || end < n {
                break;
            }
        }
        let _ = to_destination.shutdown(std::net::Shutdown::Both);
        let _ = from_source.shutdown(std::net::Shutdown::Both);
        let _ = answers.join();
    })
}

#[test]
fn a_stream_damaged_on_the_way_is_refused_and_the_source_runs_on() {
    if !kvm_available("a_stream_damaged_on_the_way_is_refused_and_the_source_runs_on") {
        return;
    }
    // Offsets inside the stream (a 64 MiB guest sends its image and the
    // 512 pages it writes, some 2 MB: its zero pages travel as runs).
    for (name, at, cut, error) in [
        (
            "flipped",
            98_765,
            false,
            "is corrupted (its CRC32 does not match)",
        ),
        ("cut", 314_159, true, "cut off in the middle of"),
    ] {
        let mut destination = Background(
            vmm()
                .args(["receive", "--listen"])
                .arg(socket(&format!("dst-{name}")).to_string())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let to = destination.listening_on();
        let proxy_at = socket(&format!("proxy-{name}"));
        let proxy = damaging_proxy(&proxy_at, &to, at, cut);
        let source = source(&["--migrate-to", &proxy_at.to_string()])
            .wait_with_output()
            .unwrap();
        let refused = destination.output();
        let (stdout, stderr) = (text(&source.stdout), text(&source.stderr));
        let refusal = text(&refused.stderr);
        assert_eq!(refused.status.code(), Some(1), "{name}: {refusal}");
        assert!(refusal.contains(error), "{name}: {refusal}");
        assert!(refused.stdout.is_empty(), "{name}: the damaged guest ran");
        assert_eq!(source.status.code(), Some(1), "{name}: {stdout}\n{stderr}");
        assert!(stderr.contains("the guest ran on here"), "{name}: {stderr}");
        assert_eq!(
            stdout.matches("pages_checked = 256").count(),
            2,
            "{name}: {stdout}"
        );
        proxy.join().unwrap();
    }
}

#[test]
fn migration_arguments_get_clear_errors() {
    let cases: [(&[&str], &str); 9] = [
        (
            &["--migrate-to", "tcp:127.0.0.1:1"],
            "tcp:127.0.0.1:1 needs --tls-cert, --tls-key and --tls-ca (or --insecure",
        ),
        (
            &[
                "--migrate-to",
                "unix:/x",
                "--tls-cert",
                "c",
                "--tls-key",
                "k",
                "--tls-ca",
                "a",
            ],
            "unix: sockets stay plain text",
        ),
        (
            &["--snapshot-to", "/y", "--insecure"],
            "--tls-cert and --insecure are for --migrate-to",
        ),
        (
            &[
                "--migrate-to",
                "tcp:127.0.0.1:1",
                "--tls-cert",
                "/nonexistent.pem",
                "--tls-key",
                "k",
                "--tls-ca",
                "a",
            ],
            "cannot read the certificates in /nonexistent.pem",
        ),
        (
            &["--migrate-to", "ftp:x"],
            "is not an address: give unix:<path> or tcp:<ip>:<port>",
        ),
        (
            &["--migrate-to", "tcp:localhost"],
            "is not an IP address and port",
        ),
        (
            &["--migrate-to", "unix:/x", "--snapshot-to", "/y"],
            "cannot be used with",
        ),
        (&["--dirty-log", "pml"], "invalid value 'pml'"),
        (
            &["--dirty-log", "ring"],
            "required arguments were not provided",
        ),
    ];
    for (args, error) in cases {
        let out = vmm()
            .args(["run", "--guest", "hello"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(
            text(&out.stderr).contains(error),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    let file = snapshot_file("not-a-socket");
    std::fs::write(&file, b"mine").unwrap();
    let at_a_file = format!("unix:{}", file.display());
    for (listen, error) in [
        (
            "unix:/nonexistent/dir/s",
            "cannot listen on unix:/nonexistent/dir/s: No such file or directory",
        ),
        (
            &at_a_file,
            "a regular file is there, not a socket (left as it is)",
        ),
    ] {
        let out = vmm()
            .args(["receive", "--listen", listen])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1));
        assert!(text(&out.stderr).contains(error), "{}", text(&out.stderr));
    }
    // Plain text on TCP only when asked for, and then with a warning; no
    // source without an allowed name.
    let out = vmm()
        .args(["receive", "--listen", "tcp:127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("needs --tls-cert"),
        "{}",
        text(&out.stderr)
    );
    let out = vmm()
        .args(["receive", "--listen", "tcp:127.0.0.1:0", "--tls-allow", "x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let (ca, _) = test_support::certs::cas("arguments");
    let files = ca.files("127.0.0.1", &ca);
    let out = vmm()
        .args(["receive", "--listen", "tcp:127.0.0.1:0", "--tls-cert"])
        .arg(&files.cert)
        .arg("--tls-key")
        .arg(&files.key)
        .arg("--tls-ca")
        .arg(&files.ca)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("no client is allowed"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(std::fs::read(&file).unwrap(), b"mine");
    std::fs::remove_file(file).unwrap();
}

/// A `hello` VM of `vcpus` vCPUs and `mem_mib` MiB on `irqchip`, with this
/// host's TSC and CPU features, as a stream describes it.
fn hello_vm(vcpus: u32, mem_mib: u64, irqchip: Irqchip) -> VmDescription {
    VmDescription {
        program: "hello".into(),
        vcpus,
        mem_mib,
        params: [0; 16],
        irqchip,
        min_timer_period_ns: 200_000,
        tsc_khz: lapic_timer::TscClock::shared().tsc_khz() as u32,
        cpu_features: CpuFeatures::of_this_host().unwrap(),
        msrs: Vec::new(),
    }
}

/// vCPU `index`'s state, all zeros, with KVM's LAPIC page.
fn zeroed_vcpu(index: u32) -> VcpuState {
    VcpuState {
        index,
        halted: false,
        captured_at_ns: 0,
        regs: Default::default(),
        sregs: Default::default(),
        xsave: Box::default(),
        xcrs: Default::default(),
        events: Default::default(),
        mp_state: 0,
        msrs: Vec::new(),
        chip: ChipState::Kernel(Box::default()),
    }
}

#[test]
fn a_stream_whose_vcpu_state_is_for_the_other_apic_is_refused() {
    if !kvm_available("a_stream_whose_vcpu_state_is_for_the_other_apic_is_refused") {
        return;
    }
    // A VM on this VMM's APIC, and a vCPU state with KVM's LAPIC page.
    let description = hello_vm(1, 64, Irqchip::User);
    let state = zeroed_vcpu(0);
    let mut out = StreamWriter::new(Vec::new()).unwrap();
    out.config(&description).unwrap();
    out.vcpu(&state).unwrap();
    out.end().unwrap();
    let bytes = std::mem::take(out.get_mut());
    let mut input = StreamReader::new(&bytes[..]).unwrap();
    let Err(e) = migration::receive(&mut input, &VmConfig::default()) else {
        panic!("a mismatched state was accepted")
    };
    assert_eq!(
        e.to_string(),
        "vCPU 0's state is for the other interrupt controller than the VM's (user)"
    );
}

/// A stream that is whole and checksummed but carries what no VM may be
/// ends with a clear error, and no VM runs: absurd memory or vCPU counts, a
/// page past the end of memory, a vCPU past the VM, a vCPU state KVM
/// refuses.
#[test]
fn hostile_streams_with_valid_checksums_end_in_a_clear_error() {
    if !kvm_available("hostile_streams_with_valid_checksums_end_in_a_clear_error") {
        return;
    }
    let vm = |vcpus, mem_mib| hello_vm(vcpus, mem_mib, Irqchip::Kernel);
    let state = zeroed_vcpu;
    let mut bad_sregs = state(0);
    bad_sregs.sregs.cr0 = u64::MAX; // reserved bits: KVM_SET_SREGS refuses
    let page = vec![0xAB; 4096];
    // The VM, its pages' addresses with a vCPU state after each, the error.
    type Hostile = (VmDescription, Vec<(u64, VcpuState)>, &'static str);
    let cases: [Hostile; 5] = [
        (vm(1, 1 << 40), vec![], "memory"),
        (vm(100_000, 64), vec![], "vCPU"),
        (vm(1, 64), vec![(64 << 20, state(0))], "reach past"),
        (vm(1, 64), vec![(0, state(3))], "vCPU 3"),
        (vm(1, 64), vec![(0, bad_sregs)], "KVM_SET_SREGS"),
    ];
    for (description, records, error) in cases {
        let mut out = StreamWriter::new(Vec::new()).unwrap();
        out.config(&description).unwrap();
        for (gpa, state) in &records {
            // A write the writer refuses is a record the reader would too.
            if out.pages(*gpa, &page).is_err() {
                continue;
            }
            out.vcpu(state).unwrap();
        }
        let _ = out.end();
        let bytes = std::mem::take(out.get_mut());
        let result = StreamReader::new(&bytes[..])
            .map_err(migration::MigrationError::from)
            .and_then(|mut input| migration::receive(&mut input, &VmConfig::default()));
        let Err(e) = result else {
            panic!("{description:?} was accepted")
        };
        eprintln!("{error}: {e}");
        assert!(e.to_string().contains(error), "{error}: {e}");
    }
}

/// A destination whose CPU lacks a feature the guest was given refuses the
/// guest, naming the feature, before the hand-over.
#[test]
fn a_guest_given_a_feature_this_host_lacks_is_refused_by_name() {
    if !kvm_available("a_guest_given_a_feature_this_host_lacks_is_refused_by_name") {
        return;
    }
    let host = CpuFeatures::of_this_host().unwrap();
    // Every feature of leaf 7's EBX: this host lacks some (none has all).
    let text: String = host
        .to_string()
        .lines()
        .map(|l| match l.starts_with("0x7 0 ebx") {
            true => "0x7 0 ebx 0xffffffff\n".to_string(),
            false => format!("{l}\n"),
        })
        .collect();
    let more: CpuFeatures = text.parse().unwrap();
    let missing = more.missing_from(&host);
    assert!(!missing.is_empty());
    let description = VmDescription {
        cpu_features: more,
        ..hello_vm(1, 64, Irqchip::Kernel)
    };
    let mut out = StreamWriter::new(Vec::new()).unwrap();
    out.config(&description).unwrap();
    let bytes = std::mem::take(out.get_mut());
    let mut input = StreamReader::new(&bytes[..]).unwrap();
    let Err(e) = migration::receive(&mut input, &VmConfig::default()) else {
        panic!("a guest with features this host lacks was accepted")
    };
    let e = e.to_string();
    assert!(
        e.contains("this host's CPU lacks what the guest was given"),
        "{e}"
    );
    assert!(e.contains(&missing[0]), "{e}");
}

/// A destination whose KVM does not list an MSR the source's vCPUs carry
/// refuses the guest, naming the MSR, before it reads any page.
#[test]
fn a_guest_carrying_an_msr_this_host_lacks_is_refused_by_name() {
    if !kvm_available("a_guest_carrying_an_msr_this_host_lacks_is_refused_by_name") {
        return;
    }
    // The TSC (every KVM lists it) and an index no CPU has.
    let description = VmDescription {
        msrs: vec![0x10, 0x4000_dead],
        ..hello_vm(1, 64, Irqchip::Kernel)
    };
    let mut out = StreamWriter::new(Vec::new()).unwrap();
    out.config(&description).unwrap();
    let bytes = std::mem::take(out.get_mut());
    let mut input = StreamReader::new(&bytes[..]).unwrap();
    let Err(e) = migration::receive(&mut input, &VmConfig::default()) else {
        panic!("a guest with MSRs this host lacks was accepted")
    };
    assert_eq!(
        e.to_string(),
        "this host's KVM cannot save or restore MSRs the source's vCPUs carry: 0x4000dead"
    );
    assert_eq!(
        input.position(),
        1,
        "no record after the Config record was read"
    );
}

#[test]
fn a_vm_made_to_receive_a_stream_does_not_run_without_one() {
    if !kvm_available("a_vm_made_to_receive_a_stream_does_not_run_without_one") {
        return;
    }
    let config = VmConfig {
        boot: Boot::Incoming,
        ..VmConfig::default()
    };
    for states in [None, Some(Vec::new())] {
        let mut vm = Vm::new(&config).unwrap();
        if let Some(states) = states {
            vm.set_incoming(states); // none for its one vCPU
        }
        let e = vm
            .run(
                test_guests::find("hello").unwrap(),
                Box::new(std::io::sink()),
            )
            .unwrap_err();
        assert!(e.to_string().contains("Vm::set_incoming"), "{e}");
    }
}

#[test]
fn a_bad_destination_is_refused_before_the_guest_starts() {
    if !kvm_available("a_bad_destination_is_refused_before_the_guest_starts") {
        return;
    }
    let dir = std::env::temp_dir();
    let no_listener = socket("nobody");
    let cases: [(&[&str], String); 4] = [
        (
            &["--snapshot-to", "/nonexistent/dir/snap"],
            "cannot create the snapshot file /nonexistent/dir/snap: No such file".into(),
        ),
        (
            &["--snapshot-to", dir.to_str().unwrap()],
            format!(
                "cannot create the snapshot file {}: Is a directory",
                dir.display()
            ),
        ),
        (
            &["--migrate-to", "tcp:127.0.0.1:1", "--insecure"],
            "cannot reach tcp:127.0.0.1:1: Connection refused".into(),
        ),
        (
            &["--migrate-to", &no_listener.to_string()],
            format!("cannot reach {no_listener}: No such file or directory"),
        ),
    ];
    for (args, error) in cases {
        let out = source(args).wait_with_output().unwrap();
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(&error), "{args:?}: {stderr}");
        // Refused before any vCPU ran: no report, nothing of the guest's.
        assert!(out.stdout.is_empty(), "{args:?}: {}", text(&out.stdout));
    }
}

#[test]
fn a_migration_that_cannot_start_leaves_the_guest_to_finish_here() {
    if !kvm_available("a_migration_that_cannot_start_leaves_the_guest_to_finish_here") {
        return;
    }
    // A guest of 300 ms that does not wait for a move, and a move 10 s in:
    // the guest ends first, at the source, and the destination is told
    // nothing (the connection closes before a byte of the stream).
    let short = config(Irqchip::User).params[1] * 3 / 5;
    let Address::Unix(path) = socket("ends-first") else {
        unreachable!()
    };
    let listener = Address::Unix(path.clone()).listen().unwrap();
    let destination = thread::spawn(move || {
        // The source is taken (its header), then sends no record.
        let mut input = listener.accept().unwrap();
        let mut rest = Vec::new();
        input.get_mut().read_to_end(&mut rest).unwrap();
        rest.len()
    });
    let out = run_migrate(&format!("256,{short},100,0"))
        .args(["--migrate-to", &format!("unix:{}", path.display())])
        .args(["--migrate-after-ms", "10000"])
        .output()
        .unwrap();
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("is no longer running (its program ended or failed)")
            && stderr.contains("the guest ran on here"),
        "{stderr}"
    );
    assert_eq!(stdout.matches("pages_checked = 256").count(), 2, "{stdout}");
    assert_eq!(
        destination.join().unwrap(),
        0,
        "the destination got a stream"
    );
    let out = vmm()
        .args(["restore", "/nonexistent/snap"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("cannot open /nonexistent/snap"));
}
