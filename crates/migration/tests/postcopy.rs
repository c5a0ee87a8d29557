//! Post-copy on `/dev/kvm` and `userfaultfd(2)`, in this process over real
//! sockets: a guest writing flat out moves at once and after pre-copy
//! (hybrid), unthrottled, its memory read through the destination's
//! faults equal to the source's at the pause; its vCPUs fault on the pages
//! still at the source and its own check of every page passes; in TLS;
//! and a link cut for 2 s in the middle of post-copy is survived. Each
//! test skips, saying so, where `userfaultfd(2)` is refused.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::thread;
use std::time::Duration;

use common::kvm_available;
use migration::postcopy::userfaultfd_available;
use migration::tls::TlsFiles;
use migration::{
    AcceptLimits, Address, Connection, DirtyLogBackend, Listener, MigrateOptions, Migration,
    MigrationError, Moved, Postcopy, Resume, StreamReader, StreamWriter, Target, hand_over,
    move_in_process, move_in_process_tls, receive, receive_from,
};
use reference_vmm::{Irqchip, RunReport, Vm, VmConfig, VmMemory};
use test_support::certs::cas;
use test_support::proxy::{LinkProxy, Plan};
use vm_memory::{Bytes, GuestAddress};

const VCPUS: u32 = 3;
/// Pages each writing vCPU rewrites: 16 MiB each.
const PAGES: u64 = 4096;

/// Whether the test can run: KVM, and `userfaultfd(2)` (a visible skip
/// where it is refused).
fn can_run(test: &str) -> bool {
    kvm_available(test)
        && match userfaultfd_available() {
            Ok(()) => true,
            Err(e) => common::skip(test, &format!("userfaultfd(2) is refused here: {e}")),
        }
}

/// The `migrate` guest writing flat out over 16 MiB on each of two vCPUs
/// (a third only computes), 300 ms once the move ended: no pre-copy round
/// fits a 5 ms downtime.
fn flat_out() -> VmConfig {
    let ms = lapic_timer::TscClock::shared().tsc_khz();
    let mut config = VmConfig {
        vcpus: VCPUS,
        mem_mib: 128,
        irqchip: Irqchip::Kernel,
        timeout: Some(Duration::from_secs(120)),
        ..VmConfig::default()
    };
    config.params[..6].copy_from_slice(&[PAGES, 300 * ms, 0, ms, 1, 2]);
    config
}

fn options(postcopy: Postcopy) -> MigrateOptions {
    MigrateOptions {
        backend: DirtyLogBackend::Manual,
        after: Duration::from_millis(100),
        downtime: Duration::from_millis(5),
        // Hybrid hands over at the second round at the latest: a later
        // round, of pages a starved writer barely dirtied, could fit the
        // downtime and end the move in pre-copy.
        max_rounds: 2,
        postcopy,
        ..MigrateOptions::default()
    }
}

fn tcp() -> Address {
    "tcp:127.0.0.1:0".parse().unwrap()
}

/// The guest's own checks passed at the destination: each writer checked
/// its pages (a page lost or stale fails the run).
fn assert_checked(report: &RunReport, what: &str) {
    assert!(report.vcpus.iter().all(|v| v.finished), "{what}: {report}");
    for vcpu in 0..2 {
        assert_eq!(
            report.value(vcpu, "pages_checked"),
            Some(PAGES),
            "{what}: {report}"
        );
    }
}

/// A move in post-copy: unthrottled, the destination fetched every page
/// the source sent after the hand-over.
fn assert_postcopy(moved: &Moved, what: &str) {
    let m = &moved.migration;
    assert!(m.postcopy && m.limited_rounds == 0, "{what}: {m}");
    assert!(m.postcopy_pages > 0 && m.downtime <= m.total, "{what}: {m}");
    let fetched = moved.fetched.expect("post-copy fetched");
    eprintln!("{what}: {m}\n  destination: {fetched:?}");
    assert!(
        fetched.filled >= m.postcopy_pages - m.asked_pages,
        "{what}: {fetched:?} {m}"
    );
    assert!(moved.source.handed_over, "{what}: {}", moved.source);
    assert_checked(&moved.destination, what);
}

#[test]
fn a_flat_out_writer_moves_in_postcopy_unthrottled_byte_for_byte() {
    if !can_run("a_flat_out_writer_moves_in_postcopy_unthrottled_byte_for_byte") {
        return;
    }
    let program = test_guests::find("migrate").unwrap();
    for postcopy in [Postcopy::Immediate, Postcopy::Hybrid] {
        for compare in [true, false] {
            let what = format!("{postcopy}, compared: {compare}");
            let moved = move_in_process(&flat_out(), program, options(postcopy), &tcp(), compare)
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_postcopy(&moved, &what);
            let fetched = moved.fetched.unwrap();
            match compare {
                // Read through the faults before the guest ran: each page
                // as the guest would first have seen it.
                true => assert_eq!(moved.differing, Some(0), "{what}"),
                // The guest ran at once: its vCPUs faulted on pages still
                // at the source, and each waited for its page.
                false if postcopy == Postcopy::Immediate => {
                    assert!(fetched.remote_faults > 0, "{what}: {fetched:?}");
                    assert!(
                        fetched.stall_max >= fetched.stall_p50,
                        "{what}: {fetched:?}"
                    );
                }
                false => {}
            }
            if postcopy == Postcopy::Hybrid {
                let m = &moved.migration;
                assert!(m.rounds >= 2 && !m.converged, "{what}: {m}");
            }
        }
    }
}

#[test]
fn a_guest_moves_in_postcopy_in_tls() {
    if !can_run("a_guest_moves_in_postcopy_in_tls") {
        return;
    }
    let (ca, _) = cas("postcopy");
    let files = |name: &str| {
        let f = ca.files(name, &ca);
        TlsFiles {
            cert: f.cert,
            key: f.key,
            ca: f.ca,
        }
    };
    let client = files("source.example").client().unwrap();
    let server = files("127.0.0.1")
        .server(&["source.example".into()])
        .unwrap();
    let program = test_guests::find("migrate").unwrap();
    let moved = move_in_process_tls(
        &flat_out(),
        program,
        options(Postcopy::Immediate),
        &tcp(),
        (client, server),
        false,
    )
    .unwrap();
    assert_postcopy(&moved, "tls");
}

/// The source that came to `listener`.
fn taken(listener: &Listener) -> StreamReader<Connection> {
    listener
        .accept_source(&AcceptLimits::default(), &mut |_| {})
        .unwrap()
}

/// Bytes that differ between two memories of `size` bytes, read a MiB at
/// a time (the destination's through its faults).
fn differing(a: &VmMemory, b: &VmMemory, size: u64) -> u64 {
    let (mut x, mut y) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    (0..size)
        .step_by(1 << 20)
        .map(|at| {
            a.read_slice(&mut x, GuestAddress(at)).unwrap();
            b.read_slice(&mut y, GuestAddress(at)).unwrap();
            x.iter().zip(&y).filter(|(p, q)| p != q).count() as u64
        })
        .sum()
}

/// The link goes down for 2 s once the destination has said RUNNING and
/// 16 KiB of pushes have gone (in the middle of post-copy), and comes
/// back: the source connects again, the destination tells it the pages it
/// still lacks, and the guest, waiting meanwhile, runs on with every page. Once more with the destination's memory read through
/// its faults before its guest runs (the reads wait out the cut), against
/// the source's: 0 bytes differ.
#[test]
fn a_link_cut_for_2_s_in_the_middle_of_postcopy_is_survived() {
    if !can_run("a_link_cut_for_2_s_in_the_middle_of_postcopy_is_survived") {
        return;
    }
    for compare in [false, true] {
        cut_for_2_s(compare);
    }
}

fn cut_for_2_s(compare: bool) {
    let listener = tcp().listen().unwrap();
    let Address::Tcp(at) = listener.address().unwrap() else {
        unreachable!("a tcp: listener")
    };
    let down = Duration::from_secs(2);
    // TAKEN, MADE, READY, RUNNING; then 16 KiB of pushes.
    let plan = Plan::CutAt {
        answers: 4,
        bytes: 16 << 10,
        down,
    };
    let proxy = LinkProxy::start(at, plan).unwrap();
    let options = MigrateOptions {
        resume: true,
        timeout: Duration::from_secs(60),
        ..options(Postcopy::Immediate)
    };
    let config = flat_out();
    let program = test_guests::find("migrate").unwrap();
    let mut vm = Vm::new(&config).unwrap();
    let source_memory = vm.memory();
    let destination = {
        let config = config.clone();
        thread::spawn(move || {
            let mut input = taken(&listener);
            let received = receive_from(&mut input, &config);
            let mut incoming = hand_over(input.get_mut(), received).unwrap();
            let resume = Resume {
                listener,
                limits: AcceptLimits::default(),
                within: Duration::from_secs(30),
                log: |line| eprintln!("{line}"),
            };
            let fetching = incoming
                .fetch(input, Some(resume))
                .unwrap()
                .expect("post-copy");
            let size = config.mem_mib << 20;
            let bytes = compare.then(|| differing(&source_memory, &incoming.vm.memory(), size));
            let run = incoming.vm.run(program, Box::new(std::io::sink()));
            (run.unwrap(), fetching.finish().unwrap(), bytes)
        })
    };
    let target = Target::Peer(Address::Tcp(proxy.address()));
    let migration = Migration::prepare(&mut vm, target, options).unwrap();
    let (tx, moved) = std::sync::mpsc::channel();
    vm.on_start(Box::new(move |control| {
        drop(tx.send(migration.run(control)))
    }));
    // While the link is down, a stranger comes with another move's id.
    let (source, dropped) = thread::scope(|scope| {
        let stranger = (!compare).then(|| scope.spawn(|| stranger(&proxy, at)));
        let source = vm.run(program, Box::new(std::io::sink())).unwrap();
        (source, stranger.map(|s| s.join().unwrap()))
    });
    assert_ne!(dropped, Some(false), "the stranger was heard");
    let report = moved.recv().unwrap().unwrap();
    let (run, fetched, bytes) = destination.join().unwrap();
    eprintln!("cut (compared: {compare}): {report}\n  destination: {fetched:?}");
    assert_eq!(proxy.cuts(), 1);
    assert!(report.postcopy && report.reconnects >= 1, "{report}");
    assert_eq!(fetched.reconnects, report.reconnects, "{fetched:?}");
    assert!(source.handed_over, "{source}");
    assert_eq!(bytes.unwrap_or(0), 0, "bytes differ after the cut");
    assert_checked(&run, "after the cut");
}

/// Once `proxy` has cut the link, comes to the destination at `at` with
/// another move's id; whether the destination dropped it without a word
/// past TAKEN.
fn stranger(proxy: &LinkProxy, at: SocketAddr) -> bool {
    while proxy.cuts() == 0 {
        thread::sleep(Duration::from_millis(5));
    }
    let mut sock = TcpStream::connect(at).unwrap();
    sock.write_all(&migration::stream::header()).unwrap();
    let mut taken = [0u8];
    sock.read_exact(&mut taken).unwrap();
    StreamWriter::after_header(&sock).postcopy(1).unwrap();
    let mut rest = Vec::new();
    let _ = sock.read_to_end(&mut rest);
    rest.is_empty()
}

/// Post-copy where it cannot run: to a snapshot file, refused before the
/// guest starts (no file made); to a destination that reads the stream as
/// a file would (plain `receive`), refused there, the guest running on at
/// the source to its end.
#[test]
fn postcopy_where_it_cannot_run_is_refused_and_the_guest_runs_on_at_the_source() {
    if !can_run("postcopy_where_it_cannot_run_is_refused_and_the_guest_runs_on_at_the_source") {
        return;
    }
    let config = flat_out();
    let program = test_guests::find("migrate").unwrap();
    let path = std::env::temp_dir().join(format!("postcopy-{}.snap", std::process::id()));
    let mut vm = Vm::new(&config).unwrap();
    let to_file = Migration::prepare(
        &mut vm,
        Target::File(path.clone()),
        options(Postcopy::Immediate),
    );
    assert!(matches!(to_file, Err(MigrationError::PostcopyToFile)));
    assert!(!path.exists());

    let listener = tcp().listen().unwrap();
    let address = listener.address().unwrap();
    let destination = thread::spawn({
        let config = config.clone();
        move || {
            let mut input = taken(&listener);
            let received = receive(&mut input, &config);
            hand_over(input.get_mut(), received)
                .err()
                .map(|e| e.to_string())
        }
    });
    let migration =
        Migration::prepare(&mut vm, Target::Peer(address), options(Postcopy::Immediate)).unwrap();
    let (tx, moved) = std::sync::mpsc::channel();
    vm.on_start(Box::new(move |control| {
        drop(tx.send(migration.run(control)))
    }));
    let source = vm.run(program, Box::new(std::io::sink())).unwrap();
    let refused = destination.join().unwrap().expect("refused");
    assert!(refused.contains("a post-copy stream"), "{refused}");
    match moved.recv().unwrap() {
        Err(MigrationError::Refused(why)) => assert!(why.contains("receive_from"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert!(!source.handed_over, "{source}");
    assert_checked(&source, "at the source");
}
