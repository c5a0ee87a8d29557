//! The migration stream in TLS 1.3 with both sides' certificates: a guest
//! moves byte for byte with each dirty-log backend, and every source or
//! destination that should not be trusted is refused, saying why.

#[path = "../../reference-vmm/tests/common/mod.rs"]
mod common;

use std::io::Read;
use std::thread;

use common::kvm_available;
use migration::tls::{TlsClient, TlsFiles, TlsServer};
use migration::{Address, DirtyLogBackend, MigrateOptions, move_in_process_tls};
use reference_vmm::{Irqchip, VmConfig};
use test_support::certs::{Ca, CertFiles, cas};

/// The TLS files of `files`.
fn tls(files: CertFiles) -> TlsFiles {
    TlsFiles {
        cert: files.cert,
        key: files.key,
        ca: files.ca,
    }
}

fn destination(ca: &Ca) -> TlsServer {
    tls(ca.files("127.0.0.1", ca))
        .server(&["source.example".into()])
        .unwrap()
}

fn tcp() -> Address {
    "tcp:127.0.0.1:0".parse().unwrap()
}

#[test]
fn a_guest_moves_byte_for_byte_in_tls_with_each_backend() {
    if !kvm_available("a_guest_moves_byte_for_byte_in_tls_with_each_backend") {
        return;
    }
    let (ours, _) = cas("moves");
    let client = tls(ours.files("source.example", &ours)).client().unwrap();
    for backend in [
        DirtyLogBackend::Bitmap,
        DirtyLogBackend::Manual,
        DirtyLogBackend::Ring,
    ] {
        let options = MigrateOptions {
            backend,
            after: std::time::Duration::from_millis(50),
            ..MigrateOptions::default()
        };
        let mut config = VmConfig {
            vcpus: 2,
            mem_mib: 64,
            irqchip: Irqchip::Kernel,
            dirty_ring: options.dirty_ring(),
            ..VmConfig::default()
        };
        let ms = lapic_timer::TscClock::shared().tsc_khz();
        config.params[..5].copy_from_slice(&[256, 200 * ms, ms / 100, ms, 1]);
        let program = test_guests::find("migrate").unwrap();
        let tls = (client.clone(), destination(&ours));
        let moved = move_in_process_tls(&config, program, options, &tcp(), tls, true).unwrap();
        assert_eq!(moved.differing, Some(0), "{backend:?}: {}", moved.migration);
        assert!(
            moved.destination.vcpus.iter().all(|v| v.finished),
            "{backend:?}"
        );
    }
}

/// Accepts one connection on `listener` in a thread: what it made of it.
fn accept_one(listener: migration::Listener) -> thread::JoinHandle<Result<(), String>> {
    thread::spawn(move || {
        let mut source = listener.accept().map_err(|e| e.to_string())?;
        // An accepted source: read what it sends until it hangs up.
        let mut rest = Vec::new();
        let _ = source.get_mut().read_to_end(&mut rest);
        Ok(())
    })
}

#[test]
fn sources_and_destinations_not_trusted_are_refused_saying_why() {
    let (ours, other) = cas("refused");
    let listen = || tcp().listen_tls(destination(&ours)).unwrap();
    let connect = |client: &TlsClient| {
        let listener = listen();
        let address = listener.address().unwrap();
        let accepted = accept_one(listener);
        let connected = address.connect_tls(client).map(|_| ());
        (connected, accepted.join().unwrap())
    };
    // The allowed source, signed by our CA.
    let allowed = tls(ours.files("source.example", &ours)).client().unwrap();
    let (source, destination_side) = connect(&allowed);
    assert!(
        source.is_ok() && destination_side.is_ok(),
        "{source:?} {destination_side:?}"
    );
    // Refused: what the source is told, and what the destination says.
    let refused = |client: &TlsClient| match connect(client) {
        (Err(source), Err(destination)) => (source.to_string(), destination),
        other => panic!("not refused: {other:?}"),
    };
    // A name not allowed: the source is told which of its names, the
    // destination's log says which it allows.
    let intruder = tls(ours.files("intruder.example", &ours)).client().unwrap();
    let (source, destination_side) = refused(&intruder);
    let told = "does not allow a source whose certificate is for intruder.example";
    assert!(source.contains(told), "{source}");
    assert!(
        !source.contains("source.example"),
        "the allowed names stay: {source}"
    );
    let logged = "intruder.example (it allows source.example)";
    assert!(destination_side.contains(logged), "{destination_side}");
    // A certificate another CA signed: refused in the handshake.
    let foreign = tls(other.files("source.example", &ours)).client().unwrap();
    let (source, destination_side) = refused(&foreign);
    assert!(
        source.contains("refused this side's certificate"),
        "{source}"
    );
    let logged = "the source's certificate";
    assert!(destination_side.contains(logged), "{destination_side}");
    // A source that trusts another CA refuses our destination.
    let wary = tls(ours.files("source.example", &other)).client().unwrap();
    let (source, _) = connect(&wary);
    let source = source.unwrap_err().to_string();
    assert!(source.contains("the destination's certificate"), "{source}");
    // A source that expects another name on the destination's certificate.
    let elsewhere = tls(ours.files("source.example", &ours))
        .client()
        .unwrap()
        .with_server_name("elsewhere.example")
        .unwrap();
    let (source, _) = connect(&elsewhere);
    let source = source.unwrap_err().to_string();
    assert!(source.contains("the destination's certificate"), "{source}");
    assert!(allowed.clone().with_server_name("not a name!").is_err());
    // A plaintext source gets a plaintext refusal.
    let listener = listen();
    let address = listener.address().unwrap();
    let accepted = accept_one(listener);
    let refusal = address.connect().unwrap_err().to_string();
    assert_eq!(
        refusal,
        "the destination turned this source away: this destination takes TLS sources only"
    );
    let refused = accepted.join().unwrap().unwrap_err();
    assert!(refused.contains("does not speak TLS"), "{refused}");
}

#[test]
fn a_tls_source_against_a_plaintext_destination_is_told_so() {
    let (ours, _) = cas("plaintext");
    let listener = tcp().listen().unwrap();
    let address = listener.address().unwrap();
    // A TLS ClientHello is no stream header: the destination says so, in
    // plain text.
    let destination =
        thread::spawn(move || listener.accept().map(|_| ()).map_err(|e| e.to_string()));
    let client = tls(ours.files("source.example", &ours)).client().unwrap();
    let e = address.connect_tls(&client).unwrap_err().to_string();
    assert!(e.contains("does not speak TLS"), "{e}");
    let refused = destination.join().unwrap().unwrap_err();
    assert!(
        refused.contains("not a reference-vmm migration stream"),
        "{refused}"
    );
}

#[test]
fn tls_files_that_cannot_be_used_are_named() {
    let (ours, _) = cas("files");
    let good = tls(ours.files("source.example", &ours));
    let missing = TlsFiles {
        key: good.key.with_extension("nope"),
        ..good.clone()
    };
    let e = missing.client().unwrap_err().to_string();
    assert!(
        e.contains("cannot read the private key") && e.contains(".nope"),
        "{e}"
    );
    let not_a_cert = TlsFiles {
        cert: good.key.clone(),
        ..good.clone()
    };
    let e = not_a_cert.client().unwrap_err().to_string();
    assert!(e.contains("holds no certificate"), "{e}");
    let e = good.server(&[]).unwrap_err().to_string();
    assert!(e.contains("--tls-allow"), "{e}");
    let unix: Address = "unix:/tmp/x.sock".parse().unwrap();
    let e = unix
        .connect_tls(&good.client().unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("TLS is for tcp"), "{e}");
}
